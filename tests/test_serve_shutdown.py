"""How prunus serve stops (prunus.serve.shutdown): a drain refuses new requests with 503 at once, lets the requests
in progress finish within the grace, then ends every stream still open with an error event and [DONE] and every
other answer with 503 (OpenAI's server and the Open Inference Protocol's), frees the engine's rows, and says so in
one line; `prunus serve` under SIGTERM with 8 streams in flight exits 0 with that line and no traceback."""

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

import pytest
import torch
from torch import nn

from prunus.models import Transformer, get_preset, save_model
from prunus.serve import Engine
from prunus.serve.http_server import CompletionServer

STEP_S = 0.02  # each decode step of the in-process engine, slowed so that a drain meets requests in progress


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    torch.manual_seed(0)
    model = Transformer(get_preset("tiny").replace(max_seq_len=2048))
    model.init_weights()
    return save_model(model.eval(), tmp_path_factory.mktemp("shutdown") / "model", stage="test")


def post(address, path: str, body: dict) -> http.client.HTTPResponse:
    conn = http.client.HTTPConnection(*address[:2], timeout=60)
    conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
    return conn.getresponse()


def completion(name: str, max_tokens: int, stream: bool) -> dict:
    return {"model": name, "prompt": "def f(x):", "max_tokens": max_tokens, "min_tokens": max_tokens,
            "temperature": 0, "stream": stream}


def read_events(resp) -> list:
    """The stream's events to [DONE] (or to its end, where [DONE] never came)."""
    out = []
    for line in resp:
        if line.startswith(b"data: "):
            payload = line[6:].strip().decode()
            out.append(payload if payload == "[DONE]" else json.loads(payload))
            if payload == "[DONE]":
                break
    return out


def ended_well(events: list) -> str:
    """'finished' or 'cut' for a stream that ended with its finish_reason or the shutdown's error, then [DONE]."""
    assert events and events[-1] == "[DONE]", events[-3:]
    last = events[-2]
    if "error" in last:
        assert last["error"]["code"] == "shutdown" and last["error"]["type"] == "server_error", last
        assert last["error"]["message"] == "server shutting down"
        return "cut"
    assert last["choices"][0]["finish_reason"] == "length", last
    return "finished"


def wait_for(condition, seconds: float = 30) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_a_drain_finishes_what_it_can_cuts_the_rest_and_refuses_new_requests(model_dir, monkeypatch):
    with Engine.load(model_dir, max_batch=4, threads=1) as engine:
        decode = engine.backend.decode
        def slowed(rows, tokens):
            time.sleep(STEP_S)
            return decode(rows, tokens)
        monkeypatch.setattr(engine.backend, "decode", slowed)
        server = CompletionServer(engine, port=0, shutdown_grace=1.0)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        name, address = server.model_name, server.server_address
        short = post(address, "/v1/completions", completion(name, 25, True))  # ~0.5 s: ends within the grace
        long = post(address, "/v1/completions", completion(name, 200, True))  # ~4 s: cut
        assert short.readline().startswith(b"data: ") and long.readline().startswith(b"data: ")
        whole: list = []
        threading.Thread(target=lambda: whole.append(post(address, "/v1/completions", completion(name, 200, False))),
                         daemon=True).start()
        wait_for(lambda: engine.scheduler.n_active == 3)
        stopping = threading.Thread(target=server.shutdown)
        stopping.start()
        wait_for(lambda: server.drain.refusing)
        late = post(address, "/v1/completions", completion(name, 2, False))
        assert late.status == 503 and late.getheader("Connection") == "close"
        assert json.loads(late.read())["error"]["code"] == "shutdown"
        assert ended_well(read_events(short)) == "finished"
        assert ended_well(read_events(long)) == "cut"
        wait_for(lambda: whole)
        assert whole[0].status == 503
        error = json.loads(whole[0].read())["error"]
        assert error["code"] == "shutdown" and error["type"] == "server_error" and error["message"].startswith(
            "server shutting down")
        stopping.join(30)
        assert not stopping.is_alive()
        assert server.drain.summary() == ("prunus serve: shut down: of 3 requests in progress, 1 finished and 2 were "
                                          "cut after the 1 s grace")
        wait_for(lambda: engine.scheduler.n_active == 0, 10)  # the cut rows are freed
        server.server_close()


