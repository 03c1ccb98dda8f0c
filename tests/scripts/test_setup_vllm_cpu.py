"""scripts/setup_vllm_cpu.sh chooses its package index before installing anything: PyTorch's
CPU index when it answers, else pip's own configuration alone (an unreachable extra index
costs pip five retries per lookup: ~800 warnings and half an hour)."""
from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "setup_vllm_cpu.sh"


def _probe(index: str) -> tuple[str, float]:
    t0 = time.monotonic()
    r = subprocess.run(["bash", str(SCRIPT), "--probe"], capture_output=True, text=True, timeout=60,
                       env=dict(os.environ, PIP_EXTRA_INDEX_URL=index))
    assert r.returncode == 0, r.stderr
    return r.stdout.strip(), time.monotonic() - t0


def test_an_unreachable_index_is_left_out_within_seconds():
    # A port nothing listens on: refused at once; an address that drops packets: the 5 s bound.
    out, seconds = _probe("http://127.0.0.1:9/whl/cpu")
    assert "pip's configured indexes only" in out and "127.0.0.1:9" in out and seconds < 30


def test_a_reachable_index_is_used(tmp_path):
    (tmp_path / "simple" / "torch").mkdir(parents=True)
    out, _ = _probe(f"file://{tmp_path}/simple")
    assert out == f"setup_vllm_cpu.sh: would install with --extra-index-url file://{tmp_path}/simple"
