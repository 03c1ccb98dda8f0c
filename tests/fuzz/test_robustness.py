"""Interrupted campaigns keep what they found and stop promptly; no orphan threads."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from fuzz.reproduce import load_reproducer

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _start(args, tmp_path):
    env = dict(os.environ, PYTHONPATH=REPO)
    return subprocess.Popen([sys.executable, "-m", "fuzz.cli", "run", "--out", str(tmp_path / "repro"), *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path)


def _wait_for(proc, pattern: str, timeout: float) -> str:
    """Read stderr until `pattern` shows up (the campaign prints progress and FOUND lines)."""
    seen, t0 = "", time.monotonic()
    box: list[str] = []

    def reader():
        for line in proc.stderr:
            box.append(line)

    th = threading.Thread(target=reader, daemon=True)
    th.start()
    while time.monotonic() - t0 < timeout:
        seen = "".join(box)
        if pattern in seen:
            return seen
        time.sleep(0.2)
    proc.kill()
    pytest.fail(f"{pattern!r} not seen within {timeout}s; stderr so far:\n{seen[-2000:]}")


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_signal_keeps_found_failure_and_prints_summary(tmp_path, sig):
    proc = _start(["--budget", "120", "--fault", "pp_stale_new_token_ids", "--keep-going",
                   "--layouts", "tp1pp2", "--modes", "eager"], tmp_path)
    _wait_for(proc, "FOUND", 90)  # the failure is on disk from here on
    proc.send_signal(sig)
    t0 = time.monotonic()
    try:
        out, _ = proc.communicate(timeout=90)
    finally:
        proc.kill()  # never leave a campaign running behind a failed test
    # A few seconds on an idle machine (measured: ~1 s); the bound leaves room for a loaded CI.
    assert time.monotonic() - t0 < 30, "did not stop within a few seconds"
    assert proc.returncode == 1  # failures found still means 1
    assert "layout" in out and "total" in out and "interrupted" in out  # the summary so far
    files = list((tmp_path / "repro").rglob("*.json"))
    assert files and all(load_reproducer(str(f)).case.faults == ("pp_stale_new_token_ids",) for f in files)


@pytest.mark.slow
def test_sigterm_on_clean_campaign_exits_zero_quickly(tmp_path):
    proc = _start(["--budget", "300", "--layouts", "tp2pp2", "--modes", "eager", "--json"], tmp_path)
    _wait_for(proc, "campaign started", 60)
    time.sleep(3)
    proc.send_signal(signal.SIGTERM)
    try:
        out, err = proc.communicate(timeout=90)
    finally:
        proc.kill()
    assert proc.returncode == 0, err[-2000:]
    summary = json.loads(out)
    assert summary["interrupted"] is True and summary["failures"] == 0


def test_bad_reproducer_files_exit_2_without_executing(tmp_path):
    bad = {"truncated.json": '{"format": 1, "case": {"config": {', "notjson.json": "hello",
           "newer.json": json.dumps({"format": 99, "case": {}}),
           "pickle.json": "cos\nsystem\n(S'touch PWNED'\ntR.",
           "impossible.json": json.dumps({"format": 1, "case": {"format": 1, "config": {"tensor_parallel_size": 3},
                                                                "workload": [{"prompt_token_ids": [1], "max_tokens": 1}]}})}
    env = dict(os.environ, PYTHONPATH=REPO)
    for name, text in bad.items():
        p = tmp_path / name
        p.write_text(text)
        r = subprocess.run([sys.executable, "-m", "fuzz.cli", "replay", str(p)], capture_output=True, text=True,
                           env=env, cwd=tmp_path, timeout=180)
        assert r.returncode == 2, (name, r.stderr)
        assert len(r.stderr.strip().splitlines()) == 1, (name, r.stderr)
    assert not (tmp_path / "PWNED").exists()


def test_unwritable_output_prints_case_and_exits_3(tmp_path):
    """/proc refuses new files even for root: the failure must reach stderr whole."""
    env = dict(os.environ, PYTHONPATH=REPO)
    r = subprocess.run([sys.executable, "-m", "fuzz.cli", "run", "--out", "/proc/llmfuzz-unwritable",
                        "--budget", "60", "--fault", "pp_stale_new_token_ids", "--layouts", "tp1pp2",
                        "--modes", "eager", "--quiet"], capture_output=True, text=True, env=env, cwd=tmp_path,
                       timeout=400)
    assert r.returncode == 3, r.stderr[-2000:]
    assert "cannot write reproducer" in r.stderr
    line = r.stderr.split("the failing Case follows as JSON:\n", 1)[1].splitlines()[0]
    from fuzz.case import Case

    assert Case.from_json(line).faults == ("pp_stale_new_token_ids",)
