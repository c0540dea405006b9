"""The unmodified tinker SDK against a real `posttrain serve` on 127.0.0.1 (Ray Serve, the CLI in its own process).

One service for the module: base model = the pipeline's tiny model, max_loras = 2, max_queued = 8, three API keys
(alice, bob, carol). The tests run in file order and share alice's training client; the contract guard runs after
them, then a crash (kill -9) and restart of the service, last.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from serve_helpers import BASE, BASE_B, DOCUMENTED, datum, logprobs, mean_nll, start_service

pytestmark = pytest.mark.slow
tinker = pytest.importorskip("tinker")
from tinker import types  # noqa: E402

TEXTS_A = ["What is 12 + 7? The answer is 19.", "What is 3 + 4? The answer is 7.", "Add 25 and 5: 30.",
           "What is 40 + 2? The answer is 42."] * 2  # fmt: skip
TEXTS_B = ["Subtract 9 from 20: 11.", "What is 8 - 3? The answer is 5.", "Take 6 away from 50: 44.",
           "What is 70 - 1? The answer is 69."] * 2  # fmt: skip


def post(server, path: str, body: dict, key: str) -> tuple[int, dict]:
    request = urllib.request.Request(
        server.url + path, json.dumps(body).encode(), {"Content-Type": "application/json", "X-API-Key": key}
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as r:
            return r.status, json.loads(r.read() or b"{}")
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def status(server) -> dict:
    request = urllib.request.Request(server.url + "/api/v1/posttrain/status", headers={"X-API-Key": "tml-test-a"})
    with urllib.request.urlopen(request, timeout=60) as r:
        return json.loads(r.read())


CLIENTS: list = []  # closed before the service stops: a closed session's heartbeat gets 410 and the SDK stops it


def service_client(server, key: str):
    sc = tinker.ServiceClient(base_url=server.url, api_key=key)
    CLIENTS.append(sc)
    return sc


@pytest.fixture(scope="module")
def server(tiny_inputs, tmp_path_factory):
    store, _, base = tiny_inputs
    root = tmp_path_factory.mktemp("serve")
    srv = start_service(base.path, Path(store.root), root / "state", root / "serve.log").start()
    yield srv
    for sc in CLIENTS:
        try:
            sc.close("success").result()
        except Exception:  # noqa: S110 (already closed by its test)
            pass
    CLIENTS.clear()
    srv.stop()


@pytest.fixture(scope="module")
def alice(server):
    """Alice's session through the environment variables the docs give, and 20 supervised steps of her adapter."""
    mp = pytest.MonkeyPatch()  # the client reads them for as long as it lives: kept for the module
    mp.setenv("TINKER_BASE_URL", server.url)
    mp.setenv("TINKER_API_KEY", "tml-test-a")
    mp.setenv("TINKER_TELEMETRY", "0")
    sc = tinker.ServiceClient()
    CLIENTS.append(sc)
    tc = sc.create_lora_training_client(base_model=BASE, rank=8).result()
    tokenizer = tc.get_tokenizer()
    batch = [datum(tokenizer, t) for t in TEXTS_A]
    losses, metrics = [], []
    for _ in range(20):
        fwd = tc.forward_backward(batch, "cross_entropy")
        opt = tc.optim_step(types.AdamParams(learning_rate=5e-3))  # pipelined behind the forward_backward
        result = fwd.result()
        metrics.append((result.metrics, opt.result().metrics))
        losses.append(mean_nll(result, batch))
    yield {"sc": sc, "tc": tc, "tokenizer": tokenizer, "batch": batch, "losses": losses, "metrics": metrics}
    mp.undo()


def test_capabilities_and_supervised_loop(server, alice):
    capabilities = tinker.RestClient(base_url=server.url, api_key="tml-test-a").get_server_capabilities().result()
    assert [m.model_name for m in capabilities.supported_models] == [BASE, BASE_B]
    losses = alice["losses"]
    assert losses[-1] < 0.7 * losses[0], losses
    fwd_metrics, opt_metrics = alice["metrics"][-1]
    assert np.isfinite(fwd_metrics["loss:sum"])
    assert all(k.count(":") == 1 for k in [*fwd_metrics, *(opt_metrics or {})])
    info = alice["tc"].get_info()
    assert info.model_data.model_name == BASE and info.lora_rank == 8


