"""The pieces of `posttrain serve` without the service: the wire format against the SDK's own converters, the
losses' input checks, the journal across a restart, API keys, and the adapter pool's eviction."""

from __future__ import annotations

import numpy as np
import pytest
import torch

tinker = pytest.importorskip("tinker")
from tinker import types  # noqa: E402


def test_forward_backward_wire_round_trip_through_the_sdk_converters():
    from tinker.proto.request_conv import forward_backward_request_to_proto
    from tinker.proto.response_conv import deserialize_forward_backward_output, deserialize_sample_response

    from posttrain_core.serve.wire import decode_forward_backward, encode_forward_backward, encode_sample

    data = [types.Datum(model_input=types.ModelInput.from_ints([5, 6, 7]),
                        loss_fn_inputs={"target_tokens": [6, 7, 8], "weights": [0.0, 1.0, 1.0]}),
            types.Datum(model_input=types.ModelInput.from_ints([9, 10]),
                        loss_fn_inputs={"target_tokens": [10, 11], "advantages": [0.5, -0.5]})]  # fmt: skip
    request = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(data=data, loss_fn="ppo", loss_fn_config={"clip_low_threshold": 0.7}),
        model_id="s1:train:0", seq_id=3,
    )  # fmt: skip
    fb = decode_forward_backward(forward_backward_request_to_proto(request).SerializeToString())
    assert (fb.model_id, fb.seq_id, fb.loss_fn, fb.loss_config) == ("s1:train:0", 3, "ppo", {"clip_low_threshold": 0.7})
    assert [d.tokens for d in fb.data] == [[5, 6, 7], [9, 10]]
    assert fb.data[0].inputs["target_tokens"].dtype == np.int64 and fb.data[1].inputs["advantages"].tolist() == [
        0.5,
        -0.5,
    ]

    outputs = [{"logprobs": np.array([-1.0, -2.0, -3.0])}, {"logprobs": np.array([-0.5, -0.25])}]
    back = deserialize_forward_backward_output(encode_forward_backward(outputs, {"loss:sum": 4.5}))
    assert back.metrics == {"loss:sum": 4.5}
    assert [o["logprobs"].to_numpy().tolist() for o in back.loss_fn_outputs] == [[-1.0, -2.0, -3.0], [-0.5, -0.25]]

    sample = deserialize_sample_response(
        encode_sample([{"tokens": [1, 2], "logprobs": [-0.1, -0.2], "stop_reason": "stop"}], [None, -1.5])
    )
    assert sample.sequences[0].tokens == [1, 2] and sample.sequences[0].stop_reason == "stop"
    assert np.allclose(sample.sequences[0].logprobs, [-0.1, -0.2]) and sample.prompt_logprobs[0] is None


def test_a_malformed_body_or_datum_is_a_user_error_naming_it():
    from posttrain_core.serve.losses import check_datum
    from posttrain_core.serve.wire import Datum, UserError, decode_forward_backward

    with pytest.raises(UserError, match="not a protobuf ForwardBackwardRequest"):
        decode_forward_backward(b"\xff\xff\xff")
    ok = {"target_tokens": np.array([2, 3])}
    check_datum("cross_entropy", Datum([1, 2], ok), 0, vocab_size=10, max_length=8)
    cases = [
        ("nope", Datum([1, 2], ok), "loss_fn: unknown loss 'nope'"),
        ("cross_entropy", Datum([1, 2], {}), r"data\[4\].loss_fn_inputs: cross_entropy needs 'target_tokens'"),
        ("ppo", Datum([1, 2], ok), "ppo needs 'logprobs'"),
        ("cross_entropy", Datum([1, 2], {**ok, "weights": np.ones(3)}), "'weights'.*3 values for 2 input tokens"),
        ("cross_entropy", Datum([1, 12], ok), r"data\[4\].model_input: token id 12 is outside"),
        ("cross_entropy", Datum(list(range(9)), {"target_tokens": np.zeros(9)}), "exceed the base model's context"),
    ]
    for loss, datum, message in cases:
        with pytest.raises(UserError, match=message):
            check_datum(loss, datum, 4, vocab_size=10, max_length=8)


def test_losses_are_sums_over_tokens():
    from posttrain_core.serve.losses import token_losses
    from posttrain_core.serve.wire import Datum

    logp = torch.tensor([-1.0, -2.0, -0.5])
    ce = token_losses("cross_entropy", logp, Datum([0, 0, 0], {"weights": np.array([0.0, 1.0, 1.0])}), {})
    assert ce.sum().item() == pytest.approx(2.5)
    inputs = {"logprobs": np.array([-1.0, -1.0, -1.0]), "advantages": np.array([1.0, 1.0, -1.0])}
    ratio = torch.exp(logp + 1.0)  # e^0, e^-1, e^0.5
    assert token_losses("importance_sampling", logp, Datum([0] * 3, inputs), {}).tolist() == pytest.approx(
        (-ratio * torch.tensor([1.0, 1.0, -1.0])).tolist()
    )
    ppo = token_losses("ppo", logp, Datum([0] * 3, inputs), {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1})
    # r=1 -> -1; r=0.37 with A>0 -> min(0.37, 0.9) -> -0.37; r=1.65 with A<0 -> min(-1.65, -1.1) -> 1.65
    assert ppo.tolist() == pytest.approx([-1.0, -ratio[1].item(), ratio[2].item()])


