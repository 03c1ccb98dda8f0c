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
PREFIX_HASH_IGNORES_EXTRA_KEY = register(
    "prefix_hash_ignores_extra_key", where="engine/kv_cache.py: KVCacheManager._extra_keys",
    doc="The block hash leaves out the request's extra keys (its cache_salt), so "
        "requests with equal tokens but different salts share KV blocks: the isolation the salt "
        "exists for is gone (the class of vLLM #8240, LoRA ids missing from block manager v2's "
        "hashes, and #44701, extra keys of two sources colliding). Minimum: tp1pp1 with prefix "
        "caching, 1 salted request whose prompt fills a block: the model's KV does not depend "
        "on the salt, so outputs stay right here, and check_accounting catches it (a held block "
        "cached under a hash that is not its holder's salted prefix). "
        "See docs/bug_classes.md#prefix_hash_ignores_extra_key.",
    needs="enable_prefix_caching; equal prompts under different cache_salt")
CACHED_BLOCK_EVICTED_WHILE_REFERENCED = register(
    "cached_block_evicted_while_referenced", where="engine/kv_cache.py: BlockPool.touch",
    doc="A prefix hit on a free cached block raises its ref count but leaves it in "
        "the free queue, so the next allocation can evict it and hand it to another request "
        "while the hitting request still reads it (the ordering vLLM #10507's review caught: "
        "touch before allocating, and take touched blocks off the free queue). Minimum: tp1pp1 "
        "with prefix caching, a request that finishes, then one that hits its prefix; "
        "check_accounting names the block at the end of that step. "
        "See docs/bug_classes.md#cached_block_evicted_while_referenced.",
    needs="enable_prefix_caching; a hit on blocks of a finished or preempted request")
PREFIX_HIT_MID_BLOCK_COUNTED_FULL = register(
    "prefix_hit_mid_block_counted_full", where="engine/kv_cache.py: KVCacheManager._num_full_blocks",
    doc="A block the computed prefix ends inside is counted as full and cached, so "
        "a later request's hit covers positions whose KV no step has written yet and skips "
        "computing them (vLLM #7822: blocks marked computed before their prefill ran; #34587: "
        "Mamba state blocks cached at a chunk boundary inside the block). Minimum: tp1pp2 with "
        "prefix caching and chunked prefill, a prompt whose first chunk ends mid-block, then "
        "a request with the same prefix scheduled while the next chunk is not yet run. "
        "See docs/bug_classes.md#prefix_hit_mid_block_counted_full.",
    needs="enable_prefix_caching, chunked prefill ending mid-block, pp>=2 (or a preemption)")
ABORT_FREES_BLOCKS_IN_FLIGHT = register(
    "abort_frees_blocks_in_flight", where="engine/scheduler.py: Scheduler._free_request",
    doc="A request aborted while one of its microbatches is in flight returns its KV "
        "blocks to the pool at once, not when that microbatch returns, so another request can "
        "be handed them while the step still runs on later PP stages (vLLM #45357: blocks of "
        "a request finished with an async step in flight were reallocated and the stale "
        "in-flight write corrupted the new owner's KV; #32255: blocks of an aborted request "
        "freed while its async KV load still wrote them). Here every stage runs microbatches "
        "in submission order, so outputs stay right and the books catch it: "
        "Scheduler.check_accounting names the block a microbatch in flight lost. Minimum: "
        "tp1pp2, 2 requests, the one in the newer microbatch aborted between steps; or any layout "
        "with the abort landing while its step runs. "
        "See docs/bug_classes.md#abort_frees_blocks_in_flight.",
    needs="an abort of a request with a microbatch in flight (pp>=2, a step ahead, or an abort in step)")
