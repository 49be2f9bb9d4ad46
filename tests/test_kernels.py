"""Kernels (model/kernels/) against their references (model/kernels/reference.py).

CPU: small shapes through Triton's interpreter (TRITON_INTERPRET=1), skipped when Triton is not installed
(it is the `kernels` extra; CI's dev extras do not include it). GPU (@pytest.mark.gpu): the compiled
kernels on several shapes, ragged ones included, and the model's forward with and without them.
Inputs are fresh random draws; outputs are poisoned before the kernels write them where they allocate.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read when a Triton kernel is defined

triton = pytest.importorskip("triton")

from dsv41.model import formats  # noqa: E402
from dsv41.model.kernels import indexer, mhc, quant, reference, sparse_attention  # noqa: E402

CPU = not torch.cuda.is_available()
interp = pytest.mark.skipif(not CPU or os.environ.get("TRITON_INTERPRET") != "1",
                            reason="CPU interpreter tests (a GPU runs the gpu-marked ones)")
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    assert not torch.isnan(a).any()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


# ---------------------------------------------------------------------------------- builders
def attention_case(B, T, H, D, W, N, Kw, Km, seed, device=DEV, empty_row=True):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, D, generator=g).bfloat16()
    wc, ws = formats.pack_fp8_ue8m0(torch.randn(B, W, D, generator=g) * 2)
    mc, ms = formats.pack_fp4_e4m3(torch.randn(B, N, D, generator=g))
    sink = torch.randn(H, generator=g)
    widx = torch.randint(-1, W, (B, T, Kw), generator=g)
    midx = torch.randint(-1, N, (B, T, Km), generator=g)
    if empty_row:
        widx[0, 0], midx[0, 0] = -1, -1  # a query that sees nothing gives 0
    to = lambda *ts: [t.to(device) for t in ts]  # noqa: E731
    return to(q, wc, ws, mc, ms, sink, widx, midx)


def indexer_case(B, T, H, DK, N, C, seed, device=DEV):
    g = torch.Generator().manual_seed(seed)
    q = formats.mxfp4_fake_quant(torch.randn(B, T, H, DK, generator=g))
    w = torch.randn(B, T, H, generator=g) * (DK * H) ** -0.5
    kc, ks = formats.pack_mxfp4(torch.randn(B, N, DK, generator=g))
    visible = torch.randint(0, N + 1, (T,), generator=g)
    cand = torch.randint(-1, N, (B, T, C), generator=g)
    return [t.to(device) for t in (q, w, kc, ks, visible, cand)]


def mhc_case(B, T, n, d, seed, device=DEV):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, T, n, d, generator=g).bfloat16()
    y = torch.randn(B, T, d, generator=g).bfloat16()
    pre_prev = torch.rand(B, T, n, generator=g)
    post = 2 * torch.rand(B, T, n, generator=g)
    comb = torch.rand(B, T, n, n, generator=g)
    fn = torch.randn((n + 2) * n, n * d, generator=g) * (n * d) ** -0.5
    scale = torch.rand(3, generator=g) + 0.5
    base = torch.randn((n + 2) * n, generator=g) * 0.1
    return [t.to(device) for t in (x, y, pre_prev, post, comb, fn, scale, base)]


def check_attention(case, force, tol, variant="auto"):
    q, wc, ws, mc, ms, sink, widx, midx = case
    scale = q.size(-1) ** -0.5
    out = sparse_attention.sparse_attention_packed(q, wc, ws, mc, ms, sink, widx, midx, scale, force_triton=force,
                                                   variant=variant)
    ref = reference.sparse_attention_packed(q, wc, ws, mc, ms, sink, widx, midx, scale)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert rel_err(out, ref) < tol
    assert torch.equal(out[0, 0], torch.zeros_like(out[0, 0]))  # the empty query
    # window-only (SWA layers)
    out = sparse_attention.sparse_attention_packed(q, wc, ws, None, None, sink, widx, None, scale, force_triton=force,
                                                   variant=variant)
    ref = reference.sparse_attention_packed(q, wc, ws, None, None, sink, widx, None, scale)
    assert rel_err(out, ref) < tol


def check_indexer(case, force):
    q, w, kc, ks, visible, cand = case
    for v, c in ((visible, None), (None, None), (visible, cand)):
        out = indexer.indexer_scores(q, w, kc, ks, v, c, force_triton=force)
        ref = reference.indexer_scores(q, w, kc, ks, v, c)
        finite = torch.isfinite(ref)
        assert torch.equal(torch.isfinite(out), finite)
        assert rel_err(out[finite], ref[finite]) < 1e-5
    k = 8
    top = indexer.indexer_topk(q, w, kc, ks, visible, k, force_triton=force)
    scores = reference.indexer_scores(q, w, kc, ks, visible)
    kth = scores.topk(min(k, scores.size(-1)), dim=-1).values[..., -1:]
    chosen = torch.where(top >= 0, scores.gather(-1, top.clamp_min(0)), torch.inf)
    assert bool((chosen >= kth - 1e-4 * kth.abs().clamp_min(1)).all())  # each pick is a true top-k score
    assert torch.equal((top >= 0).sum(-1), torch.minimum(visible, torch.tensor(k)).expand_as(top[..., 0]))
    # over the candidate list (the Reindex layers' pool): the fused Top-K against torch's on the same scores
    top = indexer.indexer_topk(q, w, kc, ks, visible, k, candidates=cand, force_triton=force)
    scores = indexer.indexer_scores(q, w, kc, ks, visible, cand, force_triton=force)
    check_topk(top, torch_topk(scores, k, cand), scores, cand)


def torch_topk(scores, k, cand=None):
    """indexer_topk's torch tail (method="torch"): the k largest, ids ascending, -1 (last) for -inf picks."""
    top = scores.topk(min(k, scores.size(-1)), dim=-1, sorted=False)
    ids = top.indices if cand is None else cand.long().expand_as(scores).gather(-1, top.indices)
    big = torch.iinfo(torch.long).max
    ids = torch.where(torch.isfinite(top.values), ids, big).sort(dim=-1).values
    return torch.where(ids == big, -1, ids)


