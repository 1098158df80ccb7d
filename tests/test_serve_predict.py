"""Serving non-generative models: Engine.predict over a generic model dir (torch) and its ONNX export dir
(ONNX Runtime), dynamic batching (concurrent callers merged into one pass, equal to one-by-one within 1e-5),
and the Open Inference Protocol endpoint (metadata, infer, bad tensors as one-line 400 / 404, 64 clients).

The model is defined here: a two-Linear regressor on 6 features with 3 outputs.
"""

from __future__ import annotations

import http.client
import json
import math
import random
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
from torch import nn

from prunus.artifacts.errors import PrunusError
from prunus.models.module_dir import save_module
from prunus.models.module_factory import build_module
from prunus.serve import Engine

FACTORY = "test_serve_predict:tiny"
TOL = 1e-5


class Tiny(nn.Module):
    def __init__(self, d_in: int = 6, out: int = 3):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d_in, 16), nn.Linear(16, out)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))


def tiny(d_in=6, out=3):
    return Tiny(d_in, out)


class Exploding(nn.Module):
    """exp of the square of a linear layer: infinity in float32 for inputs of a few hundred."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(6, 3)

    def forward(self, x):
        return torch.exp(self.fc(x) ** 2)


def exploding():
    return Exploding()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("predict")
    torch.manual_seed(0)
    save_module(build_module(FACTORY, {}), tmp / "m", stage="test", task="regression",
                input={"shape": [6], "dtype": "float32"})
    return tmp / "m"


@pytest.fixture(scope="module")
def dirs(model_dir):
    """(generic model dir, its ONNX export dir): an ONNX export, so the tests using it are marked slow."""
    from prunus.export.module_export import export_module

    export_module(model_dir, model_dir.with_name("exp"), trust_factory=True)
    return model_dir, model_dir.with_name("exp")


def _rows(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, 6)).astype(np.float32)


@pytest.mark.parametrize("which", ["model", pytest.param("export", marks=pytest.mark.slow)])
def test_dynamic_batches_merge_and_equal_one_by_one(request, which):
    path = request.getfixturevalue("model_dir") if which == "model" else request.getfixturevalue("dirs")[1]
    requests = [_rows(1 + i % 3, i) for i in range(24)]
    with Engine.load(path, trust_factory=FACTORY, max_batch=16, max_delay_ms=50, threads=1) as engine:
        assert engine.backend.capabilities.predict
        alone = [engine.backend.predict(r) for r in requests]  # one at a time: one pass each, no batcher
        passes = engine.scheduler.passes
        with ThreadPoolExecutor(8) as pool:
            together = list(pool.map(engine.predict, requests))
        assert engine.scheduler.max_requests_in_pass > 1  # a pass served several callers
        assert engine.scheduler.passes - passes < len(requests)
        out = engine.predict(torch.from_numpy(requests[0]))
        assert isinstance(out, torch.Tensor) and torch.allclose(out, torch.from_numpy(alone[0]), atol=TOL)
        with pytest.raises(PrunusError, match="non-generative model; use predict"):
            engine.generate("hello")
        big = engine.predict(_rows(40, 99))  # more rows than max_batch: passes of max_batch rows
        assert big.shape == (40, 3)
    for a, t, r in zip(alone, together, requests):
        assert a.shape == t.shape == (len(r), 3) and np.abs(a - t).max() <= TOL


@pytest.mark.slow
def test_torch_and_onnxruntime_agree_and_refuse_bad_input(dirs):
    x = _rows(5, 1)
    with Engine.load(dirs[0], trust_factory=True) as a, Engine.load(dirs[1]) as b:
        assert a.info["runtime"] == "torch_module" and b.info["runtime"] == "ort_module"
        assert b.info["inputs"] == [{"name": "input", "datatype": "FP32", "shape": [-1, 6]}]
        assert np.abs(a.predict(x) - b.predict(x)).max() < 1e-4
        for bad, needle in ((x.astype(np.float64), "datatype float64"), (x[:, :4], "shape [5, 4]"),
                            (x[0], "shape [6]")):
            with pytest.raises(PrunusError, match=re.escape(needle)) as e:
                b.predict(bad)
            assert "\n" not in str(e.value) and "'input'" in str(e.value)


def test_an_untrusted_factory_or_tp_is_one_line(model_dir):
    with pytest.raises(PrunusError, match="pass --trust-factory"):
        Engine.load(model_dir)
    with pytest.raises(PrunusError, match="tensor parallelism is not served for a generic model dir .*; drop --tp$"):
        Engine.load(model_dir, trust_factory=True, tp=2)
    for option, flag in (({"dtype": "bfloat16"}, "--dtype"),
                         ({"compile": True}, "--compile")):  # generative options are refused, not ignored
        with pytest.raises(PrunusError, match=f"drop {flag}$"):
            Engine.load(model_dir, trust_factory=True, **option)


# --- the Open Inference Protocol endpoint -------------------------------------------------------------------------

@pytest.fixture(scope="module")
def oip(model_dir):
    """(server, engine) of the model dir, max queue 8, listening on a free port in a thread."""
    from prunus.serve.oip_server import OIPServer

    engine = Engine.load(model_dir, trust_factory=FACTORY, max_batch=16, max_delay_ms=5, max_queue=8, threads=1)
    server = OIPServer(engine, "127.0.0.1", 0)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    yield server, engine
    server.shutdown()
    server.server_close()
    engine.close()


def _call(server, method: str, path: str, body=None) -> tuple[int, dict | str]:
    conn = http.client.HTTPConnection(*server.server_address[:2], timeout=30)
    data = None if body is None else json.dumps(body).encode()
    conn.request(method, path, data, {"Content-Type": "application/json"} if data is not None else {})
    resp = conn.getresponse()
    raw = resp.read().decode()
    conn.close()
    return resp.status, (json.loads(raw) if resp.getheader("Content-Type", "").startswith("application/json") else raw)


def _infer_body(x: np.ndarray, **changes) -> dict:
    tensor = {"name": "input", "shape": list(x.shape), "datatype": "FP32", "data": x.reshape(-1).tolist(), **changes}
    return {"id": "r1", "inputs": [tensor]}


def test_oip_metadata_and_infer_round_trip(oip):
    server, engine = oip
    name = server.model_name
    assert _call(server, "GET", "/v2/health/live") == (200, {"live": True})
    assert _call(server, "GET", "/v2/health/ready") == (200, {"ready": True})
    assert _call(server, "GET", f"/v2/models/{name}/ready") == (200, {"name": name, "ready": True})
    status, meta = _call(server, "GET", f"/v2/models/{name}")
    assert status == 200 and meta["inputs"] == [{"name": "input", "datatype": "FP32", "shape": [-1, 6]}]
    assert meta["outputs"] == [{"name": "output", "datatype": "FP32", "shape": [-1, 3]}]
    x = _rows(3, 5)
    status, answer = _call(server, "POST", f"/v2/models/{name}/infer", _infer_body(x))
    assert status == 200 and answer["model_name"] == name and answer["id"] == "r1"
    out = answer["outputs"][0]
    assert out["name"] == "output" and out["datatype"] == "FP32" and out["shape"] == [3, 3]
    assert np.abs(np.array(out["data"], np.float32).reshape(3, 3) - engine.predict(x)).max() <= TOL
    status, text = _call(server, "GET", "/metrics")
    assert status == 200 and "prunus_batch_occupancy" in text and "prunus_batch_passes_total" in text


@pytest.mark.parametrize("change, status, needle", [
    ({"shape": [2, 5]}, 400, "input tensor 'input': shape [2, 5] where the model takes [-1, 6]"),
    ({"datatype": "INT64"}, 400, "input tensor 'input': datatype 'INT64' where the model takes FP32"),
    ({"data": [0.5] * 11}, 400, "input tensor 'input': 'data' holds 11 elements where shape [2, 6] needs 12"),
    ({"name": "pixels"}, 400, "input tensor 'pixels': the model has no such input"),
    ({"data": ["a"] * 12}, 400, "is not a FP32 value"),
    (None, 404, "unknown model 'nope'"),
])
def test_oip_bad_tensors_are_one_line_and_the_server_keeps_serving(oip, change, status, needle):
    server, _ = oip
    x = _rows(2, 7)
    path = f"/v2/models/{'nope' if change is None else server.model_name}/infer"
    got, answer = _call(server, "POST", path, _infer_body(x, **(change or {})))
    assert got == status and needle in answer["error"] and "\n" not in answer["error"]
    assert _call(server, "POST", f"/v2/models/{server.model_name}/infer", _infer_body(x))[0] == 200


def _raw_call(server, path: str, text: str) -> tuple[int, dict | str]:
    """POST ``text`` as it is (a JSON number such as 1e400 that json.dumps would not write)."""
    conn = http.client.HTTPConnection(*server.server_address[:2], timeout=30)
    conn.request("POST", path, text.encode(), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    raw = resp.read().decode()
    conn.close()
    return resp.status, (json.loads(raw) if resp.getheader("Content-Type", "").startswith("application/json") else raw)


def _body_text(elements: list[str], datatype: str = "FP32", shape=(2, 6)) -> str:
    return (f'{{"inputs": [{{"name": "input", "shape": {list(shape)}, "datatype": "{datatype}", '
            f'"data": [{", ".join(elements)}]}}]}}')


@pytest.mark.parametrize("element, needle", [
    ("1e39", "input tensor 'input': element 3 (1e+39) lies outside FP32's range [-3.40282e+38, 3.40282e+38]"),
    ("-3.5e38", "input tensor 'input': element 3 (-3.5e+38) lies outside FP32's range"),
    ("1e400", "input tensor 'input': element 3 'inf' is not a finite FP32 value"),
    ("-1e400", "element 3 '-inf' is not a finite FP32 value"),
    ("NaN", "the request body is not valid JSON (NaN is not a JSON number)"),
    ("Infinity", "the request body is not valid JSON (Infinity is not a JSON number)"),
    ("true", "element 3 'True' is not a FP32 value"),
    ("null", "element 3 'NoneType' is not a FP32 value"),
])
def test_oip_a_value_the_datatype_cannot_hold_is_400_naming_the_tensor(oip, element, needle):
    """1e39 is no FP32 value (the cast would make it infinity): 400 before the model runs, as NaN and infinity."""
    server, engine = oip
    passes = engine.scheduler.passes
    elements = ["0.5"] * 12
    elements[3] = element
    status, answer = _raw_call(server, f"/v2/models/{server.model_name}/infer", _body_text(elements))
    assert status == 400 and needle in answer["error"] and "\n" not in answer["error"], answer
    assert engine.scheduler.passes == passes  # refused before any pass
    status, _ = _raw_call(server, f"/v2/models/{server.model_name}/infer", _body_text(["3.4e38"] + ["0.5"] * 11))
    assert status == 200  # the largest FP32 values are values


def test_oip_an_output_overflowing_on_finite_input_is_a_json_500_naming_it(tmp_path):
    """A model that overflows on a client's finite, representable input: one JSON line naming the output (the
    server's problem, 500), never a plain-text 500 from the JSON encoder; the server keeps serving."""
    from prunus.serve.oip_server import OIPServer

    torch.manual_seed(0)
    save_module(build_module("test_serve_predict:exploding", {}), tmp_path / "m", stage="test", task="regression",
                input={"shape": [6], "dtype": "float32"})
    with Engine.load(tmp_path / "m", trust_factory=True, max_batch=4, max_delay_ms=1, threads=1) as engine:
        server = OIPServer(engine, "127.0.0.1", 0)
        threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        try:
            path = f"/v2/models/{server.model_name}/infer"
            status, answer = _call(server, "POST", path, _infer_body(np.full((2, 6), 300.0, np.float32)))
            assert status == 500 and "\n" not in answer["error"], answer
            assert re.fullmatch(r"output tensor 'output': the model produced inf at element \d+ of 6 from finite "
                                r"inputs \(an overflow in the model\), which JSON cannot carry; .*", answer["error"])
            status, answer = _call(server, "POST", path, _infer_body(np.full((1, 6), 0.01, np.float32)))
            assert status == 200 and np.isfinite(answer["outputs"][0]["data"]).all()
        finally:
            server.shutdown()
            server.server_close()