def test_sampling_logprobs_match_the_trainer_and_rl_losses_train(alice):
    tc, tokenizer = alice["tc"], alice["tokenizer"]
    sampler = tc.save_weights_and_get_sampling_client().result()
    prompt_ids = tokenizer.encode("What is 12 + 7?")
    prompt = types.ModelInput.from_ints(prompt_ids)
    params = types.SamplingParams(max_tokens=8, stop=["\n"], seed=11, temperature=1.0)
    result = sampler.sample(prompt, num_samples=4, sampling_params=params).result()
    assert len(result.sequences) == 4
    assert len({s.sequence_id for s in result.sequences}) == 4
    for seq in result.sequences:
        assert len(seq.logprobs) == len(seq.tokens) <= 8 and seq.stop_reason in ("length", "stop")
    again = sampler.sample(prompt, num_samples=4, sampling_params=params).result()
    assert [s.tokens for s in again.sequences] == [s.tokens for s in result.sequences]  # same seed, same samples

    # The sampler's log-probs are the trainer's: the same adapter, the same forward.
    full = [types.Datum(model_input=types.ModelInput.from_ints((prompt_ids + s.tokens)[:-1]),
                        loss_fn_inputs={"target_tokens": (prompt_ids + s.tokens)[1:]}) for s in result.sequences]  # fmt: skip
    trainer = logprobs(tc.forward(full, "cross_entropy").result())
    for seq, lp in zip(result.sequences, trainer, strict=True):
        np.testing.assert_allclose(lp[len(prompt_ids) - 1 :], seq.logprobs, atol=1e-4)

    prompt_lp = sampler.compute_logprobs(prompt).result()
    assert len(prompt_lp) == len(prompt_ids) and prompt_lp[0] is None
    np.testing.assert_allclose(prompt_lp[1:], trainer[0][: len(prompt_ids) - 1], atol=1e-4)

    # One importance-sampling and one PPO step on those samples (prompt positions zero-padded, as rl_loop does).
    rl = []
    for seq, advantage in zip(result.sequences, [1.0, -1.0, 0.5, -0.5], strict=True):
        n_prompt, tokens = len(prompt_ids) - 1, prompt_ids + seq.tokens
        rl.append(types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs={
            "target_tokens": tokens[1:], "logprobs": [0.0] * n_prompt + list(seq.logprobs),
            "advantages": [0.0] * n_prompt + [advantage] * len(seq.tokens)}))  # fmt: skip
    for loss in ("importance_sampling", "ppo"):
        out = tc.forward_backward(rl, loss).result()
        assert np.isfinite(out.metrics["loss:sum"]) and len(out.loss_fn_outputs) == 4
        tc.optim_step(types.AdamParams(learning_rate=1e-3)).result()


@pytest.fixture(scope="module")
def saved(alice):
    return alice["tc"].save_state("s1").result().path


def test_state_round_trip_is_exact_and_checkpoints_are_artifacts(server, alice, saved, tiny_inputs, capsys):
    from posttrain_core import cli as core_cli
    from posttrain_core.config import ModelConfig
    from posttrain_core.models.build import run_build_model
    from posttrain_core.serve.checkpoints import resolve

    sc, tc, batch = alice["sc"], alice["tc"], alice["batch"]
    assert saved.startswith("tinker://") and saved.endswith("/weights/s1")
    store, _, base = tiny_inputs
    ref = resolve(store, saved)
    manifest = store.manifest(ref)
    assert manifest["stage"] == "serve" and manifest["tenant"] == "alice" and manifest["base_model"] == BASE
    assert manifest["step"] == 22 and manifest["tinker_path"] == saved
    assert [m["key"] for m in store.lineage(ref)][1] == base.key  # the base model is its input
    assert run_build_model(ModelConfig(path=saved), None, store) == ref  # what rlhf_flow's model.path resolves to
    core_cli.main(["--store", str(store.root), "artifacts", "ls", "--stage", "serve"])
    assert ref.key[:12] in capsys.readouterr().out

    resumed = sc.create_training_client_from_state_with_optimizer(saved).result()
    for client in (tc, resumed):  # the same step on both: equal only if the optimizer state came back too
        client.forward_backward(batch, "cross_entropy").result()
        client.optim_step(types.AdamParams(learning_rate=5e-3)).result()
    for a, b in zip(logprobs(tc.forward(batch, "cross_entropy").result()),
                    logprobs(resumed.forward(batch, "cross_entropy").result()), strict=True):  # fmt: skip
        np.testing.assert_allclose(a, b, atol=1e-5)

    path = tc.save_weights_for_sampler("w1").result().path
    assert "/sampler_weights/w1" in path
    sampler = sc.create_sampling_client(model_path=path).result()
    out = sampler.sample(types.ModelInput.from_ints(batch[0].model_input.to_ints()[:5]), 2,
                         types.SamplingParams(max_tokens=4)).result()  # fmt: skip
    assert len(out.sequences) == 2 and all(len(s.logprobs) == len(s.tokens) for s in out.sequences)


