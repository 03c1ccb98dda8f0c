"""Tests for fuzz.verdict.invariants: every invariant is violated once, alone, from a valid batch."""
from __future__ import annotations

import pickle

import pytest
import torch
from hypothesis import given, settings, strategies as st

from fuzz.verdict.invariants import FAInvariantError, VarlenReport, check_varlen_args

I32 = torch.int32


def i32(values) -> torch.Tensor:
    return torch.tensor(values, dtype=I32)


def make_batch(pairs, *, block_size: int = 4, pad_reqs: int = 0, pad_rows: int = 0,
               paged: bool = True, heads: tuple[int, int] = (4, 2), head_dim: int = 16,
               dtype: torch.dtype = torch.float32, device: str = "cpu") -> dict:
    """Valid kwargs for check_varlen_args: (q_len, k_len) per real request, the query being
    the last q_len keys (vLLM), padded graph-style by pad_reqs empty requests and pad_rows rows."""
    q_lens, k_lens = [q for q, _ in pairs], [k for _, k in pairs]
    n, batch = len(pairs), len(pairs) + pad_reqs
    cu_q = [0]
    for length in q_lens:
        cu_q.append(cu_q[-1] + length)
    total = cu_q[-1]
    cu_q += [total] * pad_reqs  # the padded tail repeats the last real offset
    hq, hk = heads
    args = dict(q=torch.empty(total + pad_rows, hq, head_dim, dtype=dtype, device=device),
                cu_seqlens_q=i32(cu_q), max_seqlen_q=max(q_lens, default=0),
                max_seqlen_k=max(k_lens, default=0), num_reqs=n, num_actual_tokens=total)
    if not paged:
        cu_k = [0]
        for length in k_lens:
            cu_k.append(cu_k[-1] + length)
        cu_k += [cu_k[-1]] * pad_reqs
        kv = torch.empty(cu_k[-1], hk, head_dim, dtype=dtype, device=device)
        return dict(args, k=kv, v=kv.clone(), cu_seqlens_k=i32(cu_k))
    need = [-(-k // block_size) for k in k_lens]
    num_blocks = 1 + sum(need) + 2  # block 0 is the null block; two spare blocks
    cols = max(need, default=0) + 1
    # Unused columns of real rows hold -1 and padded rows hold garbage: neither may be read.
    table = [[-1] * cols for _ in range(n)] + [[10**6] * cols for _ in range(pad_reqs)]
    slots, next_block = [], 1
    for i, (q_len, k_len) in enumerate(pairs):
        for j in range(need[i]):
            table[i][j] = next_block
            next_block += 1
        slots += [table[i][p // block_size] * block_size + p % block_size
                  for p in range(k_len - q_len, k_len)]
    kv = torch.empty(num_blocks, block_size, hk, head_dim, dtype=dtype, device=device)
    return dict(args, k=kv, v=kv.clone(), cu_seqlens_k=None, block_table=i32(table),
                seqused_k=i32(k_lens + [0] * pad_reqs),
                slot_mapping=torch.tensor(slots + [-1] * pad_rows, dtype=torch.int64))


def paged_batch(**kw) -> dict:
    """3 requests (chunked prefill across blocks, decode, full prefill), block_size 4,
    padded to a 5-request, 16-row graph: cu_seqlens_q=[0,5,6,13,13,13], seqused_k=[9,6,7,0,0]."""
    return make_batch([(5, 9), (1, 6), (7, 7)], pad_reqs=2, pad_rows=3, **kw)


def dense_batch(**kw) -> dict:
    """3 requests with contiguous k/v: cu_seqlens_q=[0,3,4,8,8], cu_seqlens_k=[0,5,11,15,15]."""
    return make_batch([(3, 5), (1, 6), (4, 4)], pad_reqs=1, paged=False, **kw)


def expect(args: dict, argument: str, index: int | None, **overrides) -> FAInvariantError:
    with pytest.raises(FAInvariantError) as info:
        check_varlen_args(**{**args, **overrides})
    err = info.value
    assert (err.argument, err.index) == (argument, index), str(err)
    message = str(err)
    assert message == err.message and "\n" not in message and argument in message
    if index is not None:
        assert str(index) in message
    return err


def strided(t: torch.Tensor) -> torch.Tensor:
    """Same shape and dtype, but stride(-1) == 2."""
    wide = torch.empty(*t.shape[:-1], 2 * t.shape[-1], dtype=t.dtype, device=t.device)
    return wide[..., ::2]


class FakeCuda(torch.Tensor):
    """A CPU tensor claiming to live on cuda:0, to test device checks on a CPU-only host."""

    @property
    def device(self) -> torch.device:
        return torch.device("cuda", 0)


# --- valid inputs and the report -------------------------------------------------------

@pytest.mark.parametrize("build", [
    paged_batch, dense_batch,
    lambda: make_batch([(5, 9), (1, 6), (7, 7)]),  # no graph padding
    lambda: {**make_batch([(5, 9), (1, 6)]), "num_reqs": None, "num_actual_tokens": None},
    lambda: paged_batch(dtype=torch.float16),
    lambda: dense_batch(dtype=torch.bfloat16, heads=(8, 8), head_dim=128),
    lambda: make_batch([(1, 1)], block_size=16, pad_reqs=7, pad_rows=7),  # decode graph of 8
], ids=["paged-padded", "dense-padded", "paged-unpadded", "defaults", "fp16", "bf16", "decode8"])
def test_valid_batches_pass(build):
    args = build()
    half = args["q"].dtype in (torch.float16, torch.bfloat16)
    assert isinstance(check_varlen_args(**args, require_half=half), VarlenReport)


def test_report_counts_padding_and_overstatement():
    report = check_varlen_args(**{**paged_batch(), "max_seqlen_q": 10, "max_seqlen_k": 12})
    assert report == VarlenReport(num_reqs=3, batch_size=5, num_actual_tokens=13, max_query_len=7,
                                  max_seqlen_q_overstated_by=3, max_key_len=9,
                                  max_seqlen_k_overstated_by=3, rows_dropped=None)
    assert check_varlen_args(**dense_batch()).max_seqlen_k_overstated_by == 0


def test_paged_with_cu_seqlens_k_and_int32_slots_pass():
    args = paged_batch()
    args.update(cu_seqlens_k=i32([0, 9, 15, 22, 22, 22]), slot_mapping=args["slot_mapping"].to(I32))
    assert check_varlen_args(**args).max_key_len == 9


def test_error_is_picklable():
    err = expect(paged_batch(), "max_seqlen_q", 0, max_seqlen_q=1)
    copy = pickle.loads(pickle.dumps(err))
    assert (copy.argument, copy.index, copy.message) == (err.argument, err.index, err.message)


# --- 1. dtypes ---------------------------------------------------------------------------

@pytest.mark.parametrize("name,make,argument", [
    ("k", lambda a: a["k"].double(), "k"),
    ("v", lambda a: a["v"].half(), "v"),
    ("cu_seqlens_q", lambda a: a["cu_seqlens_q"].long(), "cu_seqlens_q"),
    ("seqused_k", lambda a: a["seqused_k"].long(), "seqused_k"),
    ("block_table", lambda a: a["block_table"].long(), "block_table"),
    ("slot_mapping", lambda a: a["slot_mapping"].float(), "slot_mapping"),
    ("slot_mapping", lambda a: a["slot_mapping"].to(torch.int16), "slot_mapping"),
])
def test_dtype(name, make, argument):
    args = paged_batch()
    expect(args, argument, None, **{name: make(args)})


def test_dtype_cu_seqlens_k_and_half():
    args = dense_batch()
    expect(args, "cu_seqlens_k", None, cu_seqlens_k=args["cu_seqlens_k"].long())
    expect(args, "q", None, require_half=True)  # fp32 where the GPU kernel needs fp16/bf16


# --- 2. devices -----------------------------------------------------------------------

@pytest.mark.parametrize("name", ["k", "v", "cu_seqlens_q", "seqused_k", "block_table", "slot_mapping"])
def test_device(name):
    args = paged_batch()
    expect(args, name, None, **{name: args[name].as_subclass(FakeCuda)})


def test_device_cu_seqlens_k():
    args = dense_batch()
    expect(args, "cu_seqlens_k", None, cu_seqlens_k=args["cu_seqlens_k"].as_subclass(FakeCuda))


# --- 3./4. layout, head dim, heads ---------------------------------------------------

@pytest.mark.parametrize("name", ["q", "k", "v"])
@pytest.mark.parametrize("build", [paged_batch, dense_batch])
def test_last_dim_contiguous(name, build):
    args = build()
    expect(args, name, None, **{name: strided(args[name])})


@pytest.mark.parametrize("name", ["k", "v"])
def test_head_dim_mismatch(name):
    args = paged_batch()
    expect(args, name, None, **{name: args[name][..., :8]})


def test_head_dim_limits():
    expect(paged_batch(), "q", None, max_head_dim=8)
    expect(paged_batch(head_dim=12, dtype=torch.float16), "q", None, require_half=True)
    check_varlen_args(**paged_batch(head_dim=12))  # CPU fp32: no %8 rule


@pytest.mark.parametrize("heads", [(3, 2), (4, 3)])
def test_nheads_divisible(heads):
    expect(paged_batch(heads=heads), "k", None)


# --- 5. cu_seqlens structure -------------------------------------------------------------

@pytest.mark.parametrize("cu,index", [
    ([1, 5, 6, 13, 13, 13], 0),   # does not start at 0
    ([0, 5, 4, 13, 13, 13], 1),   # decreases among real requests
    ([0, 5, 6, 13, 13, 14], 5),   # padded tail does not repeat cu[num_reqs]
    ([0, 5, 6, 13, 0, 0], 4),     # stale zeros after the real batch
])
def test_cu_seqlens_q_structure(cu, index):
    expect(paged_batch(), "cu_seqlens_q", index, cu_seqlens_q=i32(cu))


def test_cu_seqlens_q_end_and_bounds():
    args = paged_batch()
    expect(args, "cu_seqlens_q", 3, num_actual_tokens=12)
    expect(args, "cu_seqlens_q", 3, q=args["q"][:12])  # offsets point past q's rows
    expect(args, "cu_seqlens_q", None, cu_seqlens_q=args["cu_seqlens_q"][None])
    expect(args, "num_reqs", None, num_reqs=6)


@pytest.mark.parametrize("override,index", [
    (dict(cu_seqlens_k=i32([0, 5, 3, 15, 15])), 1),
    (dict(cu_seqlens_k=i32([0, 5, 11, 15, 16])), 4),
    (dict(cu_seqlens_k=i32([2, 5, 11, 15, 15])), 0),
    (dict(cu_seqlens_k=i32([0, 5, 11, 15])), None),  # wrong length
    (dict(cu_seqlens_k=None), None),                  # required without block_table
])
def test_cu_seqlens_k_structure(override, index):
    expect(dense_batch(), "cu_seqlens_k", index, **override)


def test_cu_seqlens_k_past_k_rows():
    args = dense_batch()
    expect(args, "cu_seqlens_k", 3, k=args["k"][:14], v=args["v"][:14])


# --- docs/bug_classes.md#pp_shared_staging_buffer: two in-flight microbatches mixing metadata

def test_field_note_rank6_stale_tail():
    args = make_batch([(1479, 1479), (2521, 2521)], pad_reqs=6, paged=False)
    stale = i32([0, 1479, 4000, 2155, 3144, 4000, 0, 0, 0])
    err = expect(args, "cu_seqlens_q", 3, cu_seqlens_q=stale)
    assert "2155" in str(err) and "4000" in str(err)
    # A kernel (or padded graph) that reads the whole tensor sees it decrease at index 2.
    expect(args, "cu_seqlens_q", 2, cu_seqlens_q=stale, num_reqs=None, num_actual_tokens=None)


def test_field_note_rank7_stale_tail():
    args = make_batch([(546, 546)], pad_reqs=7, paged=False)
    stale = i32([0, 546, 1950, 2155, 3144, 4000, 0, 0, 0])
    expect(args, "cu_seqlens_q", 2, cu_seqlens_q=stale)


def test_field_note_scalar_of_one_microbatch_with_tensor_of_another():
    args = make_batch([(1479, 1479), (2521, 2521)], pad_reqs=6, paged=False)
    err = expect(args, "max_seqlen_q", 0, max_seqlen_q=546)
    assert "546" in str(err) and "1479" in str(err)
    assert err.report.max_query_len == 2521
    assert err.report.max_seqlen_q_overstated_by == 546 - 2521


# --- 6. max_seqlen_q / max_seqlen_k ----------------------------------------------------

@pytest.mark.parametrize("max_q,index", [(6, 2), (4, 0), (0, 0)])
def test_max_seqlen_q_understated(max_q, index):
    expect(paged_batch(), "max_seqlen_q", index, max_seqlen_q=max_q)


def test_max_seqlen_k_understated():
    err = expect(paged_batch(), "max_seqlen_k", 0, max_seqlen_k=8)
    assert "seqused_k[0]" in str(err)
    err = expect(dense_batch(), "max_seqlen_k", 1, max_seqlen_k=5)
    assert "cu_seqlens_k[1:3]=[5, 11]" in str(err)


@pytest.mark.parametrize("value", [7.0, -1, "7", True, torch.tensor([7, 7])])
def test_max_seqlen_must_be_an_int(value):
    expect(paged_batch(), "max_seqlen_q", None, max_seqlen_q=value)


def test_max_seqlen_accepts_integer_tensor():
    assert check_varlen_args(**{**paged_batch(), "max_seqlen_q": torch.tensor(7)}).max_query_len == 7


def test_rows_dropped_by_tile():
    args = make_batch([(10, 10), (300, 300)], paged=False)
    err = expect(args, "max_seqlen_q", 1, max_seqlen_q=200, tile_q=128)
    assert err.report.rows_dropped == 44 and "44" in str(err)  # rows 256..299 of sequence 1
    assert check_varlen_args(**args, tile_q=128).rows_dropped == 0
    args = make_batch([(300, 300), (290, 290), (100, 100)], paged=False)
    assert expect(args, "max_seqlen_q", 0, max_seqlen_q=200, tile_q=128).report.rows_dropped == 44 + 34
    # docs/bug_classes.md#graph_stale_max_seqlen: 16 vs 56 rows drops no whole tile, but the
    # understatement is still an error.
    args = make_batch([(56, 56)], paged=False)
    assert expect(args, "max_seqlen_q", 0, max_seqlen_q=16, tile_q=128).report.rows_dropped == 0
    expect(args, "tile_q", None, tile_q=0)


# --- 7. causal ---------------------------------------------------------------------------

def test_causal_needs_no_more_queries_than_keys():
    args = {**paged_batch(), "seqused_k": i32([9, 6, 6, 0, 0])}
    expect(args, "causal", 2)
    check_varlen_args(**args, causal=False)
    expect(make_batch([(3, 5), (4, 3)], paged=False), "causal", 1)


# --- 8. seqused_k -----------------------------------------------------------------------

@pytest.mark.parametrize("used,index", [
    ([9, 6, 7, 0], None),        # not one entry per (padded) sequence
    ([9, 6, -1, 0, 0], 2),       # negative
    ([9, 6, 7, 0, 3], 4),        # padded entry not 0
    ([[9, 6, 7, 0, 0]], None),   # not 1-D
])
def test_seqused_k(used, index):
    expect(paged_batch(), "seqused_k", index, seqused_k=i32(used))


def test_seqused_k_required_or_bounded():
    expect(paged_batch(), "seqused_k", None, seqused_k=None)  # paged, no cu_seqlens_k
    expect(dense_batch(), "seqused_k", 2, seqused_k=i32([5, 6, 5, 0]))  # > cu_seqlens_k length


# --- 9. block_table ----------------------------------------------------------------------

def edit_table(args: dict, *edits: tuple[int, int, int]) -> torch.Tensor:
    table = args["block_table"].clone()
    for row, col, value in edits:
        table[row, col] = value
    return table


def test_block_table_shape():
    args = paged_batch()
    expect(args, "block_table", None, block_table=args["block_table"][:4])  # rows < batch
    expect(args, "block_table", 0, block_table=args["block_table"][:, :2])  # sequence 0 needs 3
    expect(args, "block_table", None, block_table=args["block_table"][0])


@pytest.mark.parametrize("edit,index", [((1, 1, 10), 1), ((2, 0, -1), 2), ((0, 2, 99), 0)])
def test_block_table_ids(edit, index):
    args = paged_batch()
    err = expect(args, "block_table", index, block_table=edit_table(args, edit))
    assert f"block_table[{edit[0]}, {edit[1]}]" in str(err)


def test_block_table_ignores_unneeded_entries():
    args = paged_batch()
    # Past each sequence's ceil(k_len / block_size) blocks, and on padded rows, anything goes.
    check_varlen_args(**{**args, "block_table": edit_table(args, (1, 2, 99), (3, 0, -5), (4, 3, 7))})


def test_block_table_block_written_by_one_and_used_by_another():
    args = paged_batch()
    # Sequence 2 claims block 2, which sequence 0 writes this step (its positions 4..7).
    err = expect(args, "block_table", 0, block_table=edit_table(args, (2, 1, 2)), slot_mapping=None)
    assert "block 2" in str(err) and "sequence 0" in str(err) and "sequence 2" in str(err)


def test_block_table_shared_prefix_and_null_block_pass():
    args = make_batch([(1, 9), (1, 9)], pad_reqs=1)  # two decodes: blocks [1,2,3] and [4,5,6]
    # Prefix caching: both read blocks 1 and 2, each writes its own last block.
    shared = edit_table(args, (1, 0, 1), (1, 1, 2))
    check_varlen_args(**{**args, "block_table": shared, "slot_mapping": None})
    # Both writing block 3 is a conflict; naming the first writer, sequence 0.
    expect(args, "block_table", 0, block_table=edit_table(args, (1, 0, 1), (1, 1, 2), (1, 2, 3)),
           slot_mapping=None)
    # The null block 0 may appear anywhere, even in two write ranges.
    check_varlen_args(**{**args, "block_table": edit_table(args, (0, 2, 0), (1, 2, 0)),
                         "slot_mapping": None})


# --- 10. slot_mapping ----------------------------------------------------------------------

def edit_slots(args: dict, *edits: tuple[int, int]) -> torch.Tensor:
    slots = args["slot_mapping"].clone()
    for token, value in edits:
        slots[token] = value
    return slots


@pytest.mark.parametrize("edits,index", [
    (((3, 40),), 3),    # 10 blocks * 4 slots: 40 is past the cache
    (((3, -2),), 3),    # negative and not the -1 sentinel
    (((14, 5),), 14),   # padded token writes a slot
    (((6, 9),), 6),     # token 6 writes token 1's slot
])
def test_slot_mapping_values(edits, index):
    args = paged_batch()
    expect(args, "slot_mapping", index, slot_mapping=edit_slots(args, *edits))


def test_slot_mapping_length_and_skip():
    args = paged_batch()
    expect(args, "slot_mapping", None, slot_mapping=args["slot_mapping"][:12])
    check_varlen_args(**{**args, "slot_mapping": edit_slots(args, (5, -1))})  # -1: skip the write


# --- meta-device q/k/v -------------------------------------------------------------------

def to_meta(args: dict) -> dict:
    return {**args, **{name: args[name].to("meta") for name in ("q", "k", "v")}}


@pytest.mark.parametrize("build", [paged_batch, dense_batch])
def test_meta_qkv(build):
    args = to_meta(build())
    assert check_varlen_args(**args) == check_varlen_args(**build())
    expect(args, "max_seqlen_q", 0, max_seqlen_q=1)
    expect(args, "q", None, q=strided(args["q"]))
    expect(args, "q", None, require_half=True)  # a recorded GPU call in fp32
    expect(args, "cu_seqlens_q", None, cu_seqlens_q=args["cu_seqlens_q"].to("meta"))  # values needed


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_tensors():
    args = paged_batch(dtype=torch.float16, device="cuda")
    cuda = {name: value.cuda() if isinstance(value, torch.Tensor) and name not in ("q", "k", "v") else value
            for name, value in args.items()}
    assert check_varlen_args(**cuda).max_query_len == 7
    expect(cuda, "cu_seqlens_q", None, cu_seqlens_q=args["cu_seqlens_q"])  # left on the CPU
    expect(cuda, "q", None, **{name: args[name].float() for name in ("q", "k", "v")})  # fp32 on GPU


# --- valid random batches -----------------------------------------------------------------

pairs = st.lists(st.tuples(st.integers(1, 40), st.integers(0, 40)).map(lambda t: (t[0], t[0] + t[1])),
                 min_size=1, max_size=8)


@settings(max_examples=60, deadline=None)
@given(pairs=pairs, paged=st.booleans(), block_size=st.sampled_from([1, 4, 16]),
       pad_reqs=st.integers(0, 3), pad_rows=st.integers(0, 8), slack=st.integers(0, 5))
def test_random_valid_batches_pass(pairs, paged, block_size, pad_reqs, pad_rows, slack):
    args = make_batch(pairs, paged=paged, block_size=block_size, pad_reqs=pad_reqs, pad_rows=pad_rows)
    args["max_seqlen_q"] += slack
    report = check_varlen_args(**args, tile_q=128)
    assert report.max_query_len == max(q for q, _ in pairs)
    assert report.max_key_len == max(k for _, k in pairs)
    assert report.max_seqlen_q_overstated_by == slack and report.max_seqlen_k_overstated_by == 0
    assert (report.num_reqs, report.batch_size, report.rows_dropped) == (len(pairs), len(pairs) + pad_reqs, 0)
