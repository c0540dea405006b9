"""The real pretrained model through the pipeline: SmolLM2-135M-Instruct imported from its GGUF file, 3 LoRA SFT steps
and 2 GRPO iterations continuing the same adapter on 2 Ray workers, with the hf engine; the saved adapter, loaded
with plain peft on its base, gives the trainer's log-probs."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def real_run(smollm2, prefect_api, ray_session):
    from flows.real import real_config
    from flows.rlhf import rlhf_flow
    from posttrain_core.config import EvalConfig, LoraConfig, RolloutConfig, SFTConfig

    store = smollm2[0].root  # the model.path below (the GGUF file) is a cache hit there
    base = real_config()
    config = base.model_copy(
        update=dict(
            store=str(store),
            data=base.data.model_copy(update=dict(n_train=16, n_eval=4, n_rl_prompts=8)),
            sft=SFTConfig(
                max_steps=3, global_batch_size=4, micro_batch_size=2, num_workers=2, max_seq_len=64, lr=1e-4,
                warmup_steps=0, log_every=1, checkpoint_every=0, lora=LoraConfig(r=8, alpha=16),
            ),
            iterations=2,
            rollout=RolloutConfig(n=2, max_prompts=4, max_tokens=8, num_engines=1, batch_size=8),
            rl=base.rl.model_copy(update=dict(lora=LoraConfig(r=8, alpha=16), micro_batch_size=4, mini_batches=1)),
            eval=EvalConfig(verifier="numeric", max_new_tokens=8, num_engines=1),
            eval_samples=0,
        )
    )  # fmt: skip
    return config, rlhf_flow(config)


def test_lora_sft_then_grpo_on_the_real_model(real_run):
    from posttrain_core.artifacts import ArtifactStore

    config, result = real_run
    store = ArtifactStore(config.store)
    start, policy = store.manifest(result["start"]), store.manifest(result["policy"])
    assert start["stage"] == "sft" and start["adapter"] and start["objective"] == "sft"
    assert len(start["loss_history"]) == 3 and all(math.isfinite(x) for x in start["loss_history"])
    assert store.manifest(store.get(start["inputs"][1]["key"]))["stage"] == "import_gguf"  # the base: the GGUF's
    updates = [store.manifest(r) for r in store.list() if r.kind == "model" and store.manifest(r)["stage"] == "rl_update"]
    assert len(updates) == 2 and policy["adapter"]
    for m in updates:  # each iteration trained on 8 samples with a finite loss
        assert m["metrics"]["samples"] == 8 and math.isfinite(m["metrics"]["pg_loss"]), m["metrics"]


def test_the_saved_adapter_loaded_with_peft_gives_the_trainers_log_probs(real_run):
    """The last iteration's rows, scored by the final adapter twice: as the trainer computes log-probs (posttrain's
    loader, right-padded batch, response-only logits) and as a user would (peft on the base the adapter names, one
    unpadded row at a time)."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from posttrain_core.artifacts import ArtifactStore
    from posttrain_core.models.loading import load_causal_lm, load_tokenizer
    from posttrain_core.train.rl_batch import encode, load_batch, response_logprobs

    config, result = real_run
    store = ArtifactStore(config.store)
    policy = result["policy"]
    inputs = {i["name"]: store.get(i["key"]) for i in store.manifest(policy)["inputs"]}
    scored = [ref for name, ref in inputs.items() if name.startswith("scored")]
    batch, _ = load_batch(store, scored, inputs["policy"], config.rl.resolved())
    rows = list(range(len(batch)))
    pad_id = load_tokenizer(store.local_path(policy)).pad_token_id

    adapter = Path(store.local_path(policy))
    base_path = json.loads((adapter / "adapter_config.json").read_text())["base_model_name_or_path"]
    users = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32), adapter)
    trainer = load_causal_lm(adapter)
    ids, attn, pos, labels, _ = encode(batch, rows, pad_id)

    def one_row_at_a_time(model) -> list[torch.Tensor]:
        out = []
        with torch.no_grad():
            for b in rows:
                seq = torch.tensor([batch.prompt_ids[b] + batch.response_ids[b]])
                P, n = len(batch.prompt_ids[b]), len(batch.response_ids[b])
                logp = torch.log_softmax(model.eval()(seq).logits[0, P - 1 : P - 1 + n], -1)
                out.append(logp.gather(1, torch.tensor(batch.response_ids[b])[:, None])[:, 0])
        return out

    theirs = one_row_at_a_time(users)
    # The same computation on the two loaders' models: bit for bit the same weights.
    assert all(torch.equal(a, b) for a, b in zip(theirs, one_row_at_a_time(trainer), strict=True))
    with torch.no_grad():
        ours = response_logprobs(trainer.eval(), ids, attn, pos, labels).logp
    # The trainer's batched path: a right-padded batch and a chunked head on the response positions sum in another
    # order than one unpadded full forward; on this 30-layer model that alone moves fp32 log-probs by up to ~3e-5.
    gaps = [(t - ours[b, : len(t)]).abs().max().item() for b, t in enumerate(theirs)]
    assert max(gaps) < 5e-5, gaps
    # The engine's log-probs of the same tokens (KV-cached generation) as the update reported them.
    metrics = store.manifest(policy)["metrics"]
    assert metrics["logp_mismatch_mean"] < 1e-4 and metrics["logp_mismatch_max"] < 1e-3, metrics


