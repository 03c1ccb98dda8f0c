"""`llmfuzz run --jobs N`: one campaign's cells in N worker processes (fuzz.campaign.jobs_worker is
the worker's side), their summaries merged into one.

Workers are `python -m fuzz.cli run` processes, not threads: a campaign is CPU-bound Python
(the GIL) and the in-process world already runs its ranks as threads on one core each. The
partition is over layouts, each with all its modes (and, on CUDA, kernels) as `--jobs 1` has
them, so a cell is the same strategy everywhere. Fewer workers than layouts: layouts are
dealt to the least loaded worker, costliest first (tp shards every GEMM over rank threads
that meet at each step: tp8 and tp2pp4 cost ~3× tp1pp1), so every cell gets about as many
chunks as in one process's round robin. More workers than layouts: one layout each, the
extra workers on the costliest layouts, a shared layout's chunks dealt between its workers.
On CUDA each worker is dealt its GPUs (CUDA_VISIBLE_DEVICES) by fuzz/campaign/jobs_gpus.py: one in the
in-process world, one a rank of its largest layout with --world torch.

A stop (SIGINT/SIGTERM to the parent) is passed to every worker as one SIGTERM: each stops
as `--jobs 1` does (its failures on disk), writes its report and exits; the parent merges
what arrived and prints it. Workers
run in their own session (a terminal's Ctrl-C reaches the parent only: two signals would cut
a worker's report short) and die with the parent (PR_SET_PDEATHSIG).
"""
from __future__ import annotations

import collections
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

from engine.config import parse_layout
from fuzz.errors import EXIT_FAIL, EXIT_OK, EXIT_UNWRITTEN, BadInput
from fuzz.campaign.jobs_gpus import (deal, gpu_free_bytes, gpu_jobs, gpus_needed, layout_ranks, visible_gpus,
                                     worker_gpu_bytes)
from fuzz.campaign.jobs_worker import merge_reports, plan_args, read_report

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # workers import this llmfuzz
MARGIN_S = 120.0  # past budget + shrink budget: start-up (torch, engines) and the last Case
STOP_GRACE_S = 20.0  # after the SIGTERM, before SIGKILL
_PROGRESS = re.compile(r"\] +\d+s/\d+s (\d+) examples .* failures (\d+)")


def parse_jobs(args) -> int | None:
    """--jobs as given (None: not given), checked before anything starts."""
    raw = getattr(args, "jobs", None)
    if raw is None:
        return None
    try:
        n = int(str(raw).strip())
    except ValueError:
        raise BadInput(f"--jobs: {raw!r} is not a whole number of worker processes") from None
    if n < 1:
        raise BadInput(f"--jobs: {n} worker processes; it takes 1 or more")
    if args.target == "vllm" and n != 1:
        raise BadInput("--jobs: the vllm target runs its cells one after another and owns the machine; "
                       "it takes --jobs 1 only")
    return n


