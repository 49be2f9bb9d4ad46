"""Checkpoints on disk: the official Hugging Face layout and our runtime layout (docs/convert.md).

Official layout (what DeepSeek publishes; spec/architecture.md §6)
    `config.json`, `model.safetensors.index.json` ({metadata.total_size, weight_map: name -> shard}),
    shards `model-000NN-of-000MM.safetensors`, tokenizer files. Tensor names are the inference names
    (`layers.{i}.attn.wq_a.weight`, ...). Dense linears are FP8 E4M3 with UE8M0 scales over 32x32
    blocks, routed experts packed E2M1 ("I8", two values per byte, low nibble first) with one UE8M0
    per 32 inputs, the two Engram tables FP8 rows with one UE8M0 per 32 values.

Runtime layout (what `dsv41 convert --to runtime` writes)
    `model{r}-mp{N}.safetensors` for ranks r < N, split by the rules of `NAME_MAP` (those of REF's
    parallel modules), `attn.wo_a` dequantized to bf16 with its block scales (as REF's convert does),
    routed experts in the chosen `--expert-dtype`; `official-scales.safetensors` keeps the dropped
    `wo_a` scales so `--to official` restores the original bytes; `runtime.json` records mp, the
    storage dtypes, each file's size and sha256 (resume verification) and the official shard layout;
    config.json and the tokenizer files are copied unchanged. Every other tensor keeps its stored
    dtype, including the one accepted deviation from the model's dtypes: ViT norm weights stored as
    BF16 (as in the release) instead of F32 (`accepted_dtypes`).

Everything is verified from the safetensors headers before any tensor data is read: a problem is a
`CheckpointError` whose one-line message names the file and the tensor. Then the values (`check_values`:
no NaN/inf, no NaN codes), for checkpoints up to LOAD_SCAN_BYTES on open, for any size with
`verify_checkpoint` (`convert --verify`). Conversion streams: pass-
through tensors (and row/column slices of them) are copied in bounded chunks with `pread`, so a 100 GB
Engram table never has to fit in memory; only tensors that change format (wo_a, converted experts)
are materialized, one at a time. Output goes to `DST.partial/` and is renamed to DST at the end;
finished files are journaled with their sha256, so `--resume` after any interruption (kill -9
included) reuses them and produces the same bytes.

Loading (`load_model`, `load_state_dict`, `load_rank_state`) memory-maps the files: tensors are views
of the page cache, read lazily, tensor by tensor, as the model touches them.

The modules, lowest first (each imports only those above it; none imports dsv41.model.parallel, which
depends on the name map, nor dsv41.model.ledger, which depends on the inventory):

    safetensors.py  headers, memory-mapped and chunked reads, pieces, streaming writes, sha256, value checks
    names.py        the one name map (legacy spellings, model-parallel splits), the inventory and its dtypes
    layout.py       what both layouts share: file names, detect_layout, load_args, the config check
    official.py     the official layout: open_official, its shards and index, save_official
    runtime.py      the runtime layout: open_runtime, tensors as pieces of the rank files
    plan.py         conversion plans (official <-> runtime) and the exact format changes they use
    runner.py       running a plan atomically and resumably; convert, verify_checkpoint
    load.py         loading: state dicts, one rank's part, a model in one process or as one rank

This package re-exports the public names of all of them, so `from dsv41.model.checkpoint import X` works
for every X it ever offered. Monkeypatch a module-level setting where it is read (e.g.
`dsv41.model.checkpoint.safetensors.LOAD_SCAN_BYTES`), not here.
"""

from dsv41.model.checkpoint.safetensors import (CHUNK_BYTES, LOAD_SCAN_BYTES, SCAN_CHUNK, ST_DTYPES,
                                                ST_NAMES, Bytes, CheckpointError, Columns, Computed, Header,
                                                InMemory, OutFile, OutTensor, Piece, Progress, Seq, TensorEntry,
                                                Zeros, check_values, itemsize, materialize, open_tensor,
                                                out_of_format, read_header, sha256_file, st_name, write_safetensors)
from dsv41.model.checkpoint.names import (COLS, EXPERTS, NAME_MAP, REPLICATED, ROWS, ROWS_PADDED, Part,
                                          accepted_dtypes, check_mp, expected_tensors, inventory_totals,
                                          model_dtype, official_name, parameter_inventory, part_shape, rank_part,
                                          rank_tensors, release_dtype, runtime_args, split_of, to_model_dtypes)
from dsv41.model.checkpoint.layout import (COPIED_FILES, EXPERT_DTYPES, INDEX_FILE, JOURNAL_FILE, MANIFEST_FILE,
                                           RUNTIME_FORMAT, RUNTIME_VERSION, SCALES_FILE, SINGLE_FILE, detect_layout,
                                           load_args, partial_dir)
from dsv41.model.checkpoint.official import OfficialCheckpoint, open_official, save_official
from dsv41.model.checkpoint.runtime import RuntimeCheckpoint, open_runtime, rank_file
from dsv41.model.checkpoint.plan import (FP4_GROUP, Plan, fp4_experts_to_fp8, fp4_experts_to_values,
                                         plan_conversion, plan_official, plan_runtime)
from dsv41.model.checkpoint.runner import THREADS_ENV, convert, execute, verify_checkpoint
from dsv41.model.checkpoint.load import (check_state_matches, fill_meta_model, load_model, load_rank,
                                         load_rank_model, load_rank_state, load_rank_weights, load_state_dict)

__all__ = [
    # safetensors
    "CHUNK_BYTES", "LOAD_SCAN_BYTES", "SCAN_CHUNK", "ST_DTYPES", "ST_NAMES", "Bytes", "CheckpointError",
    "Columns", "Computed", "Header", "InMemory", "OutFile", "OutTensor", "Piece", "Progress", "Seq", "TensorEntry",
    "Zeros", "check_values", "itemsize", "materialize", "open_tensor", "out_of_format", "read_header", "sha256_file",
    "st_name", "write_safetensors",
    # names
    "COLS", "EXPERTS", "NAME_MAP", "REPLICATED", "ROWS", "ROWS_PADDED", "Part", "accepted_dtypes", "check_mp",
    "expected_tensors", "inventory_totals", "model_dtype", "official_name", "parameter_inventory", "part_shape",
    "rank_part", "rank_tensors", "release_dtype", "runtime_args", "split_of", "to_model_dtypes",
    # layout
    "COPIED_FILES", "EXPERT_DTYPES", "INDEX_FILE", "JOURNAL_FILE", "MANIFEST_FILE", "RUNTIME_FORMAT",
    "RUNTIME_VERSION", "SCALES_FILE", "SINGLE_FILE", "detect_layout", "load_args", "partial_dir",
    # official, runtime
    "OfficialCheckpoint", "open_official", "save_official", "RuntimeCheckpoint", "open_runtime", "rank_file",
    # plan, runner
    "FP4_GROUP", "Plan", "fp4_experts_to_fp8", "fp4_experts_to_values", "plan_conversion", "plan_official",
    "plan_runtime", "THREADS_ENV", "convert", "execute", "verify_checkpoint",
    # load
    "check_state_matches", "fill_meta_model", "load_model", "load_rank", "load_rank_model", "load_rank_state",
    "load_rank_weights", "load_state_dict",
]
