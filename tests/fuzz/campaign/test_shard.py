"""`llmfuzz run --shard K/N` (fuzz.campaign.shard): N shards together draw the Cases one
machine draws, each chunk in one shard only; bad --shard is one line and exit 2; the summary
names its shard and carries what `llmfuzz merge` needs."""
from __future__ import annotations

import contextlib
import json

import pytest

from fuzz.campaign import loop
from fuzz.campaign.jobs import within
from fuzz.campaign.shard import Shard, parse_shard, shard_part
from fuzz.cli.main import main
from fuzz.errors import BadInput

from fuzz_testutil import FakeClock, FakeHarness, campaigns_on, recording_draws


def drawn(monkeypatch, tmp_path, argv: list[str]) -> tuple[dict, dict]:
    """`llmfuzz run ARGV --json` on FakeHarness (no engine): ({(layout, chunk): [Case JSON]},
    the summary), the chunk each cell was in when the budget cut it left out. On a clock each
    check moves 50 ms: the budget holds as many chunks however loaded the machine."""
    with recording_draws(monkeypatch) as seen:
        clock = FakeClock()
        monkeypatch.setattr(loop, "make_harness", lambda *a, **k: FakeHarness(clock=clock, check_s=0.05))
        campaigns_on(monkeypatch, clock)
        out = tmp_path / f"summary{len(list(tmp_path.iterdir()))}.json"
        with open(out, "w") as f, contextlib.redirect_stdout(f):
            assert main(["run", "--jobs", "1", "--modes", "eager", "--seed", "3", "--budget", "3", "--json",
                         "--quiet", "--out", str(tmp_path / "r"), *argv]) == 0
    last: dict = {}
    for lay, i in seen:
        last[lay] = max(last.get(lay, -1), i)
    return {k: v for k, v in seen.items() if k[1] != last[k[0]]}, json.loads(out.read_text())


@pytest.mark.parametrize("layouts", ["tp1pp1,tp1pp2,tp2pp1", "tp1pp2"])
def test_two_shards_draw_the_cases_of_one_campaign_each_once(monkeypatch, tmp_path, layouts) -> None:
    """Three layouts: each shard its own layouts; one layout: each shard every other chunk."""
    one, _ = drawn(monkeypatch, tmp_path, ["--layouts", layouts])
    (a, sa), (b, sb) = (drawn(monkeypatch, tmp_path, ["--layouts", layouts, "--shard", s]) for s in ("1/2", "2/2"))
    assert sa["shard"] == "1/2" and sb["shard"] == "2/2"
    assert not set(a) & set(b)  # no chunk in both shards
    # Every chunk one machine ran, the shard that holds it ran with the same Cases.
    reached = {lay: max(i for (x, i) in {**a, **b} if x == lay) for lay, _ in {**a, **b}}
    common = [k for k in one if k[1] <= reached.get(k[0], -1)]
    assert len(common) >= 4 and len(common) >= len(one) // 2, (sorted(one), sorted(a), sorted(b))
    assert all(({**a, **b}[k] == one[k]) for k in common)
    shards_cases = {c for k in common for c in (a.get(k) or b[k])}
    assert shards_cases == {c for k in common for c in one[k]}
    if "," in layouts:  # whole layouts dealt: the shards' Cases are disjoint
        assert not {c for v in a.values() for c in v} & {c for v in b.values() for c in v}
        assert sorted(sa["layouts"] + sb["layouts"]) == sorted(layouts.split(","))
    else:
        assert {k[1] % 2 for k in a} == {0} and {k[1] % 2 for k in b} == {1}


def test_shard_deals_as_jobs_and_nests_streams() -> None:
    lays = ["tp1pp1", "tp1pp2", "tp2pp1", "tp4pp1"]
    from fuzz.campaign.jobs import partition

    assert [shard_part(Shard(k, 3), lays).part for k in (1, 2, 3)] == partition(lays, 3)
    # Shard 2 of 3 on one layout runs chunks 1, 4, 7, ...; its own 2 workers 1, 7, ... and 4, 10, ...
    outer = shard_part(Shard(2, 3), ["tp1pp1"]).part
    assert (outer["stream"], outer["streams"]) == (1, 3)
    inner = within(outer, partition(["tp1pp1"], 2))
    assert [(p["stream"], p["streams"]) for p in inner] == [(1, 6), (4, 6)]