def cpu_cores() -> int:
    """The cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def busy_processes(parts: list[dict], world: str) -> int:
    """Processes computing at once in the workers `parts` (partition's): one per worker in the
    in-process world (rank threads under one GIL); with --world torch each worker's ranks are
    processes of a core each (DistExecutor: one intra-op thread a rank), and a worker runs one
    layout at a time (its chunks round robin; the ranks of its other layouts block on their
    pipes), so a worker counts its largest layout's tp * pp."""
    if world != "torch":
        return len(parts)
    return sum(max(layout_ranks(x) for x in p["layouts"]) for p in parts)


def cpu_jobs(cores: int, layouts: list[str], world: str = "inproc") -> int:
    """The most workers, at most one per layout, whose busy processes fit in `cores`; 1 if
    none do (a campaign runs in this process, as --jobs 1). With --world torch this counts the
    workers' rank processes over the layouts as partition() deals them, not `workers * the
    largest tp*pp`: a worker without a tp8 layout takes fewer cores (8 cores, tp1pp1,tp2pp1,
    tp4pp1: 3 workers, 7 ranks, where cores // 4 would give 2)."""
    for n in range(min(cores, len(layouts)), 1, -1):
        if busy_processes(partition(layouts, n), world) <= cores:
            return n
    return 1


def default_jobs(device: str, layouts: list[str], world: str = "inproc") -> int:
    """Workers when --jobs is not given, at most one per layout (a layout shared between
    workers is an explicit --jobs: a single-layout run stays as it was). CPU: the cores this
    process may run on, counting rank processes with --world torch (cpu_jobs). CUDA (every
    visible GPU, or the one named by cuda:N): that, and no more than the GPUs' free memory
    holds: in the in-process world a worker on one GPU (gpu_jobs); with --world torch on
    "cuda" a worker on as many GPUs as its largest layout has ranks (fuzz/campaign/jobs_gpus.py), so
    the most workers, as partition() deals the layouts, whose GPU sets all fit."""
    n = cpu_jobs(cpu_cores(), layouts, world)
    if device == "cpu" or n == 1:  # n == 1: no GPU to share, and CUDA stays untouched here
        return n
    free, per = gpu_free_bytes(device), worker_gpu_bytes(world)
    if world != "torch" or device != "cuda":  # one GPU a worker (cuda:N: its ranks from GPU N on)
        return gpu_jobs(n, free, len(layouts), per)
    for m in range(n, 1, -1):
        if deal(worker_gpus(partition(layouts, m), world), free, per)[1]:
            return m
    return 1


def worker_gpus(parts: list[dict], world: str) -> list[int]:
    """GPUs each worker of `parts` (partition's) needs."""
    return [gpus_needed(p["layouts"], world) for p in parts]


def oversubscribed(jobs: int, layouts: list[str], world: str, cores: int) -> str | None:
    """The warning for an explicit --jobs whose --world torch rank processes outnumber the
    cores (the run goes ahead as asked), else None."""
    if world != "torch" or jobs < 2:
        return None
    busy = busy_processes(partition(layouts, jobs), world)
    if busy <= cores:
        return None
    return (f"llmfuzz: warning: --jobs {jobs} with --world torch runs up to {busy} rank processes at once "
            f"on {cores} cores: oversubscribed (without --jobs, counting ranks: {cpu_jobs(cores, layouts, world)} "
            f"workers)")


def layout_cost(layout: str) -> float:
    """Relative cost of a layout's example (1 = tp1pp1)."""
    tp, pp = parse_layout(layout)
    return 1 + 2 * (tp * pp - 1) / 7 if tp > 1 else 1 + 0.5 * (pp - 1) / 7


def partition(layouts: list[str], jobs: int, cost=None) -> list[dict]:
    """Each worker's layouts (in campaign order) and its stream of their chunks; `cost`: a
    cell's relative cost (default layout_cost; `run --shard` deals vLLM configs at 1 each)."""
    cost = cost or layout_cost
    order = sorted(range(len(layouts)), key=lambda i: (-cost(layouts[i]), i))
    if jobs >= len(layouts):
        owners = [[i] for i in range(len(layouts))]  # workers per layout, by layout index
        for j in range(jobs - len(layouts)):
            owners[order[j % len(layouts)]].append(None)
        out = []
        for i, ws in enumerate(owners):
            out += [{"layouts": [layouts[i]], "stream": s, "streams": len(ws)} for s in range(len(ws))]
        return out
    load, share = [0.0] * jobs, [[] for _ in range(jobs)]
    for i in order:
        w = min(range(jobs), key=lambda w: (load[w], w))
        load[w] += cost(layouts[i])
        share[w].append(i)
    return [{"layouts": [layouts[i] for i in sorted(s)], "stream": 0, "streams": 1} for s in share]


def within(outer: dict, inner: list[dict]) -> list[dict]:
    """The parts of `inner` (partition's, over the layouts of `outer`, a shard's part: `run
    --shard K/N --jobs M`) as streams of `outer`'s: a worker on stream t of T inside stream s of
    S runs chunks s + S*t mod S*T, so the shard's workers split its chunks, each chunk once."""
    s, n = outer["stream"], outer["streams"]
    return [{**p, "stream": s + n * p["stream"], "streams": n * p["streams"]} for p in inner]


class _Worker:
    def __init__(self, index: int, part: dict, proc: subprocess.Popen, report: str, progress: bool) -> None:
        self.index, self.part, self.proc, self.report = index, part, proc, report
        self.tail: collections.deque[str] = collections.deque(maxlen=20)
        self.examples = self.failures = 0  # from its progress lines
        self.timed_out = False
        self.reader = threading.Thread(target=self._read, args=(progress,), daemon=True)
        self.reader.start()

    def _read(self, forward: bool) -> None:
        """Its stderr: progress lines are summed into the parent's; the rest go on, prefixed."""
        for line in self.proc.stderr:
            m = _PROGRESS.search(line)
            if m:
                self.examples, self.failures = int(m.group(1)), int(m.group(2))
                continue
            if line.strip():
                self.tail.append(line.rstrip())
                clear = "\r\033[K" if sys.stderr.isatty() else ""  # over the parent's progress line
                sys.stderr.write(f"{clear}[w{self.index}] {line}")
                sys.stderr.flush()


def _spawn(i: int, part: dict, plan: dict, run_dir: str, env: dict, progress: bool) -> _Worker:
    path = os.path.join(run_dir, f"plan{i}.json")
    with open(path, "w") as f:
        json.dump({**plan, **part, "worker": i}, f)
    proc = subprocess.Popen([sys.executable, "-m", "fuzz.cli", "run", "--worker-plan", path],
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True, errors="replace", env=env, start_new_session=True)
    return _Worker(i, part, proc, os.path.join(run_dir, f"w{i}.json"), progress)


def _stop(workers: list[_Worker], grace: float) -> None:
    """SIGTERM every live worker once; SIGKILL those still alive after `grace` seconds (or at
    a second interrupt)."""
    for w in workers:
        if w.proc.poll() is None:
            w.proc.send_signal(signal.SIGTERM)
    end = time.monotonic() + grace
    try:
        while any(w.proc.poll() is None for w in workers) and time.monotonic() < end:
            time.sleep(0.1)
    except KeyboardInterrupt:
        pass
    for w in workers:
        if w.proc.poll() is None:
            w.proc.kill()
            w.proc.wait()


def run_jobs(args, jobs: int, layouts: list[str], bases: list, modes: list[str], shard=None,
             outer: dict | None = None, cells_total: int | None = None) -> int:
    """Run the campaign in `jobs` workers (`bases`: one config per kernel, each a cell of every
    layout); print the merged summary; the exit code. A shard (`run --shard K/N`): `layouts`
    are its own, `outer` its part (fuzz.campaign.shard) and `cells_total` the whole campaign's."""
    from fuzz.campaign.findings import run_json, run_text

    render_target = None  # on CUDA the summary names each row's kernel, as one process's does
    if bases[0].device != "cpu":
        from fuzz.targets.kernels import KernelCells

        render_target = KernelCells(None, layouts, modes, tuple(args.fault), bases)
        render_target.cells()
    progress = not args.json and not args.quiet
    parts = partition(layouts, jobs)
    if outer is not None:
        parts = within(outer, parts)
    run_dir = tempfile.mkdtemp(prefix="llmfuzz-jobs-")
    shrink_s = args.shrink_budget if args.shrink_budget is not None else max(60.0, args.budget / 4)
    plan = {"args": plan_args(args), "cells_total": cells_total or len(layouts) * len(bases), "run_dir": run_dir,
            "progress": progress, "parent_pid": os.getpid()}
    gpus = _announce(args, jobs, layouts, parts)
    t0 = time.monotonic()
    workers, interrupted = _run_workers(parts, plan, run_dir, gpus, progress, t0, args.budget + shrink_s)
    try:
        summary, shrink_report = merge_reports([(w.index, w.part, read_report(w.report)) for w in workers],
                                               budget_s=args.budget, seed=args.seed, target=render_target)
        # The workers' campaigns ran side by side: the longest is the campaign's time (start-up
        # excluded, as one process's summary excludes it), so examples/s compare with --jobs 1.
        summary.seconds = max((w["seconds"] for w in summary.workers if w["seconds"] is not None),
                              default=time.monotonic() - t0)
        summary.interrupted = summary.interrupted or interrupted
        summary.shard = shard
        _add_worker_rows(summary, workers, run_dir)
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
    print(json.dumps(run_json(summary, shrink_report), indent=1) if args.json else run_text(summary, shrink_report))
    if summary.write_errors:
        return EXIT_UNWRITTEN
    bad = any(w["status"] in ("crashed", "timed out") for w in summary.workers)
    return EXIT_FAIL if summary.failures or bad else EXIT_OK


def _announce(args, jobs: int, layouts: list[str], parts: list[dict]) -> list[str]:
    """Deal the GPUs and say where each worker runs (one stderr line); each worker's
    CUDA_VISIBLE_DEVICES ([]: none, or all workers on the one `cuda:N` named)."""
    gpus, on = [], ""
    if args.device == "cuda":
        ids = visible_gpus()
        sets, _ = deal(worker_gpus(parts, args.world), gpu_free_bytes("cuda"), worker_gpu_bytes(args.world))
        gpus = [",".join(ids[g] for g in s) for s in sets]
        on = " on " + ", ".join(f"GPU{'s' if ',' in g else ''} {g} ×{gpus.count(g)}" for g in dict.fromkeys(gpus))
    elif args.device != "cpu":
        on = f" on {args.device} ×{len(parts)}"
    if args.jobs is not None:  # an explicit --jobs: obeyed, but oversubscribing ranks is said once
        warning = oversubscribed(jobs, layouts, args.world, cpu_cores())
        if warning:
            sys.stderr.write(warning + "\n")
    sys.stderr.write(f"llmfuzz: {len(parts)} workers{on}: "
                     + "; ".join(f"w{i} {','.join(p['layouts'])}" + (f" (chunks {p['stream']} mod {p['streams']})"
                                                                     if p["streams"] > 1 else "")
                                 for i, p in enumerate(parts)) + "\n")
    return gpus


def _run_workers(parts: list[dict], plan: dict, run_dir: str, gpus: list[str], progress: bool, t0: float,
                 seconds: float) -> tuple[list[_Worker], bool]:
    """Spawn a worker per part and wait for them all, at most `seconds` (+ a margin) from `t0`:
    a hung worker becomes an error line, never a hung parent. Returns (workers, interrupted)."""
    from fuzz.stop import stop_requested

    workers: list[_Worker] = []
    interrupted = False
    try:
        for i, part in enumerate(parts):
            # One compute thread per worker (the Harness sets torch's; these are the BLAS pools').
            env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
                   "PYTHONPATH": os.pathsep.join(filter(None, (_ROOT, os.environ.get("PYTHONPATH"))))}
            if gpus:
                env["CUDA_VISIBLE_DEVICES"] = gpus[i % len(gpus)]
            workers.append(_spawn(i, part, plan, run_dir, env, progress))
        limit, last = t0 + seconds + MARGIN_S, t0
        while any(w.proc.poll() is None for w in workers):
            if stop_requested():
                raise KeyboardInterrupt
            now = time.monotonic()
            if now > limit:
                for w in workers:
                    w.timed_out = w.timed_out or w.proc.poll() is None
                _stop(workers, STOP_GRACE_S)
                break
            if progress and now - last >= (1.0 if sys.stderr.isatty() else 15.0):
                last = now
                _print_progress(workers, now - t0, plan["args"]["budget"])
            time.sleep(0.2)
    except KeyboardInterrupt:
        interrupted = True
        _stop(workers, STOP_GRACE_S)
    finally:
        for w in workers:
            w.reader.join(timeout=5)
    return workers, interrupted