def check_topk(top, ref, scores, cand=None, exact=False):
    """The same number of picks and the same multiset of picked scores (picks between equal scores may
    differ); with exact (distinct scores), the same ids in the same order."""
    assert top.shape == ref.shape and top.dtype == torch.long
    assert torch.equal((top >= 0).sum(-1), (ref >= 0).sum(-1))
    assert bool((top[..., :-1] <= top[..., 1:]).logical_or(top[..., 1:] < 0).all())  # ascending, -1s last
    if exact:
        assert torch.equal(top, ref)
    pos = lambda ids: ids if cand is None else (  # noqa: E731  entry id -> its column in the scores
        cand.long().expand_as(scores)[..., :, None] == ids[..., None, :]).long().argmax(-2)
    picked = lambda ids: torch.where(ids >= 0, scores.gather(-1, pos(ids.clamp_min(0))), -torch.inf)  # noqa: E731
    assert torch.equal(picked(top).sort(-1).values, picked(ref).sort(-1).values)


def check_mhc(case, force, tol_x, tol_c):
    x, y, pre_prev, post, comb, fn, scale, base = case
    for yy in (y, None):
        out = mhc.mhc_step(x, pre_prev, fn, scale, base, 20, 1e-6, 1e-6, yy, post, comb, force_triton=force)
        ref = reference.mhc_step(x, pre_prev, fn, scale, base, 20, 1e-6, 1e-6, yy, post, comb)
        for i, (a, b) in enumerate(zip(out, ref)):
            assert a.shape == b.shape and a.dtype == b.dtype
            assert rel_err(a, b) < (tol_x if i < 2 else tol_c), i


def check_pack(x, force):
    for name in ("pack_fp4_e4m3", "pack_fp8_ue8m0"):
        out = getattr(quant, name)(x, force_triton=force)
        ref = getattr(reference, name)(x)
        for a, b in zip(out, ref):
            assert a.shape == b.shape and torch.equal(a, b), name


def pack_input(shape, dtype, seed, device=DEV):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.exp(4 * torch.randn(*shape[:-1], 1, generator=g))
    flat = x.view(-1)
    flat[:40] = 0  # an all-zero block: the amax floors
    flat[40:48] *= 1e-7  # scales in the subnormal range
    flat[50] = -0.0
    flat[60] = 1e5
    return x.to(dtype).to(device)


# ---------------------------------------------------------------------------------- CPU (interpreter)
@interp
@pytest.mark.parametrize("variant", ["split", "tiles"])  # split: how "auto" runs decode (and prefill if chosen)
@pytest.mark.parametrize("shape", [(2, 3, 4, 64, 8, 20, 5, 7), (1, 2, 3, 32, 5, 40, 3, 70)])
def test_sparse_attention_interpreted(shape, variant):
    check_attention(attention_case(*shape, seed=sum(shape)), force=True, tol=2e-2, variant=variant)


@interp
@pytest.mark.parametrize("shape", [(2, 1, 4, 64, 8, 20, 5, 7), (3, 1, 5, 64, 40, 300, 70, 150),
                                   (2, 1, 16, 256, 20, 90, 19, 45)])
def test_sparse_attention_split_decode_interpreted(shape):
    """Decode (T=1) takes the split kernel + combine by default: several splits per token (the last shape
    uses the D>=256 tile of 16 rows, with splits that hold only window or only main rows), -1 holes, a
    token that sees nothing, a batch row whose window is all -1 (splits with no valid row: l = 0), and a
    sink large enough to matter. Same reference and bound as the tile kernel."""
    q, wc, ws, mc, ms, sink, widx, midx = attention_case(*shape, seed=sum(shape))
    if shape[0] > 2:
        widx[2] = -1
    sink = sink * 3
    B, _, H, D = q.shape
    from dsv41.model.kernels.sparse_attention import segment_splits

    seg_splits = [n for _, n in segment_splits(B, [widx.size(-1), midx.size(-1)], D, 132)[1]]
    assert sum(seg_splits) > 1  # the merge is exercised
    calls = []
    launch = sparse_attention._launch_split
    sparse_attention._launch_split = lambda *a: calls.append(1) or launch(*a)
    try:
        check_attention((q, wc, ws, mc, ms, sink, widx, midx), force=True, tol=6e-3)  # measured ~2e-3
    finally:
        sparse_attention._launch_split = launch
    assert len(calls) == 2  # both calls (with and without the main store) took the split path


@interp
def test_sparse_attention_split_matches_tiles_interpreted():
    """variant="split" on a multi-token batch (rows = B*T) agrees with the tile kernel and the reference."""
    q, wc, ws, mc, ms, sink, widx, midx = attention_case(2, 3, 4, 64, 8, 20, 5, 70, seed=11)
    args = (q, wc, ws, mc, ms, sink, widx, midx, 0.125)
    split = sparse_attention.sparse_attention_packed(*args, force_triton=True, variant="split")
    tiles = sparse_attention.sparse_attention_packed(*args, force_triton=True, variant="tiles")
    ref = reference.sparse_attention_packed(*args)
    assert rel_err(split, ref) < 6e-3 and rel_err(tiles, ref) < 2e-2
    assert rel_err(split, tiles) < 2e-2
    with pytest.raises(ValueError, match="variant"):
        sparse_attention.sparse_attention_packed(*args, force_triton=True, variant="nope")


