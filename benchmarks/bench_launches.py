"""Kernel launches per Reuse layer (issue #9, item 5; target: decode launches per Reuse layer <= 11), at
V4.1-Flash width (the 8-layer stack of benchmarks/flash_stack.py, random weights, cache filled to --ctx
tokens), in a decode step and in a prefill chunk, eagerly and under CUDA graphs.

How: one model forward (decode: 1 token; prefill: --chunk tokens) with a hook that keeps the Reuse
layer's inputs (residual streams, mHC `pre`, position, cache, the Top-K handed down); then that block
alone is called again with them (a Reuse layer writes only its own window-ring slots, so calling it again
recomputes the same thing) under torch.profiler, and the runtime calls are counted:
  kernel launches = cudaLaunchKernel* + cuLaunchKernel* (Triton launches through the driver API),
  also memcpy / memset calls, stream/device synchronizations, and the kernels the GPU ran.
Host syncs inside the layer are located with torch.cuda.set_sync_debug_mode("warn") (file:line).

CUDA graphs: the same block call captured with torch.cuda.graph (after two warm-up calls on a side
stream) and replayed under the profiler: host launches = cudaGraphLaunch calls, plus the kernels the
replay ran and the graph's nodes by type (cudaGraphDebugDotPrint). A captured step bakes in its position
(RoPE row, ring slot, entry counts), so it counts what a graph-captured step launches; it is not a
reusable decode graph. If capture fails (a host sync, a pageable host-to-device copy, ...) the reason is
reported as the result.

Usage (GPU):  python benchmarks/bench_launches.py --json F
      (CPU check, tiny widths; counts CPU operators, no launches): python benchmarks/bench_launches.py --tiny --device cpu
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import sys
import tempfile
import traceback
import warnings
from collections import Counter
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))

import flash_stack as fs  # noqa: E402

TARGET_DECODE = 11


def kind_of(name: str) -> str | None:
    """Runtime / driver API call -> what it is (None: not a runtime call we count)."""
    if "LaunchKernel" in name:
        return "kernel_launches"
    if name.startswith(("cudaGraphLaunch", "cuGraphLaunch")):
        return "graph_launches"
    if "Memcpy" in name:
        return "memcpy_calls"
    if "Memset" in name:
        return "memset_calls"
    if "Synchronize" in name:
        return "syncs"
    return None


def count(prof) -> dict:
    out = Counter()
    names = Counter()
    kernels, aten = Counter(), Counter()  # what the GPU ran and the operators called, by name
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            out["gpu_kernels_run"] += 1
            kernels[e.name[:120]] += 1
            continue
        k = kind_of(e.name)
        if k:
            out[k] += 1
            names[e.name] += 1
        elif e.name.startswith("aten::"):
            out["aten_ops"] += 1
            aten[e.name] += 1
    res = {k: out.get(k, 0) for k in ("kernel_launches", "graph_launches", "memcpy_calls", "memset_calls", "syncs",
                                      "gpu_kernels_run", "aten_ops")}
    res["runtime_calls"] = dict(names)
    res["gpu_kernels_by_name"] = dict(kernels.most_common())
    res["aten_ops_by_name"] = dict(aten.most_common())
    res["launches_by_site"] = launch_sites(prof)
    return res


def launch_sites(prof) -> dict:
    """Kernel launches by the model's source line that caused them: each launch's outermost operator, the first
    frame of its Python stack inside model/ (needs the profile's with_stack; Triton launches have no operator
    above them and count under their own stack or "triton")."""
    sites = Counter()
    try:
        for e in prof.events():
            if kind_of(e.name) != "kernel_launches":
                continue
            top = e
            while top.cpu_parent is not None:
                top = top.cpu_parent
            frames = [f for f in (top.stack or e.stack or []) if "/model/" in f]
            sites[frames[0].split("/model/")[-1] if frames else ("triton" if top is e else top.name)] += 1
    except Exception as err:  # the breakdown is a diagnosis: never fail the count for it
        return {"error": f"{type(err).__name__}: {err}"[:300]}
    return dict(sites.most_common())


def capture_inputs(model, layer_ids, ids, cache):
    """Run one forward; return {layer: (args, output)}: the inputs each listed block received and what it
    returned (to check that calling it again alone recomputes the same)."""
    got, outs, rings, handles = {}, {}, {}, []

    def hook(mod, args, layer):
        x, pre, start_pos, cch, shared, *rest = args
        got[layer] = (x.clone(), pre.clone(), start_pos, cch, dataclasses.replace(shared), *rest)
        ring = cch.layer(layer).window
        rings[layer] = (ring, ring.snapshot()) if ring is not None else None

    for l in layer_ids:
        handles.append(model.layers[l].register_forward_pre_hook(lambda mod, args, l=l: hook(mod, args, l)))
        handles.append(model.layers[l].register_forward_hook(
            lambda mod, args, out, l=l: outs.__setitem__(l, out[0].clone())))
    try:
        model(ids, cache.pos, cache)
    finally:
        for h in handles:
            h.remove()
    return {l: (got[l], outs[l], rings[l]) for l in layer_ids}


def restore_ring(saved) -> None:
    """Put the layer's window ring back as it was before the layer ran inside the forward (a prefill
    chunk longer than the window overwrote the slots its queries read)."""
    if saved is not None:
        ring, snap = saved
        for part, old in zip(ring.parts, snap):
            part.copy_(old)


def sync_sites(block, args) -> list[str]:
    """file:line of every synchronizing CUDA call in one eager call of the block."""
    sites = Counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            block(*args)
        finally:
            torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    for w in caught:
        if "synchroniz" in str(w.message).lower():
            sites[f"{Path(w.filename).name}:{w.lineno}"] += 1
    return [f"{k} x{v}" for k, v in sites.items()]


def eager(block, args, cuda: bool, expected: torch.Tensor, ring) -> dict:
    restore_ring(ring)
    again = block(*args)[0]  # also the warm-up (compilation, cached weights)
    same = (again.float() - expected.float()).abs().max().item()
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    restore_ring(ring)
    with profile(activities=acts, with_stack=True) as prof:
        block(*args)
        if cuda:
            torch.cuda.synchronize()
    res = count(prof)
    res["recomputed_max_abs_diff"] = same  # the lone call against the call inside the forward
    if cuda:
        res["syncs"] -= 1  # the benchmark's own synchronize above
        res["runtime_calls"]["cudaDeviceSynchronize"] = res["runtime_calls"].get("cudaDeviceSynchronize", 1) - 1
        res["sync_sites"] = sync_sites(block, args)
    return res


def graphed(block, args) -> dict:
    """Capture one block call in a CUDA graph and count a replay; {'captured': False, 'reason'} if capture fails."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            block(*args)
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    try:
        graph.enable_debug_mode()
    except Exception:  # older builds: no DOT dump, the profiler counts still come
        pass
    try:
        with torch.cuda.graph(graph):
            block(*args)
    except Exception as e:
        torch.cuda.synchronize()
        return {"captured": False, "reason": f"{type(e).__name__}: {e}"[:1500]}
    graph.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        graph.replay()
        torch.cuda.synchronize()
    res = {"captured": True, **count(prof)}
    res["syncs"] -= 1
    try:
        with tempfile.TemporaryDirectory() as d:
            graph.debug_dump(f"{d}/g.dot")
            dot = Path(f"{d}/g.dot").read_text()
        res["graph_nodes"] = dict(Counter(re.findall(r'label="\{?([A-Z_]+)', dot)))
    except Exception as e:
        res["graph_nodes"] = f"no DOT dump: {type(e).__name__}: {e}"[:300]
    return res