def test_two_tenants_train_at_once_isolated_and_the_base_sampler_is_untouched(server, alice, saved):
    bob_sc = service_client(server, "tml-test-b")
    base_sampler = bob_sc.create_sampling_client(base_model=BASE).result()
    probe = types.ModelInput.from_ints(alice["tokenizer"].encode("What is 40 + 2? The answer is 42."))
    base_before = base_sampler.compute_logprobs(probe).result()
    bob = bob_sc.create_lora_training_client(base_model=BASE, rank=4).result()
    bob_batch = [datum(alice["tokenizer"], t) for t in TEXTS_B]
    losses: dict[str, list[float]] = {"a": [], "b": []}

    def train(client, batch, out):
        for _ in range(6):
            fwd = client.forward_backward(batch, "cross_entropy")
            client.optim_step(types.AdamParams(learning_rate=5e-3)).result()
            out.append(mean_nll(fwd.result(), batch))

    threads = [threading.Thread(target=train, args=(alice["tc"], alice["batch"], losses["a"])),
               threading.Thread(target=train, args=(bob, bob_batch, losses["b"]))]  # fmt: skip
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert losses["b"][-1] < losses["b"][0] and losses["a"][-1] <= losses["a"][0] + 1e-3, losses
    stats = status(server)["workers"][BASE]
    assert stats["rounds"] > 0

    alice_now = logprobs(alice["tc"].forward(alice["batch"], "cross_entropy").result())
    train(bob, bob_batch, [])  # bob's steps do not move alice's adapter
    for a, b in zip(alice_now, logprobs(alice["tc"].forward(alice["batch"], "cross_entropy").result()), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5)
    np.testing.assert_allclose(base_sampler.compute_logprobs(probe).result()[1:], base_before[1:], atol=1e-5)

    # Bob cannot touch alice's model, checkpoint or futures: a fatal 404, never her data.
    alice_model = alice["tc"].model_id
    code, body = post(server, "/api/v1/get_info", {"model_id": alice_model, "type": "get_info"}, "tml-test-b")
    assert code == 404 and "no model" in body["detail"]
    with pytest.raises(tinker.NotFoundError):
        bob_sc.create_training_client_from_state(saved).result()
    code, _ = post(server, "/api/v1/optim_step", {"model_id": alice_model, "seq_id": 999, "adam_params": {}},
                   "tml-test-b")  # fmt: skip
    assert code == 404


def test_gradients_accumulate_across_requests_and_retries_run_once(server, alice):
    """A batch sent as two requests (as the SDK chunks large batches) trains exactly like one request: losses are
    sums. A retried submission (same model and seq_id) answers the first one's future instead of running again."""
    carol = service_client(server, "tml-test-c")
    whole, halves = (carol.create_lora_training_client(base_model=BASE, rank=4, seed=7).result() for _ in range(2))
    batch = [datum(alice["tokenizer"], t) for t in TEXTS_B[:4]]
    for _ in range(2):
        whole.forward_backward(batch, "cross_entropy").result()
        halves.forward_backward(batch[:2], "cross_entropy").result()
        halves.forward_backward(batch[2:], "cross_entropy").result()
        for client in (whole, halves):
            client.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    for a, b in zip(logprobs(whole.forward(batch, "cross_entropy").result()),
                    logprobs(halves.forward(batch, "cross_entropy").result()), strict=True):  # fmt: skip
        np.testing.assert_allclose(a, b, atol=1e-5)

    body = {"model_id": whole.model_id, "seq_id": 10**6, "adam_params": {"learning_rate": 1e-2}, "type": "optim_step"}
    first, again = (post(server, "/api/v1/optim_step", body, "tml-test-c") for _ in range(2))
    assert first[0] == again[0] == 200 and first[1]["request_id"] == again[1]["request_id"]


