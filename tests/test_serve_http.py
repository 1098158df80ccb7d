"""prunus serve as a real server process on 127.0.0.1 (a free port), with two tensor-parallel workers:
completions equal to prunus.models greedy tokens, concurrent clients, streaming, 400 / 404 / 429 answers
after which it keeps serving, a client leaving mid-stream or mid-answer frees its slot, /health and /metrics, and
killing the server ends its workers, which remove its temp dir (named after its pid)."""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from prunus.artifacts.pids import remove_stale
from prunus.cli.main import cli
from prunus.models import Transformer, get_preset, load_model, load_model_tokenizer, save_model, stream_tokens
from prunus.runtime.torch_tp import TEMP_PREFIX

PROMPTS = ["def f(x):", "import os\n", "class A:\n    def ", "for i in range(", "x = {"]
LINUX = sys.platform.startswith("linux")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    torch.manual_seed(0)
    model = Transformer(get_preset("tiny").replace(max_seq_len=1024))  # room for long streams
    model.init_weights()
    return save_model(model.eval(), tmp_path_factory.mktemp("http") / "model", stage="test")


@pytest.fixture(scope="module")
def greedy(model_dir):
    model, tok = load_model(model_dir), load_model_tokenizer(model_dir)

    def text(prompt: str, n: int) -> str:
        ids = [int(t[0]) for t in stream_tokens(model, torch.tensor([tok.encode(prompt)]), n, eos_id=tok.eos_id)]
        return tok.decode(ids)
    return text


@pytest.fixture(scope="module")
def server_tmp(tmp_path_factory):
    """The server's own TMPDIR: another test's server, in a parallel worker, cleans the shared one at its start."""
    return tmp_path_factory.mktemp("server-tmp")


@pytest.fixture(scope="module")
def server(model_dir, server_tmp):
    proc = subprocess.Popen([sys.executable, "-m", "prunus.cli.main", "serve", str(model_dir), "--port", "0",
                             "--tp", "2", "--max-batch", "2", "--max-queue", "4"],
                            stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1", "TMPDIR": str(server_tmp)})
    lines, url = [], None
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        if not line:
            break
        lines.append(line)
        m = re.search(r"listening on (http://\S+)", line)
        if m:
            url = m.group(1)
            break
    if url is None:
        proc.kill()
        pytest.fail("the server did not start:\n" + "".join(lines))
    threading.Thread(target=lambda: [None for _ in proc.stderr], daemon=True).start()  # keep its pipe drained
    yield proc, url
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)


MODEL = "model"  # the served dir's name: what a request's required 'model' gives


def call(url: str, path: str, body=None, raw: bytes | None = None) -> tuple[int, dict | str]:
    """(status, JSON or text); a JSON ``body`` names :data:`MODEL` unless it names a model itself."""
    if isinstance(body, dict) and "model" not in body:
        body = {"model": MODEL, **body}
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    req = urllib.request.Request(url + path, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            status, text, ctype = r.status, r.read().decode(), r.headers.get("Content-Type", "")
    except urllib.error.HTTPError as e:
        status, text, ctype = e.code, e.read().decode(), e.headers.get("Content-Type", "")
    return status, json.loads(text) if ctype.startswith("application/json") else text


def metric(pattern: str, text: str) -> int:
    """A sample's value in the Prometheus text (prometheus_client writes counters as floats: 12.0)."""
    return int(float(re.search(pattern, text, re.M).group(1)))


def start_clients(url: str, bodies: list[dict]) -> tuple[list[threading.Thread], list]:
    """One thread per body, each POSTing it to /v1/completions; answers[i] is (status, body) once joined."""
    answers = [None] * len(bodies)

    def client(i):
        answers[i] = call(url, "/v1/completions", bodies[i])
    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(bodies))]
    for t in threads:
        t.start()
    return threads, answers


def open_stream(url: str, body: dict) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=120)
    conn.request("POST", "/v1/completions", json.dumps({"model": MODEL, **body, "stream": True}),
                 {"Content-Type": "application/json"})
    return conn, conn.getresponse()


def read_events(resp) -> list:
    events = []
    for line in resp:
        line = line.decode().strip()
        if line.startswith("data: "):
            payload = line[6:]
            events.append(payload if payload == "[DONE]" else json.loads(payload))
            if payload == "[DONE]":
                break
    return events


