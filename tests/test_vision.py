"""The vision pathway (spec §4.9): preprocessing sizes and token counts, the ViT pieces, the token
layout, and how the language model treats image positions (embeddings, bias_vl routing, Engram dead
positions and gate 0, bidirectional sliding window inside a span, chunked prefill)."""

from __future__ import annotations

import io
import math
import subprocess
import sys

import pytest
import torch

from dsv41.model import vision as V
from dsv41.model.config import ModelArgs, preset
from dsv41.model.image_processor import fit_token_budget, num_image_tokens, plan_image_grid, preprocess

PIL = pytest.importorskip("PIL.Image")

OFFICIAL = ModelArgs()  # V4.1-Flash: patch 14, ratio 3, min_pixels 544^2, max_image_tokens 1024
IMG_ID = 500  # the tiny vocabulary has 512 ids: the placeholder must be one of them


def vision_args(**changes) -> ModelArgs:
    """The tiny model (every layer mode, Engram, DSpark) with a tiny vision tower and small images."""
    base = dict(vision_n_layers=2, vision_dim=32, vision_n_heads=2, vision_inter_dim=32, vision_min_pixels=28 * 28,
                vision_max_n_token=40, image_token_id=IMG_ID)
    base.update(changes)
    return preset("tiny").replace(**base)


@pytest.fixture(scope="module")
def vmodel():
    from dsv41.model.transformer import Transformer, init_random_

    model = Transformer(vision_args())
    init_random_(model, seed=1)
    return model.eval().requires_grad_(False)


def png(w: int, h: int, colour=(200, 30, 30), seed: int = 0) -> bytes:
    """A test image: a colour field with some noise (so patches differ), PNG-encoded."""
    g = torch.Generator().manual_seed(seed)
    pixels = (torch.tensor(colour).view(1, 1, 3) + torch.randint(-25, 26, (h, w, 3), generator=g)).clamp(0, 255)
    buf = io.BytesIO()
    PIL.fromarray(pixels.to(torch.uint8).numpy(), "RGB").save(buf, "PNG")
    return buf.getvalue()


