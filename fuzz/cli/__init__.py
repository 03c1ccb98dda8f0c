"""The `llmfuzz` command line: `main` (run, selftest, bench, faults, report, …), `replay`
(replay and minimize), `vllm` (the vLLM target's options and plans), `common` (arguments
every command reads)."""
