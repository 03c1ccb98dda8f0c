"""`Contention`: the co-processes of a profile, started and stopped with the command.

Each co-process (fuzz/contention/burn.py) runs in a session of its own, so stopping it
kills its whole group, and asks the kernel to kill it when its parent dies: a campaign
killed by SIGKILL leaves nothing behind. While it runs, `LLMFUZZ_CONTENTION` holds the
profile in force, so every reproducer written in this process or in its workers records it
(fuzz.campaign.reproduce.write_reproducer).

A drawn campaign (`--contention draw`) starts the largest level once and changes level per
cell by pausing (SIGSTOP) and resuming (SIGCONT) co-processes: a CUDA co-process takes
seconds to start, a pause is immediate.
"""
from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time

from fuzz.contention.profile import NONE, Profile

ENV = "LLMFUZZ_CONTENTION"
READY_S = 120.0  # a cold CUDA context on a busy host takes tens of seconds


def active() -> str | None:
    """The profile in force in this process (or the one that started it), as recorded."""
    text = os.environ.get(ENV)
    return text if text and text != "none" else None


class Contention:
    """The co-processes of `profile` (the largest level, for a drawn campaign), running from
    `start()` to `stop()`; `use(level)` runs only those of `level`, pausing the rest."""

    def __init__(self, profile: Profile, device: str = "cuda:0", seed: int = 0) -> None:
        self.profile, self.device, self.seed = profile, device, seed
        self.gpu: list[subprocess.Popen] = []
        self.cpu: list[subprocess.Popen] = []
        self.level = NONE
        self._saved_env = os.environ.get(ENV)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.gpu + self.cpu]

    def start(self) -> "Contention":
        try:
            self.gpu = [self._spawn("gpu", i) for i in range(self.profile.gpu)]
            self.cpu = [self._spawn("cpu", i) for i in range(self.profile.cpu)]
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        self.level = self.profile
        os.environ[ENV] = str(self.profile)
        return self

    def _spawn(self, kind: str, i: int) -> subprocess.Popen:
        script = os.path.join(os.path.dirname(__file__), "burn.py")
        env = {**os.environ, "LLMFUZZ_CONTENTION_PARENT": str(os.getpid())}
        env.pop(ENV, None)
        args = [sys.executable, script, kind, str(self.seed * 1000 + i)] + ([self.device] if kind == "gpu" else [])
        return subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL,
                                env=env, start_new_session=True, text=True)

    def _wait_ready(self) -> None:
        """Every co-process loading its resource before the first Case runs: contention that
        starts halfway through a replay makes its rate meaningless."""
        deadline = time.monotonic() + READY_S
        for p in self.gpu + self.cpu:
            left = deadline - time.monotonic()
            ready, _, _ = select.select([p.stdout], [], [], max(0.0, left))
            line = p.stdout.readline() if ready else ""
            if line.strip() != "ready":
                code = p.wait(timeout=5) if ready else p.poll()  # at EOF it is exiting: its code
                why = f"exited with {code}" if code is not None else f"not ready within {READY_S:.0f}s"
                raise RuntimeError(f"contention co-process ({' '.join(p.args[2:])}) {why}")

    def use(self, level: Profile) -> None:
        """Run `level`'s co-processes (at most those started), pause the others."""
        for procs, n in ((self.gpu, level.gpu), (self.cpu, level.cpu)):
            for i, p in enumerate(procs):
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGCONT if i < n else signal.SIGSTOP)
        self.level = Profile(min(level.gpu, len(self.gpu)), min(level.cpu, len(self.cpu)))
        os.environ[ENV] = str(self.level)

    def stop(self) -> None:
        """Kill every co-process's group and reap it; the environment as it was before."""
        procs, self.gpu, self.cpu = self.gpu + self.cpu, [], []
        for p in procs:
            for sig in (signal.SIGCONT, signal.SIGKILL):  # a paused one must not linger stopped
                try:
                    os.killpg(p.pid, sig)
                except ProcessLookupError:
                    continue  # already gone; it is reaped below
        for p in procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:  # unkillable (D state): say so rather than hang
                print(f"llmfuzz: contention co-process {p.pid} did not exit", file=sys.stderr)
            if p.stdout is not None:
                p.stdout.close()
        if self._saved_env is None:
            os.environ.pop(ENV, None)
        else:
            os.environ[ENV] = self._saved_env
        self.level = NONE

    def __enter__(self) -> "Contention":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
