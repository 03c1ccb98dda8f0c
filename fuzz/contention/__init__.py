"""Contention as a lever: what runs beside a Case, made, recorded and replayed on purpose.

- `profile`: the profiles (`none`, `cpu[:N]`, `gpu[:N]`, `both[:N]`, lists, `draw`), parsed and checked;
- `coprocs.Contention`: the co-processes of a profile, started and stopped with the command;
  `active()`: the profile in force, which reproducers record;
- `burn`: one co-process (run as a script; imports nothing of llmfuzz);
- `command`: what `run`, `replay`, `minimize` and `selftest` do with `--contention`.

docs/contention.md says when to use it and what a rate means.
"""
from fuzz.contention.coprocs import Contention, active
from fuzz.contention.profile import NONE, Profile, parse_profile

__all__ = ["Contention", "NONE", "Profile", "active", "parse_profile"]
