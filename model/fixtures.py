"""Checkpoint fixtures: random models written in the exact official layout (several shards, an index,
real FP8 + UE8M0 and packed-FP4 encodings, the Engram tables in shards of their own, DSpark and vision
tensors, config.json and tokenizer files), for tests and benchmarks.

* `write_official_fixture` builds `Transformer(args)` with `init_random_` (every tensor quantized into
  its storage format by `dsv41.model.formats`) and writes its state dict: a small checkpoint that loads and
  runs.
* `write_random_official` draws valid encodings byte by byte, one tensor at a time, without building
  the model: multi-GB checkpoints for converter benchmarks in seconds (the weights are noise).
"""

from __future__ import annotations

import math
import os
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch

from dsv41.model.checkpoint import expected_tensors, save_official
from dsv41.model.config import ModelArgs, preset

# a vision tower small enough for tests, with every tensor kind of the real one
TINY_VISION = dict(vision_n_layers=1, vision_dim=32, vision_n_heads=2, vision_inter_dim=32)


def fixture_args(vision: bool = True, **changes) -> ModelArgs:
    """`preset('tiny')` (every V4.1 layer mode, Engram, DSpark), optionally with the tiny vision tower."""
    args = preset("tiny")
    if vision:
        args = args.replace(**TINY_VISION)
    return args.replace(**changes) if changes else args


@lru_cache(maxsize=1)
def _tokenizer_json() -> str:
    """The bundled tokenizer with V4.1's token names, as a checkpoint would ship it."""
    from dsv41.model.tokenizer import load_tokenizer

    return load_tokenizer().backend.to_str()


def _tokenizer_dir() -> Path:
    from dsv41.model.tokenizer import bundled_tokenizer_path

    return bundled_tokenizer_path().parent  # its tokenizer_config.json


def write_official_fixture(dst: str | os.PathLike, args: ModelArgs | None = None, seed: int = 0,
                           n_shards: int = 4, tokenizer: bool = True) -> Path:
    """A random model of `args` (default: `fixture_args()`) in the official layout at `dst`:
    n_shards - (number of Engram tables) backbone shards plus one shard per Engram table."""
    from dsv41.model.transformer import Transformer, init_random_

    args = args or fixture_args()
    model = Transformer(args)
    init_random_(model, seed=seed)
    state = model.state_dict()
    return save_official(state, args, dst, n_shards=n_shards,
                         tokenizer_dir=_tokenizer_dir() if tokenizer else None,
                         tokenizer_json=_tokenizer_json() if tokenizer else None)


def random_tensor(name: str, shape: tuple[int, ...], dtype: str, rng: np.random.Generator) -> torch.Tensor:
    """Random values in a tensor's storage encoding: FP8 E4M3 bytes without the NaN codes, UE8M0
    scales between 2^-12 and 2^-2, any packed-FP4 byte, small normal bf16/fp32 values."""
    n = math.prod(shape)
    if dtype in ("F8_E4M3", "I8", "U8"):
        raw = np.frombuffer(bytearray(rng.bytes(n)), dtype=np.uint8)
        if dtype == "F8_E4M3":
            raw[(raw & 0x7F) == 0x7F] = 0  # 0x7F / 0xFF are NaN in E4M3
        torch_dtype = {"F8_E4M3": torch.float8_e4m3fn, "I8": torch.int8, "U8": torch.uint8}[dtype]
        return torch.from_numpy(raw).view(torch_dtype).view(shape)
    if dtype == "F8_E8M0":
        return torch.from_numpy(rng.integers(115, 126, n, dtype=np.uint8)).view(torch.float8_e8m0fnu).view(shape)
    if dtype in ("BF16", "F32"):
        values = torch.from_numpy(rng.standard_normal(n, dtype=np.float32)) * (0.02 if dtype == "BF16" else 0.1)
        return values.to(torch.bfloat16 if dtype == "BF16" else torch.float32).view(shape)
    raise ValueError(f"no random generator for {dtype} ({name})")


def write_random_official(dst: str | os.PathLike, args: ModelArgs, seed: int = 0, n_shards: int | None = None,
                          tokenizer: bool = True) -> Path:
    """A checkpoint of `args` with random encodings in every tensor, generated lazily while writing."""
    rng = np.random.default_rng(seed)
    tensors = {name: (lambda name=name, shape=shape, dtype=dtype: random_tensor(name, shape, dtype, rng))
               for name, (shape, dtype) in expected_tensors(args).items()}
    return save_official(tensors, args, dst, n_shards=n_shards,
                         tokenizer_dir=_tokenizer_dir() if tokenizer else None,
                         tokenizer_json=_tokenizer_json() if tokenizer else None)
