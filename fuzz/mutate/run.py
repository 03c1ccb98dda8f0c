"""Mutation analysis: draw mutants, run each in its own process, classify it.

The parent draws the mutants (fuzz.mutate.points, uniformly over every point of the files)
and a fixed list of Cases (the campaign's strategies, seeded), then runs the baseline (an
unmutated copy of the package) and every mutant as `python -m fuzz.mutate.worker` processes,
`jobs` at a time, each killed at its timeout. A mutant is
- stillborn: it failed to import, or to build an engine;
- caught: the campaign found a failure in its budget ("timeout": its process hung past the
  timeout and was killed, counted as caught);
- observable: caught, or one of the fixed Cases differed from the baseline bitwise, in its
  outputs (tokens, logits, sampling records) or only in its FA call records (`observed_by`);
  silent: observable and not caught (a survivor the campaign should have seen);
- unobserved: neither (equivalent, as far as these Cases can tell);
- error: the worker itself failed (not the engine): counted apart, never scored.

`--target vllm` differs in its worker (fuzz.mutate.vllm_worker), its fixed Cases, what is
digested and the timeout (fuzz.mutate.vllm); the classification is the same, the engine's
schedule (its step count) standing where the FA records stand. vLLM's engines run in
processes of their own sessions, so a mutant's processes are found by a tag in their
environment (`TAG_ENV`), not by process group, and all are killed when it ends.
"""
from __future__ import annotations

import concurrent.futures
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field

from fuzz.mutate.points import Mutant, MutationError, points
from fuzz.mutate.sources import REPO_ROOT, Source, scratch_copy

STARTUP_S = 60.0  # a process's imports and first engines, on a loaded two-core machine
TAG_ENV = "LLMFUZZ_MUTANT_TAG"  # in the environment of every process of a mutant's run: its scratch dir


@dataclass
class Plan:
    source: Source
    files: list[str]
    seed: int
    n: int
    budget_s: float
    jobs: int = 1
    num_cases: int = 24
    layouts: tuple[str, ...] = ()  # () = the campaign's (fuzz.cases.strategies.CAMPAIGN_ORDER)
    out_dir: str = "reproducers/mutate"
    timeout_s: float | None = None  # None: from the baseline's time on the Cases
    progress: bool = True
    by_operator: dict = field(default_factory=dict)
    points_total: int = 0


def enumerate_points(plan: Plan) -> list[Mutant]:
    out: list[Mutant] = []
    for rel in plan.files:
        out += points(plan.source.read(rel), rel)
    plan.points_total = len(out)
    plan.by_operator = {}
    for m in out:
        plan.by_operator[m.operator] = plan.by_operator.get(m.operator, 0) + 1
    return out


def sample(all_points: list[Mutant], n: int, seed: int) -> list[Mutant]:
    """`n` mutants drawn uniformly without replacement (all of them when fewer)."""
    picked = random.Random(seed).sample(all_points, min(n, len(all_points)))
    return sorted(picked, key=lambda m: (m.file, m.line, m.col, m.operator, m.mutated))


