"""Loaded at start-up by every Python process of a vLLM target's process group: the target
puts this directory on PYTHONPATH, so the llmfuzz worker, vLLM's engine core and vLLM's
spawned tp/pp workers all run it (vLLM on CPU spawns; a fork inherits it). Standard
library only; vLLM modules are patched only when they are imported (an import hook), so a
process that never imports vLLM pays nothing.

- Stacks on demand: `LLMFUZZ_VLLM_STACKS=DIR` registers faulthandler on SIGUSR1, writing
  every thread's Python stack to DIR/<pid>.txt. The target's watchdog sends SIGUSR1 to the
  whole process group when progress stops, then names the hang by the stuck frame
  (fuzz/targets/vllm/stacks.py). One file per process: dumps of several processes would
  interleave in one log.
- Free blocks: EngineCore gets `llmfuzz_free_blocks`, the KV pool's free blocks, for the
  worker to ask of a core in its own process as a utility call.
- Drafts: `LLMFUZZ_VLLM_DRAFTS=DIR` wraps the v1 model runner's `propose_draft_token_ids`
  and appends, per step, each request's n-gram draft with the number of tokens it was
  drafted from to DIR/<pid>.jsonl; llmfuzz recomputes the drafts from the final tokens
  (fuzz/targets/vllm/drafts.py). vLLM's metrics only count drafts, they cannot tell a
  wrong draft from a rejected one.
- Spin: `LLMFUZZ_VLLM_SPIN_S=S` makes vLLM's shm message-queue readers (tp/pp ranks, the
  driver reading their replies) spin S seconds after a read instead of 1 s before they sleep
  on their socket: on a machine with fewer cores than vLLM has processes, the spinning ranks
  starve the rest (fuzz.targets.vllm.launch.worker_env sets 0.02).
- Planted bugs (`LLMFUZZ_VLLM_PLANT`, for the tests that show a property catches them):
  `ngram_offbyone`: the n-gram proposer matches the window that ends one token early;
  `hang_schedule:N`: the N-th `Scheduler.schedule` call sleeps forever in `planted_hang`;
  `seed_draw_per_row`: the CPU sampler draws from every seeded request's generator once per
  row of the batch, not once for its own row (a generator advanced for rows it did not
  sample: the batch changes a seeded request's tokens, each of which is still one its
  params allow);
  `prefix_hash_ignores_last_token`: a full block's prefix-cache hash leaves out its last
  token, so a prompt that differs from a cached one only there hits the other's KV;
  `prefix_hash_ignores_salt`: the prefix-cache hash leaves out the request's cache salt, so
  a request hits KV cached under another salt (the KV is the same, so no output differs:
  only the reported hits, judged by the harness's own cache model, show it);
  `penalties_rows_reversed`: the sampler's penalties count the output tokens of the batch's
  rows in reverse order (each request penalised by another's history, as after a reorder
  that moved the rows but not their state);
  `abort_keeps_blocks`: the scheduler never returns an aborted request's KV blocks to the pool;
  `wrong_kv_row`: a decode reads one wrong KV row: in a context of 40 tokens or more, position
  10's K and V are position 30's, in every layer, for that call only (a stale or misplaced
  cache row: the error is small, and in bf16 only a measured-noise bound sees it).
"""
import faulthandler
import importlib.abc
import json
import os
import signal
import sys
import time

_PLANT = os.environ.get("LLMFUZZ_VLLM_PLANT", "")


def _register_stacks() -> None:
    d = os.environ.get("LLMFUZZ_VLLM_STACKS")
    if not d:
        return
    try:
        f = open(os.path.join(d, f"{os.getpid()}.txt"), "w")  # noqa: SIM115 - lives as long as the process
        faulthandler.register(signal.SIGUSR1, file=f, all_threads=True, chain=False)
        _register_stacks.file = f
    except (OSError, ValueError, RuntimeError):
        pass


_register_stacks()
os.register_at_fork(after_in_child=_register_stacks)


def planted_hang() -> None:
    """The planted hang's stuck frame (its signature names this function)."""
    while True:
        time.sleep(3600)