@interp
def test_sparse_attention_prefill_takes_split_in_row_groups_interpreted(monkeypatch):
    """Prefill (T > 1) with variant "auto" takes the split kernel by default (PREFILL_VARIANT), the tile kernel
    where PREFILL_VARIANT says "tiles" and above SPLIT_MAX_HEADS heads. The split path's query tokens go through
    in groups of SPLIT_GROUP_ROWS: with groups of 3 over B=2 x T=4 (rows
    0-2, then 3-5 across the batch rows, then a shorter 6-7) the output is bit for bit the one-group output
    (same split choice, same per-token work) and matches the reference; the empty query stays 0."""
    from dsv41.model.kernels import _triton_sparse_attention as kernels
    from dsv41.model.kernels.sparse_attention import segment_splits

    calls, combines = [], []
    for kind in ("split", "tiles"):
        launch = getattr(sparse_attention, f"_launch_{kind}")
        monkeypatch.setattr(sparse_attention, f"_launch_{kind}",
                            lambda *a, _f=launch, _k=kind: calls.append(_k) or _f(*a))

    class CountedCombine:  # split_combine_kernel[grid]: one launch per group, grid[0] = the group's rows
        def __getitem__(self, grid, _kernel=kernels.split_combine_kernel):
            combines.append(grid[0])
            return _kernel[grid]

    monkeypatch.setattr(kernels, "split_combine_kernel", CountedCombine())
    q, wc, ws, mc, ms, sink, widx, midx = attention_case(2, 4, 4, 64, 8, 20, 5, 70, seed=21)
    sink = sink * 3
    assert sparse_attention.PREFILL_VARIANT == "split"
    with monkeypatch.context() as m:
        m.setattr(sparse_attention, "PREFILL_VARIANT", "tiles")
        sparse_attention.sparse_attention_packed(q, wc, ws, mc, ms, sink, widx, midx, 0.125, force_triton=True)
    assert calls == ["tiles"]
    calls.clear()
    B, T, H, D = q.shape
    assert B * T <= sparse_attention.SPLIT_GROUP_ROWS
    assert segment_splits(3, [5, 70], D, 132) == segment_splits(B * T, [5, 70], D, 132)  # what bit for bit needs
    for m_codes, m_scales, m_idx in ((mc, ms, midx), (None, None, None)):  # and window-only (one segment)
        args = (q, wc, ws, m_codes, m_scales, sink, widx, m_idx, 0.125)
        whole = sparse_attention.sparse_attention_packed(*args, force_triton=True)
        with monkeypatch.context() as m:
            m.setattr(sparse_attention, "SPLIT_GROUP_ROWS", 3)
            grouped = sparse_attention.sparse_attention_packed(*args, force_triton=True)
        assert combines == [B * T, 3, 3, 2]
        combines.clear()
        assert torch.equal(grouped, whole)
        assert rel_err(grouped, reference.sparse_attention_packed(*args)) < 6e-3
        assert torch.equal(grouped[0, 0], torch.zeros_like(grouped[0, 0]))
    assert calls == ["split"] * 4
    # more heads than the split kernel's program holds: the tile kernel
    q, wc, ws, mc, ms, sink, widx, midx = attention_case(1, 2, sparse_attention.SPLIT_MAX_HEADS + 1, 32, 4, 6, 3,
                                                         5, seed=22)
    args = (q, wc, ws, mc, ms, sink, widx, midx, 0.125)
    out = sparse_attention.sparse_attention_packed(*args, force_triton=True)
    assert calls[4:] == ["tiles"]
    assert rel_err(out, reference.sparse_attention_packed(*args)) < 2e-2


@interp
def test_sparse_attention_split_empty_segments_interpreted():
    """Decode with an empty window list, an empty main list, or both (no launch of that segment; with none,
    the partials are set to 'nothing seen' and the output is 0)."""
    q, wc, ws, mc, ms, sink, widx, midx = attention_case(2, 1, 4, 64, 8, 20, 5, 7, seed=1)
    for w, m in [(widx[..., :0], midx), (widx, midx[..., :0]), (widx[..., :0], midx[..., :0])]:
        out = sparse_attention.sparse_attention_packed(q, wc, ws, mc, ms, sink, w, m, 0.125, force_triton=True)
        ref = reference.sparse_attention_packed(q, wc, ws, mc, ms, sink, w, m, 0.125)
        assert rel_err(out, ref) < 6e-3
        if w.size(-1) + m.size(-1) == 0:
            assert torch.equal(out, torch.zeros_like(out))
        else:
            assert out.abs().amax() > 0


