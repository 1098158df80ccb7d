"""Compression quality: each family beside the float model it came from, on the demo model and a real one.

    OMP_WAIT_POLICY=PASSIVE .venv/bin/python -m benchmarks.compress_quality [--model demo] [--model smollm2|DIR]

One section per family; each prints bits per byte (with the held-out tokens behind it),
its change against fp32, greedy agreement, the size of model.safetensors and CPU latency,
with the ratios against the fp32 model (timed alternately with it), and whether the family
meets its quality target. ``--model`` may be given more than once (``demo``: the demo model,
trained when missing; ``smollm2``: SmolLM2-135M-Instruct through ``real_model.py``; or any
model dir): every section runs on each, and a last table puts every target of every model
side by side. Evaluation is the one every scorer of prunus uses (``prunus.data.evaluate``:
the same held-out slice, English prose for a pretrained tokenizer). Distillation trains, so it
runs only on models below ``DISTILL_MAX_PARAMS`` unless asked for by ``--only distill``.
A section is a function ``(bench) -> None``; add yours to SECTIONS.
Nothing here fails on a figure.
"""

from __future__ import annotations

import argparse
import copy
import subprocess
import sys
from pathlib import Path

import benchmarks._omp  # noqa: F401  (OMP_WAIT_POLICY=PASSIVE unless set; before torch loads)

import torch
from rich.console import Console
from rich.table import Table

from prunus.compress.context import build_context
from prunus.compress.quantize import quantize_pass
from prunus.compress.report import greedy, latency_ms, prompts_from, report_row
from prunus.compress.smoothquant import smoothquant_pass
from prunus.data.evaluate import DEFAULT_EVAL_TOKENS
from benchmarks.real_model import add_cache_argument, model_name, resolve_model
from benchmarks.harness import machine_line, spread
from benchmarks.compress_quality_distill import section_distill as _section_distill

ROOT = Path(__file__).resolve().parent.parent
DEMO = ROOT / "runs" / "demo" / "model"
DISTILL_MAX_PARAMS = 20_000_000
SMOOTHQUANT_ALPHA = 0.8  # what the w8a8-smoothquant recipe uses
console = Console(width=150)


def ratio_cell(q: tuple[float, float, float]) -> str:
    """A latency ratio to fp32 from (q1, median, q3) of paired runs: ``≈`` when the range holds 1 (within noise)."""
    lo, mid, hi = q
    return f"{'≈ ' if lo <= 1 <= hi else ''}{mid:.2f}x [{lo:.2f}–{hi:.2f}]"


class Bench:
    """The fp32 model, its context and its report row, shared by every section."""

    def __init__(self, model_dir: Path, eval_tokens: int, name: str = "", latency: bool = True):
        self.name, self.latency, self.targets = name, latency, []
        self.ctx = build_context(model_dir, eval_tokens=eval_tokens)
        self.prompts = prompts_from(self.ctx, self.ctx.teacher)
        self.reference = greedy(self.ctx.teacher, self.prompts)
        self.base = self.row("fp32", self.ctx.teacher)

    def fresh(self):
        """A float copy of the input model, for a section to compress."""
        return copy.deepcopy(self.ctx.teacher)

    def row(self, name: str, model) -> dict:
        r = report_row(name, model, self.ctx, reference=self.reference, prompts=self.prompts,
                       base=getattr(self, "base", None), latency=False)
        if hasattr(self, "base") and self.latency:
            r.update(self.paired_latency(model))
        return r

    def paired_latency(self, model, runs: int = 7) -> dict:
        """Latency of ``model`` over the fp32 model's, timed alternately so both see the same machine load:
        the median ratio of ``runs`` pairs and the interquartile range of the ratios (a range holding 1 is noise)."""
        prefill, decode = [], []
        for _ in range(runs):
            a, b = latency_ms(self.ctx.teacher, self.ctx), latency_ms(model, self.ctx)
            prefill.append(b["prefill_ms"] / a["prefill_ms"])
            decode.append(b["decode_ms"] / a["decode_ms"])
        return {"prefill_ratio": spread(prefill), "decode_ratio": spread(decode)}

    def table(self, title: str, rows: list[dict], target: tuple[str, float] | None = None) -> None:
        """Print rows beside fp32; ``target`` (row name, max relative bpb increase) is checked and shown."""
        t = Table(title=f"[{self.name}] {title}", title_justify="left",
                  caption=f"bits per byte on {self.base['val_tokens']:,} held-out tokens of {self.ctx.corpus_name}, "
                          f"windows of {self.ctx.seq_len}" + ("; latency ratios: median and, in brackets, interquartile range of 7 paired runs, "
                          "≈ where the range holds 1 (within noise)" if self.latency else ""), caption_justify="left")
        for col in ("variant", "bits/byte", "Δ bpb vs fp32", "greedy agree", "MB", "size ratio", "prefill ratio",
                    "decode ratio"):
            t.add_column(col, justify="left" if col == "variant" else "right")
        b = self.base
        for r in [b, *rows]:
            t.add_row(r["pass"], f"{r['val_bpb']:.4f}", f"{100 * r['bpb_change']:+.3f}%", f"{100 * r['agreement']:.1f}%",
                      f"{r['bytes'] / 1e6:.3f}", f"{r['bytes'] / b['bytes']:.3f}x",
                      *(ratio_cell(r[k]) if k in r else ("1.00x" if r is b and self.latency else "-")
                        for k in ("prefill_ratio", "decode_ratio")))
        console.print(t)
        if target is not None:
            name, limit = target
            row = next(r for r in rows if r["pass"] == name)
            ok = "meets" if row["bpb_change"] <= limit else "MISSES"
            self.targets.append((name, limit, row))
            console.print(f"  {name}: {100 * row['bpb_change']:+.3f}% bits per byte, {ok} the +{100 * limit:g}% target\n")


