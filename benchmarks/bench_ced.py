"""CED `replay` prefill against `full` (issue #9, item 5; target: replay >= 1.8x faster than full at 32K
prompt tokens), on the V4.1-Flash-shaped 8-layer stack of benchmarks/flash_stack.py at full width with
random weights (4 encoder + 4 decoder layers, the real model's 20/20 split; no Engram, no DSpark).

Both modes run the engine's chunked prefill (`Generator.prefill(cache, ids, chunk, ced=mode)`) of the same
random 32K-token prompt into an empty cache, with the same chunk (4096 by default: a whole 32K chunk in
`full` mode would need two [32K, 32 heads, 32K] bf16 index-score tensors, 128 GB). `full` runs every
layer on every token; `replay` (spec §4.5) runs the encoder on every token, projects the decoder's global
KV from layer n/2 for every token, and the decoder on the last window_size (128) tokens of each chunk.
One untimed chunk of each mode first (Triton compilation). Timed: wall clock between synchronizations.

Reported: seconds per mode, replay speedup = full / replay, per-layer times (CUDA events), and the same
composed for all 40 V4.1-Flash layers from the per-layer times (flash_stack.compose_flash; an estimate).

Usage (GPU):  python benchmarks/bench_ced.py --json F
      (CPU check, tiny widths): python benchmarks/bench_ced.py --tiny --device cpu
"""

from __future__ import annotations

import argparse
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import flash_stack as fs  # noqa: E402
from dsv41.model.engine import Generator  # noqa: E402

TARGET = 1.8


@torch.inference_mode()
def prefill_time(model, ids: torch.Tensor, chunk: int, mode: str) -> dict:
    gen = Generator(model)
    gen.prefill(model.new_cache(1), ids[:, :chunk], chunk, ced=mode)  # warm-up: one chunk of this mode
    cache = model.new_cache(1)
    dt, timer = fs.timed(model, lambda: gen.prefill(cache, ids, chunk, ced=mode))
    layers = timer.seconds()
    comp = fs.compose_flash(layers, dt)
    T = ids.size(1)
    window = model.args.window_size
    decoder_tokens = T if mode == "full" else sum(min(chunk, T - s, window) for s in range(0, T, chunk))
    return {"mode": mode, "prompt_tokens": T, "chunk": chunk, "seconds": dt, "tokens_per_s": T / dt,
            "decoder_tokens": decoder_tokens,
            "layer_ms": {f"{i} {fs.REPRESENTS[i]}": t * 1e3 for i, t in sorted(layers.items())},
            "outside_blocks_ms": comp["outside_blocks_s"] * 1e3,
            "estimate_40_layers_s": comp["estimate_40_layers_s"], **fs.memory_note()}


def run(json_path=None, device=None, tiny=False, tokens=None, chunks=None, experts=None, quick=False,
        prefill_variants=None):
    """prefill_variants: the sparse attention kernels to run the prefill with, each in turn in this run
    (model/kernels/sparse_attention.py PREFILL_VARIANT: "tiles", "split"); default the module's own."""
    from dsv41.model.kernels import sparse_attention

    default_variant = sparse_attention.PREFILL_VARIANT
    variants = prefill_variants or [default_variant]
    try:
        return _run(json_path, device, tiny, tokens, chunks, experts, variants)
    finally:
        sparse_attention.PREFILL_VARIANT = default_variant