def test_a_grace_out_of_range_is_one_line():
    from prunus.artifacts.errors import PrunusError
    from prunus.serve.shutdown import Drain

    for grace in (-1, float("nan"), 1e9):
        with pytest.raises(PrunusError, match=r"^shutdown_grace=.* \(--shutdown-grace\) must be from 0 to 3600 s"):
            Drain(grace)


def test_a_second_signal_cuts_at_once():
    from prunus.serve.shutdown import Drain, Flight

    drain, flight = Drain(60), Flight()
    drain.flights.add(flight)
    assert not drain.step() and not drain.refusing
    drain.request()  # SIGTERM
    assert not drain.step() and drain.refusing and drain.draining and not flight.cut_off  # the grace runs
    drain.request()  # a second one
    assert not drain.step() and flight.cut_off
    drain.landed(flight)
    assert drain.step()
    assert drain.summary() == ("prunus serve: shut down: of 1 request in progress, 0 finished and 1 was cut at a "
                               "second signal")


RELEASE = threading.Event()


class Slow(nn.Module):
    """A row above 1e6 holds its pass until RELEASE: an Open Inference Protocol request in progress."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(2, 1)

    def forward(self, x):
        if bool((x > 1e6).any()):
            RELEASE.wait(30)
        return self.fc(x)


def slow():
    return Slow()


def test_the_inference_protocol_answers_a_cut_request_503(tmp_path):
    import importlib

    from prunus.models.module_dir import save_module
    from prunus.models.module_factory import build_module
    from prunus.serve.oip_server import OIPServer

    factory = "test_serve_shutdown:slow"
    save_module(build_module(factory, {}), tmp_path / "m", stage="test", task="regression",
                input={"shape": [2], "dtype": "float32"})
    with Engine.load(tmp_path / "m", trust_factory=factory, max_batch=4, max_delay_ms=1, threads=1) as engine:
        server = OIPServer(engine, "127.0.0.1", 0, shutdown_grace=0.2)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        body = {"inputs": [{"name": "input", "shape": [1, 2], "datatype": "FP32", "data": [2e6, 0.0]}]}
        answers: list = []
        threading.Thread(target=lambda: answers.append(post(server.server_address, "/v2/models/m/infer", body)),
                         daemon=True).start()
        wait_for(lambda: server.drain.flights)
        try:
            server.shutdown()  # while the pass still runs
            wait_for(lambda: answers)
            assert answers[0].status == 503
            assert json.loads(answers[0].read()) == {"error": "server shutting down; retry on another instance"}
        finally:
            importlib.import_module("test_serve_shutdown").RELEASE.set()  # the factory's import of this module
        assert server.drain.summary().endswith("of 1 request in progress, 0 finished and 1 was cut after the "
                                               "0.2 s grace")
        server.server_close()


@pytest.mark.slow
@pytest.mark.skipif(not hasattr(signal, "SIGTERM") or sys.platform == "win32", reason="POSIX signals")
def test_sigterm_with_streams_in_flight_ends_each_stream_and_exits_0(model_dir):
    """8 streams of 1500 tokens, a 0.5 s grace: each ends with its answer or the shutdown's error, then [DONE]."""
    proc = subprocess.Popen([sys.executable, "-m", "prunus.cli.main", "serve", str(model_dir), "--port", "0",
                             "--no-prepare", "--max-batch", "8", "--shutdown-grace", "0.5"],
                            stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        address = listening(proc)
        streams = [post(address, "/v1/completions", completion(model_dir.name, 1500, True)) for _ in range(8)]
        for resp in streams:
            assert resp.status == 200 and resp.readline().startswith(b"data: ")
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.2)  # the signal handled: new requests are refused while the streams run on
        late = post(address, "/v1/completions", completion(model_dir.name, 2, False))
        assert late.status == 503 and json.loads(late.read())["error"]["code"] == "shutdown"
        ends = [ended_well(read_events(resp)) for resp in streams]
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    assert "Traceback" not in err, err
    cut = ends.count("cut")
    assert err.strip().splitlines() == [f"prunus serve: shut down: of 8 requests in progress, {8 - cut} finished and "
                                        f"{cut} were cut after the 0.5 s grace"], err
    assert cut >= 1


def listening(proc: subprocess.Popen) -> tuple[str, int]:
    """The address of the server ``proc`` once its startup line says it listens."""
    lines = []
    for line in proc.stderr:
        lines.append(line)
        m = re.search(r"listening on http://([\d.]+):(\d+)", line)
        if m:
            return m.group(1), int(m.group(2))
    pytest.fail("the server did not start:\n" + "".join(lines))
