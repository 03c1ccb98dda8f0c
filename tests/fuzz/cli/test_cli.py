"""`llmfuzz` end to end: exit codes 0 (nothing failed / passes now), 1 (failure found /
reproduces), 2 (bad input: one line on stderr, before any rank starts)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from engine.faults import FAULTS
from engine.inproc_world import InProcWorld
from fuzz.cases.case import Case, RequestSpec, Workload
from fuzz.cli.main import main
from fuzz.campaign.reproduce import load_reproducer, write_reproducer
from fuzz.cases.strategies import FUZZ_MODEL

ROOT = Path(__file__).resolve().parents[3]
SECTIONS = ("Failing case", "What was violated", "Reproduce with", "Minimize with")


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def assert_one_line_error(code: int, out: str, err: str, words: str) -> None:
    assert code == 2, (code, out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("llmfuzz: ") and words in lines[0], lines[0]
    assert "Traceback" not in err


def llmfuzz_command() -> list[str]:
    exe = shutil.which("llmfuzz")
    return [exe] if exe else [sys.executable, "-m", "fuzz.cli.main"]


def test_console_script_run_json(tmp_path) -> None:
    out_dir = tmp_path / "out"
    proc = subprocess.run(
        llmfuzz_command() + ["run", "--budget", "5", "--layouts", "tp1pp1,tp1pp2", "--json", "--out", str(out_dir)],
        capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout)
    for key in ("examples", "failures", "layouts", "modes", "seconds", "reproducers"):
        assert key in summary, summary
    assert summary["examples"] > 0 and summary["failures"] == 0 and summary["reproducers"] == []
    assert set(summary["layouts"]) <= {"tp1pp1", "tp1pp2"} and summary["layouts"]
    assert not out_dir.exists() or not any(out_dir.rglob("*.json"))


BAD_RUN_ARGS = [
    ("bad_layout_string", ["--layouts", "tp2xp4"], "not of the form"),
    ("empty_layouts", ["--layouts", ","], "--layouts"),
    ("tp3_heads_not_divisible", ["--layouts", "tp1pp1,tp3"], "tp=3"),
    ("tp16_heads_not_divisible", ["--layouts", "tp16"], "tp=16"),
    ("more_stages_than_layers", ["--layouts", "pp16"], "more stages"),
    ("unknown_fault", ["--fault", "pp_everything_wrong"], "unknown fault 'pp_everything_wrong'"),
    ("bad_mode", ["--modes", "turbo"], "turbo"),
    ("negative_budget", ["--budget", "-5"], "--budget"),
    ("zero_budget", ["--budget", "0"], "--budget"),
    ("nan_budget", ["--budget", "nan"], "--budget"),
    ("unknown_profile", ["--profile", "weekly"], "weekly"),
    ("negative_shrink_budget", ["--shrink-budget", "-1"], "--shrink-budget"),
    ("nan_shrink_budget", ["--shrink-budget", "nan"], "--shrink-budget"),
]


@pytest.mark.parametrize("args,words", [b[1:] for b in BAD_RUN_ARGS], ids=[b[0] for b in BAD_RUN_ARGS])
def test_run_bad_input_exits_2_with_one_line(capsys, tmp_path, args: list[str], words: str) -> None:
    code, out, err = run_cli(capsys, "run", "--budget", "1", "--out", str(tmp_path), *args)
    assert_one_line_error(code, out, err, words)
    assert not any(tmp_path.iterdir())


BAD_SELFTEST_ARGS = [
    ("unknown_fault", ["--fault", "pp_everything_wrong"], "unknown fault 'pp_everything_wrong'"),
    ("zero_budget", ["--budget-per-fault", "0"], "--budget-per-fault"),
    ("nan_budget", ["--budget-per-fault", "nan"], "--budget-per-fault"),
    ("unknown_profile", ["--profile", "weekly"], "weekly"),
]


@pytest.mark.parametrize("args,words", [b[1:] for b in BAD_SELFTEST_ARGS], ids=[b[0] for b in BAD_SELFTEST_ARGS])
def test_selftest_bad_input_exits_2_with_one_line(capsys, tmp_path, args: list[str], words: str) -> None:
    code, out, err = run_cli(capsys, "selftest", "--fault", "pp_stale_new_token_ids", "--budget-per-fault", "1",
                             "--out", str(tmp_path), *args)
    assert_one_line_error(code, out, err, words)
    assert not any(tmp_path.iterdir())


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="needs a machine without CUDA")
def test_run_cuda_without_cuda_exits_2(capsys, tmp_path) -> None:
    code, out, err = run_cli(capsys, "run", "--budget", "1", "--device", "cuda", "--out", str(tmp_path))
    assert_one_line_error(code, out, err, "CUDA is not available")


def test_run_with_fault_exits_1_writes_reproducer_that_replays(capsys, tmp_path) -> None:
    """One campaign with a fault switched on (it stops at the first, shrunk, failure); its
    reproducer then replays through `llmfuzz replay`. One test, so the campaign runs once."""
    out_dir = tmp_path / "repro"
    code, out, err = run_cli(capsys, "run", "--fault", "pp_uneven_partition", "--layouts", "tp1pp3",
                             "--budget", "10", "--out", str(out_dir))
    assert code == 1, out + err
    files = sorted(out_dir.rglob("*.json"))
    # One file per failure found (Hypothesis may report two distinct ones from the same chunk,
    # e.g. logits in eager and an invariant in graph mode): the unshrunk first version of each
    # was replaced, not kept.
    assert files and len(files) == len({f.parent.name for f in files}), files
    path = str(files[0])
    repro = load_reproducer(path)
    assert files[0].parent.name == repro.property
    assert repro.case.faults == ("pp_uneven_partition",) and repro.case.layout == "tp1pp3"
    assert "FAILED" in out and f"llmfuzz replay {path}" in out
    assert not list(out_dir.rglob(".tmp-*")), "atomic write left a temp file"

    code, out, err = run_cli(capsys, "replay", path)
    assert code == 1, out + err
    for section in SECTIONS:
        assert section + ":" in out, out
    positions = [out.index(s) for s in SECTIONS]
    assert positions == sorted(positions)
    assert f"llmfuzz replay {path}" in out and f"python reproducers/replay.py {path}" in out
    assert f"llmfuzz minimize {path}" in out

    code, out, err = run_cli(capsys, "replay", path, "--json")
    assert code == 1
    doc = json.loads(out)
    assert doc["reproduces"] is True and doc["property"] == doc["recorded_property"] == repro.property
    assert doc["verdict"] == "reproduces" and doc["kind"] == doc["recorded_kind"]


def test_run_json_times_and_sizes_each_finding(capsys, tmp_path, monkeypatch) -> None:
    """`run --json`: each failure says when it was found (seconds, examples before it), its
    property and oracle, the reproducer's size and whether it is minimal; the shrink phase
    says what it did (null: nothing was left to it). The text summary has the same table.
    On a clock each check moves 0.5 s: the budget (finding, then minimizing to the minimum) is
    checks, not seconds of a machine however loaded."""
    from fuzz_testutil import FakeClock, campaigns_on

    campaigns_on(monkeypatch, FakeClock(), check_s=0.5)
    out_dir = tmp_path / "repro"
    code, out, err = run_cli(capsys, "run", "--fault", "pp_uneven_partition", "--layouts", "tp1pp3", "--modes",
                             "eager", "--budget", "12", "--shrink-budget", "5", "--out", str(out_dir), "--json")
    assert code == 1, err[-2000:]
    doc = json.loads(out)
    # The fault shows first as logits; a long Case may show it as a scheduler limit too.
    assert all(d["seconds_to_find"] > 0 and d["examples_before"] >= 0 and d["path"] for d in doc["failure_details"])
    (f,) = [d for d in doc["failure_details"] if d["property"] == "logits"]
    assert f["oracle"] == "reference"
    assert f["size"] == {"requests": 1, "tokens": 1, "layout": "tp1pp3", "mode": "eager"}, f
    assert f["minimal"] is True and f["shrink_seconds"] >= 0
    assert "shrink_phase" in doc  # null when the budget left nothing unshrunk
    assert load_reproducer(f["path"]).meta["minimal"] is True
    from fuzz.campaign.findings import findings_table

    table = findings_table([{**f, **f["size"]}])
    assert "tp1pp3/eager" in table and table.splitlines()[1].split()[-1] == "yes"


def _fault_reproducer(tmp_path, prop: str, message: str) -> str:
    case = Case(FUZZ_MODEL.replace(layout="tp1pp3"), Workload((RequestSpec((1,), 1),)), faults=("pp_uneven_partition",))
    return write_reproducer(str(tmp_path), case, prop, message)


REPLAYS = [  # pp_uneven_partition on tp1pp3 shows as logits beyond tolerance
    ("as_recorded", "logits", "request r0 position 0: max |logits - reference| = 0.9 > tolerance 7.7e-05", 1,
     "reproduces"),
    ("another_property", "fa_invariants", "rank 0 layer 0 microbatch 0: cu_seqlens_q[1]=1 != num_actual_tokens=5", 4,
     "differs"),
    ("another_kind_of_message", "logits", "request r0 position 0: 128 non-finite logits (step 1, microbatch 0)", 4,
     "differs"),
]


@pytest.mark.parametrize("prop,message,code,verdict", [r[1:] for r in REPLAYS], ids=[r[0] for r in REPLAYS])
def test_replay_exit_code_says_what_reproduced(capsys, tmp_path, prop, message, code, verdict) -> None:
    """Exit 1 only when the recorded property and kind of message come back; another violation
    is exit 4, and the text says what was recorded and what happened instead."""
    path = _fault_reproducer(tmp_path, prop, message)
    got, out, err = run_cli(capsys, "replay", path, "--json")
    assert got == code, out + err
    doc = json.loads(out)
    assert doc["verdict"] == verdict and doc["reproduces"] is (code == 1) and doc["property"] == "logits"
    got, out, err = run_cli(capsys, "replay", path)
    assert got == code
    assert ("Not what was recorded" in out) is (code == 4), out


def _passing_reproducer(tmp_path) -> str:
    case = Case(FUZZ_MODEL.replace(layout="tp1pp2"), Workload((RequestSpec((3, 1, 4, 1, 5), 2),)))
    return write_reproducer(str(tmp_path), case, "logits", "was a bug once")


def test_replay_of_passing_case_exits_0(capsys, tmp_path) -> None:
    path = _passing_reproducer(tmp_path)
    code, out, err = run_cli(capsys, "replay", path)
    assert code == 0, out + err
    assert "passes" in out
    for section in SECTIONS:
        assert section + ":" in out


def test_minimize_of_passing_case_exits_0(capsys, tmp_path) -> None:
    path = _passing_reproducer(tmp_path)
    code, out, err = run_cli(capsys, "minimize", path, "--out", str(tmp_path / "min"))
    assert code == 0 and "nothing to minimize" in out
    assert not (tmp_path / "min").exists()


MALFORMED_FILES = [
    ("not_json", "{{{", "not valid JSON"),
    ("truncated", None, "truncated"),
    ("not_an_object", "[]", "expected a JSON object"),
    ("unknown_fault", "unknown_fault", "unknown fault"),
    ("impossible_layout", "impossible_layout", "tp=3"),
]


@pytest.mark.parametrize("kind,text,words", MALFORMED_FILES, ids=[m[0] for m in MALFORMED_FILES])
@pytest.mark.parametrize("command", ["replay", "minimize"])
def test_malformed_reproducer_exits_2_with_one_line(capsys, tmp_path, command, kind, text, words) -> None:
    good = _passing_reproducer(tmp_path)
    full = Path(good).read_text()
    doc = json.loads(full)
    if kind == "truncated":
        text = full[: len(full) // 2]
    elif kind == "unknown_fault":
        doc["case"]["faults"] = ["nope"]
        text = json.dumps(doc)
    elif kind == "impossible_layout":
        doc["case"]["config"]["tensor_parallel_size"] = 3
        text = json.dumps(doc)
    bad = tmp_path / "bad.json"
    bad.write_text(text)
    code, out, err = run_cli(capsys, command, str(bad))
    assert_one_line_error(code, out, err, words)
    assert str(bad) in err


def test_replay_missing_file_exits_2(capsys, tmp_path) -> None:
    code, out, err = run_cli(capsys, "replay", str(tmp_path / "nope.json"))
    assert_one_line_error(code, out, err, "cannot read")


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="needs a machine without CUDA")
def test_replay_of_gpu_reproducer_without_cuda_exits_2(capsys, tmp_path) -> None:
    """A reproducer recorded on a GPU cannot run here: that is bad input (exit 2, one line),
    not 'the failure reproduces' (exit 1)."""
    case = Case(FUZZ_MODEL.replace(layout="tp1pp1", device="cuda"), Workload((RequestSpec((1, 2), 1),)))
    path = write_reproducer(str(tmp_path), case, "logits", "seen on an H200")
    code, out, err = run_cli(capsys, "replay", path)
    assert_one_line_error(code, out, err, "CUDA")


def test_faults_lists_every_registry_fault(capsys) -> None:
    code, out, err = run_cli(capsys, "faults")
    assert code == 0
    names = [line for line in out.splitlines() if line and not line.startswith(" ")]
    assert names == list(FAULTS)
    code, out, err = run_cli(capsys, "faults", "--json")
    assert code == 0 and sorted(json.loads(out)) == sorted(FAULTS)


def test_replay_script_from_checkout(tmp_path) -> None:
    """`python reproducers/replay.py FILE` works without installing: the script puts the
    checkout first on sys.path. A malformed file keeps it fast (exit 2 before torch loads)."""
    bad = tmp_path / "bad.json"
    bad.write_text("{ truncated")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([sys.executable, str(ROOT / "reproducers" / "replay.py"), str(bad)],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path, env=env)
    assert proc.returncode == 2, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and "not valid JSON" in proc.stderr


def test_replay_script_passing_case(tmp_path) -> None:
    path = _passing_reproducer(tmp_path)
    proc = subprocess.run([sys.executable, str(ROOT / "reproducers" / "replay.py"), path, "--json"],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout)["reproduces"] is False


def test_inproc_world_shutdown_joins_rank_threads() -> None:
    """The CLI exits right after closing its engines. A rank thread still unwinding at
    interpreter exit aborted the process ('terminate called without an active exception',
    exit 134 instead of 0/1), so shutdown must return only once parked rank threads ended."""
    world = InProcWorld(32, timeout_s=10.0)
    for r in range(32):
        world.start(r, lambda r=r: world.wait_for(r, lambda: False, "parked"))
    world.run_until(lambda: all(x.state == "blocked" for x in world.ranks), "park every rank")
    world.shutdown()
    alive = [r.rank for r in world.ranks if r.thread.is_alive()]
    assert not alive, f"rank threads still running after shutdown: {alive}"


def test_hypothesis_reports_go_to_stderr_and_leave_the_json_alone(monkeypatch, capsys) -> None:
    """A slow shrink makes Hypothesis print a warning; on stdout it broke `run --json`'s one
    JSON document (a 900 s bf16 campaign's): it goes to stderr."""
    import fuzz.cli.main as cli_main
    from hypothesis.reporting import report

    def noisy(args):
        report("WARNING: Hypothesis has spent more than five minutes working to shrink a failing example")
        print(json.dumps({"examples": 1}))
        return 0

    monkeypatch.setattr(cli_main, "cmd_faults", noisy)
    assert cli_main.main(["faults", "--json"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out) == {"examples": 1} and "five minutes" in err
