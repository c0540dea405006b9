"""`posttrain serve` on the real model (SmolLM2-135M-Instruct from its GGUF file) with a memory budget, driven by the
unmodified tinker SDK: batches as large as its users send stay within the budget the service was given.

The worker sizes every forward/backward pass from the budget and the model's shape; its own peak resident memory,
which the operator's status endpoint reports, is what the test holds to the budget.
"""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.slow
tinker = pytest.importorskip("tinker")
from tinker import types  # noqa: E402

MEMORY_GB = 4.0  # one worker: the process with the model (~1 GB), its adapters, one 1,000-token datum per pass
KEY = "tml-real"


@pytest.fixture(scope="module")
def service(smollm2, tmp_path_factory):
    from posttrain_core.models.gguf import smollm2_gguf
    from posttrain_core.serve.process import ServiceProcess

    store, _, _ = smollm2
    root = tmp_path_factory.mktemp("serve-real")
    srv = ServiceProcess("smol", smollm2_gguf(), Path(store.root), root / "state", root / "serve.log", {KEY: "rachel"},
                         memory_gb=MEMORY_GB, max_loras=2)  # fmt: skip
    yield srv.start(timeout=300)
    srv.stop()


def worker_status(service) -> dict:
    request = urllib.request.Request(service.url + "/api/v1/posttrain/status", headers={"X-API-Key": KEY})
    with urllib.request.urlopen(request, timeout=60) as r:
        return json.loads(r.read())["workers"]["smol"]


def batch(rng: np.random.Generator, n: int, length: int) -> list:
    """n datums of `length` random tokens of the vocabulary, next-token targets, every position weighted."""
    data = []
    for _ in range(n):
        ids = rng.integers(100, 49_000, length + 1).tolist()
        data.append(types.Datum(model_input=types.ModelInput.from_ints(ids[:-1]),
                                loss_fn_inputs={"target_tokens": ids[1:], "weights": [1.0] * length}))  # fmt: skip
    return data


def test_the_batches_users_send_stay_within_the_memory_budget(service):
    sc = tinker.ServiceClient(base_url=service.url, api_key=KEY)
    try:
        tc = sc.create_lora_training_client(base_model="smol", rank=8).result()
        rng = np.random.default_rng(0)
        budget_mb = MEMORY_GB * 1024
        assert worker_status(service)["memory_budget_mb"] == pytest.approx(budget_mb)
        # many short datums (the service once grew to 20 GB on 1,030 x 10), then long ones: either way the budget
        # cuts them into several passes (1.3k and 2k tokens here: more than one pass of a 4 GB budget holds)
        for n, length in ((128, 10), (2, 1000)):
            data = batch(rng, n, length)
            passes = worker_status(service)["fwdbwd_passes"]
            out = tc.forward_backward(data, "cross_entropy").result()
            assert len(out.loss_fn_outputs) == n and np.isfinite(out.metrics["loss:sum"])
            assert all(len(o["logprobs"].to_numpy()) == length for o in out.loss_fn_outputs)
            stats = worker_status(service)
            assert stats["fwdbwd_passes"] - passes >= 2  # the budget, not the request, decided the passes
            assert stats["peak_rss_mb"] < budget_mb, stats
        tc.optim_step(types.AdamParams(learning_rate=1e-4)).result()

        # A datum that cannot fit one pass alone is the caller's to fix: refused before any compute, naming it.
        too_long = batch(rng, 2, 8000)
        with pytest.raises(tinker.RequestFailedError) as err:
            tc.forward_backward(too_long, "cross_entropy").result()
        assert err.value.category == types.RequestErrorCategory.User, err.value
        assert "data[0] (8000 tokens)" in str(err.value) and "--memory-gb" in str(err.value)
        assert np.isfinite(tc.forward(batch(rng, 2, 16), "cross_entropy").result().metrics["loss:sum"])
        print("worker after the large batches:", {k: v for k, v in worker_status(service).items() if "mb" in k})
    finally:
        sc.close("success").result()
