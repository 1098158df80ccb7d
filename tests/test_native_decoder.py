"""The native decoder (prunus's own CPU kernels over a genai export's weights): its linear kernels against numpy,
its passes against ONNX Runtime's on the same graph and the same KV buffers (fp32 exactly, with every family
variant the genai graph builds), quantized graphs against the PyTorch model, serving through it, and its refusals.
Skipped with the reason where the kernels cannot be built (no AVX2, no C compiler). The kernel and pass tests run
once per kernel path (avx2, avxvnni, avx512, avx512vnni, amx); a path this CPU lacks is skipped with that reason."""

from __future__ import annotations

import ctypes
import hashlib
import json
import shutil

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from safetensors import safe_open
from safetensors.numpy import save_file

from family_variants import family_model
from prunus.artifacts.errors import PrunusError
from prunus.artifacts.native_layout import NATIVE_WEIGHTS
from prunus.cli.main import cli
from prunus.compress.quantize import quantize_pass
from prunus.export import export_model
from prunus.export.genai_graph import GENAI_GRAPH, build_genai_graph, save_genai_graph
from prunus.export.native_weights import write_native_weights
from prunus.runtime.genai_session import GenaiSession
from prunus.models import generate, load_model, save_model
from prunus.serve import Engine
from prunus.runtime.ort_genai import GenaiBackend
from prunus.runtime.native import NativeSession
from prunus.runtime.native_backend import NativeBackend
from prunus.runtime.load_options import LoadOptions
from prunus.runtime.registry import check_options

from prunus.native.build import (ISA_ENV, ISAS, batch_invariant, default_isa, isa, isa_missing, library, set_isa,
                                 supported_isas, unavailable)

WHY = unavailable()
pytestmark = pytest.mark.skipif(WHY is not None, reason=f"native kernels unavailable: {WHY}")

from prunus.native.decoder import KV_DTYPES, NativeDecoder, _linear  # noqa: E402
from prunus.export.export_dir import genai_dims  # noqa: E402
from prunus.native.weights import pack_blocks, pack_f32, read_native_weights  # noqa: E402

PROMPTS = [[5, 6, 7], [9, 10, 11, 12, 13, 14, 15, 16, 17], [40], [3, 1, 4, 1, 5, 9]]


@pytest.fixture(params=ISAS)
def kernel_path(request):
    """The test runs with the linear layers on this kernel path (skipped where the CPU lacks it)."""
    why = isa_missing(request.param)
    if why is not None:
        pytest.skip(why)
    before = set_isa(request.param)
    try:
        yield request.param
    finally:
        set_isa(before)


def _run_linear(packed, x: np.ndarray, threads: int) -> np.ndarray:
    lib = library()
    pool = lib.prunus_pool_new(threads)
    try:
        y = np.zeros((x.shape[0], packed.n), np.float32)
        c = _linear(packed)
        lib.prunus_linear(ctypes.addressof(c), pool, x.shape[0], np.ascontiguousarray(x).ctypes.data, y.ctypes.data)
        return y
    finally:
        lib.prunus_pool_free(pool)


def _quantized_activations(x: np.ndarray) -> np.ndarray:
    """x as the kernels see it: blocks of 32 rounded to amax / 127 steps."""
    blocks = x.reshape(x.shape[0], -1, 32)
    scale = np.abs(blocks).max(-1, keepdims=True) / 127
    return (np.round(blocks / np.where(scale > 0, scale, 1)) * scale).reshape(x.shape)


