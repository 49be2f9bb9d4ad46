"""Tensor and expert parallelism (model/parallel.py): two gloo processes on 127.0.0.1 must compute
what one process computes.

The multi-process tests launch torchrun (as users do) in a process group of their own, with a hard
timeout that kills the whole group, so a hung collective can never hang the test run. The worker
side of the library test is this file run as a script (`python tests/test_parallel.py ...`).
"""

from __future__ import annotations

import json
import math
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent
TIMEOUT_S = 240  # generous for a loaded 2-core machine; a healthy run takes well under a minute

# long enough that the window (8), the indexer Top-K (4) and the candidate pool (2 blocks of 4) all bite
PROMPT = [0, 5, 77, 200, 31, 9, 100, 4, 8, 15, 16, 23, 42, 99, 300, 1, 2, 3, 250, 11, 64, 65, 66, 400, 12, 13, 14]
PAIRS = [([0, 5, 77, 200, 31, 9], [100, 4, 8]), ([3, 250, 11, 64, 65, 66, 400, 12, 13, 14, 7, 8], [15]),
         ([0, 1], [2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17])]
TEXT = "Tensor parallel ranks must agree on every token, byte for byte. Ünïcödé too."
REQUESTS = [("Hello", " world"), ("The sky", " is blue"), ("Ice", " is cold"), ("", "Ice")]  # lm-eval's


# ---------------------------------------------------------------------------------- the scenario
def scenario(model, tokenizer) -> dict:
    """Everything compared between one process and two: logits of a padded batch, log-likelihoods of
    (context, continuation) pairs, bits per byte of a text, greedy generation (whole and chunked
    prefill), DSpark speculative generation, and seeded sampling."""
    from dsv41.model.engine import GenerationConfig, Generator, SamplingConfig

    out = {}
    with torch.inference_mode():
        batch = torch.tensor([PROMPT, PROMPT[5:] + [2] * 5])
        out["logits"] = model(batch, all_logits=True)
        lls = []
        for ctx, cont in PAIRS:
            ids = torch.tensor([ctx + cont])
            logp = torch.log_softmax(model(ids, all_logits=True)[0, len(ctx) - 1:-1].double(), dim=-1)
            picked = logp.gather(-1, torch.tensor(cont).unsqueeze(-1)).squeeze(-1)
            lls.append((float(picked.sum()), bool((logp.argmax(-1) == torch.tensor(cont)).all())))
        out["loglikelihoods"] = lls
        ids = tokenizer.encode(TEXT)
        logp = torch.log_softmax(model(torch.tensor([ids]), all_logits=True)[0, :-1].double(), dim=-1)
        nll_bits = -float(logp.gather(-1, torch.tensor(ids[1:]).unsqueeze(-1)).sum()) / math.log(2)
        out["bpb"] = nll_bits / len(tokenizer.decode(ids[1:]).encode("utf-8"))  # the first token is not predicted
    # the same through evals/bpb.py, which `dsv41 bpb` and the lm-eval adapter use: right-padded batches
    # run through the KV cache in chunks of 8 positions
    from dsv41.evals.bpb import bits_per_byte, rolling_windows, score_sequences

    chunked = dict(pad_id=tokenizer.pad_id, batch_size=2, max_logits_bytes=2 * 8 * model.args.vocab_size * 4)
    scored = score_sequences(model, [c + x for c, x in PAIRS], [len(x) for _, x in PAIRS], **chunked)
    out["scored_pairs"] = [(s.logprob, s.greedy) for s in scored]
    windows = list(rolling_windows(ids, tokenizer.bos_id, 16, 8))
    scored = score_sequences(model, [w for w, _ in windows], [n for _, n in windows], **chunked)
    out["bpb_rolling"] = bits_per_byte(-sum(s.logprob for s in scored), len(TEXT.encode("utf-8")))
    engine = Generator(model, tokenizer)
    greedy = GenerationConfig(max_new_tokens=16, stop_ids=())
    out["greedy"] = engine.generate(PROMPT, greedy).output_ids
    out["greedy_chunked"] = engine.generate(PROMPT, GenerationConfig(max_new_tokens=16, stop_ids=(), prefill_chunk=5)).output_ids
    out["dspark"] = engine.generate(PROMPT, GenerationConfig(max_new_tokens=16, stop_ids=(), dspark=True)).output_ids
    sampled = GenerationConfig(max_new_tokens=16, stop_ids=(), sampling=SamplingConfig(temperature=1.0, seed=5))
    out["sampled"] = engine.generate(PROMPT, sampled).output_ids
    return out


