"""The GPUs of `llmfuzz run --device cuda --jobs N` (fuzz.campaign.jobs_gpus, dealt by fuzz.campaign.jobs): a worker
gets one GPU in the in-process world and a GPU per rank of its largest layout with --world torch
(NCCL refuses two ranks on one GPU), as many workers on a GPU as its free memory holds; a layout
with more ranks than there are GPUs is one line and exit 2 before anything starts, with or
without --jobs. CPU tests model the GPUs (counts, free memory, the ranks' own choice of GPU);
the `gpu` tests run the real thing and skip without enough GPUs."""
from __future__ import annotations

import itertools
import json
import os
from pathlib import Path
import random
import subprocess
import sys
from types import SimpleNamespace

import pytest

from fuzz.campaign import jobs as jobs_mod
from fuzz.cli.main import main
from fuzz.campaign.jobs import default_jobs, partition, worker_gpus
from fuzz.verdict.gpu_memory import CUDA_CONTEXT_BYTES, WORKER_GPU_BYTES
from fuzz.campaign.jobs_gpus import check_gpu_count, deal, gpu_jobs, gpus_needed, worker_gpu_bytes
from fuzz.errors import BadInput

REPO = str(Path(__file__).resolve().parents[3])
GIB = 1 << 30


def test_gpu_jobs_shares_a_gpu_bound_by_cores_memory_and_layouts() -> None:
    per = 4 * GIB
    assert gpu_jobs(16, [140 * GIB], 12, per) == 12  # one GPU, 12 workers on it: shared
    assert gpu_jobs(4, [140 * GIB], 12, per) == 4  # the cores bound
    assert gpu_jobs(16, [140 * GIB], 3, per) == 3  # the layouts bound (one worker per layout)
    assert gpu_jobs(16, [10 * GIB], 12, per) == 2  # the memory bound: 10 GiB holds two 4 GiB workers
    assert gpu_jobs(16, [10 * GIB, 9 * GIB - 1], 12, per) == 4  # per GPU, summed: 2 + 2 (1 GiB short of 3)
    assert gpu_jobs(16, [10 * GIB], 12, per_worker=GIB) == 10
    assert gpu_jobs(16, [GIB, 0], 12, per) == gpu_jobs(16, [], 12, per) == gpu_jobs(0, [140 * GIB], 12, per) == 1
    # The default allowance: an H200's free memory holds 8 workers of this tiny model, an 80 GB H100's 4.
    assert gpu_jobs(16, [139 * GIB], 12) == 8 and gpu_jobs(16, [78 * GIB], 12) == 4


def test_deal_one_gpu_workers_round_robin_within_each_gpus_memory() -> None:
    per = 4 * GIB
    assert deal([1] * 4, [80 * GIB, 80 * GIB], per) == ([(0,), (1,), (0,), (1,)], True)  # equal GPUs: round robin
    # GPU 1 holds one worker: the GPUs with more room take the others first.
    sets, fits = deal([1] * 5, [80 * GIB, 5 * GIB, 80 * GIB], per)
    assert fits and sets == [(0,), (2,), (0,), (2,), (0,)]
    # Past the memory (an explicit --jobs): every worker still gets a GPU, the least oversubscribed.
    sets, fits = deal([1] * 6, [8 * GIB, 4 * GIB], per)
    assert not fits and sorted(g for s in sets for g in s) == [0, 0, 0, 1, 1, 1]
    assert deal([1] * 3, [0], per) == ([(0,)] * 3, False)


def test_a_torch_world_worker_is_dealt_a_gpu_per_rank() -> None:
    lays = ["tp1pp1", "tp1pp2", "tp2pp2", "tp8pp1"]
    assert [gpus_needed([x], "torch") for x in lays] == [1, 2, 4, 8]
    assert [gpus_needed([x], "inproc") for x in lays] == [1, 1, 1, 1]  # rank threads share their GPU
    assert gpus_needed(["tp1pp1", "tp2pp2", "tp1pp2"], "torch") == 4  # its largest layout
    per = worker_gpu_bytes("torch")
    assert per == WORKER_GPU_BYTES + CUDA_CONTEXT_BYTES  # a rank process's context on each GPU of its set
    assert deal([2, 2], [80 * GIB] * 2, per) == ([(0, 1), (0, 1)], True)  # two tp1pp2 workers share two GPUs
    assert deal([1, 2, 1], [80 * GIB] * 2, per) == ([(0,), (0, 1), (1,)], True)  # the largest set first
    assert deal([4, 2, 2], [80 * GIB] * 4, per)[0] == [(0, 1, 2, 3), (0, 1), (2, 3)]
    # A GPU short of memory is left out of a set when others have room, and no set repeats a GPU.
    sets, fits = deal([2, 2], [80 * GIB, 10 * GIB, 80 * GIB], per)
    assert fits and sets == [(0, 2), (0, 2)]
    sets, fits = deal([2] * 3, [2 * per, per], per)  # past the memory: still two distinct GPUs each
    assert not fits and all(len(set(s)) == 2 for s in sets)


