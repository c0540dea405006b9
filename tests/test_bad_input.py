"""Bad input fails early, names the file/line/field at fault, starts no Ray work and leaves the store unchanged."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent(
    """
    import json, sys
    from posttrain_core.env import apply_defaults; apply_defaults()
    import ray
    from posttrain_core.artifacts import ArtifactStore
    from posttrain_core.config import DataConfig, ModelConfig, SFTFlowConfig
    from posttrain_core.data.prepare import run_prepare_data
    from posttrain_core.models.build import run_build_model

    store = ArtifactStore(sys.argv[1])
    cases = json.loads(sys.argv[2])
    out = {}
    for name, case in cases.items():
        try:
            if case["stage"] == "data":
                run_prepare_data(DataConfig(**case["cfg"]), store)
            else:
                run_build_model(ModelConfig(**case["cfg"]), None, store)
            out[name] = None
        except Exception as e:
            out[name] = f"{type(e).__name__}: {e}"
    out["_artifacts"] = len(store.list())
    out["_ray_started"] = ray.is_initialized()
    print("RESULT" + json.dumps(out))
    """
)


def test_bad_inputs_fail_before_any_work(tmp_path):
    good = json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]})
    malformed = tmp_path / "malformed.jsonl"
    malformed.write_text("\n".join([good, good, '{"messages": [ broken', good]) + "\n")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    no_role = tmp_path / "no_assistant.jsonl"
    no_role.write_text(json.dumps({"messages": [{"role": "user", "content": "only a question"}]}) + "\n")
    cases = {
        "malformed": {"stage": "data", "cfg": {"train_path": str(malformed), "n_eval": 1}},
        "empty": {"stage": "data", "cfg": {"train_path": str(empty), "n_eval": 1}},
        "no_assistant": {"stage": "data", "cfg": {"train_path": str(no_role), "n_eval": 1}},
        "missing_file": {"stage": "data", "cfg": {"train_path": str(tmp_path / "nope.jsonl")}},
        "missing_model": {"stage": "model", "cfg": {"path": str(tmp_path / "no-such-model")}},
        "not_a_model": {"stage": "model", "cfg": {"path": str(tmp_path)}},
    }
    store_root = tmp_path / "store"
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(store_root), json.dumps(cases)], capture_output=True, text=True, timeout=300
    )
    line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT")]
    assert line, proc.stderr[-3000:]
    out = json.loads(line[0][len("RESULT") :])

    assert "malformed.jsonl line 3" in out["malformed"] and "invalid JSON" in out["malformed"]
    assert "empty.jsonl" in out["empty"] and "no rows" in out["empty"]
    assert "no_assistant.jsonl line 1" in out["no_assistant"] and "no assistant message" in out["no_assistant"]
    assert out["missing_file"].startswith("FileNotFoundError") and "nope.jsonl" in out["missing_file"]
    assert out["missing_model"].startswith("FileNotFoundError") and "no-such-model" in out["missing_model"]
    assert "config.json" in out["not_a_model"]
    assert out["_artifacts"] == 0
    assert out["_ray_started"] is False


def test_bad_config_is_rejected_with_the_field_named():
    import pytest
    from pydantic import ValidationError

    from posttrain_core.config import SFTConfig

    with pytest.raises(ValidationError, match="global_batch_size"):
        SFTConfig(global_batch_size=30, micro_batch_size=8, num_workers=2)
    with pytest.raises(ValidationError, match="max_steps"):
        SFTConfig(max_steps=0)


def test_max_seq_len_beyond_the_model_context_fails_before_ray(tiny_inputs):
    import pytest

    from posttrain_core.config import SFTConfig
    from posttrain_core.train.sft import validate_inputs

    store, data, base = tiny_inputs
    with pytest.raises(ValueError, match="max_seq_len=4096 exceeds"):
        validate_inputs("sft", SFTConfig(max_seq_len=4096), data.sft, base)
    with pytest.raises(ValueError, match="must be a 'sft' dataset"):
        validate_inputs("sft", SFTConfig(), data.text, base)
