"""The `posttrain` store-inspection command."""

from __future__ import annotations

import json

from posttrain_core.cli import main


def test_ls_show_lineage(tiny_inputs, capsys):
    store, data, base = tiny_inputs
    assert main(["--store", str(store.root), "ls"]) == 0
    out = capsys.readouterr().out
    assert "build_model" in out and "prepare_data.sft" in out
    assert main(["--store", str(store.root), "show", base.key[:12]]) == 0
    assert json.loads(capsys.readouterr().out)["stage"] == "build_model"
    assert main(["--store", str(store.root), "lineage", base.key[:12]]) == 0
    assert capsys.readouterr().out.split() == ["build_model", base.key[:12], "prepare_data.text", data.text.key[:12]]
    assert main(["--store", str(store.root), "sweep"]) == 0
