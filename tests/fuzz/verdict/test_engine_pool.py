"""The engine pool's size for a campaign (`fuzz.verdict.engine_pool.pool_capacity_for`): the engine keys a
campaign really asks for, replayed through an LRU of that size, miss about as often as
through a 16-engine pool, and a 16-engine pool is kept where it pays."""
from __future__ import annotations

from collections import OrderedDict

import pytest
from hypothesis import HealthCheck, given, seed as hseed, settings

from fuzz.cases.case import reference_config
from fuzz.verdict.engine_pool import engine_config, pool_capacity_for
from fuzz.cases.strategies import CAMPAIGN_ORDER, FUZZ_MODEL, cases


def engine_keys(layouts: tuple[str, ...], modes: tuple[str, ...], chunks: int, chunk: int = 8) -> list[str]:
    """The engines a campaign's chunks ask the pool for, in order (reference, then test), drawn
    the way `Campaign.run` draws them: one layout per chunk, round robin, a seed per chunk."""
    keys: list[str] = []
    for i in range(chunks):
        drawn = []

        @hseed(i)
        @settings(max_examples=chunk + 1, database=None, deadline=None, suppress_health_check=list(HealthCheck))
        @given(cases((layouts[i % len(layouts)],), modes, (), FUZZ_MODEL, 10))
        def draw(case):
            drawn.append(case)

        draw()
        for case in drawn:
            keys.append(repr(engine_config(reference_config(case.config)).to_dict()))
            keys.append(repr(engine_config(case.config).to_dict()))
    return keys


def miss_rate(keys: list[str], capacity: int) -> float:
    pool: OrderedDict[str, None] = OrderedDict()
    misses = 0
    for k in keys:
        if k in pool:
            pool.move_to_end(k)
            continue
        misses += 1
        pool[k] = None
        while len(pool) > capacity:
            pool.popitem(last=False)
    return misses / len(keys)


@pytest.mark.parametrize("layouts,modes", [(CAMPAIGN_ORDER, ("eager", "graph")),
                                           (("tp1pp1", "tp2pp4"), ("eager", "graph")),
                                           (("tp2pp4",), ("eager",))])
def test_pool_size_misses_about_as_often_as_sixteen_engines(layouts, modes):
    keys = engine_keys(layouts, modes, chunks=2 * len(layouts) + 4)
    size = pool_capacity_for(len(layouts), len(modes))
    assert size <= 16
    # Within 4 points of a 16-engine pool (measured: 3.1 on the default cells): a smaller pool
    # may only drop engines that a round robin would have evicted before their next use anyway.
    assert miss_rate(keys, size) <= miss_rate(keys, 16) + 0.04, (size, miss_rate(keys, size), miss_rate(keys, 16))
