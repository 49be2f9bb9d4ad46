"""Shared fixtures: a tiny random V4.1 model in which every layer mode occurs."""

from __future__ import annotations

import atexit
import os
import shutil
import signal
import sys
import tempfile
from pathlib import Path

import pytest
import torch

# lm-eval and datasets read these once, at import: no network (conftest runs before any test module), and a throwaway cache, not the user's
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
if not os.environ.get("HF_HOME", "").startswith(tempfile.gettempdir()):
    os.environ["HF_HOME"] = tempfile.mkdtemp(prefix="dsv41-hf-")
    atexit.register(shutil.rmtree, os.environ["HF_HOME"], True)

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tests/checkpoints.py

# the test models are tiny: per-op overhead dominates, extra intra-op threads only add contention
torch.set_num_threads(1)

# Launched in the background without job control (`bash .ci/run &`), the suite starts with SIGINT ignored,
# and every command the interrupt tests start would inherit that and never see their Ctrl-C. A handler here
# (not an ignore) is reset to the default by exec, so the children's Python installs its KeyboardInterrupt.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session")
def tiny_args():
    from dsv41.model.config import preset

    return preset("tiny")


@pytest.fixture(scope="session")
def tiny_model(tiny_args):
    from dsv41.model.transformer import Transformer, init_random_

    model = Transformer(tiny_args)
    init_random_(model, seed=0)
    return model.eval().requires_grad_(False)


@pytest.fixture(scope="session")
def small_checkpoint(tmp_path_factory):
    """A complete official-layout checkpoint of the tiny model with its own small tokenizer."""
    from checkpoints import make_small_checkpoint

    return make_small_checkpoint(tmp_path_factory.mktemp("small") / "ckpt")


@pytest.fixture
def run_here():
    """run_here(*argv, input="", env=None, cwd=None): `dsv41 ARGV` in this process (tests/in_process.py)."""
    from in_process import run_dsv41

    return run_dsv41
