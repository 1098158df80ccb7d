"""int8 post-training quantization of a generic module's ONNX graph (``prunus export --precision int8``).

A graph with convolutions is quantized **statically**: pre-processed by ONNX Runtime (shape inference, and
graph optimisation that folds each BatchNorm into the conv before it), then ``quantize_static``: QDQ format,
int8 weights per output channel in a 7-bit range, uint8 activations with ranges calibrated (min / max) on
samples of the task's data (``--data``'s training split, so the parity check's held-out inputs are not the
calibration set). Static int8 needs real samples: without ``--data`` it is refused, unless ``--data random``
asks for seeded random inputs of the recorded shape, and then the report says the calibration was synthetic.
Any other graph (Linear-only, recurrent, attention) is quantized **dynamically** (``quantize_dynamic``: int8
weights of MatMul / Gemm, LSTM and embedding Gather, activations quantized at run time; no calibration).
ONNX Runtime has no int8 GRU / RNN, so those stay float: the report gives the share of the fp32 graph's
parameters held as int8 (``int8_param_share``) and names the weight-bearing operators left float.
Parity (:func:`.module_export.module_parity`) compares the graph, as ONNX Runtime serves it, with the fp32 PyTorch
module: top-1 agreement
for a classifier, the relative output MSE (and, with targets, the MSE increase) for a regressor.

Two choices decide the static path's accuracy:

* **7-bit weights** (``reduce_range``): ONNX Runtime runs uint8 x int8 products on x86 CPUs without VNNI
  (AVX2, AVX-512F) with ``vpmaddubsw``, which adds two products into a saturating int16; with full-range
  weights, large activations saturate and the logits drift (ResNet-18 on digits lost 3 to 4 points of top-1).
  Weights in [-64, 64] keep every pair in range; the graph stays accurate on every CPU it is served on
  (the dynamic path uses the same range).
* **calibration samples spread over the whole split** (:func:`spread_indices`): datasets are often stored in
  class order (an image folder is), so the first samples can all be one class, whose activation ranges are
  not the task's.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
import torch

from prunus.artifacts.errors import PrunusError

from .random_inputs import random_inputs

CALIB_SAMPLES, CALIB_BATCH = 128, 16
INT8_MIN_AGREEMENT = 0.9
RANDOM = "random"  # --data random: seeded random inputs of the recorded shape (synthetic calibration / probes)
STATIC_OPS = ("Conv", "ConvTranspose")
DYNAMIC_OPS = ["MatMul", "Gemm", "LSTM", "Gather"]


def spread_indices(n: int, k: int) -> list[int]:
    """``min(n, k)`` indices evenly spaced over ``0 .. n - 1`` (the first and the last included)."""
    if k >= n:
        return list(range(n))
    return [round(i * (n - 1) / (k - 1)) if k > 1 else 0 for i in range(k)]


def calibration_inputs(config: dict, data: str | None, model_dir: Path) -> tuple[torch.Tensor, str]:
    """The calibration samples and what they are: ``data``'s training split (spread over it), or with
    ``--data random`` seeded random inputs of the recorded shape; nothing else (see the module docstring)."""
    if data is None:
        raise PrunusError(f"{model_dir}: static int8 calibrates activation ranges on real samples; pass --data (its "
                          "training split calibrates), or --data random to calibrate on random inputs (synthetic)")
    if data == RANDOM:
        if config.get("input") is None:
            raise PrunusError(f"{model_dir}: config.json records no input shape; pass --data to calibrate int8")
        return random_inputs(config["input"], CALIB_SAMPLES), f"synthetic: {CALIB_SAMPLES} seeded random inputs"
    from torch.utils.data import default_collate

    from prunus.data.module_datasets import module_datasets

    train = module_datasets(data)[0]
    picked = spread_indices(len(train), CALIB_SAMPLES)
    return default_collate([train[i] for i in picked])[0], f"{len(picked)} samples of {data}'s training split"


def int8_method(graph: Path) -> str:
    """``static`` for a graph with convolutions, else ``dynamic`` (see the module docstring)."""
    import onnx

    ops = {n.op_type for n in onnx.load(str(graph), load_external_data=False).graph.node}
    return "static" if ops & set(STATIC_OPS) else "dynamic"


def _reader(name: str, inputs: torch.Tensor):
    from onnxruntime.quantization import CalibrationDataReader

    class Reader(CalibrationDataReader):
        def __init__(self):
            self.batches = iter([{name: inputs[i:i + CALIB_BATCH].numpy()} for i in range(0, len(inputs), CALIB_BATCH)])

        def get_next(self):
            return next(self.batches, None)

    return Reader()


def quantize_module_graph(fp32: Path, out: Path, calibration: torch.Tensor | None) -> None:
    """``fp32`` (an ONNX graph with one input) -> ``out``: static QDQ with ``calibration``, dynamic without
    (see the module docstring)."""
    from .quiet_logs import quiet_loggers

    with tempfile.TemporaryDirectory(prefix="prunus-int8-") as tmp, quiet_loggers():
        try:
            if calibration is None:
                _dynamic(fp32, out, Path(tmp))
            else:
                _static(fp32, out, Path(tmp), calibration)
        except PrunusError:
            raise
        except Exception as e:  # noqa: BLE001 - one line naming the reason
            from prunus.models.module_factory import reason

            raise PrunusError(f"export --precision int8: ONNX Runtime could not quantize the graph ({reason(e)}); "
                              "export at fp32") from None


def _static(fp32: Path, out: Path, tmp: Path, calibration: torch.Tensor) -> None:
    import onnx
    from onnxruntime.quantization import CalibrationMethod, QuantFormat, QuantType, quantize_static
    from onnxruntime.quantization.shape_inference import quant_pre_process

    name = onnx.load(str(fp32), load_external_data=False).graph.input[0].name
    prepared = tmp / "prepared.onnx"
    quant_pre_process(str(fp32), str(prepared), skip_symbolic_shape=True)
    quantize_static(str(prepared), str(out), _reader(name, calibration), quant_format=QuantFormat.QDQ,
                    per_channel=True, reduce_range=True, activation_type=QuantType.QUInt8,
                    weight_type=QuantType.QInt8, calibrate_method=CalibrationMethod.MinMax,
                    extra_options={"CalibTensorRangeSymmetric": False})


def _dynamic(fp32: Path, out: Path, tmp: Path) -> None:
    """``quantize_dynamic`` of the graph pre-processed without its recorded intermediate shapes (the exporter's
    shapes of a recurrent layer's outputs disagree with ONNX shape inference; they are inferred again)."""
    import onnx
    from onnxruntime.quantization import QuantType, quantize_dynamic
    from onnxruntime.quantization.shape_inference import quant_pre_process

    model = onnx.load(str(fp32))
    del model.graph.value_info[:]
    plain, prepared = tmp / "plain.onnx", tmp / "prepared.onnx"
    onnx.save(model, str(plain))
    quant_pre_process(str(plain), str(prepared), skip_symbolic_shape=True)
    quantize_dynamic(str(prepared), str(out), op_types_to_quantize=DYNAMIC_OPS, per_channel=True, reduce_range=True,
                     weight_type=QuantType.QInt8)


def int8_weight_share(graph: Path) -> float:
    """The share of the graph's initializer bytes held as int8 (how much of the weights were quantized)."""
    import onnx
    from onnx import numpy_helper

    sizes = [(t.data_type, numpy_helper.to_array(t).nbytes) for t in onnx.load(str(graph)).graph.initializer]
    total = sum(n for _, n in sizes)
    return float(np.float64(sum(n for d, n in sizes if d == onnx.TensorProto.INT8)) / max(total, 1))


def _float_params(graph) -> int:
    import onnx

    return sum(int(np.prod(t.dims)) for t in graph.initializer if t.data_type == onnx.TensorProto.FLOAT)


def quantized_share(fp32: Path, int8: Path) -> dict:
    """``int8_param_share``: int8 values of ``int8`` over the float parameters of ``fp32``; ``float_ops``: the
    operator types of ``int8`` that still read a float weight (an initializer of two or more dimensions)."""
    import onnx

    before, after = onnx.load(str(fp32)).graph, onnx.load(str(int8)).graph
    quantized = sum(int(np.prod(t.dims)) for t in after.initializer if t.data_type == onnx.TensorProto.INT8)
    matrices = {t.name for t in after.initializer  # a weight matrix, not a bias shaped (1, n)
                if t.data_type == onnx.TensorProto.FLOAT and sum(d > 1 for d in t.dims) >= 2}
    float_ops = sorted({n.op_type for n in after.node if matrices & set(n.input)})
    return {"int8_param_share": round(min(1.0, quantized / max(_float_params(before), 1)), 4), "float_ops": float_ops}
