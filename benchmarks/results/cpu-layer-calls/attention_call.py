# The C sparse attention against its reference at decode shapes (1 and 32 rows), one thread:
# python benchmarks/results/cpu-layer-calls/attention_call.py (run at 4637845)
import time, torch, sys
from dsv41.model import formats
from dsv41.model.kernels import host, reference
sys.path.insert(0,'tests')
from test_host_kernels import _packed_attention_case
torch.set_num_threads(1)
for B in (1, 32):
    q, (wc, ws), (mc, ms), sink, w_idx, m_idx = _packed_attention_case(B, 1, 4, 64, 64, 40, 64, 32, torch.bfloat16, 1)
    wv = formats.unpack_fp8_ue8m0(wc, ws, formats.FP8_BLOCK, torch.float32)
    with torch.inference_mode():
        for name, f in (("host", lambda: host.sparse_attention_packed(q, wc, ws, mc, ms, sink, w_idx, m_idx, 0.125, wv)),
                        ("ref", lambda: reference.sparse_attention_packed(q, wc, ws, mc, ms, sink, w_idx, m_idx, 0.125, wv))):
            for _ in range(20): f()
            n = 500 if B == 1 else 100
            t=time.perf_counter()
            for _ in range(n): f()
            print(B, name, f"{(time.perf_counter()-t)/n*1e6:.1f} us")
