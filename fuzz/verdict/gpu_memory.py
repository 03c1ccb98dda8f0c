"""The GPU memory a campaign worker may use: one allowance bounds both how many workers a GPU
takes and how large a worker's engine pool grows. No imports, so the CLI deals GPUs without torch."""

# Per-worker GPU memory allowance of a CUDA campaign, on each GPU the worker uses. It bounds a
# worker's memory twice: a GPU takes at most its free memory over this many workers
# (fuzz.campaign.jobs_gpus), and a worker's engine pool evicts engines while its process's CUDA
# caching allocator holds more than this, less the context. A worker's one CUDA process (its
# isolated Harness child) holds a context, its engines (each with its KV cache and, in graph mode,
# a graph pool per rank) and what the allocator caches. Measured on an H200 (bf16, torch_flash):
# a tp1pp8 worker alone, 16 engines, held 2.5-4.6 GiB of allocator memory and 10-12 GiB in NVML's
# count of the process (context, graph executables, libraries), flat over time. 16 GiB keeps room
# for a GPU dealt more heavy layouts than light: running out would turn memory into false crash
# findings, while a worker less costs only speed (an H200 takes 8, an 80 GB H100 4).
WORKER_GPU_BYTES = 16 << 30
# A CUDA context, measured and rounded up: not in the caching allocator's figures. With --world
# torch each rank is a process with a context of its own on its GPU.
CUDA_CONTEXT_BYTES = 1 << 30
