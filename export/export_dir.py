"""``export_model``: a model dir -> an export dir (ONNX Runtime or TensorRT), checked for parity.

The export dir holds ``config.json`` (the model dir's config plus an ``"export"`` key whose
``graph`` says which graphs follow), the tokenizer files, the graphs (+ ``.data`` files for large
models): ``model.onnx`` for ``graph`` "genai" (one graph for prefill and decode on ONNX Runtime's
fused operators, :mod:`prunus.export.genai_graph`, with ``native_weights.safetensors``, the same numbers for
the native decoder, :mod:`prunus.export.native_weights`), else ``prefill.onnx`` / ``decode.onnx`` from
``torch.onnx.export`` (``prefill.plan`` / ``decode.plan`` too for TensorRT); ``parity.json`` and
``prunus.json`` (manifest: stage "export", parent path and hash, command, file hashes,
metrics). It is written into a temporary dir and renamed: a failed parity check or any
error leaves nothing behind.
"""

from __future__ import annotations

import copy
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import onnx
import torch
from rich.console import Console

from prunus.artifacts.atomic import atomic_dir, atomic_write_json
from prunus.artifacts.contained import inside
from prunus.artifacts.errors import PrunusError
from prunus.artifacts.paths import check_output
from prunus.artifacts.validate import read_json_object
from prunus.models.model_dir import (CONFIG, load_model, load_model_tokenizer, read_config, read_config_json,
                                     verify_model_dir)
from prunus.models.quant_registry import QuantizedModule, handler, quantized_modules
from prunus.models.spec import TRANSFORMER, get_spec

from .onnx_export import DEFAULT_OPSET, MIN_OPSET, dequantized_copy, export_decode, export_prefill, save_graph
from .export_manifest import PARITY, ExportResult, write_manifest
from .formats import FORMATS, GRAPHS, PRECISIONS
from .genai_graph import (GENAI_GRAPH, check_genai_support, genai_dims, quantized_genai_graph,
                          unsupported_features)
from .genai_compat import write_genai_compat
from .int4_qdq import check_tensorrt_int4
from .backend_parity import export_graphs
from .parity import ParityFailed, compare, torch_reference
from .served_parity import native_parity, ort_record
from .quantize_onnx import apply_stored_quantization, quantize_fp32_graph, required_opset

EXPORT_GRAPHS = {"prefill": "prefill.onnx", "decode": "decode.onnx"}
ENGINE_GRAPHS = {"prefill": "prefill.plan", "decode": "decode.plan"}
EXTERNAL_DATA_BYTES = int(1.5e9)  # above this the weights go to external data files
# QDQ (which ONNX Runtime rewrites to MatMulNBits), the faster and, on activation outliers without VNNI, the only
# faithful int8 form (docs/defaults.md); TensorRT always gets QDQ; "integer" (DynamicQuantizeMatMul) is opt-in.
ONNX_INT8_STYLE = "qdq"
MAX_OPSET = 23


def _stored_precision(modules: dict[str, QuantizedModule]) -> str | None:
    kinds = {"fp8" if m.scheme.startswith("fp8") else "int4" if m.scheme.startswith("int4") else "int8"
             for m in modules.values()}
    if kinds == {"int4", "int8"}:  # a mixed-precision recipe (int8 blocks, int4 elsewhere): MatMulNBits and int8
        return "int4"
    if len(kinds) > 1:
        raise PrunusError("export: the model mixes int8 and fp8 modules; export needs one of them (re-compress)")
    return kinds.pop() if kinds else None


