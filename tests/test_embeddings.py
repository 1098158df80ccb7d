"""Embeddings (prunus.serve.embeddings): Engine.embed and POST /v1/embeddings equal a direct forward pass of the
model (the final norm's output pooled, 1e-5), batched with padding, last and mean pooling, normalized or not,
float and base64; bad input and backends without the model in this process refused in one line / a 400."""

from __future__ import annotations

import base64
import http.client
import json
import threading

import numpy as np
import pytest
import torch

from prunus.artifacts.errors import PrunusError
from prunus.models import Transformer, get_preset, load_model, save_model
from prunus.serve import Engine
from prunus.serve.http_server import CompletionServer

TOL = 1e-5
TEXTS = ["def f(x):", "import os\nimport sys\n", "x"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    torch.manual_seed(0)
    model = Transformer(get_preset("tiny"))
    model.init_weights()
    return save_model(model.eval(), tmp_path_factory.mktemp("embed") / "model", stage="test")


@pytest.fixture(scope="module")
def engine(model_dir):
    with Engine.load(model_dir, max_batch=2, compile=False, threads=1, backend="torch") as engine:  # embeddings: torch
        yield engine


def direct(model, ids, pooling, normalize=True):
    """The final norm's output of one input alone, pooled."""
    with torch.no_grad():
        seen = {}
        handle = model.output.register_forward_pre_hook(lambda m, a: seen.setdefault("h", a[0]))
        model(torch.tensor([ids]))
        handle.remove()
    h = seen["h"][0]
    v = h[-1] if pooling == "last" else h.mean(0)
    return torch.nn.functional.normalize(v, dim=-1) if normalize else v


@pytest.mark.parametrize("pooling, normalize", [("last", True), ("mean", True), ("mean", False)])
def test_embed_equals_a_direct_forward_pass(engine, model_dir, pooling, normalize):
    model = load_model(model_dir).eval()
    got = engine.embed(TEXTS, pooling=pooling, normalize=normalize)  # 3 inputs: batches of 2 and 1, padded
    assert got.shape == (3, model.config.dim)
    for i, text in enumerate(TEXTS):
        want = direct(model, engine.tokenizer.encode(text), pooling, normalize)
        assert (got[i] - want).abs().max() <= TOL, (pooling, i)
    if normalize:
        assert torch.allclose(got.norm(dim=-1), torch.ones(3), atol=1e-5)
    assert (engine.embed(TEXTS[1], pooling=pooling, normalize=normalize)[0] - got[1]).abs().max() <= TOL  # alone
    assert engine.generate("x", 3, ignore_eos=True).token_ids  # generation still serves


@pytest.mark.parametrize("inputs, pooling, needle", [
    ([], "last", "input must be a string"),
    (["ok", ""], "last", "the prompt is empty"),
    (["ok"], "max", "pooling='max' must be one of last, mean"),
    ([[1, 2, 100000]], "last", "prompt token ids must lie in"),
])
def test_bad_embedding_inputs_are_one_line(engine, inputs, pooling, needle):
    with pytest.raises(PrunusError) as e:
        engine.embed(inputs, pooling=pooling)
    assert needle in str(e.value) and "\n" not in str(e.value)


def call(server, body):
    conn = http.client.HTTPConnection(*server.server_address[:2], timeout=60)
    conn.request("POST", "/v1/embeddings", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    out = json.loads(resp.read().decode())
    conn.close()
    return resp.status, out


def test_http_embeddings_float_and_base64(engine):
    server = CompletionServer(engine, port=0, served_model_names=["tiny"])
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        want = engine.embed(TEXTS)
        status, out = call(server, {"model": "tiny", "input": TEXTS})
        assert status == 200 and out["object"] == "list" and out["model"] == "tiny"
        assert [d["index"] for d in out["data"]] == [0, 1, 2]
        got = torch.tensor([d["embedding"] for d in out["data"]])
        assert (got - want).abs().max() <= TOL
        n = sum(len(engine.tokenizer.encode(t)) for t in TEXTS)
        assert out["usage"] == {"prompt_tokens": n, "total_tokens": n}
        ids = engine.tokenizer.encode(TEXTS[0])
        status, out = call(server, {"model": "tiny", "input": ids, "encoding_format": "base64"})
        assert status == 200
        raw = np.frombuffer(base64.b64decode(out["data"][0]["embedding"]), dtype="<f4")
        assert np.abs(raw - want[0].numpy()).max() <= TOL and out["usage"]["prompt_tokens"] == len(ids)
        for body, code in (({"model": "tiny", "input": "x", "encoding_format": "int8"}, 400),
                           ({"model": "tiny", "input": "x", "dimensions": 8}, 400), ({"input": "x"}, 400),
                           ({"input": "x", "model": "other"}, 404), ({"model": "tiny", "input": []}, 400)):
            status, out = call(server, body)
            assert status == code and "\n" not in out["error"]["message"], body
    finally:
        server.shutdown()
        server.server_close()


def test_other_backends_refuse_embeddings(engine, monkeypatch):
    from prunus.runtime.backend import Capabilities

    class Graph:  # a backend that does not declare embeddings
        name = "onnxruntime"
        capabilities = Capabilities(max_batch=2)

    monkeypatch.setattr(engine, "backend", Graph())
    monkeypatch.setattr(engine, "info", {**engine.info, "runtime": "native", "native_isa": "avx2"})
    with pytest.raises(PrunusError) as e:
        engine.embed(["x"])
    # the refusal names the runtime that serves (here the native kernels), not the backend family
    assert "this engine runs on prunus's native kernels (avx2); serve the model dir with --backend torch" in str(e.value)