def draw_cases(seed: int, k: int, layouts: tuple[str, ...] = ()) -> list[dict]:
    """`k` Cases of the campaign's strategies (layouts round robin, both modes), by seed."""
    from hypothesis import HealthCheck, Phase, given, seed as hseed, settings

    from fuzz.campaign.loop import chunk_seed
    from fuzz.cases.strategies import CAMPAIGN_ORDER, cases

    layouts = tuple(layouts) or CAMPAIGN_ORDER
    per = -(-k // len(layouts))
    drawn: list[list[dict]] = []
    for lay in layouts:
        got: dict[str, dict] = {}

        @hseed(chunk_seed(seed, f"mutate:{lay}", 0))
        @settings(max_examples=per + 1, database=None, deadline=None, phases=(Phase.generate,),
                  suppress_health_check=list(HealthCheck))
        @given(cases((lay,), ("eager", "graph")))
        def collect(case):
            got.setdefault(case.key(), case.to_dict())

        collect()
        drawn.append(list(got.values())[-per:])  # the first draw is the simplest Case: last to go
    out = [c for i in range(per) for col in drawn for c in col[i:i + 1]]
    return out[:k]


# CPython 3.11's ast.parse is not thread-safe ("AST constructor recursion depth mismatch",
# seen with --jobs 2): applying a mutant parses its file, one thread at a time.
_AST_LOCK = threading.Lock()
LIVE: dict[subprocess.Popen, str] = {}  # mutant processes running now (and their tags), killed on a stop


def tagged(tag: str) -> list[int]:
    """The live processes whose environment carries TAG_ENV=`tag` (Linux /proc; our own only)."""
    needle = f"{TAG_ENV}={tag}".encode()
    out = []
    for d in os.listdir("/proc") if os.path.isdir("/proc") else ():
        if d.isdigit() and int(d) != os.getpid():
            try:
                with open(f"/proc/{d}/environ", "rb") as f:
                    if needle in f.read().split(b"\0"):
                        out.append(int(d))
            except OSError:
                continue
    return out


def _kill(p: subprocess.Popen, tag: str | None = None) -> None:
    try:
        os.killpg(p.pid, signal.SIGKILL)  # the worker and any rank processes it started
    except ProcessLookupError:
        pass
    # What it started in sessions of their own (vLLM's engine processes and theirs), wherever
    # they were re-parented to: each carries the mutant's tag.
    for pid in tagged(tag) if tag else ():
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def mutant_env(tmp: str, base: dict | None = None) -> dict:
    """A mutant process's environment: the scratch copy first on PYTHONPATH, then this
    repository (the harness), then what was there; the tag that finds its processes."""
    base = dict(os.environ if base is None else base)
    return {**base, "PYTHONPATH": os.pathsep.join([tmp, REPO_ROOT, base.get("PYTHONPATH", "")]),
            "PYTHONDONTWRITEBYTECODE": "1", TAG_ENV: tmp}


def run_worker(source: Source, mutant: Mutant | None, spec: dict, timeout_s: float) -> dict:
    """One process on a scratch copy of the package (mutated, or not for the baseline)."""
    tmp = tempfile.mkdtemp(prefix="llmfuzz-mutant-")
    try:
        with _AST_LOCK:
            scratch_copy(source, mutant, tmp)
        spec_path, result_path, log_path = (os.path.join(tmp, n) for n in ("spec.json", "result.json", "log.txt"))
        with open(spec_path, "w") as f:
            json.dump({**spec, "out_dir": os.path.join(tmp, "repro"), "parent_pid": os.getpid(), "scratch": tmp,
                       "package": source.package}, f)
        env = mutant_env(tmp)
        module = "fuzz.mutate.vllm_worker" if source.target == "vllm" else "fuzz.mutate.worker"
        t0 = time.monotonic()
        with open(log_path, "wb") as log:
            # cwd is the scratch directory too: `python -m` puts the cwd first on sys.path, ahead
            # of PYTHONPATH, so a cwd holding the original package would shadow the copy.
            p = subprocess.Popen([sys.executable, "-m", module, spec_path, result_path], cwd=tmp,
                                 env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
            LIVE[p] = tmp
            try:
                rc = p.wait(timeout=timeout_s)
                timed_out = False
            except subprocess.TimeoutExpired:
                _kill(p, tmp)
                rc, timed_out = p.wait(), True
            finally:
                LIVE.pop(p, None)
                _kill(p, tmp)  # anything it left behind (a vLLM engine of a worker that crashed)
        try:
            with open(result_path) as f:
                res = json.load(f)
        except (OSError, ValueError):
            res = {"stage": "start", "digests": [], "campaign": None}
        with open(log_path, "rb") as f:
            res["log_tail"] = f.read()[-2000:].decode(errors="replace")
        res.update(rc=rc, timed_out=timed_out, seconds=round(time.monotonic() - t0, 2))
        if res.get("stage") == "wrong_tree":  # the harness's fault, never the mutant's: an error
            res["log_tail"] = f"{res.get('error')}\n{res['log_tail']}"
        return res
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def classify(res: dict, base: dict) -> dict:
    """A mutant's status from its worker's result and the baseline's (see the module doc)."""
    digests = res.get("digests") or []
    differ = [i for i, (d, b) in enumerate(zip(digests, base["digests"])) if d["outputs"] != b["outputs"]]
    fa_only = [i for i, (d, b) in enumerate(zip(digests, base["digests"]))
               if d["outputs"] == b["outputs"] and d["fa"] != b["fa"]]
    # What the second digest records: the FA calls (reference engine) or the schedule (vLLM's steps).
    seen = "outputs" if differ else base.get("second", "fa_records") if fa_only else None
    # An engine error on a differing Case (an invariant, a crash): the check that would see it.
    raised = next((digests[i]["raised"] for i in differ if digests[i].get("raised")), None)
    out = {"differing_cases": differ, "fa_only_cases": fa_only, "observed_by": seen, "caught_by": None,
           "raised_on_cases": raised}
    camp = res.get("campaign")
    if res.get("stillborn") or res["stage"] in ("start", "import", "startup"):  # a hang there too
        why = res.get("stillborn") or ("hung at start-up\n" if res["timed_out"] else "") + res["log_tail"]
        return {**out, "status": "stillborn", "detail": why[-600:]}
    if res["timed_out"]:
        return {**out, "status": "caught", "caught_by": f"timeout (killed in stage {res['stage']})"}
    if camp is None or res["rc"] != 0:
        return {**out, "status": "error", "detail": res["log_tail"][-600:]}
    if camp["failures"]:
        f = camp["failures"][0]
        return {**out, "status": "caught", "caught_by": f"{f['property']}: {f['message'][:200]}", "failure": f}
    return {**out, "status": "silent" if seen else "unobserved"}


def plan_cases(plan: Plan) -> list[dict]:
    """The fixed Cases every process runs, drawn once from the seed."""
    if plan.source.target == "vllm":
        from fuzz.mutate.vllm import draw_vllm_cases

        return draw_vllm_cases(plan.seed, plan.num_cases)
    return draw_cases(plan.seed, plan.num_cases, plan.layouts)


def mutant_timeout(plan: Plan, base: dict) -> float:
    """`--timeout`, else from the baseline's times (fuzz.mutate.vllm.timeout_s for vLLM)."""
    if plan.timeout_s:
        return plan.timeout_s
    if plan.source.target == "vllm":
        from fuzz.mutate.vllm import timeout_s

        return timeout_s(plan.budget_s, base)
    return plan.budget_s + 3 * base["cases_seconds"] + STARTUP_S


def worker_spec(plan: Plan, module: str | None, cases: list[dict]) -> dict:
    return {"module": module, "cases": cases, "seed": plan.seed, "budget_s": plan.budget_s,
            "layouts": list(plan.layouts)}


def module_name(rel: str) -> str:
    mod = rel[:-3].replace("/", ".")
    return mod[:-len(".__init__")] if mod.endswith(".__init__") else mod


def run_plan(plan: Plan, mutants: list[Mutant], log=lambda s: None) -> tuple[dict, list[tuple[Mutant, dict]]]:
    """The baseline's result and each mutant's (classified), in the order of `mutants`."""
    cases = plan_cases(plan)
    log(f"{len(cases)} Cases drawn; baseline (unmutated copy) running")
    base = run_worker(plan.source, None, worker_spec(plan, None, cases), plan.timeout_s or 3600.0)
    if base.get("stage") != "done" or base["timed_out"] or len(base["digests"]) != len(cases):
        raise RuntimeError(f"the unmutated engine's run did not finish (stage {base.get('stage')}):\n"
                           f"{base['log_tail'][-1500:]}")
    base["cases"] = cases
    base["second"] = "schedule" if plan.source.target == "vllm" else "fa_records"
    plan.timeout_s = round(mutant_timeout(plan, base), 1)
    log(f"baseline: Cases {base['cases_seconds']:.0f}s, campaign {base['campaign']['examples']} examples, "
        f"{len(base['campaign']['failures'])} failures; per-mutant timeout {plan.timeout_s:.0f}s")
    results: list[dict | None] = [None] * len(mutants)

    def one(i: int) -> None:
        m = mutants[i]
        try:
            res = run_worker(plan.source, m, worker_spec(plan, module_name(m.file), cases), plan.timeout_s)
            results[i] = {**classify(res, base), "seconds": res["seconds"]}
        except MutationError as e:  # the file changed since the points were drawn
            results[i] = {"status": "error", "detail": str(e), "caught_by": None, "observed_by": None,
                          "differing_cases": [], "fa_only_cases": [], "seconds": 0.0}
        log(f"[{sum(r is not None for r in results)}/{len(mutants)}] {m.file}:{m.line} {m.operator} "
            f"{m.original!r} -> {m.mutated!r}: {results[i]['status']}")

    pool = concurrent.futures.ThreadPoolExecutor(max_workers=plan.jobs)
    try:
        for fut in [pool.submit(one, i) for i in range(len(mutants))]:
            fut.result()
    except BaseException:  # a stop (SIGINT/SIGTERM): no mutant starts or runs on
        pool.shutdown(wait=False, cancel_futures=True)
        for p, tag in list(LIVE.items()):
            _kill(p, tag)
            shutil.rmtree(tag, ignore_errors=True)  # its thread's own clean-up may not run now
        raise
    pool.shutdown()
    return base, list(zip(mutants, results))
