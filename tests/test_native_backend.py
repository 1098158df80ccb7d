"""The native runtime (prunus.runtime.native_backend): a model dir's stored float / int8 / int4 weights packed at
load, no export written, give the same packed numbers as its genai export's ``native_weights.safetensors`` and so the
same logits bit for bit; the torch model's logits within the kernels' stated tolerance (float32: 1e-5; int8 / int4,
whose kernels quantize activations to int8 per block of 32: 0.02, about 5x the 0.004 seen, on logits of standard
deviation 0.16); greedy tokens the
same alone and batched with different neighbours (8 of 8); rows are slots, released and reused out of order with no
row's logits changed; speculative (n-gram) greedy output identical to plain."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from prunus.compress.quantize import quantize_pass
from prunus.models import Transformer, get_preset, load_model, save_model
from prunus.native.build import unavailable
from prunus.serve import Engine

pytestmark = pytest.mark.skipif(unavailable() is not None, reason=str(unavailable()))

PRECISIONS = ("fp32", "int8", "int4")
TORCH_TOL = {"fp32": 1e-5, "int8": 0.02, "int4": 0.02}
_rng = random.Random(5)
PROMPTS = [[_rng.randrange(3, 250) for _ in range(_rng.randrange(1, 20))] for _ in range(8)]
NEW = 12


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    """Per precision: a model dir (int8 / int4 stored weights), the kernels checked on it as `prunus serve` checks
    it (so that native="auto" serves it in them), and its genai export."""
    from prunus.export import export_model, prepared_path
    from prunus.runtime.load_options import LoadOptions

    root = tmp_path_factory.mktemp("native-backend")
    torch.manual_seed(0)
    model = Transformer(get_preset("tiny"))
    model.init_weights()
    save_model(model.eval(), root / "fp32", stage="test")
    out = {}
    for precision in PRECISIONS:
        if precision != "fp32":
            scheme = f"{precision}-weight-only"
            quantized = quantize_pass(load_model(root / "fp32"), None, scheme=scheme, exclude=[])
            save_model(quantized, root / precision, stage="compress", parent=root / "fp32", command="test")
        export_model(root / precision, root / f"{precision}-export", graph="genai", progress=False)
        assert prepared_path(root / precision, None, LoadOptions(), False, progress=False)[0] == root / precision
        out[precision] = (root / precision, root / f"{precision}-export")
    return out


def _arrays(packed) -> dict:
    """Every array of packed weights by a name."""
    out = {n: getattr(packed, n) for n in ("emb", "cos", "sin", "norm")}
    for i, layer in enumerate(packed.layers):
        for role, lin in layer.items():
            if hasattr(lin, "kind"):
                out.update({f"{i}.{role}.{a}": getattr(lin, a) for a in ("w", "s", "sz", "bias")})
            elif isinstance(lin, np.ndarray):
                out[f"{i}.{role}"] = lin
    out.update({f"head.{a}": getattr(packed.head, a) for a in ("w", "s", "sz", "bias")})
    return out


@pytest.mark.parametrize("precision", PRECISIONS)
def test_a_model_dir_packs_its_exports_native_weights_and_gives_its_logits(dirs, precision):
    """The model dir read directly packs the very arrays its export wrote; the same logits bit for bit, the torch
    model's within tolerance, every position of a prompt and decode steps."""
    model_dir, export = dirs[precision]
    with Engine.load(model_dir, max_batch=2, max_len=64, threads=1) as a, \
            Engine.load(export, max_batch=2, max_len=64, threads=1) as b:
        assert a.info["runtime"] == b.info["runtime"] == "native" and a.info["native"] == "on"
        assert a.info["precision"] == b.info["precision"] == precision and a.info["batch_invariant"]
        left, right = _arrays(a.backend.packed), _arrays(b.backend.packed)
        assert left.keys() == right.keys()
        for name in left:
            assert (left[name] is None) == (right[name] is None), name
            assert left[name] is None or np.array_equal(left[name], right[name]), name
        ids = [PROMPTS[2], PROMPTS[5]]
        seen = [be.verify_rows([1, 0], ids) if be.prefill([0, 1], [[1], [1]]) is not None else None
                for be in (a.backend, b.backend)]
        assert all(torch.equal(x, y) for x, y in zip(*seen))
    reference = load_model(model_dir).float()
    with torch.no_grad():
        for row, piece in zip((1, 0), ids):
            want = reference(torch.tensor([[1] + piece]))[0, 1:]
            assert (seen[0][[1, 0].index(row)] - want).abs().max() < TORCH_TOL[precision]


@pytest.mark.parametrize("precision", PRECISIONS)
def test_greedy_tokens_alone_and_batched_equal_the_exports(dirs, precision):
    model_dir, export = dirs[precision]
    runs = []
    for path in (model_dir, export):
        with Engine.load(path, max_batch=8, max_len=64, threads=2) as engine:
            alone = [engine.wait(engine.submit(p, NEW, temperature=0.0, ignore_eos=True)).token_ids for p in PROMPTS]
            requests = [engine.submit(p, NEW, temperature=0.0, ignore_eos=True) for p in PROMPTS]
            runs.append((alone, [engine.wait(r).token_ids for r in requests]))
    assert runs[0][0] == runs[0][1] == runs[1][0] == runs[1][1]  # 8 of 8, alone, batched, either artifact


