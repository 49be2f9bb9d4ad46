"""Loss curve of the dsv41-tiny training run (both stages) -> recipes/tiny/loss.png.

    python -m dsv41.recipes.tiny.plot [stage1_history.json stage2_history.json ...]
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main(argv: list[str] | None = None) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    stage = lambda p: int(re.search(r"stage(\d+)_", Path(p).name).group(1))  # noqa: E731  (stage10 after stage9)
    files = [Path(p) for p in (argv or sorted((HERE / "logs").glob("stage*_history.json"), key=stage))]
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(13, 7))
    offset_tokens, offset_steps = 0, 0
    for i, f in enumerate(files, 1):
        h = json.loads(f.read_text())
        bb = h["backbone"]
        if bb:
            ax.plot([(offset_tokens + r["tokens"]) / 1e6 for r in bb], [r["lm_loss"] for r in bb], label=f"stage {i} LM loss")
            ax.plot([(offset_tokens + r["tokens"]) / 1e6 for r in bb], [r["indexer_kl"] * 10 for r in bb], ":",
                    label=f"stage {i} indexer KL x10")
            if "image_reply_loss" in bb[-1]:
                ax.plot([(offset_tokens + r["tokens"]) / 1e6 for r in bb if "image_reply_loss" in r],
                        [r["image_reply_loss"] for r in bb if "image_reply_loss" in r], "--",
                        label=f"stage {i} image-question reply loss")
        ds = h["dspark"]
        if ds:
            ax2.plot([offset_steps + r["dspark_step"] for r in ds], [r["ce"] for r in ds], label=f"stage {i} drafter CE")
            ax2.plot([offset_steps + r["dspark_step"] for r in ds], [r["teacher_forced_top1"] * 10 for r in ds], ":",
                     label=f"stage {i} drafter top-1 x10")
        if bb:
            offset_tokens += bb[-1]["tokens"]
            ax.axvline(offset_tokens / 1e6, color="grey", lw=0.5)
        if ds:
            offset_steps += ds[-1]["dspark_step"]
    ax.set_xlabel("training tokens (M)")
    ax.set_ylabel("nats / token")
    ax.set_title("dsv41-tiny backbone (all stages; grey lines: stage boundaries)")
    # legends under the plots: ten stages x three curves do not fit inside them
    ax.legend(fontsize=7, ncol=2, loc="upper center", bbox_to_anchor=(0.5, -0.12))
    ax2.set_xlabel("drafter steps (backbone frozen)")
    ax2.set_title("DSpark drafter")
    ax2.legend(fontsize=7, ncol=2, loc="upper center", bbox_to_anchor=(0.5, -0.12))
    fig.tight_layout()
    out = HERE / "loss.png"
    fig.savefig(out, dpi=110)
    return out


if __name__ == "__main__":
    print(main(sys.argv[1:] or None))
