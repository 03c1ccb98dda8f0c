"""Contention profiles: parsed to one canonical form, bad ones refused in one line."""
from __future__ import annotations

import os

import pytest

from fuzz.contention.profile import NONE, Profile, check_device, draw_levels, drawn_for, parse_profile
from fuzz.errors import BadInput


@pytest.mark.parametrize("text, canonical", [
    ("none", "none"), ("gpu", "gpu:3"), ("gpu:1", "gpu:1"), ("cpu:2", "cpu:2"), ("both:2", "gpu:2,cpu:2"),
    ("gpu:3,cpu:6", "gpu:3,cpu:6"), (" GPU:2 , cpu:1 ", "gpu:2,cpu:1"), ("gpu:1,gpu:2", "gpu:3"),
])
def test_profiles_parse_to_their_canonical_form(text, canonical):
    p = parse_profile(text)
    assert str(p) == canonical
    assert parse_profile(str(p)) == p  # what a reproducer records reads back as the same profile


def test_cpu_without_a_count_is_every_core():
    assert parse_profile("cpu") == Profile(cpu=os.cpu_count())


@pytest.mark.parametrize("text, words", [
    ("bogus", "unknown profile 'bogus'"), ("gpu:0", "positive integer"), ("cpu:x", "positive integer"),
    ("none:2", "none takes no count"), ("cpu:500", "at most"), ("draw", "only `run` draws"),
])
def test_bad_profiles_are_one_line_naming_the_problem(text, words):
    with pytest.raises(BadInput) as e:
        parse_profile(text)
    assert words in str(e.value) and "\n" not in str(e.value)


def test_gpu_contention_needs_cuda():
    check_device(Profile(cpu=2), cuda_ok=False)
    with pytest.raises(BadInput, match="needs CUDA"):
        check_device(Profile(gpu=1), cuda_ok=False)


def test_a_drawn_level_depends_on_the_seed_and_cell_only():
    levels = draw_levels(cuda=True)
    assert levels[0] == NONE and any(p.gpu for p in levels)
    cells = [f"cell{i}" for i in range(40)]
    drawn = [drawn_for(c, 7, levels) for c in cells]
    assert drawn == [drawn_for(c, 7, levels) for c in cells]
    assert len(set(drawn)) == len(levels)  # 40 cells reach every level
    assert not any(p.gpu for p in draw_levels(cuda=False))
