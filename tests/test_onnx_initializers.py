"""An ONNX graph's initializers are checked at load (prunus.artifacts.onnx_initializers): NaN or infinity in a weight,
a bias, a table or a quantization scale, and a scale an operator divides by that is not positive, are one line
naming the graph, the initializer and the element, wherever the numbers are stored (raw bytes, typed fields,
external data, float16 / bfloat16, a subgraph); a rank-0 constant of the graph's arithmetic (torch.onnx.export's
``masked_fill(-inf)`` fill value) loads. The file is read in place (prunus.artifacts.onnx_wire), which finds exactly
what ``onnx.load`` finds. Served end to end: an export dir whose graph or native weights hold NaN is refused at
load, ``prunus generate`` exits 2 with one line."""

from __future__ import annotations

import hashlib
import json
import shutil

import numpy as np
import onnx
import pytest
from click.testing import CliRunner
from onnx import TensorProto, helper, numpy_helper
from safetensors import safe_open
from safetensors.numpy import save_file

from family_variants import family_model
from prunus.artifacts.errors import PrunusError
from prunus.artifacts.native_layout import NATIVE_WEIGHTS
from prunus.artifacts.onnx_initializers import check_initializers
from prunus.artifacts.onnx_wire import graphs
from prunus.runtime.ort_session import ort_session

NAN, INF = float("nan"), float("inf")


def _model(nodes, inits, inputs=("x",), sparse=()) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info(n, TensorProto.FLOAT, [2, 2]) for n in inputs],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], list(inits),
                              sparse_initializer=list(sparse))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)], ir_version=10)


def _matmul(w: TensorProto) -> onnx.ModelProto:
    """y = x @ float32(w)."""
    return _model([helper.make_node("Cast", [w.name], ["wf"], to=TensorProto.FLOAT),
                   helper.make_node("MatMul", ["x", "wf"], ["y"])], [w])


def _stored(kind: str, values: np.ndarray) -> TensorProto:
    """Initializer "w" holding ``values`` as ``kind`` stores them."""
    if kind == "raw":
        return numpy_helper.from_array(values.astype(np.float32), "w")
    if kind == "float_data":  # the typed field, not raw bytes
        return helper.make_tensor("w", TensorProto.FLOAT, values.shape, values.astype(np.float32).ravel().tolist())
    if kind == "float16":
        return numpy_helper.from_array(values.astype(np.float16), "w")
    bits = (values.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)  # bfloat16: the top half of float32
    return helper.make_tensor("w", TensorProto.BFLOAT16, values.shape, bits.tobytes(), raw=True)


def _save(proto, path, external=False):
    onnx.save_model(proto, str(path), save_as_external_data=external, location="w.data", size_threshold=0)
    return path


def _one_line(match: str, fn, *args):
    with pytest.raises(PrunusError, match=match) as e:
        fn(*args)
    assert "\n" not in str(e.value)
    return str(e.value)


@pytest.mark.parametrize("kind", ["raw", "float_data", "float16", "bfloat16", "external"])
@pytest.mark.parametrize("value, shown", [(NAN, "nan"), (INF, "inf"), (-INF, "-inf")])
def test_a_nonfinite_initializer_is_one_line_naming_it(tmp_path, kind, value, shown):
    good = np.arange(4, dtype=np.float32).reshape(2, 2)
    bad = good.copy()
    bad.reshape(-1)[3] = value
    stored = "raw" if kind == "external" else kind
    _save(_matmul(_stored(stored, good)), tmp_path / "good.onnx", kind == "external")
    check_initializers(tmp_path / "good.onnx")
    out = ort_session(tmp_path / "good.onnx").run(None, {"x": np.eye(2, dtype=np.float32)})[0]
    assert out.tolist() == [[0, 1], [2, 3]]
    path = _save(_matmul(_stored(stored, bad)), tmp_path / "bad.onnx", kind == "external")
    shown = "a NaN or an infinity" if kind == "bfloat16" else shown
    for fn in (check_initializers, ort_session):  # ort_session: every graph ONNX Runtime loads for prunus
        _one_line(f"bad.onnx: initializer 'w' holds {shown} at element 3 of 4; the graph's weights are damaged; "
                  "re-export it", fn, path)
    if kind != "external":  # a graph given as bytes
        _one_line("the ONNX graph: initializer 'w' holds", check_initializers, path.read_bytes())


def test_a_variant_of_a_graph_is_checked_and_named_by_its_source(tmp_path):
    """variant_session (the prompt twin, the parity check's all-positions graph) loads a changed copy from a
    temporary file: its errors name the graph it copies."""
    from prunus.runtime.ort_session import variant_session

    bad = np.arange(4, dtype=np.float32).reshape(2, 2)
    bad[1, 1] = NAN
    source = _save(_matmul(_stored("raw", bad)), tmp_path / "model.onnx")
    _one_line(f"{tmp_path / 'model.onnx'} \\(twin variant\\): initializer 'w' holds nan at element 3 of 4",
              variant_session, source, onnx.load(str(source)), "twin")


