"""Load test of `dsv41 serve`: N concurrent streaming clients with mixed prompt and reply lengths for a fixed
time, against a real server (a subprocess on a free loopback port), then the engine alone on the same kind
of workload in this process: the ceiling the server is measured against, in the same run.

What it checks and reports: every request sent ends exactly once, with an answer (the stream's finish
reason and [DONE]) or a clear error (an HTTP status with an OpenAI error object); completion ids are
unique (none duplicated); the server's RSS every second (a time series in the JSON, `--plot` draws it);
p50/p99 time to first token (first reasoning or content delta); the aggregate completion tokens/s; SIGTERM
at the end drains and exits 0.

Throughput against a ceiling. The server's rate is the tokens its engine committed (GET /health's
`tokens`) between `--warmup` seconds after the start and the end of the sending window, while the clients
keep it saturated. The ceiling: the engine's `Scheduler` (what `Generator.generate_many` runs) with the same
max_batch_size, in this process after the server has exited, fed the same kind of requests (the same
prompt and reply length distribution, the same prompts through serve/protocol.py's chat encoding, the same
sampling, a seed per request) and kept at `--clients` requests outstanding as the clients keep the server,
for `--ceiling-seconds`; its rate is measured over the same kind of window. `ratio` = server / engine.

The clients are coroutines of one asyncio loop speaking HTTP/1.1 on raw streams, with no thread per client
(the load generator shares the machine with the server); `--client-threads` runs the first run's client (a
thread per client, http.client) to compare: both cost well under 1% of a core here (NOTES.md).

    python -m benchmarks serve --json benchmarks/results/cpu-serve/serve.json [--clients 64] [--seconds 120]
        [--plot docs/img/serve-rss.png] [--server-env DSV41_SERVE_SWITCH_INTERVAL=0.001]
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import os
import random
import re
import resource
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
MODEL = "dsv41-tiny"


def start_server(args) -> tuple[subprocess.Popen, str, int]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    for kv in args.server_env:
        k, _, v = kv.partition("=")
        env[k] = v
    proc = subprocess.Popen([sys.executable, "-m", "dsv41_cli", "serve", "--port", "0", "--device", args.device,
                             "--max-batch-size", str(args.max_batch_size), "--max-queue", str(args.max_queue),
                             "--log-level", "warning"], stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
                            env=env)
    for line in proc.stderr:
        found = re.search(r"listening on http://([\d.]+):(\d+)/v1", line)
        if found:
            threading.Thread(target=lambda: [None for _ in proc.stderr], daemon=True).start()  # keep draining
            return proc, found.group(1), int(found.group(2))
    raise SystemExit("the server did not start")


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def cpu_seconds(pid: int) -> float:
    """user + system CPU seconds of a process (all its threads)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def thread_cpu_seconds(pid: int) -> dict[str, float]:
    """CPU seconds of each thread of a process, by name (the main thread, where uvicorn's event loop runs,
    is "main"; threads of one name summed)."""
    out: dict[str, float] = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                raw = f.read()
        except OSError:
            continue
        name = "main" if tid == str(pid) else raw[raw.index("(") + 1:raw.rindex(")")]
        fields = raw.rsplit(")", 1)[1].split()
        out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return out


def own_cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def workload(rng: random.Random) -> dict:
    """One chat request of the load: prompts of about 40 to 170 tokens, a quarter with a system message of
    filler words (much longer), max_tokens 16-128, thinking mode, temperature 0.6, its own seed."""
    digits = rng.choice([2, 4, 8, 16, 32, 64])
    filler = rng.choice([0, 0, 50, 150])
    messages = [{"role": "user", "content": "Add: " + " ".join(str(rng.randrange(10)) for _ in range(digits))}]
    if filler:
        messages.insert(0, {"role": "system", "content": " ".join(rng.choice(["alpha", "beta", "gamma", "delta"])
                                                                   for _ in range(filler))})
    return {"model": MODEL, "messages": messages, "max_tokens": rng.choice([16, 32, 64, 128]), "temperature": 0.6,
            "seed": rng.randrange(2**31), "stream": True, "stream_options": {"include_usage": True}}


