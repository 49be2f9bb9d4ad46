"""Several engines in several processes (evals/engine_pool.py): the same outputs as one engine, token for
token; reported as they finish; a worker's failure stops the run with its error; small runs stay here."""

from __future__ import annotations

import pytest

from dsv41.evals.batch_generate import GenRequest, generate
from dsv41.evals.engine_pool import MIN_REQUESTS_PER_ENGINE, EnginePool, WorkerFailed, default_engines


@pytest.fixture(scope="module")
def small_ckpt(small_checkpoint):
    return small_checkpoint  # conftest.py's, which the other files of a test worker share


@pytest.fixture(scope="module")
def loaded(small_ckpt):
    from dsv41.model.checkpoint import load_model

    return load_model(small_ckpt)


def requests(tok, n):
    """Prompts of mixed lengths and lengths of reply, thinking (ends with <think>) and not, a stop string."""
    out = []
    for k in range(n):
        text = "Add: " + " ".join(str((k * 7 + j) % 10) for j in range(2 + k % 9))
        ids = tok.encode(text + (" <think>" if k % 2 else ""), allow_special=True)
        out.append(GenRequest(ids, max_new_tokens=4 + (k * 5) % 13, until=("\n\n",) if k % 3 == 0 else ()))
    return out


def same(a, b) -> bool:
    """The outputs equal but for engine_seconds (a timing)."""
    from dataclasses import replace

    return [replace(o, engine_seconds=0.0) for o in a] == [replace(o, engine_seconds=0.0) for o in b]


@pytest.fixture(scope="module")
def alone(loaded):
    """(requests, one engine's outputs): a run large enough to spread over two engines, computed once for the
    tests that compare a pool's run with it."""
    model, _, tok = loaded
    reqs = requests(tok, 2 * MIN_REQUESTS_PER_ENGINE + 3)
    return reqs, generate(model, tok, reqs, batch_size=4)


def test_two_engines_give_one_engines_outputs_token_for_token(loaded, small_ckpt, alone):
    from dsv41.model.engine import Generator

    model, _, tok = loaded
    reqs, alone = alone
    seen = []
    with EnginePool(Generator(model, tok), small_ckpt, engines=2, batch_size=4) as pool:
        pooled = generate(model, tok, reqs, batch_size=4, pool=pool, on_done=lambda i, o: seen.append(i))
        assert len(pool._procs) == 1  # the worker ran (and stays for the next run)
        again = pool.generate(reqs[:5], tok)  # a small run: this process only
    assert same(pooled, alone) and same(again, alone[:5])
    assert sorted(seen) == list(range(len(reqs)))  # each reported once


def test_workers_started_before_this_process_loads_its_checkpoint(loaded, small_ckpt, alone):
    """A pool made before the checkpoint is loaded here (generator None, its device named) starts its worker at
    once (`start`), then takes this process's engine (`attach`): the same outputs; `spreads` also takes a count.
    The run starts once the worker has loaded its checkpoint (`wait_ready`), so that the worker decodes part of
    it: a worker takes longer to start than this process takes to finish so small a run alone."""
    from dsv41.model.engine import Generator

    model, _, tok = loaded
    reqs, alone = alone
    with EnginePool(None, small_ckpt, engines=2, batch_size=4, device="cpu") as pool:
        assert pool.spreads(len(reqs)) and not pool.spreads(2 * MIN_REQUESTS_PER_ENGINE - 1)
        pool.start()
        pool.start()  # once
        assert len(pool._procs) == 1
        pool.attach(Generator(model, tok))
        pool.wait_ready()
        assert same(generate(model, tok, reqs, batch_size=4, pool=pool), alone)
        assert 0 < pool.from_workers < len(reqs)  # both engines decoded: the worker's tokens are one engine's
    with pytest.raises(ValueError, match="CPU only"):
        EnginePool(None, small_ckpt, engines=2, batch_size=4, device="cuda")


def test_a_failing_worker_stops_the_run_with_its_error(loaded, tmp_path):
    from dsv41.model.engine import Generator

    model, _, tok = loaded
    reqs = requests(tok, 2 * MIN_REQUESTS_PER_ENGINE)
    with EnginePool(Generator(model, tok), tmp_path / "no-such-checkpoint", engines=2, batch_size=4) as pool:
        with pytest.raises(WorkerFailed, match="engine worker 1 failed"):
            pool.generate(reqs, tok)
        assert pool._procs == []  # closed after the failure


def test_default_engines():
    assert default_engines("cuda") == 1
    assert 1 <= default_engines("cpu") <= 8
    with pytest.raises(ValueError):
        EnginePool(None, ".", engines=0, batch_size=1)


def test_generate_input_file_on_two_engines_writes_one_engines_replies(small_ckpt, tmp_path, run_here):
    """`dsv41 generate --input-file` spreads the file over the engines (its requests as the engine takes them,
    no hook or prefix cache): the same replies, in the file's order, as with one engine. The command runs in this
    process (`run_here`; its worker is a process of its own all the same), at DSV41_THREADS=1."""
    import json
    import os

    prompts = "\n\n".join(f"Add: {k} {k + 3} {2 * k % 7}" for k in range(2 * MIN_REQUESTS_PER_ENGINE + 1))
    (tmp_path / "in.txt").write_text(prompts + "\n")
    replies = {}
    for engines in (1, 2):
        r = run_here("generate", "--model", small_ckpt, "--input-file", tmp_path / "in.txt", "--max-new-tokens", 6,
                     "--temperature", 0, "--json", "--engines", engines, env={**os.environ, "DSV41_THREADS": "1"},
                     cwd=tmp_path)
        assert r.returncode == 0, r.stderr[-2000:]
        docs = [json.loads(line) for line in r.stdout.splitlines()]
        replies[engines] = [(d["prompt_tokens"], d["output_ids"], d["finish_reason"]) for d in docs]
    assert len(replies[1]) == 2 * MIN_REQUESTS_PER_ENGINE + 1 and replies[2] == replies[1]