@pytest.mark.parametrize("bits,zero", [(8, None), (8, "uint8"), (4, None), (4, "uint8")])
@pytest.mark.parametrize("m,threads", [(1, 1), (5, 2), (9, 2), (17, 2)])
def test_integer_kernels_equal_numpy(kernel_path, bits, zero, m, threads):
    """(q - zero) * scale against block-quantized activations, 37 output rows (not a multiple of the tile's 4); 17
    rows: a pass AMX takes (a chunk of 16 and one of 1, two groups of 16 outputs, the last tiles on AVX-512 VNNI)."""
    rng = np.random.default_rng(bits + m)
    n, k = 37, 96
    q = rng.integers(0, 2 ** bits, (n, k)).astype(np.uint8)
    scale = rng.uniform(0.01, 0.1, (n, k // 32)).astype(np.float32)
    z = None if zero is None else rng.integers(0, 2 ** bits, (n, k // 32)).astype(np.float32)
    bias = rng.standard_normal(n).astype(np.float32)
    x = rng.standard_normal((m, k)).astype(np.float32)
    x[0, 3] = 40.0  # an outlier: its own block's scale, not the row's
    mid = 128 if bits == 8 else 8
    zero = np.full((n, k // 32), mid, np.float32) if z is None else z
    w = (q.astype(np.float32) - np.repeat(zero, 32, axis=1)) * np.repeat(scale, 32, axis=1)
    want = _quantized_activations(x) @ w.T + bias
    got = _run_linear(pack_blocks(q, scale, z, bits, bias), x, threads)
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()


@pytest.mark.parametrize("m", [3, 9])
def test_float_kernel_equals_numpy(kernel_path, m):
    """9 rows: passes of six rows or more prefetch the next tile's weights as they go."""
    rng = np.random.default_rng(0)
    w = rng.standard_normal((13, 64)).astype(np.float32)
    x = rng.standard_normal((m, 64)).astype(np.float32)
    assert np.allclose(_run_linear(pack_f32(w), x, 2), x @ w.T, atol=1e-5)


@pytest.mark.parametrize("kind", ["f32", "q8", "q4"])
def test_prompt_sized_passes_equal_their_rows_one_at_a_time(kernel_path, kind):
    """A prompt's pass goes over the tiles once per block of rows that fits L2 (here 4096 inputs: 12 fp32 rows,
    48 int8 ones per block), fp32 three rows at a time: every row the same bits as that row alone (int8 and int4 on
    AVX2 / AVX-VNNI too, four rows at a time with the decode kernels' block math, the pairs left with the decode
    kernels), and numpy's."""
    rng = np.random.default_rng(1)
    n, k, m = 13, 4096, 101 if kind == "f32" else 197
    x = rng.standard_normal((m, k)).astype(np.float32)
    if kind == "f32":
        w = rng.standard_normal((n, k)).astype(np.float32)
        packed, want = pack_f32(w), x @ w.T
    else:
        bits = int(kind[1])
        q = rng.integers(0, 2 ** bits, (n, k)).astype(np.uint8)
        scale = rng.uniform(0.01, 0.1, (n, k // 32)).astype(np.float32)
        w = (q.astype(np.float32) - (128 if bits == 8 else 8)) * np.repeat(scale, 32, axis=1)
        packed, want = pack_blocks(q, scale, None, bits, None), _quantized_activations(x) @ w.T
    got = _run_linear(packed, x, 2)  # numpy divides by the block's scale where the kernels multiply by its inverse:
    assert np.abs(got - want).max() <= 1e-3 * np.abs(want).max()  # a few integers one step apart over 4096 inputs
    alone = np.concatenate([_run_linear(packed, x[i:i + 1], 1) for i in range(m)])
    if kind == "f32" or (kind == "q8" and kernel_path != "amx") or batch_invariant(kernel_path):
        assert np.array_equal(got, alone)  # AVX2 / AVX-VNNI: every row kernel shares the four-row kernels' block math
    else:  # int4 prompts on the 512-bit paths: pairs sum their floats in another order; AMX sums each block first
        assert np.abs(got - alone).max() <= 1e-6 * np.abs(alone).max()


@pytest.mark.parametrize("bits,zero", [(8, None), (8, "uint8"), (4, None), (4, "uint8")])
@pytest.mark.parametrize("m", [16, 23, 101])
def test_integer_prompt_kernels_four_rows_at_a_time_equal_numpy(kernel_path, bits, zero, m):
    """Passes of 16 rows or more take the prompt kernels (AVX2 / AVX-VNNI: four rows per pass over a tile, the rows
    left over in pairs and one alone; 101 rows of 2048 inputs: row blocks of 94 and 7), with and without zero
    points, one and two threads, 37 outputs (not a multiple of the tile's 4): within 1e-5 of numpy's largest
    output, and within 1e-6 of the same rows run one at a time (the decode kernels)."""
    rng = np.random.default_rng(bits * m)
    n, k = 37, 2048 if m == 101 else 96
    q = rng.integers(0, 2 ** bits, (n, k)).astype(np.uint8)
    scale = rng.uniform(0.01, 0.1, (n, k // 32)).astype(np.float32)
    z = None if zero is None else rng.integers(0, 2 ** bits, (n, k // 32)).astype(np.float32)
    bias = rng.standard_normal(n).astype(np.float32)
    x = rng.standard_normal((m, k)).astype(np.float32)
    x[m - 1, 5] = 40.0  # an outlier in the last row, which a remainder kernel takes
    mid = np.full((n, k // 32), 128 if bits == 8 else 8, np.float32) if z is None else z
    w = (q.astype(np.float32) - np.repeat(mid, 32, axis=1)) * np.repeat(scale, 32, axis=1)
    want = _quantized_activations(x) @ w.T + bias
    packed = pack_blocks(q, scale, z, bits, bias)
    alone = np.concatenate([_run_linear(packed, x[i:i + 1], 1) for i in range(m)])
    for threads in (1, 2):
        got = _run_linear(packed, x, threads)
        assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max() * (k / 96)  # numpy rounds a few blocks apart
        assert np.abs(got - alone).max() <= 1e-6 * np.abs(alone).max()


@pytest.mark.parametrize("bits,zero", [(8, None), (8, "uint8"), (4, None), (4, "uint8")])
@pytest.mark.parametrize("m", [1, 2, 3, 5, 7, 9])
def test_decode_sized_passes_sum_each_row_as_alone_and_equal_numpy(kernel_path, bits, zero, m):
    """Decode steps (fewer than 16 rows): AVX2 / AVX-VNNI run a row alone, rows in pairs (9 rows: pairs that
    prefetch the next tile) and four or five rows four at a time with the same block math (a row's four outputs
    summed in integers, one convert, scale and FMA per block), so every row is the same bits as that row alone,
    with and without zero points, one and two threads; and within 1e-5 of numpy's largest output."""
    rng = np.random.default_rng(7 * bits + m)
    n, k = 37, 160
    q = rng.integers(0, 2 ** bits, (n, k)).astype(np.uint8)
    scale = rng.uniform(0.01, 0.1, (n, k // 32)).astype(np.float32)
    z = None if zero is None else rng.integers(0, 2 ** bits, (n, k // 32)).astype(np.float32)
    bias = rng.standard_normal(n).astype(np.float32)
    x = rng.standard_normal((m, k)).astype(np.float32)
    x[m - 1, 33] = -40.0  # an outlier in the last row, which a remainder kernel takes
    mid = np.full((n, k // 32), 128 if bits == 8 else 8, np.float32) if z is None else z
    w = (q.astype(np.float32) - np.repeat(mid, 32, axis=1)) * np.repeat(scale, 32, axis=1)
    want = _quantized_activations(x) @ w.T + bias
    packed = pack_blocks(q, scale, z, bits, bias)
    alone = np.concatenate([_run_linear(packed, x[i:i + 1], 1) for i in range(m)])
    assert np.abs(alone - want).max() <= 1e-5 * np.abs(want).max()
    for threads in (1, 2):
        got = _run_linear(packed, x, threads)
        if kernel_path in ("avx2", "avxvnni"):
            assert np.array_equal(got, alone)
        else:
            assert np.abs(got - alone).max() <= 1e-6 * np.abs(alone).max()


def _graph(model, tmp_path):
    """The genai graph of ``model`` and, beside it, the native weights export writes with it."""
    path = tmp_path / GENAI_GRAPH
    save_genai_graph(build_genai_graph(model), path, external_data=False)
    write_native_weights(model, tmp_path)
    return path


def _session(model, path, n_slots: int, max_len: int, native: bool, threads: int = 1) -> GenaiSession:
    cfg = model.config
    return (NativeSession if native else GenaiSession)(
        path, n_layers=cfg.n_layers, n_kv_heads=cfg.n_kv_heads, head_dim=cfg.head_dim, vocab_size=cfg.vocab_size,
        n_slots=n_slots, max_len=max_len, threads=threads)


def _native_prefill(sess, prompts) -> np.ndarray:
    """Every prompt through the native kernels of a native session (:class:`NativeSession`)."""
    return sess.prefill(0, prompts).copy()


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral", "phi3"])
def test_fp32_passes_equal_onnx_runtimes_on_the_same_buffers(kernel_path, tmp_path, family):
    """Prompts of different lengths, then 30 greedy steps (a sliding window of 6 for mistral, biases for qwen2,
    scaled rope for llama): logits and the KV buffers as GroupQueryAttention writes them, and torch's tokens."""
    model = family_model(family)
    path = _graph(model, tmp_path)
    ort, nat = (_session(model, path, len(PROMPTS), 64, native) for native in (False, True))
    want = ort.prefill(0, PROMPTS).copy()
    got = _native_prefill(nat, PROMPTS)
    assert np.abs(got - want).max() < 1e-4 * np.abs(want).max()
    for r, p in enumerate(PROMPTS):  # keys and values in GroupQueryAttention's layout, rotated the same way
        for a, b in zip(ort.k + ort.v, nat.k + nat.v):
            assert np.allclose(a[r, :, :len(p)], b[r, :, :len(p)], atol=1e-5)
    lengths = np.array([len(p) for p in PROMPTS])
    tokens = [list(got.argmax(-1))]
    for _ in range(29):
        step_want = ort.decode(lengths, tokens[-1]).copy()
        step = nat.decode(lengths, tokens[-1]).copy()
        assert np.abs(step - step_want).max() < 1e-4 * np.abs(step_want).max()
        tokens.append(list(step.argmax(-1)))
        lengths += 1
    with torch.no_grad():
        ref = [generate(model, torch.tensor([p]), 30)[0, len(p):].tolist() for p in PROMPTS]
    assert [list(map(int, col)) for col in zip(*tokens)] == ref


@pytest.mark.parametrize("family", ["llama", "mistral"])
def test_contexts_over_several_attention_chunks_equal_onnx_runtimes(tmp_path, family):
    """Native attention splits a context longer than 256 positions into chunks and merges them: prompts of 300 and
    600 tokens (one pass, both rows), then decode steps across the 512 boundary, against ONNX Runtime on the same
    buffers (mistral: a sliding window of 6, so most chunks are empty), one and two threads."""
    model = family_model(family, max_seq_len=640)
    path = _graph(model, tmp_path)
    rng = np.random.default_rng(0)
    prompts = [list(rng.integers(0, 320, 300)), list(rng.integers(0, 320, 600))]
    ort = _session(model, path, 2, 640, False)
    want = ort.prefill(0, prompts).copy()
    lengths = np.array([len(p) for p in prompts])
    steps = [ort.decode(lengths + i, [7, 8]).copy() for i in range(3)]
    for threads in (1, 2):
        nat = _session(model, path, 2, 640, True, threads)
        got = _native_prefill(nat, prompts)
        assert np.abs(got - want).max() < 1e-4 * np.abs(want).max()
        for i, step_want in enumerate(steps):
            step = nat.decode(lengths + i, [7, 8])
            assert np.abs(step - step_want).max() < 1e-4 * np.abs(step_want).max()
        nat.close()


@pytest.mark.parametrize("precision", ["int8", "int4"])
def test_quantized_graphs_are_as_close_to_torch_as_onnx_runtimes(kernel_path, trained_run, tmp_path, precision):
    """Both runtimes quantize activations to int8 blocks of 32; the native kernels may round them differently,
    not worse: their largest logit error against the fp32 PyTorch model stays within 1.5x ONNX Runtime's."""
    model = load_model(trained_run / "model").eval()
    export_model(trained_run / "model", tmp_path / "e", precision=precision, progress=False)
    path = tmp_path / "e" / GENAI_GRAPH
    ort, nat = (_session(model, path, len(PROMPTS), 48, native) for native in (False, True))
    with torch.no_grad():
        ref = torch.stack([model(torch.tensor([p]))[0, -1] for p in PROMPTS]).numpy()
    err_ort = np.abs(ort.prefill(0, PROMPTS) - ref).max()
    err_native = np.abs(_native_prefill(nat, PROMPTS) - ref).max()
    assert 0 < err_native <= 1.5 * err_ort
    assert isinstance(nat, NativeSession) and not hasattr(nat, "session")  # no ONNX Runtime session


@pytest.mark.parametrize("heads,kv_heads,dim", [(4, 2, 64), (6, 2, 96), (8, 2, 128)])
@pytest.mark.parametrize("kv_dtype", ["f32", "f16"])
def test_prompt_attention_by_groups_of_heads_equals_one_token_at_a_time(tmp_path, heads, kv_heads, dim, kv_dtype):
    """A prompt's pass (37 tokens, two threads) attends with a KV head's query heads together, two or three at a
    time (8 heads over 2 KV heads: a group of three and one head alone); fp32 prompts sum every product in the
    order a decode step does, so every position's logits are the same bits as the same tokens fed one at a time."""
    model = family_model("llama", dim=dim, n_heads=heads, n_kv_heads=kv_heads)
    path = _graph(model, tmp_path)
    dims = genai_dims(model)
    packed = read_native_weights(path.parent / NATIVE_WEIGHTS, dims)
    ids = np.random.default_rng(heads).integers(0, 320, 37)
    shape = (1, kv_heads, 48, dim // heads)
    got = []
    for rows in (37, 1):
        kv = [[np.zeros(shape, KV_DTYPES[kv_dtype]) for _ in range(dims["n_layers"])] for _ in range(2)]
        dec = NativeDecoder(packed, kv[0], kv[1], 1, 48, threads=2)
        out = np.zeros((37, 320), np.float32)
        for s in range(0, 37, rows):
            dec.forward(ids[None, s:s + rows], [s], [rows], 0, out[s:s + rows], every_position=True)
        dec.close()
        got.append(out)
    assert np.array_equal(got[0], got[1])


@pytest.mark.parametrize("precision", ["int8", "int4"])
def test_long_quantized_prompts_are_as_close_to_torch_as_onnx_runtimes(trained_run, tmp_path, precision):
    """Prompts of 37 and 22 tokens in one pass (59 rows: the prompt kernels, four rows at a time, and their
    remainders), on AVX2: the native logits' largest error against the fp32 PyTorch model within 1.5x ONNX
    Runtime's, and the same next tokens as ONNX Runtime."""
    model = load_model(trained_run / "model").eval()
    export_model(trained_run / "model", tmp_path / "e", precision=precision, progress=False)
    path = tmp_path / "e" / GENAI_GRAPH
    rng = np.random.default_rng(3)
    prompts = [list(rng.integers(0, model.config.vocab_size, n)) for n in (37, 22)]
    ort, nat = (_session(model, path, len(prompts), 48, native) for native in (False, True))
    with torch.no_grad():
        ref = torch.stack([model(torch.tensor([p]))[0, -1] for p in prompts]).numpy()
    want = ort.prefill(0, prompts).copy()
    got = _native_prefill(nat, prompts)
    assert 0 < np.abs(got - ref).max() <= 1.5 * np.abs(want - ref).max()
    assert (got.argmax(-1) == want.argmax(-1)).all()


def test_stored_int4_with_zero_points_runs_natively(kernel_path, trained_run, tmp_path):
    """Asymmetric int4 (uint8 zero points in MatMulNBits) and an int8 block: the packed weights' own zero points."""
    model = load_model(trained_run / "model")
    quantize_pass(model, None, scheme="int4-weight-only", algorithm="rtn", group_size=32, symmetric=False,
                  int8=["layers.-1"])
    save_model(model, tmp_path / "q", stage="compress")
    export_model(tmp_path / "q", tmp_path / "e", progress=False)
    path = tmp_path / "e" / GENAI_GRAPH
    ort, nat = (_session(model.eval(), path, len(PROMPTS), 48, native) for native in (False, True))
    want = ort.prefill(0, PROMPTS)
    got = _native_prefill(nat, PROMPTS)
    assert np.abs(got - want).max() < 0.05 * np.abs(want).max()
    assert (got.argmax(-1) == want.argmax(-1)).all()


@pytest.fixture(scope="module")
def export_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("native")
    model = family_model("llama")
    save_model(model, root / "model", stage="train")
    export_model(root / "model", root / "export", progress=False)
    return root, model


def test_engine_serves_natively_with_joins_and_leaves(export_dir):
    """Continuous batching through the native decoder: rows join, leave (their slots free, nothing moves) and
    join again, and every request still gets torch's greedy tokens."""
    root, model = export_dir
    prompts = [[5, 6, 7], [9, 10, 11, 12], [40], [3, 1, 4, 1, 5], [8, 8]]
    lengths = [12, 3, 9, 5, 7]
    with Engine.load(root / "export", max_batch=3, max_len=64, native=True, threads=2) as engine:
        assert engine.info["native_isa"] == isa() == default_isa()  # the CPU's default path
        assert engine.info["native"] == "on" and engine.info["runtime"] == "native"
        assert isinstance(engine.backend, NativeBackend)  # no ONNX Runtime session: the weights are in memory once
        requests = [engine.submit(p, n, temperature=0.0, ignore_eos=True) for p, n in zip(prompts, lengths)]
        results = [engine.wait(r) for r in requests]
    with torch.no_grad():
        for p, n, r in zip(prompts, lengths, results):
            assert r.token_ids == generate(model, torch.tensor([p]), n)[0, len(p):].tolist()


def test_info_names_the_kernel_path_of_an_export(export_dir):
    root, _ = export_dir
    r = CliRunner().invoke(cli, ["info", str(root / "export")], env={"COLUMNS": "200"})
    assert r.exit_code == 0, r.output
    assert "native decoding on this machine" in r.output
    assert isa() in next(line for line in r.output.splitlines() if "kernel path" in line)


def test_native_is_refused_where_it_cannot_run(export_dir, tmp_path, assert_user_error):
    root, _ = export_dir
    with pytest.raises(PrunusError, match="no runtime of the torch backend serves tp=2 and native=True together"):
        Engine.load(root / "model", native=True, tp=2)
    with pytest.raises(PrunusError, match="native=True asks for decoding in the native kernels, which the tensorrt backend does "
                                          "not serve .only a model dir or an ONNX genai export dir"):
        check_options(root, "tensorrt", LoadOptions(native=True))
    torch_graphs = tmp_path / "torch"  # an export dir of torch graphs, as its config says (refused before reading)
    shutil.copytree(root / "export", torch_graphs)
    config = json.loads((torch_graphs / "config.json").read_text())
    config["export"]["graph"] = "torch"
    (torch_graphs / "config.json").write_text(json.dumps(config))
    manifest = json.loads((torch_graphs / "prunus.json").read_text())
    manifest["files"]["config.json"] = hashlib.sha256((torch_graphs / "config.json").read_bytes()).hexdigest()
    (torch_graphs / "prunus.json").write_text(json.dumps(manifest))
    with pytest.raises(PrunusError, match="decoding in the native kernels is not served for an ONNX export dir of "
                                          "prefill / decode graphs, only for: a model dir or an ONNX genai export"):
        Engine.load(torch_graphs, native=True)
    old = tmp_path / "old"  # an export of an older prunus: its graph only
    shutil.copytree(root / "export", old)
    (old / NATIVE_WEIGHTS).unlink()
    manifest = json.loads((old / "prunus.json").read_text())
    del manifest["files"][NATIVE_WEIGHTS]
    (old / "prunus.json").write_text(json.dumps(manifest))
    with pytest.raises(PrunusError, match="has no native_weights.safetensors.*re-export with this prunus version"):
        Engine.load(old, native=True)
    model = load_model(root / "model")  # int8 as DynamicQuantizeMatMul: ONNX Runtime's alone
    quantize_pass(model, None, scheme="int8-weight-only", granularity="per_channel")
    stored = {n: m for n, m in model.named_modules() if hasattr(m, "weight_scale")}
    write_native_weights(model, tmp_path, stored, "int8", style="integer")
    with pytest.raises(PrunusError, match="cannot run this export: it holds layers.0.attention.wq "
                                          r"\(int8-weight-only\) as DynamicQuantizeMatMul; serve it without --native"):
        read_native_weights(tmp_path / NATIVE_WEIGHTS, genai_dims(model))
    with safe_open(root / "export" / NATIVE_WEIGHTS, "np") as f:  # heads that do not match the projections' widths
        tensors, meta = {k: f.get_tensor(k) for k in f.keys()}, f.metadata()
    save_file(tensors, str(tmp_path / "wide.safetensors"), metadata={**meta, "n_heads": "2"})
    with pytest.raises(PrunusError, match="has a layer 0 [a-z]+ projection of 64 -> 64, not 32 -> 64"):
        read_native_weights(tmp_path / "wide.safetensors", genai_dims(model))
    runner = CliRunner()
    ok = runner.invoke(cli, ["generate", str(root / "model"), "--prompt", "ab", "--native", "--max-new-tokens", "4"])
    assert ok.exit_code == 0, ok.output  # a model dir natively: its weights packed at load
    ok = runner.invoke(cli, ["generate", str(root / "export"), "--prompt", "ab", "--native", "--max-new-tokens", "4",
                             "--temperature", "0"])
    assert ok.exit_code == 0, ok.output


@pytest.mark.parametrize("precision", ["fp32", "int8"])
def test_the_parity_check_runs_through_the_native_kernels(trained_run, tmp_path, precision):
    """The native backend that serves, driven through its protocol (``native_graphs``): every position's logits and
    greedy decoding pass the export's own parity check, with fp32 at the PyTorch model's bits per byte."""
    from prunus.data.corpus import default_data, load_corpus
    from prunus.export.backend_parity import native_graphs
    from prunus.export.parity import check_parity
    from prunus.runtime.native import pack_export
    from prunus.models import load_model_tokenizer

    model = load_model(trained_run / "model").eval()
    export_model(trained_run / "model", tmp_path / "e", precision=precision, progress=False)
    tokenizer = load_model_tokenizer(trained_run / "model")
    corpus = load_corpus(default_data(None, tokenizer), tokenizer, max_bytes=1 << 16, vocab_size=model.config.vocab_size)
    graphs = native_graphs(pack_export(tmp_path / "e" / GENAI_GRAPH, genai_dims(model)), threads=2)
    report = check_parity(model, graphs, corpus.val, tokenizer.token_bytes(), precision, eval_tokens=4096)
    assert report["passed"], report
    if precision == "fp32":
        assert report["max_abs_logits"] < 1e-3 and report["greedy_agreement"] == 1.0
        assert abs(report["bpb_increase"]) < 1e-5


@pytest.mark.parametrize("env,message", [("XDG_CACHE_HOME", "cannot be written"), ("CC", "no C compiler was found")])
def test_a_kernel_build_that_cannot_happen_is_one_line(monkeypatch, tmp_path, env, message):
    """An unwritable cache dir (here a file in its path) or a missing compiler: one PrunusError line."""
    a_file = tmp_path / "file"
    a_file.write_text("")
    monkeypatch.setenv(env, str(a_file / "x") if env == "XDG_CACHE_HOME" else str(tmp_path / "no-such-cc"))
    library.cache_clear()
    try:
        with pytest.raises(PrunusError, match=message):
            library()
    finally:
        library.cache_clear()


def test_the_kernel_path_is_chosen_from_the_cpu_or_forced_by_the_environment(monkeypatch):
    """PRUNUS_NATIVE_ISA forces a path the CPU has; a path it lacks, or no path at all, is one PrunusError line."""
    library.cache_clear()
    try:
        here = supported_isas()
        assert isa() == default_isa() and "avx2" in here
        # the default is the first batch-invariant path this CPU has: AVX-VNNI or AVX2, never a 512-bit / AMX one
        assert default_isa() == next(n for n in here if batch_invariant(n)) and default_isa() in ("avxvnni", "avx2")
        monkeypatch.setenv(ISA_ENV, "avx2")
        library.cache_clear()
        assert isa() == "avx2"
        for lacking in (name for name in ISAS if name not in here):
            monkeypatch.setenv(ISA_ENV, lacking)
            library.cache_clear()
            with pytest.raises(PrunusError, match=f"^{ISA_ENV}={lacking}: this CPU has no {lacking}; set it to one "
                                                  "of .*avx2, or unset it"):
                library()
        monkeypatch.setenv(ISA_ENV, "sse2")
        library.cache_clear()
        with pytest.raises(PrunusError, match=f"^{ISA_ENV}=sse2: not a native kernel path; set it to one of "
                                              f"{', '.join(ISAS)}, or unset it"):
            library()
    finally:
        monkeypatch.delenv(ISA_ENV)
        library.cache_clear()
    assert isa() == default_isa()


def test_the_isa_check_runs_every_path_this_cpu_has(capsys):
    """python -m prunus.native.check_isa: a line naming the CPU, one line per path it runs (each against numpy and
    the AVX2 path), and the verdict."""
    from prunus.native.check_isa import main

    assert main(["--n", "37", "--k", "96", "--rounds", "1"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("CPU: ") and f"paths it runs: {', '.join(supported_isas())}" in out[0]
    assert [line.split()[0] for line in out[1:-1]] == supported_isas()
    assert all("int8 err" in line and "int4 err" in line and "fp32 err" in line for line in out[1:-1])
    assert out[-1].startswith("ok: largest error")


def _run_cache(packed, dims, dtype, prompts, steps: int, max_len: int, tokens=None):
    """Prompts in one pass, then ``steps`` decode steps (``tokens``: the tokens to feed, else each step's greedy
    ones) over a KV cache of ``dtype``: every pass's logits, stacked."""
    shape = (len(prompts), dims["n_kv_heads"], max_len, dims["head_dim"])
    k, v = ([np.zeros(shape, dtype) for _ in range(dims["n_layers"])] for _ in range(2))
    decoder = NativeDecoder(packed, k, v, len(prompts), max_len, 1)
    ids = np.zeros((len(prompts), max(map(len, prompts))), np.int64)
    for i, p in enumerate(prompts):
        ids[i, :len(p)] = p
    logits = np.zeros((len(prompts), dims["vocab_size"]), np.float32)
    lengths = np.array([len(p) for p in prompts], np.int32)
    out = [decoder.forward(ids, np.zeros(len(prompts), np.int32), lengths, 0, logits).copy()]
    for i in range(steps):
        step = out[-1].argmax(-1) if tokens is None else tokens[i]
        out.append(decoder.forward(step[:, None], lengths, np.ones(len(prompts), np.int32), 0, logits).copy())
        lengths += 1
    decoder.close()
    assert decoder.kv_dtype == ("f16" if dtype == np.float16 else "f32")
    return np.stack(out)


@pytest.mark.parametrize("family", ["llama", "mistral"])
def test_a_half_precision_kv_cache_stays_within_its_tolerance_of_the_float_one(tmp_path, family):
    """Keys and values rounded to float16 as they are written (F16C), over prompts of 300 and 600 tokens (chunked
    attention) and 10 steps fed the same tokens: every logit within 2e-3 of the largest, the same greedy tokens."""
    model = family_model(family, max_seq_len=640)
    write_native_weights(model, tmp_path)
    dims = genai_dims(model)
    packed = read_native_weights(tmp_path / NATIVE_WEIGHTS, dims)
    rng = np.random.default_rng(0)
    prompts = [list(rng.integers(0, 320, 300)), list(rng.integers(0, 320, 600))]
    want = _run_cache(packed, dims, np.float32, prompts, 10, 640)
    got = _run_cache(packed, dims, np.float16, prompts, 10, 640, tokens=list(want[:-1].argmax(-1)))
    assert np.abs(got - want).max() <= 2e-3 * np.abs(want).max()
    assert (got.argmax(-1) == want.argmax(-1)).all()


def test_the_engine_serves_with_a_half_precision_kv_cache(export_dir, assert_user_error):
    """kv_dtype="f16": float16 buffers of the native decoder's own, every pass native (no ONNX Runtime session),
    torch's greedy tokens; without native, or another type, one line (and exit 2 from the CLI)."""
    root, model = export_dir
    prompts, n = [[5, 6, 7], [9, 10, 11, 12]], 8
    with Engine.load(root / "export", max_batch=2, max_len=64, native=True, kv_dtype="f16", threads=1) as engine:
        backend = engine.backend
        assert engine.info["kv_dtype"] == "f16" and isinstance(backend, NativeBackend)
        assert all(buf.dtype == np.float16 for buf in backend.k + backend.v)
        results = [engine.wait(engine.submit(p, n, temperature=0.0, ignore_eos=True)) for p in prompts]
    with torch.no_grad():
        for p, r in zip(prompts, results):
            assert r.token_ids == generate(model, torch.tensor([p]), n)[0, len(p):].tolist()
    with Engine.load(root / "export", max_batch=1, max_len=16, kv_dtype="f16") as engine:  # native by default
        assert engine.info["native"] == "on" and engine.backend.k[0].dtype == np.float16
    with pytest.raises(PrunusError, match="kv_dtype='f16' is the native decoder's KV cache; drop native=False"):
        Engine.load(root / "export", native=False, kv_dtype="f16")
    with pytest.raises(PrunusError, match="kv_dtype='f8': choose 'f32' or 'f16'"):
        Engine.load(root / "export", native=True, kv_dtype="f8")
    cli_run = CliRunner().invoke(cli, ["generate", str(root / "export"), "--prompt", "ab", "--kv-dtype", "f16",
                                       "--no-native"])
    assert_user_error(cli_run, "kv_dtype='f16' is the native decoder's KV cache")
    cli_run = CliRunner().invoke(cli, ["generate", str(root / "model"), "--prompt", "ab", "--kv-dtype", "f16",
                                       "--backend", "torch"])
    assert_user_error(cli_run, "kv_dtype='f16' is the native decoder's KV cache, and --backend torch was asked for")
