"""transformers' continuous batching (paged KV cache, chunked prefill, its scheduler, CUDA
graphs) as a black-box target: `configs` (what a config is), `runner` (Cases through the
library in a worker process), `tap` (top-k logprobs and arrivals inside the worker),
`stacks` (hangs), `plan` (the configs a campaign visits), `target` (the campaign's target)."""