def test_sparse_attention_segment_splits(monkeypatch):
    """The split path's plan (segment_splits): every tile covered, no split empty; each segment cut on its own into
    whole waves of SMs x SPLIT_RESIDENT programs. Decode at B = 64 (V4.1: 128 window rows, 512 main rows, 32-row
    tiles): 2 splits of 2 tiles and 2 of 8 (128 programs a launch), where split_config's shared tile count ("share")
    gave 1 of 4 (64 programs) and 4 of 4 (256); one sequence: one tile a split; a prefill group of 1024 rows: one
    split a segment, as before."""
    from dsv41.model.kernels import sparse_attention as sa

    for rows, counts, D in [(1, [128, 512], 512), (8, [128, 512], 512), (64, [128, 512], 512),
                            (4096, [128, 512], 512), (3, [70, 150], 64), (1, [5], 64), (2, [0, 33], 512)]:
        BK, plan = sa.segment_splits(rows, counts, D, 132)
        assert BK == (sa.SPLIT_BK if D >= 256 else 64)
        for k, (tiles, n) in zip(counts, plan):
            n_tiles = -(-k // BK)
            assert tiles >= 1 and n * tiles >= n_tiles and (n - 1) * tiles < max(n_tiles, 1)  # covered, none empty
    assert sa.segment_splits(64, [128, 512], 512, 132)[1] == [(2, 2), (8, 2)]
    assert sa.segment_splits(1, [128, 512], 512, 132)[1] == [(1, 4), (1, 16)]
    assert sa.segment_splits(1024, [128, 512], 512, 132)[1] == [(4, 1), (16, 1)]
    assert sa.segment_splits(2, [0, 33], 512, 132)[1][0][1] == 0  # an empty segment: no launch
    monkeypatch.setattr(sa, "SPLIT_RULE", "share")
    BK, tiles, seg = sa.split_config(64, [128, 512], 512, 132)
    assert sa.segment_splits(64, [128, 512], 512, 132) == (BK, [(tiles, n) for n in seg]) == (32, [(4, 1), (4, 4)])


def test_sparse_attention_split_config():
    """Splits: about 2 x SMs programs, at least one tile each, none empty, every tile covered; B=1 gets one
    split per tile of its lists."""
    from dsv41.model.kernels.sparse_attention import SPLIT_BK, split_config

    for rows, counts, D in [(1, [128, 512], 512), (8, [128, 512], 512), (64, [128, 512], 512),
                            (4096, [128, 512], 512), (3, [70, 150], 64), (1, [5], 64), (2, [0, 33], 512)]:
        BK, tiles, seg_splits = split_config(rows, counts, D, 132)
        assert BK == (SPLIT_BK if D >= 256 else 64) and tiles >= 1
        for k, n in zip(counts, seg_splits):
            n_tiles = -(-k // BK)
            assert n * tiles >= n_tiles and (n - 1) * tiles < n_tiles  # covered, no empty split
        total = sum(-(-k // BK) for k in counts)
        assert rows * sum(seg_splits) >= min(132, rows * total)  # the SMs are filled at least once
    assert SPLIT_BK == 32  # (the launch of h200-2026-12-02-c; 16 before)
    assert split_config(1, [128, 512], 512, 132)[1:] == (1, [4, 16])
    assert split_config(4096, [128, 512], 512, 132)[1:] == (20, [1, 1])


@interp
def test_sparse_attention_dense_rows_interpreted():
    q, *_ = attention_case(1, 2, 4, 64, 4, 4, 2, 2, seed=3)
    kv = torch.randn(1, 30, 64).bfloat16()
    idx = torch.randint(-1, 30, (1, 2, 37))
    from dsv41.model.attention import sparse_attention as model_ref

    sink = torch.randn(4)
    out = sparse_attention.sparse_attention(q, kv, sink, idx, 0.125, force_triton=True)
    assert rel_err(out, model_ref(q, kv, sink, idx, 0.125)) < 2e-2
    # decode (T=1) over bf16 rows takes the split kernel, several splits, one batch row all -1
    q, *_ = attention_case(3, 1, 4, 64, 4, 4, 2, 2, seed=4)
    kv = torch.randn(3, 300, 64).bfloat16()
    idx = torch.randint(-1, 300, (3, 1, 200))
    idx[1] = -1
    out = sparse_attention.sparse_attention(q, kv, sink, idx, 0.125, force_triton=True)
    assert rel_err(out, model_ref(q, kv, sink, idx, 0.125)) < 6e-3
    assert torch.equal(out[1], torch.zeros_like(out[1]))


@interp
@pytest.mark.parametrize("shape", [(2, 3, 4, 64, 70, 40), (1, 1, 16, 32, 33, 9), (1, 5, 32, 128, 300, 260)])
def test_indexer_interpreted(shape):
    # the last shape: V4.1 head width, 3 entry tiles of 128 (the last ragged) walked by one program, two
    # tokens per program with a padding token in the last block
    check_indexer(indexer_case(*shape, seed=sum(shape)), force=True)


@interp
@pytest.mark.parametrize("programs", [2, 3, 64])
def test_indexer_tiles_split_over_programs_interpreted(monkeypatch, programs):
    """Programs stride over the entry tiles (p, p + P, ...): with 2 or 3 programs per sequence over 5 tiles
    each tile is scored exactly once, and with more programs than tiles the extra ones are not launched."""
    monkeypatch.setattr(indexer, "_target_programs", lambda device: programs)
    check_indexer(indexer_case(1, 1, 8, 64, 600, 530, seed=programs), force=True)


@interp
def test_indexer_bf16_key_decode_interpreted(monkeypatch):
    """The key decode straight to bf16 from bits (indexer.TUNE["decode_bf16"]) gives the same scores."""
    monkeypatch.setitem(indexer.TUNE, "decode_bf16", True)
    check_indexer(indexer_case(1, 2, 8, 64, 300, 200, seed=4), force=True)


@interp
def test_indexer_e4m3_key_decode_interpreted(monkeypatch):
    """The key decode through the E4M3 conversion (TUNE["decode_bf16"] = "e4m3": the codes / 64, the queries x 64)
    gives the bits of the decode from bits, in REF's bf16-rounded scores too, over keys holding every E2M1 code
    (the subnormal 0.5 and -0 included) and scales from 2^-20 to 2^20."""
    q, w, kc, ks, vis, _ = indexer_case(2, 1, 8, 64, 300, 200, seed=9)
    kc = torch.arange(kc.numel(), dtype=torch.int64).remainder(256).to(torch.uint8).view_as(kc)  # every byte
    ks = torch.randint(107, 148, ks.shape, generator=torch.Generator().manual_seed(9), dtype=torch.int64).to(torch.uint8)
    outs = []
    for decode in (True, "e4m3"):
        monkeypatch.setitem(indexer.TUNE, "decode_bf16", decode)
        outs.append([indexer.indexer_scores(x, w, kc, ks, vis, bf16_scores=b, force_triton=True)
                     for x in (q, q.bfloat16()) for b in (False, True)])  # fp32 and bf16 queries (the model's)
    for a, b in zip(*outs):
        assert torch.equal(a.view(torch.int32), b.view(torch.int32))
    ref = reference.indexer_scores(q, w, kc, ks, vis)
    finite = torch.isfinite(ref)
    assert torch.equal(torch.isfinite(outs[1][0]), finite) and rel_err(outs[1][0][finite], ref[finite]) < 1e-5


@interp
@pytest.mark.parametrize("case", ["distinct", "ties", "few visible", "k > L", "gather"])
def test_topk_select_interpreted(case):
    """The radix-select Top-K against torch.topk + sort: rows of 1300 scores walked in chunks of 64 by 2
    programs each, negative and positive scores (the 4 digits of the order key all decide somewhere), -0.0
    beside +0.0; ties at the threshold (equal scores), rows with fewer finite scores than k (-1 picks) and
    all -inf, k larger than the row, and candidate ids mapped through the list."""
    g = torch.Generator().manual_seed(7)
    B, T, L, k = 2, 2, 1300, 64
    scores = torch.randn(B, T, L, generator=g) * torch.exp(3 * torch.randn(B, T, 1, generator=g))
    scores[..., 5] = -0.0
    cand = None
    if case == "ties":
        scores = torch.randint(-20, 20, (B, T, L), generator=g).float() / 4  # ~370 copies of each value
    elif case == "few visible":
        scores[0, 0, 40:] = -torch.inf
        scores[1, 1] = -torch.inf
    elif case == "k > L":
        scores, k = scores[..., :50], 64
    elif case == "gather":
        cand = torch.randint(-1, 100000, (B, T, L), generator=g)
        scores = scores.masked_fill(cand < 0, -torch.inf)
    top = indexer.topk_select(scores, k, cand)
    check_topk(top, torch_topk(scores, k, cand), scores, cand, exact=case in ("distinct", "k > L"))


@interp
@pytest.mark.parametrize("shape", [(1, 3, 4, 64), (2, 1, 4, 32)])
def test_mhc_interpreted(shape):
    # the GPU bounds: the kernel rounds X' and the collapse to bf16 nearest-even under the interpreter too
    check_mhc(mhc_case(*shape, seed=sum(shape)), force=True, tol_x=2e-3, tol_c=1e-4)


@interp
@pytest.mark.parametrize("programs", [2, 15, 64])
def test_mhc_channel_ranges_interpreted(monkeypatch, programs):
    """Channel ranges: d = 80 is 5 blocks of 16. At 260 tokens (5 token blocks of 64, the last ragged) they are
    walked by one program per token block, by ranges of 2, 2, 1 blocks, or one block per program; at one
    token (the decode tiles) by ranges of 3, 2 blocks or one block per program. Each range adds its partials
    once: a block walked twice or skipped changes the result."""
    monkeypatch.setattr(mhc, "_target_programs", lambda device: programs)
    check_mhc(mhc_case(1, 260, 4, 80, seed=programs), force=True, tol_x=2e-3, tol_c=1e-4)
    check_mhc(mhc_case(1, 1, 4, 80, seed=programs), force=True, tol_x=2e-3, tol_c=1e-4)


def test_mhc_channel_ranges_fill_whole_waves(monkeypatch):
    """The residual kernel's channel ranges (mhc._blocks_per_range) at V4.1-Flash width (d = 5120, the 16 x 64 tile:
    80 channel blocks) on 132 SMs x 4 programs: a grid of whole waves where the rule before it made 1.09-1.45 waves
    (1024-4096 tokens), the same grids elsewhere (one token: one block per program; 16384 tokens: one range)."""
    target = 528
    monkeypatch.setattr(mhc, "_target_programs", lambda device: target)
    cpu = torch.device("cpu")
    waves = {}
    for rule in ("fill", "waves"):
        monkeypatch.setattr(mhc, "RANGE_RULE", rule)
        for M in (1, 64, 1024, 2048, 4096, 8192, 16384):
            cfg = mhc.launch_config(M, 5120, cpu)
            assert cfg["grid"][1] * cfg["blocks_per_range"] >= 5120 // cfg["BD"]  # every channel block covered
            waves[rule, M] = cfg["grid"][0] * cfg["grid"][1] / target
    assert waves["fill", 4096] == 768 / target and waves["waves", 4096] == 512 / target
    for M in (1024, 2048, 4096, 8192):
        assert waves["waves", M] <= 1 < waves["fill", M]
    for M in (1, 64, 16384):
        assert waves["waves", M] == waves["fill", M]
    assert mhc.launch_config(1, 5120, cpu)["blocks_per_range"] == 1


@interp
def test_mhc_forced_tile_interpreted(monkeypatch):
    """`launch_config(..., tile=)` (the tile sweep of benchmarks/diagnose_gaps.py): the forced tile is the one
    launched, with the grid still covering every channel block, and the result still the reference's."""
    cfg = mhc.launch_config(260, 80, torch.device("cpu"), tile=(32, 16, 2))
    assert (cfg["BM"], cfg["BD"], cfg["num_stages"]) == (32, 16, 2)
    assert cfg["grid"][0] == 9 and cfg["grid"][1] * cfg["blocks_per_range"] >= 5
    original = mhc.launch_config
    monkeypatch.setattr(mhc, "launch_config", lambda M, d, device: original(M, d, device, tile=(32, 16, 2)))
    check_mhc(mhc_case(1, 260, 4, 80, seed=5), force=True, tol_x=2e-3, tol_c=1e-4)


@interp
@pytest.mark.parametrize("tune", [dict(tile=(64, 32, 2), x_once=True), dict(tile=(32, 32, 2), x_once=True)])
def test_mhc_stream_tiles_loaded_once_interpreted(monkeypatch, tune):
    """mhc.TUNE's x_once (a block's n stream tiles loaded once, [BM, n, BD]) and a 32-channel tile, from 256
    tokens on (260 tokens: ragged last token block; d = 96: 3 blocks of 32 over 2 channel ranges)."""
    for key, value in tune.items():
        monkeypatch.setitem(mhc.TUNE, key, value)
    check_mhc(mhc_case(1, 260, 4, 96, seed=11), force=True, tol_x=2e-3, tol_c=1e-4)


# Every residual-kernel tile that mhc.TUNE (the default, its 64 x 16 fallback) or benchmarks/bench_mhc.py's
# SWEEP can choose, and the x_once default before the current one, with the stream tiles loaded once (x_once):
# (tile, warps). (bench_mhc checks each row of its XONCE_SWEEP against the reference as it times it.) 300 tokens
# is a multiple of none of the token blocks.
MHC_TILES = [((64, 16, 2), 4), ((64, 32, 2), 4), ((64, 32, 3), 4), ((128, 32, 2), 8), ((64, 64, 2), 8),
             ((32, 64, 2), 4), ((16, 64, 2), 2)]


@interp
@pytest.mark.parametrize("tile,warps", MHC_TILES)
def test_mhc_x_once_every_tile_interpreted(monkeypatch, tile, warps):
    """x_once at each tile: 300 tokens (ragged last token block), d = 192 (3 to 12 channel blocks), 40 target
    programs (several channel ranges per token block). With the default TUNE, the tiles it picks: at 300 tokens and
    d = 96 and 80 (not multiples of 64) the 64 x 16 fallback with x_once, whose results are checked at d = 192 here
    (tile0) and at d = 80 over three range layouts (test_mhc_channel_ranges_interpreted); at 37 tokens the 16 x 32
    small-M tile without x_once, whose results test_mhc_interpreted and the one-token ranges check."""
    monkeypatch.setattr(mhc, "_target_programs", lambda device: 40)
    if tile == mhc.TUNE["tile"]:
        assert mhc.TUNE == dict(tile=tile, num_warps=warps, x_once=True)  # the default, checked as it stands
        for T, d, want in ((300, 96, (64, 16, 2, True, 4)), (300, 80, (64, 16, 2, True, 4)),
                           (37, 192, (16, 32, 3, False, 4))):
            cfg = mhc.launch_config(T, d, torch.device("cpu"))
            assert (cfg["BM"], cfg["BD"], cfg["num_stages"], cfg["x_once"], cfg["num_warps"]) == want
    for key, value in dict(tile=tile, num_warps=warps, x_once=True).items():
        monkeypatch.setitem(mhc.TUNE, key, value)
    cfg = mhc.launch_config(300, 192, torch.device("cpu"))
    assert (cfg["BM"], cfg["BD"], cfg["num_stages"], cfg["x_once"]) == (*tile, True)
    assert cfg["grid"][1] > 1 and cfg["grid"][1] * cfg["blocks_per_range"] >= 192 // tile[1]
    check_mhc(mhc_case(1, 300, 4, 192, seed=tile[0] + tile[1]), force=True, tol_x=2e-3, tol_c=1e-4)


@interp
def test_mhc_new_weight_at_a_reused_address_interpreted():
    """The W_fn split cache must not serve a freed tensor's split to a new tensor (same address)."""
    for seed in range(3):
        check_mhc(mhc_case(1, 2, 4, 32, seed=seed), force=True, tol_x=2e-3, tol_c=1e-4)


@interp
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pack_interpreted_bit_exact(dtype):
    check_pack(pack_input((3, 5, 64), dtype, seed=1), force=True)


def test_dispatch_keeps_cpu_on_reference():
    """Without force, CPU tensors take the reference path: identical results, CPU numerics unchanged."""
    case = attention_case(1, 2, 4, 64, 8, 20, 5, 7, seed=5, device="cpu")
    q, wc, ws, mc, ms, sink, widx, midx = case
    out = sparse_attention.sparse_attention_packed(q, wc, ws, mc, ms, sink, widx, midx, 0.125)
    assert torch.equal(out, reference.sparse_attention_packed(q, wc, ws, mc, ms, sink, widx, midx, 0.125))


# ---------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(2, 1, 64, 512, 128, 3000, 128, 512), (1, 37, 64, 512, 128, 777, 100, 333),
                                   (3, 5, 16, 128, 16, 50, 9, 61), (1, 2, 5, 64, 8, 20, 5, 7)])
def test_sparse_attention_gpu(shape):
    for seed in range(2):
        check_attention(attention_case(*shape, seed=seed), force=False, tol=1e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(2, 1, 64, 512, 128, 70000, 128, 512), (64, 1, 64, 512, 128, 4096, 128, 512),
                                   (3, 1, 16, 128, 16, 50, 9, 61), (2, 4, 64, 512, 128, 900, 100, 333),
                                   (2, 600, 64, 512, 128, 2048, 128, 512)])
def test_sparse_attention_split_gpu(shape):
    """The split kernel (the default for decode with H <= 64) against the reference and the tile kernel,
    at V4.1-Flash width with B=2 (one split per 16-row tile) and B=64, -1 holes and an empty query; the last
    shape is a prefill of 1,200 query tokens: two groups of SPLIT_GROUP_ROWS, the second starting inside
    batch row 0."""
    for seed in range(2):
        q, wc, ws, mc, ms, sink, widx, midx = attention_case(*shape, seed=seed)
        args = (q, wc, ws, mc, ms, sink, widx, midx, q.size(-1) ** -0.5)
        split = sparse_attention.sparse_attention_packed(*args, variant="split")
        tiles = sparse_attention.sparse_attention_packed(*args, variant="tiles")
        ref = reference.sparse_attention_packed(*args)
        assert rel_err(split, ref) < 1e-2 and rel_err(split, tiles) < 1e-2
        assert torch.equal(split[0, 0], torch.zeros_like(split[0, 0]))
        if shape[1] == 1:
            check_attention((q, wc, ws, mc, ms, sink, widx, midx), force=False, tol=1e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(1, 1, 32, 128, 70001, 16384), (2, 7, 32, 128, 1000, 513), (1, 3, 3, 64, 65, 17)])
