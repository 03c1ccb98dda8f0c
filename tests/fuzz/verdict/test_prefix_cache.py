"""fuzz.verdict.prefix_cache: the harness's own prefix-cache model, from its definition (full
blocks, names chained by the parent's, the salt on the first block, the last prompt token
never a hit, unseen continuations as anything)."""
from __future__ import annotations

from fuzz.verdict.prefix_cache import PrefixCacheModel, block_names

B = 4


def toks(n: int, start: int = 1) -> tuple[int, ...]:
    return tuple(range(start, start + n))


def test_a_hit_is_whole_blocks_never_the_last_prompt_token():
    m = PrefixCacheModel(B)
    m.add(toks(10))
    assert m.hit(toks(10)) == 8  # two full blocks of 4; the third is partial
    assert m.hit(toks(8)) == 4  # exactly two blocks: the last token must be computed, so one block
    assert m.hit(toks(9)) == 8
    assert m.hit(toks(3)) == 0  # no full block
    assert m.hit(toks(6) + (99, 99, 99)) == 4  # parts in the second block


def test_names_are_chained_by_the_parent():
    m = PrefixCacheModel(B)
    m.add(toks(8))
    other_first = (50, 51, 52, 53) + toks(8)[4:] + (0,)
    assert m.hit(other_first) == 0  # the same second block after another first block is another block
    assert block_names(toks(8), B)[1] != block_names(other_first, B)[1]


def test_the_salt_separates_every_block_and_an_empty_salt_is_none():
    m = PrefixCacheModel(B)
    m.add(toks(13), salt="alice")
    assert m.hit(toks(13), salt="alice") == 12
    assert m.hit(toks(13), salt="bob") == 0 and m.hit(toks(13)) == 0
    m.add(toks(13))
    assert m.hit(toks(13), salt="") == 12  # no salt
    assert m.hit(toks(13), extra=("lora-a",)) == 0  # keys on every block


def test_an_unseen_continuation_matches_anything_up_to_its_reach():
    m = PrefixCacheModel(B)
    m.add(toks(6), unknown=5)  # known 6 tokens, then up to 5 unseen: 11 tokens, two full blocks
    assert m.hit(toks(6) + (77, 78, 79, 80, 81, 82)) == 8  # the second block's tail may be anything
    assert m.hit(toks(5) + (77,) + toks(6)) == 4  # differs inside the known tail: only the first block
    m2 = PrefixCacheModel(B)
    m2.add(toks(2), unknown=20, salt="s")  # no full known block: from the root, under its salt
    assert m2.hit(toks(2) + (9,) * 30, salt="s") == 20 and m2.hit(toks(2) + (9,) * 30) == 0


def test_within_is_a_union_of_models():
    a, b = PrefixCacheModel(B), PrefixCacheModel(B)
    a.add(toks(4))
    b.add(toks(9))
    assert a.hit(toks(9)) == 4 and a.hit(toks(9), within=[b]) == 8