def _check_request(fmt: str, precision: str | None, stored: str | None, model_dir: Path) -> str:
    if fmt not in FORMATS:
        raise PrunusError(f"--format {fmt!r}: choose one of {', '.join(FORMATS)}")
    if precision is not None and precision not in PRECISIONS:
        raise PrunusError(f"--precision {precision!r}: choose one of {', '.join(PRECISIONS)}")
    if stored is not None:
        if precision not in (None, stored):
            raise PrunusError(f"{model_dir}: holds {stored} weights; export it at --precision {stored} "
                              f"(or export its uncompressed parent at {precision})")
        return stored
    precision = precision or "fp32"
    if fmt == "tensorrt" and precision == "int4":
        raise PrunusError(f"--format tensorrt --precision int4 takes the stored int4 weights: compress {model_dir} "
                          "with --quantize int4-weight-only (symmetric) first and export the compressed dir")
    if fmt == "tensorrt" and precision == "int8":
        raise PrunusError(f"--format tensorrt --precision int8 takes int8 scales from the graph: compress {model_dir} "
                          "to int8 first (prunus compress) and export the compressed dir")
    return precision


def _fp8_modules(model) -> dict[str, QuantizedModule]:
    """fp8 weights for every Linear (per channel, e4m3), for an fp32 model exported at --precision fp8; a
    mixture-of-experts router stays in float, as prunus compress keeps it (rounding flips which experts run)."""
    return {name: handler("fp8-weight-only").quantize(m, "per_channel")
            for name, m in model.named_modules() if isinstance(m, torch.nn.Linear) and not name.endswith("router")}


def load_export(path: str | Path):
    """(config dict, tokenizer) of an export dir."""
    from prunus.models.tokenizer import load_tokenizer

    path = Path(path)
    cpath = inside(path, CONFIG, fix="re-create the export dir", required=False)  # a symlink out, a FIFO: one line
    if cpath is None:
        raise PrunusError(f"{path}: no {CONFIG}; give a directory written by prunus export")
    config = read_json_object(cpath, fix="re-create the export dir")
    if "export" not in config:
        raise PrunusError(f"{cpath}: has no 'export' key; this is a model dir, not an export dir (run prunus export)")
    return config, load_tokenizer(config.get("tokenizer"), base_dir=path)


def _refuse(flags: list[str], title: str, model_dir: Path) -> None:
    """Options of another kind's export, refused in one line (never ignored)."""
    if flags:
        raise PrunusError(f"{', '.join(flags)}: not taken by a {title}'s export ({model_dir}); drop {flags[0]}")


@dataclass(frozen=True)
class ExportPlan:
    """What an export writes, settled before anything is written."""

    precision: str
    modules: dict  # name -> stored quantized module (QuantizedModule): stored (or fp8) weights the graphs carry as they are
    opset: int
    style: str  # int8 weights: "qdq", "integer" or "matmulnbits"
    int4_style: str
    graph: str  # "genai" or "torch"
    external: bool


@dataclass(frozen=True)
class ExportFormat:
    """One row of :data:`EXPORT_FORMATS`: what a format checks first, forces, and adds after the graphs."""

    name: str
    check: Callable  # (stored modules, model dir) -> None, before any graph is written
    weight_style: str | None  # the int8 / int4 style it takes whatever is asked (None: the asked or default)
    finish: Callable | None  # (tmp, export entry, plan, cfg, timing_cache, console) -> None, after parity


def _check_tensorrt_format(modules: dict, model_dir: Path) -> None:
    from . import tensorrt_build

    check_tensorrt_int4(modules, model_dir)
    tensorrt_build.check_tensorrt()


def _finish_tensorrt(tmp: Path, export: dict, plan: ExportPlan, cfg, timing_cache, console) -> None:
    export["graphs"].update(ENGINE_GRAPHS)
    export["engines"] = _build_engines(tmp, plan.precision, cfg, export["n_layers"], timing_cache, console)


EXPORT_FORMATS = {
    "onnx": ExportFormat("onnx", lambda modules, model_dir: None, None, None),
    "tensorrt": ExportFormat("tensorrt", _check_tensorrt_format, "qdq", _finish_tensorrt),
}


