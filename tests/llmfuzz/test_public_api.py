"""The public surface `import llmfuzz`: every name it promises (docs/targets.md#versioning) is
there, its version is the package's and the reproducers', and it loads nothing heavy before use."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROMISED = {"cases", "check", "check_protocol", "replay", "Target", "Request", "Completion", "Case", "SamplingParams",
            "Violation", "TargetFailure", "BadInput", "__version__"}


def test_every_promised_name_is_exported_and_documented() -> None:
    import llmfuzz

    assert PROMISED <= set(llmfuzz.__all__) and all(hasattr(llmfuzz, n) for n in PROMISED)
    doc = (ROOT / "docs" / "targets.md").read_text()
    versioning = doc[doc.index("## Versioning"):]
    assert all(f"`{n}`" in versioning for n in PROMISED)


def test_the_version_is_the_package_s_and_the_reproducers() -> None:
    import llmfuzz
    from fuzz.campaign.reproduce import LLMFUZZ_VERSION

    pyproject = (ROOT / "pyproject.toml").read_text()
    assert re.search(r'^version = "([^"]+)"', pyproject, re.M).group(1) == llmfuzz.__version__ == LLMFUZZ_VERSION
    assert re.search(r'include = \[.*"llmfuzz\*"', pyproject)  # shipped


def test_importing_llmfuzz_starts_no_engine_and_no_transformers() -> None:
    code = "import sys, llmfuzz; print(' '.join(m for m in ('transformers', 'fuzz.verdict.harness') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT,
                         env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}).stdout.split()
    assert out == []
