"""Shared fixtures: a tiny random V4.1 model in which every layer mode occurs."""

from __future__ import annotations

import os

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tests/checkpoints.py

# the test models are tiny: per-op overhead dominates, extra intra-op threads only add contention
torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session")
def tiny_args():
    from model.config import preset

    return preset("tiny")


@pytest.fixture(scope="session")
def tiny_model(tiny_args):
    from model.transformer import Transformer, init_random_

    model = Transformer(tiny_args)
    init_random_(model, seed=0)
    return model.eval().requires_grad_(False)


@pytest.fixture(scope="session")
def small_checkpoint(tmp_path_factory):
    """A complete official-layout checkpoint of the tiny model with its own small tokenizer."""
    from checkpoints import make_small_checkpoint

    return make_small_checkpoint(tmp_path_factory.mktemp("small") / "ckpt")
