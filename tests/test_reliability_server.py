"""The HTTP server under load, slow clients and malformed requests, against a real server (uvicorn) on
127.0.0.1: 64 concurrent clients lose nothing, a connection over the cap gets 429, requests that do not
arrive in time get 408, a client that stops reading is dropped after the write deadline, every error is JSON
in OpenAI's shape with the right status, and a client that resets is one log line."""

from __future__ import annotations

import http.client
import json
import socket
import struct
import threading
import time

import pytest
import torch

from prunus.models import Transformer, get_preset, save_model
from prunus.serve import Engine
from prunus.serve.http_access import ServeAccess
from prunus.serve.http_server import CompletionServer


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    torch.manual_seed(0)
    model = Transformer(get_preset("tiny"))
    model.init_weights()
    path = save_model(model.eval(), tmp_path_factory.mktemp("srv") / "model", stage="test")
    with Engine.load(path, max_batch=8, max_queue=64) as engine:
        yield engine


def start(engine, **kwargs) -> CompletionServer:
    kwargs.setdefault("access", ServeAccess(allowed_hosts=("x",)))  # the raw requests below say "Host: x"
    server = CompletionServer(engine, port=0, **kwargs)
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    return server


@pytest.fixture
def server(engine):
    server = start(engine, header_timeout=1.0, body_timeout=1.0)
    yield server
    server.shutdown()
    server.server_close()


def exchange(server, raw: bytes, *, chunks: list[tuple[float, bytes]] = (), timeout: float = 20):
    """Send ``raw`` (then each delayed chunk) on a new connection; (status, headers, body bytes, seconds)."""
    t0 = time.monotonic()
    with socket.create_connection(server.server_address[:2], timeout=timeout) as s:
        s.sendall(raw)
        for delay, data in chunks:
            time.sleep(delay)
            try:
                s.sendall(data)
            except OSError:
                break
        data = b""
        while True:
            try:
                part = s.recv(65536)
            except (ConnectionResetError, socket.timeout):
                break
            if not part:
                break
            data += part
            head, sep, body = data.partition(b"\r\n\r\n")
            if sep and b"content-length:" in head.lower():
                n = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
                if len(body) >= n:
                    break
    elapsed = time.monotonic() - t0
    if not data:
        return None, {}, b"", elapsed
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    return int(lines[0].split()[1]), headers, body, elapsed


def post(path: str, body: bytes, extra: str = "") -> bytes:
    """A raw POST; a JSON object body names the served model, the dir's name (``model`` is required), unless it
    names one."""
    if body.startswith(b'{"') and b'"model"' not in body:
        body = b'{"model": "model", ' + body[1:]
    return (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n"
            f"{extra}\r\n").encode() + body


def nested(depth: int) -> bytes:
    return b'{"prompt": "x", "stop": ' + b"[" * depth + b"]" * depth + b"}"


POST_JSON = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
MALFORMED = [  # (raw request, status, words in the message)
    (post("/v1/completions", b'{"prompt": "\\ud800 x", "max_tokens": 2}'), 400, "lone surrogate"),
    (post("/v1/completions", b'{"prompt": "x", "seed": 18446744073709551616}'), 400, "beyond 64 bits"),
    (post("/v1/completions", b'{"prompt": "x", "seed": -9223372036854775809}'), 400, "'seed'"),
    (post("/v1/completions", b'{"prompt": "x", "max_tokens": 1' + b"0" * 5000 + b"}"), 400, "not valid JSON"),
    (post("/v1/completions", b'{"prompt": "x", "top_k": 1' + b"0" * 30 + b"}"), 400, "beyond 64 bits"),
    (post("/v1/completions", nested(100_000)), 400, "nested deeper"),
    (post("/v1/completions", nested(40)), 400, "nested deeper"),
    (post("/v1/completions", b'{"prompt": "x", "temperature": NaN}'), 400, "not valid JSON"),
    (post("/v1/completions", b'{"prompt": "\xff\xfe"}'), 400, "not UTF-8"),
    (post("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\udc00"}]}'), 400, "lone surrogate"),
    (POST_JSON + b"Content-Length: -5\r\n\r\n", 400, "negative"),
    (POST_JSON + b"Content-Length: five\r\n\r\n", 400, "Content-Length"),
    (POST_JSON + b"\r\n", 411, "Content-Length"),
    (POST_JSON + b"Content-Length: 99999999\r\n\r\n", 413, "larger than"),
    (b"PUT /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}", 405, "not allowed"),
    (b"DELETE /v1/completions HTTP/1.1\r\nHost: x\r\n\r\n", 405, "not allowed"),
    (b"BREW /pot HTTP/1.1\r\nHost: x\r\n\r\n", 501, "not supported"),
    (b"GARBAGE\r\n\r\n", 400, "Bad request"),
    (b"GET /nowhere HTTP/1.1\r\nHost: x\r\n\r\n", 404, "no route"),
    (b"GET /health HTTP/1.1\r\n" + b"".join(b"X-%d: y\r\n" % i for i in range(120)) + b"\r\n", 431, "Too many headers"),
]