def export_model(model_dir: str | Path, out: str | Path, *, format: str = "onnx", precision: str | None = None,
                 opset: int | None = None, verify: bool = True, data: str | None = None, overwrite: bool = False,
                 external_data: bool | None = None, int8_style: str | None = None, eval_tokens: int | None = None,
                 command: str | None = None, progress: bool = True, timing_cache: str | Path | None = None,
                 graph: str | None = None, trust_factory=False) -> ExportResult:
    """Export ``model_dir`` to ``out`` and check it against the PyTorch model.

    ``format``: a row of :data:`EXPORT_FORMATS`. ``precision`` None keeps the model's own (fp32, or the int8 / fp8
    of a compressed dir). ``graph``: "genai" (one graph built around ONNX Runtime's fused operators,
    :mod:`prunus.export.genai_graph`), "torch" (prefill and decode graphs through ``torch.onnx.export``) or None:
    genai where it supports the model, the format and the precision, else torch.
    ``verify`` False keeps an export whose parity check failed (the report still says so).
    A generic module dir (config.json ``"kind": "module"``) is exported by :mod:`.module_export`, its factory
    imported only when ``trust_factory`` trusts it.
    Raises PrunusError on bad input and :class:`ParityFailed` when the check fails."""
    model_dir, out = Path(model_dir), Path(out)
    if format not in EXPORT_FORMATS:
        raise PrunusError(f"--format {format!r}: choose one of {', '.join(FORMATS)}")
    fmt = EXPORT_FORMATS[format]
    check_output(out, [("MODEL_DIR", model_dir), ("--data", data)])
    if out.exists() and not overwrite:
        raise PrunusError(f"{out}: already exists; choose another output path or pass --overwrite")
    manifest = verify_model_dir(model_dir)
    spec = get_spec(read_config_json(model_dir).get("kind"))
    given = {"--external-data": external_data, "--int8-style": int8_style, "--eval-tokens": eval_tokens,
             "--timing-cache": timing_cache, "--graph": graph}
    if spec.name != TRANSFORMER:  # another kind's graph and parity check (any nn.Module: module_export)
        _refuse([flag for flag, value in given.items() if value is not None], spec.title, model_dir)
        return spec.load("export")(model_dir, out, format=format, precision=precision, opset=opset, verify=verify, data=data,
                             overwrite=overwrite, command=command, trust_factory=trust_factory, manifest=manifest)
    _refuse(["--trust-factory"] if trust_factory else [], spec.title, model_dir)
    _, src_config = read_config(model_dir)
    model = load_model(model_dir, verify=False).float()
    plan = _plan(fmt, model, model_dir, precision, opset, int8_style, graph, external_data)
    tokenizer = load_model_tokenizer(model_dir)
    console = Console(stderr=True, quiet=not progress)
    with atomic_dir(out, overwrite=overwrite) as tmp:
        with console.status("") as status:
            graphs = GRAPH_WRITERS[plan.graph](model, plan, tmp, status)
            tokenizer.save(tmp)
            if plan.graph == "genai":  # the same graph as onnxruntime-genai's runtime loads it (og.Model(out))
                write_genai_compat(tmp, model, tokenizer)
            export = _export_entry(fmt.name, plan, model)
            config = {**src_config, "export": export}
            atomic_write_json(tmp / CONFIG, config)  # the runtime table loads the written dir for the check
            status.update("parity: ONNX Runtime (and the native kernels) against PyTorch on held-out text")
            report = _parity(model, tmp, config, graphs, tokenizer, plan.precision, data, eval_tokens)
        if not report["passed"] and verify:
            raise ParityFailed(report)
        atomic_write_json(tmp / PARITY, report)
        if fmt.finish is not None:
            fmt.finish(tmp, export, plan, model.config, timing_cache, console)
            atomic_write_json(tmp / CONFIG, config)
        write_manifest(tmp, model_dir, manifest, report, command)
    return ExportResult(out, config, report)  # the caller says it was written, after reading the parity report


