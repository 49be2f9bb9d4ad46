"""The two measurements behind cpu-batch-invariance/NOTES.md, on this machine's CPU (one torch thread):

1. elementwise functions on 4,000 random rows of 4 fp32 values, each row computed alone (a one-row decode step)
   against all rows in one call (a batched step): rows whose bits differ, plain and through reference.per_row;
2. fp32 F.linear (MKL's sgemm) at 64 inputs and 64 outputs: the row counts 1-32 whose first rows differ from
   the rows computed one at a time (a GEMV), against host.fixed_order_linear.

    python benchmarks/results/cpu-batch-invariance/position_dependence.py      # also under ATEN_CPU_CAPABILITY=avx2
"""

import torch
import torch.nn.functional as F

from dsv41.model.kernels import host, reference

torch.set_num_threads(1)
g = torch.Generator().manual_seed(0)
x = torch.randn(4000, 4, generator=g) * 3
for name, fn in [("exp", torch.exp), ("sigmoid", torch.sigmoid), ("softplus", F.softplus), ("silu", F.silu)]:
    alone = torch.cat([fn(x[i:i + 1]) for i in range(x.size(0))])
    with reference.row_invariant():
        fixed = reference.per_row(fn, x)
    print(f"{name}: rows differing alone against together {int((alone != fn(x)).any(-1).sum())} of {x.size(0)}; "
          f"through per_row {int((alone != fixed).any(-1).sum())}")
w = torch.randn(64, 64, generator=g)
rows = torch.randn(32, 64, generator=g)
one_by_one = torch.cat([F.linear(rows[i:i + 1], w) for i in range(32)])
mkl = [m for m in range(1, 33) if not torch.equal(F.linear(rows[:m], w), one_by_one[:m])]
fixed = [m for m in range(1, 33) if not torch.equal(host.fixed_order_linear(rows[:m], w),
                                                     host.fixed_order_linear(rows, w)[:m])]
print(f"F.linear fp32, row counts whose rows differ from one at a time: {mkl}")
print(f"host.fixed_order_linear, the same: {fixed}")