def test_the_journal_tells_the_truth_after_a_restart(tmp_path):
    from posttrain_core.serve.state import LOST, Journal
    from posttrain_core.serve.wire import UserError

    first = Journal(tmp_path / "j.sqlite")
    first.add_session("s1", "alice")
    first.add_model("s1:train:0", "alice", "s1", "base", "t1", 8)
    first.add_future("r-done", "alice", "save:s1:train:0:3", "save_weights")
    first.finish_future("r-done", {"result": {"path": "tinker://s1:train:0/weights/a"}})
    first.add_future("r-bytes", "alice", "fb:1", "forward_backward")
    first.finish_future("r-bytes", {"result": b"proto"})
    first.add_future("r-running", "alice", "fb:2", "forward_backward")
    assert first.model("s1:train:0", "alice")["adapter"] == "t1"

    again = Journal(tmp_path / "j.sqlite")  # the restarted service
    assert again.epoch == first.epoch + 1 and again.session_open("s1", "alice")
    assert again.past_future("r-done", "alice") == {"result": {"path": "tinker://s1:train:0/weights/a"}}
    assert again.past_future("r-running", "alice") == again.past_future("r-bytes", "alice") == {
        "error": LOST, "category": "server"}  # fmt: skip
    assert again.past_future("r-done", "bob") is None and again.find_future("fb:2", "alice") == "r-running"
    with pytest.raises(LookupError, match="lost its unsaved state"):
        again.model("s1:train:0", "alice")
    with pytest.raises(UserError, match="no model"):
        again.model("s1:train:0", "bob")


def test_api_keys_from_a_file_or_the_environment(tmp_path, monkeypatch):
    from posttrain_core.serve.app import KEYS_ENV, ServeConfig, read_keys

    monkeypatch.delenv(KEYS_ENV, raising=False)
    config = ServeConfig(base_models={"b": "/x"})
    assert read_keys(config) is None  # open: any tml- key is its own tenant
    monkeypatch.setenv(KEYS_ENV, "tml-a=alice, tml-b=bob")
    assert read_keys(config) == {"tml-a": "alice", "tml-b": "bob"}
    keys = tmp_path / "keys.txt"
    keys.write_text("# team keys\ntml-c carol\n\nsk-d dave\n")
    with pytest.raises(ValueError, match=r"keys.txt:4: expected `tml-KEY TENANT`"):
        read_keys(config.model_copy(update={"keys_file": str(keys)}))


def test_eviction_keeps_weights_optimizer_and_pending_gradients_bit_exact(tmp_path):
    """The same steps on two adapters in a pool of 1 slot (every switch evicts, often with gradients pending) and in
    a pool of 2 (no eviction) end in the same weights, bit for bit."""
    import copy

    from posttrain_core.models.tiny import build_tiny_model
    from posttrain_core.serve.adapters import LoraPool, spec_from_request

    torch.manual_seed(0)
    model = build_tiny_model(vocab_size=64, hidden_size=64, num_layers=1, num_heads=2, num_kv_heads=1).eval()
    pools = [LoraPool(copy.deepcopy(model), n, tmp_path / f"spill{n}") for n in (1, 2)]
    ids = torch.randint(0, 64, (2, 6))
    for pool in pools:
        spec = spec_from_request({"rank": 4, "seed": 3}, 8, pool.linear_names)
        pool.create("ta", spec)
        pool.create("tb", spec_from_request({"rank": 2}, 8, pool.linear_names))
        for name in ("ta", "tb", "ta", "tb", "ta"):  # a forward/backward, then (every other time) the step
            pool.ensure([name])
            logits = pool.model(input_ids=ids, adapter_names=[name, "__base__"]).logits
            logits.float().log_softmax(-1)[..., 0].sum().backward()
            if name == "ta":
                pool.optim_step("ta", {"learning_rate": 1e-2})
        pool.optim_step("tb", {"learning_rate": 1e-2})
    assert pools[0].evictions >= 4 and pools[1].evictions == 0
    for name in ("ta", "tb"):
        for pool in pools:
            pool.ensure([name])
        spilled, kept = (pool._params(name) for pool in pools)
        assert spilled.keys() == kept.keys()
        for k in kept:
            assert torch.equal(spilled[k], kept[k]), (name, k)