def _plan(fmt: ExportFormat, model, model_dir: Path, precision: str | None, opset: int | None,
          int8_style: str | None, graph: str | None, external_data: bool | None) -> ExportPlan:
    """Every choice of the export checked and settled (one PrunusError line for a bad one) before any write."""
    stored_modules = quantized_modules(model)
    precision = _check_request(fmt.name, precision, _stored_precision(stored_modules), model_dir)
    fmt.check(stored_modules, model_dir)
    modules = stored_modules or (_fp8_modules(model) if precision == "fp8" else {})
    need = required_opset(modules) if modules else MIN_OPSET
    opset = opset or max(DEFAULT_OPSET[fmt.name], need)
    if not need <= opset <= MAX_OPSET:
        raise PrunusError(f"--opset {opset}: this export needs an opset from {need} to {MAX_OPSET}")
    style = fmt.weight_style or int8_style or ONNX_INT8_STYLE
    int4_style = fmt.weight_style or "matmulnbits"  # TensorRT: blocked INT4 DequantizeLinear
    graph = _choose_graph(graph, fmt.name, model.config, modules, precision)
    if graph == "genai" and int8_style is None:
        style = "matmulnbits"  # stored int8-weight-only integers as MatMulNBits (bits 8), ONNX Runtime's weight-only kernel
    weight_bytes = sum(p.numel() * 4 for p in model.parameters())
    external = external_data if external_data is not None else weight_bytes > EXTERNAL_DATA_BYTES
    return ExportPlan(precision, modules, opset, style, int4_style, graph, external)


def _write_genai(model, plan: ExportPlan, tmp: Path, status) -> dict:
    status.update(f"export: genai graph (GroupQueryAttention, shared KV buffer, {plan.precision})")
    return {"model": quantized_genai_graph(model, plan.modules, plan.precision, tmp, plan.external, plan.style,
                                           plan.int4_style, plan.opset)}


def _write_torch_graphs(model, plan: ExportPlan, tmp: Path, status) -> dict:
    """prefill.onnx and decode.onnx through torch.onnx.export, their weights stored or quantized as planned."""
    precision, modules = plan.precision, plan.modules
    plain = dequantized_copy(model, modules)
    if precision == "fp16":  # a half model: float16 weights, past/present and logits
        plain = copy.deepcopy(model).half()
    graphs = {}
    for kind, fn in (("prefill", export_prefill), ("decode", export_decode)):
        status.update(f"export: {kind} graph (torch.onnx.export, opset {plan.opset})")
        proto = fn(plain, plan.opset)
        path = tmp / EXPORT_GRAPHS[kind]
        if modules:
            status.update(f"export: {kind} graph, stored {precision} weights ({plan.style})")
            apply_stored_quantization(proto, modules, plan.style, plan.int4_style)
        if precision in ("int8", "int4") and not modules:
            status.update(f"export: {kind} graph, onnxruntime MatMulNBits ({precision})")
            fp32_path = tmp / f".{kind}.fp32.onnx"
            save_graph(proto, fp32_path, plan.external)
            quantize_fp32_graph(fp32_path, path, plan.external, bits=4 if precision == "int4" else 8)
            for f in tmp.glob(f".{kind}.fp32.onnx*"):
                f.unlink()
            onnx.checker.check_model(str(path))
        else:
            save_graph(proto, path, plan.external)
        graphs[kind] = path
    return graphs


GRAPH_WRITERS = {"genai": _write_genai, "torch": _write_torch_graphs}


def _torch_graphs(format: str) -> dict:
    """config.json's ``export.graphs`` of the prefill / decode graphs: a TensorRT dir keeps them under "onnx" (its
    engines are added beside them once built)."""
    return {"onnx": dict(EXPORT_GRAPHS)} if format == "tensorrt" else dict(EXPORT_GRAPHS)