def test_subgraphs_and_sparse_initializers_are_checked(tmp_path):
    w = numpy_helper.from_array(np.array([[1.0, NAN], [0.0, 1.0]], np.float32), "inner")
    branch = helper.make_graph([helper.make_node("MatMul", ["x", "inner"], ["z"])], "b", [],
                               [helper.make_tensor_value_info("z", TensorProto.FLOAT, None)], [w])
    cond = numpy_helper.from_array(np.array(True), "c")
    model = _model([helper.make_node("If", ["c"], ["y"], then_branch=branch, else_branch=branch)], [cond])
    _one_line("initializer 'inner' holds nan at element 1 of 4", check_initializers, _save(model, tmp_path / "if.onnx"))
    values = numpy_helper.from_array(np.array([1.0, INF], np.float32), "s")
    sparse = helper.make_sparse_tensor(values, numpy_helper.from_array(np.array([0, 3], np.int64), "i"), [2, 2])
    model = _model([helper.make_node("MatMul", ["x", "s"], ["y"])], [], sparse=[sparse])
    _one_line("initializer 's' holds inf at element 1 of 2", check_initializers, _save(model, tmp_path / "sp.onnx"))


def test_scales_are_finite_and_positive_where_divided_by_and_scalar_constants_load(tmp_path):
    """A rank-0 -inf fill value (what torch.onnx.export writes for ``masked_fill(mask, float("-inf"))``) loads; the
    same value as a DequantizeLinear scale does not; a QuantizeLinear scale (it divides by it) must be positive."""
    fill = numpy_helper.from_array(np.array(-INF, np.float32), "fill")
    mask = helper.make_node("Less", ["x", "zero"], ["m"])
    model = _model([mask, helper.make_node("Where", ["m", "fill", "x"], ["y"])],
                   [fill, numpy_helper.from_array(np.array(0.0, np.float32), "zero")])
    path = _save(model, tmp_path / "mask.onnx")
    out = ort_session(path).run(None, {"x": np.array([[-1, 2], [3, -4]], np.float32)})[0]
    assert out.tolist() == [[-INF, 2], [3, -INF]]

    def qdq(scale: float, op: str):
        codes = numpy_helper.from_array(np.array([[1, 2], [3, 4]], np.int8), "q")
        s = numpy_helper.from_array(np.array(scale, np.float32), "s")
        if op == "DequantizeLinear":
            nodes = [helper.make_node("DequantizeLinear", ["q", "s"], ["w"]),
                     helper.make_node("MatMul", ["x", "w"], ["y"])]
        else:
            nodes = [helper.make_node("QuantizeLinear", ["x", "s"], ["xq"]),
                     helper.make_node("DequantizeLinear", ["xq", "s"], ["y"])]
        return _save(_model(nodes, [codes, s]), tmp_path / f"{op}.onnx")

    _one_line("DequantizeLinear.onnx: initializer 's' holds -inf at element 0 of 1", check_initializers,
              qdq(-INF, "DequantizeLinear"))
    check_initializers(qdq(0.0, "DequantizeLinear"))  # zero weights: a valid scale
    _one_line("QuantizeLinear.onnx: initializer 's' holds 0 at element 0, a scale the graph divides by, which must "
              "be positive", check_initializers, qdq(0.0, "QuantizeLinear"))
    check_initializers(qdq(0.5, "QuantizeLinear"))


def test_external_data_outside_its_file_is_one_line(tmp_path):
    path = _save(_matmul(_stored("raw", np.ones((2, 2)))), tmp_path / "g.onnx", external=True)
    proto = onnx.load(str(path), load_external_data=False)
    for entry in proto.graph.initializer[0].external_data:
        if entry.key == "offset":
            entry.value = "12"
    if not any(e.key == "offset" for e in proto.graph.initializer[0].external_data):
        proto.graph.initializer[0].external_data.add(key="offset", value="12")
    onnx.save_model(proto, str(tmp_path / "g.onnx"))
    _one_line(r"initializer 'w': its external data \(offset '12', length .*\) is not 4 values inside w.data "
              r"\(16 bytes\)", check_initializers, tmp_path / "g.onnx")


def _genai_graph(tmp_path, precision: str):
    from prunus.export.genai_graph import quantized_genai_graph

    tmp_path.mkdir(parents=True, exist_ok=True)
    return quantized_genai_graph(family_model("llama"), {}, precision, tmp_path, False, "matmulnbits", "matmulnbits")


