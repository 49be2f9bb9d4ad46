"""Options and model resolution shared by the commands."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

import typer

from dsv41.model.assets import BUNDLED_NAME  # `--model dsv41-tiny` (or DSV41_MODEL=dsv41-tiny): the bundled model
from dsv41_cli.console import fail

ModelOpt = typer.Option(None, "--model", envvar="DSV41_MODEL",
                        help="Checkpoint directory (official HF layout or runtime layout), or dsv41-tiny "
                             "(the bundled model). Default: dsv41-tiny.")
DeviceOpt = typer.Option("auto", "--device", help="auto|cpu|cuda (auto: cuda when present).")
JsonOpt = typer.Option(False, "--json", help="Print one JSON document on stdout (logs go to stderr).")


def resolve_device(device: str) -> str:
    if device not in ("auto", "cpu", "cuda"):
        fail(f"--device must be auto, cpu or cuda, not {device!r}")
    if device == "cpu":  # nothing to ask torch
        return device
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        fail("--device cuda was asked for but no CUDA device is available")
    return device


def bundled_model_dir() -> Path:
    """The bundled dsv41-tiny checkpoint directory (a one-line error if this install has none)."""
    from dsv41.model.assets import bundled_model_dir as find

    bundled = find()
    if bundled is None:
        fail(f"this install has no bundled {BUNDLED_NAME} checkpoint; pass --model PATH")
    return bundled


def resolve_model_dir(model: Optional[str]) -> Path:
    """The checkpoint directory to use: --model / DSV41_MODEL (a directory, or the name dsv41-tiny), else
    the bundled model. A directory named dsv41-tiny in the current directory wins over the name."""
    if model and not (model == BUNDLED_NAME and not Path(model).exists()):
        p = Path(model).expanduser()
        if not p.exists():
            fail(f"--model {model}: no such file or directory (a checkpoint directory, or {BUNDLED_NAME})")
        if p.is_file():
            fail(f"--model {model}: expected a checkpoint directory, got a file")
        if not (p / "config.json").is_file():
            fail(f"--model {model}: no config.json in that directory")
        return p
    return bundled_model_dir()


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
    commands keep progress, notes and file writes on `ctx.is_main`. Call it before reading inputs.

    One process (no torchrun): a stand-in that imports torch only when something beyond rank 0's
    console needs it (`ctx.device`, a collective), so a command that ends early (`generate --print-prompt`,
    a bad input) starts without torch. `--device cuda` without CUDA still fails here."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        if device != "auto":
            device = resolve_device(device)
        return _OneProcess(device)
    from dsv41.model.parallel import init_from_env

    return init_from_env(resolve_device(device))


class _OneProcess:
    """The one-process context until torch is needed; then the real `ParallelContext` (every attribute it
    does not answer itself is the real context's)."""

    rank, world, local_rank, tp, tp_rank, dp, dp_rank = 0, 1, 0, 1, 0, 1, 0
    distributed, is_main = False, True

    def __init__(self, device: str):
        self._device = device
        self._ctx = None

    def real(self):
        if self._ctx is None:
            from dsv41.model.parallel import init_from_env

            self._ctx = init_from_env(resolve_device(self._device))
        return self._ctx

    def broadcast_object(self, obj, src: int = 0):
        return obj

    def on_main(self, fn, *args, **kwargs):
        return fn(*args, **kwargs)

    def same_seed(self, seed):
        return seed

    def __getattr__(self, name):  # device, backend, tp_group, share, gather, split_work, ...
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self.real(), name)


def load_on_ranks(model_dir: Path, ctx):
    """(model, args, tokenizer) for this process: the whole model in one process, this rank's part
    of it under torchrun (`dsv41.model.parallel.load_model_parallel`; every rank of a model copy must call
    it). Bad checkpoints end the command with the one-line error."""
    from dsv41.model.parallel import load_model_parallel

    if isinstance(ctx, _OneProcess):
        ctx = ctx.real()
    try:
        model, args, tokenizer = load_model_parallel(model_dir, ctx.device, ctx)
    except (ValueError, FileNotFoundError) as e:  # CheckpointError is a ValueError
        fail(f"--model {model_dir}: {e}")
    tune_threads(args, ctx.device)
    return model, args, tokenizer