# --- fuzz: the Open Inference Protocol tensor reader ----------------------------------------------------------------

# JSON numbers and values at and past every datatype's edges, and the JSON specials
SPECIALS = ["NaN", "Infinity", "-Infinity", "1e39", "-1e39", "1e400", "-1e400", "1e-400", "-0.0", "3.4028235e38",
            "3.4028236e38", "3.5e38", "65504", "65520", "70000", "-65536", "1.7976931348623157e308", "0", "1", "-1",
            "127", "128", "-128", "-129", "255", "256", "32767", "32768", "2147483647", "2147483648",
            "9223372036854775807", "9223372036854775808", "18446744073709551615", "18446744073709551616",
            "-9223372036854775808", "-9223372036854775809", "true", "false", "null", '"7"', "0.5", "1.5", "-2.25"]


def _holds(datatype: str, text: str) -> bool:
    """The oracle: whether JSON ``text`` is one value of ``datatype`` (an integer within its range, a number that
    stays finite when cast, a boolean; JSON's NaN / Infinity refused, integers beyond 64 bits refused)."""
    from prunus.runtime.tensor_spec import DATATYPES

    try:
        v = json.loads(text, parse_constant=lambda c: (_ for _ in ()).throw(ValueError(c)))
    except ValueError:
        return False
    if isinstance(v, int) and not isinstance(v, bool) and abs(v) >= 1 << 64:
        return False
    if datatype == "BOOL":
        return isinstance(v, bool)
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return False
    dtype = np.dtype(DATATYPES[datatype])
    if dtype.kind in "iu":
        return isinstance(v, int) and np.iinfo(dtype).min <= v <= np.iinfo(dtype).max
    with np.errstate(over="ignore"):
        return math.isfinite(v) and bool(np.isfinite(np.array(v, dtype)))


