"""`llmfuzz run --cluster ray[://ADDRESS]`: the workers of `run --jobs N` as Ray tasks, on
whichever machines of a Ray cluster have room (fuzz.campaign.cluster_task is a task's side).

The campaign is dealt as `--jobs` deals it (fuzz.campaign.jobs.partition; with --shard, the
shard's part dealt again), one task per worker, each asking Ray for what a worker uses: a CPU
(the in-process world: rank threads in one process) or its largest layout's tp × pp CPUs
(--world torch: a process a rank), and on CUDA a GPU, or tp × pp GPUs with --world torch
(Ray sets the task's CUDA_VISIBLE_DEVICES). A task runs the worker as `--jobs` does (`run
--worker-plan`), in a scratch directory on its node, and sends each reproducer to the driver
as soon as it is written (a `Collector` actor), so the driver writes them under `--out` as
they come; a task returns the worker's report. Stop-on-failure and a stop (SIGINT/SIGTERM to
the driver) reach every task through the Collector.

A task whose worker process or node is lost is run again by Ray (`MAX_RETRIES`): the same
part, for what is left of the budget. The reproducers its lost attempt sent are kept, and
any its last attempt does not report again are failures of the summary (`lost_failures`).
Every node needs this llmfuzz installed (the same version as the driver).
"""
from __future__ import annotations

import contextlib
import json
import os
import sys
import time

from fuzz.errors import EXIT_FAIL, EXIT_OK, EXIT_UNWRITTEN, BadInput

MAX_RETRIES = 2  # attempts after a lost one (worker process or node died)
MARGIN_S = 180.0  # past budget + shrink budget: Ray scheduling, start-up, a retry's start


def parse_cluster(text: str | None) -> str | None:
    """--cluster ray[://ADDRESS] (None: not given): the address for ray.init ("" for a local
    or RAY_ADDRESS cluster), checked, and ray importable, before anything starts."""
    if text is None:
        return None
    text = text.strip()
    if text != "ray" and not text.startswith("ray://"):
        raise BadInput(f"--cluster: {text!r} is not ray or ray://HOST:PORT")
    try:
        import ray  # noqa: F401
    except ImportError:
        raise BadInput("--cluster ray: the ray package is not installed (pip install 'llmfuzz[cluster]', "
                       "or pip install ray)") from None
    return "" if text == "ray" else text


def task_resources(part: dict, device: str, world: str) -> dict:
    """What Ray reserves for a worker of `part`: CPUs, and GPUs on CUDA."""
    from fuzz.campaign.jobs_gpus import gpus_needed, layout_ranks

    ranks = max(map(layout_ranks, part["layouts"])) if world == "torch" else 1
    return {"num_cpus": ranks, "num_gpus": gpus_needed(part["layouts"], world) if device != "cpu" else 0}


class Collector:
    """The driver's actor: the reproducers tasks send as they write them, the attempts each
    task started, and the flags that end every task (stop-on-failure, a stop)."""

    def __init__(self) -> None:
        self.files: dict[str, tuple[int, int, bytes]] = {}  # relative path -> (worker, attempt, bytes)
        self.attempts: dict[int, int] = {}
        self.ended = self.stopped = False

    def started(self, worker: int, pid: int) -> int:
        self.attempts[worker] = self.attempts.get(worker, 0) + 1
        return self.attempts[worker]

    def put(self, worker: int, attempt: int, rel: str, data: bytes) -> None:
        self.files[rel] = (worker, attempt, data)

    def drop(self, worker: int, rel: str) -> None:
        if self.files.get(rel, (worker,))[0] == worker:  # never one another task holds
            self.files.pop(rel, None)

    def flags(self, end: bool = False) -> tuple[bool, bool]:
        self.ended = self.ended or end
        return self.ended, self.stopped

    def stop(self) -> None:
        self.stopped = True

    def state(self) -> tuple[dict, dict]:
        return self.files, self.attempts


def run_cluster(args, address: str, jobs: int, layouts: list[str], bases: list, shard=None,
                outer: dict | None = None, cells_total: int | None = None) -> int:
    """The campaign in `jobs` Ray tasks; prints the merged summary; the exit code."""
    import ray

    from fuzz.campaign.cluster_task import run_task
    from fuzz.campaign.findings import run_json, run_text
    from fuzz.campaign.jobs import partition, within
    from fuzz.campaign.jobs_worker import plan_args

    parts = partition(layouts, jobs)
    parts = within(outer, parts) if outer is not None else parts
    shrink_s = args.shrink_budget if args.shrink_budget is not None else max(60.0, args.budget / 4)
    plan = {"args": {**plan_args(args), "out": "out"}, "cells_total": cells_total or len(layouts) * len(bases),
            "progress": False, "deadline": time.time() + args.budget,
            # The driver's database and profile choice, for tasks on nodes that do not share its environment.
            "env": {k: os.environ[k] for k in ("LLMFUZZ_DB", "LLMFUZZ_PROFILE") if k in os.environ}}
    out_dir = args.out or "reproducers"
    # Ray prints its own news (a worker died, ...) on the driver's stdout: stderr here, so that
    # stdout holds the summary alone (`--json > summary.json`).
    with contextlib.redirect_stdout(sys.stderr):
        ours = not ray.is_initialized()
        ray.init(address=address or None, ignore_reinit_error=True, log_to_driver=False, logging_level="WARNING")
        try:
            collector = ray.remote(Collector).options(num_cpus=0).remote()
            task = ray.remote(run_task)
            refs = [task.options(max_retries=MAX_RETRIES, **task_resources(p, bases[0].device, args.world))
                    .remote(i, p, plan, collector) for i, p in enumerate(parts)]
            sys.stderr.write(f"llmfuzz: {len(parts)} Ray tasks on {address or 'the local Ray cluster'}: "
                             + "; ".join(f"w{i} {','.join(p['layouts'])}" for i, p in enumerate(parts)) + "\n")
            results, files, attempts, interrupted = _wait(refs, collector, out_dir,
                                                          args.budget + shrink_s + MARGIN_S)
        finally:
            if ours:
                ray.shutdown()
    summary, shrink = _summary(args, parts, results, files, attempts, out_dir)
    summary.interrupted = summary.interrupted or interrupted
    summary.shard = shard
    print(json.dumps(run_json(summary, shrink), indent=1) if args.json else run_text(summary, shrink))
    if summary.write_errors:
        return EXIT_UNWRITTEN
    bad = any(w["status"] != "ok" for w in summary.workers)
    return EXIT_FAIL if summary.failures or bad else EXIT_OK


