"""The runtime floor's contract: the import graph between stages (down the pipeline only) and between modules
(no circle), and every registered runtime's backend declaring its capabilities and implementing ``release(row)``
(:class:`prunus.runtime.backend.Backend`)."""

from __future__ import annotations

import ast
import importlib
import inspect
from pathlib import Path

import pytest
import torch

from prunus.runtime.backend import Backend, BackendBase, Capabilities
from prunus.runtime.load_options import LoadOptions
from prunus.runtime.registry import BACKENDS, RUNTIMES, find_runtime
from prunus.runtime.sampling import RowSampling, sample

ROOT = Path(__file__).resolve().parents[1]
# stage -> stages it must never import
FORBIDDEN = {"serve": ("export", "native"), "export": ("native", "serve"), "runtime": ("serve", "export"),
             "native": ("serve", "export", "runtime")}


# every stage folder, recursively: the module-level import graph between them has no circle
STAGES = ("artifacts", "models", "data", "train_parallel", "compress", "export", "native", "runtime", "serve", "cli")


def _imported_names(path: Path, module: str) -> set[str]:
    """The dotted names a module imports, at module level or inside functions, relative imports resolved against
    ``module`` (its own dotted name); ``from a import b`` gives ``a.b``, which may name a module or a name in ``a``."""
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[:len(package) - node.level + 1] + ([node.module] if node.module else []))
            found.update(f"{base}.{a.name}" for a in node.names)
    return found


def _imported_stages(path: Path, stage: str) -> set[str]:
    """The prunus stages a module imports, absolute (prunus.x) or relative (from ..x)."""
    parts = (n.split(".") for n in _imported_names(path, f"prunus.{stage}.{path.stem}"))
    return {p[1] for p in parts if p[0] == "prunus" and len(p) > 1}


def _module_name(path: Path, root: Path) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(("prunus", *(parts[:-1] if parts[-1] == "__init__" else parts)))


def _import_graph(root: Path = ROOT, stages=STAGES) -> dict[str, set[str]]:
    """module -> the prunus modules it imports (each name resolved to the longest module it starts with)."""
    files = {_module_name(p, root): p for s in stages for p in sorted((root / s).rglob("*.py"))}
    graph = {}
    for module, path in files.items():
        graph[module] = set()
        for name in _imported_names(path, module):
            while name and name not in files:
                name = name.rpartition(".")[0]
            if name and name != module:
                graph[module].add(name)
    return graph


def _import_circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative), sorted."""
    index, low, stack, on_stack, circles = {}, {}, [], set(), []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start), on_stack.add(start)
        while work:
            node, edges = work[-1]
            nxt = next((w for w in edges if w not in index or w in on_stack), None)
            if nxt is not None and nxt not in index:
                index[nxt] = low[nxt] = len(index)
                stack.append(nxt), on_stack.add(nxt)
                work.append((nxt, iter(sorted(graph[nxt]))))
            elif nxt is not None:
                low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while not component or component[-1] != node:
                        component.append(stack.pop())
                        on_stack.discard(component[-1])
                    if len(component) > 1:
                        circles.append(sorted(component))
    return sorted(circles)


def test_no_module_imports_itself_through_others():
    graph = _import_graph()
    circles = _import_circles(graph)
    assert not circles, f"{len(circles)} import circles (module -> the modules of its circle it imports):\n" + "\n".join(
        "; ".join(f"{m} -> {', '.join(sorted(graph[m] & set(c)))}" for m in c) for c in circles)


def test_the_circle_check_sees_circles_through_functions_and_subpackages(tmp_path):
    (tmp_path / "a" / "sub").mkdir(parents=True)
    (tmp_path / "b").mkdir()
    (tmp_path / "a" / "x.py").write_text("from .sub import y\n")
    (tmp_path / "a" / "sub" / "y.py").write_text("def f():\n    from prunus.b.z import g\n")
    (tmp_path / "b" / "z.py").write_text("from ..a import x\nfrom prunus.b import w\n")
    (tmp_path / "b" / "w.py").write_text("import prunus.a.sub.y\n")
    graph = _import_graph(tmp_path, ("a", "b"))
    assert graph["prunus.a.sub.y"] == {"prunus.b.z"} and graph["prunus.b.z"] == {"prunus.a.x", "prunus.b.w"}
    assert _import_circles(graph) == [["prunus.a.sub.y", "prunus.a.x", "prunus.b.w", "prunus.b.z"]]
    (tmp_path / "a" / "sub" / "y.py").write_text("")
    assert _import_circles(_import_graph(tmp_path, ("a", "b"))) == []


@pytest.mark.parametrize("stage", sorted(FORBIDDEN))
def test_the_import_graph_points_down_the_pipeline(stage):
    bad = [f"{p.relative_to(ROOT)} imports prunus.{s}" for p in sorted((ROOT / stage).glob("*.py"))
           for s in sorted(_imported_stages(p, stage) & set(FORBIDDEN[stage]))]
    assert not bad, bad


def test_the_import_check_sees_imports_inside_functions(tmp_path):
    f = tmp_path / "m.py"
    f.write_text("def f():\n    from prunus.export.parity import check_parity\n    from ..native import build\n")
    assert _imported_stages(f, "serve") == {"export", "native"}


def _backend_classes() -> list[type]:
    """The backend class each registered runtime's module defines."""
    out = []
    for runtime in RUNTIMES:
        module = importlib.import_module(f"prunus.runtime.{runtime.module}")
        classes = [c for _, c in inspect.getmembers(module, inspect.isclass)
                   if issubclass(c, BackendBase) and c is not BackendBase]
        assert classes and callable(getattr(module, "load", None)), runtime.name
        out += classes
    return sorted(set(out), key=lambda c: c.__name__)


