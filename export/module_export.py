"""A generic module's model dir -> an ONNX export dir, checked for parity against the PyTorch module.

The module (rebuilt by its factory, imported only when trusted: :func:`prunus.models.module_dir.load_module`)
is exported through ``torch.onnx.export`` (the dynamo exporter) as one graph ``model.onnx``: input ``input``
of the sample shape the model dir records, with a dynamic batch axis; output ``output``. The parity check runs
the graph in ONNX Runtime on held-out inputs (``--data``'s held-out split, else - or with ``--data random`` -
seeded random inputs of the recorded shape, 64 of them in one batch: another batch size than the one traced;
``inputs`` in the report says which) and reports:

* ``max_abs_outputs``: max |output_ort - output_torch|;
* ``top1_agreement``: the share of inputs whose argmax over the last axis agrees (outputs with more than one
  value per input);
* ``output_rel_mse`` (outputs of one value per input, a regressor's): mean squared difference over the
  variance of the PyTorch outputs;
* ``mse_increase`` (a regression task with ``--data``): the graph's MSE against the targets over the module's,
  minus 1.

The graph is checked as it is served: the written dir loaded by the runtime table's ONNX Runtime row for a
generic module's export (:mod:`prunus.runtime.ort_module`), the probe inputs through its ``predict``.
fp32 must match tightly (:data:`MODULE_TOLERANCES`); a failed check writes nothing unless ``verify`` is off.
The export dir holds ``model.onnx``, ``parity.json``, ``config.json`` (the model dir's, plus ``export``) and
``prunus.json``. ONNX at fp32, or at int8 (``--precision int8``: static post-training quantization of the
graph, :mod:`.module_int8`; parity then holds top-1 agreement, or the regression limits, of
:data:`MODULE_TOLERANCES`).
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import torch

from prunus.artifacts.atomic import atomic_dir, atomic_write_bytes, atomic_write_json
from prunus.artifacts.errors import PrunusError
from prunus.artifacts.paths import check_output
from prunus.models.module_dir import carried_files, load_module, read_module_config
from prunus.models.module_factory import reason

from .parity import ParityFailed
from .random_inputs import random_inputs

MODULE_TOLERANCES = {"fp32": {"max_abs_outputs": 1e-3, "top1_agreement": 1.0},
                     # int8 (.module_int8): a classifier's argmax, a regressor's outputs within 2% of their variance
                     # and its error against the targets at most 10% above the module's
                     "int8": {"top1_agreement": 0.9, "output_rel_mse": 0.02, "mse_increase": 0.1}}
MODULE_PARITY_KEYS = ("max_abs_outputs", "top1_agreement", "output_rel_mse", "mse_increase", "passed")
PROBE_SAMPLES = 64
GRAPH = "model.onnx"


def probe_inputs(config: dict, data: str | None, model_dir: Path) -> tuple[torch.Tensor, torch.Tensor | None, str]:
    """The inputs of the parity check, their targets (None for random inputs) and what they are (see the module
    docstring)."""
    from .module_int8 import RANDOM

    if data is not None and data != RANDOM:
        from torch.utils.data import default_collate

        from prunus.data.module_datasets import module_datasets

        val = module_datasets(data)[1]
        x, y = default_collate([val[i] for i in range(min(len(val), PROBE_SAMPLES))])
        return x, y, f"{len(x)} held-out samples of {data}"
    if config.get("input") is None:
        raise PrunusError(f"{model_dir}: config.json records no input shape; pass --data with held-out samples")
    return random_inputs(config["input"], PROBE_SAMPLES), None, f"synthetic: {PROBE_SAMPLES} seeded random inputs"


def reference_outputs(module: torch.nn.Module, inputs: torch.Tensor, model_dir) -> torch.Tensor:
    """The module's outputs on the probe inputs; one line when it cannot take them (random values of the
    recorded input that its layers refuse: token ids past an embedding's rows, floats for an embedding)."""
    try:
        with torch.inference_mode():
            return module(inputs).float()
    except Exception as e:  # noqa: BLE001 - the module's own error, in one line
        spec = f"{inputs.dtype}".removeprefix("torch.")
        raise PrunusError(f"export: the module in {model_dir} fails on inputs of {tuple(inputs.shape[1:])} {spec} "
                          f"({reason(e)}); pass --data with samples it takes (config.json input records the shape, "
                          "dtype and, for token ids, high)") from None


