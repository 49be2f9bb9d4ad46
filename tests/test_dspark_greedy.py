"""What DSpark greedy decoding guarantees against plain greedy decoding (docs/generation.md, DSpark).

The two are not bit-identical: the verification forward scores k+1 positions at once, plain decoding
one position per forward, and a multi-row forward does not compute the same numbers (fp32 GEMMs whose
reduction order depends on the row count, indexer Top-K ties broken differently for score rows of
another length, and the KV the verification forward wrote is what later steps read). What holds
exactly: every token DSpark emits is the argmax of its verification logits at that position, so it
equals plain greedy's token wherever plain's top-1 margin exceeds twice the largest logit difference
between the two paths. These tests measure that difference step by step (the verification row vs the
one-token step over the same history, teacher-forced along DSpark's output), check it stays under a
bound, and check that the outputs agree up to the first position whose margin is within twice the bound.
"""

from __future__ import annotations

import pytest
import torch

from dsv41.model.engine import GenerationConfig, Generator

# bound on max |verification logit - one-token-step logit| at any generated position (fp32 logits of the
# tiny bf16 test model). Measured 2026-12-01 on the prompts below: at most 0.0058 under the AVX-512, AVX2
# and default (SSE4.1) kernels (its logits are below 1 in size)
BOUND = 0.02


def prompt(n, seed=0, vocab=512):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n,), generator=g).tolist()


def trace(gen: Generator, ids: list[int], max_new_tokens: int, run_plain: bool = True, **kw) -> dict:
    """Run DSpark greedy on `ids`; record, for every position DSpark generated, the verification logits
    that decided it, and the one-token-step logits of plain decoding over the same history (prompt +
    DSpark's tokens before it). Returns DSpark's output, the per-position difference (max abs over the
    vocabulary), plain's top-1 margin there and its argmax, and plain greedy's own output (run_plain;
    else its tokens up to the first divergence, which are the step argmaxes: same history, same forward)."""
    model = gen.model
    rows: dict[int, torch.Tensor] = {}
    forward = model.forward

    def recording(x, start_pos=0, cache=None, **fkw):
        out = forward(x, start_pos=start_pos, cache=cache, **fkw)
        if fkw.get("all_logits") and fkw.get("return_taps"):  # the engine's verification forward
            for j in range(x.size(1)):  # row j predicts position start_pos + j + 1; a later verification
                rows[start_pos + j + 1] = out[0][0, j].clone()  # overwrites the rows rejected here
        return out

    cfg = dict(max_new_tokens=max_new_tokens, stop_ids=(), **kw)
    own = model.__dict__.get("forward")  # an instance-level forward (a test's wrapper) stays in place
    model.forward = recording
    try:
        spec = gen.generate(ids, GenerationConfig(dspark=True, **cfg)).output_ids
    finally:
        if own is None:
            del model.forward  # back to the class's forward
        else:
            model.forward = own
    diff, margin, argmax = [], [], []
    with torch.inference_mode():
        cache = model.new_cache(1)
        step = gen.prefill(cache, ids)[0]
        for i, token in enumerate(spec):
            pos = len(ids) + i
            top = step.topk(2).values
            margin.append(float(top[0] - top[1]))
            argmax.append(int(step.argmax()))
            # position 0 comes from the prefill logits on both paths
            diff.append(0.0 if i == 0 else float((rows[pos] - step).abs().max()))
            if i + 1 < len(spec):
                step = gen.step(cache, token)[0]
    if run_plain:
        plain = gen.generate(ids, GenerationConfig(**cfg)).output_ids
    else:
        plain = next(([*argmax[:i + 1]] for i, (a, b) in enumerate(zip(argmax, spec)) if a != b), argmax)
    first = next((i for i, (a, b) in enumerate(zip(plain, spec)) if a != b), None)
    return {"plain": plain, "spec": spec, "diff": diff, "margin": margin, "argmax": argmax, "first_diff": first}


