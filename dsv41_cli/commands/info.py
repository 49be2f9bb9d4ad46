"""`dsv41 info`: ledgers from a config, without allocating weights."""

from __future__ import annotations

from typing import Optional

import typer

from dsv41_cli.common import DeviceOpt, JsonOpt, ModelOpt, resolve_model_dir
from dsv41_cli.console import fail, out, print_json


def command(
    model: Optional[str] = ModelOpt,
    config: Optional[str] = typer.Option(None, "--config",
                                         help="A preset (v4.1-flash, v4-flash, v4-pro, tiny) or a config.json path."),
    device: str = DeviceOpt,
    as_json: bool = JsonOpt,
):
    from model.config import load_config, resolve_config
    from model.ledger import info

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
    from rich.table import Table

    out.print(f"[bold]{doc['model']}[/] ({doc['family']})" + (f"  {doc['path']}" if doc["path"] else ""))
    t = Table(title="Parameters", title_justify="left")
    t.add_column("component")
    t.add_column("parameters", justify="right")
    for k, v in doc["params"].items():
        t.add_row(k, _fmt_params(v))
    t.add_row("activated / token, prefill", _fmt_params(doc["activated"]["prefill"]))
    t.add_row("activated / token, decode", _fmt_params(doc["activated"]["decode"]))
    out.print(t)

    kv = doc["kv"]
    t = Table(title="KV cache", title_justify="left")
    t.add_column("what")
    t.add_column("bytes", justify="right")
    t.add_row("global KV per token", f"{kv['global_bytes_per_token']:,.1f}")
    t.add_row("  main KV per token", f"{kv['main_bytes_per_token']:,.1f}")
    t.add_row("  indexer keys per token", f"{kv['indexer_bytes_per_token']:,.1f}")
    t.add_row("window KV per layer (full ring)", f"{kv['swa_bytes_per_layer_window']:,}")
    out.print(t)

    t = Table(title="Layer plan", title_justify="left")
    for col in ("layers", "part", "m", "mode", "KV from", "Top-K from"):
        t.add_column(col)
    for first, last, row in _runs(doc["layers"]):
        span = str(first) if first == last else f"{first}-{last}"
        t.add_row(span, row["part"], str(row["compress_ratio"]), row["mode"],
                  _src(row["kv_source"], first, last), _src(row["index_source"], first, last))
    out.print(t)


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