def get_json(host, port, path) -> dict:
    conn = http.client.HTTPConnection(host, port, timeout=30)
    try:
        conn.request("GET", path)
        return json.loads(conn.getresponse().read())
    finally:
        conn.close()


# ------------------------------------------------------------------------------------------- asyncio clients
class _Events:
    """SSE events out of the body's bytes (which arrive in any cut)."""

    def __init__(self):
        self.buf = b""

    def feed(self, data: bytes) -> list[str]:
        self.buf += data
        *events, self.buf = self.buf.split(b"\n\n")
        return [e.decode() for e in events]


def _on_event(event: str, out: dict) -> bool:
    """One SSE event into the request's record; True at [DONE]."""
    for line in event.splitlines():
        if not line.startswith("data: "):
            continue
        if line == "data: [DONE]":
            return True
        chunk = json.loads(line[6:])
        if "error" in chunk:
            out.update(outcome="error", status=200, error=chunk["error"]["message"])
            return True
        out.setdefault("id", chunk["id"])
        if chunk.get("usage"):
            out["tokens"] = chunk["usage"]["completion_tokens"]
        for choice in chunk["choices"]:
            delta = choice["delta"]
            if "first" not in out and (delta.get("content") or delta.get("reasoning_content")):
                out["first"] = time.perf_counter()
            out["finish"] = choice.get("finish_reason") or out.get("finish")
    return False


async def one_request_async(host, port, body: dict) -> dict:
    out = {"max_tokens": body["max_tokens"], "sent": time.perf_counter()}
    writer = None
    try:
        reader, writer = await asyncio.open_connection(host, port)
        payload = json.dumps(body).encode()
        writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: %s:%d\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\nConnection: close\r\n\r\n" % (host.encode(), port, len(payload)) + payload)
        status = int((await reader.readline()).split()[1])
        headers = {}
        while (line := await reader.readline()) not in (b"\r\n", b""):
            k, _, v = line.decode().partition(":")
            headers[k.strip().lower()] = v.strip()
        if status != 200:
            doc = json.loads(await reader.read())
            out.update(outcome="error", status=status, error=doc["error"]["message"])
            return out
        events, done = _Events(), False
        chunked = headers.get("transfer-encoding") == "chunked"
        while not done:
            if chunked:
                size = int((await reader.readline()).strip() or b"0", 16)
                if size == 0:
                    break
                data = await reader.readexactly(size + 2)
                data = data[:-2]
            else:
                data = await reader.read(65536)
                if not data:
                    break
            for event in events.feed(data):
                if _on_event(event, out):
                    done = True
                    break
        if out.get("outcome") != "error":
            out["outcome"] = "answer" if done and out.get("finish") else "cut"
    except (OSError, asyncio.IncompleteReadError, ValueError, IndexError) as e:
        out.update(outcome="error", status=None, error=f"{type(e).__name__}: {e}")
    finally:
        out["ended"] = time.perf_counter()
        if writer is not None:
            writer.close()
    return out


async def run_clients_async(args, host, port, deadline, results):
    async def client(i):
        rng = random.Random(args.seed * 1000 + i)
        while time.perf_counter() < deadline:
            r = await asyncio.wait_for(one_request_async(host, port, workload(rng)), 900)
            results.append(r)
            if r["outcome"] == "error" and r.get("status") == 429:
                await asyncio.sleep(1.0)

    await asyncio.gather(*(client(i) for i in range(args.clients)))


