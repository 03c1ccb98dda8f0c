"""Run `llmfuzz run ARGS` in this process (pass --isolate off: the Harness and its engine pool
live here) and log this process's GPU memory every PERIOD seconds to CSV.
usage: bench/gpu_memory_watch.py OUT.csv PERIOD run ARGS...   (DEMO_BUDGET=bytes: the pool's budget, if it has one)"""
import os
import sys
import threading
import time

out, period, argv = sys.argv[1], float(sys.argv[2]), sys.argv[3:]
pools = []
import fuzz.verdict.engine_pool as h  # noqa: E402

_init = h.EnginePool.__init__


def init(self, *a, **k):
    if "DEMO_BUDGET" in os.environ and "memory_budget" in _init.__code__.co_varnames:
        k["memory_budget"] = int(os.environ["DEMO_BUDGET"])
    _init(self, *a, **k)
    pools.append(self)


h.EnginePool.__init__ = init


def nvml_mib() -> int:
    try:
        import pynvml
        pynvml.nvmlInit()
        tot = 0
        for i in range(pynvml.nvmlDeviceGetCount()):
            for p in pynvml.nvmlDeviceGetComputeRunningProcesses(pynvml.nvmlDeviceGetHandleByIndex(i)):
                if p.pid == os.getpid():
                    tot += p.usedGpuMemory or 0
        return tot >> 20
    except Exception:
        return -1


def loop() -> None:
    import torch
    t0 = time.monotonic()
    with open(out, "w") as f:
        f.write("t_s,reserved_mib,allocated_mib,nvml_pid_mib,engines,evicted_for_memory\n")
        while True:
            r = a = 0
            if torch.cuda.is_initialized():
                for d in range(torch.cuda.device_count()):
                    r += torch.cuda.memory_reserved(d)
                    a += torch.cuda.memory_allocated(d)
            ev = sum(getattr(p, "evicted_for_memory", -1) for p in pools)
            n = sum(len(p.engines) for p in pools)
            f.write(f"{time.monotonic() - t0:.0f},{r >> 20},{a >> 20},{nvml_mib()},{n},{ev}\n")
            f.flush()
            time.sleep(period)


threading.Thread(target=loop, daemon=True).start()
from fuzz.cli.main import main  # noqa: E402

rc = main(argv)
time.sleep(0.5)
sys.exit(rc)
