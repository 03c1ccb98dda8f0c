"""What decides a verdict: a Case's runs checked against oracles and properties.

- `harness`: the cached reference runs and `Harness.check(case) -> Verdict`, over
  `engine_pool` (engines reused across Cases), `runner` (driving one run, engine errors as
  Violations) and `derived` (the Cases a check derives from the Case under test);
- `isolated`: the same check in a child process the harness can replace (fatal CUDA errors);
- `properties`: the violations and the logits, FA-record and determinism checks;
- `bitwise`: where the engine promises bit-identical runs, and the bitwise comparison;
- `tolerance`: the logits tolerance rule; `invariants`: the FlashAttention varlen checker;
- `oracles/`: solo, transformers and the sequence oracles; `compare`: a black-box target's
  outputs against an oracle's.
"""
