"""The worker's tap and arrivals on stand-ins for the library's objects (fast, no worker): LM
head row j goes to the j-th request of the batch that gets a token (a request still in
chunked prefill gets none), with its top-k and the chosen token; rows beyond the first
len(token_ids) events are dropped (a token sampled past max_tokens); requests arrive after
the batch update their step names, in workload order."""
from __future__ import annotations

from types import SimpleNamespace as NS

import torch

from fuzz.targets.transformers_cb.tap import Arrivals, LogitsTap


class Head(torch.nn.Linear):
    pass


def fake_model(vocab=6):
    head = Head(3, vocab, bias=False)
    return NS(get_output_embeddings=lambda: head), head


def fs(rid, new, status="DECODING"):
    return NS(state=NS(request_id=rid, status=NS(name=status)), has_new_token=new)


def test_rows_go_to_the_requests_with_a_new_token_in_batch_order():
    model, head = fake_model()
    mgr = NS(batch_processor=None)
    tap = LogitsTap(model, mgr, rows=8, top_k=2)
    logits = torch.tensor([[[0.0, 5.0, 1.0, 0.0, 0.0, 0.0], [3.0, 0.0, 0.0, 0.0, 4.0, 0.0]]])
    tap._hook(head, (), logits)  # what the LM head returned for this batch: 2 rows
    original = lambda: ([fs("a", True), fs("b", False), fs("c", True)], [1, 2], None)  # noqa: E731
    io = NS(prepare_batch_update=original)
    seen = []
    tap.wrap(io, seen.append)
    io.prepare_batch_update()
    lp = torch.log_softmax(logits[0].double(), -1)
    assert tap.result("a", [1]) == {"tap_tokens": [1], "logprobs": [[[1, float(lp[0, 1])], [2, float(lp[0, 2])]]]}
    # "c" (the batch's second request with a token) gets row 1; its sampled token 2 is outside
    # the top-2 and is added.
    assert tap.result("c", [2])["logprobs"] == [[[4, float(lp[1, 4])], [0, float(lp[1, 0])], [2, float(lp[1, 2])]]]
    assert "b" not in tap.events and seen == [1] and tap.batches == 1
    assert tap.result("a", []) == {"tap_tokens": [], "logprobs": []}  # past max_tokens: dropped
    tap.remove()
    assert io.prepare_batch_update is original
    assert not head._forward_hooks


def test_async_batching_reads_the_slot_of_the_pair_being_updated():
    model, head = fake_model()
    io = NS(current_pair=0)
    tap = LogitsTap(model, NS(batch_processor=NS(inputs_and_outputs=io)), rows=4, top_k=1)
    tap._hook(head, (), torch.tensor([[[9.0, 0, 0, 0, 0, 0]]]))  # batch N computed in pair 0
    io.current_pair = 1
    tap._hook(head, (), torch.tensor([[[0, 9.0, 0, 0, 0, 0]]]))  # batch N+1 in pair 1 before N is updated
    io.current_pair = 0  # the library updates batch N with pair 0 current
    tap._record([fs("a", True)], [0])
    assert tap.events["a"][0][1][0][0] == 0


def test_a_token_the_library_drops_is_not_recorded_but_keeps_its_row():
    """Async batching: a request offloaded (PENDING) or finished since it was scheduled keeps
    its row and token slot, which the library's update_batch skips; it recomputes the position
    later. The tap records the token it keeps, so a recomputed token is no inconsistency (an
    H200 campaign reported one as the library's, from this)."""
    model, head = fake_model()
    io = NS(current_pair=0)
    tap = LogitsTap(model, NS(batch_processor=NS(inputs_and_outputs=io)), rows=4, top_k=1)
    tap._hook(head, (), torch.tensor([[[9.0, 0, 0, 0, 0, 0], [0, 9.0, 0, 0, 0, 0], [0, 0, 9.0, 0, 0, 0]]]))
    tap._record([fs("a", True, "PENDING"), fs("b", True), fs("c", True, "FINISHED")], [3, 4, 5])
    assert set(tap.events) == {"b"} and tap.events["b"][0][0] == 4 and tap.events["b"][0][1][0][0] == 1
    tap._hook(head, (), torch.tensor([[[0, 0, 0, 9.0, 0, 0]]]))
    tap._record([fs("a", True)], [2])  # the offloaded request's position, recomputed
    assert tap.result("a", [2])["tap_tokens"] == [2]


def test_arrivals_join_after_the_batch_their_step_names():
    added = []
    mgr = NS(add_request=lambda ids, request_id, max_new_tokens, eos_token_id: added.append(request_id) or request_id)
    reqs = [{"id": "r0", "prompt_token_ids": [1], "max_tokens": 1, "arrival_step": 2},
            {"id": "r1", "prompt_token_ids": [1], "max_tokens": 1},
            {"id": "r2", "prompt_token_ids": [1], "max_tokens": 1, "arrival_step": 5},
            {"id": "r3", "prompt_token_ids": [1], "max_tokens": 1, "arrival_step": 2}]
    a = Arrivals(mgr, reqs)
    a.add_due(0)
    assert added == ["r1"]
    a.after_batch(1)
    assert added == ["r1"]
    a.after_batch(2)
    assert added == ["r1", "r0", "r3"]  # workload order within a step
    a.add_next()  # everything added has finished: the next step's requests come now
    assert added == ["r1", "r0", "r3", "r2"] and a.added == a.total == 4
