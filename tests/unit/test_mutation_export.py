"""Mutants carried without cosmic-ray (benchmarks/mutation_export.py; mutation_engine.py --export / --from):
a unified diff applied in plain Python, exactly or not at all; an export read back only against the tree it
was cut from; shards that split the list."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
from mutation_export import (ExportedMutant, apply_unified_diff, parse_shard, read_export, sha256,  # noqa: E402
                             shard, unified_diff, write_export)
from mutation_judging import Mutant  # noqa: E402

BEFORE = "".join(f"line {i}\n" for i in range(1, 21))
MASK = "harness/engine/ddtree/mask.py"


@pytest.mark.parametrize("after", [
    BEFORE.replace("line 3\n", "line three\n"),                                    # one line changed
    BEFORE.replace("line 2\n", "").replace("line 18\n", "line 18\nnew\n"),         # two hunks: a removal, an insert
    "line 0\n" + BEFORE,                                                           # inserted at the top
    BEFORE + "last, no newline",                                                   # no newline at end of file
    BEFORE[:-1],                                                                   # the newline taken away
])
@pytest.mark.parametrize("context", [0, 3])
def test_a_diff_applied_gives_the_mutated_text(after, context):
    assert apply_unified_diff(BEFORE, unified_diff("m.py", BEFORE, after, context)) == after


def test_a_diff_for_another_revision_is_refused_never_misapplied():
    diff = unified_diff("m.py", BEFORE, BEFORE.replace("line 10\n", "line ten\n"))
    with pytest.raises(ValueError, match="expects"):
        apply_unified_diff(BEFORE.replace("line 9\n", "line nine\n"), diff)
    with pytest.raises(ValueError):
        apply_unified_diff(BEFORE, "not a diff\n")


def test_a_diff_whose_lines_moved_is_reanchored_where_they_stand_once_and_refused_elsewhere():
    diff = unified_diff("m.py", BEFORE, BEFORE.replace("line 10\n", "line ten\n"))
    moved = "header\nheader\n" + BEFORE.replace("line 2\n", "")   # lines added above, one taken away
    assert apply_unified_diff(moved, diff, reanchor=True) == moved.replace("line 10\n", "line ten\n")
    with pytest.raises(ValueError, match="expects"):
        apply_unified_diff(moved, diff)   # exact unless asked
    with pytest.raises(ValueError, match="nowhere"):   # the context itself changed
        apply_unified_diff(moved.replace("line 9\n", "line nine\n"), diff, reanchor=True)
    twice = BEFORE + BEFORE
    with pytest.raises(ValueError, match="2 times"):
        apply_unified_diff("x\n" + twice, unified_diff("m.py", BEFORE, BEFORE.replace("line 10\n", "ten\n")),
                           reanchor=True)


def test_an_export_of_a_changed_module_is_judged_reanchored_or_left_out(tmp_path):
    m = _mask_mutant()
    src = (ROOT / MASK).read_text()
    tree = tmp_path / "tree"
    (tree / MASK).parent.mkdir(parents=True)
    (tree / MASK).write_text('"""moved down"""\n' + src)
    path = tmp_path / "mutants.json"
    write_export(path, {"tree": "abc"}, [m], {MASK: sha256(src)})
    with pytest.raises(SystemExit, match="--reanchor"):
        read_export(path, tree)
    meta, (back,) = read_export(path, tree, reanchor=True)
    assert back.reanchor and meta["reanchored"] == 1 and meta["not_reanchored"] == [] and meta["changed_modules"] == [MASK]
    back.apply(tree)
    assert "vis[i, i] = False" in (tree / MASK).read_text() and (tree / MASK).read_text().startswith('"""moved')
    (tree / MASK).write_text(src.replace("vis[i, i] = True", "vis[i, i] = bool(1)"))   # the mutated line itself changed
    meta, kept = read_export(path, tree, reanchor=True)
    assert kept == [] and meta["not_reanchored"] == [m.mutant.key]


def _mask_mutant() -> ExportedMutant:
    """A real row no longer sees itself (`vis[i, i] = True` -> False in tree_visibility), as cosmic-ray's
    ReplaceTrueWithFalse writes it."""
    before = (ROOT / MASK).read_text()
    after = before.replace("vis[i, i] = True", "vis[i, i] = False", 1)
    assert after != before
    line = before[:before.index("vis[i, i] = True")].count("\n") + 1
    return ExportedMutant(Mutant(MASK, "core/ReplaceTrueWithFalse", 0, line, 20, "tree_visibility"), "mask",
                          unified_diff(MASK, before, after))


def test_an_export_read_back_applies_to_a_copy_of_the_tree(tmp_path):
    m = _mask_mutant()
    path = tmp_path / "mutants.json"
    write_export(path, {"tree": "abc", "seed": 1}, [m], {MASK: sha256((ROOT / MASK).read_text())})
    meta, (back,) = read_export(path, ROOT)
    assert back == m and meta["tree"] == "abc" and json.loads(path.read_text())["mutants"][0]["line"] == m.mutant.line
    copy = tmp_path / "tree"
    (copy / MASK).parent.mkdir(parents=True)
    (copy / MASK).write_text((ROOT / MASK).read_text())
    back.apply(copy)
    assert "vis[i, i] = False" in (copy / MASK).read_text()
    assert (copy / MASK).read_text().count("\n") == (ROOT / MASK).read_text().count("\n")


def test_an_export_of_another_revision_is_refused(tmp_path):
    path = tmp_path / "mutants.json"
    write_export(path, {"tree": "abc"}, [_mask_mutant()], {MASK: sha256("another revision\n")})
    with pytest.raises(SystemExit, match="differs from the tree"):
        read_export(path, ROOT)


def test_shards_split_the_list_once():
    items = list(range(10))
    parts = [shard(items, *parse_shard(f"{i}/3")) for i in range(3)]
    assert sorted(x for p in parts for x in p) == items and parts[0] == [0, 3, 6, 9]
    for bad in ("3/3", "1", "a/b", "-1/2"):
        with pytest.raises(ValueError):
            parse_shard(bad)


def test_pick_keeps_the_named_mutants_less_the_judged_ones_and_refuses_an_unknown_key():
    from mutation_export import pick
    mutants = [ExportedMutant(Mutant(MASK, "core/NumberReplacer", k, 10 + k, 0, "f"), "mask",
                              unified_diff(MASK, BEFORE, BEFORE.replace(f"line {k + 1}\n", "x\n")))
               for k in range(4)]
    keys = [e.mutant.key for e in mutants]
    assert [e.mutant.key for e in pick(mutants, set(), set())] == keys
    assert [e.mutant.key for e in pick(mutants, {keys[1], keys[3]}, set())] == [keys[1], keys[3]]
    assert [e.mutant.key for e in pick(mutants, set(), {keys[0]})] == keys[1:]
    assert [e.mutant.key for e in pick(mutants, {keys[1], keys[2]}, {keys[2]})] == [keys[1]]
    with pytest.raises(ValueError, match="not in the export"):
        pick(mutants, {"harness/engine/ddtree/mask.py:core/AddNot:9"}, set())
