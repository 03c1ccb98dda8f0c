"""`llmfuzz run --jobs N` (fuzz.campaign.jobs, fuzz.campaign.jobs_worker): a cell draws the same Cases alone in
a worker as among all cells in one process, and workers sharing a cell split its chunks
between them; two workers finding the same failure write one reproducer; bad --jobs is one
line and exit 2 before any worker starts; a `--jobs 2` run's merged summary adds up its
workers'; SIGTERM (or SIGKILL) to the parent leaves no worker running."""
from __future__ import annotations

import json
import os
from pathlib import Path
import signal
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import pytest

from fuzz.campaign.loop import Campaign
from fuzz.cli.main import main
from fuzz.campaign import jobs as jobs_mod
from fuzz.campaign.jobs import busy_processes, cpu_jobs, oversubscribed, partition
from fuzz.campaign.jobs_worker import Share, merge_reports, summary_doc
from fuzz.verdict.properties import LogitsMismatch
from fuzz.campaign.recorder import Claims, Recorder
from fuzz.campaign.summary import Summary
from fuzz_testutil import FakeClock, FakeHarness, recording_draws

REPO = str(Path(__file__).resolve().parents[3])


def draws(monkeypatch, layouts, share=None, budget_s=2.5) -> dict:
    """{(layout, chunk index): [Case keys drawn]} of a campaign on FakeHarness, the last
    chunk (cut by the budget) left out. On a clock each check moves 50 ms: the budget holds
    as many chunks however loaded the machine."""
    clock = FakeClock()
    with recording_draws(monkeypatch) as seen:
        Campaign(layouts=layouts, modes=("eager", "graph"), seed=7, budget_s=budget_s, progress=False,
                 harness=FakeHarness(clock=clock, check_s=0.05), out_dir="/nonexistent", share=share,
                 clock=clock).run()
    seen.pop(list(seen)[-1])
    return seen


def test_a_cell_draws_the_same_cases_alone_among_others_and_shared(monkeypatch) -> None:
    together = draws(monkeypatch, ("tp1pp1", "tp1pp2"))
    alone = draws(monkeypatch, ("tp1pp2",), Share(cells_total=2))
    common = set(together) & set(alone)
    assert sum(k[0] == "tp1pp2" for k in common) >= 3, (sorted(together), sorted(alone))
    assert all(together[k] == alone[k] for k in common)
    # Chunk 0 of each cell is its simplest Case only (the first round), in a worker too.
    assert len(alone[("tp1pp2", 0)]) == 1 and len(together[("tp1pp1", 0)]) == 1
    # Two workers sharing the cell: every other chunk each, the same draws as one process.
    a = draws(monkeypatch, ("tp1pp2",), Share(cells_total=2, stream=0, streams=2))
    b = draws(monkeypatch, ("tp1pp2",), Share(cells_total=2, stream=1, streams=2))
    assert {k[1] % 2 for k in a} == {0} and {k[1] % 2 for k in b} == {1}
    both = {**a, **b}
    assert all(both[k] == alone[k] for k in set(both) & set(alone)) and len(set(b) & set(alone)) >= 1


def test_chunk_seed_is_the_same_in_every_process() -> None:
    """Workers are separate interpreters: a seed built on hash() (salted per process) would
    make each draw other Cases."""
    from fuzz.campaign.loop import chunk_seed

    code = "from fuzz.campaign.loop import chunk_seed; print(chunk_seed(7, 'cell', 3))"
    env = dict(os.environ, PYTHONPATH=REPO, PYTHONHASHSEED="12345")
    there = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert int(there.stdout) == chunk_seed(7, "cell", 3)
    assert len({chunk_seed(s, c, k) for s in (0, 7) for c in ("a", "b") for k in (0, 1)}) == 8


def failure(out, requests: int = 2):
    from fuzz.cases.case import Case, RequestSpec, Workload
    from fuzz.cases.strategies import FUZZ_MODEL

    case = Case(FUZZ_MODEL.replace(layout="tp1pp1"), Workload(tuple(RequestSpec((1,) * (i + 1), 1)
                                                                     for i in range(requests))))
    return LogitsMismatch("two requests", case, 2.0, oracle="reference")


