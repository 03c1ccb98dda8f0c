"""The fault registry: each known bug class as a named, off-by-default switch.

A fault changes the engine at the one place its real bug lived; docs/bug_classes.md has a
section per fault (anchor: the fault's name) on the real bug, with its upstream report where
one is known. Faults exist to prove the harness catches bugs (`llmfuzz selftest`), never to
make tests pass.

Engine code names a fault by its module constant (`faults.on(SP_RESIDUAL_COPY_LEN)`), never
by a string, so a misspelt fault fails at import. Each fault is checked once, in its seam:
the function named by `Fault.where`, whose body is the correct behaviour plus that one check
(tests/engine/test_faults.py holds every `where` to the source).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Fault:
    name: str
    doc: str
    where: str  # the seam: "path: Class.method" of the one function that checks the fault
    needs: str = ""  # what a Case needs for the fault to be reachable (for strategies/selftest)


FAULTS: dict[str, Fault] = {}


def register(name: str, *, where: str, doc: str, needs: str = "") -> str:
    """Add a fault; returns its name, for the module constant engine code uses."""
    if name in FAULTS:
        raise ValueError(f"fault: {name!r} registered twice")
    FAULTS[name] = Fault(name, doc, where, needs)
    return name


GRAPH_STALE_MAX_SEQLEN = register(
    "graph_stale_max_seqlen", where="engine/graph_runner.py: CUDAGraphRunner._capture_bounds",
    doc="The graph bakes max_seqlen_q / max_seqlen_k of the batch that "
        "triggered its capture instead of bounds valid for every batch of that size, so a replay "
        "with a longer query is launched with too few row tiles. Its rows past the last tile "
        "keep stale output memory, here as on the H200 (FA2: 64-row tiles with paged KV), so "
        "logits change only for a query past 64 tokens; the FA invariant check sees any. "
        "Minimum: tp1pp1 graph, 2 requests (a short one captures the size, a longer one "
        "replays it). "
        "See docs/bug_classes.md#graph_stale_max_seqlen.",
    needs="graph mode; a later batch with a longer query at the same captured size")
PP_SHARED_STAGING_BUFFER = register(
    "pp_shared_staging_buffer", where="engine/input_prep.py: InputPreparer._wait_for_staging_copies",
    doc="With PP microbatches in flight, the host staging buffer of the next "
        "microbatch is written before the previous microbatch's non_blocking copy landed, so one "
        "batch's scalars meet another's query_start_loc. Minimum: tp1pp2, 2 requests in two "
        "microbatches, a schedule that prepares ahead and delays copies. "
        "See docs/bug_classes.md#pp_shared_staging_buffer.",
    needs="pp>=2; a schedule with prepare_ahead and copy_delay")
STALE_QUERY_START_LOC_TAIL = register(
    "stale_query_start_loc_tail", where="engine/input_prep.py: InputPreparer._pad_query_start_loc_tail",
    doc="Padded entries of query_start_loc past num_reqs are not refreshed, and a "
        "padded graph reads them (stale offsets of an earlier, larger batch, or poison). Minimum: "
        "tp1pp1 graph, 1 request (the tail holds the reset poison). "
        "See docs/bug_classes.md#stale_query_start_loc_tail.",
    needs="graph mode")
SP_RESIDUAL_COPY_LEN = register(
    "sp_residual_copy_len", where="engine/pp_stage.py: PPStage._copy_len",
    doc="`is_scattered = \"residual\" and is_residual_scattered` is always "
        "is_residual_scattered, so with sequence parallelism hidden_states is copied into the "
        "persistent PP buffer for only num_tokens // tp rows. Minimum: tp2pp2 with SP, 1 request "
        "of 2 tokens (num_tokens // tp < num_tokens). "
        "See docs/bug_classes.md#sp_residual_copy_len.",
    needs="pp>=2, tp>=2, sequence_parallel")
INTERMEDIATE_COPY_UNSYNCED = register(
    "intermediate_copy_unsynced", where="engine/pp_stage.py: PPStage._wait_for_copy",
    doc="The non_blocking copy of received IntermediateTensors into the "
        "persistent PP buffer is not waited on before the stage reads the buffer: when the copy "
        "lands late, the stage reads the buffer's earlier contents. Minimum: tp1pp2, 1 request of "
        "1 token, a schedule that delays copies. "
        "See docs/bug_classes.md#intermediate_copy_unsynced.",
    needs="pp>=2; a schedule with copy_delay")
PP_UNEVEN_PARTITION = register(
    "pp_uneven_partition", where="engine/pp_stage.py: PPStage.layer_end",
    doc="The layer split loses a layer when layers % pp != 0 (the last stage stops "
        "one layer early): pp3 of 8 layers is wrong while every even split is right. Minimum: "
        "tp1pp3 (the smallest pp that does not divide the fuzz model's 8 layers), 1 request. "
        "See docs/bug_classes.md#pp_uneven_partition.",
    needs="pp not dividing num_hidden_layers")
PP_ALLGATHER_NON_REPLICATED = register(
    "pp_allgather_non_replicated", where="engine/pp_stage.py: PPStage._scattered_keys",
    doc="SGLang #30015: the PP send's all_gather optimisation is applied to the "
        "sequence-parallel residual, which differs per TP rank, so the receiver reassembles pieces "
        "of different shards. Minimum: tp2pp2 with SP, 1 request of 2 tokens. "
        "See docs/bug_classes.md#pp_allgather_non_replicated.",
    needs="pp>=2, tp>=2, sequence_parallel")
PP_LOGITS_NOT_BROADCAST = register(
    "pp_logits_not_broadcast", where="engine/pp_stage.py: PPStage._logits_to_sample",
    doc="With broadcast_pp_output, non-last ranks sample from the logits of their "
        "previous step instead of the broadcast ones, so ranks disagree on sampled tokens. "
        "Minimum: tp1pp2 with broadcast_pp_output, 1 request. "
        "See docs/bug_classes.md#pp_logits_not_broadcast.",
    needs="pp>=2, broadcast_pp_output")
REORDER_PARTIAL_SWAP = register(
    "reorder_partial_swap", where="engine/input_prep.py: InputPreparer._reorder_batch",
    doc="reorder_batch swaps a request's token rows but not its block-table row, so "
        "requests attend through another request's KV blocks. Minimum: tp1pp1, a prefill and a "
        "decode in one step in an order reorder_batch changes (2-3 requests, staggered arrival). "
        "See docs/bug_classes.md#reorder_partial_swap.",
    needs="a batch mixing decodes and prefills that reorder_batch reorders")
PP_STALE_NEW_TOKEN_IDS = register(
    "pp_stale_new_token_ids", where="engine/input_prep.py: InputPreparer._new_token_ids",
    doc="Non-last PP ranks drop the newest entry of new_token_ids for cached "
        "requests, so their input_ids lag the last rank's. Minimum: tp1pp2, 1 request of 1 token "
        "with max_tokens 2 (the first decode step). "
        "See docs/bug_classes.md#pp_stale_new_token_ids.",
    needs="pp>=2 and a decode step")
CAPTURE_METADATA_BAKED = register(
    "capture_metadata_baked", where="engine/graph_runner.py: CUDAGraphRunner._capture_num_reqs",
    doc="build_for_cudagraph_capture bakes the capture batch's number of requests "
        "into the graph, so a replay with more real requests treats the extra ones as padding "
        "(their rows are never computed). In this engine padded rows are inert (q_len 0, "
        "seq_len 0), so the visible direction is more requests than at capture. Minimum: tp1pp1 "
        "graph, 1 request captures the size, a later step at that size holds 2. "
        "See docs/bug_classes.md#capture_metadata_baked.",
    needs="graph mode; a replay with more requests than its capture")
SPEC_ROLLBACK_MISSING = register(
    "spec_rollback_missing", where="engine/scheduler.py: Scheduler._rollback_rejected_drafts",
    doc="vLLM #49355, #52071: rejected draft tokens are not rolled back in "
        "num_computed_tokens, so the next step computes from positions past the real sequence "
        "end. Minimum: tp1pp1 with ngram drafting, 1 request whose prompt repeats a token (so a "
        "draft exists) and a draft the model rejects. "
        "See docs/bug_classes.md#spec_rollback_missing.",
    needs="speculative decoding with a rejected draft")

# Faults that change what a graph bakes at capture: with one on, a Case's own first batches
# must capture (CUDAGraphRunner.reset), so its verdict never depends on earlier Cases.
CAPTURE_FAULTS = frozenset({GRAPH_STALE_MAX_SEQLEN, CAPTURE_METADATA_BAKED})


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
