"""Fidelity against the official V4.1 inference code (S0, run on the CPU with its own kernel ports).

tests/fixtures/s0_tiny holds a tiny random checkpoint in the official layout and the numbers S0
produced on it (docs/fidelity.md says how they were made; no S0 code is in this repository). Every
layer mode occurs, Top-K is smaller than the visible entries, the candidate pool smaller than the
blocks, and sequence A has exact bf16 ties at the Top-K boundary.

On the CPU flavour that made the golden (AVX-512 with oneDNN's bf16 paths, MKL's AVX-512 sgemm) our
forward reproduces every recorded tensor bit for bit. Other x86-64 CPUs sum fp32 GEMMs (MKL's sgemm
kernel, oneDNN's bf16 GEMMs) and ATen reductions in another order: the hc coefficients move by ~1e-7,
a bf16 residual flips by one step, an FP4 cache entry or a near-tied Top-K / routing decision flips
further down, and from there logits move by 0.1-1. The official code does exactly the same: rebuilt out of
tree and run under emulated AVX2 / non-bf16 flavours, S0 drifts from its own golden exactly as our forward
does (the two stay bit-identical to each other in every flavour). So the checks come in tiers set from
that measured spread (docs/fidelity.md §7; tests/fixtures/s0_tiny/spread.json):

* **bit-exact on every CPU**: Engram hashes (integer arithmetic); the embedding that enters layer 0;
  discrete decisions computed from S0's own inputs on rows whose margin exceeds the measured noise
  (Top-K rows with a relative boundary gap >= 1 %, routes with a biased-score gap >= 1e-3); the set
  of invisible (-inf) index scores.
* **component tier** (each sub-layer fed S0's recorded inputs, S0's decisions and S0's upstream
  sub-layer outputs, so only that sub-layer's own arithmetic is compared): bf16 outputs within
  2 bf16 steps of the tensor's scale with at most 2 % of the elements not bit-identical (in the MoE
  output, a row past that passes only where one E4M3 tie of its FP8 activation explains it); fp32 hc
  coefficients within 1e-3, router weights within 1e-4, the head within 1e-4.
* **end-to-end tier**: full prefills compared over each sequence's robust prefix (the positions before
  the first near-tied Top-K or routing decision, and before the first row this CPU rounds a bf16
  sub-layer output differently from S0 when fed S0's inputs), logits within 2e-2 and argmaxes equal where
  S0's top-1 margin exceeds twice that; decode must still tell the `ref` quirk from `fixed` (in its logits
  over the steps where the quirk shows, and in decodeA's first-step Top-K), unless this CPU's prefill
  already drifts too far for that.
* **same-flavour**: where this CPU reproduces S0's prefills of A, B and C bit for bit (it sums like the
  golden's CPU), the caches must be bit-identical, and so must every decode run whose first step is.
"""

from pathlib import Path

import pytest
import torch

from dsv41.model import formats, mhc

FIXTURE = Path(__file__).parent / "fixtures" / "s0_tiny"
INDEX_LAYERS = (2, 4, 6, 8)
KV_LAYERS = (2, 4, 6)

# tiers; the measured spreads behind them are in docs/fidelity.md §7
TOPK_GAP = 0.01  # relative Top-K boundary gap (bf16 scores: one step is 2^-8 = 0.0039)
ROUTE_GAP = 1e-3  # gap between the k-th and (k+1)-th biased router score (measured noise <= 2e-7)
BF16_STEPS = 2 ** -7  # component tier: |d| <= 2 bf16 steps of the tensor's largest value ...
BF16_FRACTION = 0.02  # ... on at most 2 % of the elements (measured <= 1.2 %)
# MoE output only: a row past that bound passes if one E4M3 rounding of its FP8 activation, moved by one bf16
# step of the input, explains it (fp8_tie_explains; measured: 5.6 steps at layer 5 of A, one row of 80)
PRE_ATOL, ROUTE_W_ATOL, HEAD_ATOL = 1e-3, 1e-4, 1e-4
LOGITS_ATOL = 2e-2  # end-to-end, robust prefix only (measured <= 1.2e-7; one decision flip: 0.1-1)
DECODE_RATIO = 0.5  # decode: distance to the own mode's golden against the other mode's
DECODE_DRIFT = 0.4  # decode: compared only where the prefill's drift stays below this part of the quirk's effect


@pytest.fixture(scope="module")
def s0():
    from dsv41.model.checkpoint import load_model

    model, args, _ = load_model(FIXTURE)
    golden = torch.load(FIXTURE / "golden.pt", weights_only=True)
    return model, golden