# ------------------------------------------------------------------------------------------- thread clients
def one_request_blocking(host, port, body: dict) -> dict:
    """The first run's client (http.client in a thread per client), kept for --client-threads."""
    out = {"max_tokens": body["max_tokens"], "sent": time.perf_counter()}
    try:
        conn = http.client.HTTPConnection(host, port, timeout=600)
        conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
        r = conn.getresponse()
        if r.status != 200:
            doc = json.loads(r.read())
            out.update(outcome="error", status=r.status, error=doc["error"]["message"])
            return out
        done = False
        for raw in r:
            line = raw.decode().strip()
            if line.startswith("data: ") and _on_event(line, out):
                done = True
                break
        if out.get("outcome") != "error":
            out["outcome"] = "answer" if done and out.get("finish") else "cut"
    except OSError as e:
        out.update(outcome="error", status=None, error=f"{type(e).__name__}: {e}")
    finally:
        out["ended"] = time.perf_counter()
    return out


def run_clients_threads(args, host, port, deadline, results):
    lock = threading.Lock()

    def client(i):
        rng = random.Random(args.seed * 1000 + i)
        while time.perf_counter() < deadline:
            r = one_request_blocking(host, port, workload(rng))
            with lock:
                results.append(r)
            if r["outcome"] == "error" and r.get("status") == 429:
                time.sleep(1.0)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(args.clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


# ------------------------------------------------------------------------------------------- the engine alone
def engine_ceiling(args) -> dict:
    """The engine's Scheduler in this process (as Generator.generate_many runs it), the same max_batch_size,
    kept at `clients` requests outstanding for `ceiling_seconds`; committed tokens per second over the
    window [warmup, end of submitting], as the server's rate is measured."""
    import torch

    from dsv41.model.assets import bundled_model_dir
    from dsv41.model.checkpoint import load_model
    from dsv41.model.engine import GenerationConfig, Generator, Request, SamplingConfig, Scheduler
    from dsv41.serve.protocol import parse_chat

    from dsv41_cli.common import tune_threads

    model, margs, tok = load_model(bundled_model_dir(), device=args.device)
    tune_threads(margs, args.device)  # the server's intra-op threads (1 for the bundled model on the CPU)
    gen = Generator(model, tok)
    rng = random.Random(args.seed * 1000 + 999_999)  # the clients' distribution, other draws
    stamps: list[float] = []

    def request() -> Request:
        body = workload(rng)
        params = parse_chat({k: v for k, v in body.items() if k not in ("stream", "stream_options")}, MODEL)
        ids = tok.encode(params.prompt(), allow_special=True)
        s = params.sampling
        sampling = SamplingConfig(s.temperature, s.top_p, s.seed)
        config = GenerationConfig(max_new_tokens=body["max_tokens"], sampling=sampling, stop_ids=(tok.eos_id,))
        return Request(ids, config, None, lambda token: stamps.append(time.perf_counter()))

    cpu0 = own_cpu_seconds()
    with torch.inference_mode():
        scheduler = Scheduler(gen, args.max_batch_size, static_shapes=True)  # as serve/worker.py runs it
        for _ in range(args.clients):
            scheduler.submit(request())
        t0 = time.perf_counter()
        deadline = t0 + args.ceiling_seconds
        while scheduler.busy:
            for _ in scheduler.step():
                if time.perf_counter() < deadline:
                    scheduler.submit(request())
        t1 = time.perf_counter()
    start = t0 + min(args.warmup, args.ceiling_seconds / 4)
    window = [t for t in stamps if start <= t < deadline]
    return {"what": f"Scheduler(max_batch_size={args.max_batch_size}, static_shapes=True) in-process, {args.clients} requests "
                    f"outstanding for {args.ceiling_seconds:.0f} s",
            "window_s": round(deadline - start, 1), "window_tokens": len(window),
            "tokens_per_s": len(window) / (deadline - start), "total_tokens": len(stamps),
            "total_s": round(t1 - t0, 1), "cpu_s": round(own_cpu_seconds() - cpu0, 1),
            "torch_threads": torch.get_num_threads()}


def percentile(values, q):
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))] if values else None


