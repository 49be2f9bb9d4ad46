"""Running without the Hugging Face Hub: is it reachable, which files does each alias need, are they here.

`dsv41 eval` decides once, before `datasets`/`huggingface_hub` are imported, whether the Hub can be
reached (`hub_reachable`: one TCP connect to the Hub host, or its proxy, bounded by a timeout that covers
the name lookup too). When it cannot, the run goes offline (HF_HUB_OFFLINE / HF_DATASETS_OFFLINE), so
lm-eval and datasets never retry; a task whose data is neither under --data-dir nor in the local cache
then fails at once with `DataUnavailable`, whose message says which files to put where.

`HUB_DATA` lists, for every alias, the Hub dataset(s) lm-eval's task reads, their configs and the
splits it uses; docs/evaluation.md ("Offline data") prints the same table for people.
`python -m dsv41.evals.tasks.prepare` turns downloaded parquet/JSON files into the --data-dir layout.

Nothing here imports lm-eval or datasets.
"""

from __future__ import annotations

import os
import socket
import threading
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

DOCS = 'docs/evaluation.md, "Offline data"'
SPLIT_SUFFIXES = (".jsonl", ".json", ".parquet")


@dataclass(frozen=True)
class HubData:
    """One Hub dataset a task reads: its id, the configs (subsets) lm-eval loads (each its own folder
    under DIR/<path>/; () when the task uses the default config) and the splits it needs."""

    path: str
    splits: tuple[str, ...]
    configs: tuple[str, ...] = ()
    gated: bool = False  # the Hub asks for a login and accepting terms before downloading

    def folders(self, data_dir: str | os.PathLike) -> list[Path]:
        root = Path(data_dir)
        return [root / self.path / c for c in self.configs] if self.configs else [root / self.path]


_BBH = ("boolean_expressions", "causal_judgement", "date_understanding", "disambiguation_qa", "dyck_languages",
        "formal_fallacies", "geometric_shapes", "hyperbaton", "logical_deduction_five_objects",
        "logical_deduction_seven_objects", "logical_deduction_three_objects", "movie_recommendation",
        "multistep_arithmetic_two", "navigate", "object_counting", "penguins_in_a_table",
        "reasoning_about_colored_objects", "ruin_names", "salient_translation_error_detection", "snarks",
        "sports_understanding", "temporal_sequences", "tracking_shuffled_objects_five_objects",
        "tracking_shuffled_objects_seven_objects", "tracking_shuffled_objects_three_objects", "web_of_lies",
        "word_sorting")
_AGIEVAL = ("aqua-rat", "gaokao-biology", "gaokao-chemistry", "gaokao-chinese", "gaokao-english", "gaokao-geography",
            "gaokao-history", "gaokao-mathcloze", "gaokao-mathqa", "gaokao-physics", "jec-qa-ca", "jec-qa-kd",
            "logiqa-en", "logiqa-zh", "lsat-ar", "lsat-lr", "lsat-rc", "math", "sat-en", "sat-en-without-passage",
            "sat-math")
_MATH = ("algebra", "counting_and_probability", "geometry", "intermediate_algebra", "number_theory", "prealgebra",
         "precalculus")
_MGSM = ("bn", "de", "en", "es", "fr", "ja", "ru", "sw", "te", "th", "zh")

# alias -> the Hub data lm-eval's task for it reads (both the base and the thinking variant).
# mmlu, c-eval and longbench-v2 read one config per subject: every config of the Hub dataset.
HUB_DATA: dict[str, tuple[HubData, ...]] = {
    "mmlu-pro": (HubData("TIGER-Lab/MMLU-Pro", ("test", "validation")),),
    "gsm8k": (HubData("openai/gsm8k", ("train", "test"), ("main",)),),
    "bbh": (HubData("SaylorTwift/bbh", ("test",), _BBH),),
    "mmlu": (HubData("cais/mmlu", ("test", "dev"), ("<subject>",)),),
    "c-eval": (HubData("ceval/ceval-exam", ("val", "dev"), ("<subject>",)),),
    "ceval": (HubData("ceval/ceval-exam", ("val", "dev"), ("<subject>",)),),
    "agieval": tuple(HubData(f"hails/agieval-{n}", ("test",)) for n in _AGIEVAL),
    "drop": (HubData("EleutherAI/drop", ("train", "validation")),),
    "hellaswag": (HubData("Rowan/hellaswag", ("train", "validation")),),
    "math": (HubData("EleutherAI/hendrycks_math", ("train", "test"), _MATH),),
    "mgsm": (HubData("juletxara/mgsm", ("train", "test"), _MGSM),),
    "longbench-v2": (HubData("recursal/longbench-v2", ("train",), ("<subset>",)),),
    "gpqa-diamond": (HubData("Idavidrein/gpqa", ("train",), ("gpqa_diamond",), gated=True),),
}


class DataUnavailable(RuntimeError):
    """A task's dataset is neither under --data-dir nor in the local cache, and the Hub is not used."""

    def __init__(self, message: str):
        super().__init__(message)