def tokens(golden, name):
    return golden[f"{name}.tokens"].view(1, -1)


def component_run(model, golden, name):
    """Every block fed S0's recorded input (`layer{i-1}.x_out`, or `engram_out` at the Engram layers) and
    `pre`; inside it, the Top-K, candidate pool, routes and each sub-layer's output replaced by S0's after
    ours was recorded. Returns our tensors under golden.pt's key names (plus `route_gap`)."""
    from dsv41.model.transformer import SharedState

    g = lambda key: golden[f"{name}.{key}"]  # noqa: E731
    ids = tokens(golden, name)
    rows, _ = model.hasher(ids)
    cache, shared, rec, undo = model.new_cache(1), SharedState(), {}, []

    def patch(module, forward):
        module.forward = forward
        undo.append(module)

    for i, block in enumerate(model.layers):
        gate, attn, ffn, indexer = block.ffn.gate, block.attn, block.ffn, block.attn.indexer

        def gate_fw(x, image_mask=None, i=i, gate=gate, orig=gate.forward):
            w, idx = orig(x, image_mask)
            assert gate.score_func == "sqrtsoftplus"  # the fixture's router, re-scored below for its margin
            biased = torch.nn.functional.linear(x.float(), gate.weight.float()) / gate.gate_temp
            biased = torch.nn.functional.softplus(biased).sqrt() + gate.bias
            top = biased.topk(gate.topk + 1, dim=-1).values
            rec[f"layer{i}.route_idx"], rec[f"layer{i}.route_w"] = idx, w
            rec[f"layer{i}.route_gap"] = top[:, -2] - top[:, -1]
            return g(f"layer{i}.route_w"), g(f"layer{i}.route_idx")

        def attn_fw(*a, i=i, orig=attn.forward):
            rec[f"layer{i}.attn_out"] = orig(*a)[0]
            return g(f"layer{i}.attn_out")[None]

        def ffn_fw(*a, i=i, orig=ffn.forward):
            rec[f"layer{i}.ffn_in"] = a[0][0]  # the normed input: the MoE's FP8 activations come from it
            rec[f"layer{i}.ffn_out"] = orig(*a)[0]
            return g(f"layer{i}.ffn_out")[None]

        patch(gate, gate_fw), patch(attn, attn_fw), patch(ffn, ffn_fw)
        if indexer is not None:
            def index_fw(x, qr, keys, freqs, start_pos, shared, i=i, orig=indexer.forward):
                top, scores = orig(x, qr, keys, freqs, start_pos, shared)
                rec[f"layer{i}.topk"], rec[f"layer{i}.index_score"] = top[0], scores[0]
                if i == 6:
                    rec["layer6.candidates"] = shared.candidates[0]
                    shared.candidates = g("layer6.candidates")[None]
                return g(f"layer{i}.topk").long()[None], scores

            patch(indexer, index_fw)
    try:
        with torch.inference_mode():
            for i, block in enumerate(model.layers):
                x = g("layer0.x_in") if i == 0 else g(f"layer{i - 1}.x_out")
                pre = mhc.identity_pre(x[None]) if i == 0 else g(f"layer{i - 1}.pre_out")[None]
                if block.engram is not None:
                    rec[f"layer{i}.engram_out"] = block.engram(x[None], rows[:, :, block.spec.engram], None)[0]
                    x = g(f"layer{i}.engram_out")
                x_out, pre_out = block(x[None], pre, 0, cache, shared)
                rec[f"layer{i}.x_out"], rec[f"layer{i}.pre_out"] = x_out[0], pre_out[0]
                if block.spec.owns_kv:
                    rec[f"layer{i}.compress_kv"] = cache.compressed(i)[0].to(torch.bfloat16)
                    rec[f"layer{i}.index_k"] = cache.index_keys_for(i)[0].to(torch.bfloat16)
            u = mhc.collapse(g("layer9.x_out")[None], g("layer9.pre_out")[None])
            rec["logits_all"] = model.head(model.norm(u))[0]
    finally:
        for module in undo:
            del module.forward
    return rec


@pytest.fixture(scope="module")
def components(s0):
    model, golden = s0
    return {name: component_run(model, golden, name) for name in "ABC"}