def section_int8_weight_only(bench: Bench) -> None:
    rows = [bench.row(f"int8 weight-only {g}", quantize_pass(bench.fresh(), bench.ctx, scheme="int8-weight-only",
                                                             granularity=g, group_size=gs))
            for g, gs in (("per_channel", None), ("per_group", 32), ("per_tensor", None))]
    bench.table("int8 weight-only (target: within +0.5% bits per byte of fp32)", rows,
                target=("int8 weight-only per_channel", 0.005))


def section_w8a8(bench: Bench) -> None:
    rows = []
    for smooth in (False, True):
        for scheme, calibration in (("w8a8-dynamic", "minmax"), ("w8a8-static", "percentile")):
            model = bench.fresh()
            if smooth:
                model = smoothquant_pass(model, bench.ctx, alpha=SMOOTHQUANT_ALPHA)
            model = quantize_pass(model, bench.ctx, scheme=scheme, calibration=calibration)
            name = ("smoothquant + " if smooth else "") + scheme + (f" {calibration}" if scheme == "w8a8-static" else "")
            rows.append(bench.row(name, model))
    bench.table(f"W8A8 int8 weights and activations, without and with SmoothQuant (alpha {SMOOTHQUANT_ALPHA}); "
                "per-token dynamic activation scales (the recipes) and static per-tensor ones "
                "(target: the w8a8-smoothquant recipe, SmoothQuant + dynamic, within +1.5%)", rows,
                target=("smoothquant + w8a8-dynamic", 0.015))


def section_fp8(bench: Bench) -> None:
    rows = [bench.row(f"{scheme} {g}", quantize_pass(bench.fresh(), bench.ctx, scheme=scheme, granularity=g))
            for scheme, g in (("fp8-weight-only", "per_channel"), ("fp8-weight-only", "per_tensor"),
                              ("fp8-w8a8", "per_channel"))]
    rows.append(bench.row("fp8-weight-only per_channel, last block float (recipe fp8)",
                          quantize_pass(bench.fresh(), bench.ctx, scheme="fp8-weight-only", exclude=["output", "layers.-1"])))
    bench.table("fp8 e4m3, emulated on CPU (target: the fp8 recipe, weight-only with the last block in float, within +1%)",
                rows, target=("fp8-weight-only per_channel, last block float (recipe fp8)", 0.01))


INT4_GROUP = 64


def _torchao_int4(model, names: list[str], method: str, group: int):
    """``model`` with each named Linear's weight replaced by torchao's int4 rounding of it, dequantized (a peer
    on the same weights; torchao's int4 kernels do not run on CPU, so the rounding is applied in float):
    ``tinygemm`` is what ``Int4WeightOnlyConfig`` stores (asymmetric, bfloat16 scales and float zeros),
    ``hqq`` torchao's HQQ (float zero points)."""
    from torchao.quantization import quant_primitives as qp

    with torch.no_grad():
        for name in names:
            lin = model.get_submodule(name)
            w = lin.weight.detach().float()
            if method == "hqq":
                q, scale, zero, _ = qp._choose_qparams_and_quantize_affine_hqq(
                    w, nbits=4, group_size=group, axis=1, compute_dtype=torch.float32, device="cpu", raw_output=True)
                deq = ((q.float().reshape(-1, group) - zero.reshape(-1, 1)) * scale.reshape(-1, 1)).reshape(w.shape)
            else:
                block = (1, group)
                scale, zero = qp._choose_qparams_affine_tinygemm(w, qp.MappingType.ASYMMETRIC, block, torch.int32, 0, 15,
                                                                 1e-6, torch.bfloat16, torch.bfloat16)
                q = qp._quantize_affine_tinygemm(w, block, scale, zero, torch.int32, 0, 15)
                deq = qp._dequantize_affine_tinygemm(q, block, scale, zero, torch.int32, 0, 15, output_dtype=torch.float32)
            lin.weight.copy_(deq.to(lin.weight.dtype))
    return model


