"""transformers' continuous batching through CBRunner on the CPU, on the tiny Llama checkpoint the
reference engine's weights are exported to: its greedy tokens and top-k logprobs agree with
the reference engine within the black-box checker's tolerance for a mixed batch (chunked prefill,
requests arriving while others run, a KV cache too small for all of them); the same Case
gives the same run twice; the manager leaves nothing behind."""
from __future__ import annotations

import importlib.util

import pytest

from fuzz.cases.case import Case, RequestSpec, Workload
from fuzz.targets.transformers_cb.configs import CB_MODEL, CBOptions

pytestmark = [pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="needs transformers"),
              pytest.mark.slow]


@pytest.fixture(scope="module")
def runner():
    from fuzz.targets.transformers_cb.runner import CBRunner

    r = CBRunner(hang_s=60.0)
    yield r
    r.close()


@pytest.fixture(scope="module")
def reference():
    from fuzz.targets.reference import ReferenceRunner

    r = ReferenceRunner()
    yield r
    r.close()


CFG = CB_MODEL.replace(max_num_batched_tokens=16)  # prompts of 17..40 tokens are prefilled in chunks


def mixed(opts: CBOptions = CBOptions()) -> Case:
    wl = Workload((RequestSpec(tuple(range(1, 30)), 6), RequestSpec((5, 6), 8, arrival_step=2),
                   RequestSpec(tuple(range(40, 80)), 4, arrival_step=1), RequestSpec((7,), 3, arrival_step=9),
                   RequestSpec(tuple(range(100, 117)), 5)))
    return opts.on(Case(CFG, wl))


def compare(reference, case, run):
    from fuzz.targets.blackbox import logprob_tolerance
    from fuzz.verdict.compare import check_greedy, compare_runs

    tol = logprob_tolerance(case.config, reference.logit_absmax(case))
    check_greedy(run.results, tol, "transformers CB")
    return compare_runs(reference.run(case).results, run.results, lp_tol=tol, margin_tol=tol,
                        oracle_name="reference", test_name="transformers CB"), tol


# 12 blocks of 4 tokens hold the longest request (40 + 4 tokens) and one block more, not the batch.
@pytest.mark.parametrize("opts", [CBOptions(), CBOptions(kv_blocks=12, scheduler="prefill_first")],
                         ids=["default", "small-kv-prefill-first"])
def test_mixed_batch_agrees_with_the_reference(runner, reference, opts):
    case = mixed(opts)
    run = runner.run(case)
    rep, tol = compare(reference, case, run)
    n = sum(r.max_tokens for r in case.workload.requests)
    assert rep.positions == n  # every position compared: no near-tie divergence on this Case
    assert rep.max_lp_error < tol
    assert all(len(pos) >= runner.top_k for r in run.results.values() for pos in r.logprobs)
    # The library's own logprob of each chosen token (fp32 log of softmax) is the tapped row's.
    for rid, own in runner.last_run["own_logprobs"].items():
        tapped = [dict(pos)[t] for t, pos in zip(run.results[rid].token_ids, run.results[rid].logprobs)]
        assert own == pytest.approx(tapped, abs=1e-5)
    assert runner.last_run["memory"] == {"thread_alive": False, "cache_alive": False, "leaked_bytes": 0,
                                         "threads_left": 0}
    # The small cache (one longest request and a block) cannot hold the batch: the library evicts.
    assert (runner.last_run["offloads"] > 0) == bool(opts.kv_blocks)


def test_same_case_same_run(runner):
    """Arrivals are added at batch updates, in the library's thread: the batches, and so the
    logprobs, are the same bit for bit on a second run."""
    case = mixed()
    a, b = runner.run(case), runner.run(case)
    assert a.results == b.results and a.steps == b.steps


def test_solo_items_and_arrivals_count_batches(runner):
    """`items` runs instead of the workload (a solo run); a request arriving at step 9 after
    the others finished still runs (the engine would idle until then)."""
    case = mixed()
    solo = runner.run(case, items=[("r3", case.workload.requests[3])])
    assert list(solo.results) == ["r3"] and len(solo.results["r3"].token_ids) == 3
    assert solo.steps == 3  # one batch per generated token: prefill of 1 token, 2 decodes
