"""Throughput and peak memory of `dsv41 convert` on a multi-GB official-layout fixture.

    python benchmarks/convert_bench.py [--workdir DIR] [--experts 64] [--dim 1024] [--engram-vocab 4000000]

Builds a random checkpoint in the exact official layout (the tiny V4.1 config widened: dim 1024, 64
routed experts per layer, two Engram tables of ~18M rows; about 2.4 GB, the largest tensor a 576 MB
Engram table), then runs each conversion in a fresh process through the CLI entry point and reports
wall time, throughput (bytes written / s) and the process's peak resident set size (VmHWM: every page
the process had mapped at once, file-backed ones included). A `--dry-run` of the same
conversion gives the baseline: interpreter, torch, the package and the verified plan.

Numbers are with a warm page cache (the fixture was just written), so they measure the converter,
not the disk. Results go to stdout as a table and as JSON (`--json FILE` to keep them).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def child(argv: list[str]) -> None:
    """Run one CLI command in this process and print its wall time and peak RSS as JSON (last line)."""
    sys.path.insert(0, str(REPO))
    from dsv41_cli.app import main

    started = time.perf_counter()
    code = 0
    try:
        main(argv)
    except SystemExit as e:
        code = e.code or 0
    seconds = time.perf_counter() - started
    print(json.dumps({"code": code, "seconds": seconds, "peak_rss_bytes": peak_rss_bytes()}))


def peak_rss_bytes() -> int:
    """This process's high-water resident set size. VmHWM belongs to the address space, so it starts
    afresh at exec (ru_maxrss would carry over the forking parent's peak)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def run(argv: list[str]) -> dict:
    out = subprocess.run([sys.executable, __file__, "--child", *argv], cwd=REPO, capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(f"{' '.join(argv)} failed:\n{out.stderr}")
    result = json.loads(out.stdout.strip().splitlines()[-1])
    if result["code"]:
        raise SystemExit(f"{' '.join(argv)} exited {result['code']}:\n{out.stderr}")
    return result


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.iterdir() if p.is_file())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workdir", default=None, help="where to build the fixture (default: a temp dir, removed after)")
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--dim", type=int, default=1024)
    ap.add_argument("--engram-vocab", type=int, default=3_000_000, help="Engram tables hold ~6x this many rows")
    ap.add_argument("--json", default=None, help="also write the results to this file")
    ap.add_argument("--child", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    opts = ap.parse_args()
    if opts.child is not None:
        return child(opts.child)

    sys.path.insert(0, str(REPO))
    from dsv41.model.checkpoint import expected_tensors, itemsize
    from dsv41.model.engram import engram_table_rows
    from dsv41.model.fixtures import fixture_args

    args = fixture_args(vision=False, dim=opts.dim, moe_inter_dim=opts.dim, n_routed_experts=opts.experts,
                        dspark_n_routed_experts=opts.experts, engram_vocab_size=opts.engram_vocab)
    args = args.replace(engram_num_embeddings=engram_table_rows(args))
    sizes = {n: itemsize(d) * math.prod(s) for n, (s, d) in expected_tensors(args).items()}
    largest = max(sizes, key=sizes.get)

    work = Path(opts.workdir or tempfile.mkdtemp(prefix="dsv41-convert-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    src = work / "official"
    try:
        if src.exists():
            shutil.rmtree(src)
        t = time.perf_counter()
        subprocess.run([sys.executable, "-c", "import sys, json; sys.path.insert(0, sys.argv[1]); "
                        "from dsv41.model.fixtures import write_random_official; from dsv41.model.config import ModelArgs; "
                        "write_random_official(sys.argv[2], ModelArgs.from_dict(json.loads(sys.argv[3])), n_shards=6)",
                        str(REPO), str(src), json.dumps(args.to_dict())], check=True)  # its memory is not ours
        made = time.perf_counter() - t
        total = dir_bytes(src)
        print(f"fixture: {total / 1e9:.2f} GB, {len(sizes):,} tensors, largest {largest} "
              f"{sizes[largest] / 1e6:.0f} MB, written in {made:.1f} s", file=sys.stderr)

        cases = [
            ("baseline: --dry-run (verify + plan)", [str(src), str(work / "dry"), "--mp", "2", "--dry-run"], None),
            ("official -> runtime, mp 1, fp4", [str(src), str(work / "mp1")], work / "mp1"),
            ("official -> runtime, mp 2, fp4", [str(src), str(work / "mp2"), "--mp", "2"], work / "mp2"),
            ("official -> runtime, mp 2, fp8 experts", [str(src), str(work / "mp2fp8"), "--mp", "2",
                                                        "--expert-dtype", "fp8"], work / "mp2fp8"),
            ("runtime mp 2 -> official", [str(work / "mp2"), str(work / "back"), "--to", "official"], work / "back"),
        ]
        rows = []
        for label, argv, out_dir in cases:
            r = run(["convert", *argv])
            written = dir_bytes(out_dir) if out_dir else 0
            rows.append({"case": label, "seconds": round(r["seconds"], 2), "bytes_written": written,
                         "throughput_mb_s": round(written / r["seconds"] / 1e6, 1) if written else None,
                         "peak_rss_mb": round(r["peak_rss_bytes"] / 2**20, 1)})
            print(f"{label}: {rows[-1]}", file=sys.stderr)
            if out_dir is not None and out_dir.name in ("mp1", "mp2fp8", "back"):
                shutil.rmtree(out_dir)  # keep the disk footprint at ~3 fixtures
        doc = {"fixture": {"bytes": total, "tensors": len(sizes), "largest_tensor": largest,
                           "largest_tensor_bytes": sizes[largest], "write_seconds": round(made, 1),
                           "config": {"dim": opts.dim, "experts": opts.experts,
                                      "engram_rows": list(args.engram_num_embeddings)}},
               "cpu_count": os.cpu_count(), "results": rows}
        print("| conversion | wall s | written GB | MB/s | peak RSS MB |")
        print("|---|---:|---:|---:|---:|")
        for r in rows:
            print(f"| {r['case']} | {r['seconds']:.1f} | {r['bytes_written'] / 1e9:.2f} | "
                  f"{r['throughput_mb_s'] if r['throughput_mb_s'] is not None else '-'} | {r['peak_rss_mb']:.0f} |")
        print(json.dumps(doc, indent=1))
        if opts.json:
            Path(opts.json).write_text(json.dumps(doc, indent=1) + "\n")
    finally:
        if opts.workdir is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
