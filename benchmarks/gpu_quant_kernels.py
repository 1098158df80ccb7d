"""CUDA kernel paths of prunus's quantized Linear modules: correctness against the dequantizing path, and timings.

Checks, at the Linear shapes of SmolLM2-135M (dim 576, hidden 1536, 3 kv heads of 64, vocab 49,152),
and one 7B-class layer pair (4096 x 14336) for timings only:

* int4 (Int4Linear): ``torch._weight_int4pack_mm`` (tinygemm) against (a) the same bf16 inputs,
  bf16 scales and zeros dequantized and summed in float32, and (b) the module's own
  dequantizing path in float32 (float32 scales);
* int8 W8A8 dynamic (QuantizedLinear): ``torch._int_mm`` on CUDA against the same module on CPU;
* fp8 W8A8 (QuantizedLinear): ``torch._scaled_mm`` on CUDA (SM >= 8.9) against the same module on CPU.

Timings (CUDA events, median of repeated calls after warm-up) of one Linear per shape at batch 1
and 8 rows, eager (host launch overhead included) and replayed from a CUDA graph of 100 calls
(the GPU's own time): bf16 ``F.linear``, Int4Linear (tinygemm), and the int8 / fp8 modules as the torch
backend runs them, plus the raw ``_int_mm`` / ``_scaled_mm`` kernels on rows padded to what
they accept (32 / 16). Prints one JSON line per shape and writes JSON (``--out``, default $OUT or .).

    python -m benchmarks.gpu_quant_kernels [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from pathlib import Path

import torch
from torch import nn


from prunus.models.int4 import rtn_int4
from prunus.models.quantized import QuantizedLinear, _int_mm_fits, _scaled_mm_fits
from prunus.models.quantized_int4 import Int4Linear, tinygemm_available

# (name, in_features, out_features) of SmolLM2-135M's Linear layers
SHAPES = [("wq/wo", 576, 576), ("wk/wv", 576, 192), ("w1/w3", 576, 1536), ("w2", 1536, 576), ("output", 576, 49152)]
# a 7B-class layer pair, where batch-1 decode is bound by reading the weights: timed for comparison
LARGE = [("large 4096x14336", 4096, 14336), ("large 14336x4096", 14336, 4096)]
PER_BLOCK = {"wq/wo": 2, "wk/wv": 2, "w1/w3": 2, "w2": 1}
N_BLOCKS = 30


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float().cpu(), b.float().cpu()
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


def time_ms(fn, reps: int = 50) -> float:
    """Median milliseconds of one eager call (CUDA events around it): host launch overhead included."""
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def graph_ms(fn, calls: int = 100, reps: int = 5) -> float | None:
    """Milliseconds per call of ``calls`` calls captured in one CUDA graph and replayed (the GPU's own time,
    no launch overhead): the median over ``reps`` replays. None when the call cannot be captured."""
    try:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(3):
                fn()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(calls):
                fn()
    except RuntimeError as e:
        return f"not capturable: {str(e).splitlines()[0][:120]}"
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / calls)
    return statistics.median(times)


def int4_checks(lin: nn.Linear, group: int) -> dict:
    m = Int4Linear.from_quantized(lin, *rtn_int4(lin.weight, group, False), group, False, "rtn").cuda()
    out = {}
    for rows in (1, 8, 32):
        x = torch.randn(rows, lin.in_features, device="cuda")
        xb = x.to(torch.bfloat16)
        assert tinygemm_available(xb, m)
        y = m(xb)
        _, sz = m._tinygemm_weight()
        scale, zero = sz[..., 0].float().t(), sz[..., 1].float().t()
        w = (m.unpacked().float() - 8) * scale.repeat_interleave(group, 1) + zero.repeat_interleave(group, 1)
        out[f"rows{rows}"] = {"vs_bf16_params_fp32_sum": rel(y, xb.float() @ w.t()),
                              "vs_module_fp32_path": rel(y, m(xb.float()))}
    return out


def w8a8_checks(lin: nn.Linear, scheme: str) -> dict:
    q = QuantizedLinear.from_linear(lin, scheme, "per_channel")
    qc = QuantizedLinear.from_linear(lin, scheme, "per_channel").cuda()
    out = {}
    for rows in (1, 8, 16, 32):
        x = torch.randn(rows, lin.in_features)
        xc = x.cuda()
        kernel = _int_mm_fits(xc, qc.weight) if scheme == "w8a8-dynamic" else _scaled_mm_fits(xc, qc.weight)
        out[f"rows{rows}"] = {"kernel": bool(kernel), "rel_vs_cpu_path": rel(qc(xc), q(x))}
    return out


def timings(lin: nn.Linear, group: int) -> dict:
    """Per call: eager (host launch included) and CUDA-graph replay (GPU time) of each kind."""
    lb = nn.Linear(lin.in_features, lin.out_features, bias=False).cuda().to(torch.bfloat16)
    m4 = Int4Linear.from_quantized(lin, *rtn_int4(lin.weight, group, False), group, False, "rtn").cuda()
    m8 = QuantizedLinear.from_linear(lin, "w8a8-dynamic", "per_channel").cuda()
    m8w = QuantizedLinear.from_linear(lin, "int8-weight-only", "per_channel").cuda()
    f8 = QuantizedLinear.from_linear(lin, "fp8-w8a8", "per_channel").cuda()
    out = {}
    for rows in (1, 8):
        xb = torch.randn(rows, lin.in_features, device="cuda", dtype=torch.bfloat16)
        fns = {"bf16": lambda: lb(xb), "int4_tinygemm": lambda: m4(xb), "int8_weight_only_module": lambda: m8w(xb),
               "w8a8_int8_module": lambda: m8(xb), "fp8_w8a8_module": lambda: f8(xb)}
        x32 = torch.randint(-127, 127, (32, lin.in_features), device="cuda", dtype=torch.int8)
        fns["raw_int_mm_32rows"] = lambda: torch._int_mm(x32, m8.weight.t())
        if torch.cuda.get_device_capability() >= (8, 9):
            x16 = torch.randn(16, lin.in_features, device="cuda").to(torch.float8_e4m3fn)
            one = torch.ones((), device="cuda")
            fns["raw_scaled_mm_16rows"] = lambda: torch._scaled_mm(x16, f8.weight.t(), scale_a=one, scale_b=one,
                                                                   out_dtype=torch.bfloat16)
        out[f"rows{rows}"] = {"eager": {k: time_ms(f) for k, f in fns.items()},
                              "graph": {k: graph_ms(f) for k, f in fns.items()}}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("gpu_quant_kernels: no CUDA device; nothing to measure")
        return
    torch.manual_seed(0)
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "capability": list(torch.cuda.get_device_capability()), "shapes": {}}
    for name, k, n in SHAPES + LARGE:
        lin = nn.Linear(k, n, bias=False)
        with torch.no_grad():
            lin.weight.normal_(0, 0.02)
        group = 64 if k % 128 else 128
        entry = {"in": k, "out": n, "group": group, "int4": int4_checks(lin, group),
                 "w8a8_int8": w8a8_checks(lin, "w8a8-dynamic"), "timing_ms": timings(lin, group)}
        if torch.cuda.get_device_capability() >= (8, 9):
            entry["fp8_w8a8"] = w8a8_checks(lin, "fp8-w8a8")
        result["shapes"][name] = entry
        print(name, json.dumps(entry), flush=True)
    for rows in ("rows1", "rows8"):  # the 30 blocks' Linear layers of one decode step (output head apart)
        for mode in ("eager", "graph"):
            kinds = result["shapes"]["wq/wo"]["timing_ms"][rows][mode]
            per_step = {}
            for kind in kinds:
                vals = [result["shapes"][s]["timing_ms"][rows][mode][kind] for s in PER_BLOCK]
                if all(isinstance(v, float) for v in vals):
                    per_step[kind] = N_BLOCKS * sum(c * v for c, v in zip(PER_BLOCK.values(), vals))
            result[f"block_linears_per_step_ms_{rows}_{mode}"] = per_step
            print(rows, mode, "30 blocks' linears per decode step (ms):", json.dumps(per_step))
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "gpu_quant_kernels.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