def test_health_and_greedy_completions(server, greedy):
    _, url = server
    status, health = call(url, "/health")
    assert status == 200 and health["status"] == "ok" and health["backend"] == "torch" and health["tp"] == 2
    status, r = call(url, "/v1/completions", {"prompt": PROMPTS[0], "max_tokens": 20, "temperature": 0})
    assert status == 200 and r["object"] == "text_completion"
    assert r["choices"][0]["text"] == greedy(PROMPTS[0], 20)
    assert r["usage"]["prompt_tokens"] == len(PROMPTS[0]) and r["usage"]["total_tokens"] == len(PROMPTS[0]) + r["usage"]["completion_tokens"]
    status, r = call(url, "/v1/completions", {"prompt": PROMPTS[:2], "max_tokens": 12, "temperature": 0, "top_k": 5})
    assert status == 200 and [c["index"] for c in r["choices"]] == [0, 1]
    assert [c["text"] for c in r["choices"]] == [greedy(p, 12) for p in PROMPTS[:2]]
    seeded = {"prompt": PROMPTS[2], "max_tokens": 12, "temperature": 0.8, "top_p": 0.9, "seed": 5}
    assert call(url, "/v1/completions", seeded)[1]["choices"] == call(url, "/v1/completions", seeded)[1]["choices"]


def test_concurrent_clients(server, greedy):
    _, url = server
    threads, answers = start_clients(url, [{"prompt": p, "max_tokens": 16, "temperature": 0} for p in PROMPTS[:4]])
    for t in threads:
        t.join()
    assert [a[0] for a in answers] == [200] * 4
    assert [a[1]["choices"][0]["text"] for a in answers] == [greedy(p, 16) for p in PROMPTS[:4]]


def test_streaming_matches_the_plain_answer(server):
    _, url = server
    body = {"prompt": PROMPTS[3], "max_tokens": 20, "temperature": 0}
    conn, resp = open_stream(url, body)
    assert resp.status == 200 and resp.getheader("Content-Type") == "text/event-stream"
    events = read_events(resp)
    conn.close()
    assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] in ("length", "stop")
    text = "".join(e["choices"][0]["text"] for e in events[:-1])
    assert text == call(url, "/v1/completions", body)[1]["choices"][0]["text"]


def test_malformed_requests_get_400_and_the_server_keeps_serving(server):
    _, url = server

    def named(body: dict) -> bytes:
        return json.dumps({"model": MODEL, **body}).encode()
    cases = [
        (b"{not json", "not valid JSON"),
        (b"[1, 2]", "JSON object"),
        (named({"max_tokens": 4}), "'prompt'"),
        (named({"prompt": "x", "max_tokens": -1}), "max_tokens=-1"),  # the request's field, not the API's
        (named({"prompt": "x", "max_tokens": 10**9}), "exceeds the context"),
        (named({"prompt": "x" * 2000, "max_tokens": 1}), "exceeds the context"),
        (named({"prompt": "x", "temperature": "hot"}), "temperature"),
        (named({"prompt": "x", "stream": "yes"}), "'stream'"),
        (named({"prompt": "x", "bogus": 1}), "unknown field"),
    ]
    for raw, needle in cases:
        status, body = call(url, "/v1/completions", raw=raw)
        assert status == 400, (raw, body)
        assert body["error"]["type"] == "invalid_request_error" and needle in body["error"]["message"], body
    assert call(url, "/nowhere")[0] == 404
    assert call(url, "/v1/completions", {"prompt": "x", "max_tokens": 2, "temperature": 0})[0] == 200