def assert_bf16_tier(ours, ref, what, explained=None):
    """Component tier for a bf16 tensor: within 2 bf16 steps of its largest value, and at most 2 % of the
    elements not bit-identical (a scale of 1.01 or a wrong sign moves nearly all of them).

    `explained(row, bound) -> bool`, for a row-wise sub-layer (the MoE) only: rows past the bound pass where
    it says one E4M3 tie of that row's FP8 activation accounts for them; at most 2 % of the rows (at least
    one) may need it, and the 2 % element condition still holds for the whole tensor."""
    ours, ref = ours.float(), ref.float()
    finite = torch.isfinite(ref)
    assert torch.equal(finite, torch.isfinite(ours)), f"{what}: -inf pattern differs"
    d = (ours[finite] - ref[finite]).abs()
    bound = BF16_STEPS * ref[finite].abs().max().item()
    frac = (d > 0).float().mean().item()
    assert frac <= BF16_FRACTION, f"{what}: {frac:.1%} of the elements differ"
    if d.max().item() <= bound:
        return
    assert explained is not None, f"{what}: max |d| {d.max().item():.3g} > {bound:.3g}"
    rows = ((ours - ref).abs().nan_to_num(0.0).flatten(1).amax(-1) > bound).nonzero().flatten().tolist()
    assert len(rows) <= max(1, int(BF16_FRACTION * ref.size(0))), f"{what}: rows {rows} past {bound:.3g}"
    for row in rows:
        assert explained(row, bound), f"{what}: row {row} past {bound:.3g}, not explained by one E4M3 tie"


def fp8_tie_explains(model, golden, name, layer, x, row, bound):
    """True where S0's MoE output of `row` at `layer` is within `bound` of ours recomputed with one element
    of our normed input moved by one bf16 step, among the moves that change that element's E4M3 rounding
    in the FP8 activation quantization (S0's routes used). A bf16 input one step from an E4M3 rounding
    midpoint (ties to even) flips a 32-wide block's activation by one E4M3 step, and the experts' GEMMs
    carry that into the whole row: under the baseline ISA on an AMD EPYC, layer 5 of A, row 7, element 62
    was -92.0 quanta (an exact tie, to -96) where S0 had -91.5 (to -88): ffn_out 5.6 bf16 steps off on
    that row alone (docs/fidelity.md §7.5). A scale or sign error in the MoE is not explained this way."""
    ffn = model.layers[layer].ffn
    block = ffn.experts[0].w1.block  # the activation block of the experts' FP8 GEMMs
    x = x[row]
    n = x.numel()
    moved = x.repeat(2 * n, 1)
    bits = moved.view(torch.int16)
    j = torch.arange(n)
    bits[j, j] += 1  # one bf16 step away from zero
    bits[n + j, j] -= 1  # one bf16 step toward zero
    q = formats.fp8_fake_quant_f32(moved.float(), block)
    flips = torch.isfinite(moved).all(-1) & (q != formats.fp8_fake_quant_f32(x.float(), block)[None]).any(-1)
    moved = moved[flips]
    if not len(moved):
        return False
    w, idx = golden[f"{name}.layer{layer}.route_w"][row], golden[f"{name}.layer{layer}.route_idx"][row]
    ffn.gate.forward = lambda h, image_mask=None: (w.expand(len(h), -1), idx.expand(len(h), -1))
    try:
        with torch.inference_mode():
            out = ffn(moved[None], None)[0].float()
    finally:
        del ffn.gate.forward
    ref = golden[f"{name}.layer{layer}.ffn_out"][row].float()
    return (out - ref).abs().amax(-1).min().item() <= bound


def topk_robust_rows(golden, name, layer):
    gap = golden[f"{name}.layer{layer}.topk_boundary_gap"].float()
    return ~golden[f"{name}.layer{layer}.topk_tie_at_boundary"] & (gap >= TOPK_GAP)


def robust_prefix(golden, components, name):
    """The positions before S0's first near-tied decision of this sequence (Top-K at any index layer, or
    routing at any layer, the router's margin taken from S0's own inputs)."""
    S = golden[f"{name}.tokens"].numel()
    shaky = torch.zeros(S, dtype=torch.bool)
    for layer in INDEX_LAYERS:
        shaky |= ~topk_robust_rows(golden, name, layer)
    for layer in range(10):
        shaky |= components[name][f"layer{layer}.route_gap"] < ROUTE_GAP
    return int(shaky.nonzero()[0]) if shaky.any() else S