def _regression_checks(ref: torch.Tensor, got: torch.Tensor, targets: torch.Tensor | None, task) -> dict:
    out = {"output_rel_mse": float(((got - ref) ** 2).mean() / ref.var(0, unbiased=False).mean().clamp_min(1e-12))}
    if targets is not None and task == "regression" and targets.shape == ref.shape:
        out["mse_increase"] = float(((got - targets) ** 2).mean() / ((ref - targets) ** 2).mean().clamp_min(1e-12) - 1)
    return out


def _export_graph(module: torch.nn.Module, example: torch.Tensor, opset: int):
    from torch.export import Dim

    from .onnx_export import _export

    try:
        return _export(module, (example,), ["input"], ["output"], ({0: Dim("batch")},), opset)
    except Exception as e:  # noqa: BLE001 - the user's module may not trace: one line naming the reason
        raise PrunusError(f"export: torch.onnx.export could not export the module ({reason(e)}); make its forward "
                          "traceable (torch.export)") from None


def served_outputs(export_dir: Path, config: dict, inputs: torch.Tensor) -> torch.Tensor:
    """The outputs of ``inputs`` through the backend ``prunus serve`` loads for the written export dir."""
    from .backend_parity import served_backend

    backend = served_backend(export_dir, config, len(inputs), threads=os.cpu_count())
    try:
        return torch.from_numpy(backend.predict(inputs.numpy())).float()
    finally:
        backend.close()


def module_parity(module: torch.nn.Module, export_dir: Path, config: dict, inputs: torch.Tensor,
                  precision: str = "fp32", *, targets: torch.Tensor | None = None, task: str | None = None) -> dict:
    """The parity report of the written export dir (its ``config``) as it is served against ``module`` on
    ``inputs`` (``targets``: theirs, for a regression task's MSE increase)."""
    with torch.inference_mode():
        ref = module(inputs).float()
    got = served_outputs(export_dir, config, inputs)
    if got.shape != ref.shape:
        raise PrunusError(f"export: ONNX Runtime returns shape {tuple(got.shape)} where the module returns "
                          f"{tuple(ref.shape)}; the graph does not keep the batch axis dynamic")
    report = {"precision": precision, "max_abs_outputs": float((ref - got).abs().max()), "samples": len(inputs),
              "output_shape": list(ref.shape[1:])}
    if ref.ndim >= 2 and ref.shape[-1] > 1:
        report["top1_agreement"] = float((ref.argmax(-1) == got.argmax(-1)).float().mean())
    else:
        report.update(_regression_checks(ref, got, None if targets is None else targets.float(), task))
    tol = {k: v for k, v in MODULE_TOLERANCES[precision].items() if k in report}
    failed = [k for k, lim in tol.items()
              if math.isnan(report[k]) or (report[k] < lim if k == "top1_agreement" else report[k] > lim)]
    return {**report, "tolerances": tol, "failed": failed, "passed": not failed}