def test_indexer_gpu(shape):
    check_indexer(indexer_case(*shape, seed=1), force=False)


@pytest.mark.gpu
@pytest.mark.parametrize("decode_bf16", [False, True, "e4m3"])
def test_indexer_topk_gpu(monkeypatch, decode_bf16):
    """The fused Top-K at the benchmark's shapes (B=4 decode queries, 32 heads x 128, Top-512): dense over
    200000 entries with visible counts below and above k, and over a 16384-candidate pool; against
    method="torch" on the same scores, with both key decodes."""
    monkeypatch.setitem(indexer.TUNE, "decode_bf16", decode_bf16)
    q, w, kc, ks, _, _ = indexer_case(4, 1, 32, 128, 200000, 1, seed=3)
    for vis in (torch.tensor([200000]), torch.tensor([300]), torch.tensor([131071])):
        vis = vis.to(q.device)
        top = indexer.indexer_topk(q, w, kc, ks, vis, 512)
        ref = indexer.indexer_topk(q, w, kc, ks, vis, 512, method="torch")
        check_topk(top, ref, indexer.indexer_scores(q, w, kc, ks, vis))
    cand = torch.randint(-1, 200000, (4, 1, 16384), device=q.device, dtype=torch.int32)
    vis = torch.tensor([150000], device=q.device)
    top = indexer.indexer_topk(q, w, kc, ks, vis, 512, candidates=cand)
    ref = indexer.indexer_topk(q, w, kc, ks, vis, 512, candidates=cand, method="torch")
    check_topk(top, ref, indexer.indexer_scores(q, w, kc, ks, vis, cand), cand)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(1, 1, 4, 5120), (2, 333, 4, 5120), (1, 17, 4, 64), (1, 4096, 4, 5120)])