def section_int4(bench: Bench) -> None:
    """int4 weight-only at group 64, asymmetric: each algorithm, a mixed-precision recipe, and torchao's rounding."""
    rows = []
    for algorithm, act_order in (("rtn", False), ("gptq", False), ("awq", False), ("hqq", False), ("awq-gptq", True)):
        model = quantize_pass(bench.fresh(), bench.ctx, scheme="int4-weight-only", algorithm=algorithm,
                              group_size=INT4_GROUP, symmetric=False, act_order=act_order)
        rows.append(bench.row(f"int4 {algorithm}{' act-order' if act_order else ''} g{INT4_GROUP}", model))
    for algorithm, act_order in (("rtn", False), ("gptq", False), ("awq", False), ("awq-gptq", True)):  # clipped grids
        model = quantize_pass(bench.fresh(), bench.ctx, scheme="int4-weight-only", algorithm=algorithm,
                              group_size=INT4_GROUP, symmetric=False, act_order=act_order, clip="mse")
        rows.append(bench.row(f"int4 {algorithm}{' act-order' if act_order else ''} g{INT4_GROUP} clip mse", model))
    for algorithm, act_order in (("rtn", False), ("hqq", False), ("awq-gptq", True)):  # float zero points
        model = quantize_pass(bench.fresh(), bench.ctx, scheme="int4-weight-only", algorithm=algorithm,
                              group_size=INT4_GROUP, symmetric=False, act_order=act_order, float_zero=True)
        rows.append(bench.row(f"int4 {algorithm}{' act-order' if act_order else ''} g{INT4_GROUP} float zero", model))
    rows.append(bench.row(f"int4 rtn g{INT4_GROUP} symmetric", quantize_pass(
        bench.fresh(), bench.ctx, scheme="int4-weight-only", algorithm="rtn", group_size=INT4_GROUP)))
    rows.append(bench.row(f"int4 gptq g{INT4_GROUP}, int8 first and last blocks", quantize_pass(
        bench.fresh(), bench.ctx, scheme="int4-weight-only", algorithm="gptq", group_size=INT4_GROUP, symmetric=False,
        int8=["layers.0", "layers.-1"])))
    try:
        import torchao  # noqa: F401
    except ImportError:
        console.print(f"[{bench.name}] torchao peer rows skipped: torchao is not installed")
    else:
        from prunus.compress.quantize import linear_names

        names = linear_names(bench.ctx.teacher, ["output"])[0]
        for method in ("tinygemm", "hqq"):
            peer = _torchao_int4(bench.fresh(), names, method, INT4_GROUP)
            rows.append(bench.row(f"peer: torchao int4 {method} g{INT4_GROUP} (float copy)", peer))
    calibrated = [f"int4 {a} g{INT4_GROUP}{c}" for a in ("gptq", "awq", "awq-gptq act-order") for c in ("", " clip mse")]
    best = min((r for r in rows if r["pass"] in calibrated), key=lambda r: r["bpb_change"])
    bench.table(f"int4 weight-only, group {INT4_GROUP}, asymmetric unless said (target: GPTQ or AWQ (or both) within +3%); "
                "torchao rows hold float weights rounded as torchao rounds them", rows, target=(best["pass"], 0.03))


PEER_GPTQ_BATCHES = 1  # calibration batches (4 rows x 512 tokens) for ONNX Runtime's GPTQ: it runs the fp32
# graph once per MatMul input and batch (121 inputs on SmolLM2), so it gets the first of prunus's batches


