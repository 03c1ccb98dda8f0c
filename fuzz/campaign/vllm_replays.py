"""The known vLLM crashes a campaign replays (fuzz.targets.vllm.known): which of them, what
state each is in (`known_crash_states`), and the replays run in a process of their own
beside the campaign (`BackgroundReplays`).

Each known crash whose configs the plan leaves out, and each workload crash the cells draw
around, has its reproducer replayed once per campaign, so the summary says whether it
still fails. A replay is an engine start (pp2 for two of the committed ones) and a run: run
first, before the campaign, they took 53-90 s of a 900 s campaign's wall on 2 cores. In a
process beside it they take no wall time of their own (133-145 s there, measured); they share
the cores with the first cells meanwhile.

    python -m fuzz.campaign.vllm_replays SPEC.json   ({"plan", "known", "python", "worker"})
    -> stdout: each row with its state, a JSON line each, as soon as it has it
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time


def pending_rows(plan: dict | None, crashes=None) -> list[dict]:
    """The known crashes this plan replays, as summary rows without a state yet: each one
    whose configs the plan left out (KNOWN_CRASHES, named in `pairs_excluded`), and each
    workload crash the cells draw around (KNOWN_WORKLOAD_CRASHES). Pairs with their crash."""
    from fuzz.targets.vllm.known import KNOWN_CRASHES, KNOWN_WORKLOAD_CRASHES

    reasons = " ".join((plan or {}).get("pairs_excluded", {}).values())
    out = []
    for k in (*KNOWN_CRASHES, *KNOWN_WORKLOAD_CRASHES) if crashes is None else crashes:
        combos = getattr(k, "combos", None)
        if combos is not None and k.short not in reasons:
            continue
        row = {"signature": k.signature, "reproducer": k.reproducer}
        row.update({"combos": [dict(c) for c in combos]} if combos is not None else {"excluded": k.excluded})
        out.append(row)
    return out


def known_crash_states(target, plan: dict, crashes=None, root: str | None = None, quiet: bool = True,
                       on_state=None) -> list[dict]:
    """Each row of `pending_rows`, its reproducer replayed once on `target` (the installed
    vLLM): "still fails" (the recorded signature), "passes now" (fixed: plan its configs
    again), "fails differently" (another failure: which is named), "no reproducer", or "not
    replayed" when the target's time ran out before the replay could run. `on_state(row)`:
    called with each row as soon as it has its state."""
    from fuzz.campaign.reproduce import CaseFormatError, load_reproducer, replay_on
    from fuzz.targets.vllm.known import ROOT

    out = []

    def done(row: dict) -> None:
        out.append(row)
        if on_state is not None:
            on_state(row)
        if not quiet:
            sys.stderr.write(state_line(row) + "\n")

    for row in pending_rows(plan, crashes):
        try:
            repro = load_reproducer(os.path.join(root or ROOT, row["reproducer"]))
        except CaseFormatError as e:
            done({**row, "state": "no reproducer", "detail": str(e)})
            continue
        unchecked, t0 = getattr(target, "unchecked", 0), time.monotonic()
        verdict, violation = replay_on(target, repro)
        if getattr(target, "unchecked", 0) > unchecked:  # not run: its engine could not start in time
            done({**row, "state": "not replayed", "detail": "the campaign's time ran out"})
            continue
        state = {"reproduces": "still fails", "passes": "passes now", "differs": "fails differently"}[verdict]
        detail = "" if violation is None else getattr(violation, "signature", None) or violation.property
        done({**row, "state": state, "detail": detail, "replay_s": round(time.monotonic() - t0, 1)})
    return out


def state_line(row: dict) -> str:
    """'known crash 402ca48c42d3.json: still fails' (with the detail unless it still fails)."""
    why = f" ({row['detail']})" if row["state"] != "still fails" and row.get("detail") else ""
    return f"known crash {os.path.basename(row['reproducer'])}: {row['state']}{why}"


def _stated(rows: list[dict], states: list[dict], why: str) -> list[dict]:
    """`rows` in order, each with its state from `states` where it has one, else "not replayed"."""
    got = {s["reproducer"]: s for s in states}
    return [got.get(r["reproducer"]) or {**r, "state": "not replayed", "detail": why} for r in rows]


class BackgroundReplays:
    """`known_crash_states` in a process of its own, started now, beside the campaign; its
    vLLM engines start with this process's vLLM Python and worker script. `result(wait_s)`:
    the states (a replay that could not finish in time is "not replayed", with why)."""

    def __init__(self, plan: dict, known: set[str]) -> None:
        from fuzz.targets.vllm import launch

        self.rows = pending_rows(plan)
        self.seconds: float | None = None  # the replays' time, once collected (each row's replay_s)
        self.proc = None
        if not self.rows:
            return
        self._log = tempfile.TemporaryFile()
        spec = {"plan": plan, "known": sorted(known), "python": launch.vllm_python(), "worker": launch.WORKER}
        with tempfile.NamedTemporaryFile("w", suffix=".json", prefix="llmfuzz-replays-", delete=False) as f:
            json.dump(spec, f)
        self._spec = f.name
        # A session of its own: a terminal's Ctrl-C reaches the campaign, which stops this.
        self.proc = subprocess.Popen([sys.executable, "-m", "fuzz.campaign.vllm_replays", self._spec],
                                     stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=self._log,
                                     start_new_session=True)

    def result(self, wait_s: float) -> list[dict]:
        """The states, waiting at most `wait_s` for the replays still running: those are
        stopped and reported "not replayed"."""
        if self.proc is None:
            return []
        why = "the campaign's time ran out"
        try:
            out, _ = self.proc.communicate(timeout=max(0.0, wait_s))
        except subprocess.TimeoutExpired:
            self.stop()
            out, _ = self.proc.communicate()
        else:
            if self.proc.returncode:
                self._log.seek(0)
                tail = self._log.read().decode("utf-8", "replace").strip().splitlines()[-1:]
                why = f"the replay process failed: {(tail or [f'exit {self.proc.returncode}'])[0][:300]}"
        states = []
        for line in out.decode("utf-8", "replace").splitlines():
            try:
                states.append(json.loads(line))
            except ValueError:  # a line cut by the stop, or something else printed: not a state
                continue
        self.seconds = round(sum(r.get("replay_s", 0.0) for r in states), 1)
        return _stated(self.rows, states, why)

    def stop(self) -> None:
        """SIGTERM (it shuts its engines down, fuzz.stop), then SIGKILL of its group after 15 s."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self._log.close()
        try:
            os.unlink(self._spec)
        except OSError:  # already removed (stop() is called again after result())
            pass


def main() -> int:
    from fuzz.stop import terminate_as_interrupt
    from fuzz.targets.vllm import launch
    from fuzz.targets.vllm.checker import VLLMChecker
    from fuzz.targets.vllm.runner import VLLMRunner
    from fuzz.targets.vllm.target import VLLMTarget

    signal.signal(signal.SIGTERM, terminate_as_interrupt)
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    launch.WORKER = spec["worker"]  # the campaign's (llmfuzz mutate and the tests point it elsewhere)
    # No deadline of its own: the campaign stops this process at its hard end (`result`).
    target = VLLMTarget([], checker=VLLMChecker(VLLMRunner(python=spec["python"])), known=set(spec["known"]),
                        plan=spec["plan"])
    try:
        known_crash_states(target, spec["plan"], on_state=lambda row: print(json.dumps(row), flush=True))
    finally:
        target.checker.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
