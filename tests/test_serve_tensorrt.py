"""TrtRunner's own plumbing on CPU tensors, with stand-ins for TensorRT and the CUDA stream at its boundary.

The stand-ins compute nothing: the fake execution context reads back every input from the address
TrtRunner bound (to check shape, dtype, contiguity and values) and writes a marker, its position,
into every output's memory (to check each output comes back under its own name, with the shape and
dtype the engine reports). Real engines run in tests/test_export.py where TensorRT and a GPU exist.
"""

from __future__ import annotations

import ctypes
from types import SimpleNamespace

import pytest
import torch

from prunus.artifacts.errors import PrunusError
from prunus.runtime.tensorrt import TrtRunner, trt_dtypes

FAKE_TRT = SimpleNamespace(DataType=SimpleNamespace(FLOAT="FLOAT", HALF="HALF", INT64="INT64", INT32="INT32",
                                                    BF16="BF16"))
VOCAB, HEADS, HEAD_DIM = 7, 2, 4


def memory(ptr: int, shape, dtype: torch.dtype) -> torch.Tensor:
    """A tensor over the memory at ``ptr`` (no copy): what an engine reads and writes through an address."""
    n = int(torch.Size(shape).numel()) * torch.empty((), dtype=dtype).element_size()
    return torch.frombuffer((ctypes.c_byte * n).from_address(ptr), dtype=dtype).view(shape)


class FakeEngine:
    """A decode engine's bindings as TensorRT describes them: int32 token ids, fp16 keys and values."""

    dtypes = {"input_ids": "INT32", "position_ids": "INT64", "attention_mask": "INT64", "past.0.key": "HALF",
              "past.0.value": "HALF", "logits": "FLOAT", "present.0.key": "HALF", "present.0.value": "HALF"}

    def __init__(self, log):
        self.log = log

    def get_tensor_dtype(self, name):
        return self.dtypes[name]

    def create_execution_context(self):
        return FakeContext(self)


class FakeContext:
    def __init__(self, engine: FakeEngine):
        self.engine, self.shapes, self.addresses, self.seen, self.ok = engine, {}, {}, {}, True

    def set_input_shape(self, name, shape):
        self.shapes[name] = shape
        return True

    def set_tensor_address(self, name, ptr):
        self.addresses[name] = ptr
        return True

    def get_tensor_shape(self, name):
        """The output shapes the graph contract gives for the input shapes set (-1 until they are)."""
        if "input_ids" not in self.shapes:
            return (-1,)
        if name == "logits":
            return (*self.shapes["input_ids"], VOCAB)
        b, h, past, d = self.shapes[name.replace("present", "past")]
        return (b, h, past + 1, d)

    def execute_async_v3(self, stream_handle):
        self.engine.log.append(("execute", stream_handle))
        dtype = trt_dtypes(FAKE_TRT)
        for name, shape in self.shapes.items():
            self.seen[name] = memory(self.addresses[name], shape, dtype[self.engine.dtypes[name]]).clone()
        outputs = [n for n in self.addresses if n not in self.shapes]
        for i, name in enumerate(outputs):
            memory(self.addresses[name], self.get_tensor_shape(name), dtype[self.engine.dtypes[name]]).fill_(i + 1)
        return self.ok


class FakeRuntime:
    def __init__(self, log):
        self.log = log

    def deserialize_cuda_engine(self, blob: bytes):
        return None if blob == b"corrupt" else FakeEngine(self.log)


class FakeStream:
    cuda_stream = 1234

    def __init__(self, log):
        self.log = log

    def wait_stream(self, other):
        self.log.append(("wait", other))

    def synchronize(self):
        self.log.append(("synchronize",))


@pytest.fixture
def runner(tmp_path, monkeypatch):
    log = []
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: "torch's current stream")
    plans = {}
    for kind in ("prefill", "decode"):
        plans[kind] = tmp_path / f"{kind}.plan"
        plans[kind].write_bytes(b"plan")
    r = TrtRunner(FakeRuntime(log), plans, trt_dtypes(FAKE_TRT), torch.device("cpu"), FakeStream(log))
    r.log = log
    return r


def test_run_binds_every_input_and_output_by_name(runner):
    b, past = 3, 5
    feeds = {"input_ids": torch.tensor([[4], [5], [6]]), "position_ids": torch.tensor([[5], [5], [2]]),
             "attention_mask": torch.ones(b, past + 1, dtype=torch.long),
             "past.0.key": torch.randn(b, past, HEADS, HEAD_DIM).transpose(1, 2),  # not contiguous
             "past.0.value": torch.randn(b, HEADS, past, HEAD_DIM)}
    outputs = ["logits", "present.0.key", "present.0.value"]
    outs = runner.run("decode", feeds, outputs)
    ctx = runner.contexts["decode"]
    assert ctx.shapes == {n: tuple(t.shape) for n, t in feeds.items()}
    for name, t in feeds.items():  # converted to the engine's dtype, laid out contiguously, values intact
        want = t.to(trt_dtypes(FAKE_TRT)[FakeEngine.dtypes[name]])
        assert ctx.seen[name].dtype == want.dtype and torch.equal(ctx.seen[name], want), name
    assert [tuple(o.shape) for o in outs] == [(b, 1, VOCAB), (b, HEADS, past + 1, HEAD_DIM), (b, HEADS, past + 1, HEAD_DIM)]
    assert [o.dtype for o in outs] == [torch.float32, torch.float16, torch.float16]
    assert [o.unique().tolist() for o in outs] == [[1.0], [2.0], [3.0]]  # each output is the buffer bound to its name
    assert runner.log == [("wait", "torch's current stream"), ("execute", 1234), ("synchronize",)]
    assert not runner.contexts["prefill"].shapes  # one context per engine


def test_a_failed_run_and_an_unreadable_plan_are_one_clear_error(runner, tmp_path):
    runner.contexts["decode"].ok = False
    feeds = {"input_ids": torch.zeros(1, 1, dtype=torch.long), "past.0.key": torch.zeros(1, HEADS, 2, HEAD_DIM)}
    with pytest.raises(PrunusError, match="the decode engine failed to run"):
        runner.run("decode", feeds, ["present.0.key"])
    bad = tmp_path / "bad.plan"
    bad.write_bytes(b"corrupt")
    with pytest.raises(PrunusError, match="bad.plan: TensorRT cannot deserialize this engine"):
        TrtRunner(FakeRuntime([]), {"decode": bad}, trt_dtypes(FAKE_TRT), torch.device("cpu"), FakeStream([]))

