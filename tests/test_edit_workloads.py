"""The repetitive workloads (file-edit, json-edit): multi-turn chat edits whose replies re-emit text
the conversation shows."""
import json

from draftwise.lab.edit_workloads import file_edit_candidates, json_edit_candidates
from draftwise.lab.workload import load_workload

SRC = ("import os\n\n\n"
       "def join_all(parts, sep='/'):\n    out = []\n    for p in parts:\n        out.append(p)\n"
       "    return sep.join(out)\n\n\n"
       "def split_all(path):\n    items = path.split('/')\n    items = [i for i in items if i]\n"
       "    return join_all(items, sep=',') + ' ' + path.strip().lower().upper()\n\n\n"
       "def count(path):\n    \"\"\"How many parts.\"\"\"\n    return len(split_all(path)) + len(path) * 2 - 2 + 1 - 1\n")


def test_file_edit_turns_grow_one_conversation():
    (group,) = file_edit_candidates([("pkg/paths.py", SRC)])
    assert [fid for fid, _, _ in group] == ["pkg.paths:4:rename", "pkg.paths:4:docstring", "pkg.paths:4:whole"]
    first, second, third = (msgs for _, msgs, _ in group)
    assert len(first) == 1 and second[:1] == first and third[:3] == second  # each turn extends the one before
    assert [r for r, _ in third] == ["user", "assistant", "user", "assistant", "user"]
    assert "Rename `join_all` to `join_all_v2`" in first[0][1] and "def join_all(parts" in first[0][1]
    renamed = second[1][1]
    assert "join_all" not in renamed.replace("join_all_v2", "") and renamed.count("join_all_v2") == 2
    documented = third[3][1]
    assert '    """Split all."""\n    items = path.split' in documented  # the docstring went to split_all
    assert documented.replace('    """Split all."""\n', "") == renamed
    assert all(64 <= mt <= 256 for _, _, mt in group)


def test_json_edit_flips_a_flag_then_adds_a_field():
    (group,) = json_edit_candidates([("pkg/paths.py", SRC)])
    msgs = group[-1][1]
    shown = json.loads(msgs[0][1].split("```json\n")[1].split("```")[0])
    flipped = json.loads(msgs[1][1].removeprefix("```json\n").removesuffix("```"))
    reviewed = json.loads(msgs[3][1].removeprefix("```json\n").removesuffix("```"))
    assert [f["name"] for f in shown["functions"]] == ["join_all", "split_all", "count"]
    assert shown["functions"][1]["has_docstring"] is False and flipped["functions"][1]["has_docstring"] is True
    assert reviewed == {**flipped, "reviewed": True}
    assert "Reply with the whole record again" in msgs[-1][1]


def test_shipped_edit_workloads_come_in_ordered_groups_of_three():
    for name in ("file-edit", "json-edit"):
        reqs = load_workload(name).requests
        assert len(reqs) == 24 and all(r.temperature == 0 for r in reqs)
        for i in range(0, 24, 3):
            a, b, c = reqs[i : i + 3]
            assert b.messages[:1] == a.messages and c.messages[:3] == b.messages