# ============================================================================ is the Hub reachable
def hub_endpoint() -> tuple[str, int]:
    """(host, port) a connection to the Hub goes to: the HTTPS proxy when one is set, else HF_ENDPOINT."""
    for var in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"):
        if os.environ.get(var):
            u = urlparse(os.environ[var] if "://" in os.environ[var] else "http://" + os.environ[var])
            if u.hostname:
                return u.hostname, u.port or 8080
    u = urlparse(os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    return u.hostname or "huggingface.co", u.port or (80 if u.scheme == "http" else 443)


def hub_reachable(timeout: float = 1.5) -> tuple[bool, str]:
    """One TCP connect to the Hub (or its proxy); the name lookup included, never longer than `timeout`.
    Returns (reachable, why not)."""
    host, port = hub_endpoint()
    result: list = []

    def probe():
        try:
            socket.create_connection((host, port), timeout=timeout).close()
            result.append("")
        except OSError as e:
            result.append(f"{type(e).__name__}: {e}")

    t = threading.Thread(target=probe, daemon=True)
    t.start()
    t.join(timeout + 0.2)
    if not result:
        return False, f"{host}:{port} did not answer within {timeout:g} s"
    return (not result[0]), (f"{host}:{port}: {result[0]}" if result[0] else "")


def env_offline() -> bool:
    return any(os.environ.get(v, "").strip().lower() in ("1", "true", "yes", "on")
               for v in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"))


def set_offline() -> None:
    """HF_HUB_OFFLINE / HF_DATASETS_OFFLINE, and the flags of the libraries if already imported."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["HF_DATASETS_OFFLINE"] = "1"
    import sys

    hub = sys.modules.get("huggingface_hub.constants")
    if hub is not None:
        hub.HF_HUB_OFFLINE = True
    cfg = sys.modules.get("datasets.config")
    if cfg is not None:
        cfg.HF_HUB_OFFLINE = True
        if hasattr(cfg, "HF_DATASETS_OFFLINE"):
            cfg.HF_DATASETS_OFFLINE = True


# ============================================================================ are the files here
def _split_files(folder: Path) -> set[str]:
    if not folder.is_dir():
        return set()
    return {f.stem for f in folder.iterdir() if f.is_file() and f.suffix in SPLIT_SUFFIXES}


def missing_in_data_dir(hd: HubData, data_dir: str | os.PathLike) -> list[str]:
    """The files `hd` still lacks under data_dir (the paths one would create), [] when complete.
    A folder may also be named by the dataset's last path part (DIR/MMLU-Pro/), as `local_split_files`
    accepts. Configs written as <subject> mean: at least one config folder."""
    root = Path(data_dir)
    tail = hd.path.split("/")[-1]
    bases = [root / hd.path, root / tail]
    if any(c.startswith("<") for c in hd.configs):
        for base in bases:
            subs = [d for d in base.iterdir() if d.is_dir()] if base.is_dir() else []
            if subs and all(set(hd.splits) <= _split_files(d) for d in subs):
                return []
        return [f"{root / hd.path}/{hd.configs[0]}/{s}.jsonl" for s in hd.splits]
    missing = []
    for config in hd.configs or (None,):
        have = set()
        for base in bases:
            have |= _split_files(base / config if config else base)
        missing += [f"{root / hd.path}{'/' + config if config else ''}/{s}.jsonl" for s in hd.splits if s not in have]
    return missing


def in_hf_cache(path: str) -> bool:
    """Whether the local Hugging Face caches hold anything of dataset `path` (then datasets may load it
    offline; we let it try)."""
    home = Path(os.environ.get("HF_HOME") or Path.home() / ".cache" / "huggingface")
    org, _, name = path.rpartition("/")
    names = {f"{org}___{name}".lower(), f"datasets--{org}--{name}".lower()}
    for d in (Path(os.environ.get("HF_DATASETS_CACHE") or home / "datasets"),
              Path(os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE") or home / "hub")):
        try:
            if any(p.name.lower() in names for p in d.iterdir()):
                return True
        except OSError:
            continue
    return False


def check_alias_data(alias: str, data_dir: str | os.PathLike | None) -> str | None:
    """Offline: None when every dataset the alias reads is under data_dir (or possibly cached), else
    one line saying what to put where. Names that are not aliases are not checked (None)."""
    needs = HUB_DATA.get(alias.strip().lower())
    if not needs:
        return None
    lacking = []
    for hd in needs:
        if in_hf_cache(hd.path):
            continue
        missing = missing_in_data_dir(hd, data_dir) if data_dir is not None else ["all"]
        if missing:
            lacking.append((hd, missing))
    if not lacking:
        return None
    return describe_missing(alias, lacking, data_dir)


def describe_missing(alias: str, lacking: list[tuple[HubData, list[str]]], data_dir) -> str:
    hd = lacking[0][0]
    more = f" (and {len(lacking) - 1} more datasets: hails/agieval-*)" if len(lacking) > 1 else ""
    splits = " and ".join(f"{s}.jsonl" for s in hd.splits)
    where = f"DIR/{hd.path}/" + (f"{hd.configs[0]}/" if len(hd.configs) == 1 else
                                  ("<config>/" if hd.configs else ""))
    gated = " (gated: accept its terms on the Hub first)" if hd.gated else ""
    if data_dir is None:
        return (f"{alias} needs the Hub dataset {hd.path}{gated}{more}, which is not on this machine, and this run "
                f"is offline: put {splits} (or .parquet) in {where} and pass --data-dir DIR; see {DOCS}")
    files = lacking[0][1]
    shown = ", ".join(files[:3]) + (f" and {len(files) - 3} more" if len(files) > 3 else "")
    stray = sorted(f.name for f in Path(data_dir).glob("*") if f.is_file() and f.suffix in SPLIT_SUFFIXES)
    hint = (f" (found {', '.join(stray[:3])} directly in {data_dir}: the files belong in "
            f"{where.replace('DIR', str(data_dir), 1)})"
            if stray else "")
    return (f"--data-dir {data_dir} has no {hd.path}{more} for {alias}: missing {shown} (or .parquet/.json){hint}; "
            f"see {DOCS}")


def is_offline_error(e: BaseException) -> bool:
    text = f"{type(e).__name__} {e}"
    return any(s in text for s in ("OfflineModeIsEnabled", "Couldn't reach", "LocalEntryNotFound",
                                   "ConnectionError", "offline mode", "Offline mode"))