def run(json_path=None, device=None, tiny=False, ctx=None, chunk=None, layers=None, experts=None):
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    cuda = device == "cuda"
    ctx, chunk = ctx or (256 if tiny else 8192), chunk or (16 if tiny else 512)
    args = fs.stack_args("tiny" if tiny else "v4.1-flash", experts)
    if not layers:  # the first Reuse layer of each CED part
        layers = sorted({next(s.id for s in args.plan.layers if s.mode == "reuse" and s.part == part)
                         for part in ("encoder", "decoder")})
    model = fs.build(args, device)
    info = {"config": args.name, "routed_experts": args.n_routed_experts, "ctx": ctx, "prefill_chunk": chunk,
            "omitted": fs.OMITTED, "layers": {l: fs.REPRESENTS[l] for l in layers}}
    print(f"model: {info}", flush=True)
    with torch.inference_mode():  # not around the build: inference tensors would break the weight caches
        results = _measure(model, args, info, layers, ctx, chunk, cuda, device, json_path)
    dec = [r for r in results if r["phase"] == "decode" and "kernel_launches" in r["eager"]]
    if cuda and dec:
        worst = max(r["eager"]["kernel_launches"] for r in dec)
        print(f"\ndecode kernel launches per Reuse layer (eager): {worst} against the target <= {TARGET_DECODE}")
    return results