def test_every_runtime_is_one_row_with_a_loader_and_a_backend_under_a_known_name():
    assert len({r.name for r in RUNTIMES}) == len(RUNTIMES)
    assert {r.backend for r in RUNTIMES} == set(BACKENDS)
    names = {c.__name__ for c in _backend_classes()}
    assert {"TorchBackend", "TPBackend", "GraphBackend", "GenaiBackend"} <= names


@pytest.mark.parametrize("cls", _backend_classes(), ids=lambda c: c.__name__)
def test_every_backend_declares_capabilities_and_implements_release(cls):
    """Every part of the protocol is there; capabilities is a declared property, release the backend's own."""
    for name in ("capabilities", "prefill", "extend", "decode", "release", "warm_up", "describe", "close"):
        assert callable(getattr(cls, name, None)) or name == "capabilities", name
    assert isinstance(inspect.getattr_static(cls, "capabilities"), property)
    assert "release" not in vars(BackendBase) and callable(cls.release)


def test_the_torch_backend_conforms_and_keeps_logits_on_its_device(tiny_model):
    from prunus.runtime.torch import TorchBackend

    backend = TorchBackend(tiny_model, 2, 32, prefill_chunk=8)
    assert isinstance(backend, Backend)
    caps = backend.capabilities
    assert caps == Capabilities(max_batch=2, extend=True, prefill_chunk=8, tunable_threads=True, verify=True,
                                verify_rows=True, embeddings=True, lora=True, hidden_states=True,
                                prompt_logits=True)
    logits = backend.prefill([1], [[3, 4, 5]])
    assert logits.device == backend.device and logits.shape == (1, tiny_model.config.vocab_size)
    backend.decode([1], [7])
    assert int(backend.cache.lengths[1]) == 4
    backend.release(1)
    assert int(backend.cache.lengths[1]) == 0


def test_capabilities_are_frozen_and_checked():
    caps = Capabilities(max_batch=4)
    with pytest.raises(AttributeError):
        caps.max_batch = 2
    with pytest.raises(ValueError):
        Capabilities(max_batch=0)
    with pytest.raises(ValueError):
        Capabilities(max_batch=1, prefill_chunk=8)  # chunks need extend


def test_the_registry_picks_the_runtime_the_artifact_needs():
    model, onnx = {"model": {}}, {"model": {}, "export": {"format": "onnx", "graph": "torch"}}
    genai = {"model": {}, "export": {"format": "onnx", "graph": "genai"}}
    trt = {"model": {}, "export": {"format": "tensorrt"}}
    o = LoadOptions()
    assert find_runtime("torch", model, o).name == "torch"
    assert find_runtime("torch", model, LoadOptions(tp=2)).name == "torch_tp"
    assert find_runtime("onnxruntime", onnx, o).name == "ort_graphs"
    assert find_runtime("onnxruntime", genai, o).name == "ort_genai"
    assert find_runtime("onnxruntime", genai, LoadOptions(native=True)).name == "native"
    assert find_runtime("tensorrt", trt, o).name == "tensorrt"


