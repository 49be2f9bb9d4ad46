"""Shared pieces of the kernel benchmarks: ceilings measured in the same run, timing, roofline floors,
the printed table and the JSON record.

Ceilings (METHOD.md): a large device-to-device copy (bytes read + bytes written over the time) and a large
bf16 matmul on random data (2 M N K over the time). The roofline floor of a case is max(bytes / copy
bandwidth, FLOPs / matmul rate), with the bytes and FLOPs written down per case; the reported ratio is the
measured median time over that floor.
"""

from __future__ import annotations

import json
import platform
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

_CEILINGS: dict | None = None
# Quick mode (set_quick): every timing window divided by 5, for one short GPU run (benchmarks/device_batch.sh)
_WINDOW = {"scale": 1.0}


def set_quick(quick: bool = True) -> None:
    _WINDOW["scale"] = 0.2 if quick else 1.0


def bench(fn, warmup_ms: float = 25, rep_ms: float = 100) -> float:
    """Median time of fn() in seconds (CUDA events through triton.testing.do_bench, L2 flushed between runs)."""
    from triton.testing import do_bench

    k = _WINDOW["scale"]
    return do_bench(fn, warmup=warmup_ms * k, rep=rep_ms * k, return_mode="median") * 1e-3


def graph_bench(fn) -> float:
    """Median time of fn() replayed from a CUDA graph (no CPU launch cost), in seconds. fn must not
    synchronise with the host; it is run once before capture (compilation, caches)."""
    fn()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return bench(graph.replay)


def ceilings() -> dict:
    """{'copy_GBps', 'bf16_TFLOPs'} measured now on this device (random data)."""
    global _CEILINGS
    if _CEILINGS is None:
        n = 1 << 30  # 1 GiB each way
        src = torch.empty(n, dtype=torch.uint8, device="cuda").random_(0, 255)
        dst = torch.empty_like(src)
        t = bench(lambda: dst.copy_(src))
        a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
        b = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
        tm = bench(lambda: a @ b)
        _CEILINGS = {"copy_GBps": 2 * n / t / 1e9, "bf16_TFLOPs": 2 * 8192**3 / tm / 1e12,
                     "copy_bytes": 2 * n, "matmul_shape": [8192, 8192, 8192]}
        del src, dst, a, b
        torch.cuda.empty_cache()
    return _CEILINGS


def machine() -> dict:
    info = {"python": platform.python_version(), "torch": torch.__version__}
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        pass
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        info.update(gpu=p.name, sms=p.multi_processor_count, memory_GiB=round(p.total_memory / 2**30, 1),
                    cuda=torch.version.cuda)
    return info


def record(name: str, case: str, seconds: float, bytes_: float, flops: float, **extra) -> dict:
    """One row: the time, achieved GB/s and TFLOP/s, the floor and the ratio to it."""
    c = ceilings()
    floor = max(bytes_ / (c["copy_GBps"] * 1e9), flops / (c["bf16_TFLOPs"] * 1e12))
    return {"kernel": name, "case": case, "us": seconds * 1e6, "bytes": bytes_, "flops": flops,
            "GBps": bytes_ / seconds / 1e9, "TFLOPs": flops / seconds / 1e12, "floor_us": floor * 1e6,
            "x_floor": seconds / floor, "bound": "bytes" if bytes_ / c["copy_GBps"] / 1e9 >= flops / c["bf16_TFLOPs"] / 1e12
            else "flops", **extra}


def print_table(rows: list[dict], title: str) -> None:
    print(f"\n== {title}")
    print(f"{'case':44s} {'us':>10s} {'GB/s':>8s} {'TFLOP/s':>8s} {'floor us':>9s} {'x floor':>8s} {'bound':>6s}  extra")
    for r in rows:
        extra = {k: v for k, v in r.items() if k not in ("kernel", "case", "us", "bytes", "flops", "GBps", "TFLOPs",
                                                         "floor_us", "x_floor", "bound")}
        extra_s = " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in extra.items())
        print(f"{r['case']:44s} {r['us']:10.2f} {r['GBps']:8.0f} {r['TFLOPs']:8.2f} {r['floor_us']:9.2f} "
              f"{r['x_floor']:8.2f} {r['bound']:>6s}  {extra_s}")


def write_json(path: str | None, name: str, rows: list[dict]) -> None:
    if not path:
        return
    data = {"benchmark": name, "machine": machine(), "ceilings": ceilings(), "rows": rows,
            "command": " ".join(sys.argv)}
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(data, indent=1))


def write_record(path: str, data: dict, with_ceilings: bool = False) -> None:
    """A model-level benchmark's JSON (written after every case, so a run cut short keeps what it
    measured): `data` plus the command line, and on a GPU the machine (and the ceilings when asked)."""
    data = {**data, "command": " ".join(sys.argv)}
    if torch.cuda.is_available():
        data["machine"] = machine()
        if with_ceilings:
            data["ceilings"] = ceilings()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(data, indent=1, default=str))