def _feasible(needs: list[int], room: list[int]) -> bool:
    """Brute force: some dealing of distinct GPUs fits every worker in the GPUs' room."""
    if not needs:
        return True
    for pick in itertools.combinations(range(len(room)), needs[0]):
        if all(room[g] > 0 for g in pick):
            rest = [r - (g in pick) for g, r in enumerate(room)]
            if _feasible(needs[1:], rest):
                return True
    return False


def test_deal_fits_whenever_any_dealing_fits() -> None:
    """The greedy dealing is no worse than an exhaustive one: the default --jobs (the most
    workers whose sets fit) never gives up workers a better dealing would have fitted."""
    rng = random.Random(0)
    for _ in range(3000):
        n = rng.randint(1, 4)
        room = [rng.randint(0, 3) for _ in range(n)]
        needs = [rng.randint(1, n) for _ in range(rng.randint(1, 5))]
        sets, fits = deal(needs, room, 1)
        assert fits == _feasible(needs, room), (needs, room)
        assert [len(set(s)) for s in sets] == needs


def test_default_jobs_deals_gpus_by_memory_and_counts_ranks(monkeypatch) -> None:
    from fuzz.cases.strategies import CAMPAIGN_ORDER

    lays, per = list(CAMPAIGN_ORDER), WORKER_GPU_BYTES
    asked: list[str] = []
    free = {"cuda": [20 * per, per + per // 2], "cuda:1": [per + per // 2]}
    monkeypatch.setattr(jobs_mod, "gpu_free_bytes", lambda device: asked.append(device) or free[device])
    monkeypatch.setattr(jobs_mod, "cpu_cores", lambda: 16)
    assert default_jobs("cpu", lays) == 12 and default_jobs("cpu", lays, "torch") == 2 and asked == []
    assert default_jobs("cuda", lays) == 12 and asked == ["cuda"]  # 12 on 2 GPUs (20 + 1 fit)
    assert default_jobs("cuda", lays[:3]) == 3
    free["cuda"] = [3 * per, per - 1]
    assert default_jobs("cuda", lays) == 3  # memory: 3 on the first GPU, none on the second
    assert default_jobs("cuda:1", lays) == 1  # the GPU named holds one worker
    free["cuda:1"] = [10 * per]
    assert default_jobs("cuda:1", lays) == 10
    # --world torch: the cores count ranks, and a worker takes a GPU per rank of its largest layout.
    pt = worker_gpu_bytes("torch")
    two = ["tp1pp1", "tp2pp1"]  # partition: w0 tp2pp1 on 2 GPUs, w1 tp1pp1 on 1
    free["cuda"] = [2 * pt, pt]
    assert default_jobs("cuda", two, "torch") == 2
    free["cuda"] = [pt, 2 * pt]
    assert default_jobs("cuda", two, "torch") == 2  # w1 on the second GPU
    free["cuda"] = [2 * pt - 1, pt]  # one worker on each GPU: w0's two GPUs leave w1 no room
    assert default_jobs("cuda", two, "torch") == 1
    free["cuda"] = [100 * per]  # one GPU: a tp2 worker cannot have its two (check_gpu_count refuses the layout)
    assert default_jobs("cuda", two, "torch") == 1
    four = ["tp1pp1", "tp1pp2", "tp2pp2", "tp1pp4"]
    for room in (1, 2, 3, 4):  # the most workers whose sets fit, and one more would not
        free["cuda"] = [room * pt] * 4
        n = default_jobs("cuda", four, "torch")
        assert n == 1 or deal(worker_gpus(partition(four, n), "torch"), free["cuda"], pt)[1]
        assert n == 4 or not deal(worker_gpus(partition(four, n + 1), "torch"), free["cuda"], pt)[1]
    assert n == 4
    monkeypatch.setattr(jobs_mod, "cpu_cores", lambda: 1)
    asked.clear()
    assert default_jobs("cuda", lays) == 1 and asked == []  # one worker: CUDA left untouched


def _place_ranks(monkeypatch, visible: list[str], layout: str) -> list[str]:
    """The physical GPU of each rank of `layout` in a process that sees `visible` (its
    CUDA_VISIBLE_DEVICES), as the rank processes choose it (engine/dist_worker_main.py)."""
    import torch

    from engine.dist_worker_main import _device_for
    from fuzz.cases.strategies import FUZZ_MODEL

    monkeypatch.setattr(torch.cuda, "device_count", lambda: len(visible))
    monkeypatch.setattr(torch.cuda, "set_device", lambda dev: None)
    cfg = FUZZ_MODEL.replace(device="cuda", world="torch", layout=layout)
    return [visible[int(_device_for(cfg, r).device.split(":")[1])] for r in range(cfg.world_size)]


@pytest.mark.parametrize("layouts,jobs", [(["tp1pp2"], 2), (["tp1pp1", "tp1pp2", "tp2pp2"], 3),
                                          (["tp2pp1", "tp1pp4"], 4)])
def test_run_jobs_gives_every_rank_of_a_worker_its_own_gpu(monkeypatch, tmp_path, capsys, layouts, jobs) -> None:
    """Each worker's CUDA_VISIBLE_DEVICES holds a GPU for every rank of its largest layout, so its
    ranks, choosing by their rank, land on distinct GPUs (one GPU a worker put them all on one)."""
    from fuzz.cli.main import build_parser

    envs: list[dict] = []

    class Spawned(Exception):
        pass

    def spawn(i, part, plan, run_dir, env, progress):
        envs.append(dict(env, layouts=part["layouts"]))
        if len(envs) == jobs:
            raise Spawned
        return SimpleNamespace(reader=SimpleNamespace(join=lambda timeout=None: None))

    monkeypatch.setattr(jobs_mod, "_spawn", spawn)
    monkeypatch.setattr(jobs_mod, "visible_gpus", lambda: ["3", "4", "5", "6"])  # a parent's own CUDA_VISIBLE_DEVICES
    monkeypatch.setattr(jobs_mod, "gpu_free_bytes", lambda device: [140 * GIB] * 4)
    monkeypatch.setattr(jobs_mod.tempfile, "mkdtemp", lambda prefix: str(tmp_path))
    args = build_parser().parse_args(["run", "--device", "cuda", "--world", "torch", "--jobs", str(jobs)])
    with pytest.raises(Spawned):
        jobs_mod.run_jobs(args, jobs, layouts, [SimpleNamespace(device="cpu")], ["eager"])
    assert len(envs) == jobs
    for env in envs:
        visible = env["CUDA_VISIBLE_DEVICES"].split(",")
        assert set(visible) <= {"3", "4", "5", "6"} and len(set(visible)) == len(visible)
        for lay in env["layouts"]:
            placed = _place_ranks(monkeypatch, visible, lay)
            assert len(set(placed)) == len(placed), (lay, visible, placed)
    line = capsys.readouterr().err.splitlines()[-1]
    assert line.startswith(f"llmfuzz: {jobs} workers on GPU"), line


def test_inproc_workers_keep_one_gpu_each(monkeypatch, tmp_path) -> None:
    """In the in-process world a worker's ranks are threads on one GPU: one GPU each, whatever
    its layouts' ranks."""
    from fuzz.cli.main import build_parser

    envs: list[str] = []

    class Spawned(Exception):
        pass

    def spawn(i, part, plan, run_dir, env, progress):
        envs.append(env["CUDA_VISIBLE_DEVICES"])
        if len(envs) == 2:
            raise Spawned
        return SimpleNamespace(reader=SimpleNamespace(join=lambda timeout=None: None))

    monkeypatch.setattr(jobs_mod, "_spawn", spawn)
    monkeypatch.setattr(jobs_mod, "visible_gpus", lambda: ["0", "1"])
    monkeypatch.setattr(jobs_mod, "gpu_free_bytes", lambda device: [140 * GIB] * 2)
    monkeypatch.setattr(jobs_mod.tempfile, "mkdtemp", lambda prefix: str(tmp_path))
    args = build_parser().parse_args(["run", "--device", "cuda", "--jobs", "2"])
    with pytest.raises(Spawned):
        jobs_mod.run_jobs(args, 2, ["tp1pp2", "tp2pp2"], [SimpleNamespace(device="cpu")], ["eager"])
    assert envs == ["0", "1"]


def test_check_gpu_count_names_the_layout_and_the_gpus() -> None:
    check_gpu_count("cuda", ["tp1pp2", "tp2pp1"], "torch", count=2)
    check_gpu_count("cuda", ["tp8pp1"], "inproc", count=1)  # rank threads share one GPU
    check_gpu_count("cpu", ["tp8pp1"], "torch", count=0)  # gloo: no GPU
    with pytest.raises(BadInput) as e:
        check_gpu_count("cuda", ["tp1pp1", "tp2pp2", "tp1pp2"], "torch", count=2)
    msg = str(e.value)
    assert "\n" not in msg and "tp2pp2" in msg and "4 GPUs" in msg and "2 are visible" in msg
    with pytest.raises(BadInput, match="1 is visible"):
        check_gpu_count("cuda:0", ["tp1pp2"], "torch", count=1)


@pytest.mark.parametrize("jobs", [[], ["--jobs", "1"], ["--jobs", "2"]])
def test_too_few_gpus_for_a_layout_is_one_line_before_anything_starts(monkeypatch, capsys, tmp_path, jobs) -> None:
    """With or without --jobs: exit 2 and one line, no worker and no campaign started (a
    campaign would otherwise crash every Case of the layout in NCCL: false findings)."""
    import torch

    from fuzz.campaign.loop import Campaign

    def started(*a, **k):
        raise AssertionError("started a campaign or worker")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(jobs_mod, "_spawn", started)
    monkeypatch.setattr(jobs_mod, "run_jobs", started)
    monkeypatch.setattr(Campaign, "run", started)
    code = main(["run", "--device", "cuda", "--world", "torch", "--attention-backend", "torch_flash",
                 "--layouts", "tp1pp1,tp1pp2", "--budget", "5", "--out", str(tmp_path / "out"), *jobs])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith("llmfuzz: --layouts: tp1pp2 needs 2 GPUs with --world torch") and "1 is visible" in err[0]


# -- on GPUs ------------------------------------------------------------------------------------

def _cuda_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _run(args: list[str], tmp_path, env: dict | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=REPO, **(env or {}))
    return subprocess.run([sys.executable, "-m", "fuzz.cli", "run", "--out", str(tmp_path / "out"), *args],
                          capture_output=True, text=True, env=env, cwd=tmp_path, timeout=400)


@pytest.mark.gpu
@pytest.mark.skipif(_cuda_count() < 2, reason="needs 2 CUDA GPUs")
def test_torch_world_jobs_run_a_two_rank_layout_on_two_gpus(tmp_path) -> None:
    p = _run(["--device", "cuda", "--world", "torch", "--layouts", "tp1pp2", "--jobs", "2", "--budget", "30",
              "--shrink-budget", "0", "--json"], tmp_path)
    assert p.returncode == 0, p.stderr[-4000:]
    doc = json.loads(p.stdout)
    assert doc["jobs"] == 2 and all(w["status"] == "ok" and w["examples"] > 0 for w in doc["workers"]), doc["workers"]
    assert doc["failures"] == 0
    assert "2 workers on GPUs 0,1 ×2" in p.stderr, p.stderr[-2000:]


@pytest.mark.gpu
@pytest.mark.skipif(_cuda_count() < 1, reason="needs CUDA")
def test_torch_world_layout_past_the_visible_gpus_is_refused(tmp_path) -> None:
    for jobs in ([], ["--jobs", "2"]):
        p = _run(["--device", "cuda", "--world", "torch", "--layouts", "tp1pp1,tp1pp2", "--budget", "5", *jobs],
                 tmp_path, env={"CUDA_VISIBLE_DEVICES": "0"})
        err = p.stderr.strip().splitlines()
        assert p.returncode == 2 and "tp1pp2 needs 2 GPUs" in err[-1] and "1 is visible" in err[-1], p.stderr
