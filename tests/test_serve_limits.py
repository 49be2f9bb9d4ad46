"""`dsv41 serve`'s limits on a real server (one row, one queue place, an API key): 401 without the key,
429 with Retry-After past the bounded queue, a client that disconnects frees its slot, and SIGTERM
finishes the request in flight, refuses new ones and exits 0."""

from __future__ import annotations

import http.client
import json
import signal
import time

import pytest

from tests.test_serve import MODEL, Server

pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
KEY = "sk-serve-test"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def server():
    s = Server("--api-key", KEY, "--max-batch-size", "1", "--max-queue", "1", "--grace", "60")
    yield s
    s.stop()


def open_stream(server, max_tokens=400) -> http.client.HTTPConnection:
    """A streaming chat request whose first chunk has arrived (so the engine has taken it)."""
    host, port = server.base.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    conn.request("POST", "/v1/chat/completions", json.dumps({
        "model": MODEL, "messages": [{"role": "user", "content": "Add: 1 2 3 4 5 6 7 8 9"}], "max_tokens": max_tokens,
        "temperature": 0, "stream": True}), {"Content-Type": "application/json", **AUTH})
    response = conn.getresponse()
    assert response.status == 200
    assert response.readline().startswith(b"data: ")
    conn.stream = response
    return conn


def wait_health(server, until, seconds=30.0) -> dict:
    deadline = time.monotonic() + seconds
    while True:
        _, doc, _ = server.get("/health")
        if until(doc) or time.monotonic() > deadline:
            return doc
        time.sleep(0.05)


def test_api_key_is_required(server):
    status, doc, _ = server.get("/v1/models")
    assert status == 401 and doc["error"]["code"] == "invalid_api_key"
    status, _, _ = server.get("/v1/models", {"Authorization": "Bearer wrong"})
    assert status == 401
    status, doc, _ = server.get("/v1/models", AUTH)
    assert status == 200 and doc["data"][0]["id"] == MODEL
    status, doc, _ = server.get("/health")  # open: load balancers probe it without the key
    assert status == 200
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url, api_key="wrong", max_retries=0).models.list()


def test_past_the_queue_429_and_a_disconnect_frees_the_slot(server):
    first = open_stream(server)  # the one row
    second = open_stream(server)  # the one queue place (waits for the row)
    doc = wait_health(server, lambda d: d["running"] == 1 and d["waiting"] == 1)
    assert doc["inflight"] == 2
    status, doc, headers = server.post("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                                                                 "max_tokens": 2}, AUTH)
    assert status == 429 and doc["error"]["type"] == "rate_limit_error" and int(headers["retry-after"]) >= 1
    client = openai.OpenAI(base_url=server.url, api_key=KEY, max_retries=0)
    with pytest.raises(openai.RateLimitError):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    # both clients go away: their requests are cancelled in the engine, the row and the queue place freed
    first.close()
    second.close()
    doc = wait_health(server, lambda d: d["inflight"] == 0 and d["running"] == 0 and d["waiting"] == 0)
    assert (doc["inflight"], doc["running"], doc["waiting"]) == (0, 0, 0)
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Add: 1 2"}], max_tokens=3,
                                       temperature=0)
    assert r.usage.completion_tokens == 3


def test_a_plain_request_whose_client_leaves_is_cancelled(server):
    host, port = server.base.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    conn.request("POST", "/v1/chat/completions", json.dumps({
        "model": MODEL, "messages": [{"role": "user", "content": "Add: 9 9 9"}], "max_tokens": 2000, "temperature": 0}),
        {"Content-Type": "application/json", **AUTH})
    wait_health(server, lambda d: d["running"] == 1)
    conn.close()  # before any answer: the 2000 tokens are never generated
    doc = wait_health(server, lambda d: d["running"] == 0 and d["inflight"] == 0, seconds=10)
    assert doc["running"] == 0 and doc["inflight"] == 0


def test_sigterm_finishes_in_flight_refuses_new_and_exits_0(server):
    conn = open_stream(server, max_tokens=40)
    server.proc.send_signal(signal.SIGTERM)
    time.sleep(0.3)
    status = None
    try:
        status, _, _ = server.get("/health")
    except OSError:
        pass  # the listening socket is closed: refused outright
    assert status in (None, 503)
    body = conn.stream.read().decode()  # the stream in flight runs to its end
    chunks = [json.loads(line[6:]) for line in body.splitlines() if line.startswith("data: {")]
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length") and body.rstrip().endswith("data: [DONE]")
    assert server.proc.wait(30) == 0
