"""`llmfuzz run --cluster ray` (fuzz.campaign.cluster, fuzz.campaign.cluster_task): the --jobs
workers as Ray tasks, reproducers sent back to the driver as they are written; a task whose
worker process is killed is run again and the failure it had found is in the summary; a
reproducer a lost attempt sent that no report names is a failure of the summary; without
ray, or with another cluster kind, one line and exit 2."""
from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import sys
import threading
import time

import pytest

from fuzz.cli.main import main


@pytest.mark.parametrize("value,words", [("slurm", "is not ray or ray://"), ("ray:/x", "is not ray or ray://")])
def test_bad_cluster_exits_2_with_one_line(capsys, tmp_path, value, words) -> None:
    assert main(["run", "--cluster", value, "--budget", "1", "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and words in err[0], err
    assert not (tmp_path / "out").exists()


def test_without_ray_cluster_says_what_to_install(monkeypatch, capsys, tmp_path) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` fails as if not installed
    assert main(["run", "--cluster", "ray", "--budget", "1", "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "pip install 'llmfuzz[cluster]'" in err[0], err
    assert main(["run", "--target", "vllm", "--cluster", "ray", "--budget", "1"]) == 2
    assert "--shard" in capsys.readouterr().err


def test_each_task_asks_for_what_its_worker_uses() -> None:
    from fuzz.campaign.cluster import task_resources

    part = {"layouts": ["tp1pp1", "tp2pp2"], "stream": 0, "streams": 1}
    assert task_resources(part, "cpu", "inproc") == {"num_cpus": 1, "num_gpus": 0}  # rank threads, one core
    assert task_resources(part, "cpu", "torch") == {"num_cpus": 4, "num_gpus": 0}  # a process a rank
    assert task_resources(part, "cuda", "inproc") == {"num_cpus": 1, "num_gpus": 1}
    assert task_resources(part, "cuda", "torch") == {"num_cpus": 4, "num_gpus": 4}  # a GPU a rank (NCCL)


def test_a_lost_attempts_reproducer_is_a_failure(tmp_path) -> None:
    from fuzz.campaign.cluster import lost_failures
    from fuzz.campaign.reproduce import write_reproducer
    from fuzz.campaign.summary import Failure
    from fuzz.cases.case import Case, RequestSpec, Workload
    from fuzz.cases.strategies import FUZZ_MODEL

    out = str(tmp_path / "out")
    files = {}
    for n in (1, 2):
        case = Case(FUZZ_MODEL.replace(layout="tp1pp3"), Workload(tuple(RequestSpec((1,) * 3, 1) for _ in range(n))))
        path = write_reproducer(out, case, "logits", f"m{n}", 2.0, oracle="reference")
        files[os.path.relpath(path, out)] = (1, n, open(path, "rb").read())
    reported = [Failure("logits", "m2", "d", os.path.join(out, sorted(files, key=lambda r: files[r][1])[1]), 2.0)]
    lost = lost_failures(files, reported, out)
    assert len(lost) == 1 and lost[0].message == "m1" and lost[0].size["requests"] == 1
    assert lost[0].oracle == "reference" and lost[0].meta["lost_attempt"] == "w1 attempt 1"


def _worker_of(plan_name: str) -> int | None:
    """The pid of the `run --worker-plan .../PLAN_NAME` process, if running."""
    for d in os.listdir("/proc"):
        try:
            with open(f"/proc/{d}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        if b"--worker-plan" in argv and argv[-2].endswith(plan_name.encode()):
            return int(d)
    return None


def _parent(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().split(")")[-1].split()[1])


@pytest.mark.slow
def test_a_killed_worker_is_run_again_and_its_failure_kept(tmp_path) -> None:
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level="ERROR")
    try:
        out, killed = tmp_path / "out", {}

        def kill_w1_once_it_found_one():  # the campaign runs on the main thread (Hypothesis' settings are per thread)
            t0 = time.monotonic()
            while not list(out.rglob("*.json")) and time.monotonic() - t0 < 150:  # w1 (tp1pp3) found it
                time.sleep(0.2)
            killed["found"], killed["worker"] = sorted(out.rglob("*.json")), _worker_of("plan1.json")
            if killed["worker"] is not None:
                os.kill(_parent(killed["worker"]), signal.SIGKILL)  # the Ray worker process running task w1

        t = threading.Thread(target=kill_w1_once_it_found_one, daemon=True)
        t.start()
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            code = main(["run", "--cluster", "ray", "--layouts", "tp1pp1,tp1pp3", "--modes", "eager",
                         "--fault", "pp_uneven_partition", "--keep-going", "--budget", "30",
                         "--shrink-budget", "5", "--json", "--out", str(out)])
        t.join(timeout=10)
        assert killed.get("found") and killed.get("worker") is not None, killed
        doc = json.loads(buf.getvalue())
        assert code == 1 and doc["failures"] >= 1
        w1 = doc["workers"][1]
        assert w1["layouts"] == ["tp1pp3"] and w1["attempts"] == 2 and w1["status"] == "ok", doc["workers"]
        assert doc["workers"][0]["attempts"] == 1 and doc["workers"][0]["status"] == "ok"
        assert all(os.path.exists(p) for p in doc["reproducers"])
        assert any(d["size"]["layout"] == "tp1pp3" for d in doc["failure_details"])
    finally:
        ray.shutdown()