def _run(json_path, device, tiny, tokens, chunks, experts, variants):
    from dsv41.model.kernels import sparse_attention

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    cuda = device == "cuda"
    tokens = tokens or (256 if tiny else 32768)
    chunks = chunks or ([64] if tiny else [4096])
    args = fs.stack_args("tiny" if tiny else "v4.1-flash", experts)
    t0 = time.perf_counter()
    model = fs.build(args, device)
    fs.sync(device)
    info = {"config": args.name, "routed_experts": args.n_routed_experts, "omitted": fs.OMITTED,
            "layers": {i: fs.REPRESENTS[i] for i in range(args.n_layers)},
            "weights_GiB": fs.gib(fs.weight_bytes(model)), "build_s": round(time.perf_counter() - t0, 1)}
    print(f"model: {info}", flush=True)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, args.vocab_size, (1, tokens), generator=g).to(device)
    results, comparisons, failures = [], [], []
    for chunk, variant in [(c, v) for c in chunks for v in variants]:
        sparse_attention.PREFILL_VARIANT = variant
        got = {}
        for mode in ("full", "replay"):
            try:
                r = {**prefill_time(model, ids, chunk, mode), "prefill_attention": variant}
                got[mode] = r
                results.append(r)
                print(f"{mode:7s} chunk {chunk} ({variant}): {r['seconds']:.3f} s ({r['tokens_per_s']:.0f} tokens/s), "
                      f"decoder tokens {r['decoder_tokens']}, 40-layer estimate {r['estimate_40_layers_s']:.3f} s",
                      flush=True)
                print("    per layer ms: " + "  ".join(f"{k}:{v:.1f}" for k, v in r["layer_ms"].items()))
            except Exception as e:
                failures.append({"mode": mode, "chunk": chunk, "prefill_attention": variant,
                                 "error": f"{type(e).__name__}: {e}"[:2000],
                                 "oom": fs.is_oom(e)})
                print(f"!! {mode} chunk {chunk}: {type(e).__name__}: {str(e)[:500]}", flush=True)
                traceback.print_exc()
            if cuda:
                torch.cuda.empty_cache()
            if json_path:  # after every mode: a timeout later still leaves this
                _write(json_path, info, results, comparisons, failures)
        if len(got) == 2:
            c = {"chunk": chunk, "prompt_tokens": tokens, "prefill_attention": variant,
                 "speedup_stack": got["full"]["seconds"] / got["replay"]["seconds"],
                 "speedup_40_layer_estimate": got["full"]["estimate_40_layers_s"] / got["replay"]["estimate_40_layers_s"],
                 "target": TARGET}
            c["met_stack"] = c["speedup_stack"] >= TARGET
            comparisons.append(c)
        if json_path:
            _write(json_path, info, results, comparisons, failures)
    print(f"\n== CED replay vs full prefill, {tokens} prompt tokens ({args.name}, {args.n_routed_experts} experts)")
    print(f"{'chunk':>6s} {'attention':>9s} {'full s':>9s} {'replay s':>9s} {'speedup':>8s} {'40-layer est.':>14s} "
          f"{'target':>7s}")
    for c in comparisons:
        same = [r for r in results if r["chunk"] == c["chunk"] and r["prefill_attention"] == c["prefill_attention"]]
        full = next(r for r in same if r["mode"] == "full")
        rep = next(r for r in same if r["mode"] == "replay")
        print(f"{c['chunk']:6d} {c['prefill_attention']:>9s} {full['seconds']:9.3f} {rep['seconds']:9.3f} "
              f"{c['speedup_stack']:8.2f} {c['speedup_40_layer_estimate']:14.2f} {'>= ' + str(TARGET):>7s}")
    for f in failures:
        print(f"  FAILED {f['mode']} chunk {f['chunk']}: {f['error'][:200]}")
    return comparisons


def _write(path, info, results, comparisons, failures):
    from kernels_common import write_record

    write_record(path, {"benchmark": "ced_replay_vs_full", "model": info, "results": results,
                        "comparisons": comparisons, "failures": failures})


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json")
    ap.add_argument("--device")
    ap.add_argument("--tiny", action="store_true", help="tiny widths (CPU check of the code paths)")
    ap.add_argument("--tokens", type=int, help="prompt tokens (default 32768)")
    ap.add_argument("--chunks", type=int, nargs="*", help="prefill chunk sizes (default 4096)")
    ap.add_argument("--experts", type=int)
    ap.add_argument("--prefill-variants", nargs="*", choices=("tiles", "split"),
                    help="sparse attention kernels for the prefill, each timed in turn (default: the model's own)")
    a = ap.parse_args()
    run(a.json, a.device, a.tiny, a.tokens, a.chunks, a.experts, prefill_variants=a.prefill_variants)
