"""The indexer's bf16 score product on the CPU: ATen's bf16 GEMM (the reference as it was) against the fp32 GEMM
rounded to bf16 once (reference.weighted_relu_scores(mxfp4=True)), on one-block MXFP4 operands. Checks the bits on
random operands whose blocks' scales span 2^-20 .. 2^20, then times the prefill's and the decode step's shapes on
one thread (median of 5 rounds of 20 calls). Ad hoc; its numbers are in NOTES.md beside the command.

    python benchmarks/results/cpu-indexer-exact/scores.py
"""
import statistics, time
import torch
from dsv41.model import formats
from dsv41.model.kernels import reference

torch.set_num_threads(1)
g = torch.Generator().manual_seed(0)


def mx(*shape, spread=20):
    x = torch.randn(*shape, generator=g) * torch.exp2(torch.randint(-spread, spread, (*shape[:-1], 1), generator=g).float())
    return formats.mxfp4_fake_quant(x.bfloat16(), 32)


differ = total = 0
for _ in range(100):
    T, n = torch.randint(1, 300, (2,), generator=g).tolist()
    q, k, w = mx(1, T, 4, 32), mx(1, n, 32), torch.randn(1, T, 4, generator=g).bfloat16()
    for a, b in ((reference.weighted_relu_scores(q, k, w, True), reference.weighted_relu_scores(q, k, w, True, mxfp4=True)),
                 (reference.weighted_relu_scores(q[:, :1], k, w[:, :1], True, by_entry=True),
                  reference.weighted_relu_scores(q[:, :1], k, w[:, :1], True, by_entry=True, mxfp4=True))):
        differ += int((a.view(torch.int32) != b.view(torch.int32)).sum())
        total += a.numel()
print(f"scores compared: {total:,}, differing bits: {differ}")


def timed(f, rounds=5, calls=20):
    f()
    out = []
    for _ in range(rounds):
        t = time.perf_counter()
        for _ in range(calls):
            f()
        out.append((time.perf_counter() - t) / calls)
    return statistics.median(out) * 1e3


print("| shape | bf16 GEMM ms | fp32 GEMM, rounded, ms | ratio |")
print("|---|---:|---:|---:|")
for label, B, T, n, by_entry in (("prefill chunk, 400 queries x 400 entries", 1, 400, 400, False),
                                 ("prefill chunk, 128 queries x 128 entries", 1, 128, 128, False),
                                 ("decode step, 32 rows x 300 entries", 32, 1, 300, True),
                                 ("decode step, 1 row x 300 entries", 1, 1, 300, True)):
    q, k, w = mx(B, T, 4, 32, spread=4), mx(B, n, 32, spread=4), torch.randn(B, T, 4, generator=g).bfloat16()
    a = timed(lambda: reference.weighted_relu_scores(q, k, w, True, by_entry=by_entry))
    b = timed(lambda: reference.weighted_relu_scores(q, k, w, True, by_entry=by_entry, mxfp4=True))
    print(f"| {label} | {a:.3f} | {b:.3f} | {a / b:.1f}x |")