def test_dpo_with_lora_on_the_real_model(session_dir, prefect_api, ray_session):
    """DPO with LoRA (reference = the base with the adapter disabled) on the synthetic preference pairs: 2 steps on
    2 Ray workers, a finite loss, and an adapter artifact on the imported base."""
    from flows.preference import PreferenceFlowConfig, preference_flow
    from flows.real import real_config
    from posttrain_core.artifacts import ArtifactStore
    from posttrain_core.config import DPOConfig, LoraConfig

    base = real_config()
    config = PreferenceFlowConfig(
        store=str(session_dir / "real-model-store"),  # the GGUF import is a cache hit from the first test
        data=base.data.model_copy(update=dict(n_train=16, n_eval=4, n_rl_prompts=8)),
        model=base.model,
        sft=None,
        reward_model=None,
        dpo=DPOConfig(
            max_steps=2, global_batch_size=4, micro_batch_size=2, num_workers=2, max_seq_len=64, warmup_steps=0,
            log_every=1, checkpoint_every=0, eval_pairs=4, lora=LoraConfig(r=8, alpha=16),
        ),
    )  # fmt: skip
    result = preference_flow(config)
    m = ArtifactStore(config.store).manifest(result["dpo"])
    assert m["adapter"] and len(m["loss_history"]) == 2 and all(math.isfinite(x) for x in m["loss_history"])
    assert 0.0 <= m["metrics"]["eval_accuracy"] <= 1.0


def test_grpo_with_lora_on_the_vllm_engine_swaps_the_adapter_in_place(real_run, vllm_or_skip):
    """The same run with the vLLM engine (CPU): iteration 2 is sampled by the iteration-1 adapter loaded into the
    running engine; the trainer's log-probs agree with vLLM's (the update reports the gap)."""
    from flows.rlhf import rlhf_flow
    from posttrain_core.artifacts import ArtifactStore

    config, _ = real_run
    rollout = config.rollout.model_copy(update={"engine": "vllm", "seed": 1})
    vllm_or_skip(rollout)
    config = config.model_copy(update={"rollout": rollout})  # SFT and the evaluation before RL: cache hits
    result = rlhf_flow(config)
    store = ArtifactStore(config.store)
    updates = {store.manifest(r)["key"]: store.manifest(r) for r in store.list() if r.kind == "model"}
    last = updates[result["policy"].key]
    first = updates[next(i["key"] for i in last["inputs"] if i["name"] == "policy")]
    assert first["stage"] == "rl_update" and last["adapter"]  # iteration 2 sampled by iteration 1's adapter
    for m in (first, last):
        assert m["metrics"]["samples"] == 8 and math.isfinite(m["metrics"]["pg_loss"])
        assert m["metrics"]["logp_mismatch_mean"] < 0.05, m["metrics"]