# ============================================================================ preprocessing: sizes
@pytest.mark.parametrize("w, h, pixels, grid, tokens", [
    # 544 x 544 is exactly min_pixels: no upscale; 544 -> 546 = 39 patches -> ceil(39/3) = 13 per side
    (544, 544, (546, 546), (13, 13), 13 * 14 + 2),
    # 100 x 50 upscaled by s = sqrt(295936/5000) = 7.693: int -> 769 x 384, rounded up to 770 x 392
    # (55 x 28 patches) -> 19 x 10 tokens
    (100, 50, (392, 770), (10, 19), 10 * 20 + 2),
    # 1000 x 700 (above min_pixels): 1008 x 700 = 72 x 50 patches -> 24 x 17 -> 17*25+2 = 427 <= 1024
    (1000, 700, (700, 1008), (17, 24), 17 * 25 + 2),
    # 4000 x 2000 shrinks: a = 0.5, n_w <= sqrt(1022/0.5 + 1/4) - 1/2 = 44.72, n_h <= 22.36;
    # beta = min(44*42/4000, 22*42/2000) = 0.462 -> 924 x 1848 px = 66 x 132 patches -> 22 x 44 tokens
    (4000, 2000, (924, 1848), (22, 44), 22 * 45 + 2),
    # a very tall strip: one column of cells, (1024-2)//2 = 511 rows -> 511*2+2 = 1024 tokens
    (10, 100000, (511 * 42, 42), (511, 1), 1024),
    # a very wide strip: one row, 1024-3 = 1021 cells -> 1021+1+2 = 1024 tokens
    (100000, 10, (42, 1021 * 42), (1, 1021), 1024),
])
def test_plan_image_grid_follows_the_spec(w, h, pixels, grid, tokens):
    g = plan_image_grid(w, h, OFFICIAL)
    assert (g.height, g.width) == pixels
    assert (g.llm_h, g.llm_w) == grid
    assert (g.vit_h, g.vit_w) == (pixels[0] // 14, pixels[1] // 14)
    assert g.n_tokens == tokens == num_image_tokens(*grid)


def test_plan_image_grid_invariants_over_many_shapes():
    g = torch.Generator().manual_seed(0)
    for args in (OFFICIAL, OFFICIAL.replace(vision_min_pixels=56 * 56, vision_max_n_token=64)):
        for _ in range(400):
            w, h = (int(v) for v in torch.randint(1, 6000, (2,), generator=g))
            grid = plan_image_grid(w, h, args)
            assert grid.height % 14 == 0 and grid.width % 14 == 0
            assert grid.n_tokens <= args.vision_max_n_token
            assert (grid.llm_h, grid.llm_w) == (math.ceil(grid.vit_h / 3), math.ceil(grid.vit_w / 3))
            if w * h < args.vision_min_pixels:
                continue
            rounded = (math.ceil(w / 14) * 14, math.ceil(h / 14) * 14)
            fits = num_image_tokens(math.ceil(rounded[1] / 42), math.ceil(rounded[0] / 42)) <= args.vision_max_n_token
            if fits:  # not upscaled, not shrunk: the image only grew to the next multiple of 14
                assert (grid.width, grid.height) == rounded
            elif grid.llm_h > 1 and grid.llm_w > 1:  # shrunk with its aspect kept (up to 14-pixel rounding)
                assert grid.width <= rounded[0] and grid.height <= rounded[1]
                aspect = grid.height / grid.width
                assert abs(aspect / (h / w) - 1) <= 14 / grid.height + 14 / grid.width


def test_token_budget_is_the_largest_whole_cell_grid():
    # 3:4 aspect, budget 1024: n_w <= sqrt(1022/0.75 + 1/4) - 1/2 = 36.4 -> 36 x 27 cells fit (1001 tokens),
    # and one more column at that aspect (37 x 27.75) would not
    H, W = fit_token_budget(3000, 4000, 14, 3, 1024)
    assert num_image_tokens(math.ceil(H / 14 / 3), math.ceil(W / 14 / 3)) <= 1024
    assert W == 36 * 42 and H == 27 * 42
    assert 28 * (37 + 1) + 2 > 1024


def test_preprocess_pads_with_grey_and_normalizes():
    args = OFFICIAL.replace(vision_min_pixels=1, vision_max_n_token=64)
    red = io.BytesIO()
    PIL.new("RGB", (30, 28), (255, 0, 0)).save(red, "PNG")  # 30 wide -> 42: 6 grey columns each side
    patches, grid = preprocess({"data": red.getvalue()}, args)
    assert (grid.height, grid.width, grid.vit_h, grid.vit_w) == (28, 42, 2, 3)
    assert patches.shape == (6, 3 * 14 * 14) and patches.dtype == torch.bfloat16
    tiles = patches.float().view(2, 3, 3, 14, 14)  # [row, col, channel, y, x]
    grey = (127 / 255 - 0.5) / 0.5
    assert torch.allclose(tiles[0, 0, :, 5, :6], torch.full((3, 6), grey), atol=1e-2)  # left padding
    assert torch.equal(tiles[1, 1, 0], torch.ones(14, 14))  # red: (1 - 0.5) / 0.5
    assert torch.equal(tiles[1, 1, 1:], -torch.ones(2, 14, 14))  # green, blue: -1
    assert torch.allclose(tiles[0, 2, :, 0, 8:], torch.full((3, 6), grey), atol=1e-2)  # right padding
    # a small image is upscaled to min_pixels before padding: 10x10 with min 28*28 -> 28x28 (4 patches)
    small = io.BytesIO()
    PIL.new("RGB", (10, 10), (0, 0, 255)).save(small, "PNG")
    p2, g2 = preprocess({"data": small.getvalue()}, args.replace(vision_min_pixels=28 * 28))
    assert (g2.height, g2.width) == (28, 28) and p2.shape[0] == 4
    assert torch.equal(p2.float().view(4, 3, 196)[:, 2], torch.ones(4, 196))  # blue everywhere, no padding


def test_image_records_from_the_chat_encoding(tmp_path):
    import base64

    data = png(20, 20)
    path = tmp_path / "x.png"
    path.write_bytes(data)
    args = OFFICIAL.replace(vision_min_pixels=1, vision_max_n_token=64)
    want, _ = preprocess(data, args)
    for record in ({"url": str(path)}, str(path), {"data": base64.b64encode(data).decode()},
                   {"url": "data:image/png;base64," + base64.b64encode(data).decode()},
                   {"source": {"data": base64.b64encode(data).decode()}}):
        assert torch.equal(preprocess(record, args)[0], want)
    with pytest.raises(ValueError, match="cannot read image"):
        preprocess({"url": str(tmp_path / "missing.png")}, args)
    (tmp_path / "bad.png").write_bytes(b"not an image")
    with pytest.raises(ValueError, match="not an image"):
        preprocess(str(tmp_path / "bad.png"), args)


# ============================================================================ layout
def test_token_layout_and_placeholder_expansion():
    assert V.image_token_types(2, 3).tolist() == [0, 1, 1, 1, 2, 1, 1, 1, 2, 3]
    args = vision_args()
    ids, types, inputs = V.expand_image_placeholders([0, 7, IMG_ID, 8, IMG_ID], [png(28, 28), png(70, 28)], args)
    # 28x28: 2x2 patches -> 1x1 tokens -> 1*2+2 = 4; 70x28 -> 5x2 patches -> 2x1 tokens -> 1*3+2 = 5
    assert [img.start for img in inputs] == [2, 7] and [img.end for img in inputs] == [6, 12]
    assert ids == [0, 7] + [IMG_ID] * 4 + [8] + [IMG_ID] * 5
    assert types == [-1, -1, 0, 1, 2, 3, -1, 0, 1, 1, 2, 3]
    assert (inputs[1].vit_h, inputs[1].vit_w) == (2, 5)
    with pytest.raises(ValueError, match="2 image placeholders but 1 images"):
        V.expand_image_placeholders([IMG_ID, IMG_ID], [png(28, 28)], args)
    with pytest.raises(ValueError, match="no vision tower"):
        V.expand_image_placeholders([IMG_ID], [png(28, 28)], preset("tiny").replace(image_token_id=IMG_ID))


# ============================================================================ ViT pieces
def test_2d_rope_depends_on_relative_row_and_column_only():
    n_h, n_w, dim = 5, 6, 8
    cos, sin = V.rope_2d(n_h, n_w, dim, 10000.0)
    q, k = torch.randn(1, 1, 2 * dim), torch.randn(1, 1, 2 * dim)
    def score(a, b):  # patch a's query against patch b's key
        return (V.rotate_half(q, cos[a], sin[a]) * V.rotate_half(k, cos[b], sin[b])).sum()
    at = lambda r, c: r * n_w + c
    assert torch.allclose(score(at(1, 2), at(3, 1)), score(at(2, 4), at(4, 3)), atol=1e-5)  # same (2, -1) offset
    assert not torch.allclose(score(at(1, 2), at(3, 1)), score(at(1, 2), at(1, 3)), atol=1e-3)
    # the first dim/2 frequencies follow the row, the last dim/2 the column
    assert torch.equal(cos[at(3, 0), 0, dim // 2:], torch.ones(dim // 2))
    assert torch.equal(cos[at(0, 4), 0, : dim // 2], torch.ones(dim // 2))


def test_aligner_unshuffles_3x3_cells_channel_major_with_zero_padding():
    args = vision_args(vision_dim=2)
    al = V.Aligner(args)
    n_h, n_w = 4, 5
    feats = torch.arange(n_h * n_w * 2, dtype=torch.float32).view(n_h * n_w, 2) + 1
    cells = al.unshuffle(feats, n_h, n_w)
    assert cells.shape == (2 * 2, 2 * 9)
    grid = feats.view(n_h, n_w, 2)
    for cell, (r0, c0) in enumerate([(0, 0), (0, 3), (3, 0), (3, 3)]):  # reading order of 3x3 cells
        want = torch.zeros(2, 3, 3)
        for i in range(3):
            for j in range(3):
                if r0 + i < n_h and c0 + j < n_w:
                    want[:, i, j] = grid[r0 + i, c0 + j]
        assert torch.equal(cells[cell], want.flatten())


def test_batched_vit_matches_one_image_at_a_time_in_fp32():
    args = vision_args()
    torch.manual_seed(0)
    vit = V.VisionTransformer(args).float()
    for p in vit.parameters():
        p.data.normal_(0, 0.2)
    patches = torch.randn(3, 6, 588)
    batched = vit(patches, 2, 3)
    for i in range(3):
        assert torch.allclose(batched[i], vit(patches[i], 2, 3), atol=1e-5)
    # attention is bidirectional: the first patch's output depends on the last patch
    changed = patches[0].clone()
    changed[-1] += 1
    assert not torch.allclose(vit(changed, 2, 3)[0], batched[0], atol=1e-4)


# ============================================================================ the language model
def prompt_with_image(args, w=70, h=70, seed=0):
    """BOS, two text tokens, one image (70x70 -> 5x5 patches -> 2x2 tokens, 8 positions), 5 text tokens."""
    ids, types, inputs = V.expand_image_placeholders([0, 17, 300, IMG_ID, 41, 42, 43, 44, 45],
                                                     [png(w, h, seed=seed)], args)
    return torch.tensor([ids]), torch.tensor([types]), inputs


def test_image_positions_take_vision_embeddings(vmodel):
    ids, types, inputs = prompt_with_image(vmodel.args)
    h = vmodel.merge_image_embeddings(vmodel.embed(ids.masked_fill(types >= 0, 0)), [inputs])
    rows = V.encode_images(vmodel.vision, vmodel.aligner, inputs)[0]
    span = h[0, inputs[0].start: inputs[0].end]
    assert torch.equal(span[0], vmodel.image_start) and torch.equal(span[-1], vmodel.image_end)
    assert torch.equal(span[3], vmodel.image_newline) and torch.equal(span[6], vmodel.image_newline)
    assert torch.equal(span[[1, 2, 4, 5]], rows.to(span.dtype))  # reading order
    assert torch.equal(h[0, :3], vmodel.embed(ids[0, :3])) and torch.equal(h[0, -5:], vmodel.embed(ids[0, -5:]))


def test_image_spans_route_with_bias_vl_and_engram_skips_them(vmodel):
    ids, types, inputs = prompt_with_image(vmodel.args)
    image_mask = (types >= 0)[0]
    routed, engram_io = [], []
    saved = {}
    gates = [m for m in vmodel.modules() if type(m).__name__ == "Gate"]
    for gate in gates:  # text must pick experts {0, 1}, images {2, 3}, whatever the scores
        saved[gate] = (gate.bias.clone(), gate.bias_vl.clone())
        gate.bias.copy_(torch.tensor([100.0, 100.0, 0.0, 0.0]))
        gate.bias_vl.copy_(torch.tensor([0.0, 0.0, 100.0, 100.0]))
    hooks = [g.register_forward_hook(lambda m, a, out: routed.append(out[1])) for g in gates]
    hooks += [b.engram.register_forward_hook(lambda m, a, out: engram_io.append((a[0], out)))
              for b in vmodel.layers if b.engram is not None]
    try:
        with torch.inference_mode():
            vmodel(ids, images=[inputs])
    finally:
        for h in hooks:
            h.remove()
        for gate, (b, bvl) in saved.items():
            gate.bias.copy_(b), gate.bias_vl.copy_(bvl)
    backbone = [r for r in routed if r.size(0) == ids.size(1)]
    assert len(backbone) == len(vmodel.layers)
    for chosen in backbone:
        chosen = chosen.sort(-1).values
        assert (chosen[image_mask] == torch.tensor([2, 3])).all()
        assert (chosen[~image_mask] == torch.tensor([0, 1])).all()
    assert len(engram_io) == 2
    for x_in, x_out in engram_io:  # gate 0 on image positions: the residual passes unchanged
        assert torch.equal(x_out[0, image_mask], x_in[0, image_mask])
        assert not torch.equal(x_out[0, ~image_mask], x_in[0, ~image_mask])


def test_engram_hashes_treat_image_positions_as_dead(vmodel):
    ids, types, inputs = prompt_with_image(vmodel.args)
    rows, _ = vmodel.hasher(ids, types >= 0)
    after = inputs[0].end  # the first text token after the image: no n-gram reaches into the image
    fresh, _ = vmodel.hasher(ids[:, after: after + 1])  # the same token at the start of a sequence
    assert torch.equal(rows[0, after], fresh[0, 0])
    plain, _ = vmodel.hasher(ids)  # without the mask the placeholder ids would count as text
    assert not torch.equal(rows[0, after], plain[0, after])


def test_window_indices_make_image_spans_bidirectional():
    window = 8
    img = V.ImageInput(start=3, patches=torch.zeros(1), vit_h=1, vit_w=1, types=torch.zeros(14, dtype=torch.long))
    extra = V.image_window_indices([[img]], start_pos=0, seqlen=20, n_prev=0, window=window)
    assert extra.shape == (1, 20, 14)
    for t in range(20):
        causal = set(range(max(0, t - window + 1), t + 1))
        seen = [int(i) for i in extra[0, t] if i >= 0]
        assert len(seen) == len(set(seen)) and not causal & set(seen)  # never a key twice
        want = set(range(3, 17)) - causal if 3 <= t < 17 else set()
        assert set(seen) == want
    # a later chunk: the layout is [n_prev cached ; chunk], positions start_pos - n_prev ...
    extra = V.image_window_indices([[img.shifted(30)]], start_pos=30, seqlen=20, n_prev=8, window=window)
    assert int(extra[0, 3, 13]) == (33 + 13) - (30 - 8)  # START sees END


def test_image_span_sees_itself_whole_and_text_stays_causal(vmodel):
    ids, types, inputs = prompt_with_image(vmodel.args)
    a, e = inputs[0].start, inputs[0].end
    with torch.inference_mode():
        base = vmodel(ids, images=[inputs], all_logits=True)
        saved = vmodel.image_end.clone()
        vmodel.image_end.add_(1.0)  # changes only the END position's input
        try:
            changed = vmodel(ids, images=[inputs], all_logits=True)
            vmodel.image_attention = "causal"  # S0's reference forward
            causal_changed = vmodel(ids, images=[inputs], all_logits=True)
            vmodel.image_end.copy_(saved)
            causal_base = vmodel(ids, images=[inputs], all_logits=True)
        finally:
            vmodel.image_end.copy_(saved)
            vmodel.image_attention = "bidirectional"
    assert torch.equal(changed[0, :a], base[0, :a])  # text before the image never sees it
    assert not torch.allclose(changed[0, a], base[0, a])  # START sees END (bidirectional)
    assert torch.equal(causal_changed[0, : e - 1], causal_base[0, : e - 1])  # causal: nothing before END moves
    assert not torch.equal(causal_base[0, a:e], base[0, a:e])


def test_chunked_prefill_keeps_image_spans_whole(vmodel):
    from dsv41.model.engine import Generator, _chunk_bounds

    assert _chunk_bounds(20, 4, [(3, 11)]) == [(0, 11), (11, 15), (15, 19), (19, 20)]  # 4 falls inside the span
    assert _chunk_bounds(20, 4, [(4, 11)]) == [(0, 4), (4, 11), (11, 15), (15, 19), (19, 20)]
    ids, types, inputs = prompt_with_image(vmodel.args)
    gen = Generator(vmodel)
    with torch.inference_mode():
        whole = vmodel(ids, images=[inputs])
        for chunk in (2, 5):
            cache = vmodel.new_cache(1)
            chunked = gen.prefill(cache, ids[0].tolist(), chunk=chunk, images=inputs)
            # chunking changes only the blocking of REF's online softmax (bf16 probabilities) and of the
            # quantized GEMMs: same argmax, logits within float tolerance (as for text, test_engine.py)
            assert torch.allclose(chunked, whole, atol=2e-2), chunk
            assert torch.equal(chunked.argmax(-1), whole.argmax(-1)), chunk
        with pytest.raises(ValueError, match="inside the chunk"):
            vmodel(ids[:, :5], images=[inputs])


def test_text_only_logits_are_identical_with_and_without_the_vision_tower(vmodel):
    from dsv41.model.transformer import Transformer

    text_args = vmodel.args.replace(vision_n_layers=0)
    text_model = Transformer(text_args).eval()
    state = {k: v for k, v in vmodel.state_dict().items()
             if not k.startswith(("vision.", "aligner.", "image_")) and not k.endswith("bias_vl")}
    text_model.load_state_dict(state, strict=True)
    text_model._hasher = vmodel.hasher
    ids = torch.tensor([[0, 5, 17, 300, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50]])
    with torch.inference_mode():
        assert torch.equal(vmodel(ids, all_logits=True), text_model(ids, all_logits=True))
        # and an image-free `images` argument changes nothing
        assert torch.equal(vmodel(ids, all_logits=True, images=[[]]), text_model(ids, all_logits=True))


def test_text_only_code_paths_do_not_import_the_vision_code():
    code = ("import sys, model.transformer, model.engine\n"
            "assert 'dsv41.model.vision' not in sys.modules and 'PIL' not in sys.modules, sorted(sys.modules)\n")
    subprocess.run([sys.executable, "-c", code], check=True)