def first_rounding_departure(golden, components, name):
    """(row, what) of the first position where this CPU, fed S0's own inputs and decisions, rounds a bf16
    sub-layer output (a residual stream, attention, MoE or Engram output) differently from S0, or (S, None).
    Such an element sat within this CPU's summation noise of a bf16 rounding midpoint (row 0, the BOS
    shared by A, B and C, at layer 1 on an AMD EPYC: 2 fp32 ulps, 1.6e-7 relative, docs/fidelity.md §7.5).
    It is a discrete decision like a near-tied Top-K: end to end, one bf16 step moves an E4M3 rounding of a
    32-wide FP8 activation block, and from there logits move by 0.1-0.6 without any Top-K or route flip."""
    S = golden[f"{name}.tokens"].numel()
    first, what = S, None
    for layer in range(10):
        for key in ("engram_out", "attn_out", "ffn_out", "x_out"):
            if f"{name}.layer{layer}.{key}" not in golden:
                continue
            ours, ref = components[name][f"layer{layer}.{key}"], golden[f"{name}.layer{layer}.{key}"]
            rows = (ours.float() != ref.float()).flatten(1).any(-1).nonzero()
            if len(rows) and int(rows[0]) < first:
                first, what = int(rows[0]), f"layer{layer}.{key}"
    return first, what


def same_flavour(s0):
    """True where this CPU reproduces S0's prefill of A, B and C bit for bit (it sums like the golden's
    CPU). All three: the GEMM kernels chosen depend on the row count, and a CPU can match A's 80 rows and
    not B's 37 (ATen's baseline ISA does)."""
    model, golden = s0
    with torch.inference_mode():
        return all(torch.equal(model(tokens(golden, name), all_logits=True)[0], golden[f"{name}.logits_all"])
                   for name in "ABC")


@pytest.fixture(scope="module")
def same_decode_flavour(s0):
    """True where this CPU also sums the one-row (decode) GEMMs and reductions like the golden's: the
    prefills and the first decode step of decodeA (fixed) reproduced bit for bit. A CPU can match the golden's
    multi-row prefill and still differ in decode's one-row paths (ATen's baseline ISA with oneDNN's own
    paths does), so the decode tier's bit-exact check asks for both."""
    model, golden = s0
    if not same_flavour(s0):
        return False
    ids = tokens(golden, "A")
    with torch.inference_mode():
        cache = model.new_cache(1)
        model(ids[:, :64], cache=cache)
        first = model(ids[:, 64:65], start_pos=64, cache=cache)[0]
    return torch.equal(first, golden["decodeA.fixed.step_logits"][0])


# ------------------------------------------------------------------------------ bit-exact on every CPU
def test_engram_hashes_match(s0):
    model, golden = s0
    for name in "ABC":
        rows, _ = model.hasher(tokens(golden, name))
        assert torch.equal(rows[0], golden[f"{name}.engram_hash"])


def test_embedding_matches(s0):
    model, golden = s0
    for name in "ABC":
        x = model.embed(tokens(golden, name))[0]
        assert torch.equal(x.unsqueeze(1).expand(-1, 4, -1), golden[f"{name}.layer0.x_in"])


@pytest.mark.parametrize("name", ["A", "B", "C"])
def test_decisions_from_s0_inputs(s0, components, name):
    """Top-K and routing computed from S0's own inputs agree exactly wherever S0's margin exceeds the tier."""
    model, golden = s0
    ours = components[name]
    for layer in INDEX_LAYERS:
        rows = topk_robust_rows(golden, name, layer)
        assert rows.float().mean() > 0.5  # the check must cover most rows
        assert torch.equal(ours[f"layer{layer}.topk"][rows], golden[f"{name}.layer{layer}.topk"].long()[rows]), layer
    for layer in range(10):
        rows = ours[f"layer{layer}.route_gap"] >= ROUTE_GAP
        assert torch.equal(ours[f"layer{layer}.route_idx"][rows].sort(-1).values,
                           golden[f"{name}.layer{layer}.route_idx"][rows].sort(-1).values), layer
        w, ref = ours[f"layer{layer}.route_w"][rows], golden[f"{name}.layer{layer}.route_w"][rows]
        assert (w - ref).abs().max() <= ROUTE_W_ATOL, layer


