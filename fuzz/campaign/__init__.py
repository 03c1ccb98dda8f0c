"""A campaign: time-budgeted fuzzing of a target's cells, then shrinking and reproducers.

- `loop.Campaign` (and `sequential` for targets visited cell by cell); `summary`: what it
  reports; `jobs`, `jobs_worker`, `jobs_gpus`: `--jobs N` worker processes and their GPUs;
- `shrink`, `shrink_phase`: the minimizer and the phase after the budget;
- `recorder`, `reproduce`: reproducers written atomically, replayed; `findings`: when and how
  small each failure was; `selftest`: every registry fault fuzzed until it is caught.
"""
