"""One entry point for the benchmarks: `python -m benchmarks NAME [--json PATH] [--device D] [--quick] [--tiny]`
from the repository root. Each subcommand runs one script of benchmarks/ in a fresh process (so each still
runs alone, with the same options, as before); the four shared flags are mapped onto that script's own
options, and any further options are passed through unchanged (e.g. `kernels --only gemm experts`).

    python -m benchmarks --help                    # the subcommands, [GPU] / [CPU] / [any] per line
    python -m benchmarks NAME --help               # what the shared flags do for NAME
    python -m benchmarks NAME ... --print          # print the command instead of running it

A shared flag a script has no equivalent for is refused with a one-line error (exit 2), and so is a
GPU-only subcommand on a machine without CUDA. The numbers and the commands that produced them:
docs/performance.md; the device batch that runs them all: benchmarks/device_batch.sh.
"""

from __future__ import annotations

import argparse
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent

NO_TINY_GPU = "GPU shapes only; `python -m benchmarks smoke` runs gemm and experts at tiny shapes on the CPU"


@dataclass(frozen=True)
class Sub:
    script: str
    help: str
    where: str  # "gpu", "cpu", "any" (its --device), or "gpu-unless-tiny" (--tiny runs on the CPU)
    json: tuple | None = ("--json",)  # the script's option for the output file (PATH appended); None: refused
    quick: tuple | None = ("--quick",)  # arguments for --quick; None: refused
    tiny: tuple | None = ("--tiny",)  # arguments for --tiny; None: refused
    device: str = "pass"  # "pass": --device D handed on; "cuda" / "cpu": only that device accepted
    quick_note: str = ""  # why --quick is refused, or what it does when it is not the script's own --quick
    tiny_note: str = ""
    json_note: str = ""


