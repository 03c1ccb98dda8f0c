"""One mutant's process: `python -m fuzz.mutate.worker SPEC RESULT`.

Started by fuzz.mutate.run with the mutated package's scratch copy first on PYTHONPATH (the
baseline: an unmutated copy). Stages, each recorded in RESULT (rewritten atomically after each,
so a process killed by its timeout leaves what it had):
1. import: the mutated module and the engine; an error here makes the mutant stillborn;
2. startup: one engine built and shut down (a crash here: stillborn too);
3. cases: the fixed Cases the parent drew, each run on the engine under test (its reference
   run, then the teacher-forced test run, as the harness does) and digested bitwise: tokens,
   logits, sampling records, prompt logprobs, aborts, and separately its FA call records;
4. campaign: the normal campaign (`llmfuzz run`'s, fuzz.campaign.loop.Campaign) for the budget,
   stopping at its first failure: a failure means the campaign caught the mutant.
"""
from __future__ import annotations

import hashlib
import importlib
import json
import os
import sys
import time
import traceback


def _tensor(h, t) -> None:
    if t is None:
        h.update(b"-")
    else:
        h.update(str((tuple(t.shape), str(t.dtype))).encode())
        h.update(t.detach().cpu().contiguous().numpy().tobytes())


def outputs_digest(trace) -> str:
    """What a run produced, bitwise: per request its tokens, logits and sampling records,
    prompt logprobs, abort step and stop reason."""
    h = hashlib.sha256()
    for rid in sorted(trace.tokens):
        h.update(f"\0{rid}".encode())
        for r in trace.tokens[rid]:
            h.update(f"{r.sampled},{r.token},{sorted((r.top_logprobs or {}).items())}".encode())
            for t in (r.logits, r.logprobs, r.noise):
                _tensor(h, t)
    h.update(repr(sorted(trace.prompt_logprobs.items())).encode())
    h.update(repr(sorted(trace.aborted.items())).encode())
    h.update(repr(sorted(trace.stop_reasons.items())).encode())
    return h.hexdigest()


def read_block_table(rec):
    """The block table as the kernel reads it: row i's first ceil(seqused_k[i] / block_size)
    entries; the rest is -1. Entries past a row's length are garbage by contract (poison fills
    them, and a mutant that changes only that garbage changes nothing a kernel sees)."""
    import torch

    bt, used = rec.block_table, rec.seqused_k
    if bt is None or used is None or bt.dim() != 2 or len(rec.kv_shape) < 2:
        return bt
    need = (used.to(bt.device, torch.int64) + rec.kv_shape[1] - 1) // rec.kv_shape[1]
    rows = min(bt.shape[0], need.shape[0])
    read = torch.zeros(bt.shape, dtype=torch.bool, device=bt.device)
    read[:rows] = torch.arange(bt.shape[1], device=bt.device)[None, :] < need[:rows, None]
    return bt.masked_fill(~read, -1)


def fa_digest(records) -> str:
    """The FA calls as a multiset (rank threads may interleave their records), each as the
    kernel reads it (read_block_table)."""
    each = []
    for rec in records:
        h = hashlib.sha256()
        for name in type(rec).__dataclass_fields__:
            v = read_block_table(rec) if name == "block_table" else getattr(rec, name)
            _tensor(h, v) if hasattr(v, "numpy") else h.update(f"{name}={v!r};".encode())
        each.append(h.hexdigest())
    return hashlib.sha256("".join(sorted(each)).encode()).hexdigest()


def case_digests(harness, case) -> dict:
    """The Case's reference run and test run on this process's engine, digested; an error
    (a crash, a liveness or invariant violation) is digested by its type and message."""
    try:
        ref = harness.reference(case)
        test = harness.run_case(case)
        return {"outputs": outputs_digest(ref) + outputs_digest(test), "fa": fa_digest(test.fa_records)}
    except Exception as e:  # the engine's own failure is an output like any other
        text = f"raised {type(e).__name__}: {e}"
        return {"outputs": hashlib.sha256(text.encode()).hexdigest(), "fa": "", "raised": text[:300]}


class Result:
    """RESULT on disk, rewritten atomically as stages end."""

    def __init__(self, path: str) -> None:
        self.path, self.doc = path, {"stage": "import", "digests": [], "campaign": None}

    def save(self, **kw) -> None:
        self.doc.update(kw)
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(self.doc, f)
        os.replace(tmp, self.path)


def _campaign(spec: dict, res: Result) -> None:
    from fuzz import profiles
    from fuzz.campaign.loop import Campaign
    from fuzz.cases.strategies import CAMPAIGN_ORDER, FUZZ_MODEL

    profiles.load()  # `llmfuzz run`'s default Hypothesis profile (no deadline)

    camp = Campaign(layouts=list(spec.get("layouts") or CAMPAIGN_ORDER), modes=("eager", "graph"), seed=spec["seed"],
                    out_dir=spec["out_dir"], budget_s=spec["budget_s"], shrink_budget_s=0.0, shrink_s=0.0,
                    stop_on_failure=True, progress=False, base=FUZZ_MODEL)
    res.save(stage="done", campaign=campaign_record(camp.run()))


def campaign_record(s, **extra) -> dict:
    """A mutant's campaign as RESULT keeps it: its size and each failure found."""
    return {"examples": s.examples, "seconds": round(s.seconds, 2), "interrupted": s.interrupted, **extra,
            "failures": [{"property": f.property, "message": f.message[:500], "case": f.case_desc, "path": f.path,
                          "oracle": f.oracle} for f in s.failures]}


def main(spec_path: str, result_path: str) -> int:
    with open(spec_path) as f:
        spec = json.load(f)
    from fuzz.campaign.jobs_worker import _die_with

    _die_with(spec["parent_pid"])  # no mutant runs on after `llmfuzz mutate` is gone
    res = Result(result_path)
    res.save()
    stage = "import"
    try:
        pkg = importlib.import_module(spec["package"])
        if not os.path.realpath(pkg.__file__).startswith(os.path.realpath(spec["scratch"]) + os.sep):
            # Not stillborn: the harness, not the mutant, is wrong. Never score the original.
            res.save(stage="wrong_tree", error=f"{spec['package']} loaded from {pkg.__file__}")
            return 3
        if spec.get("module"):
            importlib.import_module(spec["module"])
        from engine.llm_engine import LLMEngine
        from fuzz.cases.case import Case
        from fuzz.cases.strategies import FUZZ_MODEL
        from fuzz.verdict.harness import Harness

        stage = "startup"
        res.save(stage=stage)
        LLMEngine(FUZZ_MODEL).shutdown()
    except Exception:  # noqa: BLE001 - any error before the first Case makes the mutant stillborn
        res.save(stage=stage, stillborn=traceback.format_exc(limit=4)[-1500:])
        return 0
    res.save(stage="cases")
    harness = Harness()
    t0 = time.monotonic()
    for d in spec["cases"]:
        res.doc["digests"].append(case_digests(harness, Case.from_dict(d)))
        res.save()
    harness.close()
    res.save(stage="campaign", cases_seconds=round(time.monotonic() - t0, 2))
    if spec.get("budget_s"):
        _campaign(spec, res)
    else:
        res.save(stage="done")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
