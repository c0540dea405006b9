"""The library reads exactly the documented environment variables, all through `posttrain_core.env.setting`.

Nothing outside a config may change a result: an environment variable read deep in the library would be an input
that no stage key holds. So no module but env.py touches `os.environ`, every `setting(...)` names a declared setting,
and docs/operations.md documents each of them.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
EXPECTED = {
    "POSTTRAIN_STORE",
    "POSTTRAIN_CODE_VERSION",
    "POSTTRAIN_VLLM_PYTHON",
    "POSTTRAIN_MLFLOW_UI",
    "MLFLOW_TRACKING_URI",
    "RAY_ADDRESS",
    "POSTTRAIN_SERVE_KEYS",
    "POSTTRAIN_CACHE_DIR",
    "POSTTRAIN_CACHE_GB",
}


def _modules() -> list[Path]:
    return sorted(p for folder in ("posttrain_core", "flows", "tasks") for p in (REPO / folder).rglob("*.py"))


def test_the_library_reads_exactly_the_documented_settings():
    from posttrain_core.env import SETTINGS

    assert set(SETTINGS) == EXPECTED
    readers, named = [], set()
    for path in _modules():
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            touches_environ = (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id == "os"
                and node.attr in ("environ", "getenv", "putenv", "unsetenv")
            ) or (
                isinstance(node, ast.ImportFrom)
                and node.module == "os"
                and any(a.name == "environ" for a in node.names)
            )
            if touches_environ and path.name != "env.py":
                readers.append(f"{path.relative_to(REPO)}:{node.lineno}")
            if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None)) == "setting":
                arg = node.args[0] if node.args else None
                assert isinstance(arg, ast.Constant) or isinstance(arg, ast.Name), ast.dump(node)
                if isinstance(arg, ast.Constant):
                    named.add(arg.value)
    assert readers == [], f"read the environment through posttrain_core.env.setting: {readers}"
    assert named <= EXPECTED, named - EXPECTED
    assert {"POSTTRAIN_STORE", "RAY_ADDRESS", "MLFLOW_TRACKING_URI", "POSTTRAIN_VLLM_PYTHON"} <= named


def test_every_setting_is_documented():
    from posttrain_core.env import SETTINGS

    text = (REPO / "docs" / "operations.md").read_text()
    missing = [name for name in SETTINGS if f"`{name}`" not in text]
    assert not missing, f"docs/operations.md does not document {missing}"


def test_an_unknown_setting_is_refused(monkeypatch):
    import pytest

    from posttrain_core.env import setting

    monkeypatch.setenv("POSTTRAIN_STORE", "/somewhere")
    assert setting("POSTTRAIN_STORE") == "/somewhere"
    with pytest.raises(KeyError, match="POSTTRAIN_WARM_RL_WORKERS is not one of posttrain's settings"):
        setting("POSTTRAIN_WARM_RL_WORKERS")