# prunus's rows of that section: name -> int4 pass arguments (group 64, asymmetric); then ONNX Runtime's
ORT_PEER_OURS = {
    "prunus rtn, head int4": dict(algorithm="rtn", exclude=()),
    "prunus hqq, head int4": dict(algorithm="hqq", exclude=()),
    "prunus hqq float zero, head int4": dict(algorithm="hqq", exclude=(), float_zero=True),
    "prunus gptq, head int4": dict(algorithm="gptq", exclude=()),
    f"prunus gptq on {PEER_GPTQ_BATCHES} calibration batch(es) (the peer's), head int4":
        dict(algorithm="gptq", exclude=(), n_calib=PEER_GPTQ_BATCHES),
    "prunus awq-gptq act-order, head int4": dict(algorithm="awq-gptq", act_order=True, exclude=()),
    "prunus awq-gptq act-order clip mse, head int4": dict(algorithm="awq-gptq", act_order=True, exclude=(), clip="mse"),
    "prunus awq-gptq act-order clip mse, head int8 (recipe int4-awq-gptq-g64)":
        dict(algorithm="awq-gptq", act_order=True, exclude=(), int8=["output"], clip="mse"),
}
ORT_PEER_ALGORITHMS = ("rtn", "hqq", "gptq")


def section_int4_ort_peers(bench: Bench) -> None:
    """int4 at group 64, asymmetric, every MatMul including the output head, all scored in ONNX Runtime on the
    same held-out text: prunus's stored int4 weights exported as MatMulNBits beside ONNX Runtime's own
    ``MatMulNBitsQuantizer`` (RTN, GPTQ, HQQ) applied to prunus's fp32 graph (``_ort_int4_peers.py``)."""
    import tempfile

    from benchmarks._ort_int4_peers import PrefillLogits, matmulnbits_summary, ort_int4
    from prunus.data.evaluate import evaluate
    from prunus.export.onnx_export import dequantized_copy, export_prefill, save_graph
    from prunus.export.quantize_onnx import apply_stored_quantization
    from prunus.models.quant_registry import quantized_modules

    ctx, rows = bench.ctx, []
    peer_calib = ctx.calibration(8)[:PEER_GPTQ_BATCHES]  # the first of the batches prunus's GPTQ reads

    def score(name: str, path: Path) -> None:
        r = evaluate(PrefillLogits(path), ctx.val_tokens, ctx.token_bytes, seq_len=ctx.seq_len, max_tokens=ctx.eval_tokens)
        rows.append((name, r["val_bpb"], r["val_tokens"], matmulnbits_summary(path)))
        console.print(f"  [{bench.name}] {name}: {r['val_bpb']:.4f} bits per byte", highlight=False)

    def ours(name: str, path: Path, **kw) -> None:
        model = quantize_pass(bench.fresh(), ctx, scheme="int4-weight-only", group_size=INT4_GROUP, symmetric=False, **kw)
        modules = quantized_modules(model)
        proto = export_prefill(dequantized_copy(model, modules))
        apply_stored_quantization(proto, modules)
        save_graph(proto, path, external_data=False)
        score(name, path)
        path.unlink()

    with tempfile.TemporaryDirectory(dir=ROOT / "runs") as tmp:
        tmp = Path(tmp)
        fp32 = tmp / "fp32.onnx"
        save_graph(export_prefill(bench.fresh()), fp32, external_data=False)
        score("fp32 export", fp32)
        for name, kw in ORT_PEER_OURS.items():
            ours(name, tmp / "q.onnx", **kw)
        for algorithm in ORT_PEER_ALGORITHMS:
            try:  # onnxruntime 1.31.1's GPTQ fails on SmolLM2 at group 64 (9 blocks per row: it reshapes the
                # packed zero points as if the count were even); the row says so and the others go on
                path = ort_int4(fp32, tmp / f"peer-{algorithm}.onnx", algorithm, INT4_GROUP, symmetric=False,
                                calibration=peer_calib if algorithm == "gptq" else None)
            except Exception as e:  # noqa: BLE001  (a peer's failure is a result, not a crash of the benchmark)
                console.print(f"  [{bench.name}] peer {algorithm} failed: {type(e).__name__}: {e}", highlight=False)
                rows.append((f"peer: onnxruntime MatMulNBitsQuantizer {algorithm}: failed", float("nan"), 0,
                             f"{type(e).__name__}: {str(e)[:80]}"))
                continue
            score(f"peer: onnxruntime MatMulNBitsQuantizer {algorithm}"
                  f"{f' ({PEER_GPTQ_BATCHES} calibration batch(es))' if algorithm == 'gptq' else ''}", path)
            path.unlink()
    t = Table(title=f"[{bench.name}] int4 group {INT4_GROUP} asymmetric, output head included, scored in ONNX Runtime: "
                    "prunus's stored weights beside ONNX Runtime's MatMulNBitsQuantizer on prunus's fp32 graph",
              title_justify="left", caption=f"bits per byte on {rows[0][2]:,} held-out tokens of {ctx.corpus_name}, "
                                            f"windows of {ctx.seq_len}", caption_justify="left")
    for col in ("variant", "bits/byte", "Δ vs fp32 export", "graph"):
        t.add_column(col, justify="left" if col in ("variant", "graph") else "right")
    for name, b, _, graph in rows:
        t.add_row(name, f"{b:.4f}", f"{100 * (b / rows[0][1] - 1):+.3f}%", graph)
    console.print(t)