def test_an_adapter_beyond_max_loras_evicts_and_reloads_bit_exact(server, alice):
    before = logprobs(alice["tc"].forward(alice["batch"], "cross_entropy").result())
    evictions = status(server)["workers"][BASE]["evictions"]
    carol = service_client(server, "tml-test-c")
    clients = [carol.create_lora_training_client(base_model=BASE, rank=4, seed=s).result() for s in (1, 2)]
    batch = [datum(alice["tokenizer"], t) for t in TEXTS_B[:4]]
    first = [mean_nll(c.forward(batch, "cross_entropy").result(), batch) for c in clients]
    for _ in range(4):
        for c in clients:
            c.forward_backward(batch, "cross_entropy").result()
            c.optim_step(types.AdamParams(learning_rate=5e-3)).result()
    last = [mean_nll(c.forward(batch, "cross_entropy").result(), batch) for c in clients]
    assert all(b < a for a, b in zip(first, last, strict=True)), (first, last)
    stats = status(server)["workers"][BASE]
    assert stats["evictions"] > evictions and len(stats["resident"]) <= 2
    after = logprobs(alice["tc"].forward(alice["batch"], "cross_entropy").result())  # reloaded from disk
    for a, b in zip(before, after, strict=True):
        np.testing.assert_array_equal(a, b)


def test_bad_input_fails_as_a_user_error_naming_the_field(server, alice):
    tc, tokenizer = alice["tc"], alice["tokenizer"]
    good = datum(tokenizer, TEXTS_A[0])
    ids = good.model_input.to_ints()
    cases = {
        "outside the vocabulary": types.Datum(model_input=types.ModelInput.from_ints([*ids[:-1], 10**6]),
                                              loss_fn_inputs={"target_tokens": ids}),
        "'weights'": types.Datum(model_input=good.model_input, loss_fn_inputs={
            "target_tokens": good.loss_fn_inputs["target_tokens"].to_numpy().tolist(), "weights": [1.0]}),
    }  # fmt: skip
    for expected, bad in cases.items():
        with pytest.raises(tinker.RequestFailedError) as err:
            tc.forward_backward([good, bad], "cross_entropy").result()
        assert err.value.category == types.RequestErrorCategory.User and "data[1]" in str(err.value), err.value
        assert expected in str(err.value)
    with pytest.raises(tinker.RequestFailedError, match="importance_sampling needs 'logprobs'") as err:
        tc.forward_backward([good], "importance_sampling").result()
    assert err.value.category == types.RequestErrorCategory.User
    assert np.isfinite(tc.forward([good], "cross_entropy").result().metrics["loss:sum"])  # still serving


def test_a_full_queue_answers_429_and_the_sdk_retries(server, alice):
    sampler = alice["tc"].save_weights_and_get_sampling_client().result()
    prompt = types.ModelInput.from_ints(alice["tokenizer"].encode("What is 3 + 4?"))
    rejected = status(server)["rejected"]
    futures = [sampler.sample(prompt, 2, types.SamplingParams(max_tokens=16, seed=i)) for i in range(24)]
    results = [f.result() for f in futures]
    assert all(len(r.sequences) == 2 for r in results)
    assert status(server)["rejected"] > rejected  # max_queued = 8: the rest waited in the SDK, not the server