def _patch_runner(mod) -> None:
    d = os.environ.get("LLMFUZZ_VLLM_DRAFTS")
    cls = getattr(mod, "GPUModelRunner", None)
    if not d or cls is None or getattr(cls, "_llmfuzz_drafts", False):
        return
    orig = cls.propose_draft_token_ids

    def propose_draft_token_ids(self, scheduler_output, sampled_token_ids, *a, **kw):
        out = orig(self, scheduler_output, sampled_token_ids, *a, **kw)
        spec = getattr(self, "speculative_config", None)
        if spec is None or spec.method != "ngram" or not isinstance(out, list):
            return out
        batch, recs = self.input_batch, []
        max_len = self.model_config.max_model_len
        for i, rid in enumerate(batch.req_ids):
            if i >= len(out) or i >= len(sampled_token_ids) or not len(sampled_token_ids[i]):
                continue  # a partial prefill: no token sampled, so no draft asked for
            n = int(batch.num_tokens_no_spec[i])
            if n >= max_len:
                continue
            recs.append([rid, n, int(scheduler_output.num_spec_tokens_to_schedule), [int(t) for t in out[i]]])
        if recs:
            with open(os.path.join(d, f"{os.getpid()}.jsonl"), "a") as f:
                f.write(json.dumps(recs) + "\n")
        return out

    cls.propose_draft_token_ids = propose_draft_token_ids
    cls._llmfuzz_drafts = True


def _patch_ngram(mod) -> None:
    if _PLANT != "ngram_offbyone":
        return
    import numpy as np

    orig = mod.NgramProposer.propose

    def propose(self, k, sampled_token_ids, num_tokens_no_spec, token_ids_cpu, *a, **kw):
        # The planted bug: the suffix window ends one token early (greedy verification still
        # keeps the output right: only the drafts, and the acceptance, go wrong).
        return orig(self, k, sampled_token_ids, np.maximum(np.asarray(num_tokens_no_spec) - 1, 0), token_ids_cpu,
                    *a, **kw)

    mod.NgramProposer.propose = propose


def _patch_scheduler(mod) -> None:
    if _PLANT == "abort_keeps_blocks":
        free = mod.Scheduler._free_request_blocks

        def _free_request_blocks(self, request):
            if str(request.status).endswith("ABORTED"):  # the planted bug: an aborted request's blocks leak
                return
            return free(self, request)

        mod.Scheduler._free_request_blocks = _free_request_blocks
        return
    if not _PLANT.startswith("hang_schedule:"):
        return
    at, calls = int(_PLANT.split(":", 1)[1]), [0]
    orig = mod.Scheduler.schedule

    def schedule(self, *a, **kw):
        calls[0] += 1
        if calls[0] == at:
            planted_hang()
        return orig(self, *a, **kw)

    mod.Scheduler.schedule = schedule


def _patch_sampler(mod) -> None:
    if _PLANT != "seed_draw_per_row":
        return
    import torch

    orig = mod.TopKTopPSampler.forward_cpu

    def forward_cpu(self, logits, generators, k, p):
        for gen in generators.values():  # the planted bug: one extra draw per other row
            for _ in range(logits.shape[0] - 1):
                torch.randint(0, 2 ** 31, (1,), generator=gen, dtype=torch.long)
        return orig(self, logits, generators, k, p)

    mod.TopKTopPSampler.forward_cpu = forward_cpu


def _patch_block_hash(mod) -> None:
    if _PLANT == "prefix_hash_ignores_salt":
        gen = mod.generate_block_hash_extra_keys

        def generate_block_hash_extra_keys(request, *a, **kw):
            keys, mm_idx = gen(request, *a, **kw)
            # The planted bug: the cache salt is left out of the first block's hash.
            keys = tuple(k for k in keys or () if not (isinstance(k, tuple) and k and k[0] == "cache_salt")) or None
            return keys, mm_idx

        mod.generate_block_hash_extra_keys = generate_block_hash_extra_keys
        return
    if _PLANT != "prefix_hash_ignores_last_token":
        return
    orig = mod.hash_block_tokens

    def hash_block_tokens(hash_function, parent_block_hash, curr_block_token_ids, extra_keys=None):
        tokens = tuple(curr_block_token_ids)
        return orig(hash_function, parent_block_hash, tokens[:-1] + (0,) if tokens else tokens, extra_keys)

    mod.hash_block_tokens = hash_block_tokens