def test_rows_are_slots_released_and_reused_out_of_order(dirs):
    """Rows anywhere in the buffer, in any order, one leaving and another taking its slot mid-way: each row's
    logits are the bits it gives alone (the kernels are batch-invariant, and nothing moves)."""
    model_dir, _ = dirs["int8"]
    with Engine.load(model_dir, max_batch=6, max_len=64, threads=2) as e:
        backend = e.backend

        def alone(prompt, steps):
            backend.prefill([4], [prompt])
            out = [backend.decode([4], [t]) for t in steps]
            backend.release(4)
            return out

        p = {5: PROMPTS[0], 0: PROMPTS[1], 3: PROMPTS[2], 1: PROMPTS[3]}
        want = {r: alone(p[r], [7, 8, 9]) for r in p}
        backend.prefill([5, 0, 3], [p[5], p[0], p[3]])
        got = {r: [] for r in p}
        step = backend.decode([3, 5, 0], [7, 7, 7])
        for i, r in enumerate((3, 5, 0)):
            got[r].append(step[i:i + 1])
        backend.release(0)
        backend.prefill([1], [p[1]])  # row 1 joins while 0 is free
        step = backend.decode([1, 3, 5], [7, 8, 8])
        for i, r in enumerate((1, 3, 5)):
            got[r].append(step[i:i + 1])
        step = backend.decode([5, 1, 3], [9, 8, 9])
        for i, r in enumerate((5, 1, 3)):
            got[r].append(step[i:i + 1])
        for r in (5, 3, 1):
            assert all(torch.equal(a, b) for a, b in zip(got[r], want[r])), r
        assert torch.equal(got[0][0], want[0][0])
        with pytest.raises(Exception, match="never prefilled"):
            backend.decode([0], [1])


@pytest.mark.parametrize("precision", ("fp32", "int4"))
def test_ngram_speculation_gives_plain_greedy_tokens(dirs, precision):
    model_dir, _ = dirs[precision]
    prompt = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6]
    with Engine.load(model_dir, max_batch=2, max_len=64, threads=1) as plain:
        want = plain.wait(plain.submit(prompt, 20, temperature=0.0, ignore_eos=True)).token_ids
    with Engine.load(model_dir, max_batch=2, max_len=64, threads=1, draft="ngram", draft_tokens=3) as e:
        assert e.info["runtime"] == "native"
        got = e.wait(e.submit(prompt, 20, temperature=0.0, ignore_eos=True)).token_ids
        assert e.info["speculative"]["steps"] > 0
    assert got == want


def test_options_only_torch_serves_keep_a_model_dir_on_torch(dirs):
    model_dir, _ = dirs["fp32"]
    for kwargs, why in (({"backend": "torch"}, "--backend torch was asked for"),
                        ({"dtype": "bfloat16"}, "dtype=bfloat16"), ({"native": False}, "native=False")):
        with Engine.load(model_dir, max_batch=1, max_len=32, threads=1, compile=False, **kwargs) as e:
            assert e.info["runtime"] == "torch" and why in e.info["native"], e.info["native"]
    with Engine.load(model_dir, max_batch=1, max_len=32, threads=1, kv_dtype="f16") as e:
        assert e.info["runtime"] == "native" and e.backend.k[0].dtype == np.float16


def test_the_kernels_parity_check_of_a_dir_is_run_once_kept_and_obeyed(dirs, tmp_path, monkeypatch):
    """A model dir served natively by `prunus serve` has the kernels checked on it with the export's limits, once per
    content and kernel path (kept in prunus's cache); until then, and after a kept failure, native="auto" keeps off
    that dir, with the figures in the reason, and `prunus serve` prepares its ONNX Runtime export instead."""
    import json

    from prunus.export import prepared_path
    from prunus.export import native_dir_parity
    from prunus.runtime.load_options import LoadOptions
    from prunus.runtime.native_parity import dir_parity

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setenv("PRUNUS_CACHE_DIR", str(tmp_path / "cache"))
    model_dir, _ = dirs["int4"]
    assert dir_parity(model_dir) is None
    with Engine.load(model_dir, max_batch=1, max_len=32, threads=1) as e:
        assert e.info["runtime"] == "torch" and "have not been checked on this model dir" in e.info["native"]
    with Engine.load(model_dir, max_batch=1, max_len=32, threads=1, native=True) as e:
        assert e.info["native_parity"].startswith("not checked on this kernel path yet")
    path, info = prepared_path(model_dir, None, LoadOptions(), False, progress=False)
    record = dir_parity(model_dir)
    assert path == model_dir and "directly" in info["skipped"] and record["passed"] is True
    assert record["checked"] and record["precision"] == "int4" and 0.9 <= record["top1_agreement"] <= 1
    with Engine.load(model_dir, max_batch=1, max_len=32, threads=1) as e:
        assert e.info["native_parity"].startswith(f"passed on {record['isa']} (top-1 ")
    monkeypatch.setattr(native_dir_parity, "check_native_dir", lambda d: pytest.fail("checked twice"))
    assert prepared_path(model_dir, None, LoadOptions(), False, progress=False)[0] == model_dir
    kept = next((tmp_path / "cache" / "native-parity").glob("*.json"))
    kept.write_text(json.dumps({**record, "passed": False, "failed": ["max_abs_logits"], "max_abs_logits": 9.0}))
    with Engine.load(model_dir, max_batch=1, max_len=32, threads=1) as e:
        assert e.info["runtime"] == "torch"
        assert "the model dir's parity check failed on the native kernels" in e.info["native"]
        assert "max_abs_logits 9 (limit" in e.info["native"]
    with Engine.load(model_dir, max_batch=1, max_len=32, threads=1, native=True) as e:
        assert e.info["runtime"] == "native"  # asked for by name: served, as asked
    monkeypatch.setattr("prunus.export.export_dir.export_model", lambda *a, **k: pytest.fail("prepared"))
    with pytest.raises(BaseException, match="prepared"):  # under auto the export is prepared instead
        prepared_path(model_dir, None, LoadOptions(), False, progress=False)