SUBS: dict[str, Sub] = {
    # Triton kernels at V4.1-Flash shapes (one H200): ceilings of the run, floors and ratios
    "kernels": Sub("run_all_kernels.py", "ceilings + every kernel benchmark in one process (--out DIR for "
                   "the per-kernel JSON, --only NAME ...)", "gpu", device="cuda", tiny=None,
                   tiny_note=NO_TINY_GPU, json_note="--json PATH: one JSON of every kernel's rows"),
    "sparse-attention": Sub("bench_sparse_attention.py", "sparse attention over packed FP8/FP4 KV, decode and "
                            "prefill", "gpu", device="cuda", tiny=None, tiny_note=NO_TINY_GPU),
    "indexer": Sub("bench_indexer.py", "indexer scores + Top-K over packed MXFP4 keys, dense and deep",
                   "gpu", device="cuda", tiny=None, tiny_note=NO_TINY_GPU),
    "mhc": Sub("bench_mhc.py", "single-pass mHC step (n=4, d=5120)", "gpu", device="cuda", tiny=None,
               tiny_note=NO_TINY_GPU),
    "kv-pack": Sub("bench_kv_pack.py", "fused FP4 / FP8 KV quantize-and-pack", "gpu", device="cuda", tiny=None,
                   tiny_note=NO_TINY_GPU),
    "gemm": Sub("bench_gemm.py", "FP8 block-scaled GEMM at the projection shapes", "gpu", device="cuda",
                tiny=None, tiny_note=NO_TINY_GPU),
    "experts": Sub("bench_experts.py", "FP4 routed experts of one MoE layer (384 x 5120 -> 2304)", "gpu",
                   device="cuda", tiny=None, tiny_note=NO_TINY_GPU),
    "decode-gemms": Sub("bench_decode_gemms.py", "a decode step's weight-streaming products at one token (FP8 "
                        "projections, FP4 experts, the head) from CUDA graphs on cold weights (--sweep: launch "
                        "configurations)", "gpu", device="cuda", tiny=None, tiny_note=NO_TINY_GPU),
    "diagnose-gaps": Sub("diagnose_gaps.py", "where the missed kernel targets lose their time (variants, "
                         "graph replays, tile sweep)", "gpu", device="cuda", tiny=None, tiny_note=NO_TINY_GPU,
                         quick=None, quick_note="its timing windows are the variants being compared"),
    "diagnose-kernels": Sub("diagnose_kernels.py", "registers/spills, graph replay and variants of the first "
                            "kernels (prints only)", "gpu", device="cuda", json=None, quick=None, tiny=None,
                            json_note="it prints its findings and writes no JSON", quick_note="no quick mode",
                            tiny_note=NO_TINY_GPU),
    # model level: V4.1-Flash layers at full width (GPU), or the same code paths at tiny widths (--tiny, CPU)
    "flash-layers": Sub("bench_flash_layers.py", "decode step and prefill of V4.1-Flash layers at full width "
                        "(8K / 128K / 1M context)", "gpu-unless-tiny"),
    "ced": Sub("bench_ced.py", "CED replay prefill against full, 32K prompt", "gpu-unless-tiny", quick=(),
               quick_note="accepted, changes nothing: one prompt and one chunk size, no timing window"),
    "profile-prefill": Sub("profile_prefill.py", "GPU time of one 4096-token prefill chunk of the stack, by "
                           "kernel (torch.profiler)", "gpu-unless-tiny", quick=(),
                           quick_note="accepted, changes nothing: one chunk is profiled"),
    "launches": Sub("bench_launches.py", "kernel launches per Reuse layer, eager and from a CUDA graph",
                    "gpu-unless-tiny", quick=(), quick_note="accepted, changes nothing: it counts, it does not time"),
    "e2e": Sub("bench_e2e.py", "the tiny random model decoding (GPU and CPU) and launches per Reuse layer",
               "any", tiny=(), tiny_note="accepted, changes nothing: the model is already the tiny preset",
               quick_note="8 timed decode steps instead of 32"),
    "train-step": Sub("bench_train_step.py", "training step of the dsv41-tiny recipe against the batch size "
                      "(needs .tinydata)", "gpu", device="cuda", json=("--out",), quick=("--batches", "64",
                      "--steps", "1"), tiny=(), quick_note="--batches 64 --steps 1",
                      tiny_note="accepted, changes nothing: the recipe model is already tiny"),
    # CPU
    "count-train-ops": Sub("count_train_ops.py", "operator calls and host syncs of one training step, "
                           "counted on the CPU", "any", json=("--out",), quick=("--batch", "1", "--context", "64"),
                           tiny=(), quick_note="--batch 1 --context 64 (default 2 x 128)",
                           tiny_note="accepted, changes nothing: the recipe model is already tiny"),
    "smoke": Sub("smoke_cpu.py", "bench_gemm.py and bench_experts.py end to end at tiny shapes through "
                 "Triton's interpreter (checks the scripts; the timings mean nothing)", "cpu", device="cpu",
                 quick=(), tiny=(), quick_note="accepted, changes nothing: always tiny and short",
                 tiny_note="accepted, changes nothing: always tiny and short"),
    "compile-kernels": Sub("compile_kernels.py", "compile the kernels for sm_90 without a GPU: registers, "
                           "spills, wgmma, load width", "cpu", device="cpu", tiny=(),
                           tiny_note="accepted, changes nothing: it compiles, it runs no model"),
    "convert": Sub("convert_bench.py", "throughput and peak memory of `dsv41 convert` on an official-layout "
                   "fixture (2.4 GB by default)", "cpu", device="cpu",
                   quick=("--experts", "4", "--dim", "256", "--engram-vocab", "20000"),
                   tiny=("--experts", "4", "--dim", "256", "--engram-vocab", "20000"),
                   quick_note="a fixture of a few MB (--experts 4 --dim 256 --engram-vocab 20000)",
                   tiny_note="the same small fixture as --quick"),
    "startup": Sub("bench_startup.py", "start-up time of `dsv41 --help`, `info --json`, `generate --print-prompt` "
                   "against a git revision (--rev REV, default HEAD)", "cpu", device="cpu", tiny=(),
                   quick_note="3 runs per command instead of 7",
                   tiny_note="accepted, changes nothing: the bundled model is already tiny"),
    "engine": Sub("bench_engine.py", "the generation engine against a git revision (--rev REV): one sequence, "
                  "32 mixed requests, tokens/s against concurrency, effort-sweep / eval smoke / bpb wall time",
                  "any", tiny=(), quick_note="8 requests, outputs a quarter as long, no commands",
                  tiny_note="accepted, changes nothing: the bundled model is already tiny"),
    "host-kernels": Sub("bench_host_kernels.py", "the CPU host kernels (model/kernels/host.py) against the torch "
                        "references in one process: one sequence, concurrent requests, greedy tokens identical",
                        "cpu", device="cpu", tiny=(), quick_note="2 rounds, 8 requests, 32 new tokens",
                        tiny_note="accepted, changes nothing: the bundled model is already tiny"),
    "serve": Sub("bench_serve.py", "load test of `dsv41 serve`: concurrent streaming clients for a fixed time "
                  "(--clients 64 --seconds 120): every request ends once, RSS, p50/p99 time to first token, "
                  "tokens/s", "any", tiny=(), quick_note="8 clients for 20 s",
                  tiny_note="accepted, changes nothing: the bundled model is already tiny"),
    "greedy-divergence": Sub("greedy_divergence.py", "where two greedy runs of the same prompts part "
                             "(A.jsonl B.jsonl --prompts P; JSON lines on stdout)", "cpu", device="cpu",
                             json=None, quick=None, tiny=None, json_note="it writes JSON lines to stdout",
                             quick_note="no quick mode", tiny_note="it rescores the bundled model"),
}