# ------------------------------------------------------------------------------ component tier
@pytest.mark.parametrize("name", ["A", "B", "C"])
def test_components_from_s0_inputs(s0, components, name):
    """Each sub-layer fed S0's inputs and S0's decisions: attention, Engram, MoE, mHC, compressor and
    indexer arithmetic within the component tier; the head from S0's final residual within 1e-4."""
    model, golden = s0
    ours = components[name]
    for layer in range(10):
        for key in ("attn_out", "ffn_out", "x_out") + (("engram_out",) if layer in (1, 4) else ()):
            what = f"{name}.layer{layer}.{key}"
            explained = None
            if key == "ffn_out":
                explained = lambda row, bound, layer=layer: fp8_tie_explains(  # noqa: E731
                    model, golden, name, layer, ours[f"layer{layer}.ffn_in"], row, bound)
            assert_bf16_tier(ours[f"layer{layer}.{key}"], golden[what], what, explained)
        d = (ours[f"layer{layer}.pre_out"] - golden[f"{name}.layer{layer}.pre_out"]).abs().max()
        assert d <= PRE_ATOL, f"{name}.layer{layer}.pre_out: {d:.3g}"
    for layer in KV_LAYERS:
        for key in ("compress_kv", "index_k"):
            what = f"{name}.layer{layer}.{key}"
            assert_bf16_tier(ours[f"layer{layer}.{key}"], golden[what], what)
    for layer in INDEX_LAYERS:
        assert_bf16_tier(ours[f"layer{layer}.index_score"], golden[f"{name}.layer{layer}.index_score"],
                         f"{name}.layer{layer}.index_score")
    assert (ours["logits_all"] - golden[f"{name}.logits_all"]).abs().max() <= HEAD_ATOL


# ------------------------------------------------------------------------------ end-to-end tier
@pytest.mark.parametrize("name,prefix", [("A", 20), ("B", 15), ("C", 12)])
def test_prefill_logits_over_the_robust_prefix(s0, components, name, prefix):
    model, golden = s0
    assert robust_prefix(golden, components, name) == prefix  # docs/fidelity.md §7 records these
    row, what = first_rounding_departure(golden, components, name)
    if row == 0:
        pytest.skip(f"this CPU rounds S0's {name}.{what} differently at row 0 already (a bf16 near-tie); "
                    "nothing of the prefill is comparable end to end, the component tier covers it")
    prefix = min(prefix, row)
    with torch.inference_mode():
        logits = model(tokens(golden, name), all_logits=True)[0][:prefix]
    ref = golden[f"{name}.logits_all"][:prefix]
    assert (logits - ref).abs().max() <= LOGITS_ATOL
    top2 = ref.topk(2, dim=-1).values
    clear = top2[:, 0] - top2[:, 1] > 2 * LOGITS_ATOL
    assert torch.equal(logits.argmax(-1)[clear], ref.argmax(-1)[clear])


def decode_steps(model, golden, seq, quirk, first=None):
    """The step logits of a decode run; for decodeA, `first` (a dict) receives the first step's decisions:
    `topk{i}` per index layer and `route{i}` per layer, as sets."""
    with torch.inference_mode():
        if seq == "decodeA":
            ids = tokens(golden, "A")
            cache = model.new_cache(1, ref_index_quirk=quirk)
            model(ids[:, :64], cache=cache)
            hooks = []
            if first is not None:
                for i, block in enumerate(model.layers):
                    if block.attn.indexer is not None:
                        hooks.append(block.attn.indexer.register_forward_hook(
                            lambda m, a, o, i=i: first.setdefault(f"topk{i}", set(o[0].flatten().tolist())) and None))
                    hooks.append(block.ffn.gate.register_forward_hook(
                        lambda m, a, o, i=i: first.setdefault(f"route{i}", set(o[1].flatten().tolist())) and None))
            try:
                steps = [model(ids[:, 64:65], start_pos=64, cache=cache)[0]]
            finally:
                for hook in hooks:
                    hook.remove()
            return torch.stack(steps + [model(ids[:, t:t + 1], start_pos=t, cache=cache)[0] for t in range(65, 80)])
        fed = golden[f"greedyB.{'ref' if quirk else 'fixed'}.fed_tokens"]
        cache = model.new_cache(1, ref_index_quirk=quirk)
        model(tokens(golden, "B"), cache=cache)
        return torch.stack([model(fed[t].view(1, 1), start_pos=37 + t, cache=cache)[0] for t in range(8)])


