"""The `llmfuzz` pytest plugin in a user's suite: `@given(llmfuzz.cases(...))` tests calling
`llmfuzz.check` under pytest-xdist, with our Hypothesis profile by option, and the shrunk
failure written as a reproducer where `--llmfuzz-reproducers` says."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

SUITE = textwrap.dedent('''
    import re, types
    from pathlib import Path
    from hypothesis import given, settings
    import llmfuzz

    block = re.search(r"## A complete adapter.*?```python\\n(.*?)```", Path(DOC).read_text(), re.S).group(1)
    ex = types.ModuleType("example")
    exec(block, ex.__dict__)

    class Dropped(ex.ReferenceEngineTarget):
        name = "dropped"

        def generate(self, config, requests):  # three requests or more: the last loses a token
            out = super().generate(config, requests)
            if len(requests) >= 3 and len(out[-1].token_ids) > 1:
                out[-1] = llmfuzz.Completion(out[-1].token_ids[:-1], out[-1].logprobs[:-1])
            return out

    BUGGY = Dropped()

    def test_the_profile_is_ours():
        assert settings.default.max_examples == 15 and settings.default.derandomize  # "ci"

    @settings(max_examples=40)
    @given(llmfuzz.cases(layouts=["tp1pp1"], max_requests=3))
    def test_buggy(case):
        llmfuzz.check(BUGGY, case)
''')


@pytest.mark.slow
def test_a_users_suite_runs_under_xdist_with_our_profile_and_writes_reproducers(tmp_path) -> None:
    pytest.importorskip("xdist")
    suite = tmp_path / "test_user_suite.py"
    suite.write_text(f"DOC = {str(ROOT / 'docs' / 'targets.md')!r}\n" + SUITE)
    out = tmp_path / "repro"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    env.pop("LLMFUZZ_PROFILE", None)
    env.pop("LLMFUZZ_REPRODUCERS", None)
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "2", "--rootdir",
                        str(tmp_path), "--llmfuzz-profile", "ci", "--llmfuzz-reproducers", str(out), str(suite)],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert "1 passed" in p.stdout and "1 failed" in p.stdout, p.stdout[-3000:] + p.stderr[-2000:]
    assert "test_buggy" in p.stdout and "llmfuzz reproducer:" in p.stdout
    written = list(out.rglob("*.json"))
    assert len(written) == 1 and written[0].parent.name == "dropped_vs_reference"
    case = json.loads(written[0].read_text())["case"]
    assert len(case["workload"]) == 3  # shrunk to the composition: three requests
    # The last request needs 2 tokens; Hypothesis alone (no minimizer here) takes the others to
    # 1 token, or leaves one at 2 when a loaded machine cuts its shrink short (seen in CI).
    tokens = [r["max_tokens"] for r in case["workload"]]
    assert tokens[-1] >= 2 and sum(tokens) <= 5, tokens