def _print_progress(workers: list[_Worker], el: float, budget: float) -> None:
    n, f = sum(w.examples for w in workers), sum(w.failures for w in workers)
    alive = sum(w.proc.poll() is None for w in workers)
    done = min(20, int(20 * el / budget))
    line = (f"[{'#' * done}{'.' * (20 - done)}] {el:5.0f}s/{budget:.0f}s {n} examples ({n / max(el, 1e-9):.2f}/s) "
            f"workers {alive}/{len(workers)} running, failures {f}")
    sys.stderr.write("\r" + line if sys.stderr.isatty() else line + "\n")
    sys.stderr.flush()


def _add_worker_rows(summary, workers: list[_Worker], run_dir: str) -> None:
    """One row per worker in the summary; one that left no report is an error line, with the
    reproducers it held (on disk: written as found) so none goes unreported."""
    from fuzz.campaign.recorder import Claims

    held = Claims(run_dir, "parent").read()
    for w, row in zip(workers, summary.workers):
        rc = w.proc.returncode
        row["exit"] = rc
        if w.timed_out:
            row["status"], row["error"] = "timed out", "still running past budget + shrink budget + " \
                                                       f"{MARGIN_S:.0f}s; stopped"
        elif row["status"] == "no report":
            row["status"] = "stopped" if rc == 130 else "crashed"
            why = f"killed by signal {-rc}" if rc is not None and rc < 0 else f"exit {rc}"
            row["error"] = f"{why}: {w.tail[-1] if w.tail else 'no output'}"
            row["examples"] = w.examples  # its last progress line: nothing better survived
            row["reproducers"] = sorted(os.path.relpath(p) for p, hs in held.items() if f"w{w.index}" in hs)