def _int8_graph(proto, tmp: Path, module, config: dict, data, model_dir: Path, probe) -> dict:
    """The fp32 graph quantized to int8 as ``tmp/model.onnx`` (:mod:`.module_int8`); its parity report (``config``:
    the export dir's, written)."""
    from .module_int8 import calibration_inputs, int8_method, int8_weight_share, quantize_module_graph, quantized_share
    from .onnx_export import save_graph

    fp32 = tmp / "model-fp32.onnx"
    save_graph(proto, fp32, external_data=False)
    method = int8_method(fp32)
    calibration, calibrated = calibration_inputs(config, data, model_dir) if method == "static" else (
        None, "none: activations quantized at run time")
    quantize_module_graph(fp32, tmp / GRAPH, calibration)
    fp32_bytes, share = fp32.stat().st_size, quantized_share(fp32, tmp / GRAPH)
    fp32.unlink()
    inputs, targets, _ = probe
    report = module_parity(module, tmp, config, inputs, precision="int8", targets=targets, task=config.get("task"))
    return {**report, "int8_method": method, "calibration": calibrated, **share, "graph_bytes_fp32": fp32_bytes,
            "graph_bytes": (tmp / GRAPH).stat().st_size, "int8_weight_share": round(int8_weight_share(tmp / GRAPH), 4)}


def _check_request(format: str, precision: str | None, opset: int | None) -> int:
    from .onnx_export import DEFAULT_OPSET, MIN_OPSET

    if format != "onnx":
        raise PrunusError(f"--format {format}: a generic module exports to onnx in this version; use --format onnx")
    if precision not in (None, "fp32", "int8"):
        raise PrunusError(f"--precision {precision}: a generic module exports at fp32 or int8 (static, calibrated); "
                          "use --precision fp32 or int8")
    opset = opset or DEFAULT_OPSET["onnx"]
    if not MIN_OPSET <= opset <= 23:
        raise PrunusError(f"--opset {opset}: choose an opset from {MIN_OPSET} to 23")
    return opset


def export_module(model_dir: str | Path, out: str | Path, *, format: str = "onnx", precision: str | None = None,
                  opset: int | None = None, verify: bool = True, data: str | None = None, overwrite: bool = False,
                  command: str | None = None, trust_factory=False, manifest: dict | None = None):
    """Export the generic module dir ``model_dir`` to ``out`` (see the module docstring); an ExportResult.
    Raises PrunusError on bad input and ParityFailed when the check fails (unless ``verify`` is False)."""
    from .export_manifest import PARITY, ExportResult, write_manifest
    from prunus.models.model_dir import CONFIG, verify_model_dir

    model_dir, out = Path(model_dir), Path(out)
    opset = _check_request(format, precision, opset)
    precision = precision or "fp32"
    check_output(out, [("MODEL_DIR", model_dir), ("--data", data)])
    if out.exists() and not overwrite:
        raise PrunusError(f"{out}: already exists; choose another output path or pass --overwrite")
    manifest = manifest or verify_model_dir(model_dir)
    config = read_module_config(model_dir)
    module = load_module(model_dir, config, trust_factory=trust_factory).float().eval()
    probe = probe_inputs(config, data, model_dir)
    inputs = probe[0]
    reference_outputs(module, inputs, model_dir)
    export = {"format": "onnx", "precision": precision, "opset": opset, "graph": "module", "graphs": {"model": GRAPH},
              "inputs": ["input"], "outputs": ["output"], "dynamic_axes": {"input": [0], "output": [0]}}
    config = {**config, "export": export}
    with atomic_dir(out, overwrite=overwrite) as tmp:
        proto = _export_graph(module, inputs[:2] if len(inputs) > 2 else torch.cat([inputs, inputs])[:2], opset)
        from .onnx_export import save_graph

        atomic_write_json(tmp / CONFIG, config)  # the runtime table loads the written dir for the check
        if precision == "int8":
            report = _int8_graph(proto, tmp, module, config, data, model_dir, probe)
        else:
            save_graph(proto, tmp / GRAPH, external_data=False)
            report = module_parity(module, tmp, config, inputs, targets=probe[1], task=config.get("task"))
        report["inputs"] = probe[2]
        if not report["passed"] and verify:
            raise ParityFailed(report)
        atomic_write_json(tmp / PARITY, report)
        for name, data in carried_files(model_dir).items():  # a table's labels.json
            atomic_write_bytes(tmp / name, data)
        write_manifest(tmp, model_dir, manifest, report, command, keys=MODULE_PARITY_KEYS)
    return ExportResult(out, config, report)