SECTIONS = [section_int8_weight_only, section_w8a8, section_fp8, section_int4, section_int4_ort_peers]


def section_distill(bench: Bench, asked: bool = False) -> None:
    params = bench.base["params"]
    if params > DISTILL_MAX_PARAMS and not asked:
        console.print(f"[{bench.name}] distillation skipped: {params:,} parameters is above {DISTILL_MAX_PARAMS:,} "
                      "(it trains; --only distill runs it anyway)\n")
        return
    _section_distill(bench)


SECTIONS.append(section_distill)


def ensure_demo_model(model_dir: Path) -> None:
    """Train the demo model (as ``make demo`` does) when it is missing."""
    if (model_dir / "prunus.json").is_file():
        return
    run_dir = model_dir.parent
    console.print(f"{model_dir} is missing: training the demo model into {run_dir}")
    subprocess.run([sys.executable, "-m", "prunus.cli.main", "train", "--preset", "small", "--steps", "240",
                    "--batch-size", "16", "--lr", "3e-3", "--min-lr", "3e-4", "--warmup-steps", "24", "--eval-every", "80",
                    "--ckpt-every", "80", "--out", str(run_dir), "--overwrite"], check=True)


def summary(benches: list[Bench]) -> None:
    """Every target of every model, side by side."""
    t = Table(title="targets: bits per byte change against fp32 (meets / MISSES)", title_justify="left")
    t.add_column("variant", justify="left")
    t.add_column("target", justify="right")
    for b in benches:
        t.add_column(f"{b.name} ({b.base['val_tokens']:,} tokens)", justify="right")
    names = list(dict.fromkeys(n for b in benches for n, _, _ in b.targets))
    for name in names:
        cells, limit = [], None
        for b in benches:
            hit = next(((lim, r) for n, lim, r in b.targets if n == name), None)
            if hit is None:
                cells.append("-")
                continue
            limit, r = hit
            cells.append(f"{100 * r['bpb_change']:+.3f}% {'meets' if r['bpb_change'] <= limit else 'MISSES'}")
        t.add_row(name, f"+{100 * limit:g}%", *cells)
    console.print(t)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", action="append", default=None,
                        help="demo (the default), smollm2, or a prunus model dir; give it more than once for several")
    parser.add_argument("--eval-tokens", type=int, default=DEFAULT_EVAL_TOKENS, help="held-out tokens scored per variant")
    parser.add_argument("--no-latency", action="store_true", help="skip the paired latency timings")
    parser.add_argument("--only", nargs="*", help="run only the sections whose name contains one of these")
    add_cache_argument(parser)
    args = parser.parse_args()
    benches = []
    for spec in args.model or ["demo"]:
        if spec == "demo":
            ensure_demo_model(DEMO)
            path, name = DEMO, "demo"
        else:
            path, name = resolve_model(spec, args.cache), model_name(spec)
        torch.manual_seed(0)
        bench = Bench(path, args.eval_tokens, name=name, latency=not args.no_latency)
        console.print(f"[{name}] {path}: {bench.base['params']:,} parameters, fp32 {bench.base['val_bpb']:.4f} bits per "
                      f"byte on {bench.base['val_tokens']:,} held-out tokens of {bench.ctx.corpus_name} (windows of "
                      f"{bench.ctx.seq_len}); latency ratios: batch 1, prefill 128 tokens and one decode step, median "
                      f"and, in brackets, interquartile range of 7 alternating fp32/variant timings (≈: the range holds 1, within noise); "
                      f"{machine_line()}\n")
        for section in SECTIONS:
            if args.only and not any(s in section.__name__ for s in args.only):
                continue
            if section is section_distill:
                section(bench, asked=bool(args.only) and any("distill" in s for s in args.only))
            else:
                section(bench)
        benches.append(bench)
    summary(benches)


if __name__ == "__main__":
    main()