def plot_rss(doc: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t, mib = zip(*doc["rss_mib"]["series"])
    fig, ax = plt.subplots(figsize=(7, 3.2))
    ax.plot(t, mib, lw=1.2)
    ax.axvline(doc["seconds_sending"], color="grey", ls="--", lw=0.8)
    ax.text(doc["seconds_sending"], min(mib), " clients stop sending", color="grey", fontsize=8, va="bottom")
    ax.set_xlabel("seconds since the clients started")
    ax.set_ylabel("server RSS (MiB)")
    ax.set_title(f"dsv41 serve, {doc['clients']} streaming clients, {doc['max_batch_size']} rows ({doc['date']})",
                 fontsize=9)
    ax.set_ylim(0, max(mib) * 1.1)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--clients", type=int, default=64)
    p.add_argument("--seconds", type=float, default=120.0, help="clients start new requests for this long")
    p.add_argument("--warmup", type=float, default=20.0, help="seconds left out of the start of the rate windows")
    p.add_argument("--ceiling-seconds", type=float, default=None, help="the engine-alone run (default: "
                   "--seconds, at most 90); 0: no ceiling")
    p.add_argument("--max-batch-size", type=int, default=32)
    p.add_argument("--max-queue", type=int, default=64)
    p.add_argument("--device", default="cpu")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--server-env", action="append", default=[], metavar="KEY=VALUE",
                   help="environment of the server process (repeatable)")
    p.add_argument("--client-threads", action="store_true", help="one thread per client (http.client) instead "
                   "of one asyncio loop")
    p.add_argument("--debug-memory", type=float, default=0.0, metavar="SECONDS",
                   help="start the server with DSV41_SERVE_DEBUG_MEMORY=1 and read GET /debug/memory this often")
    p.add_argument("--json", help="write the results here")
    p.add_argument("--plot", help="draw the RSS time series here (PNG)")
    p.add_argument("--quick", action="store_true", help="8 clients for 20 s, a 10-s ceiling")
    args = p.parse_args()
    if args.quick:
        args.clients, args.seconds = 8, 20.0
        args.ceiling_seconds = 10.0 if args.ceiling_seconds is None else args.ceiling_seconds
    if args.ceiling_seconds is None:
        args.ceiling_seconds = min(args.seconds, 90.0)
    if args.debug_memory:
        args.server_env.append("DSV41_SERVE_DEBUG_MEMORY=1")
    proc, host, port = start_server(args)
    samples: list[tuple[float, int]] = []
    stop_sampling = threading.Event()
    t0 = time.perf_counter()

    malloc: list[dict] = []  # the server's glibc counters (GET /health's "memory"), every 10 s

    def sample():
        n = 0
        while not stop_sampling.is_set():
            samples.append((time.perf_counter() - t0, rss_bytes(proc.pid)))
            if n % 10 == 0:
                try:
                    malloc.append({"t": round(time.perf_counter() - t0, 1),
                                   **get_json(host, port, "/health").get("memory", {})})
                except OSError:
                    pass
            n += 1
            stop_sampling.wait(1.0)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    results: list[dict] = []
    deadline = t0 + args.seconds
    warm = t0 + min(args.warmup, args.seconds / 4)
    marks = {}

    def mark(name, at):  # the server's token count and CPU time at the rate window's edges
        time.sleep(max(0.0, at - time.perf_counter()))
        health = get_json(host, port, "/health")
        marks[name] = (time.perf_counter(), health.get("tokens"), cpu_seconds(proc.pid), own_cpu_seconds(),
                       thread_cpu_seconds(proc.pid))

    memory_reports: list[dict] = []

    def poll_memory():
        while not stop_sampling.wait(args.debug_memory):
            try:
                memory_reports.append(get_json(host, port, "/debug/memory"))
            except OSError:
                return

    if args.debug_memory:
        threading.Thread(target=poll_memory, daemon=True).start()
    markers = [threading.Thread(target=mark, args=(n, at), daemon=True)
               for n, at in (("start", warm), ("end", deadline))]
    for m in markers:
        m.start()
    cpu_server0, cpu_clients0 = cpu_seconds(proc.pid), own_cpu_seconds()
    if args.client_threads:
        run_clients_threads(args, host, port, deadline, results)
    else:
        asyncio.run(run_clients_async(args, host, port, deadline, results))
    t1 = time.perf_counter()
    cpu_server, cpu_clients = cpu_seconds(proc.pid) - cpu_server0, own_cpu_seconds() - cpu_clients0
    for m in markers:
        m.join()
    stop_sampling.set()
    sampler.join()
    if args.debug_memory:  # all requests ended: what the allocator holds, and what a trim gives back
        memory_reports.append(get_json(host, port, "/debug/memory?trim=1"))
    proc.send_signal(signal.SIGTERM)
    exit_code = proc.wait(120)

    answers = [r for r in results if r["outcome"] == "answer"]
    errors = [r for r in results if r["outcome"] == "error"]
    cut = [r for r in results if r["outcome"] == "cut"]
    ids = [r["id"] for r in results if "id" in r]
    ttft = [r["first"] - r["sent"] for r in answers if "first" in r]
    tokens = sum(r.get("tokens", 0) for r in answers)
    (ws, tok_s, srv_s, cli_s, thr_s), (we, tok_e, srv_e, cli_e, thr_e) = marks["start"], marks["end"]
    threads_cpu = {k: round(v - thr_s.get(k, 0.0), 1) for k, v in thr_e.items() if v - thr_s.get(k, 0.0) >= 0.05}
    series = [(round(t, 1), round(b / 2**20, 1)) for t, b in samples]

    def max_between(a, b):
        got = [m for t, m in series if a <= t < b]
        return max(got) if got else None

    span = t1 - t0
    doc = {
        "date": time.strftime("%Y-%m-%d"), "clients": args.clients, "client_kind": "threads" if args.client_threads
        else "asyncio", "seconds_sending": args.seconds, "seconds": round(span, 1),
        "max_batch_size": args.max_batch_size, "max_queue": args.max_queue, "server_env": args.server_env,
        "requests": len(results), "answers": len(answers), "errors": len(errors),
        "cut_streams": len(cut), "error_kinds": sorted({f"{r.get('status')}: {r.get('error', '')[:80]}" for r in errors}),
        "unique_ids": len(set(ids)), "ids": len(ids),
        "finish_reasons": {f: sum(r.get("finish") == f for r in answers) for f in ("stop", "length")},
        "ttft_s": {"p50": percentile(ttft, 0.5), "p99": percentile(ttft, 0.99), "max": max(ttft) if ttft else None},
        "completion_tokens": tokens, "aggregate_tokens_per_s": tokens / span,
        "server_window": {"s": round(we - ws, 1), "tokens": tok_e - tok_s, "tokens_per_s": (tok_e - tok_s) / (we - ws),
                          "server_cpu_s": round(srv_e - srv_s, 1), "server_threads_cpu_s": threads_cpu,
                          "client_cpu_s": round(cli_e - cli_s, 1)},
        "cpu_s": {"server": round(cpu_server, 1), "clients": round(cpu_clients, 1)},
        "rss_mib": {"start": series[0][1], "max": max(m for _, m in series), "samples": len(series),
                    "max_by_quarter_of_sending": [max_between(args.seconds * q / 4, args.seconds * (q + 1) / 4)
                                                  for q in range(4)],
                    "series": series, "server_memory_every_10s": malloc},
        "server_exit_code": exit_code,
    }
    if memory_reports:
        doc["debug_memory"] = memory_reports
    doc["every_request_ended_once"] = (len(answers) + len(errors) == len(results) and not cut
                                       and len(set(ids)) == len(ids))
    if args.ceiling_seconds > 0:
        doc["engine_alone"] = engine_ceiling(args)
        doc["ratio_server_to_engine"] = doc["server_window"]["tokens_per_s"] / doc["engine_alone"]["tokens_per_s"]
    brief = {k: v for k, v in doc.items() if k != "rss_mib"}
    brief["rss_mib"] = {k: v for k, v in doc["rss_mib"].items() if k != "series"}
    print(json.dumps(brief, indent=2))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(doc, indent=1) + "\n")
    if args.plot:
        plot_rss(doc, args.plot)
    return 0 if doc["every_request_ended_once"] and exit_code == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