def _patch_penalties(mod) -> None:
    if _PLANT != "penalties_rows_reversed":
        return
    orig = mod.apply_all_penalties

    def apply_all_penalties(logits, prompt_token_ids, presence, frequency, repetition, output_token_ids, *a, **kw):
        return orig(logits, prompt_token_ids, presence, frequency, repetition, list(output_token_ids)[::-1], *a, **kw)

    mod.apply_all_penalties = apply_all_penalties


def _patch_core(mod) -> None:
    """EngineCore.llmfuzz_free_blocks: the KV pool's free blocks, which the worker asks for as a
    utility call when the core runs in its own process (vLLM exposes no such count)."""
    def llmfuzz_free_blocks(self):
        return int(self.scheduler.kv_cache_manager.block_pool.get_num_free_blocks())

    mod.EngineCore.llmfuzz_free_blocks = llmfuzz_free_blocks


def _patch_cpu_attention(mod) -> None:
    if _PLANT != "wrong_kv_row":
        return
    orig = mod.CPUAttentionBackendImpl.forward

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, *a, **kw):
        md = attn_metadata
        if md is None or kv_cache is None or not kv_cache.numel():
            return orig(self, layer, query, key, value, kv_cache, md, output, *a, **kw)
        num_blocks, heads, bs, _ = kv_cache.shape
        kv = kv_cache.view(num_blocks, heads, bs * 2, -1)  # keys at offsets [0, bs), values at [bs, 2 bs)
        starts, lens = md.query_start_loc.tolist(), md.seq_lens.tolist()
        saved = []
        for i, seq_len in enumerate(lens):
            if starts[i + 1] - starts[i] != 1 or seq_len < 40:
                continue  # decodes of long contexts only
            (ba, oa), (bb, ob) = [(int(md.block_table[i, p // bs]), p % bs) for p in (10, 30)]
            for off in (0, bs):  # K, then V
                saved.append((ba, oa + off, kv[ba, :, oa + off].clone()))
                kv[ba, :, oa + off] = kv[bb, :, ob + off]
        try:
            return orig(self, layer, query, key, value, kv_cache, md, output, *a, **kw)
        finally:
            for b, o, row in reversed(saved):
                kv[b, :, o] = row

    mod.CPUAttentionBackendImpl.forward = forward


def _patch_spin(mod) -> None:
    """`LLMFUZZ_VLLM_SPIN_S`: how long a shm message-queue reader spins after a read before it
    waits on its socket (vLLM: 1 s). Timing only: every message is still read in order."""
    v = os.environ.get("LLMFUZZ_VLLM_SPIN_S")
    if not v:
        return
    orig = mod.SpinCondition.__init__

    def __init__(self, *a, **kw):
        orig(self, *a, **kw)
        if self.is_reader:
            self.busy_loop_s = float(v)

    mod.SpinCondition.__init__ = __init__


_PATCHES = {"vllm.v1.worker.gpu_model_runner": _patch_runner,
            "vllm.distributed.device_communicators.shm_broadcast": _patch_spin,
            "vllm.v1.attention.backends.cpu_attn": _patch_cpu_attention,
            "vllm.v1.engine.core": _patch_core,
            "vllm.v1.spec_decode.ngram_proposer": _patch_ngram,
            "vllm.v1.core.sched.scheduler": _patch_scheduler,
            "vllm.v1.sample.ops.topk_topp_sampler": _patch_sampler,
            "vllm.v1.core.kv_cache_utils": _patch_block_hash,
            "vllm.v1.sample.sampler": _patch_penalties}


class _Hook(importlib.abc.MetaPathFinder):
    """Runs a patch right after its vLLM module is executed."""

    def find_spec(self, name, path, target=None):
        if name not in _PATCHES:
            return None
        sys.meta_path.remove(self)
        try:
            import importlib.util

            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return spec
        loader, patch = spec.loader, _PATCHES[name]

        class _Loader(importlib.abc.Loader):
            def create_module(self, s):
                return loader.create_module(s)

            def exec_module(self, module):
                loader.exec_module(module)
                patch(module)

        spec.loader = _Loader()
        return spec


sys.meta_path.insert(0, _Hook())  # the free-blocks utility is always wanted; the rest check their variables
