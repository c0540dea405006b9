"""The pieces of `posttrain serve` without the service: the wire format against the SDK's own converters, the
losses' input checks, the journal across a restart, API keys, and the adapter pool's eviction."""

from __future__ import annotations

import json

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


def test_the_services_losses_are_the_registrys_with_tinkers_definitions():
    """Each tinker loss, as the service computes it on random tensors, equals tinker's definition written out here
    and the library's registered policy loss with token-sum aggregation (1e-6), values and gradients: one training
    half for the pipeline and the service."""
    from posttrain_core.algorithms.losses import POLICY_LOSSES, LossSettings
    from posttrain_core.serve.losses import LOSSES, request_loss

    g = torch.Generator().manual_seed(0)
    B, T = 3, 7
    mask = torch.ones(B, T)
    mask[1, 5:] = 0.0  # a shorter datum, right-padded
    q = -torch.rand(B, T, generator=g) * 2  # the sampler's log-probs
    A = torch.randn(B, T, generator=g)
    w = torch.rand(B, T, generator=g)
    config = {"clip_low_threshold": 0.7, "clip_high_threshold": 1.3}
    lo, hi = 0.7, 1.3

    def tinker(name, logp):  # the losses page's definitions, summed over the datums' tokens
        r = torch.exp(logp - q)
        per_token = {
            "cross_entropy": -w * logp,
            "importance_sampling": -r * A,
            "ppo": -torch.minimum(r * A, r.clamp(lo, hi) * A),
            "cispo": -(r.detach().clamp(lo, hi) * logp * A),
        }[name]
        return (per_token * mask).sum()

    library = LossSettings(loss_agg="token-sum", clip_low=1 - lo, clip_high=hi - 1, dual_clip=None)
    for name, loss in LOSSES.items():
        logp = (q + 0.4 * torch.randn(B, T, generator=g)).requires_grad_()  # ratios of 0.3-3: some clipped
        ours = request_loss(name, config, logp, mask, {"weights": w, "logprobs": q, "advantages": A})
        (grad_ours,) = torch.autograd.grad(ours, logp)
        want = tinker(name, logp)
        (grad_want,) = torch.autograd.grad(want, logp)
        torch.testing.assert_close(ours, want, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(grad_ours, grad_want, atol=1e-6, rtol=1e-6)
        if loss.registry is not None:  # the very function the pipeline's update runs
            theirs = POLICY_LOSSES[loss.registry](logp, q, A, mask, library)[0]
            torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=1e-6)
    assert {n: LOSSES[n].registry for n in LOSSES} == {
        "cross_entropy": None, "importance_sampling": "importance_sampling", "ppo": "clip", "cispo": "cispo"}  # fmt: skip


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
    from posttrain_core.serve.config import KEYS_ENV, ServeConfig, read_keys

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
    from posttrain_core.serve.adapters import LoraPool, lora_from_request

    torch.manual_seed(0)
    model = build_tiny_model(vocab_size=64, hidden_size=64, num_layers=1, num_heads=2, num_kv_heads=1).eval()
    pools = [LoraPool(copy.deepcopy(model), n, tmp_path / f"spill{n}") for n in (1, 2)]
    ids = torch.randint(0, 64, (2, 6))
    for pool in pools:
        pool.create("ta", *lora_from_request({"rank": 4, "seed": 3}, 8, pool.linear_names))
        pool.create("tb", *lora_from_request({"rank": 2}, 8, pool.linear_names))
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


def test_every_serve_config_field_is_a_flag_of_posttrain_serve():
    """The command line is generated from `ServeConfig`: a value for every field (not its default) given as flags,
    `--store` before or after `serve`, comes back as that config; a bad value is refused naming its flag."""
    from flows.cli import DESCRIPTION, USAGE, _add_more
    from posttrain_core import cli as core_cli
    from posttrain_core.serve.config import ServeConfig, config_from_args, flag

    values = {
        "base_models": {"a": "/models/a", "b": "latest:sft"}, "host": "0.0.0.0", "port": 8123, "store": "/tmp/s",
        "state_dir": "/tmp/state", "keys_file": "/tmp/keys.txt", "max_loras": 3, "lora_alpha": 16,
        "dtype": "bfloat16", "memory_gb": 6.5, "max_queued": 9, "long_poll_s": 5.0, "threads": 2,
        "worker_resources": {"trainer": 1.0},
    }  # fmt: skip
    assert set(values) == set(ServeConfig.model_fields)  # a new field needs a value here
    for name, value in values.items():
        assert value != ServeConfig.model_fields[name].default, name
    argv: list[str] = []
    for name, value in values.items():
        if name == "base_models":
            argv += [x for k, v in value.items() for x in (flag(name), f"{k}={v}")]
        elif name != "store":
            argv += [flag(name), json.dumps(value) if isinstance(value, dict) else str(value)]
    parser = core_cli.build_parser(DESCRIPTION, core_cli.USAGE + USAGE, _add_more)
    after = config_from_args(parser.parse_args(["serve", *argv, "--store", "/tmp/s"]))
    before = config_from_args(parser.parse_args(["--store", "/tmp/s", "serve", *argv]))
    assert after == before == ServeConfig(**values)
    defaults = config_from_args(parser.parse_args(["serve", "--base-model", "a=/m"]))
    assert defaults == ServeConfig(base_models={"a": "/m"})  # the defaults are the config's, stated once
    with pytest.raises(SystemExit, match="--memory-gb"):
        config_from_args(parser.parse_args(["serve", "--base-model", "a=/m", "--memory-gb", "-1"]))
    with pytest.raises(SystemExit, match="expected NAME=PATH"):
        config_from_args(parser.parse_args(["serve", "--base-model", "nopath"]))