def test_two_workers_finding_the_same_failure_write_one_reproducer(tmp_path) -> None:
    out, run_dir = str(tmp_path / "out"), str(tmp_path / "run")
    os.makedirs(run_dir)
    target = SimpleNamespace(reproducer_meta=lambda case, v: {}, stats_key=lambda case: (case.layout, case.mode))
    a, b = (Recorder(out, target, Summary(), False, Claims(run_dir, w)) for w in ("w0", "w1"))
    # w1 sees the bigger failure first (on disk, unfinished), then w0 records the small one final.
    big = b.persist(failure(out, 3), final=False, found=(1.0, 0))
    small = a.persist(failure(out, 2), final=True, found=(1.0, 0), minimal=True)
    assert not a.elsewhere and os.path.exists(big) and os.path.exists(small)
    # w1 shrinks to the same small Case: a repeat, w0's file left as it was, w1's unfinished one gone.
    again = b.persist(failure(out, 2), final=True, found=(2.0, 5), minimal=False)
    assert b.elsewhere and again == small and not os.path.exists(big)
    files = sorted(p for p in (tmp_path / "out").rglob("*.json"))
    assert [str(p) for p in files] == [small]
    assert json.loads(files[0].read_text())["minimal"] is True  # w0's record, not overwritten by w1
    # A worker that drops its own file never removes one another worker holds.
    b.persist(failure(out, 4), final=False, found=(3.0, 6))
    a.persist(failure(out, 4), final=False, found=(3.0, 6))
    b.drop(b.unfinished_path, None)
    assert os.path.exists(a.unfinished_path)


RACE = """
import sys, os
sys.path[:0] = [{tests!r}, os.path.dirname({tests!r})]  # test_jobs and fuzz_testutil
from types import SimpleNamespace
from fuzz.campaign.recorder import Claims, Recorder
from fuzz.campaign.summary import Summary
from test_jobs import failure
out, run_dir, me = sys.argv[1], sys.argv[2], sys.argv[3]
target = SimpleNamespace(reproducer_meta=lambda case, v: {{}}, stats_key=lambda case: (case.layout, case.mode))
r = Recorder(out, target, Summary(), False, Claims(run_dir, me))
while not os.path.exists(os.path.join(run_dir, "go")):
    pass
mine = []
for n in range(2, 14):
    r.persist(failure(out, n), final=True, found=(0.0, 0))
    mine.append(0 if r.elsewhere else 1)
print(sum(mine))
"""