SAMPLING_PENALTY_STALE_ROW = register(
    "sampling_penalty_stale_row", where="engine/sample/state.py: SamplingRows.swap",
    doc="swap_states moves a row's sampling parameters but not its reference to the "
        "request's output-token counts, so after reorder_batch a request's frequency, presence "
        "and repetition penalties read the counts of the request that held its row before (the "
        "class of vLLM v1's persistent-batch bugs: InputBatch keeps per-row sampling state -- "
        "penalty tensors, req_output_token_ids references, generators -- that swap_states and "
        "condense must move with every row, and an array left behind samples a request with "
        "another's state). Minimum: tp1pp1, two requests with penalties whose rows "
        "reorder_batch swaps (a prefill chunk scheduled before a decode). "
        "See docs/bug_classes.md#sampling_penalty_stale_row.",
    needs="requests with penalties in a batch that reorder_batch reorders")
SAMPLING_GENERATOR_ADVANCED_UNSAMPLED = register(
    "sampling_generator_advanced_unsampled",
    where="engine/sample/metadata.py: drawing_rows",
    doc="A seeded request's generator draws on a step where the request samples "
        "nothing (a chunked-prefill step short of the prompt's end), so its later tokens "
        "depend on how its prompt was chunked: batched with others, or on another budget, the "
        "same seed gives other tokens. vLLM v1 samples every row, partial prefills included, "
        "and rewinds their generators by the Philox offset a sample takes "
        "(`generator.set_offset(generator.get_offset() - 4)`, CUDA-specific); a missing or "
        "wrong rewind is this bug. Minimum: tp1pp1, one random-sampling request whose prompt "
        "is prefilled in two chunks, compared with the same request unchunked. "
        "See docs/bug_classes.md#sampling_generator_advanced_unsampled.",
    needs="a random-sampling request whose prefill is chunked; a run that chunks it otherwise")
ASYNC_PLACEHOLDER_NOT_REPLACED = register(
    "async_placeholder_not_replaced", where="engine/input_prep.py: InputPreparer._req_id_to_index",
    doc="With async scheduling a decode runs ahead of its step in flight on a placeholder "
        "token, which the first stage replaces on the device with the token that step sampled, "
        "found by the request's row in that step's batch (vLLM's prev_req_id_to_index). The "
        "map is taken before reorder_batch moved the rows, so a request whose row moved reads "
        "the sampled token of the request that now holds its old row (or an unwritten row's "
        "stale id): its placeholder is never replaced by its own token, and the step computes "
        "another sequence than the one the driver appends (the class of vLLM's async-scheduling "
        "bugs where prev_sampled_token_ids was indexed by a stale row after the persistent batch "
        "was condensed or reordered). Minimum: tp1pp1 with async scheduling, a 2-token prompt "
        "admitted with a 1-token one (reorder_batch puts the one-token row first), then the "
        "first decodes ahead. "
        "See docs/bug_classes.md#async_placeholder_not_replaced.",
    needs="async_scheduling; a batch that reorder_batch reorders among requests that sample, then a decode ahead")
ALLREDUCE_ARRIVAL_ORDER = register(
    "allreduce_arrival_order", where="engine/parallel_state.py: GroupCoordinator._sum_partials",
    doc="The TP all-reduce adds each rank's partial into an output of the activations' dtype "
        "(float32, or bfloat16 in a bfloat16 run) as the partial arrives, as an atomicAdd "
        "reduction does, so the summation order is the order ranks reach "
        "the collective: a run's bits depend on timing, not on the Case (the class of GPU "
        "reductions built on atomics -- split-K GEMMs with atomic adds, scatter_add/index_add_ "
        "on CUDA -- whose results change run to run). Each result is within an ulp or two of "
        "the rank-order sum, far inside the logits tolerance; two partials commute exactly, so "
        "only a TP group of three or more ranks can show it. The arrival order is the "
        "in-process world's (the Schedule's rank order); torch.distributed hands no arrival "
        "order, so there the fault sums in rank order. Minimum: tp4pp1, 1 request of 1 token, "
        "re-run under another Schedule. "
        "See docs/bug_classes.md#allreduce_arrival_order.",
    needs="a TP group of 3 or more ranks; a re-run under another rank order")
