"""A Ray task of `llmfuzz run --cluster` (fuzz.campaign.cluster is the driver's side): one
worker of the campaign, run as `--jobs` runs one (`python -m fuzz.cli run --worker-plan`), in
a scratch directory of its node.

Its reproducers go to the driver's Collector as soon as they are on disk (and again when a
smaller version replaces one), so a task lost mid-campaign loses none it had written. The
Collector's flags reach the worker: stop-on-failure (another task found one: the end file,
read at its next chunk) and a stop (SIGTERM: it stops, writes its report). A task run again
after a lost attempt fuzzes its part for what is left of the budget.
"""
from __future__ import annotations

import collections
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
POLL_S = 0.5


def run_task(index: int, part: dict, plan: dict, collector) -> dict:
    """Worker `index` on `part`: {"report": its Summary doc or None, "exit", "tail", "attempt"}."""
    import ray

    attempt = ray.get(collector.started.remote(index, os.getpid()))
    work = tempfile.mkdtemp(prefix="llmfuzz-ray-")
    try:
        budget = max(1.0, plan["deadline"] - time.time())  # a retry: what is left of the budget
        mine = {**plan, **part, "worker": index, "run_dir": work, "parent_pid": os.getpid(),
                "args": {**plan["args"], "budget": budget}}
        path = os.path.join(work, f"plan{index}.json")
        with open(path, "w") as f:
            json.dump(mine, f)
        env = {**os.environ, **plan.get("env", {}), "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
               "PYTHONPATH": os.pathsep.join(filter(None, (_ROOT, os.environ.get("PYTHONPATH"))))}
        with open(os.path.join(work, "stderr"), "w+") as err:
            proc = subprocess.Popen([sys.executable, "-m", "fuzz.cli", "run", "--worker-plan", path], cwd=work,
                                    stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err, env=env,
                                    start_new_session=True)
            _watch(proc, index, attempt, work, collector)
            err.seek(0)
            tail = collections.deque((x.rstrip() for x in err if x.strip()), maxlen=5)
        report = None
        try:
            with open(os.path.join(work, f"w{index}.json")) as f:
                report = json.load(f)
        except (OSError, ValueError):
            pass
        return {"report": report, "exit": proc.returncode, "tail": " | ".join(tail), "attempt": attempt}
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _watch(proc: subprocess.Popen, index: int, attempt: int, work: str, collector) -> None:
    """Until the worker exits: send its new reproducers, pass the flags both ways."""
    import ray

    sent: dict[str, float] = {}
    end_file, stopping = os.path.join(work, "end"), False
    try:
        while proc.poll() is None:
            time.sleep(POLL_S)
            _send(os.path.join(work, "out"), sent, index, attempt, collector)
            ended, stopped = ray.get(collector.flags.remote(os.path.exists(end_file)))
            if ended and not os.path.exists(end_file):
                open(end_file, "a").close()  # another task's failure ends this one at its next chunk
            if stopped and not stopping:
                stopping = True
                proc.send_signal(signal.SIGTERM)
    except BaseException:  # cancelled, or the driver went away: the worker stops and reports
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        raise
    finally:
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        _send(os.path.join(work, "out"), sent, index, attempt, collector)


def _send(out: str, sent: dict, index: int, attempt: int, collector) -> None:
    """Each reproducer under `out` that is new or rewritten since last sent (not the temp
    files an atomic write leaves for a moment); and those the worker removed since (an
    unfinished one a smaller version replaced under another name), to be removed there too."""
    for path in [p for p in sent if not os.path.exists(p)]:
        collector.drop.remote(index, os.path.relpath(path, out))
        del sent[path]
    for root, _, names in os.walk(out):
        for name in names:
            if not name.endswith(".json") or name.startswith(".tmp-"):
                continue
            path = os.path.join(root, name)
            try:
                mtime = os.stat(path).st_mtime_ns
                if sent.get(path) == mtime:
                    continue
                with open(path, "rb") as f:
                    data = f.read()
            except OSError:
                continue
            collector.put.remote(index, attempt, os.path.relpath(path, out), data)
            sent[path] = mtime