def test_close_ends_the_session_and_unknown_ids_are_404(server):
    sc = service_client(server, "tml-test-c")
    sc.create_lora_training_client(base_model=BASE, rank=2).result()
    session = sc.holder.get_session_id()
    assert post(server, "/api/v1/session_heartbeat", {"session_id": session, "type": "session_heartbeat"},
                "tml-test-c")[0] == 200  # fmt: skip
    sc.close("success").result()
    code, _ = post(server, "/api/v1/session_heartbeat", {"session_id": session, "type": "session_heartbeat"},
                   "tml-test-c")  # fmt: skip
    assert code == 410
    code, body = post(server, "/api/v1/retrieve_future", {"request_id": "req-unknown"}, "tml-test-c")
    assert code == 404 and "request_id" in body["detail"]
    assert post(server, "/api/v1/create_session", {}, "tml-wrong-key")[0] == 401


def test_the_eval_flow_evaluates_a_tenant_adapter(prefect_api, ray_session, saved, tiny_inputs):
    from flows.eval import EvalFlowConfig, eval_flow
    from posttrain_core.config import DataConfig, EvalConfig

    store, _, _ = tiny_inputs
    config = EvalFlowConfig(store=str(store.root), data=DataConfig(n_train=400, n_eval=32),
                            eval=EvalConfig(max_new_tokens=8, max_prompts=8), models=[saved])  # fmt: skip
    row = eval_flow(config)["rows"][0]
    assert row["model"] == saved and row["stage"] == "serve" and 0.0 <= row["accuracy"] <= 1.0


def worker(server, base: str) -> dict:
    return status(server)["workers"][base]


def test_a_killed_model_worker_costs_its_tenants_only_their_unsaved_steps(server, alice):
    """SIGKILL the model worker of one base while two tenants train on it and a third on the other base. The gateway
    answers throughout; the requests in flight fail with category server; Serve starts a new worker; a request on a
    model that lived on the old one fails naming its last saved state; both tenants reload it and train on; the other
    base's tenant never notices."""
    import os
    import signal

    tokenizer = alice["tokenizer"]
    bob_sc, carol_sc = service_client(server, "tml-test-b"), service_client(server, "tml-test-c")
    bob = bob_sc.create_lora_training_client(base_model=BASE, rank=4).result()
    carol = carol_sc.create_lora_training_client(base_model=BASE_B, rank=4).result()
    batches = {"alice": alice["batch"], "bob": [datum(tokenizer, t) for t in TEXTS_B], "carol": alice["batch"]}
    clients = {"alice": alice["tc"], "bob": bob, "carol": carol}
    saved = {name: clients[name].save_state(f"before-kill-{name}").result().path for name in ("alice", "bob")}
    carol_losses: list[float] = []
    stop, errors = threading.Event(), {}

    def train(name):
        client, batch = clients[name], batches[name]
        try:
            while not stop.is_set():
                fwd = client.forward_backward(batch, "cross_entropy")
                client.optim_step(types.AdamParams(learning_rate=5e-3)).result()
                if name == "carol":
                    carol_losses.append(mean_nll(fwd.result(), batch))
        except tinker.RequestFailedError as e:
            errors[name] = e

    threads = {name: threading.Thread(target=train, args=(name,)) for name in clients}
    for t in threads.values():
        t.start()
    old, other = worker(server, BASE), worker(server, BASE_B)["incarnation"]
    # A long sample, in flight on the worker when it dies (64 x 400 tokens, no end-of-sequence stop).
    sampler = bob.save_weights_and_get_sampling_client().result()
    slow = sampler.sample(types.ModelInput.from_ints(batches["bob"][0].model_input.to_ints()[:4]), 64,
                          types.SamplingParams(max_tokens=400, stop=[]))  # fmt: skip
    time.sleep(1.0)
    os.kill(old["pid"], signal.SIGKILL)
    deadline = time.time() + 120
    while True:  # the gateway answers while the worker is down and after it is back
        now = worker(server, BASE)
        if now.get("incarnation") not in (None, old["incarnation"]):
            break
        assert time.time() < deadline, f"no new worker for {BASE} after 120 s: {now}"
        time.sleep(0.5)
    for name in ("alice", "bob"):
        threads[name].join(timeout=60)
        assert not threads[name].is_alive() and errors[name].category == types.RequestErrorCategory.Server, name
    with pytest.raises(tinker.RequestFailedError) as err:
        slow.result()
    assert err.value.category == types.RequestErrorCategory.Server and "model worker" in str(err.value)
    for name in ("alice", "bob"):  # the next request names what to load
        with pytest.raises(tinker.RequestFailedError) as err:
            clients[name].forward(batches[name], "cross_entropy").result()
        assert err.value.category == types.RequestErrorCategory.Server
        assert "worker restarted" in str(err.value) and saved[name] in str(err.value), str(err.value)
    sc = {"alice": alice["sc"], "bob": bob_sc}
    for name in ("alice", "bob"):
        resumed = sc[name].create_training_client_from_state_with_optimizer(saved[name]).result()
        first = mean_nll(resumed.forward(batches[name], "cross_entropy").result(), batches[name])
        for _ in range(3):
            resumed.forward_backward(batches[name], "cross_entropy").result()
            resumed.optim_step(types.AdamParams(learning_rate=5e-3)).result()
        assert mean_nll(resumed.forward(batches[name], "cross_entropy").result(), batches[name]) < first, name
    stop.set()
    threads["carol"].join(timeout=60)
    assert "carol" not in errors and len(carol_losses) >= 2, (errors, carol_losses)  # the other base carried on
    assert carol_losses[-1] < carol_losses[0] and worker(server, BASE_B)["incarnation"] == other


