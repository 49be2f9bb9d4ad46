"""Options and model resolution shared by the commands."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

import typer

from dsv41_cli.console import fail

ModelOpt = typer.Option(None, "--model", envvar="DSV41_MODEL",
                        help="Checkpoint directory (official HF layout or runtime layout). "
                             "Default: the bundled dsv41-tiny model.")
DeviceOpt = typer.Option("auto", "--device", help="auto|cpu|cuda (auto: cuda when present).")
JsonOpt = typer.Option(False, "--json", help="Print one JSON document on stdout (logs go to stderr).")


def resolve_device(device: str) -> str:
    import torch

    if device not in ("auto", "cpu", "cuda"):
        fail(f"--device must be auto, cpu or cuda, not {device!r}")
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        fail("--device cuda was asked for but no CUDA device is available")
    return device


def resolve_model_dir(model: Optional[str]) -> Path:
    """The checkpoint directory to use: --model / DSV41_MODEL, else the bundled model."""
    from dsv41.model.assets import bundled_model_dir

    if model:
        p = Path(model).expanduser()
        if not p.exists():
            fail(f"--model {model}: no such file or directory")
        if p.is_file():
            fail(f"--model {model}: expected a checkpoint directory, got a file")
        if not (p / "config.json").is_file():
            fail(f"--model {model}: no config.json in that directory")
        return p
    bundled = bundled_model_dir()
    if bundled is None:
        fail("no model given and this install has no bundled dsv41-tiny checkpoint; pass --model PATH")
    return bundled


def tune_threads(args, device: str) -> None:
    """Small models on the CPU are bound by per-op overhead, where extra intra-op threads only add
    synchronization (and collapse under load): use one thread below a hidden size of 1024."""
    import torch

    if device == "cpu" and args.dim < 1024 and "DSV41_THREADS" not in os.environ:
        torch.set_num_threads(1)
    elif "DSV41_THREADS" in os.environ:
        torch.set_num_threads(int(os.environ["DSV41_THREADS"]))


# ---------------------------------------------------------------------------------- torchrun
def start_ranks(device: str):
    """Where this process stands (`dsv41.model.parallel.ParallelContext`): one process, or one rank of
    `torchrun --nproc-per-node N -m dsv41_cli COMMAND`, which joins the process group for `--device`.
    Rank 0 owns the console: the other ranks' stdout goes to /dev/null (their stderr stays), and
    commands keep progress, notes and file writes on `ctx.is_main`. Call it before reading inputs."""
    from dsv41.model.parallel import init_from_env

    return init_from_env(resolve_device(device))


def load_on_ranks(model_dir: Path, ctx):
    """(model, args, tokenizer) for this process: the whole model in one process, this rank's part
    of it under torchrun (`dsv41.model.parallel.load_model_parallel`; every rank of a model copy must call
    it). Bad checkpoints end the command with the one-line error."""
    from dsv41.model.parallel import load_model_parallel

    try:
        model, args, tokenizer = load_model_parallel(model_dir, ctx.device, ctx)
    except (ValueError, FileNotFoundError) as e:  # CheckpointError is a ValueError
        fail(f"--model {model_dir}: {e}")
    tune_threads(args, ctx.device)
    return model, args, tokenizer
