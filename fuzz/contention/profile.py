"""Contention profiles: what else runs on the machine while a Case runs.

A race between an asynchronous copy and the next step ("adding a print makes it vanish") shows
only when something else holds the GPU or the cores long enough to widen its window. A profile
names that something, so a finding can be made, recorded and replayed under it:

    none            nothing beside the run (the default)
    cpu[:N]         N busy cores (default: every core)
    gpu[:N]         N co-processes on the same GPU, each running bf16 matmul bursts and
                    pinned host<->device copies at random intervals (default 3)
    both[:N]        gpu:N and cpu:N
    gpu:3,cpu:6     any comma list of the above: the kinds add up
    draw            (run only) each cell of the campaign draws one of the levels below

The canonical form (`str(profile)`) is what a reproducer records and `replay` restores.
"""
from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass

from fuzz.errors import BadInput

GPU_DEFAULT = 3
KINDS = ("none", "cpu", "gpu", "both", "draw")
MAX_COPROCS = 64  # a typo (cpu:6000) is bad input, not a fork bomb


@dataclass(frozen=True, slots=True)
class Profile:
    gpu: int = 0  # co-processes bursting on the GPU
    cpu: int = 0  # busy cores

    def __str__(self) -> str:
        parts = [f"gpu:{self.gpu}"] * bool(self.gpu) + [f"cpu:{self.cpu}"] * bool(self.cpu)
        return ",".join(parts) or "none"

    @property
    def idle(self) -> bool:
        return not (self.gpu or self.cpu)


NONE = Profile()


def parse_profile(text: str | None, *, allow_draw: bool = False) -> Profile | str | None:
    """`--contention TEXT` -> a Profile, "draw" (where `allow_draw`), or None when not given.
    Anything else is a one-line BadInput naming the problem."""
    if text is None:
        return None
    spec = text.strip().lower()
    if spec == "draw":
        if not allow_draw:
            raise BadInput("--contention draw: only `run` draws a profile per cell; give one profile here")
        return "draw"
    gpu = cpu = 0
    for part in (p.strip() for p in spec.split(",")):
        kind, _, n = part.partition(":")
        if kind not in KINDS or kind == "draw":
            raise BadInput(f"--contention: unknown profile {part!r} (known: none, cpu[:N], gpu[:N], both[:N], "
                           "draw, or a comma list such as gpu:3,cpu:6)")
        if kind == "none":
            if n:
                raise BadInput(f"--contention: {part!r}: none takes no count")
            continue
        count = _count(part, n, GPU_DEFAULT if kind == "gpu" else os.cpu_count() or 1)
        gpu += count if kind in ("gpu", "both") else 0
        cpu += count if kind in ("cpu", "both") else 0
    if gpu > MAX_COPROCS or cpu > MAX_COPROCS:
        raise BadInput(f"--contention {text}: at most {MAX_COPROCS} co-processes of a kind")
    return Profile(gpu, cpu)


def _count(part: str, n: str, default: int) -> int:
    if not n:
        return default
    if not n.isdigit() or int(n) < 1:
        raise BadInput(f"--contention: {part!r}: the count must be a positive integer")
    return int(n)


def check_device(profile: Profile, cuda_ok: bool) -> None:
    """GPU contention needs a GPU to contend for: one line, before anything starts."""
    if profile.gpu and not cuda_ok:
        raise BadInput(f"--contention {profile}: gpu contention needs CUDA, which is not available on this machine")


def draw_levels(cuda: bool) -> tuple[Profile, ...]:
    """The profiles `--contention draw` deals the cells: on CUDA from a quiet GPU to the
    stress that made the transformers-cb race show (three bursting co-processes beside busy
    cores); on the CPU, from none to every core busy."""
    cores = os.cpu_count() or 1
    if cuda:
        return (NONE, Profile(gpu=1), Profile(gpu=GPU_DEFAULT), Profile(gpu=GPU_DEFAULT, cpu=max(1, cores // 2)))
    return (NONE, Profile(cpu=max(1, cores // 2)), Profile(cpu=cores))


def drawn_for(cell: str, seed: int, levels: tuple[Profile, ...]) -> Profile:
    """The level a cell runs under: a function of (seed, cell) only, so a rerun with the same
    seed puts every cell under the same load."""
    digest = hashlib.sha256(f"{seed}\0contention\0{cell}".encode()).digest()
    return levels[int.from_bytes(digest[:4], "big") % len(levels)]
