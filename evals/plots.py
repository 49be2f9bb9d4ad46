"""Figures: bits per byte per corpus (report Figure 6) and the effort sweep (report Figure 9).

matplotlib is imported inside the functions, with the non-interactive Agg backend, and every file
is written to a temporary name and renamed when complete.
"""

from __future__ import annotations

import os
from pathlib import Path

PALETTE = ["#4C72B0", "#DD8452", "#55A868", "#C44E52", "#8172B3", "#937860", "#DA8BC3", "#8C8C8C"]
BASELINE_GREYS = {"gzip": "#BDBDBD", "bz2": "#A6A6A6", "xz": "#8F8F8F", "zstd": "#787878"}


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: str | os.PathLike) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.stem}.tmp{os.getpid()}{path.suffix}")
    fig.savefig(tmp, dpi=150, bbox_inches="tight")
    os.replace(tmp, path)
    return path


def plot_bpb(doc: dict, path: str | os.PathLike, title: str | None = None) -> Path:
    """Grouped bars: one group per corpus (and "overall"), one bar per model with its bootstrap 95%
    interval, then the compressor baselines as grey hatched bars; values written on the bars."""
    import numpy as np

    plt = _pyplot()
    corpora = [c["name"] for c in doc["models"][0]["corpora"]]
    series = []  # (label, values, (lo, hi) errors or None, color, hatch)
    for k, m in enumerate(doc["models"]):
        by_name = {c["name"]: c for c in m["corpora"]}
        vals = [by_name[c]["bpb"] for c in corpora]
        errs = [[v - by_name[c]["ci95"][0] if by_name[c]["ci95"] else 0 for c, v in zip(corpora, vals)],
                [by_name[c]["ci95"][1] - v if by_name[c]["ci95"] else 0 for c, v in zip(corpora, vals)]]
        has_ci = any(by_name[c]["ci95"] for c in corpora)
        series.append((m["model"], vals, errs if has_ci else None, PALETTE[k % len(PALETTE)], None))
    for name, per_corpus in doc.get("baselines", {}).items():
        series.append((name, [per_corpus[c] for c in corpora], None, BASELINE_GREYS.get(name, "#999999"), "//"))
    n_groups, n_series = len(corpora), len(series)
    width = 0.8 / n_series
    fig, ax = plt.subplots(figsize=(max(6.0, 1.4 + n_groups * (0.5 + 0.32 * n_series)), 4.2))
    x = np.arange(n_groups)
    for k, (label, vals, errs, color, hatch) in enumerate(series):
        pos = x - 0.4 + width * (k + 0.5)
        bars = ax.bar(pos, vals, width * 0.92, label=label, color=color, hatch=hatch,
                      edgecolor="white" if hatch is None else "#555555", linewidth=0.6,
                      yerr=errs, capsize=2 if errs else 0, error_kw={"elinewidth": 0.8, "ecolor": "#333333"})
        tops = [v + (errs[1][i] if errs else 0) for i, v in enumerate(vals)]
        for b, v, top in zip(bars, vals, tops):
            ax.annotate(f"{v:.2f}", (b.get_x() + b.get_width() / 2, top), xytext=(0, 2),
                        textcoords="offset points", ha="center", va="bottom", fontsize=7, rotation=90 if n_series > 7 else 0)
    ax.set_xticks(x, corpora)
    ax.set_ylabel("bits per byte (lower is better)")
    ax.set_ylim(0, max(max(s[1]) for s in series) * 1.22)
    window = doc.get("window", "")
    ax.set_title(title or f"Bits per byte on held-out corpora ({window} windows)", fontsize=11)
    ax.spines[["top", "right"]].set_visible(False)
    ax.legend(frameon=False, fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.grid(axis="y", alpha=0.3)
    ax.set_axisbelow(True)
    out = _save(fig, path)
    plt.close(fig)
    return out


def _label_points(fig, ax, xs, ys, labels, bold) -> None:
    """Write each label beside its point: right of it, else left, moving up or down a line at a time
    until it covers no marker and no label already placed; a thin leader line joins a moved label to its point."""
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    spots = [(dx, dy) for dy in (4, -14, 16, -26, 28, -38, 40, 52, 64) for dx in (10, -10)]
    from matplotlib.transforms import Bbox

    frame = ax.get_window_extent(renderer)
    placed = []  # display-space boxes a label must not cover: the markers, then the labels placed
    for x, y in zip(xs, ys):
        px, py = ax.transData.transform((x, y))
        placed.append(Bbox([[px - 9, py - 9], [px + 9, py + 9]]))
    for x, y, text, b in zip(xs, ys, labels, bold):
        style = {"fontsize": 8, "fontweight": "bold" if b else "normal", "textcoords": "offset points"}
        for dx, dy in spots:
            probe = ax.annotate(text, (x, y), xytext=(dx, dy), ha="left" if dx > 0 else "right", **style)
            box = probe.get_window_extent(renderer).expanded(1.0, 1.0).padded(3)
            probe.remove()
            inside = frame.x0 <= box.x0 and box.x1 <= frame.x1 and frame.y0 <= box.y0 and box.y1 <= frame.y1
            if inside and not any(box.x0 < q.x1 and q.x0 < box.x1 and box.y0 < q.y1 and q.y0 < box.y1 for q in placed):
                break
        placed.append(box)
        moved = (dx, dy) != spots[0]
        ax.annotate(text, (x, y), xytext=(dx, dy), ha="left" if dx > 0 else "right", **style,
                    arrowprops={"arrowstyle": "-", "lw": 0.5, "color": "#777777", "shrinkB": 4} if moved else None)


def plot_sweep(doc: dict, path: str | os.PathLike, title: str | None = None) -> Path:
    """Left: accuracy (95% interval) against mean output tokens on a log axis, one point per effort,
    labelled with its effort (e=25), the presets low/high/max (50/75/100) drawn as stars. Right: mean
    reasoning and mean output tokens per effort."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    from dsv41.model.encoding import EFFORT_PRESETS

    PRESET_OF = {v: k for k, v in EFFORT_PRESETS.items()}  # 50 -> "low", ... (as evals/effort.py's PRESET_OF)

    plt = _pyplot()
    pts = sorted(doc["points"], key=lambda p: p["effort"])
    efforts = [p["effort"] for p in pts]
    acc = [100 * p["accuracy"] for p in pts]
    tokens = [max(p["mean_output_tokens"], 1e-3) for p in pts]
    lo = [100 * (p["accuracy"] - p["ci95"][0]) for p in pts]
    hi = [100 * (p["ci95"][1] - p["accuracy"]) for p in pts]
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(10.5, 4.2), gridspec_kw={"width_ratios": [1.35, 1]})
    color = PALETTE[0]
    ax.plot(tokens, acc, "-", color=color, alpha=0.6, linewidth=1.5, zorder=1)
    ax.errorbar(tokens, acc, yerr=[lo, hi], fmt="none", ecolor=color, alpha=0.5, capsize=3, zorder=1)
    for t, a, e in zip(tokens, acc, efforts):
        preset = PRESET_OF.get(e)
        ax.scatter([t], [a], s=150 if preset else 40, marker="*" if preset else "o", zorder=3,
                   color=PALETTE[1] if preset else color, edgecolor="black" if preset else "none", linewidth=0.5)
    ax.set_xscale("log")
    lo_t, hi_t = min(tokens), max(tokens)
    if hi_t / lo_t < 4:  # a narrow range: widen it around its geometric centre so ticks fall inside
        centre, half = (lo_t * hi_t) ** 0.5, 1.35
        ax.set_xlim(centre / half, centre * half)
    ax.xaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.set_ylim(max(0, min(a - l for a, l in zip(acc, lo)) - 8), min(100, max(a + h for a, h in zip(acc, hi)) + 8))
    ax.set_xlabel("mean output tokens per item (log scale)")
    ax.set_ylabel(f"accuracy, % ({pts[0]['n']} items, 95% CI)")
    ax.grid(alpha=0.3, which="both")
    ax.spines[["top", "right"]].set_visible(False)
    ax.set_title("Accuracy against output length", fontsize=10)
    ax2.plot(efforts, [p["mean_output_tokens"] for p in pts], "o-", color=PALETTE[2], label="output tokens")
    ax2.plot(efforts, [p["mean_reasoning_tokens"] for p in pts], "s--", color=PALETTE[3], label="reasoning tokens")
    for e in efforts:
        if e in PRESET_OF:
            ax2.axvline(e, color="#bbbbbb", linewidth=0.8, zorder=0)
            ax2.annotate(PRESET_OF[e], (e, 1.0), xycoords=("data", "axes fraction"), xytext=(0, 2),
                         textcoords="offset points", ha="center", va="bottom", fontsize=8, color="#666666")
    ax2.set_xlabel("reasoning effort")
    ax2.set_ylabel("mean tokens per item")
    ax2.set_xticks(efforts)
    ax2.set_ylim(0, 1.15 * max(p["mean_output_tokens"] for p in pts) + 1)
    ax2.grid(alpha=0.3)
    ax2.legend(frameon=False, fontsize=8)
    ax2.spines[["top", "right"]].set_visible(False)
    ax2.set_title("Tokens per item at each effort", fontsize=10, pad=14)
    fig.suptitle(title or f"Effort sweep: {doc['task']}", fontsize=12)
    fig.tight_layout()
    # labels last: their overlap test needs the final layout
    _label_points(fig, ax, tokens, acc, [f"{PRESET_OF[e]} {e}" if e in PRESET_OF else f"e={e}" for e in efforts],
                  [e in PRESET_OF for e in efforts])
    out = _save(fig, path)
    plt.close(fig)
    return out