TAG = {"gpu": "GPU", "cpu": "CPU", "any": "any", "gpu-unless-tiny": "GPU; CPU with --tiny"}


def refuse(name: str, message: str) -> int:
    print(f"python -m benchmarks {name}: {message}", file=sys.stderr)
    return 2


def command(name: str, a: argparse.Namespace, rest: list[str]) -> list[str] | str:
    """The script's command line for the shared flags, or the one-line reason it cannot run."""
    sub = SUBS[name]
    args: list[str] = []
    added: list[tuple] = []
    for flag, given, mapped, note in (("--quick", a.quick, sub.quick, sub.quick_note),
                                      ("--tiny", a.tiny, sub.tiny, sub.tiny_note)):
        if given:
            if mapped is None:
                return f"{flag} is not available ({note})"
            if mapped not in added:  # --quick and --tiny may map onto the same options
                args += mapped
                added.append(mapped)
    if a.json:
        if sub.json is None:
            return f"--json is not available ({sub.json_note})"
        args += [*sub.json, a.json]
    device = a.device
    if device is not None:
        kind = "cuda" if device.startswith("cuda") else device
        if sub.device in ("cuda", "cpu") and kind != sub.device:
            return f"runs on {sub.device} only (--device {device} given)"
        if sub.device == "pass":
            args += ["--device", device]
    return [sys.executable, f"benchmarks/{sub.script}", *args, *rest]  # run with cwd=REPO: JSON records this


def needs_gpu(name: str, a: argparse.Namespace) -> bool:
    sub = SUBS[name]
    if sub.where == "gpu":
        return True
    if sub.where == "gpu-unless-tiny":
        return not a.tiny and (a.device or "cuda").startswith("cuda")
    return sub.where == "any" and (a.device or "").startswith("cuda")


def parser() -> argparse.ArgumentParser:
    width = max(map(len, SUBS))
    listing = "\n".join(f"  {n:{width}s}  [{TAG[s.where]}] {s.help}" for n, s in SUBS.items())
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Run one benchmark of benchmarks/ with the shared flags --json PATH, --device D, --quick, "
                    "--tiny (options after them go to the script unchanged).",
        epilog=f"subcommands:\n{listing}\n\nNumbers: docs/performance.md. Every GPU step in one batch: "
               "benchmarks/device_batch.sh.")
    subs = ap.add_subparsers(dest="name", metavar="NAME", required=True, help="one of the subcommands below")
    for name, s in SUBS.items():
        notes = [f"script: benchmarks/{s.script}", f"runs on: {TAG[s.where]}"]
        for flag, mapped, note in (("--json", s.json, s.json_note), ("--quick", s.quick, s.quick_note),
                                   ("--tiny", s.tiny, s.tiny_note)):
            if mapped is None:
                notes.append(f"{flag}: refused ({note})")
            else:
                notes.append(f"{flag}: {note or ' '.join(mapped) + (' PATH' if flag == '--json' else '')}")
        sp = subs.add_parser(name, description=s.help, epilog="\n".join(notes), allow_abbrev=False,
                             formatter_class=argparse.RawDescriptionHelpFormatter)
        sp.add_argument("--json", metavar="PATH", help="write the results as JSON to PATH")
        sp.add_argument("--device", help="cuda or cpu (default: the script's own)")
        sp.add_argument("--quick", action="store_true", help="the short version (see below)")
        sp.add_argument("--tiny", action="store_true", help="tiny widths (see below)")
        sp.add_argument("--print", dest="dry", action="store_true", help="print the command, do not run it")
    return ap


def main(argv: list[str] | None = None) -> int:
    a, rest = parser().parse_known_args(argv)
    cmd = command(a.name, a, rest)
    if isinstance(cmd, str):
        return refuse(a.name, cmd)
    shown = " ".join(shlex.quote(c) for c in ["python", *cmd[1:]])
    if a.dry:
        print(shown)
        return 0
    if needs_gpu(a.name, a):
        import torch

        if not torch.cuda.is_available():
            how = " (or --tiny on the CPU)" if SUBS[a.name].where == "gpu-unless-tiny" else ""
            return refuse(a.name, f"needs a CUDA GPU and none is visible here{how}; "
                                  "benchmarks/device_batch.sh runs it on the device")
    print(f"+ {shown}", file=sys.stderr, flush=True)
    return subprocess.run(cmd, cwd=REPO).returncode


if __name__ == "__main__":
    sys.exit(main())