def _random_tensor(rng: random.Random, datatype: str) -> tuple[list[str], bool]:
    """(JSON texts of elements, whether all are values of ``datatype``) for 1-12 elements."""
    n = rng.randint(1, 12)
    texts = []
    for _ in range(n):
        if rng.random() < 0.3:
            texts.append(rng.choice(SPECIALS))
        elif datatype == "BOOL":
            texts.append(rng.choice(["true", "false"]))
        elif datatype.startswith(("INT", "UINT")):
            texts.append(str(rng.randint(-200, 200)))
        else:
            texts.append(repr(rng.uniform(-1e3, 1e3)))
    return texts, all(_holds(datatype, t) for t in texts)


def test_fuzz_the_oip_tensor_reader():
    """Seeded, time-bounded: random datatypes, shapes and elements (JSON specials, every datatype's edges), with
    random structural damage (shape, datatype, name, count, nesting). A request is accepted exactly when every
    element is a value of the model's datatype and the structure fits, and then its array has the model's dtype
    and the request's shape, every float finite; anything else is one 400 line. Never another exception."""
    from prunus.runtime.tensor_spec import DATATYPES, TensorSpec
    from prunus.serve.http_guard import BadRequest, parse_json_body
    from prunus.serve.oip_tensors import parse_infer

    rng, deadline, seen = random.Random(4242), time.monotonic() + 3.0, {"accepted": 0, "refused": 0}
    for case in range(20000):
        if time.monotonic() > deadline:
            break
        datatype = rng.choice(list(DATATYPES))
        texts, values = _random_tensor(rng, datatype)
        spec = TensorSpec("input", datatype, (len(texts),))
        shape, sent_type, name, data = [1, len(texts)], datatype, "input", f"[{', '.join(texts)}]"
        damage = rng.randrange(8)
        if damage == 0:
            shape = rng.choice([[1], [2, len(texts)], [0, len(texts)], [1, len(texts) + 1], [-1, len(texts)], []])
        elif damage == 1:
            sent_type = rng.choice([*DATATYPES, "fp32", "BYTES", 7])
        elif damage == 2:
            name = rng.choice(["x", "", 7])
        elif damage == 3:
            data = rng.choice([f"[[{', '.join(texts)}]]", f"[{', '.join(texts[1:])}]", "3", "null", '"abc"', "{}"])
        structure_ok = damage >= 4 or (damage == 1 and sent_type == datatype) or (damage == 3 and data.startswith("[["))
        text = (f'{{"inputs": [{{"name": {json.dumps(name)}, "shape": {json.dumps(shape)}, '
                f'"datatype": {json.dumps(sent_type)}, "data": {data}}}]}}')
        try:
            tensors, _, _ = parse_infer(parse_json_body(text.encode()), [spec], ["output"])
        except BadRequest as e:
            assert e.status == 400 and "\n" not in str(e) and not (structure_ok and values), (text, str(e))
            seen["refused"] += 1
            continue
        a = tensors["input"]
        assert structure_ok and values, text
        assert a.dtype == spec.dtype and list(a.shape) == shape, text
        assert a.dtype.kind != "f" or np.isfinite(a).all(), text
        seen["accepted"] += 1
    assert seen["accepted"] > 50 and seen["refused"] > 50, seen


