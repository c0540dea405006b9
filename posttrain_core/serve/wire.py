"""The tinker SDK's wire format: protobuf bodies of `forward_backward` and the results of it and of `sample`.

The SDK posts `ForwardBackwardRequest` as protobuf and accepts only protobuf `ForwardBackwardOutput` and
`SampleResponse` results; everything else is JSON. The messages come from the SDK's own generated module, so the
server speaks exactly the schema of the pinned SDK (`tests/test_serve_tinker.py` guards the rest of the contract).
Arrays on this wire are raw little-endian bytes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

PROTOBUF = "application/x-protobuf"


class UserError(ValueError):
    """A request the caller must fix (a failed future of category `user`, naming the field at fault)."""


def _pb():
    from tinker.proto import tinker_public_pb2

    return tinker_public_pb2


@dataclass
class Datum:
    """One training example: its input tokens and its loss inputs (name -> 1-D array, one value per position)."""

    tokens: list[int]
    inputs: dict[str, np.ndarray] = field(default_factory=dict)


@dataclass
class ForwardBackward:
    model_id: str
    seq_id: int
    loss_fn: str
    loss_config: dict[str, float]
    forward_only: bool
    data: list[Datum]


def _dtype(code: int, where: str) -> np.dtype:
    pb = _pb()
    known = {pb.DTYPE_FLOAT32: np.float32, pb.DTYPE_INT64: np.int64, pb.DTYPE_INT32: np.int32}
    if code not in known:
        raise UserError(f"{where}: unsupported tensor dtype {code} (send float32 or int64)")
    return np.dtype(known[code])


def _tensor(msg: Any, where: str) -> np.ndarray:
    """A proto Tensor (dense, or sparse CSR) as a dense numpy array of its declared shape."""
    dtype = _dtype(msg.dtype, where)
    shape = list(msg.shape)
    if msg.HasField("sparse_csr"):
        values = np.frombuffer(msg.sparse_csr.values, dtype=dtype)
        crow = np.frombuffer(msg.sparse_csr.crow_indices, dtype=np.int64)
        col = np.frombuffer(msg.sparse_csr.col_indices, dtype=np.int64)
        if len(shape) != 2 or len(crow) != shape[0] + 1 or len(col) != len(values):
            raise UserError(f"{where}: malformed sparse tensor (shape {shape}, {len(crow)} row pointers)")
        dense = np.zeros(shape, dtype=dtype)
        rows = np.repeat(np.arange(shape[0]), np.diff(crow))
        dense[rows, col] = values
        return dense
    if len(msg.dense) % dtype.itemsize:
        raise UserError(f"{where}: {len(msg.dense)} bytes is not a whole number of {dtype} values")
    array = np.frombuffer(msg.dense, dtype=dtype)
    if shape and int(np.prod(shape)) != array.size:
        raise UserError(f"{where}: shape {shape} does not match its {array.size} values")
    return array.reshape(shape) if shape else array


def decode_forward_backward(body: bytes) -> ForwardBackward:
    """Parse a protobuf `ForwardBackwardRequest`.

    Raises:
        UserError: the body is not the message, or a datum holds a non-text chunk or a malformed tensor (names
            `data[i]` and the field).
    """
    from google.protobuf.message import DecodeError

    msg = _pb().ForwardBackwardRequest()
    try:
        msg.ParseFromString(body)
    except DecodeError as e:
        raise UserError(f"forward_backward: the body is not a protobuf ForwardBackwardRequest ({e})") from None
    config = {k: float(v) for k, v in msg.loss_fn_config.items()}
    for k, v in msg.loss_fn_config_v2.items():
        if v.WhichOneof("value") == "number":
            config[k] = float(v.number)
    data = []
    for i, d in enumerate(msg.data):
        tokens: list[int] = []
        for j, chunk in enumerate(d.model_input):
            kind = chunk.WhichOneof("chunk")
            if kind != "encoded_text":
                raise UserError(f"data[{i}].model_input.chunks[{j}]: {kind} chunks are not supported (text only)")
            tokens += np.frombuffer(chunk.encoded_text.tokens, dtype=np.int32).tolist()
        inputs = {
            name: _tensor(t, f"data[{i}].loss_fn_inputs[{name!r}]").reshape(-1) for name, t in d.loss_fn_inputs.items()
        }
        data.append(Datum(tokens, inputs))
    return ForwardBackward(msg.model_id, int(msg.seq_id), msg.loss_fn, config, bool(msg.forward_only), data)


def encode_forward_backward(outputs: list[dict[str, np.ndarray]], metrics: dict[str, float]) -> bytes:
    """`ForwardBackwardOutput`: per-datum float32 arrays (same fields for every datum) batched into one record."""
    pb = _pb()
    msg = pb.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord")
    for k, v in metrics.items():
        msg.metrics[k] = float(v)
    record = msg.loss_fn_outputs.add(num_datums=len(outputs))
    for name in outputs[0] if outputs else ():
        arrays = [np.asarray(o[name], dtype=np.float32).reshape(-1) for o in outputs]
        offsets = np.concatenate([[0], np.cumsum([a.nbytes for a in arrays])]).astype(np.int64)
        record.fields[name].data = b"".join(a.tobytes() for a in arrays)
        record.fields[name].offsets = offsets.tobytes()
        record.fields[name].dtype = pb.DTYPE_FLOAT32
    return msg.SerializeToString()


def encode_sample(sequences: list[dict[str, Any]], prompt_logprobs: list[float | None] | None) -> bytes:
    """`SampleResponse`: each sequence's tokens (int32), log-probs (float32) and stop reason; prompt log-probs with
    NaN where there is none (position 0)."""
    pb = _pb()
    msg = pb.SampleResponse()
    for s in sequences:
        msg.sequences.add(
            stop_reason=pb.STOP_REASON_STOP if s["stop_reason"] == "stop" else pb.STOP_REASON_LENGTH,
            tokens=np.asarray(s["tokens"], dtype=np.int32).tobytes(),
            logprobs=np.asarray(s["logprobs"], dtype=np.float32).tobytes(),
        )
    if prompt_logprobs is not None:
        values = [np.nan if v is None else v for v in prompt_logprobs]
        msg.prompt_logprobs = np.asarray(values, dtype=np.float32).tobytes()
    return msg.SerializeToString()


def json_tokens(model_input: Any, where: str) -> list[int]:
    """The tokens of a JSON `ModelInput` (`{"chunks": [{"type": "encoded_text", "tokens": [...]}]}`)."""
    if not isinstance(model_input, dict) or not isinstance(model_input.get("chunks"), list):
        raise UserError(f"{where}: expected {{'chunks': [...]}}, got {str(model_input)[:80]!r}")
    tokens: list[int] = []
    for j, chunk in enumerate(model_input["chunks"]):
        if not isinstance(chunk, dict) or chunk.get("type") != "encoded_text":
            kind = chunk.get("type") if isinstance(chunk, dict) else type(chunk).__name__
            raise UserError(f"{where}.chunks[{j}]: {kind} chunks are not supported (text only)")
        ids = chunk.get("tokens")
        if not isinstance(ids, list) or not all(isinstance(t, int) for t in ids):
            raise UserError(f"{where}.chunks[{j}].tokens: expected a list of token ids")
        tokens += ids
    return tokens