def _wait(refs: list, collector, out_dir: str, seconds: float) -> tuple[list, dict, dict, bool]:
    """Wait for every task (at most `seconds`), writing the reproducers as they arrive.
    Returns (each task's result or its error, the files, attempts per worker, interrupted)."""
    import ray

    from fuzz.stop import stop_requested

    end, written, interrupted = time.monotonic() + seconds, {}, False
    pending = list(refs)
    try:
        while pending and time.monotonic() < end:
            if stop_requested():
                raise KeyboardInterrupt
            _, pending = ray.wait(pending, num_returns=len(pending), timeout=1.0)
            _write_new(ray.get(collector.state.remote())[0], written, out_dir)
    except KeyboardInterrupt:  # every task stops as a --jobs worker does: it reports what it has
        interrupted = True
        collector.stop.remote()
        ray.wait(pending, num_returns=len(pending), timeout=60.0)
    results = []
    for r in refs:
        try:
            results.append(ray.get(r, timeout=0.1))
        except Exception as e:  # lost past its retries, or still running at the limit
            ray.cancel(r, force=True)
            results.append({"error": f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"})
    files, attempts = ray.get(collector.state.remote())
    _write_new(files, written, out_dir)
    return results, files, attempts, interrupted


def _write_new(files: dict, written: dict, out_dir: str) -> None:
    """The reproducers not yet written (or changed since: a smaller version) under `out_dir`;
    those no task holds any more (replaced by a smaller one) removed."""
    from fuzz.campaign.reproduce import write_json_atomic

    for rel in [r for r in written if r not in files]:
        try:
            os.remove(os.path.join(out_dir, rel))
        except OSError:
            pass
        del written[rel]

    for rel, (worker, attempt, data) in files.items():
        if written.get(rel) == data:
            continue
        write_json_atomic(os.path.join(out_dir, rel), json.loads(data))
        if rel not in written:
            sys.stderr.write(f"llmfuzz: w{worker} (attempt {attempt}) wrote {os.path.join(out_dir, rel)}\n")
        written[rel] = data


def _summary(args, parts: list[dict], results: list, files: dict, attempts: dict, out_dir: str):
    """The merged Summary: the tasks' reports (paths as the driver wrote them), a row per
    task, and the reproducers of lost attempts that no report names as failures."""
    from fuzz.campaign.jobs_worker import merge_reports

    reports = []
    for i, (p, r) in enumerate(zip(parts, results)):
        report = r.get("report")
        for f in (report or {}).get("failures", []):
            if f.get("path"):
                f["path"] = os.path.join(out_dir, os.path.relpath(f["path"], "out"))
        reports.append((i, p, report))
    summary, shrink = merge_reports(reports, budget_s=args.budget, seed=args.seed)
    summary.seconds = max((w["seconds"] for w in summary.workers if w["seconds"] is not None), default=0.0)
    for i, (row, r) in enumerate(zip(summary.workers, results)):
        row["attempts"] = attempts.get(i, 0)
        row["exit"] = r.get("exit")
        if row["status"] == "no report":
            row["status"], row["error"] = "lost", r.get("error") or r.get("tail") or "no report"
            row["reproducers"] = sorted(os.path.join(out_dir, rel) for rel, v in files.items() if v[0] == i)
    summary.failures += lost_failures(files, summary.failures, out_dir)
    return summary, shrink


def lost_failures(files: dict, reported: list, out_dir: str) -> list:
    """A Failure for each reproducer the tasks sent (relative path -> (worker, attempt, JSON
    bytes), written under `out_dir`) that no report names: found by an attempt that was lost
    before it reported."""
    from fuzz.campaign.findings import case_size
    from fuzz.campaign.reproduce import load_reproducer
    from fuzz.campaign.summary import Failure

    named = {f.path for f in reported}
    out = []
    for rel, (worker, attempt, _) in sorted(files.items()):
        path = os.path.join(out_dir, rel)
        if path in named:
            continue
        r = load_reproducer(path)
        out.append(Failure(r.property, r.message, r.case.describe(), path, r.error_ratio,
                           (r.meta or {}).get("oracle"), cell=r.case.layout,
                           meta={"lost_attempt": f"w{worker} attempt {attempt}"}, size=case_size(r.case)))
    return out