def test_fuzz_oip_requests_are_answered_200_or_400_in_json(oip):
    """Seeded, time-bounded: random FP32 bodies (moderate values and the specials and edges above, broken
    structure) through the running server: 200 with finite outputs, or one JSON 400 line; never a 500."""
    server, _ = oip
    rng, deadline, statuses = random.Random(99), time.monotonic() + 3.0, set()
    path = f"/v2/models/{server.model_name}/infer"
    huge_but_fp32 = {"3.4028235e38", "3.5e38", "1.7976931348623157e308", "3.4028236e38"}  # may overflow the model
    for _ in range(60):
        if time.monotonic() > deadline:
            break
        elements = [rng.choice([t for t in SPECIALS if t not in huge_but_fp32]) if rng.random() < 0.2 else
                    repr(rng.uniform(-1e6, 1e6)) for _ in range(12)]
        shape = (2, 6) if rng.random() < 0.8 else rng.choice([(3, 4), (2, 5), (12,)])
        status, answer = _raw_call(server, path, _body_text(elements, shape=shape))
        assert isinstance(answer, dict) and status in (200, 400), (status, answer)
        if status == 200:
            assert np.isfinite(answer["outputs"][0]["data"]).all()
        else:
            assert "\n" not in answer["error"]
        statuses.add(status)
    assert statuses == {200, 400}


