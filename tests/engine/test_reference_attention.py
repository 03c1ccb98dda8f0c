"""The reference backend honours the FlashAttention varlen contract literally.

With correct scalars `varlen_attention` equals per-sequence naive causal attention over
contiguous keys, whatever the paging. With an understated `max_seqlen_q` exactly the rows a
GPU would leave uncomputed are NaN (rounded up to whole row tiles with `tile_q`), or keep the
output memory's stale contents when given one; an understated `max_seqlen_k` drops keys only
where the work width is bounded by it (no `key_len_pad`: FA2 itself reads each sequence's
own keys). Nothing past a sequence's `seqused_k` is read: neither poisoned block-table
entries nor KV-cache poison.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
import torch

from engine.attention.reference import naive_attention, reshape_and_cache, varlen_attention

ATOL = 1e-5
I32 = torch.int32
POISON_BLOCK = -(2 ** 30)


@dataclass
class Batch:
    q: torch.Tensor  # [T_pad, Hq, D]
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    cu_seqlens_q: torch.Tensor
    seqused_k: torch.Tensor
    block_table: torch.Tensor
    q_lens: list[int]
    k_lens: list[int]
    ks: list[torch.Tensor]  # contiguous keys per sequence [k_len, Hkv, D]
    vs: list[torch.Tensor]
    scale: float
    used_slots: torch.Tensor  # bool [num_blocks * block_size]: slots holding live keys

    @property
    def num_tokens(self) -> int:
        return sum(self.q_lens)

    def run(self, max_seqlen_q: int | None = None, max_seqlen_k: int | None = None, **kw) -> torch.Tensor:
        return varlen_attention(
            self.q, self.k_cache, self.v_cache, self.cu_seqlens_q,
            max(self.q_lens) if max_seqlen_q is None else max_seqlen_q, self.seqused_k,
            max(self.k_lens) if max_seqlen_k is None else max_seqlen_k, self.block_table,
            self.scale, causal=True, **kw)

    def naive(self) -> list[torch.Tensor]:
        """Per sequence: bottom-right causal attention over its contiguous keys."""
        out, start = [], 0
        for ql, k, v in zip(self.q_lens, self.ks, self.vs):
            out.append(naive_attention(self.q[start:start + ql], k, v, self.scale))
            start += ql
        return out

    def rows(self, i: int) -> slice:
        start = sum(self.q_lens[:i])
        return slice(start, start + self.q_lens[i])


def make_batch(pairs: list[tuple[int, int]], *, hkv: int = 2, group: int = 2, d: int = 16,
               block_size: int = 4, extra_blocks: int = 3, pad_tokens: int = 0, pad_cols: int = 2,
               seed: int = 0, kv_fill: float = 0.0) -> Batch:
    """A paged batch: per (q_len, k_len) pair the query is the last q_len of k_len tokens; KV
    pages are a shuffled draw from blocks 1.. (block 0 is the null block); unused block-table
    entries are 0, unused cache slots hold `kv_fill`."""
    g = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    hq = hkv * group
    nblocks = [-(-k // block_size) for _, k in pairs]
    num_blocks = 1 + sum(nblocks) + extra_blocks
    perm = list(range(1, num_blocks))
    rng.shuffle(perm)
    k_cache = torch.full((num_blocks, block_size, hkv, d), kv_fill)
    v_cache = torch.full((num_blocks, block_size, hkv, d), kv_fill)
    table = torch.zeros(len(pairs), max(nblocks) + pad_cols, dtype=I32)
    used = torch.zeros(num_blocks * block_size, dtype=torch.bool)
    ks, vs, qs = [], [], []
    for i, (ql, kl) in enumerate(pairs):
        assert 1 <= ql <= kl
        blocks = [perm.pop() for _ in range(nblocks[i])]
        table[i, :len(blocks)] = torch.tensor(blocks, dtype=I32)
        k = torch.randn(kl, hkv, d, generator=g)
        v = torch.randn(kl, hkv, d, generator=g)
        pos = torch.arange(kl)
        slots = torch.tensor(blocks)[pos // block_size] * block_size + pos % block_size
        reshape_and_cache(k, v, k_cache, v_cache, slots)
        used[slots] = True
        ks.append(k)
        vs.append(v)
        qs.append(torch.randn(ql, hq, d, generator=g) * 2.0)
    q = torch.cat(qs + [torch.full((pad_tokens, hq, d), float("nan"))])
    cu = torch.zeros(len(pairs) + 1, dtype=I32)
    cu[1:] = torch.cumsum(torch.tensor([p[0] for p in pairs]), 0)
    return Batch(q, k_cache, v_cache, cu, torch.tensor([p[1] for p in pairs], dtype=I32), table,
                 [p[0] for p in pairs], [p[1] for p in pairs], ks, vs, d ** -0.5, used)


def random_pairs(rng: random.Random) -> list[tuple[int, int]]:
    """A mix of decodes (q=1), whole prefills (q=k) and chunked prefills (q<k)."""
    pairs = []
    for _ in range(rng.randint(1, 6)):
        kind = rng.choice(["decode", "prefill", "chunk"])
        k = rng.randint(1, 40)
        q = {"decode": 1, "prefill": k, "chunk": rng.randint(1, k)}[kind]
        pairs.append((q, k))
    return pairs


def assert_rows_match_naive(b: Batch, out: torch.Tensor, seqs=None) -> None:
    for i, ref in enumerate(b.naive()):
        if seqs is not None and i not in seqs:
            continue
        got = out[b.rows(i)]
        assert not got.isnan().any(), f"sequence {i}: NaN rows"
        err = (got - ref).abs().max().item()
        assert err <= ATOL, f"sequence {i} (q={b.q_lens[i]}, k={b.k_lens[i]}): error {err:.3g}"


# -- correct scalars -------------------------------------------------------------------------------

@pytest.mark.parametrize("seed", range(24))
def test_equals_naive_attention_with_right_scalars(seed):
    rng = random.Random(seed)
    hkv = rng.choice([1, 2, 4])
    b = make_batch(random_pairs(rng), hkv=hkv, group=rng.choice([1, 2, 4]), d=rng.choice([8, 16, 32]),
                   block_size=rng.choice([1, 2, 4, 8, 16]), pad_tokens=rng.randint(0, 5), seed=seed)
    out = b.run()
    assert_rows_match_naive(b, out)
    assert out[b.num_tokens:].isnan().all(), "rows past the live batch must stay NaN"


@pytest.mark.parametrize("group", [1, 2, 8])
def test_gqa_and_mha_with_shuffled_pages(group):
    pairs = [(1, 13), (9, 9), (4, 21), (1, 1), (16, 16), (3, 8)]
    b = make_batch(pairs, hkv=2, group=group, block_size=4, seed=group)
    assert_rows_match_naive(b, b.run())


def test_overstated_scalars_change_nothing():
    b = make_batch([(5, 12), (1, 30), (7, 7)], seed=3)
    exact = b.run()
    loose = b.run(max_seqlen_q=40, max_seqlen_k=64)
    torch.testing.assert_close(loose[:b.num_tokens], exact[:b.num_tokens], atol=1e-6, rtol=0)


# -- understated scalars -----------------------------------------------------------------------------

def nan_rows(b: Batch, out: torch.Tensor) -> set[tuple[int, int]]:
    """(sequence, local row) of every real row holding any NaN."""
    bad = out[:b.num_tokens].isnan().any(dim=(1, 2))
    return {(i, j) for i in range(len(b.q_lens)) for j in range(b.q_lens[i]) if bad[b.rows(i)][j]}


@pytest.mark.parametrize("max_q", [1, 3, 8, 15])
def test_nan_rows_exactly_where_max_seqlen_q_understates(max_q):
    b = make_batch([(16, 16), (4, 20), (1, 9), (9, 30), (3, 3)], seed=max_q, pad_tokens=3)
    out = b.run(max_seqlen_q=max_q)
    expected = {(i, j) for i, ql in enumerate(b.q_lens) for j in range(max_q, ql)}
    assert expected, "the batch must have a query longer than max_seqlen_q"
    assert nan_rows(b, out) == expected
    # Every row below max_seqlen_q is still exact.
    for i, ref in enumerate(b.naive()):
        n = min(max_q, b.q_lens[i])
        torch.testing.assert_close(out[b.rows(i)][:n], ref[:n], atol=ATOL, rtol=0)
    assert out[b.num_tokens:].isnan().all()


@pytest.mark.parametrize("max_q, tile", [(1, 4), (5, 4), (8, 4), (3, 16), (17, 8), (9, 1)])
def test_nan_rows_start_at_whole_row_tiles_with_tile_q(max_q, tile):
    b = make_batch([(30, 30), (12, 25), (1, 7), (20, 20)], seed=tile, block_size=8)
    out = b.run(max_seqlen_q=max_q, tile_q=tile)
    first_bad = -(-max_q // tile) * tile
    expected = {(i, j) for i, ql in enumerate(b.q_lens) for j in range(first_bad, ql)}
    assert nan_rows(b, out) == expected
    for i, ref in enumerate(b.naive()):
        n = min(first_bad, b.q_lens[i])
        torch.testing.assert_close(out[b.rows(i)][:n], ref[:n], atol=ATOL, rtol=0)


def test_understated_max_seqlen_k_changes_results():
    b = make_batch([(1, 30), (6, 24), (2, 5), (5, 5)], seed=11)
    max_k = 10
    out = b.run(max_seqlen_k=max_k)
    assert not out[:b.num_tokens].isnan().any(), "dropped keys give wrong rows, not NaN"
    for i, ref in enumerate(b.naive()):
        err = (out[b.rows(i)] - ref).abs().max().item()
        if b.k_lens[i] > max_k:
            assert err > 1e-3, f"sequence {i}: k_len {b.k_lens[i]} > max_seqlen_k yet unchanged"
        else:
            assert err <= ATOL, f"sequence {i}: k_len {b.k_lens[i]} <= max_seqlen_k yet changed"


def test_understated_max_seqlen_k_changes_nothing_with_the_engines_key_pad():
    """FA2 loops over each sequence's own key blocks: the engine pads the key work to
    max_model_len, and then max_seqlen_k, however small, drops nothing."""
    b = make_batch([(1, 30), (6, 24), (2, 5), (5, 5)], seed=11)
    exact = b.run(key_len_pad=32)
    torch.testing.assert_close(b.run(max_seqlen_k=10, key_len_pad=32)[:b.num_tokens], exact[:b.num_tokens],
                               atol=0, rtol=0)
    assert_rows_match_naive(b, exact)


def test_rows_not_launched_keep_the_output_memorys_stale_contents():
    """Given the output memory, rows past the launched tiles keep what it held (finite, as GPU
    memory is), the launched rows are written into it, and nothing is NaN."""
    b = make_batch([(30, 30), (12, 25), (1, 7), (20, 20)], seed=2, block_size=8)
    memory = torch.randn(b.q.shape[0] + 4, *b.q.shape[1:])
    held = memory.clone()
    out = b.run(max_seqlen_q=5, tile_q=8, out=memory)
    assert torch.isfinite(out).all()
    launched = torch.zeros(b.q.shape[0], dtype=torch.bool)
    for i, ql in enumerate(b.q_lens):
        launched[b.rows(i).start:b.rows(i).start + min(8, ql)] = True
    assert torch.equal(out[~launched], held[:b.q.shape[0]][~launched])
    assert torch.equal(memory[:b.q.shape[0]], out) and torch.equal(memory[b.q.shape[0]:], held[b.q.shape[0]:])
    for i, ref in enumerate(b.naive()):
        n = min(8, b.q_lens[i])
        torch.testing.assert_close(out[b.rows(i)][:n], ref[:n], atol=ATOL, rtol=0)


# -- nothing past seq_len is read ----------------------------------------------------------------

def test_poisoned_block_table_entries_past_seq_len_are_never_read():
    pairs = [(1, 13), (9, 9), (4, 21), (1, 1), (2, 8)]
    b = make_batch(pairs, seed=5, pad_cols=4)
    clean = b.run()
    for i, kl in enumerate(b.k_lens):
        b.block_table[i, -(-kl // 4):] = POISON_BLOCK
    assert torch.equal(b.run(), clean)


@pytest.mark.parametrize("poison", [1.0e4, 3.0e38, float("nan")])
def test_kv_cache_poison_past_seq_len_is_never_read(poison):
    """Poison every slot that holds no live key: the unused tail of each sequence's last page
    and every unowned block. Finite poison may go everywhere, the null block 0 included; NaN
    stays out of the null block (paged kernels load whole pages, and 0 x NaN is NaN)."""
    pairs = [(1, 13), (9, 9), (4, 21), (1, 1), (2, 6)]
    b = make_batch(pairs, seed=9, block_size=8)
    clean = b.run()
    flat_k = b.k_cache.view(-1, *b.k_cache.shape[2:])
    flat_v = b.v_cache.view(-1, *b.v_cache.shape[2:])
    dead = ~b.used_slots
    if poison != poison:  # NaN
        dead[:b.k_cache.shape[1]] = False
    flat_k[dead] = poison
    flat_v[dead] = poison
    assert torch.equal(b.run(), clean)


def test_query_rows_and_metadata_past_the_live_batch_are_never_read():
    """Padded query rows are NaN and padded seqused_k / block-table rows are poison: real rows
    are unchanged (the kernel only looks at cu_seqlens_q[:B+1] and seqused_k[:B])."""
    pairs = [(3, 10), (1, 4), (6, 6)]
    b = make_batch(pairs, seed=2, pad_tokens=5)
    clean = b.run()
    B = len(pairs)
    b.seqused_k = torch.cat([b.seqused_k, torch.full((3,), POISON_BLOCK, dtype=I32)])
    b.block_table = torch.cat([b.block_table, torch.full((3, b.block_table.shape[1]), POISON_BLOCK, dtype=I32)])
    out = varlen_attention(b.q, b.k_cache, b.v_cache, b.cu_seqlens_q, max(b.q_lens), b.seqused_k[:B],
                           max(b.k_lens), b.block_table[:B], b.scale)
    T = b.num_tokens
    assert torch.equal(out[:T], clean[:T])
    assert not clean[:T].isnan().any() and out[T:].isnan().all()


def test_reshape_and_cache_skips_padding_slots():
    k_cache = torch.zeros(4, 2, 1, 2)
    v_cache = torch.zeros(4, 2, 1, 2)
    k = torch.arange(1.0, 7.0).view(3, 1, 2)
    reshape_and_cache(k, -k, k_cache, v_cache, torch.tensor([3, -1, 6]))
    flat = k_cache.view(-1, 1, 2)
    assert torch.equal(flat[3], k[0]) and torch.equal(flat[6], k[2])
    assert int((k_cache != 0).sum()) == 4  # two slots x two dims, nothing else written
    assert torch.equal(v_cache.view(-1, 1, 2)[6], -k[2])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_rows_bits_do_not_depend_on_the_key_work_width(dtype):
    """The CPU plan stops the key work at the batch's longest sequence instead of the
    engine's key pad (max_model_len). That is only sound if masked keys change no bit of a
    row: the same batch at every work width gives the same bits."""
    from engine.attention.reference import _attend, _make_plan

    for seed in range(40):
        b = make_batch(random_pairs(random.Random(seed)), seed=seed)
        q = b.q.to(dtype)
        kc, vc = b.k_cache.to(dtype), b.v_cache.to(dtype)
        outs = []
        for pad in (max(b.k_lens), 96, 160, 512):
            plan = _make_plan(b.cu_seqlens_q, b.seqused_k, b.block_table, max(b.q_lens), max(b.k_lens),
                              b.q.shape[0], b.k_cache.shape[1], True, 64, pad)
            assert plan.Lk == max(max(b.k_lens), pad)
            outs.append(_attend(plan, q, kc, vc, b.scale))
        for o in outs[1:]:
            assert torch.equal(o, outs[0]), seed
        # The host plan (launched pairs only, keys up to the longest sequence) writes the
        # same bits as the GPU plan (every pair, keys up to the pad).
        T = b.q.shape[0]
        dev_rows = torch.full((T + 1, *q.shape[1:]), float("nan"), dtype=dtype)
        dev_rows.index_put_((plan.dst,), outs[-1])
        host = varlen_attention(q, kc, vc, b.cu_seqlens_q, max(b.q_lens), b.seqused_k, max(b.k_lens),
                                b.block_table, b.scale, tile_q=64, key_len_pad=512)
        assert torch.equal(host, dev_rows[:T]), seed


def test_one_plan_serves_every_call_with_the_same_metadata_content():
    """Two ranks' buffers with equal contents share one launch plan; a write to the
    metadata makes a new one."""
    from engine.attention import reference as ref

    b = make_batch([(1, 9), (5, 12), (3, 3)], seed=3)
    args = (max(b.q_lens), max(b.k_lens), b.q.shape[0], b.k_cache.shape[1], True, 64, 64)
    p1 = ref.plan_launch(b.cu_seqlens_q, b.seqused_k, b.block_table, *args)
    p2 = ref.plan_launch(b.cu_seqlens_q.clone(), b.seqused_k.clone(), b.block_table.clone(), *args)
    assert p1 is p2
    sl = b.seqused_k.clone()
    sl[0] -= 1
    assert ref.plan_launch(b.cu_seqlens_q, sl, b.block_table, *args) is not p1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_long_launch_split_by_key_width_gives_the_same_bits(dtype):
    """A host launch with much key work runs in parts by the keys each row can see (a long
    prefill's early rows, short sequences beside a long one); the bits are those of one part."""
    from engine.attention.reference import _attend, _make_plan, plan_launch

    b = make_batch([(200, 300), (1, 40), (1, 299), (30, 120), (64, 64)], seed=5)
    q, kc, vc = b.q.to(dtype), b.k_cache.to(dtype), b.v_cache.to(dtype)
    args = (b.cu_seqlens_q, b.seqused_k, b.block_table, max(b.q_lens), max(b.k_lens), b.q.shape[0],
            b.k_cache.shape[1], True, 64, 512)
    host = plan_launch(*args)
    assert host.rest, "the launch was not split"
    assert sum(p.R for p in (host, *host.rest)) == sum(b.q_lens)
    assert max(p.Lk for p in (host, *host.rest)) > min(p.Lk for p in (host, *host.rest))
    whole = _make_plan(*args)  # the GPU's plan: one part, every pair at the full width
    T = b.q.shape[0]
    want = torch.full((T + 1, *q.shape[1:]), float("nan"), dtype=dtype)
    want.index_put_((whole.dst,), _attend(whole, q, kc, vc, b.scale))
    got = varlen_attention(q, kc, vc, b.cu_seqlens_q, max(b.q_lens), b.seqused_k, max(b.k_lens),
                           b.block_table, b.scale, tile_q=64, key_len_pad=512)
    assert torch.equal(got, want[:T])
    assert_rows_match_naive(b, got.float()) if dtype == torch.float32 else None