@pytest.mark.parametrize("precision", ["fp32", "int4"])
def test_the_wire_walker_finds_what_onnx_load_finds(tmp_path, precision):
    """Names, dims, types, raw bytes and external entries of every initializer, and every node's op and inputs, of a
    real genai graph (inline and with external data) and of the hand-made graphs above."""
    path = _genai_graph(tmp_path / "g", precision)
    external = _save(onnx.load(str(path)), tmp_path / "ext.onnx", external=True)
    for p in (path, external):
        buf = np.fromfile(p, np.uint8)
        proto = onnx.load(str(p), load_external_data=False)
        (g,) = list(graphs(memoryview(buf)))
        assert g.nodes == [(n.op_type, list(n.input)) for n in proto.graph.node]
        assert len(g.tensors) == len(proto.graph.initializer)
        for t, ours in zip(proto.graph.initializer, g.tensors):
            assert (ours.name, ours.dims, ours.data_type, ours.location) == (t.name, list(t.dims), t.data_type,
                                                                             t.data_location)
            assert ours.external == {e.key: e.value for e in t.external_data}
            assert (bytes(buf[ours.raw[0]:ours.raw[1]]) if ours.raw else b"") == t.raw_data
        check_initializers(p)


def test_fuzz_the_wire_walker_on_truncated_and_flipped_graphs(tmp_path):
    """Seeded, time-bounded: a genai graph with bytes flipped or cut off is checked or refused in one line, never a
    traceback (ONNX Runtime reads a file before prunus checks it, but the walker must hold on its own)."""
    import time

    typed = _save(_matmul(_stored("float_data", np.ones((4, 4)))), tmp_path / "typed.onnx")  # values in float_data
    sources = [np.fromfile(p, np.uint8) for p in (_genai_graph(tmp_path / "g", "int4"), typed)]
    rng, deadline, seen = np.random.default_rng(7), time.monotonic() + 2.0, set()
    for case in range(2000):
        if time.monotonic() > deadline:
            break
        data = sources[case % 2].copy()
        if case % 3 == 0:
            data = data[:int(rng.integers(1, data.size))]
        at = rng.integers(data.size, size=int(rng.integers(1, 6)))
        data[at] = rng.integers(0, 256, at.size)
        try:
            check_initializers(data.tobytes())
            seen.add("checked")
        except PrunusError as e:
            assert "\n" not in str(e) and str(e).startswith("the ONNX graph"), str(e)
            seen.add("refused")
    assert seen == {"checked", "refused"}


# --- end to end: an export dir served --------------------------------------------------------------------------

@pytest.fixture(scope="module")
def export_dir(tmp_path_factory):
    from prunus.export import export_model
    from prunus.models import save_model

    root = tmp_path_factory.mktemp("finite")
    save_model(family_model("llama"), root / "model", stage="train")
    export_model(root / "model", root / "export", progress=False)
    return root / "export"


def _rehash(d) -> None:
    manifest = json.loads((d / "prunus.json").read_text())
    manifest["files"] = {n: hashlib.sha256((d / n).read_bytes()).hexdigest() for n in manifest["files"]}
    (d / "prunus.json").write_text(json.dumps(manifest))


def _damaged(export_dir, out, graph: bool, native: bool):
    """A copy of ``export_dir`` with NaN in its graph's layer-1 w2 weight and / or its native weights' copy of it."""
    shutil.copytree(export_dir, out)
    if graph:
        proto = onnx.load(str(out / "model.onnx"))
        t = next(t for t in proto.graph.initializer if t.name == "layers.1.feed_forward.w2.weight")
        a = numpy_helper.to_array(t).copy()
        a.reshape(-1)[7] = NAN
        t.CopyFrom(numpy_helper.from_array(a, t.name))
        onnx.save_model(proto, str(out / "model.onnx"))
    if native:
        with safe_open(out / NATIVE_WEIGHTS, "np") as f:
            tensors, meta = {k: f.get_tensor(k) for k in f.keys()}, f.metadata()
        tensors["layers.1.feed_forward.w2.weight"].reshape(-1)[7] = NAN
        save_file(tensors, str(out / NATIVE_WEIGHTS), metadata=meta)
    _rehash(out)
    return out


@pytest.mark.slow
def test_an_export_dir_with_nan_weights_is_refused_at_load(export_dir, tmp_path, assert_user_error):
    from prunus.cli.main import cli
    from prunus.native.build import cpu_supported
    from prunus.serve import Engine

    graph_w2 = "model.onnx: initializer 'layers.1.feed_forward.w2.weight' holds nan at element 7 of 12288"
    native_w2 = f"{NATIVE_WEIGHTS}: tensor 'layers.1.feed_forward.w2.weight' holds nan at element 7 of 12288"
    both = _damaged(export_dir, tmp_path / "both", graph=True, native=True)
    with pytest.raises(PrunusError, match=graph_w2):
        Engine.load(both, native=False)
    run = ["generate", "--prompt", "ab", "--max-new-tokens", "2"]
    assert_user_error(CliRunner().invoke(cli, [*run[:1], str(both), *run[1:]]), graph_w2)  # native="auto" falls back
    if cpu_supported() is None:
        assert_user_error(CliRunner().invoke(cli, [run[0], str(both), *run[1:], "--native"]), native_w2)
        native_only = _damaged(export_dir, tmp_path / "native", graph=False, native=True)
        with Engine.load(native_only, max_len=16) as engine:  # "auto": the graph is sound, ONNX Runtime serves it
            assert engine.info["native"].startswith("off: ") and native_w2 in engine.info["native"]
            assert engine.generate("ab", max_new_tokens=2, temperature=0.0)
