"""The FA digest a mutant is observed by: what the kernel reads, nothing else."""
from __future__ import annotations

import torch

from engine.custom_ops import FACallRecord
from fuzz.mutate.worker import fa_digest, read_block_table


def _record(block_table: torch.Tensor, seqused_k: list[int]) -> FACallRecord:
    n = len(seqused_k)
    return FACallRecord(rank=0, layer=0, microbatch=0, graph=False, q_shape=(n, 2, 8), q_stride=(16, 8, 1),
                        kv_shape=(9, 4, 2, 8), kv_stride=(64, 16, 8, 1), dtype="float32", device="cpu",
                        max_seqlen_q=1, max_seqlen_k=max(seqused_k), num_reqs=n, num_actual_tokens=n,
                        cu_seqlens_q=torch.arange(n + 1, dtype=torch.int32),
                        seqused_k=torch.tensor(seqused_k, dtype=torch.int32), block_table=block_table,
                        slot_mapping=torch.arange(n, dtype=torch.int64))


def test_entries_past_each_rows_length_do_not_change_the_digest() -> None:
    # Block size 4: row 0 (5 keys) reads 2 entries, row 1 (4 keys) 1, row 2 (a padding row, 0 keys) none.
    a = torch.tensor([[1, 2, 7, 7], [3, 7, 7, 7], [7, 7, 7, 7]], dtype=torch.int32)
    b = torch.tensor([[1, 2, 5, 8], [3, 6, 2, 1], [4, 4, 4, 4]], dtype=torch.int32)
    assert read_block_table(_record(b, [5, 4, 0])).tolist() == [[1, 2, -1, -1], [3, -1, -1, -1], [-1] * 4]
    assert fa_digest([_record(a, [5, 4, 0])]) == fa_digest([_record(b, [5, 4, 0])])


def test_an_entry_the_kernel_reads_changes_the_digest() -> None:
    a = torch.tensor([[1, 2, 7, 7], [3, 7, 7, 7]], dtype=torch.int32)
    b = a.clone()
    b[0, 1] = 8  # row 0's second block: read (5 keys)
    assert fa_digest([_record(a, [5, 4])]) != fa_digest([_record(b, [5, 4])])
    # A padding row that reads keys (seqused_k > 0) has its entries read too.
    c = torch.tensor([[1, 2, 7, 7], [3, 7, 7, 7], [5, 7, 7, 7]], dtype=torch.int32)
    d = c.clone()
    d[2, 0] = 6
    assert fa_digest([_record(c, [5, 4, 1])]) != fa_digest([_record(d, [5, 4, 1])])
