"""Component and whole-model tests on the tiny config (every CSA2 mode present, Top-K < entries)."""

import math

import pytest
import torch

from dsv41.model import mhc
from dsv41.model.attention import Compressor, sparse_attention, window_indices
from dsv41.model.cache import CompressorState
from dsv41.model.indexer import select_candidate_blocks, visible_counts
from dsv41.model.layers import apply_rope, rope_frequencies


# ------------------------------------------------------------------------------------------- mHC
def test_sinkhorn_output_is_doubly_stochastic():
    torch.manual_seed(0)
    mixes = torch.randn(5, 7, 24)
    pre, post, comb = mhc.sinkhorn_split(mixes, torch.tensor([1.0, 1.0, 1.0]), torch.randn(24) * 0.5, 4, iters=20)
    # 20 alternating normalizations: columns exact, rows converged to ~1e-3 for unit-scale logits
    assert torch.allclose(comb.sum(-1), torch.ones(5, 7, 4), atol=2e-3)
    assert torch.allclose(comb.sum(-2), torch.ones(5, 7, 4), atol=1e-5)  # the last normalization is over columns
    assert (comb > 0).all()
    assert ((pre > 0) & (pre < 1 + 1e-5)).all() and ((post > 0) & (post < 2)).all()


def test_sinkhorn_one_iteration_is_column_normalized_softmax():
    mixes = torch.randn(3, 24)
    _, _, comb = mhc.sinkhorn_split(mixes, torch.ones(3), torch.zeros(24), 4, iters=1, eps=0.0)
    soft = torch.softmax(mixes[:, 8:].view(3, 4, 4), dim=-1)
    assert torch.allclose(comb, soft / soft.sum(-2, keepdim=True), atol=1e-6)


def test_expand_uses_first_comb_index_for_the_residual():
    x = torch.randn(1, 1, 4, 8)
    y = torch.zeros(1, 1, 8)
    comb = torch.zeros(1, 1, 4, 4)
    comb[..., 1, 3] = 1.0  # stream 3 receives stream 1
    out = mhc.expand(y, x, torch.zeros(1, 1, 4), comb)
    assert torch.equal(out[0, 0, 3], x[0, 0, 1]) and torch.equal(out[0, 0, 0], torch.zeros(8))


