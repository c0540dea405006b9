"""Start and stop a real `posttrain serve` (the CLI, in its own process group) for the tinker SDK tests."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from posttrain_core.serve.process import ServiceProcess

BASE = "posttrain/tiny"
BASE_B = "posttrain/tiny-b"  # the same tiny model as a second base: a worker of its own
KEYS = {"tml-test-a": "alice", "tml-test-b": "bob", "tml-test-c": "carol"}

# The endpoints docs/serve.md documents: (method, route, content type of the body).
DOCUMENTED = {
    ("POST", "/api/v1/client/config", "application/json"),
    ("POST", "/api/v1/client/dynamic_config", "application/json"),
    ("POST", "/api/v1/create_session", "application/json"),
    ("POST", "/api/v1/session_heartbeat", "application/json"),
    ("POST", "/api/v1/sessions/{session_id}/finish", "application/json"),
    ("POST", "/api/v1/telemetry", "application/json"),
    ("GET", "/api/v1/get_server_capabilities", ""),
    ("GET", "/api/v1/healthz", ""),
    ("POST", "/api/v1/create_model", "application/json"),
    ("POST", "/api/v1/get_info", "application/json"),
    ("POST", "/api/v1/forward_backward", "application/x-protobuf"),
    ("POST", "/api/v1/optim_step", "application/json"),
    ("POST", "/api/v1/save_weights", "application/json"),
    ("POST", "/api/v1/save_weights_for_sampler", "application/json"),
    ("POST", "/api/v1/load_weights", "application/json"),
    ("POST", "/api/v1/create_sampling_session", "application/json"),
    ("GET", "/api/v1/samplers/{sampler_id}", ""),
    ("POST", "/api/v1/asample", "application/json"),
    ("POST", "/api/v1/retrieve_future", "application/json"),
    ("GET", "/api/v1/posttrain/status", ""),
}


def start_service(base_path: Path, store: Path, state_dir: Path, log: Path, **flags) -> ServiceProcess:
    """The tests' service: the tiny base as `posttrain/tiny` and `posttrain/tiny-b` (two workers), the three test
    keys, max_loras 2, max_queued 8, 4 GiB of memory."""
    flags = {"max_loras": 2, "max_queued": 8, "memory_gb": 4, **flags}
    return ServiceProcess(BASE, base_path, store, state_dir, log, KEYS, more_bases={BASE_B: base_path}, **flags)


def datum(tokenizer, text: str):
    """A next-token datum: input = ids[:-1], target = ids[1:], loss on all but the first two targets."""
    from tinker import types

    ids = tokenizer.encode(text)
    weights = [0.0] * 2 + [1.0] * (len(ids) - 3)
    return types.Datum(
        model_input=types.ModelInput.from_ints(ids[:-1]), loss_fn_inputs={"target_tokens": ids[1:], "weights": weights}
    )


def mean_nll(result, batch) -> float:
    """What the cookbook computes: -sum(w * logp) / sum(w) from the returned per-token log-probs."""
    logp = np.concatenate([o["logprobs"].to_numpy() for o in result.loss_fn_outputs])
    weights = np.concatenate([d.loss_fn_inputs["weights"].to_numpy() for d in batch])
    return float(-(logp * weights).sum() / weights.sum())


def logprobs(result) -> list[np.ndarray]:
    return [o["logprobs"].to_numpy() for o in result.loss_fn_outputs]
