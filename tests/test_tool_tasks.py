"""The synthetic tool task: tools only they can answer, families and their meta, and imperfect demonstrations."""

from __future__ import annotations

import collections
import json

from posttrain_core.data import synthetic
from posttrain_core.data.tool_tasks import TOOLS, calc, lookup
from posttrain_core.rollout.tools import ToolBox, compact


def test_the_tools_answer_and_refuse_clearly():
    assert lookup("kqz") == lookup("kqz") and 100 <= int(lookup("kqz")) <= 999
    assert lookup("KQZ").startswith("Error: no key") and lookup("kq").startswith("Error: no key")
    assert calc(347, "*", 582) == str(347 * 582) and calc(3, "-", 5) == "-2"
    assert calc(1, "/", 2).startswith("Error: unknown operator")
    # a code cannot be guessed: over 2,000 keys no code covers even 1% of them
    codes = collections.Counter(lookup(f"{a}{b}{c}") for a in "abcdefghij" for b in "abcdefghij" for c in "abcdefghij")
    assert codes.most_common(1)[0][1] < 10


def test_the_shipped_tools_load_by_reference_and_take_compact_calls():
    box = ToolBox(TOOLS)
    assert [s["function"]["name"] for s in box.schemas] == ["lookup", "calc"]
    [result] = box.call_all(compact("<tool_call>calc 347 * 582</tool_call>"), timeout_s=5)
    assert (result.status, result.content) == ("ok", str(347 * 582))


def test_tool_families_their_meta_and_demonstrations():
    problems = synthetic.make_problems(["lookup", "calc"], n=600, seed=0)
    kinds = collections.Counter(p.family for p in problems)
    assert kinds["lookup"] == 300 and kinds["calc"] + kinds["calc-easy"] == 300 and kinds["calc-easy"] > 100
    prompts = synthetic.prompts_table(problems).to_pylist()
    needs = {json.loads(r["meta"])["family"]: json.loads(r["meta"])["needs_tool"] for r in prompts}
    assert needs == {"lookup": True, "calc": True, "calc-easy": False}
    chats = synthetic.sft_table(problems).column("messages").to_pylist()
    for p, chat in zip(problems, chats, strict=True):
        if p.family == "calc-easy":  # answered in the head
            assert [m["role"] for m in chat] == ["user", "assistant"] and chat[1]["content"].endswith(p.answer)
        else:  # call, the tool's result, the answer
            assert [m["role"] for m in chat] == ["user", "assistant", "tool", "assistant"]
            assert chat[2]["content"] == p.answer and chat[3]["content"] == f"The answer is {p.answer}"


def test_imperfect_demonstrations_skip_mangle_or_call_needlessly():
    problems = synthetic.make_problems(["lookup", "calc"], n=2000, seed=0)
    shown = synthetic.with_slips(problems, 0.3, 2, seed=0)
    assert [p.answer for p in shown] == [p.answer for p in problems]  # only the demonstration changes
    changed = [(p, q) for p, q in zip(problems, shown, strict=True) if p.demo != q.demo]
    assert 0.25 < len(changed) / len(problems) < 0.35
    how = collections.Counter()
    for p, q in changed:
        texts = [text for _, text in q.demo]
        if p.family == "calc-easy":
            how["needless"] += texts[0].startswith("<tool_call>") and texts[-1].endswith(p.answer)
        elif len(texts) == 1:
            how["skipped"] += not texts[0].endswith(p.answer)
        else:
            how["mangled"] += texts[1] != p.answer and texts[0] != p.demo[0][1]
    assert min(how.values()) > 50 and sum(how.values()) == len(changed), how
    assert synthetic.with_slips(problems, 0.3, 2, seed=0) == shown  # the same mistakes every time
