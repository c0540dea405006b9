"""A crash of `posttrain serve` (kill -9) while a tenant trains: restart, the client's retries reconnect, the saved
state loads, and nothing runs twice or answers from nothing."""

from __future__ import annotations

import json
import time
import urllib.request

import numpy as np
import pytest
from serve_helpers import BASE, Server, datum, logprobs, mean_nll

pytestmark = pytest.mark.slow
tinker = pytest.importorskip("tinker")
from tinker import types  # noqa: E402

TEXTS = ["What is 12 + 7? The answer is 19.", "What is 3 + 4? The answer is 7.", "Add 25 and 5: 30.",
         "What is 40 + 2? The answer is 42."]  # fmt: skip


def unfinished(server: Server) -> int:
    request = urllib.request.Request(server.url + "/api/v1/posttrain/status", headers={"X-API-Key": "tml-test-a"})
    with urllib.request.urlopen(request, timeout=30) as r:
        return sum(json.loads(r.read())["unfinished"].values())


def wait_for(server: Server, n: int) -> None:
    deadline = time.time() + 30
    while unfinished(server) < n:
        assert time.time() < deadline, f"the service never had {n} unfinished requests"
        time.sleep(0.05)


def test_kill9_mid_run_then_restart_resumes_from_the_saved_state(tiny_inputs, tmp_path):
    _, _, base = tiny_inputs
    server = Server(base.path, tmp_path / "store", tmp_path / "state", tmp_path / "serve.log").start()
    try:
        sc = tinker.ServiceClient(base_url=server.url, api_key="tml-test-a")
        tc = sc.create_lora_training_client(base_model=BASE, rank=8).result()
        batch = [datum(tc.get_tokenizer(), t) for t in TEXTS]

        def step(client):
            client.forward_backward(batch, "cross_entropy").result()
            client.optim_step(types.AdamParams(learning_rate=5e-3)).result()

        for _ in range(3):
            step(tc)
        path = tc.save_state("before-crash").result().path
        saved = logprobs(tc.forward(batch, "cross_entropy").result())
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
        for a, b in zip(saved, logprobs(resumed.forward(batch, "cross_entropy").result()), strict=True):
            np.testing.assert_allclose(a, b, atol=1e-6)
        first = mean_nll(resumed.forward(batch, "cross_entropy").result(), batch)
        for _ in range(3):
            step(resumed)
        assert mean_nll(resumed.forward(batch, "cross_entropy").result(), batch) < first
    finally:
        server.stop()
