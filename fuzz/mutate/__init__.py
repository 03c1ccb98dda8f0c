"""`llmfuzz mutate`: mutation analysis of a campaign (docs/mutate.md). `points`: the mutants of
a source; `sources`: the target's files and the scratch copies mutants run from; `worker`:
one mutant's process; `vllm` and `vllm_worker`: the same for `--target vllm`; `run`: drawing,
running and classifying; `report`; `cli`."""