def test_concurrent_workers_claim_each_reproducer_once(tmp_path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    code = RACE.format(tests=os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=REPO)
    procs = [subprocess.Popen([sys.executable, "-c", code, str(tmp_path / "out"), str(run_dir), f"w{i}"],
                              stdout=subprocess.PIPE, text=True, env=env, cwd=REPO) for i in range(2)]
    time.sleep(1.0)
    (run_dir / "go").touch()
    won = [int(p.communicate(timeout=120)[0]) for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert sum(won) == 12 and len(list((tmp_path / "out").rglob("*.json"))) == 12  # each once, none lost


def test_merge_counts_a_failure_two_workers_report_once() -> None:
    camp = [Summary(), Summary()]
    reports = []
    from fuzz.campaign.summary import CellStats, Failure

    for i, s in enumerate(camp):
        s.examples, s.seconds = 10 + i, 5.0
        s.cells[("tp1pp1", "eager")] = CellStats(examples=10 + i, seconds=5.0, failures=1)
        s.failures.append(Failure("logits", "m", "d", "out/logits/x.json", 2.0, seconds_to_find=1.0 + i,
                                  meta={"counted_in": ["tp1pp1", "eager"]}))
        reports.append((i, {"layouts": ["tp1pp1"], "stream": i, "streams": 2}, summary_doc(s, None)))
    merged, _ = merge_reports(reports, budget_s=5.0, seed=0)
    assert merged.examples == 21 and merged.jobs == 2 and merged.repeats == 1
    assert len(merged.failures) == 1 and merged.failures[0].seconds_to_find == 1.0
    assert merged.cells[("tp1pp1", "eager")].failures == 1 and merged.cells[("tp1pp1", "eager")].examples == 21


def test_partition_balances_cost_and_shares_the_costliest() -> None:
    from fuzz.cases.strategies import CAMPAIGN_ORDER

    lays = list(CAMPAIGN_ORDER)
    four = partition(lays, 4)
    assert sorted(x for p in four for x in p["layouts"]) == sorted(lays)
    from fuzz.campaign.jobs import layout_cost

    loads = [sum(layout_cost(x) for x in p["layouts"]) for p in four]
    assert max(loads) - min(loads) <= max(layout_cost(x) for x in lays)
    sixteen = partition(lays, 16)
    assert len(sixteen) == 16 and all(len(p["layouts"]) == 1 for p in sixteen)
    shared = {p["layouts"][0] for p in sixteen if p["streams"] > 1}
    assert shared == set(sorted(lays, key=lambda x: -layout_cost(x))[:4])  # the 4 extra workers
    for lay in lays:  # each shared layout's streams are 0..S-1
        ss = sorted(p["stream"] for p in sixteen if p["layouts"] == [lay])
        assert ss == list(range(len(ss)))
    assert partition(lays, 4) == four  # deterministic


def test_cpu_jobs_counts_torch_world_rank_processes() -> None:
    from fuzz.cases.strategies import CAMPAIGN_ORDER

    lays = list(CAMPAIGN_ORDER)
    assert cpu_jobs(16, lays) == 12 and cpu_jobs(4, lays) == 4  # in-process: a core per worker
    assert cpu_jobs(16, lays, "torch") == 2  # every campaign layout: a tp8 (8 ranks) in each worker
    assert cpu_jobs(8, lays, "torch") == 1 and cpu_jobs(2, ["tp8pp1"], "torch") == 1  # at least 1
    assert cpu_jobs(8, ["tp1pp1", "tp2pp1", "tp4pp1"], "torch") == 3  # 1 + 2 + 4 ranks <= 8 cores
    assert cpu_jobs(6, ["tp1pp1", "tp2pp1", "tp4pp1"], "torch") == 2  # w0 tp4pp1, w1 tp1pp1,tp2pp1: 4 + 2
    for cores in (1, 2, 3, 5, 8, 13, 16, 24, 32, 64, 128):  # fits, and one more worker would not
        n = cpu_jobs(cores, lays, "torch")
        assert n == 1 or busy_processes(partition(lays, n), "torch") <= cores
        assert n == len(lays) or busy_processes(partition(lays, n + 1), "torch") > cores


def test_oversubscribed_names_an_explicit_jobs_past_the_cores() -> None:
    lays = ["tp1pp1", "tp2pp1", "tp4pp1"]
    assert oversubscribed(3, lays, "inproc", 2) is None  # threads: no rank processes
    assert oversubscribed(3, lays, "torch", 7) is None  # 1 + 2 + 4 ranks fit
    assert oversubscribed(1, ["tp8pp1"], "torch", 2) is None  # --jobs 1: the campaign as it always ran
    w = oversubscribed(3, lays, "torch", 6)
    assert w is not None and "\n" not in w and w.startswith("llmfuzz: warning: --jobs 3")
    assert "--world torch" in w and "7 rank processes" in w and "6 cores" in w and "oversubscribed" in w
    assert "2 workers" in w  # what the default would run here


def test_explicit_torch_jobs_past_the_cores_warns_once(monkeypatch, capsys, tmp_path) -> None:
    """run_jobs obeys --jobs as given and says the oversubscription in one stderr line."""
    from fuzz.cli.main import build_parser

    class Spawned(Exception):
        pass

    def spawn(*a, **k):
        raise Spawned

    monkeypatch.setattr(jobs_mod, "_spawn", spawn)
    monkeypatch.setattr(jobs_mod, "cpu_cores", lambda: 2)
    monkeypatch.setattr(jobs_mod.tempfile, "mkdtemp", lambda prefix: str(tmp_path))
    lays = ["tp1pp1", "tp2pp1", "tp4pp1"]
    for argv, warned in (([], False), (["--jobs", "3"], True), (["--world", "inproc", "--jobs", "3"], False)):
        args = build_parser().parse_args(["run", "--world", "torch", *argv])
        with pytest.raises(Spawned):
            jobs_mod.run_jobs(args, 3, lays, [SimpleNamespace(device="cpu")], ["eager"])
        err = capsys.readouterr().err.splitlines()
        assert sum("oversubscribed" in x for x in err) == warned, err
        assert err[-1].startswith("llmfuzz: 3 workers: w0 "), err


def test_the_cli_passes_layouts_and_world_to_the_default(monkeypatch, tmp_path) -> None:
    seen = []
    monkeypatch.setattr(jobs_mod, "default_jobs", lambda *a: seen.append(a) or 2)
    monkeypatch.setattr(jobs_mod, "run_jobs", lambda args, jobs, layouts, bases, modes, *shard: seen.append(jobs) or 0)
    assert main(["run", "--world", "torch", "--layouts", "tp1pp1,tp2pp1", "--budget", "1",
                 "--out", str(tmp_path / "out")]) == 0
    assert seen == [("cpu", ["tp1pp1", "tp2pp1"], "torch"), 2]


@pytest.mark.parametrize("value,words", [("0", "--jobs: 0"), ("-1", "--jobs: -1"), ("x", "'x' is not a whole"),
                                          ("1.5", "'1.5' is not a whole")])
def test_bad_jobs_exits_2_with_one_line(capsys, tmp_path, value: str, words: str) -> None:
    code = main(["run", f"--jobs={value}", "--budget", "1", "--out", str(tmp_path / "out")])
    out, err = capsys.readouterr()
    assert code == 2, (out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("llmfuzz: ") and words in lines[0], err
    assert not (tmp_path / "out").exists()


def test_jobs_with_vllm_is_refused(capsys) -> None:
    assert main(["run", "--target", "vllm", "--jobs", "2", "--budget", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--jobs" in err[0] and "vllm" in err[0]


def _run(args, tmp_path) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=REPO)
    return subprocess.Popen([sys.executable, "-m", "fuzz.cli", "run", "--out", str(tmp_path / "out"), *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path)


def test_jobs_2_merges_its_workers_summaries(tmp_path) -> None:
    proc = _run(["--jobs", "2", "--layouts", "tp1pp1,tp1pp2", "--budget", "6", "--json"], tmp_path)
    out, err = proc.communicate(timeout=240)
    assert proc.returncode == 0, err[-3000:]
    doc = json.loads(out)
    assert doc["jobs"] == 2 and [w["layouts"] for w in doc["workers"]] == [["tp1pp1"], ["tp1pp2"]]
    assert all(w["status"] == "ok" and w["examples"] > 0 for w in doc["workers"])
    assert doc["examples"] == sum(w["examples"] for w in doc["workers"])
    assert doc["examples"] == sum(c["examples"] for c in doc["per_cell"].values())
    assert doc["layouts"] == ["tp1pp1", "tp1pp2"] and doc["failures"] == 0 and not doc["interrupted"]


def _children(pid: int) -> list[int]:
    out = []
    for d in os.listdir("/proc"):
        try:
            with open(f"/proc/{d}/stat") as f:
                if d.isdigit() and int(f.read().split(")")[-1].split()[1]) == pid:
                    out.append(int(d))
        except (OSError, ValueError):
            pass
    return out


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_signal_to_the_parent_ends_every_worker(tmp_path, sig) -> None:
    proc = _run(["--jobs", "2", "--layouts", "tp1pp1,tp1pp2", "--budget", "300", "--json"], tmp_path)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stderr), daemon=True)
    reader.start()
    workers: list[int] = []
    try:
        t0 = time.monotonic()
        while sum("campaign started" in x for x in lines) < 2 and time.monotonic() - t0 < 120:
            time.sleep(0.2)
        workers = _children(proc.pid)
        assert len(workers) == 2, lines
        proc.send_signal(sig)
        t0 = time.monotonic()
        out = proc.stdout.read()
        proc.wait(timeout=60)
        while any(_alive(w) for w in workers) and time.monotonic() - t0 < 30:
            time.sleep(0.2)
        assert not any(_alive(w) for w in workers), "a worker outlived its parent"
        assert time.monotonic() - t0 < 30
    finally:  # never leave a campaign running behind a failed test
        proc.kill()
        for w in workers:
            if _alive(w):
                os.kill(w, signal.SIGKILL)
    if sig == signal.SIGTERM:  # the parent prints the merged summary so far
        assert proc.returncode == 0, "".join(lines)[-2000:]
        doc = json.loads(out)
        assert doc["interrupted"] and doc["jobs"] == 2 and all(w["status"] == "ok" for w in doc["workers"])