def test_mhc_gpu(shape):
    check_mhc(mhc_case(*shape, seed=2), force=False, tol_x=2e-3, tol_c=1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("tune", [dict(tile=(64, 32, 2), num_warps=4, x_once=False),
                                  dict(tile=(64, 32, 2), num_warps=4, x_once=True),
                                  dict(tile=(64, 16, 2), num_warps=4, x_once=True),
                                  dict(tile=(128, 32, 2), num_warps=8, x_once=True),
                                  dict(tile=(32, 64, 2), num_warps=4, x_once=True),
                                  dict(tile=(16, 64, 2), num_warps=2, x_once=True)])
def test_mhc_schedules_gpu(monkeypatch, tune):
    """The residual kernel's schedules of bench_mhc's sweep (mhc.TUNE) at V4.1 width, 333 and 4096 tokens."""
    for key, value in tune.items():
        monkeypatch.setitem(mhc.TUNE, key, value)
    for shape in ((2, 333, 4, 5120), (1, 4096, 4, 5120)):
        check_mhc(mhc_case(*shape, seed=3), force=False, tol_x=2e-3, tol_c=1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(1, 1, 512), (3, 1001, 512), (7, 128), (2, 9, 64)])
def test_pack_gpu_bit_exact(shape):
    for dtype in (torch.float32, torch.bfloat16):
        check_pack(pack_input(shape, dtype, seed=len(shape)), force=False)