def test_oip_request_fields_are_honoured_or_refused(oip):
    """``outputs`` naming the model's output is honoured (it is always returned); any other name, and
    ``parameters`` other than the binary data and classification extensions' (shared memory, priority), are refused
    rather than ignored (binary data: tests/test_oip_kserve.py; classification: tests/test_oip_classification.py)."""
    server, _ = oip
    path, x = f"/v2/models/{server.model_name}/infer", _rows(2, 9)
    status, answer = _call(server, "POST", path, {**_infer_body(x), "outputs": [{"name": "output"}]})
    assert status == 200 and [o["name"] for o in answer["outputs"]] == ["output"]
    for body, needle in (({**_infer_body(x), "outputs": [{"name": "probs"}]}, "output tensor 'probs': the model has no"),
                         ({**_infer_body(x), "outputs": [{"name": "output", "parameters": {"shared_memory_region": "r"}}]},
                          "parameters supported are binary_data and classification"),
                         ({**_infer_body(x), "parameters": {"priority": 1}}, "'parameters'"),
                         (_infer_body(x, parameters={"shared_memory_region": "r"}), "binary_data_size")):
        got, answer = _call(server, "POST", path, body)
        assert got == 400 and needle in answer["error"] and "\n" not in answer["error"], answer


def test_oip_64_concurrent_clients_none_lost(oip):
    server, engine = oip
    name, xs = server.model_name, [_rows(1 + i % 2, 100 + i) for i in range(64)]

    def client(x):
        for _ in range(100):  # a full queue answers 429: the client retries, as it is told to
            status, answer = _call(server, "POST", f"/v2/models/{name}/infer", _infer_body(x))
            if status != 429:
                return status, answer
        return status, answer

    with ThreadPoolExecutor(64) as pool:
        answers = list(pool.map(client, xs))
    assert [s for s, _ in answers] == [200] * 64
    for x, (_, answer) in zip(xs, answers):
        got = np.array(answer["outputs"][0]["data"], np.float32).reshape(len(x), 3)
        assert np.abs(got - engine.predict(x)).max() <= TOL
    assert engine.scheduler.max_requests_in_pass > 1