def worker(whole_dir: str, split_dir: str, out_dir: str) -> None:
    """One rank (run under torchrun): the scenario on the model loaded from the --mp 2 checkpoint, the
    logits of the whole model split in memory, and the context's helpers."""
    from dsv41.model import parallel
    from dsv41.model.checkpoint import load_model

    ctx = parallel.init_from_env("cpu")
    model, _, tokenizer = parallel.load_model_parallel(split_dir, "cpu", ctx)
    result = scenario(model, tokenizer)
    result["n_params"] = sum(p.numel() for p in model.parameters())

    whole, _, _ = load_model(whole_dir)
    parallel.apply_tensor_parallel(whole, ctx.rank, ctx.world)
    with torch.inference_mode():
        result["split_in_memory_logits"] = whole(torch.tensor([PROMPT]), all_logits=True)

    result["seed"] = ctx.same_seed(None)
    result["on_main"] = ctx.on_main(lambda: f"read by rank {ctx.rank}")
    try:
        ctx.on_main(lambda: (_ for _ in ()).throw(ValueError("bad input on rank 0")))
        result["error"] = None
    except ValueError as e:
        result["error"] = str(e)
    data_parallel = parallel.ParallelContext(ctx.rank, ctx.world, tp=1)  # two model copies of one rank each
    mine = data_parallel.share(range(7))
    result["share"] = mine
    result["gathered"] = data_parallel.gather([x * 10 for x in mine])
    result["split_work"] = data_parallel.split_work(range(7), lambda xs: [x * x for x in xs])
    try:  # item 3 fails in copy 1 only: both copies must raise it (not wait for each other)
        data_parallel.split_work(range(4), lambda xs: [x // (x - 3) for x in xs])
        result["split_error"] = None
    except ZeroDivisionError as e:
        result["split_error"] = type(e).__name__
    result.update(adapter_scenario(model, tokenizer, ctx, Path(out_dir) / "cache"))
    print(f"rank {ctx.rank} says hello on stdout")
    torch.save(result, Path(out_dir) / f"rank{ctx.rank}.pt")


def adapter_scenario(model, tokenizer, ctx, cache: Path) -> dict:
    """The lm-eval adapter (evals/lm_eval_model.py) on every rank: log-likelihoods of REQUESTS, the
    same answered from the request cache (which rank 0 alone keeps) with scoring disabled, and
    different requests on the two ranks (which must raise on both, not hang). Empty without lm-eval."""
    try:
        from lm_eval.api.instance import Instance

        import dsv41.evals.lm_eval_model as M
    except ImportError:
        return {}

    def ask(lm, pairs):
        return lm.loglikelihood([Instance(request_type="loglikelihood", doc={}, arguments=p, idx=0) for p in pairs])

    out = {}
    lm = M.DSV41LM(model=model, tokenizer=tokenizer, ctx=ctx, batch_size=2)
    lm.open_request_cache(str(cache))
    out["adapter"] = ask(lm, REQUESTS)
    lm.close_request_cache()
    scoring, M.score_sequences = M.score_sequences, None  # a rank that scored now would fail
    try:
        lm.open_request_cache(str(cache))
        out["adapter_cached"] = ask(lm, REQUESTS)
        lm.close_request_cache()
    finally:
        M.score_sequences = scoring
    try:
        ask(lm, REQUESTS[ctx.rank:])
        out["adapter_mismatch"] = None
    except RuntimeError as e:
        out["adapter_mismatch"] = str(e)
    return out


# ---------------------------------------------------------------------------------- launching
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(nproc: int, *argv: str, stdin: str | None = None, env: dict | None = None) -> subprocess.CompletedProcess:
    """`torchrun --nproc-per-node nproc ARGV` on 127.0.0.1 with gloo; killed (all ranks) on timeout.
    env: variables added to this process's environment (e.g. DSV41_TP)."""
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", DSV41_DIST_TIMEOUT="120", **(env or {}))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", str(nproc),
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()), *argv]
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(stdin, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        pytest.fail(f"torchrun did not finish in {TIMEOUT_S} s:\n{stderr[-3000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)


@pytest.fixture(scope="module")
def small_checkpoint(tmp_path_factory) -> Path:
    """The tiny model with random weights and a 512-token byte-level tokenizer, official layout."""
    from checkpoints import make_small_checkpoint

    return make_small_checkpoint(tmp_path_factory.mktemp("parallel") / "official")


@pytest.fixture(scope="module")
def split_checkpoint(small_checkpoint, tmp_path_factory) -> Path:
    """The small checkpoint converted for two ranks (`dsv41 convert --mp 2`)."""
    from dsv41.model.checkpoint import convert

    dst = tmp_path_factory.mktemp("mp2") / "mp2"
    convert(small_checkpoint, dst, mp=2)
    return dst


# ---------------------------------------------------------------------------------- tests
def test_the_split_is_the_checkpoints_split(split_checkpoint):
    """apply_tensor_parallel on a whole model keeps, for each rank, exactly the tensors (names, shapes,
    bytes) of that rank's file written by `convert --mp 2`."""
    from dsv41.model import parallel
    from dsv41.model.checkpoint import load_model, load_rank_state

    for rank in range(2):
        model, _, _ = load_model(split_checkpoint)  # the whole model, assembled from both rank files
        parallel.apply_tensor_parallel(model, rank, 2)
        mine = model.state_dict()
        theirs = load_rank_state(split_checkpoint, rank, 2)
        assert set(mine) == set(theirs)
        for name, t in theirs.items():
            assert mine[name].shape == t.shape and mine[name].dtype == t.dtype, name
            assert torch.equal(mine[name].view(torch.uint8), t.view(torch.uint8)), name
        experts = [n for n in mine if n.startswith("layers.2.ffn.experts.") and n.endswith("w1.weight")]
        assert experts == [f"layers.2.ffn.experts.{e}.w1.weight" for e in (2 * rank, 2 * rank + 1)]


def test_a_model_split_over_two_gloo_processes_computes_what_one_process_does(small_checkpoint, split_checkpoint,
                                                                            tmp_path):
    from dsv41.model import parallel
    from dsv41.model.checkpoint import load_model

    r = torchrun(2, str(Path(__file__)), str(small_checkpoint), str(split_checkpoint), str(tmp_path))
    assert r.returncode == 0, r.stderr[-4000:]
    assert r.stdout.count("says hello") == 1 and "rank 0 says hello" in r.stdout  # rank 0 owns the console
    ranks = [torch.load(tmp_path / f"rank{i}.pt") for i in range(2)]

    model, _, tokenizer = load_model(small_checkpoint)
    ref = scenario(model, tokenizer)
    whole_params = sum(p.numel() for p in model.parameters())
    for res in ranks:
        assert res["n_params"] < 0.75 * whole_params  # each rank really holds only part of the model
        scale = ref["logits"].abs().max()
        assert (res["logits"] - ref["logits"]).abs().max() <= 1e-3 * scale
        with torch.inference_mode():
            ref_prompt = model(torch.tensor([PROMPT]), all_logits=True)
        assert (res["split_in_memory_logits"] - ref_prompt).abs().max() <= 1e-3 * scale
        for (ll, greedy), (ref_ll, ref_greedy) in zip(res["loglikelihoods"], ref["loglikelihoods"]):
            assert ll == pytest.approx(ref_ll, abs=1e-3, rel=1e-4) and greedy == ref_greedy
        for (ll, greedy), (ref_ll, ref_greedy) in zip(res["scored_pairs"], ref["scored_pairs"]):
            assert ll == pytest.approx(ref_ll, abs=1e-3, rel=1e-4) and greedy == ref_greedy
        assert res["bpb"] == pytest.approx(ref["bpb"], rel=1e-4)
        assert res["bpb_rolling"] == pytest.approx(ref["bpb_rolling"], rel=1e-4)
        for key in ("greedy", "greedy_chunked", "dspark"):
            assert res[key] == ref[key], key
    # the ranks agree exactly with each other, sampling included, and on what rank 0 handed them
    assert torch.equal(ranks[0]["logits"], ranks[1]["logits"])
    assert ranks[0]["sampled"] == ranks[1]["sampled"]
    assert ranks[0]["seed"] == ranks[1]["seed"] is not None
    assert ranks[0]["on_main"] == ranks[1]["on_main"] == "read by rank 0"
    assert ranks[0]["error"] == ranks[1]["error"] == "bad input on rank 0"
    # two one-rank model copies: the items are dealt out round robin, gather restores the order
    assert ranks[0]["share"] == [0, 2, 4, 6] and ranks[1]["share"] == [1, 3, 5]
    assert ranks[0]["gathered"] == ranks[1]["gathered"] == [x * 10 for x in range(7)]
    assert ranks[0]["split_work"] == ranks[1]["split_work"] == [x * x for x in range(7)]
    assert ranks[0]["split_error"] == ranks[1]["split_error"] == "ZeroDivisionError"
    assert ref["greedy"] != ref["greedy"][:1] * 16  # the scenario exercises real, varied output
    # the lm-eval adapter: the one-process answers; from rank 0's cache alike on both ranks; and
    # different requests on the two ranks raise on both
    expected = adapter_scenario(model, tokenizer, parallel.current(), tmp_path / "one" / "cache").get("adapter")
    if expected is not None:
        for res in ranks:
            for key in ("adapter", "adapter_cached"):
                for (ll, greedy), (ref_ll, ref_greedy) in zip(res[key], expected, strict=True):
                    assert ll == pytest.approx(ref_ll, abs=1e-3, rel=1e-4) and greedy == ref_greedy
            assert "different loglikelihood requests" in res["adapter_mismatch"]
        assert (tmp_path / "cache_rank0.db").is_file()


def test_torchrun_generate_on_two_ranks_matches_one_process(small_checkpoint, split_checkpoint, tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Hello there\n\nWhat is two plus two?\n", encoding="utf-8")
    flags = ["--input-file", str(prompts), "--mode", "chat", "--temperature", "0", "--max-new-tokens", "10", "--json"]
    r = torchrun(2, "-m", "dsv41_cli", "generate", "--model", str(split_checkpoint), *flags)
    assert r.returncode == 0, r.stderr[-4000:]
    docs = [json.loads(line) for line in r.stdout.splitlines() if line.strip()]
    assert len(docs) == 2  # printed once, by rank 0
    one = subprocess.run([sys.executable, "-m", "dsv41_cli", "generate", "--model", str(small_checkpoint), *flags],
                         cwd=REPO, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert one.returncode == 0, one.stderr
    ref = [json.loads(line) for line in one.stdout.splitlines() if line.strip()]
    assert [d["output_ids"] for d in docs] == [d["output_ids"] for d in ref]
    assert [d["prompt_tokens"] for d in docs] == [d["prompt_tokens"] for d in ref]


def test_a_ranks_split_layers_keep_their_forward_in_the_decode_step(tiny_model):
    """The CPU decode step's fused host calls (host.attention_output, host.indexer_decode) compute a module's product
    in place of its forward. A rank's row-parallel wo_b and head-parallel indexer sum over the ranks in theirs, so
    they answer None, and the step runs them: with the host cache of wo_b made, as a forward makes it, and the
    attention output's shape the fused call takes (one group of 32 channels, whole FP8 blocks)."""
    import copy

    from dsv41.model import parallel
    from dsv41.model.block import SharedState

    model = parallel.apply_tensor_parallel(copy.deepcopy(tiny_model), 0, 2)
    attn = model.layers[2].attn
    with torch.inference_mode():
        attn.wo_b.dequantized_weight()
        assert attn.wo_b._dequantized[3] is not None and (attn.n_groups * attn.o_lora_rank) % attn.wo_b.block == 0
        assert attn.wo_b.host_matrix() is None
        assert type(attn.wo_a).host_matrix is parallel.Linear.host_matrix  # the plain layers keep theirs
        indexer = attn.indexer
        assert isinstance(indexer, parallel.HeadParallelIndexer)
        assert indexer._host_select(torch.zeros(1, 1, model.args.dim), None, None, None, None, SharedState()) is None


@pytest.mark.process
def test_torchrun_interactive_reads_stdin_on_rank_0(split_checkpoint):
    r = torchrun(2, "-m", "dsv41_cli", "generate", "--interactive", "--model", str(split_checkpoint), "--mode", "chat",
                 "--temperature", "0", "--max-new-tokens", "4", stdin="Hello\n/exit\n")
    assert r.returncode == 0, r.stderr[-4000:]
    assert r.stderr.count("tokens/s") + r.stderr.count("tok/s") >= 1
    assert r.stderr.count("/exit to quit") == 1  # the banner comes from rank 0 only


def test_memory_plan_counts_the_rank_files_and_the_cache(split_checkpoint, tiny_model):
    from dsv41.model import parallel
    from dsv41.model.checkpoint import load_args, load_rank_state

    args = load_args(split_checkpoint)
    plan = parallel.memory_plan(args, 2, context=40, batch=2)
    for rank in range(2):
        held = sum(t.nbytes for t in load_rank_state(split_checkpoint, rank, 2).values())
        assert plan["ranks"][rank]["param_bytes"] == held
    # the KV figure is what a real cache stores after 40 tokens of 2 sequences
    with torch.inference_mode():
        cache = tiny_model.new_cache(2)
        tiny_model(torch.randint(0, 512, (2, 40)), cache=cache)
    stored = cache.storage_bytes()
    assert plan["kv"] == {"main": stored["main"], "index_keys": stored["index_keys"], "window": stored["window"],
                          "total": stored["main"] + stored["index_keys"] + stored["window"]}
    assert plan["max_rank_bytes"] == max(r["param_bytes"] for r in plan["ranks"]) + plan["kv_bytes_per_rank"]


def run_cli(capsys, *argv) -> tuple[int, str, str]:
    from dsv41_cli.app import main

    with pytest.raises(SystemExit) as exit_info:
        main([str(a) for a in argv])
    captured = capsys.readouterr()
    return exit_info.value.code, captured.out, captured.err


def test_info_mp_reports_per_rank_bytes(capsys):
    code, stdout, stderr = run_cli(capsys, "info", "--config", "tiny", "--mp", "2", "--context", "64", "--batch", "3",
                                   "--json")
    assert code == 0, stderr
    doc = json.loads(stdout)
    assert {"params", "activated", "layers", "kv"} <= set(doc)  # the existing fields stay
    par = doc["parallel"]
    assert par["mp"] == 2 and par["context"] == 64 and par["batch"] == 3 and len(par["ranks"]) == 2
    assert all(r["param_bytes"] > 0 and r["kv_bytes"] == par["kv_bytes_per_rank"] for r in par["ranks"])
    code, stdout, stderr = run_cli(capsys, "info", "--config", "tiny", "--mp", "3")
    assert code == 2 and stdout == "" and len(stderr.strip().splitlines()) == 1 and "--mp 3" in stderr
    code, _, _ = run_cli(capsys, "info", "--config", "tiny")
    assert code == 0
    code, stdout, _ = run_cli(capsys, "info", "--config", "tiny", "--json")
    assert "parallel" not in json.loads(stdout)  # only when asked for


if __name__ == "__main__":  # a rank of the library test, under torchrun
    sys.path.insert(0, str(REPO))
    worker(*sys.argv[1:4])