# ---------------------------------------------------------------------------------- the model's forward
# The entry points that run only on the Triton path of each kernel the model's forward calls.
def _model_kernels() -> dict:
    from dsv41.model.indexer import Indexer

    return {"sparse attention (packed)": (sparse_attention, "_launch"), "indexer": (indexer, "launch_config"),
            "indexer pool (gather)": (Indexer, "pool_topk"), "mHC": (mhc, "launch_config"),
            "KV pack": (quant, "_launch")}


MODEL_KERNELS = _model_kernels()


def model_logits_on_kernels(monkeypatch, device: str, kernel_path, reference_path, batch=2, prefill=16, steps=2):
    """The tiny random model's logits over a prefill and `steps` decode steps, once under `reference_path`
    and once under `kernel_path` (context managers), and how often each MODEL_KERNELS entry ran in the latter."""
    from dsv41.model.config import preset
    from dsv41.model.transformer import Transformer, init_random_

    model = init_random_(Transformer(preset("tiny")), 0).to(device).eval()
    ids = torch.randint(0, 500, (batch, prefill + steps), generator=torch.Generator().manual_seed(0)).to(device)

    def run():
        cache = model.new_cache(batch)
        with torch.inference_mode():
            logits = [model(ids[:, :prefill], cache=cache, all_logits=True)]
            logits += [model(ids[:, t:t + 1], start_pos=t, cache=cache, all_logits=True)
                       for t in range(prefill, prefill + steps)]
        return torch.cat(logits, dim=1).float()

    with reference_path():
        ref = run()
    calls = dict.fromkeys(MODEL_KERNELS, 0)
    for name, (module, attr) in MODEL_KERNELS.items():
        original = getattr(module, attr)
        monkeypatch.setattr(module, attr, lambda *a, _f=original, _n=name, **k: calls.__setitem__(_n, calls[_n] + 1)
                            or _f(*a, **k))
    with kernel_path():
        out = run()
    return out, ref, calls


