"""Shared fixtures: a tiny random V4.1 model in which every layer mode occurs."""

from __future__ import annotations

import os

import pytest
import torch

# keep tests deterministic and light on 2 cores
torch.set_num_threads(min(2, os.cpu_count() or 1))


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
