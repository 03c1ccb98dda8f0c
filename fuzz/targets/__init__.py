"""The engines a campaign drives.

- `base`: `Target` (what a campaign, its minimizer and its reproducer writer need of an
  engine) and `Cell`; `simpler`: how a Case gets simpler, the default candidates;
- `reference`: our engine, white-box (`HarnessTarget`) and as a black-box oracle
  (`ReferenceRunner`); `kernels`: its GPU attention kernels as cells;
- `runs`: what a black-box target returns (`TargetRun`, `TargetFailure`);
- `blackbox`: any engine as a black box: the runner protocol (run, engine_key, close) and
  `BlackBoxChecker`, its properties named after the target; `sampled`: its requests with
  sampling params; `protocol`: conformance to the protocol; `blackbox_target`: such an
  engine as a campaign target; `adapter`: `llmfuzz.Target`, an engine's generate call as a
  runner; `checkpoint`: the weights every engine loads (docs/targets.md);
- `vllm/`: vLLM as a target, the black-box checker with vLLM's options (docs/vllm.md).
"""