@pytest.mark.slow
def test_oip_keeps_the_door_probes_open(dirs):  # and serves an export dir
    from prunus.serve.http_access import ServeAccess
    from prunus.serve.oip_server import OIPServer

    with Engine.load(dirs[1], max_batch=4, threads=1) as engine:
        server = OIPServer(engine, "127.0.0.1", 0, access=ServeAccess(api_key="k3y"))
        threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        try:
            assert _call(server, "GET", "/v2/health/ready") == (200, {"ready": True})  # a probe needs no key
            status, answer = _call(server, "POST", f"/v2/models/{server.model_name}/infer", _infer_body(_rows(1, 0)))
            assert status == 401 and "API key" in answer["error"]
            conn = http.client.HTTPConnection(*server.server_address[:2], timeout=30)
            conn.request("GET", f"/v2/models/{server.model_name}", headers={"Host": "evil.example", "Authorization": "Bearer k3y"})
            assert conn.getresponse().status == 403
            conn.close()
        finally:
            server.shutdown()
            server.server_close()


def test_cli_serve_routes_a_generic_dir_and_asks_for_trust(model_dir, assert_user_error):
    from click.testing import CliRunner

    from prunus.cli.main import cli

    result = CliRunner().invoke(cli, ["serve", str(model_dir), "--port", "0"])
    assert_user_error(result, "pass --trust-factory")


def test_cli_serve_picks_the_inference_protocol_for_a_generic_dir(model_dir, monkeypatch):
    from click.testing import CliRunner

    from prunus.cli.main import cli
    from prunus.serve.oip_server import OIPServer

    seen, serve = [], OIPServer.serve_forever

    def serve_once(server, poll_interval):  # one metadata call on the real loop, then Ctrl-C
        thread = threading.Thread(target=serve, args=(server, 0.05), daemon=True)
        thread.start()
        seen.append(_call(server, "GET", f"/v2/models/{server.model_name}")[1]["inputs"])
        server.shutdown()
        raise KeyboardInterrupt

    monkeypatch.setattr(OIPServer, "serve_forever", serve_once)
    result = CliRunner().invoke(cli, ["serve", str(model_dir), "--trust-factory", "--port", "0", "--max-delay-ms", "1"])
    assert result.exit_code == 0, result.output
    assert seen == [[{"name": "input", "datatype": "FP32", "shape": [-1, 6]}]]
    assert "max delay 1 ms, POST /v2/models/m/infer" in result.stderr


def test_the_registry_routes_generic_dirs_to_predict_runtimes():
    from prunus.runtime.load_options import LoadOptions
    from prunus.runtime.registry import find_runtime

    module = {"kind": "module", "factory": FACTORY}
    exported = {**module, "export": {"format": "onnx", "graph": "module"}}
    assert find_runtime("torch", module, LoadOptions()).name == "torch_module"
    assert find_runtime("onnxruntime", exported, LoadOptions()).name == "ort_module"
    assert find_runtime("torch", {"model": {}}, LoadOptions()).name == "torch"