def _measure(model, args, info, layers, ctx, chunk, cuda, device, json_path):
    g = torch.Generator().manual_seed(0)
    results = []
    for phase, T in (("decode", 1), ("prefill", chunk)):
        cache = fs.fill_cache(model, ctx)
        ids = torch.randint(3, args.vocab_size, (1, T), generator=g).to(device)
        model(ids, cache.pos, cache)  # warm-up of the whole forward at this shape
        inputs = capture_inputs(model, layers, ids, cache)
        for l in layers:
            block, (a, out, ring) = model.layers[l], inputs[l]
            r = {"phase": phase, "tokens": T, "layer": l, "type": fs.REPRESENTS[l]}
            try:
                r["eager"] = eager(block, a, cuda, out, ring)
            except Exception as e:
                r["eager"] = {"error": f"{type(e).__name__}: {e}"[:1500]}
                traceback.print_exc()
            if cuda:
                try:
                    r["cuda_graph"] = graphed(block, a)
                except Exception as e:
                    r["cuda_graph"] = {"captured": False, "reason": f"{type(e).__name__}: {e}"[:1500]}
                    traceback.print_exc()
            else:
                r["cuda_graph"] = {"captured": False, "reason": "not run: no CUDA device"}
            results.append(r)
            _print(r)
            if json_path:
                _write(json_path, info, results)
        del cache
        if cuda:
            torch.cuda.empty_cache()
    return results


def _print(r):
    e, gph = r["eager"], r["cuda_graph"]
    print(f"\n== {r['phase']} ({r['tokens']} tokens), layer {r['layer']} ({r['type']})")
    if "error" in e:
        print(f"  eager: FAILED {e['error'][:300]}")
    else:
        print(f"  eager: kernel launches {e['kernel_launches']}, memcpy {e['memcpy_calls']}, memset {e['memset_calls']}, "
              f"syncs {e['syncs']}, GPU kernels run {e['gpu_kernels_run']}, aten ops {e['aten_ops']}; "
              f"lone call vs in-forward max abs diff {e['recomputed_max_abs_diff']:.3g}")
        if e.get("sync_sites"):
            print(f"  host syncs at: {', '.join(e['sync_sites'][:12])}")
    if gph.get("captured"):
        print(f"  CUDA graph: graph launches {gph['graph_launches']}, other kernel launches {gph['kernel_launches']}, "
              f"GPU kernels run {gph['gpu_kernels_run']}, nodes {gph.get('graph_nodes')}")
    else:
        print(f"  CUDA graph: not captured: {gph.get('reason', '')[:400]}")


def _write(path, info, results):
    from kernels_common import write_record

    write_record(path, {"benchmark": "launches_per_reuse_layer", "model": info, "results": results,
                        "target_decode_launches": TARGET_DECODE})


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json")
    ap.add_argument("--device")
    ap.add_argument("--tiny", action="store_true", help="tiny widths (CPU check of the code paths)")
    ap.add_argument("--ctx", type=int, help="tokens in the cache before the measured step (default 8192)")
    ap.add_argument("--chunk", type=int, help="prefill tokens (default 512)")
    ap.add_argument("--layers", type=int, nargs="*", help="Reuse layers to count (default: 2 and 6)")
    ap.add_argument("--experts", type=int)
    a = ap.parse_args()
    run(a.json, a.device, a.tiny, a.ctx, a.chunk, a.layers, a.experts)
