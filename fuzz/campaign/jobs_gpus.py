"""The GPUs of `llmfuzz run --device cuda --jobs N` (fuzz.campaign.jobs deals them): how much GPU memory a
worker is allowed, how many GPUs it needs, and which ones each worker gets.

In the in-process world a worker's ranks are threads of one process on one GPU, so a worker
needs one GPU and several workers share one. With `--world torch` every rank is a process of
its own, and rank r takes the r-th GPU it sees (engine/dist_worker_main.py `_device_for`:
`(index of cuda[:N] + rank) % device_count`): NCCL refuses two ranks of one job on one GPU, so
a worker needs as many distinct GPUs as its largest layout has ranks. Each worker is dealt a
set of that many GPUs (its CUDA_VISIBLE_DEVICES); workers share a set, or overlap sets, as
far as each GPU's free memory holds them.
"""
from __future__ import annotations

import os

from engine.config import parse_layout
from fuzz.errors import BadInput
from fuzz.verdict.gpu_memory import CUDA_CONTEXT_BYTES, WORKER_GPU_BYTES



def layout_ranks(layout: str) -> int:
    """Ranks of a layout: tp * pp."""
    tp, pp = parse_layout(layout)
    return tp * pp


def gpus_needed(layouts: list[str], world: str) -> int:
    """Distinct GPUs a worker running `layouts` needs: one in the in-process world (rank
    threads share their process's GPU), its largest layout's ranks with --world torch."""
    return max(map(layout_ranks, layouts)) if world == "torch" else 1


def check_gpu_count(device: str, layouts: list[str], world: str, count: int | None = None) -> None:
    """A one-line BadInput, before anything starts, when a --world torch layout has more ranks
    than there are GPUs (`count`: visible GPUs, torch.cuda.device_count() when None): its ranks
    would share GPUs and every Case would crash in NCCL, a false finding each."""
    if device == "cpu" or world != "torch":
        return
    worst = max(layouts, key=layout_ranks)
    need = layout_ranks(worst)
    if count is None:
        import torch

        count = torch.cuda.device_count()
    if need > count:
        raise BadInput(f"--layouts: {worst} needs {need} GPUs with --world torch (a rank process a GPU: "
                       f"NCCL refuses two ranks on one), and {count} {'is' if count == 1 else 'are'} visible; "
                       f"take layouts of at most {count} rank{'s' if count != 1 else ''}, or --world inproc")


def worker_gpu_bytes(world: str) -> int:
    """What a worker is charged on each GPU of its set: WORKER_GPU_BYTES, and with --world
    torch the context of the rank process it runs there."""
    return WORKER_GPU_BYTES + (CUDA_CONTEXT_BYTES if world == "torch" else 0)


def gpu_jobs(cores: int, free_bytes: list[int], units: int, per_worker: int = WORKER_GPU_BYTES) -> int:
    """Workers of a CUDA campaign of one GPU each: GPUs are shared (the tiny model leaves them
    nearly idle and a worker is CPU-bound Python), so as many as `cores` workers (cpu_jobs's
    answer), at most one per layout (`units`), and on each GPU at most its free memory over
    `per_worker`; 1 at least (one process always runs)."""
    by_memory = sum(max(0, f) // per_worker for f in free_bytes)
    return max(1, min(cores, units, by_memory))


def deal(needs: list[int], free_bytes: list[int],
         per_gpu: int = WORKER_GPU_BYTES) -> tuple[list[tuple[int, ...]], bool]:
    """Each worker's GPUs (indices into `free_bytes`), needs[i] distinct ones for worker i, and
    whether every GPU dealt had room for the worker (free memory over `per_gpu`, less the workers
    already there). Workers needing most go first, each to the GPUs with the most room left,
    ties round robin: with equal GPUs plain round robin, and it fits whenever any dealing fits
    (Ryser's construction; tests check it against brute force). Past the memory (an explicit
    --jobs), the least oversubscribed GPUs."""
    room = [max(0, f) // per_gpu for f in free_bytes]
    out: list[tuple[int, ...]] = [()] * len(needs)
    fits, g, n = True, 0, len(room)
    for i in sorted(range(len(needs)), key=lambda i: -needs[i]):
        order = [(g + j) % n for j in range(n)]
        pick = sorted(order, key=lambda x: -room[x])[:needs[i]]  # stable: ties keep round robin
        fits = fits and len(pick) == needs[i] and all(room[x] > 0 for x in pick)
        for x in pick:
            room[x] -= 1
        g = (g + max(order.index(x) for x in pick) + 1) % n if pick else g
        out[i] = tuple(sorted(pick))
    return out, fits


_FREE: dict[str, list[int]] = {}


def gpu_free_bytes(device: str) -> list[int]:
    """Free memory of each GPU the workers go on ("cuda": every visible one, in visible_gpus()
    order; "cuda:N": that one), measured once per process (default_jobs and run_jobs see the
    same). torch.cuda.mem_get_info creates a CUDA context on each GPU in this process (518 MiB on
    an H200, kept until exit; the figures exclude it). That is no harm to the workers: they are
    fresh interpreters started with Popen (exec, no fork of this process), and so are --world
    torch's ranks (forkserver or spawn) and the isolated Harness child of a --jobs 1 run."""
    if device not in _FREE:
        import torch

        idx = [int(device.split(":")[1])] if ":" in device else range(torch.cuda.device_count())
        _FREE[device] = [torch.cuda.mem_get_info(i)[0] for i in idx]
    return _FREE[device]


def visible_gpus() -> list[str]:
    """The GPUs this process sees, as CUDA_VISIBLE_DEVICES names them (a worker's is a subset)."""
    import torch

    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = [g.strip() for g in visible.split(",") if g.strip()] if visible else []
    return ids or [str(i) for i in range(torch.cuda.device_count())]
