"""`--contention` for the commands that run Cases: parsed and checked before anything starts,
held for the command's whole life (findings are shrunk under the load they were found
under), and, for a drawn campaign, changed per cell (`enter_cell`, called by the campaign).

A replay restores the profile its reproducer recorded, unless `--contention` says otherwise;
a recorded GPU profile on a machine without CUDA is replayed without it, and says so.
"""
from __future__ import annotations

import contextlib
import sys

from fuzz.contention.coprocs import Contention
from fuzz.contention.profile import Profile, check_device, draw_levels, drawn_for, parse_profile
from fuzz.errors import BadInput

# The drawn campaign of this process (`run --contention draw`): a registry of one, so that
# the campaign loop can change level per cell without every target passing it along.
_drawn: dict[str, object] = {}


def _cuda_ok() -> bool:
    import torch

    return torch.cuda.is_available()


def _gpu_device(device: str | None) -> str:
    return device if device and device.startswith("cuda:") else "cuda:0"


def checked(text: str | None, *, allow_draw: bool = False, device: str | None = None) -> Profile | str | None:
    """`--contention TEXT` parsed and checked against this machine (exit 2 on bad input)."""
    profile = parse_profile(text, allow_draw=allow_draw)
    if isinstance(profile, Profile):
        check_device(profile, not profile.gpu or _cuda_ok())
    return profile


@contextlib.contextmanager
def held(profile: Profile | str | None, *, device: str | None = None, seed: int = 0):
    """Run the body under `profile` (None or idle: no co-process). "draw": the largest level
    of `draw_levels` starts paused at none; each cell then takes its drawn level."""
    if profile is None or (isinstance(profile, Profile) and profile.idle):
        yield None
        return
    cuda = device is not None and device != "cpu"
    levels = draw_levels(cuda) if profile == "draw" else None
    top = max(levels, key=lambda p: (p.gpu, p.cpu)) if levels else profile
    c = Contention(top, _gpu_device(device), seed)
    try:
        c.start()
    except RuntimeError as e:
        raise BadInput(f"--contention {profile}: {e}") from None
    say = f"llmfuzz: contention {'drawn per cell from ' + ', '.join(map(str, levels)) if levels else top}"
    print(f"{say} ({len(c.pids)} co-processes)", file=sys.stderr)
    if levels:
        c.use(levels[0])
        _drawn.update(contention=c, levels=levels, seed=seed)
    try:
        yield c
    finally:
        _drawn.clear()
        c.stop()


def enter_cell(cell: str) -> None:
    """A drawn campaign moves to `cell`: its level runs, the rest pause (no-op otherwise)."""
    if _drawn:
        level = drawn_for(cell, _drawn["seed"], _drawn["levels"])
        if level != _drawn["contention"].level:
            _drawn["contention"].use(level)


def for_replay(text: str | None, recorded: str | None) -> Profile | None:
    """The profile a replay runs under: `--contention` when given, else the recorded one.
    A recorded GPU profile this machine cannot make is dropped with a line on stderr."""
    if text is not None:
        return checked(text)
    if not recorded:
        return None
    try:
        profile = parse_profile(recorded)
    except BadInput:
        print(f"llmfuzz: recorded contention {recorded!r} is not a profile this llmfuzz knows: replaying without it",
              file=sys.stderr)
        return None
    if profile.gpu and not _cuda_ok():
        print(f"llmfuzz: recorded under contention {recorded}, which needs CUDA (not available here): "
              "replaying without it; a timing-dependent failure may not show", file=sys.stderr)
        return Profile(cpu=profile.cpu) if profile.cpu else None
    return profile