@pytest.mark.parametrize("value", ["0/4", "5/4", "x", "1/0", "2", "1/2/3", "-1/4"])
def test_bad_shard_exits_2_with_one_line(capsys, tmp_path, value: str) -> None:
    code = main(["run", f"--shard={value}", "--budget", "1", "--out", str(tmp_path / "out")])
    out, err = capsys.readouterr()
    assert code == 2, (out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("llmfuzz: --shard: ") and repr(value) in lines[0], err
    assert not (tmp_path / "out").exists()
    with pytest.raises(BadInput):
        parse_shard(value)
    assert parse_shard("3/4") == Shard(3, 4) and str(parse_shard(" 1/1 ")) == "1/1"


def test_vllm_shards_deal_the_plan_and_keep_each_config_at_its_place() -> None:
    from fuzz.cli.vllm import _shard_configs
    from fuzz.targets.vllm.configs import cell_name
    from fuzz.targets.vllm.plan import campaign_configs

    configs = campaign_configs(budget_s=600, seed=1, count=5)
    names = [cell_name(c, o) for c, o in configs]
    got = [_shard_configs(configs, Shard(k, 2)) for k in (1, 2)]
    mine = [[cell_name(c, o) for c, o in g[0]] for g in got]
    assert sorted(mine[0] + mine[1]) == sorted(names) and not set(mine[0]) & set(mine[1])
    for _, shard, share in got:
        assert share.cells_total == 5 and shard.part["layouts"] == list(share.positions)
        assert all(names[i] == n for n, i in share.positions.items())  # seeds: the plan's place


def test_shard_jobs_deal_the_shards_part_to_its_workers(monkeypatch, tmp_path, capsys) -> None:
    """`--shard 2/2 --jobs 2` on one layout: its workers run chunks 1, 5, ... and 3, 7, ... of it,
    with the whole campaign's cell count."""
    from types import SimpleNamespace

    from fuzz.campaign import jobs as jobs_mod
    from fuzz.cli.main import build_parser

    spawned = []

    class Spawned(Exception):
        pass

    def run_workers(parts, plan, *rest):
        spawned.extend((p, plan["cells_total"]) for p in parts)
        raise Spawned

    monkeypatch.setattr(jobs_mod, "_run_workers", run_workers)
    monkeypatch.setattr(jobs_mod.tempfile, "mkdtemp", lambda prefix: str(tmp_path))
    args = build_parser().parse_args(["run", "--jobs", "2", "--shard", "2/2"])
    shard = shard_part(Shard(2, 2), ["tp1pp1"])
    with pytest.raises(Spawned):
        jobs_mod.run_jobs(args, 2, ["tp1pp1"], [SimpleNamespace(device="cpu")], ["eager"], shard, shard.part, 1)
    assert [(p["stream"], p["streams"], n) for p, n in spawned] == [(1, 4, 1), (3, 4, 1)]


def test_a_sequential_targets_shard_draws_each_cell_as_the_whole_campaign(monkeypatch) -> None:
    """vLLM-like (sequential) cells: shard 2/2 visits every other cell, each with the chunk
    seeds it has at its place in the whole campaign, so it draws what one machine draws there."""
    from hypothesis import strategies as st

    from fuzz.campaign.jobs_worker import Share
    from fuzz.campaign.loop import Campaign
    from fuzz.cases.case import Case, RequestSpec, Workload
    from fuzz.cases.strategies import FUZZ_MODEL
    from fuzz.targets.base import Cell, Target
    from fuzz_testutil import PASS, FakeClock

    clock = FakeClock()  # each check moves it 20 ms: both runs have as many chunks, however loaded the machine

    class Configs(Target):
        name, sequential, hypothesis_shrinks, unit, chunk = "fake", True, False, "configs", 4

        def __init__(self, names):
            self.names = names

        def cells(self):
            def case(n):
                return Case(FUZZ_MODEL, Workload(tuple(RequestSpec((1 + t,), 1) for t in range(n))))
            return [Cell(name, st.integers(1, 6).map(case), name) for name in self.names]

        def check(self, case):
            clock.sleep(0.02)
            return PASS

        def stats_key(self, case):
            return ("?", "")

    names = ["a", "b", "c", "d"]

    def run(cells, share=None):
        with recording_draws(monkeypatch) as seen:
            Campaign(target=Configs(cells), budget_s=2.0, min_cell_s=0.3, progress=False, out_dir="/nonexistent",
                     share=share, clock=clock).run()
        return seen

    one = run(names)
    shard = shard_part(Shard(2, 2), names, cost=lambda n: 1.0)
    assert shard.part["layouts"] == ["b", "d"]
    mine = run(shard.part["layouts"], Share(4, positions={"b": 1, "d": 3}))
    assert {i // 1009 for (_, i) in mine} == {1, 3} and {c for (c, _) in mine} == {"b", "d"}
    common = set(one) & set(mine)
    assert len(common) >= 2 and all(one[k] == mine[k] for k in common)
