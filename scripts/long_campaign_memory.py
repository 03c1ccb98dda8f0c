"""Measure memory and open file descriptors over a long `llmfuzz run` campaign.

Runs `llmfuzz run --budget BUDGET` (default layouts and modes, CPU, in-process world) as a
subprocess and samples, every INTERVAL seconds from /proc, the resident memory of the
campaign process and all its descendants (VmRSS summed), the campaign process's own peak
(VmHWM), its thread count and its open file descriptors (plus the descendants'). The JSON
goes to bench/results/long_campaign_cpu.json (or --out):

    python scripts/long_campaign_memory.py --budget 1800 --interval 10

The campaign's own progress lines (stderr, every 15 s when not a terminal) give the example
count at each sample; its summary table gives the final examples and failures.
Reproducers go to a temporary directory, and the campaign runs in it, so the repository's
reproducers/ and Hypothesis database are untouched.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
from fuzz.targets.vllm.process import descendants  # noqa: E402
DEFAULT_OUT = os.path.join(REPO, "bench", "results", "long_campaign_cpu.json")
PROGRESS = re.compile(r"(\d+)s/\d+s (\d+) examples .* failures (\d+)")


def _status(pid: int) -> dict[str, str]:
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            k, _, v = line.partition(":")
            out[k] = v.strip()
    return out


def _kb(v: str | None) -> int:
    return int(v.split()[0]) if v else 0


def fd_count(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def sample(pid: int, t: float, examples: int | None) -> dict:
    st = _status(pid)
    kids = descendants(pid)
    kid_rss = kid_fds = 0
    for k in kids:
        try:
            kid_rss += _kb(_status(k).get("VmRSS"))
            kid_fds += fd_count(k)
        except (OSError, ValueError):
            pass  # gone between listing and reading
    rss = _kb(st.get("VmRSS"))
    return {"t_s": round(t, 1), "examples": examples, "rss_mb": round(rss / 1024, 1),
            "rss_total_mb": round((rss + kid_rss) / 1024, 1), "hwm_mb": round(_kb(st.get("VmHWM")) / 1024, 1),
            "fds": fd_count(pid), "fds_total": fd_count(pid) + kid_fds, "threads": int(st.get("Threads", 0)),
            "children": len(kids)}


def at(samples: list[dict], t: float) -> dict:
    """The sample nearest to `t` seconds."""
    return min(samples, key=lambda s: abs(s["t_s"] - t))


def windows(samples: list[dict], width: float = 120.0) -> list[dict]:
    """Median, min and max RSS per `width` seconds: the trend without the noise of single
    samples (a sample can catch a large Case mid-flight, or the pool mid-eviction)."""
    out: dict[int, list[dict]] = {}
    for s in samples:
        out.setdefault(int((s["t_s"] - 1e-6) // width), []).append(s)
    return [{"from_s": k * width, "to_s": (k + 1) * width, "examples": w[-1]["examples"],
             "rss_mb_median": statistics.median(x["rss_total_mb"] for x in w),
             "rss_mb_min": min(x["rss_total_mb"] for x in w), "rss_mb_max": max(x["rss_total_mb"] for x in w)}
            for k, w in sorted(out.items())]


def parse_table(stdout: str) -> tuple[int | None, int | None]:
    for line in stdout.splitlines():
        if line.startswith("total"):
            parts = line.split()
            return int(parts[1]), int(parts[3])
    return None, None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budget", type=float, default=1800.0, help="campaign seconds (default 1800)")
    ap.add_argument("--interval", type=float, default=10.0, help="sampling period in seconds (default 10)")
    ap.add_argument("--out", default=DEFAULT_OUT, help="JSON result file")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("extra", nargs="*", help="more `llmfuzz run` arguments (after --)")
    args = ap.parse_args(argv)

    work = tempfile.mkdtemp(prefix="llmfuzz-long-")
    cmd = [sys.executable, "-m", "fuzz.cli.main", "run", "--jobs", "1", "--budget", f"{args.budget:g}", "--seed", str(args.seed),
           "--out", os.path.join(work, "repro"), *args.extra]
    shown = "llmfuzz run " + " ".join(cmd[4:])
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    load_start = [round(x, 2) for x in os.getloadavg()]
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=work)
    state = {"examples": None, "failures": 0}
    err_lines: list[str] = []

    def read_err() -> None:
        for line in proc.stderr:
            err_lines.append(line)
            m = PROGRESS.search(line)
            if m:
                state["examples"], state["failures"] = int(m.group(2)), int(m.group(3))
            sys.stderr.write(line)
            sys.stderr.flush()

    reader = threading.Thread(target=read_err, daemon=True)
    reader.start()
    out_box: list[str] = []
    out_reader = threading.Thread(target=lambda: out_box.append(proc.stdout.read()), daemon=True)
    out_reader.start()

    samples: list[dict] = []
    next_t = args.interval
    while proc.poll() is None:
        left = t0 + next_t - time.monotonic()
        if left > 0:
            try:
                proc.wait(timeout=left)
                break
            except subprocess.TimeoutExpired:
                pass
        try:
            s = sample(proc.pid, time.monotonic() - t0, state["examples"])
        except OSError:
            break  # exited between poll and read
        samples.append(s)
        print(json.dumps(s), flush=True)
        next_t += args.interval
    proc.wait()
    reader.join(timeout=10)
    out_reader.join(timeout=10)
    wall = time.monotonic() - t0
    examples, failures = parse_table(out_box[0] if out_box else "")

    first = at(samples, 60.0) if samples else None
    last = samples[-1] if samples else None
    # The last sample within the budget (the summary may follow a shrink past it).
    in_budget = [s for s in samples if s["t_s"] <= args.budget + 1]
    last = in_budget[-1] if in_budget else last

    def growth(key: str) -> float | None:
        if not first or not last or not first[key]:
            return None
        return round(100.0 * (last[key] - first[key]) / first[key], 2)

    # One sample catches a Case mid-flight; the median of a minute of samples does not.
    end_t = last["t_s"] if last else 0.0
    win_first = [s["rss_total_mb"] for s in samples if 60.0 <= s["t_s"] <= 120.0]
    win_last = [s["rss_total_mb"] for s in samples if end_t - 60.0 <= s["t_s"] <= end_t]
    med_first, med_last = (statistics.median(w) if w else None for w in (win_first, win_last))

    result = {
        "command": shown,
        "invocation": "python scripts/long_campaign_memory.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
        "note": "RSS summed over the campaign process and its descendants (none in the in-process world); "
                "load averages say whether anything else ran beside it (the campaign alone is ~1-1.5).",
        "loadavg_start": load_start, "loadavg_end": [round(x, 2) for x in os.getloadavg()],
        "exit_code": proc.returncode,
        "wall_s": round(wall, 1),
        "budget_s": args.budget,
        "interval_s": args.interval,
        "examples": examples if examples is not None else state["examples"],
        "failures": failures if failures is not None else state["failures"],
        "minute_1": first,
        "minute_end": last,
        "rss_mb_minute_1": first and first["rss_total_mb"],
        "rss_mb_minute_end": last and last["rss_total_mb"],
        "rss_growth_pct": growth("rss_total_mb"),
        "peak_rss_mb_minute_1": first and first["hwm_mb"],
        "peak_rss_mb_minute_end": last and last["hwm_mb"],
        "peak_rss_growth_pct": growth("hwm_mb"),
        "rss_mb_median_minute_1_to_2": med_first,
        "rss_mb_median_last_minute": med_last,
        "rss_median_growth_pct": round(100.0 * (med_last - med_first) / med_first, 2) if med_first and med_last else None,
        "rss_mb_max_sample": max((s["rss_total_mb"] for s in samples), default=None),
        "rss_by_2_minutes": windows(samples),
        "fds_minute_1": first and first["fds_total"],
        "fds_minute_end": last and last["fds_total"],
        "fds_max_sample": max((s["fds_total"] for s in samples), default=None),
        "summary_stdout": (out_box[0] if out_box else "")[-4000:],
        "stderr_tail": "".join(err_lines)[-3000:],
        "samples": samples,
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    tmp = args.out + ".tmp"
    with open(tmp, "w") as f:
        json.dump(result, f, indent=1)
    os.replace(tmp, args.out)
    print(json.dumps({k: v for k, v in result.items() if k not in ("samples", "summary_stdout", "stderr_tail")},
                     indent=1))
    return 0 if proc.returncode in (0, 1) else proc.returncode


if __name__ == "__main__":
    sys.exit(main())
