"""vLLM as a target (docs/vllm.md): `target.VLLMTarget` is its Target; `runner.VLLMRunner`
starts and drives a vLLM engine in a process of its own (`launch`: what it starts with;
`process`, `stacks`, `worker` and `site/`: the process and watching it); `checker` compares
its outputs with the oracles; `configs`, `covering` and `plan` plan the configs a campaign
visits; `known` the failures it counts without writing; `summary` reports."""
