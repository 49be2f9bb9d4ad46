# The C sparse attention against its reference at prefill shapes, one thread:
# python benchmarks/results/cpu-layer-calls/attention_prefill_call.py (run at 4637845)
import time, torch, sys
from dsv41.model import formats
from dsv41.model.kernels import host, reference
sys.path.insert(0,'tests')
from test_host_kernels import _packed_attention_case
torch.set_num_threads(1)
for (B,T,W,N,Kw,Km) in ((1,200,264,100,64,32),(1,400,464,200,64,32),(4,50,114,25,64,32)):
    q, (wc, ws), (mc, ms), sink, w_idx, m_idx = _packed_attention_case(B, T, 4, 64, W, N, Kw, Km, torch.bfloat16, 1)
    with torch.inference_mode():
        for name, f in (("host", lambda: host.sparse_attention_packed(q, wc, ws, mc, ms, sink, w_idx, m_idx, 0.125)),
                        ("ref", lambda: reference.sparse_attention_packed(q, wc, ws, mc, ms, sink, w_idx, m_idx, 0.125))):
            for _ in range(3): f()
            n = 20
            t=time.perf_counter()
            for _ in range(n): f()
            print(B,T, name, f"{(time.perf_counter()-t)/n*1e3:.2f} ms")
