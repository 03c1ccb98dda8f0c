"""Inside the transformers-cb worker (torch and the standard library only): what the library's
continuous batching does not return, read at the points it passes through.

`LogitsTap`: top-k logprobs per generated token. transformers 5.24 returns, with
`return_logprobs`, only the chosen token's log(softmax) in fp32. The tap copies the LM
head's output (a forward hook on `lm_head`: the rows the library samples from, before its
own fp32 cast) into a buffer allocated up front, and at each batch update (a wrapper
around the IO object's `prepare_batch_update`, which the library calls once per batch with
the batch's requests and new tokens) gives row j to the j-th request of the batch that has
a new token (the library's own order, `ContinuousBatchProcessor.update_batch`); the
fp64 log-softmax of that row, top-k plus the chosen token, is the position's logprobs.
CUDA graphs: the hook runs when a graph is captured and its copy is part of the graph, so
replays fill the buffer too (a plain device copy into memory allocated before capture).
Async batching (two IO pairs, batch N+1 computed while batch N is updated): the buffer has
one slot per pair, the hook writes the pair being computed and the update reads the pair
being updated.

`Arrivals`: requests join while others run. A request with arrival_step a is added after
the library's a-th batch update (from the wrapper, in the library's thread, before that
batch's outputs are delivered), so it is drained into the scheduler before batch a + 1
(the a+1-th forward), as our reference engine's driver adds it before its a+1-th step.
When every request added so far has finished and more are to come, the next ones are added
at once (the engine would idle until their step).
"""
from __future__ import annotations

import threading

import torch


class LogitsTap:
    def __init__(self, model, manager, rows: int, top_k: int) -> None:
        self.manager, self.top_k = manager, top_k
        head = model.get_output_embeddings()
        vocab = head.weight.shape[0]
        self.buf = torch.zeros(2, rows + 1, vocab, dtype=torch.float32, device=head.weight.device)
        self.events: dict[str, list[tuple[int, list]]] = {}
        self.batches = 0
        self._handle = head.register_forward_hook(self._hook)
        self._wrapped = None

    def _pair(self) -> int:
        bp = self.manager.batch_processor
        return int(getattr(bp.inputs_and_outputs, "current_pair", 0)) if bp is not None else 0

    def _hook(self, module, args, out) -> None:
        flat = out.reshape(-1, out.shape[-1])
        n = min(flat.shape[0], self.buf.shape[1])
        self.buf[self._pair(), :n].copy_(flat[:n])

    def wrap(self, io, after_batch=None) -> None:
        """Read each batch's rows at its update; then `after_batch(number of batches updated)`."""
        original = io.prepare_batch_update

        def prepare_batch_update():
            requests, new_tokens, logprobs = original()
            self._record(requests, new_tokens)
            self.batches += 1
            if after_batch is not None:
                after_batch(self.batches)
            return requests, new_tokens, logprobs

        own = vars(io).get("prepare_batch_update")  # None: the class's method (the library's case)
        io.prepare_batch_update = prepare_batch_update
        self._wrapped = (io, own)

    def _record(self, requests, new_tokens) -> None:
        """Row j and new_tokens[j] belong to the j-th request with a new token. As the library's
        `update_batch` does, a request finished or offloaded (PENDING) since it was scheduled
        (async batching) keeps its row but not its token: an offloaded one recomputes that
        position when it is scheduled again, maybe to another token (bf16, another batch)."""
        states = [fs.state for fs in requests if fs.has_new_token]
        if not states:
            return
        lp = torch.log_softmax(self.buf[self._pair(), :len(states)].double().cpu(), -1)
        vals, idx = lp.topk(min(self.top_k, lp.shape[-1]), -1)
        for j, state in enumerate(states):
            if getattr(state.status, "name", "") in ("FINISHED", "PENDING"):
                continue
            rid, tok = state.request_id, int(new_tokens[j])
            top = dict(zip(idx[j].tolist(), vals[j].tolist()))
            top.setdefault(tok, float(lp[j, tok]))
            self.events.setdefault(rid, []).append((tok, sorted(([t, v] for t, v in top.items()), key=lambda p: -p[1])))

    def result(self, rid: str, token_ids: list[int]) -> dict:
        """The request's positions; `tap_tokens`: the tokens sampled at them (the library
        drops a token sampled past max_tokens, so only the first len(token_ids) count)."""
        ev = self.events.get(rid, [])[:len(token_ids)]
        return {"logprobs": [pos for _, pos in ev], "tap_tokens": [t for t, _ in ev]}

    def remove(self) -> None:
        self._handle.remove()
        if self._wrapped is not None:
            io, own = self._wrapped
            if own is None:
                del io.prepare_batch_update  # the class's method again
            else:
                io.prepare_batch_update = own
            self._wrapped = None
        self.buf = None


class Arrivals:
    def __init__(self, manager, requests: list[dict]) -> None:
        self.manager = manager
        self.pending = sorted(requests, key=lambda r: int(r.get("arrival_step", 0)))  # stable: workload order
        self.total, self.added = len(requests), 0
        self.fatal = None
        self._lock = threading.Lock()

    def _add(self, r: dict) -> None:
        rid = self.manager.add_request([int(t) for t in r["prompt_token_ids"]], request_id=str(r["id"]),
                                       max_new_tokens=int(r["max_tokens"]), eos_token_id=-1)
        if rid is None:
            raise RuntimeError(f"the manager refused request {r['id']} (see its log)")
        self.added += 1

    def add_due(self, step: int) -> None:
        with self._lock:
            while self.pending and int(self.pending[0].get("arrival_step", 0)) <= step:
                self._add(self.pending.pop(0))

    def after_batch(self, batches: int) -> None:
        self.add_due(batches)

    def add_next(self) -> None:
        """The next arrival step's requests, now."""
        with self._lock:
            if not self.pending:
                return
            step = int(self.pending[0].get("arrival_step", 0))
            while self.pending and int(self.pending[0].get("arrival_step", 0)) == step:
                self._add(self.pending.pop(0))