def expected_model_kernel_calls(steps: int) -> dict:
    """Per forward call of the tiny plan (8 layers; index sources 2, 4, 6; kv sources 2, 4; the prefill
    completes groups at both sources, a decode step of one token at the m=1 source only, and the m=2
    source at every second position): attention and mHC in every layer (two mHC steps), the indexer in
    each index layer (the Reindex layers in the gather mode, over their candidate pool), the window packer in
    every layer plus the main packer per written group."""
    from dsv41.model.config import preset

    args = preset("tiny")
    calls = 1 + steps
    reindex = sum(spec.uses_candidates for spec in args.plan.layers)
    assert reindex > 0
    return {"sparse attention (packed)": args.n_layers * calls, "mHC": 2 * args.n_layers * calls,
            "indexer": len(args.index_source_layers) * calls, "indexer pool (gather)": reindex * calls}


@interp
def test_model_forward_on_the_kernels_interpreted(monkeypatch):
    """The model's inference forward (prefill, then decode steps) with the kernels of its attention, indexer, mHC
    and KV packing forced onto their Triton paths under the interpreter, against the same forward on the
    references: the wiring in the model (packed KV read in the attention kernel, packed index keys, single-pass
    mHC, fused packing). The FP8 linears and the routed experts stay on torch in both runs: interpreted, they
    took more than half of this test's time, and they enter the model only through Linear and MoE.forward, whose
    dispatch to those kernels is tested under the interpreter in tests/test_kernels_gemm.py
    (test_linear_and_moe_dispatch_to_the_kernels_interpreted); the GPU test below runs every kernel here."""
    import contextlib

    from dsv41.model import kernels, layers
    from dsv41.model.kernels import experts

    monkeypatch.setattr(layers.Linear, "_kernel_usable", lambda self, x: False)
    monkeypatch.setattr(experts, "usable", lambda *a: False)

    out, ref, calls = model_logits_on_kernels(monkeypatch, "cpu", kernels.forced, contextlib.nullcontext,
                                              batch=1, prefill=12, steps=1)
    for name, n in expected_model_kernel_calls(steps=1).items():
        assert calls[name] == n, (name, calls)
    assert calls["KV pack"] >= 8 * 2  # the window rows of every layer and call, and the main entries
    assert rel_err(out, ref) < 2e-2


@pytest.mark.gpu
def test_model_forward_with_kernels_gpu(monkeypatch):
    """The tiny model on CUDA: the forward on the Triton kernels (the default) vs DSV41_DISABLE_TRITON=1."""
    import contextlib

    @contextlib.contextmanager
    def disabled():
        monkeypatch.setenv("DSV41_DISABLE_TRITON", "1")
        try:
            yield
        finally:
            monkeypatch.delenv("DSV41_DISABLE_TRITON")

    out, ref, calls = model_logits_on_kernels(monkeypatch, "cuda", contextlib.nullcontext, disabled, steps=4)
    for name, n in expected_model_kernel_calls(steps=4).items():
        assert calls[name] == n, (name, calls)
    assert calls["KV pack"] >= 8 * 5
    assert rel_err(out, ref) < 2e-2


def test_every_launch_function_is_kept_opaque_for_torch_compile():
    """`keep_launches_opaque` (what model/engine.py compiled_decode_rows runs before torch.compile) swaps every
    function that launches a Triton kernel for its torch.compiler.disable'd form in its own module, where the
    callers look it up; the launch functions are the ones marked `opaque` (each one that launches a kernel).
    In a child process: torch._dynamo stays out of this one."""
    script = r"""
import ast, inspect, sys
import dsv41.model.transformer  # every kernel module, as the model imports them
from dsv41.model import kernels
from dsv41.model.kernels import experts, gemm, indexer, mhc, norm, quant, rope, routing, sparse_attention
assert "torch._dynamo" not in sys.modules, "the model imported torch._dynamo"
launching = set()
def launches(c):  # a call `..._kernel[grid](...)` / `kernel[grid](...)`
    return (isinstance(c, ast.Call) and isinstance(c.func, ast.Subscript) and isinstance(c.func.value, ast.Name)
            and c.func.value.id.endswith("kernel"))
for module in (experts, gemm, indexer, mhc, norm, quant, rope, routing, sparse_attention):
    for node in ast.walk(ast.parse(inspect.getsource(module))):
        if isinstance(node, ast.FunctionDef) and any(launches(c) for c in ast.walk(node)):
            launching.add((module.__name__, node.name))
assert launching == set(kernels._OPAQUE), (sorted(launching ^ set(kernels._OPAQUE)))
kernels.keep_launches_opaque()
for module_name, name in kernels._OPAQUE:
    assert getattr(sys.modules[module_name], name)._torchdynamo_disable, (module_name, name)
print("ok", len(kernels._OPAQUE))
"""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0 and r.stdout.startswith("ok"), r.stdout + r.stderr[-3000:]