def test_contract_every_request_the_sdk_sent_is_documented(server):
    seen = {tuple(r) for r in status(server)["routes_seen"]}
    assert {r[1] for r in seen} >= {"/api/v1/forward_backward", "/api/v1/asample", "/api/v1/retrieve_future"}
    assert seen <= DOCUMENTED, sorted(seen - DOCUMENTED)


def unfinished(server) -> int:
    return status(server)["unfinished"]


def wait_for(server, n: int) -> None:
    deadline = time.time() + 30
    while unfinished(server) < n:
        assert time.time() < deadline, f"the service never had {n} unfinished requests"
        time.sleep(0.05)


def test_kill9_mid_run_then_restart_resumes_from_the_saved_state(server, saved):
    """Last in the module: it crashes the module's service."""
    sc = service_client(server, "tml-test-a")
    tc = sc.create_lora_training_client(base_model=BASE, rank=8).result()
    batch = [datum(tc.get_tokenizer(), t) for t in TEXTS_A[:4]]

    def step(client):
        client.forward_backward(batch, "cross_entropy").result()
        client.optim_step(types.AdamParams(learning_rate=5e-3)).result()

    for _ in range(3):
        step(tc)
    path = tc.save_state("before-crash").result().path
    at_save = logprobs(tc.forward(batch, "cross_entropy").result())
    step(tc)  # unsaved work: lost in the crash, by design

    # Requests in flight at the crash: a long sample (400 tokens x 64, no end-of-sequence stop) and, queued
    # behind it, a forward_backward; both accepted, then the process is killed.
    sampler = tc.save_weights_and_get_sampling_client().result()
    prompt = types.ModelInput.from_ints(batch[0].model_input.to_ints()[:4])
    slow = sampler.sample(prompt, 64, types.SamplingParams(max_tokens=400, stop=[]))
    wait_for(server, 1)
    in_flight = tc.forward_backward(batch, "cross_entropy")
    wait_for(server, 2)
    server.kill9()
    server.start()  # same port, store and journal

    for future in (slow, in_flight):  # the SDK's polls reconnect and get the truth
        with pytest.raises(tinker.RequestFailedError) as err:
            future.result()
        assert err.value.category == types.RequestErrorCategory.Server and "restarted" in str(err.value)
    with pytest.raises(tinker.RequestFailedError) as err:
        tc.forward(batch, "cross_entropy").result()
    assert err.value.category == types.RequestErrorCategory.Server and "lost its unsaved state" in str(err.value)

    resumed = sc.create_training_client_from_state_with_optimizer(path).result()  # the same session goes on
    for a, b in zip(at_save, logprobs(resumed.forward(batch, "cross_entropy").result()), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-6)
    first = mean_nll(resumed.forward(batch, "cross_entropy").result(), batch)
    for _ in range(3):
        step(resumed)
    assert mean_nll(resumed.forward(batch, "cross_entropy").result(), batch) < first
    assert sc.create_training_client_from_state(saved).result().get_info().lora_rank == 8  # older saves too