# ------------------------------------------------------------------------------------------- RoPE
def test_rope_yarn_frequencies_follow_the_spec():
    r, base, orig, factor = 64, 160000.0, 65536, 16.0
    f = rope_frequencies(r, 4, base, orig, factor, 32, 1)
    theta = 1.0 / base ** (torch.arange(0, r, 2, dtype=torch.float64) / r)
    dim = lambda rot: r * math.log(orig / (rot * 2 * math.pi)) / (2 * math.log(base))
    low, high = max(math.floor(dim(32)), 0), min(math.ceil(dim(1)), r - 1)
    ramp = ((torch.arange(r // 2, dtype=torch.float64) - low) / max(high - low, 1e-3)).clamp(0, 1)
    want = theta / factor * ramp + theta * (1 - ramp)
    assert torch.allclose(torch.angle(f[1]).double(), want, rtol=1e-5)
    plain = rope_frequencies(r, 4, 10000.0)  # no YaRN for window-only layers
    assert torch.allclose(torch.angle(plain[1]).double(), 1.0 / 10000.0 ** (torch.arange(0, r, 2).double() / r), rtol=1e-5)


def test_rope_rotates_adjacent_pairs_and_inverse_undoes_it():
    x = torch.randn(1, 3, 2, 8)
    f = rope_frequencies(8, 8, 10000.0)[:3]
    y = apply_rope(x, f)
    assert torch.allclose(y.norm(dim=-1), x.norm(dim=-1), atol=1e-5)  # rotation
    # pair (0, 1) at position 2 rotates by angle 2 * theta_0 = 2
    c, s = math.cos(2.0), math.sin(2.0)
    assert torch.allclose(y[0, 2, 0, 0], x[0, 2, 0, 0] * c - x[0, 2, 0, 1] * s, atol=1e-5)
    assert torch.allclose(apply_rope(y, f, inverse=True), x, atol=1e-5)


# ------------------------------------------------------------------------------------------- attention
def naive_attention(q, kv, sink, idx, scale):
    B, T, H, D = q.shape
    out = torch.zeros(B, T, H, D, dtype=torch.float64)
    for b in range(B):
        for t in range(T):
            js = [j for j in idx[b, t].tolist() if j >= 0]
            for h in range(H):
                if not js:
                    continue
                logits = torch.stack([scale * (q[b, t, h].double() @ kv[b, j].double()) for j in js])
                w = torch.cat([logits, sink[h:h + 1].double()]).softmax(0)[:-1]
                out[b, t, h] = (w[:, None] * kv[b, js].double()).sum(0)
    return out


def test_sparse_attention_matches_naive_softmax_with_sink():
    torch.manual_seed(0)
    q, kv, sink = torch.randn(2, 5, 3, 16), torch.randn(2, 9, 16), torch.randn(3)
    idx = torch.randint(-1, 9, (2, 5, 6))
    idx[0, 0] = -1  # an all-empty row gives zeros
    got = sparse_attention(q, kv, sink, idx, 0.25)
    # REF rounds the probabilities to bf16 before P.V (8 significant bits), and so do we
    assert torch.allclose(got.double(), naive_attention(q, kv, sink, idx, 0.25), atol=2e-2, rtol=1e-2)
    assert torch.equal(got[0, 0], torch.zeros(3, 16))


def test_window_indices_are_causal_and_bounded():
    idx = window_indices(0, 6, 0, 4, "cpu")
    assert idx.tolist() == [[-1, -1, -1, 0], [-1, -1, 0, 1], [-1, 0, 1, 2], [0, 1, 2, 3], [1, 2, 3, 4], [2, 3, 4, 5]]
    # a chunk at position 10 after 4 cached entries (positions 6..9): query 10 sees 7..10
    idx = window_indices(10, 2, 4, 4, "cpu")
    assert idx.tolist() == [[1, 2, 3, 4], [2, 3, 4, 5]]


# ------------------------------------------------------------------------------------------- compressor
def test_compressor_groups_and_emits_only_complete_groups(tiny_args):
    spec = tiny_args.plan[2]  # encoder kv source, m = 2
    comp = Compressor(tiny_args, spec)
    torch.manual_seed(0)
    for p in comp.parameters():
        p.data = torch.randn_like(p.data.float()).to(p.dtype) * 0.2
    x = torch.randn(1, 7, tiny_args.dim, dtype=torch.bfloat16)
    full = comp(x, CompressorState())  # 7 tokens -> 3 complete groups, one token pending
    assert full.shape == (1, 3, tiny_args.head_dim)
    # the same tokens one at a time: an entry appears exactly when its group's last token arrives
    state, entries = CompressorState(), []
    for t in range(7):
        out = comp(x[:, t:t + 1], state)
        assert (out is not None) == (t % 2 == 1), t
        if out is not None:
            entries.append(out)
    assert state.pending == 1
    assert torch.equal(torch.cat(entries, dim=1), full)
    # group g pools tokens 2g and 2g+1 only: changing token 4 changes entry 2 alone
    x2 = x.clone()
    x2[:, 4] += 1
    full2 = comp(x2, CompressorState())
    assert torch.equal(full2[:, :2], full[:, :2]) and not torch.equal(full2[:, 2], full[:, 2])


def test_visibility_counts():
    assert visible_counts(0, 6, 2, "cpu").tolist() == [0, 1, 1, 2, 2, 3]
    assert visible_counts(0, 3, 1, "cpu").tolist() == [1, 2, 3]
    assert visible_counts(7, 1, 2, "cpu").tolist() == [4]


def test_candidate_blocks_keep_best_blocks_and_the_newest():
    scores = torch.tensor([[5.0, 0.0, 1.0, 1.0, 9.0, 2.0, 0.5, -torch.inf]])
    keep, entries = select_candidate_blocks(scores, torch.tensor([7]), topk_blocks=2, block_size=2)
    # blocks: [5,0] [1,1] [9,2] [.5,-inf]; newest visible entry 6 is in block 3 -> forced; best other: block 2
    assert keep.tolist() == [[False, False, False, False, True, True, True, True]]
    assert sorted(entries[0].tolist()) == [4, 5, 6, 7]  # the same pool as entry ids
    none_visible, none_entries = select_candidate_blocks(torch.full((1, 4), -torch.inf), torch.tensor([0]), 2, 2)
    assert not none_visible.any() and (none_entries == -1).all()
    _, ragged = select_candidate_blocks(torch.arange(5.0).view(1, 5), torch.tensor([5]), topk_blocks=3, block_size=2)
    assert sorted(ragged[0].tolist()) == [-1, 0, 1, 2, 3, 4]  # the last block is cut at N = 5


# ------------------------------------------------------------------------------------------- whole model
def test_causality_every_mode(tiny_model, tiny_args):
    torch.manual_seed(1)
    T = 48  # > window (8), entries (24 at m=2, 48 at m=1) > Top-K (4), pool (8 of 48 entries)
    ids = torch.randint(0, tiny_args.vocab_size, (1, T))
    base = tiny_model(ids, all_logits=True)
    for t in (5, 20, 40):
        changed = ids.clone()
        changed[0, t] = (changed[0, t] + 7) % tiny_args.vocab_size
        out = tiny_model(changed, all_logits=True)
        assert torch.equal(out[0, :t], base[0, :t]), t
        assert not torch.equal(out[0, t:], base[0, t:]), t


def test_attention_is_really_sparse(tiny_model, tiny_args):
    """With 48 tokens the decoder has 48 entries but attends to Top-4 plus the window."""
    ids = torch.randint(0, tiny_args.vocab_size, (1, 48))
    cache = tiny_model.new_cache(1)
    tiny_model(ids, cache=cache)
    assert cache.layer(4).n_compressed == 48 and cache.layer(2).n_compressed == 24
    assert tiny_args.index_topk < 24 and tiny_args.candidate_topk_blocks * tiny_args.candidate_block_size < 48


def test_incremental_decode_matches_full_forward(tiny_model, tiny_args):
    torch.manual_seed(2)
    T = 30
    ids = torch.randint(0, tiny_args.vocab_size, (2, T))
    full = tiny_model(ids, all_logits=True)
    cache = tiny_model.new_cache(2)
    steps = [tiny_model(ids[:, :11], cache=cache, all_logits=True)]  # prefill (odd length: a pending group)
    for t in range(11, 20):  # one token at a time
        steps.append(tiny_model(ids[:, t:t + 1], start_pos=t, cache=cache, all_logits=True))
    steps.append(tiny_model(ids[:, 20:], start_pos=20, cache=cache, all_logits=True))  # a chunk
    inc = torch.cat(steps, dim=1)
    assert (inc.argmax(-1) == full.argmax(-1)).all()
    assert torch.allclose(inc, full, atol=2e-2, rtol=0), (inc - full).abs().max()


def test_state_dict_with_official_names_loads_strictly(tiny_model, tiny_args):
    from dsv41.model.ledger import parameter_inventory
    from dsv41.model.transformer import Transformer

    sd = tiny_model.state_dict()
    inv = {n: (s, d) for n, s, d in parameter_inventory(tiny_args)}
    assert {n: (tuple(t.shape), t.dtype) for n, t in sd.items()} == inv
    fresh = Transformer(tiny_args)
    fresh.load_state_dict(sd, strict=True)
    ids = torch.randint(0, tiny_args.vocab_size, (1, 12))
    assert torch.equal(fresh(ids), tiny_model(ids))
    with pytest.raises(RuntimeError):
        fresh.load_state_dict({**sd, "layers.3.attn.compressor.wkv.weight": torch.zeros(1)}, strict=True)