@pytest.mark.parametrize("seq", ["decodeA", "greedyB"])
@pytest.mark.parametrize("quirk,key,other", [(False, "fixed", "ref"), (True, "ref", "fixed")])
def test_decode_steps_match(s0, same_decode_flavour, seq, quirk, key, other):
    """`ref` is S0 as released (its decode-time indexer quirk reproduced by ref_index_quirk=True); `fixed`
    is S0 with the quirk fixed, our default. decodeA prefills A[:64], then feeds A[64..79]; greedyB
    prefills B and feeds S0's greedy tokens. Both start past their sequence's robust prefix, so on another
    CPU a near-tied prefill decision may already have flipped: there each mode must stay clearly closer to
    its own golden than to the other mode's, over the steps where the quirk shows (squared per-step max |d|
    at most half; measured <= 0.26). At decodeA's first step, where both modes share the prefill, the quirk
    shows first in the indexer's Top-K: over the index layers, that step's selections must share at least
    twice as many entries with the own mode's golden as with the other's (measured 13 against 5 at worst);
    its logits must be clearly closer to the own mode's too (ratio <= 0.5, measured <= 0.23 on the golden's
    CPU flavours) where that step decides every Top-K and route as S0 did. Where this CPU's prefill
    drifts so far that the modes cannot be told apart, the case is skipped. Where this CPU sums prefill and
    decode like the golden's: bit for bit."""
    model, golden = s0
    ref, alt = golden[f"{seq}.{key}.step_logits"], golden[f"{seq}.{other}.step_logits"]
    shows = (ref - alt).abs().amax(-1) > 4 * LOGITS_ATOL  # steps where the quirk changes the logits
    assert shows.sum() >= 7
    # the drift this CPU carries into the decode (its prefill's logits against S0's, rms over the rows the
    # decode's prefill covers) against the quirk's own effect (rms over the steps where it shows)
    name, rows = ("A", 64) if seq == "decodeA" else ("B", 37)
    with torch.inference_mode():
        prefill = model(tokens(golden, name), all_logits=True)[0][:rows]
    drift = (prefill - golden[f"{name}.logits_all"][:rows]).abs().amax(-1).square().mean().sqrt()
    effect = (ref - alt).abs().amax(-1)[shows].square().mean().sqrt()
    if drift > DECODE_DRIFT * effect:
        pytest.skip(f"{seq}: this CPU's prefill of {name} already drifts from S0's by {drift:.3f} (rms), against "
                    f"a quirk effect of {effect:.3f}: the two modes cannot be told apart from S0's numbers here")
    first = {}
    steps = decode_steps(model, golden, seq, quirk, first)
    same, cross = (steps - ref).abs().amax(-1), (steps - alt).abs().amax(-1)
    assert same[shows].square().sum() <= DECODE_RATIO * cross[shows].square().sum(), (same, cross)
    if seq == "decodeA":
        picks = lambda mode, layer: set(golden[f"decodeA.{mode}.layer{layer}.topk_last"][0].tolist())  # noqa: E731
        own = sum(len(first[f"topk{layer}"] & picks(key, layer)) for layer in INDEX_LAYERS)
        cross_picks = sum(len(first[f"topk{layer}"] & picks(other, layer)) for layer in INDEX_LAYERS)
        assert own >= 2 * cross_picks, (own, cross_picks)
        # the first step's logits are compared where that step decides as S0's did: past a flipped Top-K or
        # route (this CPU's drifted prefill moves a near-tied decode decision) one step's logits can land
        # anywhere between the modes (baseline ISA on an AMD EPYC: 0.99 against 1.02), as past the robust prefix
        routes = golden[f"decodeA.{key}.route_last"][:, 0]
        alike = all(first[f"topk{layer}"] == picks(key, layer) for layer in INDEX_LAYERS) and all(
            first[f"route{layer}"] == set(routes[layer].tolist()) for layer in range(10))
        if alike:
            assert same[0] <= DECODE_RATIO * cross[0], (same[0], cross[0])
    if same_decode_flavour and torch.equal(steps[0], ref[0]):  # this case's one-row paths sum as the golden's
        assert torch.equal(steps, ref)


# ------------------------------------------------------------------------------ same CPU flavour
def test_bit_identical_on_the_golden_cpu_flavour(s0):
    """Where this CPU sums like the golden's (every prefill reproduced bit for bit), every published cache
    must be bit-identical too; elsewhere the tiers above apply."""
    if not same_flavour(s0):
        pytest.skip("this CPU sums fp32/bf16 GEMMs in another order than the golden's; tiers apply")
    model, golden = s0
    with torch.inference_mode():
        cache = model.new_cache(1)
        model(tokens(golden, "A"), cache=cache)
    for layer in KV_LAYERS:
        assert torch.equal(cache.compressed(layer)[0].to(torch.bfloat16), golden[f"A.layer{layer}.compress_kv"])
        assert torch.equal(cache.index_keys_for(layer)[0].to(torch.bfloat16), golden[f"A.layer{layer}.index_k"])