def test_sampling_greedy_rows_take_the_argmax_and_seeded_rows_repeat():
    logits = torch.tensor([[0.0, 3.0, 1.0], [2.0, 0.0, 1.0]])
    assert sample(logits, [RowSampling(), RowSampling()]) == [1, 0]
    seeded = [RowSampling(), RowSampling(temperature=1.0, generator=torch.Generator().manual_seed(5))]
    again = [RowSampling(), RowSampling(temperature=1.0, generator=torch.Generator().manual_seed(5))]
    first, second = sample(logits, seeded), sample(logits, again)
    assert first == second and first[0] == 1


def test_a_feature_a_runtime_row_does_not_declare_is_refused_naming_the_rows_that_do():
    """Each runtime row declares what it accepts (tp, compile, native, prefix cache, draft, device map, prompt graph,
    f16 KV cache); a load asking a row for anything else is one line naming the rows that serve it and the flag to
    drop."""
    from pathlib import Path

    from prunus.artifacts.errors import PrunusError
    from prunus.runtime.load_options import LoadOptions, ServingFeatures
    from prunus.runtime.registry import FEATURES, RUNTIMES, asked, check_accepted

    declared = set().union(*(r.accepts for r in RUNTIMES))
    assert declared == set(FEATURES)
    assert asked(LoadOptions()) == {}
    wanted = asked(LoadOptions(tp=2, compile=True, native=True, device_map="auto", kv_dtype="f16", prompt_graph=True,
                               features=ServingFeatures(prefix_cache_mb=8, draft="ngram")))
    assert set(wanted) == set(FEATURES) and wanted["tp"] == "tp=2"
    tp = next(r for r in RUNTIMES if r.name == "torch_tp")
    with pytest.raises(PrunusError, match=r"^m: a device map is not served for a model dir with tp > 1 .*only for: "
                                          r"a model dir with a device map .*; drop --device-map$"):
        check_accepted(Path("m"), tp, {"device_map"})
    for row in RUNTIMES:
        check_accepted(Path("m"), row, set(row.accepts))  # what a row declares passes


@pytest.mark.parametrize("backend, kwargs, needle", [
    ("tensorrt", {"tp": 2}, "^m: tp=2 asks for tensor parallelism, which the tensorrt backend does not serve "
                            r"\(only a model dir with tp > 1 .*\); drop --tp$"),
    ("onnxruntime", {"compile": True}, "compile=True asks for a compiled decode step, which the onnxruntime"),
    ("torch", {"prompt_graph": True}, "prompt_graph asks for the prompt graph, which the torch backend"),
    ("tensorrt", {"native": True}, "native=True asks for decoding in the native kernels, which the tensorrt"),
    ("tensorrt", {"kv_dtype": "f16"}, "kv_dtype='f16' asks for a float16 KV cache, which the tensorrt"),
    ("torch", {"tp": 2, "features": {"prefix_cache_mb": 4}},
     "^m: no runtime of the torch backend serves tp=2 and prefix_cache_mb=4 together; drop --tp or --prefix-cache-mb$"),
    ("torch", {"device_map": "auto", "compile": True}, "serves compile=True and device_map together"),
    ("torch", {"device_map": "auto", "features": {"draft": "ngram"}}, "serves draft=ngram and device_map together"),
    ("onnxruntime", {"prompt_graph": True, "kv_dtype": "f16"}, "serves prompt_graph and kv_dtype='f16' together"),
])
def test_options_no_runtime_of_the_backend_serves_are_one_line_before_a_load(backend, kwargs, needle):
    """One check against the runtime table, not runtime names: a setting no row of the backend accepts, or settings
    no one row accepts together, are refused before anything loads."""
    from pathlib import Path

    from prunus.artifacts.errors import PrunusError
    from prunus.runtime.load_options import LoadOptions, ServingFeatures
    from prunus.runtime.registry import check_options

    features = ServingFeatures(**kwargs.pop("features", {}))
    with pytest.raises(PrunusError, match=needle):
        check_options(Path("m"), backend, LoadOptions(features=features, **kwargs))
    check_options(Path("m"), "torch", LoadOptions(tp=2))  # what one row serves passes
    check_options(Path("m"), "onnxruntime", LoadOptions(native=True, kv_dtype="f16",
                                                         features=ServingFeatures(prefix_cache_mb=4, draft="ngram")))