def test_malformed_requests_get_json_errors_with_the_right_status(server, capfd):
    for raw, status, words in MALFORMED:
        got, headers, body, _ = exchange(server, raw)
        assert got == status, (raw[:80], got, body[:300])
        assert headers.get("content-type") == "application/json", (raw[:80], headers)
        error = json.loads(body)["error"]
        assert set(error) == {"message", "type", "param", "code"} and words in error["message"], (raw[:80], error)
    got, _, body, _ = exchange(server, post("/v1/completions", b'{"prompt": "x", "max_tokens": 2, "seed": 5}'))
    assert got == 200 and json.loads(body)["choices"][0]["finish_reason"] in ("length", "stop")
    assert "Traceback" not in capfd.readouterr().err


SLOW = [  # (what the client sends, then chunks with delays): each must end in 408 within the deadline
    ("headers never finished", b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n", []),
    ("headers trickled a byte at a time", b"P", [(0.25, c.encode()) for c in "OST /v1/completions HTTP/1.1\r\n"]),
    ("body never finished", post("/v1/completions", b'{"prompt": "x"}')[:-5], []),
]


@pytest.mark.parametrize("raw, chunks", [s[1:] for s in SLOW], ids=[s[0] for s in SLOW])
def test_slow_requests_get_408(server, raw, chunks):
    got, headers, body, elapsed = exchange(server, raw, chunks=chunks)
    assert got == 408, (got, body)
    assert json.loads(body)["error"]["type"] == "timeout_error" and headers.get("connection") == "close"
    assert elapsed < 5


def test_an_idle_connection_is_closed_without_an_answer(server):
    got, _, _, elapsed = exchange(server, b"")
    assert got is None and elapsed < 5


def _client(server, results: list, i: int, n: int) -> None:
    for j in range(n):
        conn = http.client.HTTPConnection(*server.server_address[:2], timeout=120)
        try:
            conn.request("POST", "/v1/completions", json.dumps({"model": "model", "prompt": f"{i} {j}", "max_tokens": 2,
                                                                 "temperature": 0}),
                         {"Content-Type": "application/json"})
            resp = conn.getresponse()
            results.append(resp.status if json.loads(resp.read()).get("choices") else -resp.status)
        except OSError as e:  # a reset or refused connection: a lost request
            results.append(type(e).__name__)
        finally:
            conn.close()


def test_64_concurrent_clients_lose_nothing(engine):
    server = start(engine)  # the defaults of prunus serve: --max-queue 64, --max-batch 8
    try:
        assert server.request_queue_size >= 64
        results: list = []
        threads = [threading.Thread(target=_client, args=(server, results, i, 3)) for i in range(64)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(180)
        assert len(results) == 64 * 3 and results == [200] * len(results), sorted(map(str, results))[:10]
    finally:
        server.shutdown()
        server.server_close()


def test_connections_over_the_cap_get_429_not_a_reset(engine):
    server = start(engine, max_connections=4, header_timeout=30)
    idle = [socket.create_connection(server.server_address[:2]) for _ in range(4)]
    try:
        time.sleep(0.3)
        got, headers, body, _ = exchange(server, post("/v1/completions", b'{"prompt": "x", "max_tokens": 2}'))
        assert got == 429 and json.loads(body)["error"]["code"] == "too_many_connections" and "retry-after" in headers
        for s in idle:
            s.close()
        deadline = time.monotonic() + 10
        while True:
            got, _, body, _ = exchange(server, post("/v1/completions", b'{"prompt": "x", "max_tokens": 2}'))
            if got == 200 or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert got == 200, body
    finally:
        server.shutdown()
        server.server_close()


def test_a_client_that_resets_is_one_log_line(server, engine, capfd):
    capfd.readouterr()
    for raw, mid_answer in ((post("/v1/completions", b'{"prompt": "x", "max_tokens": 2}')[:-4], False),  # mid-body
                            (post("/v1/completions", b'{"prompt": "x", "max_tokens": 100, "temperature": 0}'), True)):
        s = socket.create_connection(server.server_address[:2])
        s.sendall(raw)
        t0 = time.monotonic()  # mid-answer: reset as soon as the engine decodes it (a tiny model is quick)
        while mid_answer and engine.scheduler.n_active == 0 and time.monotonic() - t0 < 10:
            time.sleep(0.001)
        if not mid_answer:
            time.sleep(0.3)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close with a reset
        s.close()
    err, deadline = "", time.monotonic() + 10  # the log lines come when the server notices, later under load
    while err.count("went away") < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
        err += capfd.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 2 and all("went away" in line for line in lines), err
    got, _, _, _ = exchange(server, post("/v1/completions", b'{"prompt": "x", "max_tokens": 2}'))
    assert got == 200


def test_extreme_sampling_numbers_never_give_500(server):
    """A temperature or top_p of 1e-300 is greedy (no inf / NaN probabilities); past OpenAI's range is a 400."""
    def complete(**fields) -> tuple[int, dict]:
        body = json.dumps({"prompt": "def f(x):", "max_tokens": 6, "seed": 1, **fields}).encode()
        got, _, answer, _ = exchange(server, post("/v1/completions", body))
        return got, json.loads(answer)

    greedy = complete(temperature=0)
    assert greedy[0] == 200
    for fields in ({"temperature": 1e-300}, {"top_p": 1e-300}, {"temperature": 1e-300, "top_p": 1e-300},
                   {"temperature": 5e-324}, {"top_p": 1e-300, "top_k": 1}):
        got, answer = complete(**fields)
        assert got == 200 and answer["choices"][0]["text"] == greedy[1]["choices"][0]["text"], (fields, answer)
    for fields, words in (({"temperature": 1e300}, "temperature"), ({"top_p": 1e300}, "top_p"),
                          ({"temperature": -1e-300}, "temperature"), ({"temperature": 1e5}, "temperature")):
        got, answer = complete(**fields)
        assert got == 400 and words in answer["error"]["message"], (fields, answer)
    got, answer = complete(temperature=2)  # OpenAI's hottest: a distribution, any token, no NaN
    assert got == 200 and answer["choices"][0]["finish_reason"] in ("length", "stop")


@pytest.mark.slow  # decodes a few hundred tokens to fill the buffers, then waits out the deadline
def test_a_client_that_stops_reading_is_dropped_and_frees_its_row(tmp_path, monkeypatch, capfd):
    """Once the answer fills the (here small) buffers, the client has write_timeout seconds to read."""
    monkeypatch.setattr("prunus.serve.http_connection.WRITE_BUFFER", 1024)
    torch.manual_seed(0)
    model = Transformer(get_preset("tiny").replace(max_seq_len=4096))  # long enough to outlast the deadline
    model.init_weights()
    path = save_model(model.eval(), tmp_path / "model", stage="test")
    with Engine.load(path, max_batch=2, threads=1) as engine:
        server = start(engine, write_timeout=1.0)
        server.socket.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)  # accepted sockets inherit it
        try:
            capfd.readouterr()
            s = socket.socket()
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            s.connect(server.server_address[:2])
            no_end = {str(t): -100 for t in engine.tokenizer.stop_ids}  # it would run to its 4000 tokens
            body = json.dumps({"prompt": "x", "max_tokens": 4000, "temperature": 0, "logit_bias": no_end,
                               "stream": True}).encode()
            before = engine.scheduler.tokens_generated
            s.sendall(post("/v1/completions", body))  # ...and never reads
            t0 = time.monotonic()
            while engine.scheduler.n_active == 0 and time.monotonic() - t0 < 10:
                time.sleep(0.01)
            while engine.scheduler.n_active and time.monotonic() - t0 < 30:
                time.sleep(0.05)
            assert engine.scheduler.n_active == 0 and engine.scheduler.tokens_generated - before < 3900
            s.close()
            time.sleep(0.2)
            assert "went away" in capfd.readouterr().err
            got, _, _, _ = exchange(server, post("/v1/completions", b'{"prompt": "x", "max_tokens": 2}'))
            assert got == 200
        finally:
            server.shutdown()
            server.server_close()
