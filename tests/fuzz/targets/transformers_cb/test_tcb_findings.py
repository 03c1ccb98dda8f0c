"""Each finding in docs/findings/ about transformers' continuous batching, run as its write-up's
stand-alone script on the installed transformers, on the version it was found with. When a
newer version is installed the reproducers' replay (test_tcb_reproducers.py) says whether it
still fails; this test then says which version the write-up is about."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers")

from fuzz.targets.checkpoint import checkpoint_dir  # noqa: E402
from fuzz.targets.transformers_cb.configs import CB_MODEL  # noqa: E402

ROOT = Path(__file__).resolve().parents[4]
FOUND_ON = "5.24."  # the transformers version the finding was measured on


@pytest.mark.slow
@pytest.mark.skipif(not transformers.__version__.startswith(FOUND_ON),
                    reason=f"found on transformers {FOUND_ON}x; installed {transformers.__version__}")
def test_one_request_over_the_kv_cache_fails_every_request(tmp_path):
    doc = (ROOT / "docs" / "findings" / "transformers_cb_request_over_the_kv_cache.md").read_text()
    script = tmp_path / "finding.py"
    script.write_text(re.search(r"```python\n(.*?)```", doc, re.S).group(1))
    p = subprocess.run([sys.executable, str(script), checkpoint_dir(CB_MODEL)], capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    rows = [line for line in p.stdout.splitlines() if "FAILED" in line]
    assert len(rows) == 2 and all("[]" in r for r in rows), p.stdout  # both requests, neither with a token
    assert "No requests can be scheduled" in p.stdout, p.stdout
