"""One contention co-process: `python -m fuzz.contention.burn {cpu|gpu} SEED [DEVICE]`.

It prints "ready" once it is loading its resource (for gpu: after CUDA is up and its buffers
are allocated), then works in bursts at random intervals until it is stopped. It is the
tool's own: it dies with the process that started it (PR_SET_PDEATHSIG, and a check that its
parent is still the one it had), so a killed campaign leaves nothing running.

gpu: bf16 4096x4096 matmuls and 64 MiB pinned host<->device copies, in bursts of random length
with random gaps, synchronized per burst so the queue stays short and the contention comes
and goes as another tenant's would. cpu: pure-Python spinning with rare short naps.
"""
from __future__ import annotations

import os
import random
import signal
import sys
import time


def die_with_parent() -> None:
    """Ask Linux to SIGKILL this process when its parent exits (a no-op elsewhere)."""
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return  # not Linux: the loops' check that the parent is still the one it had ends it


def spin_cpu(rng: random.Random, parent: int) -> None:
    x = 1.0
    while os.getppid() == parent:
        end = time.monotonic() + rng.uniform(0.05, 0.5)
        while time.monotonic() < end:
            for _ in range(2000):
                x = x * 1.0000001 + 1e-9
        if rng.random() < 0.1:
            time.sleep(rng.uniform(0.0, 0.005))


def burst_gpu(rng: random.Random, parent: int, device: str) -> None:
    import torch

    torch.cuda.set_device(device)
    a = torch.randn(4096, 4096, device=device, dtype=torch.bfloat16)
    b = torch.randn(4096, 4096, device=device, dtype=torch.bfloat16)
    host = torch.empty(64 << 20, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(64 << 20, dtype=torch.uint8, device=device)
    torch.cuda.synchronize()
    print("ready", flush=True)
    while os.getppid() == parent:
        r = rng.random()
        if r < 0.6:
            for _ in range(rng.randint(1, 40)):
                a = (a @ b).clamp_(-1, 1)
        elif r < 0.9:
            for _ in range(rng.randint(1, 8)):
                dev.copy_(host, non_blocking=True)
                host.copy_(dev, non_blocking=True)
        torch.cuda.synchronize()
        time.sleep(rng.uniform(0.0, 0.02))


def main(argv: list[str]) -> int:
    die_with_parent()
    kind, seed = argv[0], int(argv[1])
    parent = int(os.environ.get("LLMFUZZ_CONTENTION_PARENT", os.getppid()))
    if os.getppid() != parent:  # the parent died before the death signal was armed
        return 0
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    rng = random.Random(seed)
    if kind == "gpu":
        burst_gpu(rng, parent, argv[2] if len(argv) > 2 else "cuda:0")
    else:
        print("ready", flush=True)
        spin_cpu(rng, parent)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