def check_guarantee(t: dict, bound: float) -> None:
    # 1. the measured difference stays under the bound
    assert max(t["diff"]) <= bound, max(t["diff"])
    # 2. wherever plain's margin exceeds twice the measured difference, DSpark emits plain's token
    #    (teacher-forced along DSpark's history, so this holds at every position, also after a divergence)
    for i, (tok, want, m, d) in enumerate(zip(t["spec"], t["argmax"], t["margin"], t["diff"])):
        if m > 2 * d:
            assert tok == want, (i, tok, want, m, d)
    # 3. the two outputs agree up to the first position whose margin is within twice the bound
    low = next((i for i, m in enumerate(t["margin"]) if m <= 2 * bound), len(t["spec"]))
    assert t["spec"][:low] == t["plain"][:low], (low, t["first_diff"])
    if t["first_diff"] is not None:  # a divergence happens at a near-tie only
        i = t["first_diff"]
        assert t["margin"][i] <= 2 * t["diff"][i], (i, t["margin"][i], t["diff"][i])


@pytest.fixture(scope="module")
def gen(tiny_model):
    return Generator(tiny_model)


@pytest.mark.parametrize("n_prompt,seed,run_plain", [(5, 101, False), (14, 102, True), (33, 33, False)])
def test_difference_stays_under_the_bound(gen, n_prompt, seed, run_plain):
    """Prompts shorter and longer than the window (8), contexts past the Top-K (4) and the candidate
    pool (2 blocks of 4): the positions where the verification forward's numbers and the one-token
    steps' numbers part. One case also runs plain greedy itself (the teacher-forced steps must give it)."""
    check_guarantee(trace(gen, prompt(n_prompt, seed=seed), 32, run_plain=run_plain), BOUND)


def test_every_draft_length(gen):
    """A fixed verification length of 1 or 3 drafts changes the row count of the verification forward."""
    for k in (1, 3):
        check_guarantee(trace(gen, prompt(17, seed=40 + k), 24, run_plain=False, dspark_draft_len=k), BOUND)


def test_the_check_can_fail(gen, tiny_model):
    """A verification forward that sees a wrong context (here: one position off) breaks the bound."""
    ids = prompt(12, seed=5)
    forward = tiny_model.forward

    def shifted(x, start_pos=0, cache=None, **fkw):
        if fkw.get("all_logits") and fkw.get("return_taps"):
            x = torch.cat([x[:, :1], x[:, :-1]], dim=1)  # the anchor twice, the last draft dropped
        return forward(x, start_pos=start_pos, cache=cache, **fkw)

    tiny_model.forward = shifted
    try:
        t = trace(gen, ids, 16, run_plain=False)
    finally:
        del tiny_model.forward
    assert max(t["diff"]) > 10 * BOUND
    with pytest.raises(AssertionError):
        check_guarantee(t, BOUND)


# the bundled model on the README's main prompt, 48 greedy tokens: max |difference| 2.23 (at token 28; at most
# 2.07 elsewhere), the same under the AVX-512, AVX2 and default (SSE4.1) CPU kernels (measured 2026-12-03 on the
# checkpoint after stage 36, every GEMM of CPU inference in the fixed order; 3.35 after stage 34, 2.97 after stage
# 32, 2.77 after stage 30, 2.31 after 29; recipes/tiny/logs/trials-2026-12-03/dspark_bound.py measures it).
# Where the difference spikes moves with the weights and the arithmetic (docs/generation.md): the checkpoint
# after stage 27 measured 6.15 at its last token with these GEMMs and 1.58 with MKL's, so the bound leaves room
BUNDLED_BOUND = 8.0


@pytest.mark.slow
def test_readme_prompt_on_the_bundled_model():
    from dsv41.model import encoding
    from dsv41.model.assets import bundled_model_dir
    from dsv41.model.checkpoint import load_model

    path = bundled_model_dir()
    assert path is not None, "the bundled dsv41-tiny checkpoint is committed: its absence is a defect"
    model, args, tok = load_model(path)
    text = encoding.encode_messages([{"role": "user", "content": "Add: 7 3 9 2 5"}], mode="thinking", effort=75)
    ids = tok.encode(text, allow_special=True)
    t = trace(Generator(model, tok), ids, 48, run_plain=False, think_end_id=tok.token_to_id(encoding.THINK_END))
    check_guarantee(t, BUNDLED_BOUND)
