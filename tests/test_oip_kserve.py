"""The Open Inference Protocol as KServe / Triton clients speak it: tritonclient's HTTP clients (sync and asyncio)
against prunus serve's OIPServer on a tiny generic model dir: health, server and model metadata, model ready with
and without a version, infer with JSON and binary tensors both ways; the binary tensor data extension's malformed
bodies as one-line 400s naming the tensor; the body cap (413); a seeded, time-bounded fuzz of binary bodies that
is never answered 5xx.

The model is defined here: one Linear layer from 6 features to 3 outputs.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import random
import threading
import time

import numpy as np
import pytest
import torch
from torch import nn

from prunus.models.module_dir import save_module
from prunus.models.module_factory import build_module
from prunus.serve import Engine

tritonclient = pytest.importorskip("tritonclient.http")

FACTORY = "test_oip_kserve:tiny"
TOL = 1e-5


def tiny():
    return nn.Sequential(nn.Linear(6, 3))


@pytest.fixture(scope="module")
def oip(tmp_path_factory):
    """(server, engine, "host:port") of a tiny model dir, listening on a free port in a thread."""
    from prunus.serve.oip_server import OIPServer

    path = tmp_path_factory.mktemp("kserve") / "m"
    torch.manual_seed(0)
    save_module(build_module(FACTORY, {}), path, stage="test", task="regression",
                input={"shape": [6], "dtype": "float32"})
    engine = Engine.load(path, trust_factory=FACTORY, max_batch=64, max_delay_ms=1, threads=1)
    server = OIPServer(engine, "127.0.0.1", 0)
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    yield server, engine, "%s:%d" % tuple(server.server_address[:2])
    server.shutdown()
    server.server_close()
    engine.close()


def _rows(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, 6)).astype(np.float32)


def _input(x: np.ndarray, binary: bool):
    tensor = tritonclient.InferInput("input", list(x.shape), "FP32")
    tensor.set_data_from_numpy(x, binary_data=binary)
    return tensor


def _post(server, path: str, body: bytes, headers: dict) -> tuple[int, dict, bytes]:
    conn = http.client.HTTPConnection(*server.server_address[:2], timeout=30)
    conn.request("POST", path, body, headers)
    resp = conn.getresponse()
    raw = resp.read()
    conn.close()
    return resp.status, {k.lower(): v for k, v in resp.getheaders()}, raw


def _binary_body(x: np.ndarray, size: int | None = None, datatype: str = "FP32", shape=None) -> tuple[bytes, dict]:
    raw = x.tobytes()
    header = json.dumps({"inputs": [{"name": "input", "datatype": datatype, "shape": shape or list(x.shape),
                                     "parameters": {"binary_data_size": len(raw) if size is None else size}}]}).encode()
    return header + raw, {"Inference-Header-Content-Length": str(len(header))}


def _one_line_400(status: int, raw: bytes, *needles: str) -> None:
    assert status == 400, (status, raw[:300])
    error = json.loads(raw)["error"]
    assert "\n" not in error and all(n in error for n in needles), error


def test_tritonclient_health_metadata_and_model_ready(oip):
    server, _, url = oip
    client = tritonclient.InferenceServerClient(url)
    assert client.is_server_live() and client.is_server_ready()
    meta = client.get_server_metadata()
    assert meta["name"] == "prunus" and "binary_tensor_data" in meta["extensions"]
    name = server.model_name
    model = client.get_model_metadata(name)
    assert model == client.get_model_metadata(name, "1") and model["versions"] == ["1"]
    assert model["inputs"] == [{"name": "input", "datatype": "FP32", "shape": [-1, 6]}]
    assert client.is_model_ready(name) and client.is_model_ready(name, "1")
    assert not client.is_model_ready(name, "2") and not client.is_model_ready("other")
    with pytest.raises(Exception, match="has no version '7'"):
        client.get_model_metadata(name, "7")
    conn = http.client.HTTPConnection(*server.server_address[:2], timeout=30)
    conn.request("GET", f"/v2/models/{name}/versions/2/ready")
    resp = conn.getresponse()
    assert resp.status == 404 and resp.getheader("Content-Type") == "application/json"
    assert "has no version '2'" in json.loads(resp.read())["error"]
    conn.close()
    client.close()


@pytest.mark.parametrize("binary_in", [False, True], ids=["json-in", "binary-in"])
@pytest.mark.parametrize("binary_out", [None, False, True], ids=["default-out", "json-out", "binary-out"])
def test_tritonclient_infer_json_and_binary(oip, binary_in, binary_out):
    server, engine, url = oip
    x = _rows(5, 3)
    outputs = None if binary_out is None else [tritonclient.InferRequestedOutput("output", binary_data=binary_out)]
    client = tritonclient.InferenceServerClient(url)
    result = client.infer(server.model_name, [_input(x, binary_in)], outputs=outputs, request_id="r7",
                          model_version="1" if binary_in else "")
    client.close()
    got = result.as_numpy("output")
    assert got.dtype == np.float32 and got.shape == (5, 3)
    assert np.abs(got - engine.predict(x)).max() <= TOL
    entry = result.get_output("output")
    assert ("data" in entry) == (binary_out is False)  # no outputs named: tritonclient asks for binary
    assert result.get_response()["id"] == "r7"


def test_tritonclient_asyncio_client(oip):
    import tritonclient.http.aio as aio

    server, engine, url = oip
    name, x = server.model_name, _rows(3, 4)

    async def session():
        client = aio.InferenceServerClient(url)
        try:
            assert await client.is_server_live() and await client.is_server_ready()
            assert (await client.get_server_metadata())["name"] == "prunus"
            assert (await client.get_model_metadata(name, "1"))["outputs"][0]["name"] == "output"
            assert await client.is_model_ready(name) and await client.is_model_ready(name, "1")
            out = []
            for binary in (False, True):
                wanted = [aio.InferRequestedOutput("output", binary_data=binary)]
                result = await client.infer(name, [_input(x, binary)], outputs=wanted)
                out.append(result.as_numpy("output"))
            return out
        finally:
            await client.close()

    for got in asyncio.run(session()):
        assert np.abs(got - engine.predict(x)).max() <= TOL


def test_a_large_binary_batch_and_the_body_cap(oip):
    server, engine, url = oip
    x = _rows(52_000, 5)  # 1.25 MB of FP32: over the old 1 MiB cap, well under the default
    client = tritonclient.InferenceServerClient(url, network_timeout=120)
    got = client.infer(server.model_name, [_input(x, True)]).as_numpy("output")
    client.close()
    assert got.shape == (52_000, 3) and np.abs(got[-4:] - engine.predict(x[-4:])).max() <= TOL
    body, headers = _binary_body(_rows(64, 6))
    limit, server.max_body_bytes = server.max_body_bytes, 1000
    try:
        status, _, raw = _post(server, f"/v2/models/{server.model_name}/infer", body, headers)
    finally:
        server.max_body_bytes = limit
    error = json.loads(raw)["error"]
    assert status == 413 and "limit of 1000 bytes" in error and "--max-body-mb" in error and "\n" not in error


@pytest.mark.parametrize("case", ["short", "header-past-end", "size-vs-shape", "unknown-datatype", "bytes",
                                  "nan", "bad-header-length", "media", "gzip"])
def test_malformed_binary_bodies_are_one_line_and_the_server_keeps_serving(oip, case):
    server, engine, _ = oip
    path, x = f"/v2/models/{server.model_name}/infer", _rows(2, 8)
    body, headers = _binary_body(x)
    status, want = 400, ("input tensor 'input'",)
    if case == "short":
        body = body[:-5]
        want = ("runs past the body's end",)
    elif case == "header-past-end":
        headers = {"Inference-Header-Content-Length": str(len(body) + 1)}
        want = ("runs past the body's end",)
    elif case == "size-vs-shape":
        body, headers = _binary_body(x, shape=[3, 6])
        want = ("input tensor 'input'", "binary_data_size 48 where FP32 × shape [3, 6] needs 72 bytes")
    elif case == "unknown-datatype":
        body, headers = _binary_body(x, datatype="FP8")
        want = ("input tensor 'input'", "'FP8'", "not an Open Inference Protocol datatype")
    elif case == "bytes":
        body, headers = _binary_body(x, datatype="BYTES")
        want = ("input tensor 'input'", "BYTES is not served")
    elif case == "nan":
        body, headers = _binary_body(np.where(x > 0, np.float32("nan"), x))
        want = ("input tensor 'input'", "nan, not a finite FP32 value")
    elif case == "bad-header-length":
        headers = {"Inference-Header-Content-Length": "-3"}
        want = ("Inference-Header-Content-Length '-3' is not a byte count",)
    elif case == "media":
        headers = {**headers, "Content-Type": "text/plain"}
        status, want = 415, ("application/octet-stream",)
    else:
        headers = {**headers, "Content-Encoding": "gzip"}
        status, want = 415, ("Content-Encoding 'gzip'",)
    got, _, raw = _post(server, path, body, headers)
    error = json.loads(raw)["error"]
    assert got == status and "\n" not in error and all(w in error for w in want), (got, error)
    body, headers = _binary_body(x)  # the same body, well formed, as application/octet-stream
    got, answer_headers, raw = _post(server, path, body, {**headers, "Content-Type": "application/octet-stream"})
    assert got == 200 and answer_headers["content-type"] == "application/json"
    assert np.abs(np.array(json.loads(raw)["outputs"][0]["data"]).reshape(2, 3) - engine.predict(x)).max() <= TOL


def test_binary_outputs_carry_the_header_length_and_octet_stream(oip):
    server, engine, _ = oip
    x = _rows(4, 9)
    header = json.dumps({"parameters": {"binary_data_output": True}, "inputs": [
        {"name": "input", "datatype": "FP32", "shape": [4, 6], "parameters": {"binary_data_size": 96}}]}).encode()
    body, headers = header + x.tobytes(), {"Inference-Header-Content-Length": str(len(header))}
    status, answer_headers, raw = _post(server, f"/v2/models/{server.model_name}/versions/1/infer", body, headers)
    assert status == 200 and answer_headers["content-type"] == "application/octet-stream"
    n = int(answer_headers["inference-header-content-length"])
    header = json.loads(raw[:n])
    assert header["outputs"][0]["parameters"] == {"binary_data_size": 48} and len(raw) == n + 48
    assert np.abs(np.frombuffer(raw[n:], "<f4").reshape(4, 3) - engine.predict(x)).max() <= TOL


def _mutated(rng: random.Random, x: np.ndarray) -> tuple[bytes, dict]:
    """A binary body broken in one or two random ways: its bytes, its header length, its declared sizes."""
    body, headers = _binary_body(x, size=rng.choice([None] * 6 + [0, 47, 49, 10 ** 12, -1]),
                                 datatype=rng.choice(["FP32"] * 6 + ["FP64", "INT8", "BOOL", "BYTES", "X"]),
                                 shape=rng.choice([None] * 6 + [[2, 6], [0, 6], [2, 5], [-1, 6], [1, 2, 3]]))
    n = int(headers["Inference-Header-Content-Length"])
    for _ in range(rng.choice([0, 1, 1, 1, 2])):
        what = rng.randrange(5)
        if what == 0:
            body = body[:rng.randrange(len(body) + 1)]
        elif what == 1:
            i = rng.randrange(len(body))
            body = body[:i] + bytes([rng.randrange(256)]) + body[i + 1:]
        elif what == 2:
            n = rng.choice([0, n - 1, n + 1, len(body), len(body) + 9, rng.randrange(2 * len(body) + 1)])
        elif what == 3:
            body = body + bytes(rng.randrange(256) for _ in range(rng.randint(1, 16)))
        else:
            body = body[:n] + np.full(x.shape, rng.choice([np.nan, np.inf, 3e38, 0.0]), np.float32).tobytes()
    odd = rng.random() < 0.15  # a header length that is no byte count
    return body, {"Inference-Header-Content-Length": rng.choice(["x", "", str(-n), "1e3"]) if odd else str(n)}


def test_fuzz_binary_bodies_are_never_a_5xx(oip):
    """Seeded and bounded to 3 s: every answer is a 200 or a one-line 4xx in JSON, and the server keeps serving."""
    server, engine, _ = oip
    rng, path, x = random.Random(20251), f"/v2/models/{server.model_name}/infer", _rows(2, 10)
    statuses, deadline, n = set(), time.monotonic() + 3.0, 0
    while time.monotonic() < deadline and n < 400:
        body, headers = _mutated(rng, x)
        status, _, raw = _post(server, path, body, headers)
        assert status < 500, (status, raw[:300], headers, body[:200])
        if status != 200:
            assert "\n" not in json.loads(raw)["error"]
        statuses.add(status)
        n += 1
    assert n >= 20 and {200, 400} <= statuses, statuses
    body, headers = _binary_body(x)
    status, _, raw = _post(server, path, body, headers)
    assert status == 200 and len(json.loads(raw)["outputs"][0]["data"]) == 6


def test_cli_serve_takes_the_body_cap(tmp_path, monkeypatch):
    from click.testing import CliRunner

    from prunus.cli.main import cli
    from prunus.serve.oip_server import OIPServer

    torch.manual_seed(0)
    save_module(build_module(FACTORY, {}), tmp_path / "m", stage="test", task="regression",
                input={"shape": [6], "dtype": "float32"})
    seen = []

    def serve_once(server, poll_interval):
        seen.append(server.max_body_bytes)
        raise KeyboardInterrupt

    monkeypatch.setattr(OIPServer, "serve_forever", serve_once)
    result = CliRunner().invoke(cli, ["serve", str(tmp_path / "m"), "--trust-factory", "--port", "0",
                                      "--max-body-mb", "3"])
    assert result.exit_code == 0, result.output
    assert seen == [3 << 20]
