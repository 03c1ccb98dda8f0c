"""What a run under test is compared against, cheapest first.

- reference: the same Case at tp1pp1, eager, float32, plain decoding (never speculative),
  batched and scheduled as the Case says. It sees layout, mode, parallelism, graph and
  speculation bugs; it shares the scheduler, batch, metadata and KV code with the test run.
- solo: each request alone, whole, through the engine's layer math with dense attention
  and none of the serving code (`fuzz.verdict.oracles.solo`). It sees bugs every engine run shares:
  batching, chunking, preemption, reorder, metadata, paging.
- transformers: Hugging Face's LlamaForCausalLM on the same weights (`fuzz.verdict.oracles.hf`),
  sharing no code with the engine. It sees bugs in the model math itself.
- determinism: the run under test again on the same engine; tokens and logits must be
  bitwise equal (CPU).

Requests with sampling params (`fuzz.verdict.oracles.sampling`, checked on every Case that has
them, not selectable here): an independent sampler recomputes each processed distribution
and checks the token drawn from it; random draws must equal the reference's and those of the
request run alone, unchunked, with the same seed. The sequence oracles compare raw logits
rows only; an aborted request compares as a prefix everywhere.

Reference and solo check every Case. Transformers checks every failing Case (a second
opinion in the reproducer) and passing ones while its cost stays under a quarter of the
harness's time; determinism checks every short Case with 3 or more TP ranks and about one
other Case in 20, chosen by the Case's hash (`fuzz.verdict.derived.sampled_for_determinism`),
so a Case always gets the same checks. `--oracle NAME` checks every Case with NAME.
"""
from __future__ import annotations

ORACLES = ("reference", "solo", "transformers", "determinism")


class UnknownOracle(ValueError):
    """An oracle name that does not exist; the message is one line."""


def parse_oracles(text: str | None) -> frozenset[str]:
    """'transformers,determinism' -> the oracles to run on every Case."""
    names = [n.strip() for n in (text or "").split(",") if n.strip()]
    if "all" in names:
        return frozenset(ORACLES)
    bad = [n for n in names if n not in ORACLES]
    if bad:
        raise UnknownOracle(f"oracle: unknown oracle {bad[0]!r} (known: {', '.join(ORACLES)}, all)")
    return frozenset(names)