SPLIT_K_BY_BATCH_SIZE = register(
    "split_k_by_batch_size", where="engine/model.py: LlamaLayer._linear",
    doc="A layer's GEMMs take a split-K path for batches of fewer than ROW_TILE tokens "
        "(as GEMM heuristics pick split-K for small M) and add the two K halves' partials in the "
        "activation dtype, so a token's bits depend on how many tokens share its batch: the "
        "batch-invariance class of Thinking Machines' 'Defeating Nondeterminism in LLM "
        "Inference' (2025) and of vLLM's batch-invariant mode (kernels whose reduction split "
        "depends on the batch size). Each result is within an ulp or two of the one-pass GEMM, far inside the "
        "logits tolerance. Minimum: tp1pp1, 1 request of 1 token (a batch of one token). "
        "See docs/bug_classes.md#split_k_by_batch_size.",
    needs="a batch of fewer than 16 tokens (every decode step of a small batch)")
SCHED_MAX_NUM_SEQS_OFF_BY_ONE = register(
    "sched_max_num_seqs_off_by_one", where="engine/scheduler.py: Scheduler._room_to_admit",
    doc="The admission check lets one request more than max_num_seqs run at once "
        "(`<=` for `<`). While the extra request never shares a microbatch with all the "
        "others (pp>=2 alternates them) it computes the same tokens: outputs stay "
        "bit-identical; when all meet in one microbatch the ranks, sized for max_num_seqs, "
        "have no persistent-batch row for it. Minimum: tp1pp2, max_num_seqs 2, budget 8, "
        "prompts of 4, 4 and 3 tokens (the third admitted into the second microbatch); the "
        "driver's ScheduleLimits check names it. "
        "See docs/bug_classes.md#sched_max_num_seqs_off_by_one.",
    needs="more requests waiting than max_num_seqs, with max_num_seqs of them running")
SCHED_DRAFTS_OVER_BUDGET = register(
    "sched_drafts_over_budget", where="engine/scheduler.py: Scheduler._drafts_in_budget",
    doc="A decode's drafts are cut to the budget left, not to the budget left after the "
        "decode's own token (`[:budget]` for `[:budget - 1]`), so a microbatch whose budget "
        "runs out at a drafting decode schedules one token more than max_num_batched_tokens. "
        "Greedy verification keeps the tokens and the staging buffers have room, so outputs "
        "stay right; the driver's ScheduleLimits check names the microbatch. Minimum: tp1pp1 "
        "with n-gram drafting, a budget the first decode leaves 2 tokens of, a second decode "
        "with 2 drafts. See docs/bug_classes.md#sched_drafts_over_budget.",
    needs="speculative decoding; a drafting decode where the token budget runs out")
ASYNC_QUEUE_DEPTH_IGNORED = register(
    "async_queue_depth_ignored", where="engine/llm_engine.py: LLMEngine._queue_depth",
    doc="The batch queue is sized by PP stages alone, as if async scheduling were off (vLLM's "
        "max_concurrent_batches computed from pipeline_parallel_size without async_scheduling): "
        "at pp1 one microbatch is in flight, so no step is ever scheduled ahead and async "
        "scheduling is on in the config and off in fact. Outputs stay bit-identical, and a "
        "serving engine loses the overlap it was configured for; the driver's depth check names "
        "the step. Minimum: tp1pp1 with async scheduling, one request of 1 token. "
        "See docs/bug_classes.md#async_queue_depth_ignored.",
    needs="async_scheduling at pp1; a step the Schedule schedules ahead")

# Faults that change what a graph bakes at capture (split-K: a branch of the traced layer):
# with one on, a Case's own first batches must capture (CUDAGraphRunner.reset), so its
# verdict never depends on earlier Cases.
CAPTURE_FAULTS = frozenset({GRAPH_STALE_MAX_SEQLEN, CAPTURE_METADATA_BAKED,
                            SPLIT_K_BY_BATCH_SIZE})


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