def test_full_queue_gets_429_and_a_client_leaving_frees_its_slot(server):
    _, url = server
    # two long streams hold both batch rows
    streams = [open_stream(url, {"prompt": p, "max_tokens": 1000, "temperature": 0}) for p in PROMPTS[:2]]
    for _, resp in streams:
        assert resp.status == 200 and resp.readline().startswith(b"data: ")
    # four short requests wait for a row: the queue (4) is full
    threads, waiting = start_clients(url, [{"prompt": p, "max_tokens": 4, "temperature": 0} for p in PROMPTS[:4]])
    deadline = time.monotonic() + 30
    while call(url, "/health")[1]["queue_depth"] < 4 and time.monotonic() < deadline:
        time.sleep(0.02)
    status, body = call(url, "/v1/completions", {"prompt": "x", "max_tokens": 2})
    assert status == 429 and body["error"]["type"] == "rate_limit_error" and "queue is full" in body["error"]["message"]
    # the stream clients go away: their rows free up and the queued requests run
    for conn, resp in streams:
        resp.close()
        conn.close()
    for t in threads:
        t.join(60)
    assert [w[0] for w in waiting] == [200] * 4
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        health = call(url, "/health")[1]
        if health["active"] == 0 and health["queue_depth"] == 0:
            break
        time.sleep(0.05)
    assert health["active"] == 0 and health["queue_depth"] == 0
    metrics = call(url, "/metrics")[1]
    tokens = metric(r"^prunus_tokens_generated_total (\S+)$", metrics)
    assert tokens < 1500, "the abandoned streams ran on to their 1000 tokens each"


def test_a_client_leaving_a_plain_request_frees_its_slot(server):
    _, url = server
    host, port = url.removeprefix("http://").split(":")
    before = metric(r"^prunus_tokens_generated_total (\S+)$", call(url, "/metrics")[1])
    conn = http.client.HTTPConnection(host, int(port), timeout=120)
    conn.request("POST", "/v1/completions", json.dumps({"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 1000,
                                                         "temperature": 0}),
                 {"Content-Type": "application/json"})
    deadline = time.monotonic() + 30
    while call(url, "/health")[1]["active"] < 1 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert call(url, "/health")[1]["active"] == 1
    conn.close()  # no answer awaited: the client is gone
    deadline = time.monotonic() + 30
    while call(url, "/health")[1]["active"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert call(url, "/health")[1]["active"] == 0
    after = metric(r"^prunus_tokens_generated_total (\S+)$", call(url, "/metrics")[1])
    assert after - before < 900, "the abandoned request ran on to its 1000 tokens"
    assert call(url, "/v1/completions", {"prompt": "x", "max_tokens": 2})[0] == 200  # still serving


def test_metrics_in_prometheus_text(server):
    _, url = server
    status, text = call(url, "/metrics")
    assert status == 200
    for needle in ('prunus_requests_total{status="200"}', 'prunus_requests_total{status="400"}',
                   'prunus_requests_total{status="429"} 1', "# TYPE prunus_request_latency_seconds histogram",
                   'prunus_request_latency_seconds_bucket{le="+Inf"}', "prunus_queue_depth 0",
                   "prunus_active_requests 0", "prunus_tokens_generated_total"):
        assert needle in text, needle
    count = metric(r"^prunus_request_latency_seconds_count (\S+)$", text)
    ok = metric(r'^prunus_requests_total\{status="200"\} (\S+)$', text)
    assert count == ok >= 10


@pytest.mark.skipif(not LINUX, reason="reads /proc to find the worker processes")
def test_killing_the_server_ends_its_workers(server, children, server_tmp):
    """...and the first of them to find it gone removes the temp dir it could not (named after its pid)."""
    proc, _ = server
    workers = children(proc.pid)
    assert len(workers) == 2
    left = list(server_tmp.glob(f"{TEMP_PREFIX}{proc.pid}-*"))
    assert len(left) == 1 and (left[0] / "sock").exists()
    proc.kill()
    proc.wait(10)
    deadline = time.monotonic() + 5
    alive = workers
    while (alive or left[0].exists()) and time.monotonic() < deadline:
        alive = [w for w in workers if Path(f"/proc/{w}").exists() and "Z" not in Path(f"/proc/{w}/stat").read_text().split()[2]]
        time.sleep(0.1)
    assert not alive, f"workers {alive} outlived the killed server"
    assert not left[0].exists(), "the killed server's temp dir outlived its workers"
    assert remove_stale(server_tmp, TEMP_PREFIX) == []  # nothing left for the next start


def test_serve_cli_bad_input(tmp_path, model_dir, assert_user_error):
    runner = CliRunner()
    assert_user_error(runner.invoke(cli, ["serve", str(tmp_path / "absent")]), "no such directory")
    assert_user_error(runner.invoke(cli, ["serve", str(model_dir), "--tp", "3"]), "tp=3", "n_kv_heads=2")
    assert_user_error(runner.invoke(cli, ["serve", str(model_dir), "--backend", "onnxruntime"]), "cannot load a model dir")
