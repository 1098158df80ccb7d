"""The Open Inference Protocol's classification extension as Triton serves it: an output asked for with
``"parameters": {"classification": k}`` comes back as BYTES ``[rows, k]`` of ``"score:index:label"``, labels from
the model dir's labels.json (class indices without one), in JSON and binary, raw HTTP and tritonclient's
``InferRequestedOutput(name, class_count=k)``; bad k, a BYTES input, and a labels.json that does not fit the
output are one line; the ONNX export dir (which carries labels.json) answers the same.

The model is defined here: one Linear layer from 4 features to 3 class scores.
"""

from __future__ import annotations

import http.client
import json
import threading

import numpy as np
import pytest
import torch
from torch import nn

from prunus.artifacts.errors import PrunusError
from prunus.data.tables import LABELS_FORMAT
from prunus.models.module_dir import save_module
from prunus.models.module_factory import build_module
from prunus.serve import Engine

FACTORY = "test_oip_classification:tiny"
CLASSES = [7, "cat", "dog"]  # a table's classes, in the order training maps them (integers before text)


def tiny(out: int = 3):
    return nn.Sequential(nn.Linear(4, out))


def _save(path, labels: list | None, out: int = 3):
    torch.manual_seed(0)
    extra = None if labels is None else {"labels.json": json.dumps(
        {"format": LABELS_FORMAT, "target": "label", "features": ["a", "b", "c", "d"], "classes": labels}).encode()}
    save_module(build_module(FACTORY, {"out": out}), path, stage="test", task="classification",
                input={"shape": [4], "dtype": "float32"}, extra_files=extra)
    return path


class Served:
    """A running OIPServer over the dir at ``path`` (a thread), with its engine."""

    def __init__(self, path):
        from prunus.serve.oip_server import OIPServer

        self.engine = Engine.load(path, trust_factory=FACTORY, max_batch=16, max_delay_ms=1, threads=1)
        self.server = OIPServer(self.engine, "127.0.0.1", 0)
        threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        self.url = "%s:%d" % tuple(self.server.server_address[:2])

    def close(self):
        self.server.shutdown()
        self.server.server_close()
        self.engine.close()

    def post(self, body: bytes, headers: dict | None = None) -> tuple[int, dict, bytes]:
        conn = http.client.HTTPConnection(*self.server.server_address[:2], timeout=30)
        conn.request("POST", f"/v2/models/{self.server.model_name}/infer", body, headers or {})
        resp = conn.getresponse()
        raw = resp.read()
        conn.close()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, raw

    def get(self, path: str) -> dict:
        conn = http.client.HTTPConnection(*self.server.server_address[:2], timeout=30)
        conn.request("GET", path)
        resp = conn.getresponse()
        answer = json.loads(resp.read())
        conn.close()
        return answer


@pytest.fixture(scope="module")
def labelled(tmp_path_factory):
    served = Served(_save(tmp_path_factory.mktemp("cls") / "m", CLASSES))
    yield served
    served.close()


@pytest.fixture(scope="module")
def unlabelled(tmp_path_factory):
    served = Served(_save(tmp_path_factory.mktemp("cls") / "plain", None))
    yield served
    served.close()


def _rows(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, 4)).astype(np.float32)


def _body(x: np.ndarray, **output_params) -> bytes:
    return json.dumps({"inputs": [{"name": "input", "datatype": "FP32", "shape": list(x.shape),
                                   "data": x.reshape(-1).tolist()}],
                       "outputs": [{"name": "output", "parameters": output_params}]}).encode()


def _expected(scores: np.ndarray, k: int, labels: list[str]) -> list[list[tuple[float, int, str]]]:
    order = np.argsort(-scores, axis=1, kind="stable")[:, :k]
    return [[(float(scores[r, i]), int(i), labels[i]) for i in row] for r, row in enumerate(order)]


def _parsed(strings) -> list[tuple[float, int, str]]:
    out = []
    for s in strings:
        score, index, label = (s.decode() if isinstance(s, bytes) else s).split(":", 2)
        out.append((float(score), int(index), label))
    return out


def _check(got: list, want: list) -> None:
    assert [[(i, lab) for _, i, lab in row] for row in got] == [[(i, lab) for _, i, lab in row] for row in want]
    assert all(np.float32(g[0]) == np.float32(w[0]) for gr, wr in zip(got, want) for g, w in zip(gr, wr))


@pytest.mark.parametrize("k", [1, 2, 3])
def test_json_classification_returns_top_k_with_class_names(labelled, k):
    x = _rows(5, k)
    scores = labelled.engine.predict(x)
    status, headers, raw = labelled.post(_body(x, classification=k))
    assert status == 200 and headers["content-type"] == "application/json", raw[:300]
    out = json.loads(raw)["outputs"][0]
    assert out["name"] == "output" and out["datatype"] == "BYTES" and out["shape"] == [5, k]
    got = _parsed(out["data"])
    _check([got[r * k:(r + 1) * k] for r in range(5)], _expected(scores, k, [str(c) for c in CLASSES]))