def _export_entry(format: str, plan: ExportPlan, model) -> dict:
    """config.json's ``export`` key: what was written and the dimensions a runtime needs."""
    cfg, precision = model.config, plan.precision
    return {"format": format, "precision": precision, "opset": plan.opset, "graph": plan.graph,
            "graphs": {"model": GENAI_GRAPH} if plan.graph == "genai" else _torch_graphs(format),
            "n_layers": len(model.layers), "n_kv_heads": cfg.n_kv_heads,
            "head_dim": cfg.head_dim, "vocab_size": cfg.vocab_size, "max_seq_len": cfg.max_seq_len,
            "int8_style": plan.style if precision == "int8" else None,
            "int4_style": plan.int4_style if precision == "int4" else None, "external_data": plan.external}


def _parity(model, tmp: Path, config: dict, graphs: dict, tokenizer, precision: str, data,
            eval_tokens: int | None) -> dict:
    """The parity report of the written dir, loaded by the runtime table's ONNX Runtime row as ``prunus serve
    --no-native`` loads it (a TensorRT dir's ONNX graphs with their float semantics, as TensorRT computes them), and
    of a genai graph in the native kernels too."""
    from prunus.data.corpus import default_data, load_corpus

    corpus = load_corpus(default_data(data, tokenizer), tokenizer, max_bytes=1 << 16, vocab_size=model.config.vocab_size)
    token_bytes = tokenizer.token_bytes()
    ref = torch_reference(model, corpus.val, token_bytes, eval_tokens=eval_tokens)
    report = compare(ref, export_graphs(tmp, config, threads=os.cpu_count()), corpus.val, token_bytes, precision)
    report["corpus"] = corpus.name
    report["runtimes"] = {"onnxruntime": ort_record(report, precision)}
    if "model" in graphs:  # served by the native kernels where they run: checked on this CPU's path too
        report["runtimes"]["native"] = native_parity(model, graphs["model"], genai_dims(model), ref, corpus.val,
                                                     token_bytes, precision)
    return report


def _choose_graph(graph: str | None, format: str, cfg, modules: dict, precision: str) -> str:
    """The graph kind to write: the one asked for (genai refused in one line where unsupported), or genai where
    it supports the model, else torch."""
    if graph is not None and graph not in GRAPHS:
        raise PrunusError(f"--graph {graph!r}: choose one of {', '.join(GRAPHS)}")
    if graph == "genai" and format != "onnx":
        raise PrunusError(f"--graph genai is an ONNX Runtime graph; --format {format} takes --graph torch")
    if graph == "genai":
        check_genai_support(cfg, modules, precision)
    if graph is None:
        graph = "genai" if format == "onnx" and not unsupported_features(cfg, modules, precision) else "torch"
    return graph


def _build_engines(tmp: Path, precision: str, cfg, n_layers: int, timing_cache, console) -> dict:
    from . import tensorrt_timing as timing
    from .tensorrt_build import build_engine, profile_shapes

    work, entry = tmp / "tensorrt.timing", None  # the builds read and write the timings in the export dir
    if timing_cache:
        if Path(timing_cache).is_file():
            shutil.copyfile(timing_cache, work)
    else:
        entry = _timing_entry(console)
        work.write_bytes(b"" if entry is None else timing.cached_timings(entry))
    built = {}
    for kind in ("prefill", "decode"):
        console.print(f"tensorrt: building {ENGINE_GRAPHS[kind]} ({precision})")
        shapes = profile_shapes(kind, n_layers, cfg.n_kv_heads, cfg.head_dim, cfg.max_seq_len)
        built[kind] = build_engine(tmp / EXPORT_GRAPHS[kind], tmp / ENGINE_GRAPHS[kind], precision, shapes, work)
    if timing_cache:
        Path(timing_cache).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(work, timing_cache)
    elif entry is not None:
        timing.store_timings(entry, work)
    return built


def _timing_entry(console):
    """The verified-cache entry of this TensorRT and GPU (prunus.export.tensorrt_timing), or None when the cache
    dir cannot be used (the builds then measure afresh)."""
    import tensorrt

    from .tensorrt_timing import timing_entry

    try:
        return timing_entry(tensorrt.__version__, torch.cuda.get_device_name(0))
    except PrunusError as e:
        console.print(f"tensorrt: the timing cache is not used: {e}")
        return None
