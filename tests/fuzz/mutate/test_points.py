"""Mutation points: each operator's points on a small synthetic source, the edits that apply
them, and the seeded sampling."""
from __future__ import annotations

import ast

import pytest

from fuzz.mutate.points import OPERATORS, Mutant, MutationError, apply, points
from fuzz.mutate.run import sample

SRC = '''"""A module docstring with 3 < 4 in it."""
LIMIT = 8


def step(a, b, flags):
    """Docstring: not a statement to drop."""
    total = a + 1
    total += b
    if a < b and not flags:
        total = min(a, b)
    elif a == b or a >= 2:
        record(a, b)
    return f"{total:3}"
'''


def _by(op: str) -> list[Mutant]:
    return points(SRC, "syn.py", (op,))


@pytest.mark.parametrize("op, expected", [
    ("cmp_flip", {("a < b", "a <= b"), ("a == b", "a != b"), ("a >= 2", "a > 2")}),
    ("off_by_one", {("a + 1", "a + 1 + 1"), ("a + 1", "a + 1 - 1")}),
    ("const_bump", {("1", "2"), ("1", "0"), ("2", "3"), ("2", "1")}),
    ("boolop_swap", {("a < b and (not flags)", "a < b or not flags"), ("a == b or a >= 2", "a == b and a >= 2")}),
    ("drop_not", {("not flags", "flags")}),
    ("min_max", {("min(a, b)", "max(a, b)")}),
    ("drop_stmt", {("total = a + 1", "pass"), ("total += b", "pass"), ("total = min(a, b)", "pass"),
                   ("record(a, b)", "pass")}),
    ("swap_args", {("min(a, b)", "min(b, a)"), ("record(a, b)", "record(b, a)")}),
])
def test_each_operator_finds_exactly_its_points(op: str, expected: set) -> None:
    """Docstrings, f-string format specs (the 3 of `:3`) and module-level statements are never
    mutated; a module-level int literal (LIMIT's 8) is a small constant like any other."""
    got = {(m.original, m.mutated) for m in _by(op)}
    if op == "const_bump":
        expected = expected | {("8", "9"), ("8", "7")}
    assert got == expected


@pytest.mark.parametrize("op", list(OPERATORS))
def test_applying_a_point_changes_only_its_node(op: str) -> None:
    for m in _by(op):
        out = apply(SRC, m)
        before, after = SRC.splitlines(), out.splitlines()
        assert len(before) == len(after)  # every edit stays on its lines
        changed = [i + 1 for i, (x, y) in enumerate(zip(before, after)) if x != y]
        assert changed and all(m.line <= i <= m.end_line for i in changed), (m, changed)
        assert ast.dump(ast.parse(out)) != ast.dump(ast.parse(SRC))


def test_a_point_that_does_not_fit_the_source_is_refused() -> None:
    m = _by("cmp_flip")[0]
    with pytest.raises(MutationError):
        apply(SRC.replace("a < b", "a > b"), m)


def test_sampling_is_deterministic_for_a_seed_and_uniform_without_repeats() -> None:
    pts = points(SRC, "syn.py")
    a, b, c = sample(pts, 6, 1), sample(pts, 6, 1), sample(pts, 6, 2)
    assert a == b and a != c
    assert len({m.id for m in a}) == 6
    assert sample(pts, 10_000, 1) == sorted(pts, key=lambda m: (m.file, m.line, m.col, m.operator, m.mutated))


def test_the_default_paths_give_every_operator_points() -> None:
    from fuzz.mutate.sources import DEFAULT_PATHS, find_source

    src = find_source("reference")
    ops = {m.operator for f in src.files(DEFAULT_PATHS) for m in points(src.read(f), f)}
    assert ops == set(OPERATORS)
