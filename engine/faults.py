"""The fault registry: each known bug class as a named, off-by-default switch.

A fault changes the engine at the one place its real bug lived; the docstring names the
field note (../shared/FIELD_NOTES.md) or upstream report it models. Faults exist to prove
the harness catches bugs (`llmfuzz selftest`), never to make tests pass.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Fault:
    name: str
    doc: str
    needs: str = ""  # what a Case needs for the fault to be reachable (for strategies/selftest)


FAULTS: dict[str, Fault] = {}


def register(name: str, doc: str, needs: str = "") -> None:
    FAULTS[name] = Fault(name, doc, needs)


register("graph_stale_max_seqlen",
         "Field notes 1 and 12: the graph bakes max_seqlen_q / max_seqlen_k of the batch that "
         "triggered its capture instead of bounds valid for every batch of that size, so a "
         "replay with a longer query leaves rows uncomputed (NaN here, garbage on a GPU).",
         needs="graph mode and a later batch with a longer query at the same captured size")
register("pp_shared_staging_buffer",
         "Field note 2: with PP microbatches in flight, the host staging buffer of the next "
         "microbatch is written before the previous microbatch's non_blocking copy landed, so "
         "one batch's scalars meet another's query_start_loc.",
         needs="pp>=2 and a schedule that prepares ahead and delays copies")
register("intermediate_copy_unsynced",
         "Field notes 3 and 5: the non_blocking copy of received IntermediateTensors into the "
         "persistent PP buffer is not waited on before the stage reads the buffer.",
         needs="pp>=2")
register("sp_residual_copy_len",
         "Field note 5: `is_scattered = \"residual\" and is_residual_scattered` is always "
         "is_residual_scattered, so with sequence parallelism hidden_states is copied into the "
         "persistent PP buffer for only num_tokens // tp rows.",
         needs="pp>=2, tp>=2, sequence_parallel")
register("reorder_skips_block_table",
         "Field note 9: reorder_batch swaps a request's rows but not its block-table row, so "
         "requests attend through another request's KV blocks.",
         needs="a batch mixing decodes and prefills in an order reorder_batch changes")
register("pp_stale_new_token_ids",
         "Field note 11: non-last PP ranks keep stale new_token_ids for cached requests "
         "(they miss the last sampled token), so their input_ids differ from the last rank's.",
         needs="pp>=2 and a decode step")


class FaultSet:
    """The faults switched on for one Case; `on(name)` is the hook engine code calls."""

    def __init__(self, names: tuple[str, ...] | list[str] = ()) -> None:
        unknown = [n for n in names if n not in FAULTS]
        if unknown:
            raise ValueError(f"fault: unknown fault {unknown[0]!r} (known: {', '.join(sorted(FAULTS))})")
        self.names = frozenset(names)

    def on(self, name: str) -> bool:
        assert name in FAULTS, name  # a typo in engine code must not silently disable a fault
        return name in self.names
