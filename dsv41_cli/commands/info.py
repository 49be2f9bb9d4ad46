"""`dsv41 info`: ledgers from a config, without allocating weights and without torch (the per-rank plan of
`--mp`, `--context`, `--batch` imports it: `dsv41.model.parallel.memory_plan`)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from dsv41_cli.common import BUNDLED_NAME, DeviceOpt, JsonOpt, ModelOpt, resolve_model_dir
from dsv41_cli.console import fail, out, print_json


EPILOG = """Examples:

  dsv41 info

  dsv41 info --model CKPT --json

  dsv41 info --config v4.1-flash --mp 8 --context 1048576 --batch 4
"""


def command(
    model: Optional[str] = ModelOpt,
    config: Optional[str] = typer.Option(None, "--config",
                                         help="A preset (v4.1-flash, v4-flash, v4-pro, tiny) or a config.json path."),
    mp: Optional[int] = typer.Option(None, "--mp", min=1, help="Plan for N model-parallel ranks: per-rank parameter "
                                     "and KV-cache bytes (with --context, --batch)."),
    context: Optional[int] = typer.Option(None, "--context", min=0, help="Tokens per sequence for the KV plan "
                                          "(default: the config's max_seq_len)."),
    batch: int = typer.Option(1, "--batch", min=1, help="Sequences held at once for the KV plan."),
    device: str = DeviceOpt,
    as_json: bool = JsonOpt,
):
    from dsv41.model.config import load_config, resolve_config
    from dsv41.model.ledger import info

    if model and config:
        fail("give --model or --config, not both")
    path = None
    try:
        if config:
            args = resolve_config(config)
        else:
            model_dir = resolve_model_dir(model)
            args, path = load_config(model_dir), str(model_dir)
    except (ValueError, FileNotFoundError) as e:
        fail(str(e))
    doc = info(args, path)
    if mp is not None or context is not None or batch != 1:
        from dsv41.model.parallel import memory_plan

        try:
            doc["parallel"] = memory_plan(args, mp or 1, args.max_seq_len if context is None else context, batch)
        except ValueError as e:
            fail(str(e))
    if as_json:
        print_json(doc)
    else:
        render(doc)


def _fmt_params(n: float) -> str:
    for unit, div in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= div:
            return f"{n / div:,.2f}{unit}"
    return f"{n:,.0f}"


def render(doc: dict) -> None:
    from rich.markup import escape
    from rich.table import Table

    from dsv41.model.assets import bundled_model_dir

    out.print(f"[bold]{escape(doc['model'])}[/] ({doc['family']})")
    if doc["path"]:  # where the checkpoint lives (the bundled one: inside the installed package)
        bundled = bundled_model_dir()
        name = f" ({BUNDLED_NAME}, bundled)" if bundled and Path(doc["path"]).resolve() == bundled.resolve() else ""
        out.print(f"path: {doc['path']}{name}", markup=False)
    t = Table(title="Parameters", title_justify="left")
    t.add_column("component")
    t.add_column("parameters", justify="right")
    for k, v in doc["params"].items():
        t.add_row(k, _fmt_params(v))
    t.add_row("activated / token, prefill", _fmt_params(doc["activated"]["prefill"]))
    t.add_row("activated / token, decode", _fmt_params(doc["activated"]["decode"]))
    out.print(t)
    if "checkpoint" in doc:
        ck = doc["checkpoint"]
        dtypes = ", ".join(f"{k} {v['tensors']:,}" for k, v in ck["by_dtype"].items())
        out.print(f"Checkpoint ({ck['layout']} layout): {ck['tensors']:,} tensors, {ck['bytes']:,} bytes "
                  f"({_bytes(ck['bytes'])}); {dtypes}")

    kv = doc["kv"]
    t = Table(title="KV cache", title_justify="left")
    t.add_column("what")
    t.add_column("bytes", justify="right")
    t.add_row("global KV per token", f"{kv['global_bytes_per_token']:,.1f}")
    t.add_row("  main KV per token", f"{kv['main_bytes_per_token']:,.1f}")
    t.add_row("  indexer keys per token", f"{kv['indexer_bytes_per_token']:,.1f}")
    t.add_row("window KV per layer (full ring)", f"{kv['swa_bytes_per_layer_window']:,}")
    t.add_row("persistent cache per token (no SWA)", f"{kv['persistent_bytes_per_token_without_swa']:,.1f}")
    t.add_row("SWA snapshot (every layer's ring)", f"{kv['swa_snapshot_bytes']:,}")
    out.print(t)
    if "kv_vs_v4_flash" in doc:
        _render_kv_comparison(doc["kv_vs_v4_flash"])

    if "parallel" in doc:
        _render_parallel(doc["parallel"])

    t = Table(title="Layer plan", title_justify="left")
    for col in ("layers", "part", "m", "mode", "KV from", "Top-K from"):
        t.add_column(col)
    for first, last, row in _runs(doc["layers"]):
        span = str(first) if first == last else f"{first}-{last}"
        t.add_row(span, row["part"], str(row["compress_ratio"]), row["mode"],
                  _src(row["kv_source"], first, last), _src(row["index_source"], first, last))
    out.print(t)


def _bytes(n: float) -> str:
    for unit, div in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= div:
            return f"{n / div:,.2f} {unit}"
    return f"{n:,.0f} B"


def _render_parallel(plan: dict) -> None:
    from rich.table import Table

    kv = plan["kv"]
    t = Table(title=f"Per rank: mp {plan['mp']}, context {plan['context']:,}, batch {plan['batch']} "
                    f"(experts {plan['expert_dtype']}, main KV {plan['kv_main_format']})", title_justify="left")
    for col in ("rank", "parameters", "KV cache", "total"):
        t.add_column(col, justify="right")
    for r in plan["ranks"]:
        t.add_row(str(r["rank"]), _bytes(r["param_bytes"]), _bytes(r["kv_bytes"]), _bytes(r["total_bytes"]))
    out.print(t)
    out.print(f"KV per rank: main {_bytes(kv['main'])}, index keys {_bytes(kv['index_keys'])}, windows "
              f"{_bytes(kv['window'])} (every rank holds the whole cache). Activations and workspace not counted.")


def _render_kv_comparison(c: dict) -> None:
    from rich.table import Table

    g, p = c["global_bytes_per_token"], c["persistent"]
    t = Table(title=f"KV ledger against {c['baseline']} (bytes per token)", title_justify="left")
    for col in ("", "this model", c["baseline"], "ratio", "report"):
        t.add_column(col, justify="left" if not col else "right")
    t.add_row("global KV", f"{g['this']:,.1f}", f"{g['baseline']:,.1f}", f"{g['ratio']:.3f}", f"{g['report_ratio']:.3f}")
    t.add_row(f"persistent cache, turns of {p['turn_tokens_swa_half']:,.0f} tokens*",
              f"{p['this_without_swa_bytes_per_token']:,.1f}", f"{p['baseline_with_swa_bytes_per_token']:,.1f}",
              f"{p['ratio']:.3f}", f"{p['report_ratio']:.3f}")
    out.print(t)
    by_turn = ", ".join(f"{int(k):,}: {v:.3f}" for k, v in p["ratio_by_turn_tokens"].items())
    out.print(f"* this model without SWA KV (bounded replay), {c['baseline']} with two SWA snapshots per turn; at "
              f"this turn length SWA is half of {c['baseline']}'s persistent cache, as the report describes. "
              f"Ratio by turn length: {by_turn}.")


def _src(v, first, last) -> str:
    if v is None:
        return "-"
    return "self" if v == first == last else str(v)


def _runs(layers):
    """Group consecutive layers that read the same sources in the same mode (for a short table)."""
    key = lambda r: (r["part"], r["compress_ratio"], r["mode"], r["kv_source"], r["index_source"])
    start = prev = None
    for r in layers:
        if prev is not None and key(r) == key(prev) and r["mode"] in ("reuse", "swa"):
            prev = r
            continue
        if start is not None:
            yield start["id"], prev["id"], start
        start = prev = r
    if start is not None:
        yield start["id"], prev["id"], start