def test_k_above_the_class_count_ranks_every_class(labelled):
    x = _rows(2, 11)
    status, _, raw = labelled.post(_body(x, classification=50))
    out = json.loads(raw)["outputs"][0]
    assert status == 200 and out["shape"] == [2, 3]
    assert sorted(lab for _, _, lab in _parsed(out["data"][:3])) == ["7", "cat", "dog"]


def test_binary_classification_is_length_prefixed_bytes(labelled):
    x = _rows(3, 5)
    scores = labelled.engine.predict(x)
    status, headers, raw = labelled.post(_body(x, classification=2, binary_data=True))
    assert status == 200 and headers["content-type"] == "application/octet-stream"
    n = int(headers["inference-header-content-length"])
    entry = json.loads(raw[:n])["outputs"][0]
    tail = raw[n:]
    assert entry["datatype"] == "BYTES" and entry["shape"] == [3, 2]
    assert entry["parameters"]["binary_data_size"] == len(tail)
    strings, offset = [], 0
    while offset < len(tail):
        size = int.from_bytes(tail[offset:offset + 4], "little")
        strings.append(tail[offset + 4:offset + 4 + size])
        offset += 4 + size
    got = _parsed(strings)
    _check([got[r * 2:(r + 1) * 2] for r in range(3)], _expected(scores, 2, [str(c) for c in CLASSES]))


def test_without_labels_the_index_is_the_label(unlabelled):
    x = _rows(4, 2)
    scores = unlabelled.engine.predict(x)
    status, _, raw = unlabelled.post(_body(x, classification=3))
    assert status == 200
    got = _parsed(json.loads(raw)["outputs"][0]["data"])
    _check([got[r * 3:(r + 1) * 3] for r in range(4)], _expected(scores, 3, ["0", "1", "2"]))
    assert "parameters" not in unlabelled.get(f"/v2/models/{unlabelled.server.model_name}")


def test_metadata_lists_the_labels_and_the_extension(labelled):
    meta = labelled.get(f"/v2/models/{labelled.server.model_name}")
    assert meta["parameters"] == {"labels": "labels.json", "classes": 3}
    assert "classification" in labelled.get("/v2")["extensions"]


@pytest.mark.parametrize("params, needle", [
    ({"classification": 0}, "classification must be the number of top classes"),
    ({"classification": True}, "classification must be"),
    ({"classification": "2"}, "classification must be"),
    ({"classification": 2, "binary_data": "yes"}, "binary_data must be true or false"),
    ({"classification": 2, "top": 1}, "parameters supported are binary_data and classification"),
])
def test_bad_classification_parameters_are_one_line_400(labelled, params, needle):
    status, _, raw = labelled.post(_body(_rows(1, 0), **params))
    error = json.loads(raw)["error"]
    assert status == 400 and needle in error and "\n" not in error, error


def test_bytes_inputs_stay_refused(labelled):
    body = json.dumps({"inputs": [{"name": "input", "datatype": "BYTES", "shape": [1, 4], "data": ["a"] * 4}],
                       "outputs": [{"name": "output", "parameters": {"classification": 1}}]}).encode()
    status, _, raw = labelled.post(body)
    assert status == 400 and "datatype BYTES is not served here" in json.loads(raw)["error"]


def test_labels_that_do_not_fit_the_output_are_one_line(tmp_path):
    from prunus.serve.oip_server import OIPServer

    path = _save(tmp_path / "m", ["a", "b"])  # 2 names, 3 scores
    with Engine.load(path, trust_factory=FACTORY, threads=1) as engine:
        with pytest.raises(PrunusError, match=r"labels.json: 2 class names where output 'output' scores shape \[3\]"):
            OIPServer(engine, "127.0.0.1", 0)


def test_tritonclient_class_count(labelled):
    httpclient = pytest.importorskip("tritonclient.http")
    x = _rows(3, 8)
    scores = labelled.engine.predict(x)
    client = httpclient.InferenceServerClient(labelled.url)
    tensor = httpclient.InferInput("input", [3, 4], "FP32")
    tensor.set_data_from_numpy(x, binary_data=True)
    for binary in (True, False):
        out = httpclient.InferRequestedOutput("output", binary_data=binary, class_count=2)
        got = client.infer(labelled.server.model_name, [tensor], outputs=[out]).as_numpy("output")
        assert got.shape == (3, 2)
        _check([_parsed(row) for row in got], _expected(scores, 2, [str(c) for c in CLASSES]))
    client.close()


@pytest.mark.slow  # an ONNX export
def test_export_dir_serves_the_same_class_names(labelled, tmp_path):
    from prunus.export.module_export import export_module

    export_module(labelled.engine.info["path"], tmp_path / "exp", trust_factory=True)
    served = Served(tmp_path / "exp")
    try:
        x = _rows(4, 3)
        status, _, raw = served.post(_body(x, classification=3))
        assert status == 200 and served.engine.info["runtime"] == "ort_module"
        got = _parsed(json.loads(raw)["outputs"][0]["data"])
        want = _expected(labelled.engine.predict(x), 3, [str(c) for c in CLASSES])
        assert [[(i, lab) for _, i, lab in got[r * 3:(r + 1) * 3]] for r in range(4)] == \
            [[(i, lab) for _, i, lab in row] for row in want]
        assert served.get(f"/v2/models/{served.server.model_name}")["parameters"]["labels"] == "labels.json"
    finally:
        served.close()
