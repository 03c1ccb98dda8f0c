"""AsyncCopier: the CPU model of a copy stream, and real non_blocking copies on CUDA.

Both must show the same two races the faults rely on: a staging copy that reads its
source when it lands (host writes before then are seen), and a copy inside compute that the
compute reads before it landed unless it waits.
"""
from __future__ import annotations

import pytest
import torch

from engine.async_copy import AsyncCopier, CudaAsyncCopier, make_copier

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_cpu_pending_copy_reads_its_source_when_it_lands():
    cp = AsyncCopier(land_immediately=False)
    src, dst = torch.tensor([1, 2, 3]), torch.zeros(3, dtype=torch.int64)
    cp.copy(dst, torch.tensor([9, 9, 9]))  # ahead in the stream: holds the next one back
    h = cp.copy(dst, src)
    src.fill_(7)  # the host writes the staging buffer again before the copy landed
    cp.synchronize()
    assert h.landed and dst.tolist() == [7, 7, 7]


def test_cpu_wait_lands_the_copy_before_the_host_writes_again():
    cp = AsyncCopier(land_immediately=False)
    src, dst = torch.tensor([1, 2, 3]), torch.zeros(3, dtype=torch.int64)
    cp.copy(dst, torch.tensor([9, 9, 9]))
    h = cp.copy(dst, src)
    cp.wait(h)
    src.fill_(7)
    cp.synchronize()
    assert dst.tolist() == [1, 2, 3]


def test_cpu_compute_starts_after_the_copies_launched_before_it():
    cp = AsyncCopier(land_immediately=False)
    dst = torch.zeros(2)
    h = cp.copy(dst, torch.ones(2))
    cp.launch(0)
    later = cp.copy(torch.zeros(2), torch.ones(2))
    cp.start_compute(0)
    assert h.landed and not later.landed  # stream order: nothing overtakes the launch
    cp.end_compute(0)


def test_cpu_copy_inside_compute_lands_at_once_unless_the_schedule_delays_it():
    """As on a GPU, where a small side-stream copy usually beats the next kernel: without a
    wait the compute reads the destination stale only when the copy is delayed."""
    for delay, expect in ((False, [1, 2, 3]), (True, [0, 0, 0])):
        cp = AsyncCopier(land_immediately=False)
        cp.should_delay = lambda delay=delay: delay
        dst = torch.zeros(3, dtype=torch.int64)
        cp.start_compute(0)
        h = cp.copy(dst, torch.tensor([1, 2, 3]))
        assert dst.tolist() == expect and h.landed == (not delay)
        cp.end_compute(0)  # nothing issued by a compute outlives it
        assert dst.tolist() == [1, 2, 3]


@pytest.mark.parametrize("poison", ["nan", "stale"])
def test_an_unsynced_receive_copy_fails_only_under_a_schedule_that_delays_it(poison):
    """intermediate_copy_unsynced is a real race: under the default schedule the receive copy
    has landed before the stage reads it (logits exact); with copies delayed the stage reads
    the buffer's earlier contents (finite and wrong under stale poison, NaN under NaN)."""
    from engine import EngineConfig, LLMEngine
    from engine.schedule import Schedule

    eng = LLMEngine(EngineConfig(num_hidden_layers=2, pipeline_parallel_size=2, max_model_len=32, num_gpu_blocks=16))

    def first_logits(schedule, faults):
        eng.reset(schedule, faults, poison=poison)
        eng.add_request("a", [3, 1, 4], 1)
        while eng.has_unfinished_requests():
            eng.step()
        return eng.trace.tokens["a"][0].logits

    try:
        right = first_logits(Schedule(), ())
        fault = ("intermediate_copy_unsynced",)
        assert torch.equal(first_logits(Schedule(), fault), right)
        late = first_logits(Schedule(copy_delay=1.0), fault)
        if poison == "nan":
            assert not torch.isfinite(late).all()
        else:
            assert torch.isfinite(late).all() and (late - right).abs().max() > 1e-2
    finally:
        eng.shutdown()


def test_make_copier_picks_the_device_model():
    assert type(make_copier("cpu")) is AsyncCopier


@pytest.mark.gpu
@cuda
def test_cuda_delayed_staging_copy_reads_the_pinned_source_late():
    torch.cuda._sleep(1000)  # load the sleep kernel first: a lazy module load may synchronize
    torch.cuda.synchronize()
    cp = CudaAsyncCopier("cuda", land_immediately=False)
    cp.should_delay = lambda: True  # every copy gets a _sleep in front of it
    cp.delay_cycles = 100_000_000  # ~50 ms: far longer than the host's write below
    src = torch.full((1024,), 1.0, pin_memory=True)
    dst = torch.zeros(1024, device="cuda")
    cp.copy(dst, src)
    src.fill_(2.0)  # the host writes the staging buffer before the DMA ran
    cp.synchronize()
    assert cp.num_delays == 1 and dst.eq(2.0).all()  # the real race, observed


@pytest.mark.gpu
@cuda
def test_cuda_wait_makes_the_host_write_safe():
    cp = CudaAsyncCopier("cuda", land_immediately=False)
    cp.should_delay = lambda: True
    src = torch.full((1024,), 1.0, pin_memory=True)
    dst = torch.zeros(1024, device="cuda")
    h = cp.copy(dst, src)
    cp.wait(h)
    src.fill_(2.0)
    cp.synchronize()
    assert dst.eq(1.0).all()


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("wait", [True, False])
def test_cuda_copy_inside_compute_is_read_stale_without_a_wait(wait):
    cp = CudaAsyncCopier("cuda", land_immediately=False)
    cp.should_delay = lambda: True
    buf = torch.zeros(1 << 16, device="cuda")  # the persistent buffer
    recv = torch.full((1 << 16,), 3.0, device="cuda")  # what the PP receive produced
    cp.start_compute(0)
    h = cp.copy(buf, recv)  # side stream, behind a _sleep
    if wait:
        cp.wait(h)  # the compute stream waits on the copy's event (no host sync)
    seen = buf * 1.0  # compute reads the buffer
    cp.end_compute(0)
    cp.synchronize()
    assert buf.eq(3.0).all()
    assert seen.eq(3.0).all() if wait else seen.eq(0.0).all()
