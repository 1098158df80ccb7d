"""Static int8 post-training quantization of a generic module's ONNX graph (``prunus export --precision int8``).

The fp32 graph the exporter writes is pre-processed by ONNX Runtime (shape inference, and graph optimisation
that folds each BatchNorm into the conv before it), then quantized by ``quantize_static``: QDQ format, int8
weights per output channel in a 7-bit range, uint8 activations with ranges calibrated (min / max) on samples of
the task's data (``--data``'s training split, so the parity check's held-out inputs are not the calibration set;
seeded random inputs of the recorded shape without ``--data``). The graph stores int8 values and fp32 scales as plain
initializers. Parity (:func:`.module_export.module_parity`) compares it with the fp32 PyTorch module: top-1
agreement must reach :data:`INT8_MIN_AGREEMENT`.

Two choices decide the accuracy:

* **7-bit weights** (``reduce_range``): ONNX Runtime runs uint8 x int8 products on x86 CPUs without VNNI
  (AVX2, AVX-512F) with ``vpmaddubsw``, which adds two products into a saturating int16; with full-range
  weights, large activations saturate and the logits drift (ResNet-18 on digits lost 3 to 4 points of top-1).
  Weights in [-64, 64] keep every pair in range; the graph stays accurate on every CPU it is served on.
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


def spread_indices(n: int, k: int) -> list[int]:
    """``min(n, k)`` indices evenly spaced over ``0 .. n - 1`` (the first and the last included)."""
    if k >= n:
        return list(range(n))
    return [round(i * (n - 1) / (k - 1)) if k > 1 else 0 for i in range(k)]


def calibration_inputs(config: dict, data: str | None, model_dir: Path) -> torch.Tensor:
    """The calibration samples: ``data``'s training split (spread over it), else seeded random inputs of the
    recorded shape."""
    if data is not None:
        from torch.utils.data import default_collate

        from prunus.data.module_datasets import module_datasets

        train = module_datasets(data)[0]
        return default_collate([train[i] for i in spread_indices(len(train), CALIB_SAMPLES)])[0]
    if config.get("input") is None:
        raise PrunusError(f"{model_dir}: config.json records no input shape; pass --data to calibrate int8")
    return random_inputs(config["input"], CALIB_SAMPLES)


def _reader(name: str, inputs: torch.Tensor):
    from onnxruntime.quantization import CalibrationDataReader

    class Reader(CalibrationDataReader):
        def __init__(self):
            self.batches = iter([{name: inputs[i:i + CALIB_BATCH].numpy()} for i in range(0, len(inputs), CALIB_BATCH)])

        def get_next(self):
            return next(self.batches, None)

    return Reader()


def quantize_module_graph(fp32: Path, out: Path, calibration: torch.Tensor) -> None:
    """``fp32`` (an ONNX graph with one input) -> ``out``, statically quantized (see the module docstring)."""
    import onnx
    from onnxruntime.quantization import CalibrationMethod, QuantFormat, QuantType, quantize_static
    from onnxruntime.quantization.shape_inference import quant_pre_process

    from .quiet_logs import quiet_loggers

    name = onnx.load(str(fp32), load_external_data=False).graph.input[0].name
    with tempfile.TemporaryDirectory(prefix="prunus-int8-") as tmp, quiet_loggers():
        prepared = Path(tmp) / "prepared.onnx"
        try:
            quant_pre_process(str(fp32), str(prepared), skip_symbolic_shape=True)
            quantize_static(str(prepared), str(out), _reader(name, calibration), quant_format=QuantFormat.QDQ,
                            per_channel=True, reduce_range=True, activation_type=QuantType.QUInt8,
                            weight_type=QuantType.QInt8,
                            calibrate_method=CalibrationMethod.MinMax,
                            extra_options={"CalibTensorRangeSymmetric": False})
        except Exception as e:  # noqa: BLE001 - one line naming the reason
            from prunus.models.module_factory import reason

            raise PrunusError(f"export --precision int8: ONNX Runtime could not quantize the graph ({reason(e)}); "
                              "export at fp32") from None


def int8_weight_share(graph: Path) -> float:
    """The share of the graph's initializer bytes held as int8 (how much of the weights were quantized)."""
    import onnx
    from onnx import numpy_helper

    sizes = [(t.data_type, numpy_helper.to_array(t).nbytes) for t in onnx.load(str(graph)).graph.initializer]
    total = sum(n for _, n in sizes)
    return float(np.float64(sum(n for d, n in sizes if d == onnx.TensorProto.INT8)) / max(total, 1))
