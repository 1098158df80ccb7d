"""ONNX Runtime exports against PyTorch eager and against ONNX Runtime's own quantizer, side by side.

For each model (the demo model dir, and a randomly initialised ``base`` preset, 85M
parameters, for latency at size), at 2 threads:

* ORT fp32 vs PyTorch eager fp32: prefill of 128 tokens and one decode step with a
  128-token cache, batch 1 and 8;
* int8 vs ORT fp32: decode latency and graph size, for ``prunus export --precision int8``
  (ORT quantize_dynamic after untying the head), a compressed w8a8-dynamic dir exported
  with its own weights as ``DynamicQuantizeMatMul`` ("integer") and as QDQ ("qdq");
* our int8 vs ``quantize_dynamic`` applied to our own fp32 export as it is (the peer):
  decode latency and bits per byte on held-out text.

Medians over alternating repetitions; ratios are what count. Never fails on time.
Usage: python benchmarks/export_latency.py [--models demo,base] [--reps 20] [--out runs/bench/export]
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import onnx  # noqa: E402
import torch  # noqa: E402

from prunus.compress.quantize import quantize_pass  # noqa: E402
from prunus.data.corpus import load_corpus  # noqa: E402
from prunus.data.evaluate import evaluate  # noqa: E402
from prunus.export import OrtGraphs, export_model  # noqa: E402
from prunus.export.onnx_export import dequantized_copy, export_decode, export_prefill, save_graph  # noqa: E402
from prunus.export.parity import _nll_score  # noqa: E402
from prunus.export.quantize_onnx import apply_stored_quantization, quantize_fp32_graph  # noqa: E402
from prunus.models import KVCache, Transformer, get_preset, load_model, load_model_tokenizer, save_model  # noqa: E402
from prunus.models.quantized import QuantizedLinear  # noqa: E402

THREADS = 2
OURS, PEER = "int8 (export --precision int8)", "peer: quantize_dynamic(fp32 export)"
CTX = 128


def median_times(fns: dict, reps: int) -> dict:
    """Median seconds per call of each fn, calls alternating so drift hits all alike."""
    for fn in fns.values():
        fn()
    times = {k: [] for k in fns}
    for _ in range(reps):
        for k, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def graphs(d: Path, n_layers: int) -> OrtGraphs:
    # no spinning: this process holds a dozen sessions timed in turn, and the spinning threads of
    # the one just timed took the cores of the next (a fp32 decode at batch 8 on 2 threads: 7.8 ms spinning, 4.0 ms not)
    return OrtGraphs(d / "prefill.onnx", d / "decode.onnx", n_layers, threads=THREADS, spinning=False)


def torch_fns(model, batch: int):
    ids = torch.randint(0, 256, (batch, CTX))
    cache = KVCache.for_model(model, batch, max_len=CTX + 1)
    with torch.inference_mode():
        model(ids, cache=cache)
    tok = torch.randint(0, 256, (batch, 1))

    @torch.inference_mode()
    def prefill():
        model(ids)

    @torch.inference_mode()
    def decode():
        cache.seq_len = CTX
        model(tok, cache=cache)
    return prefill, decode


def ort_fns(g: OrtGraphs, batch: int):
    ids = torch.randint(0, 256, (batch, CTX))
    pos, mask = torch.arange(CTX).expand(batch, CTX), torch.ones(batch, CTX, dtype=torch.long)
    _, past = g.prefill(ids, pos, mask)
    tok, tpos, tmask = torch.randint(0, 256, (batch, 1)), torch.full((batch, 1), CTX), torch.ones(batch, CTX + 1, dtype=torch.long)
    return (lambda: g.prefill(ids, pos, mask)), (lambda: g.decode(tok, tpos, tmask, past))


def peer_quantize(fp32_dir: Path, out: Path) -> Path:
    """onnxruntime.quantization.quantize_dynamic on our fp32 graphs, as they are."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    out.mkdir(parents=True, exist_ok=True)
    for f in ("prefill.onnx", "decode.onnx"):
        quantize_dynamic(fp32_dir / f, out / f, weight_type=QuantType.QInt8, per_channel=True, op_types_to_quantize=["MatMul"])
    return out


def bench_model(name: str, model_dir: Path, work: Path, reps: int, val: np.ndarray, token_bytes, eval_tokens: int,
                trained: bool):
    model = load_model(model_dir)
    n_layers = len(model.layers)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"\n## {name}: {n_params / 1e6:.1f}M parameters ({model_dir})", flush=True)
    dirs = {"fp32": work / f"{name}-fp32", "int8 (export --precision int8)": work / f"{name}-int8"}
    t0 = time.perf_counter()
    export_model(model_dir, dirs["fp32"], overwrite=True, progress=False, verify=False)
    # what export --precision int8 does after exporting these same fp32 graphs: untie, quantize_dynamic
    dirs["int8 (export --precision int8)"].mkdir(parents=True, exist_ok=True)
    for f in ("prefill.onnx", "decode.onnx"):
        quantize_fp32_graph(dirs["fp32"] / f, dirs["int8 (export --precision int8)"] / f)
    # a compressed dir (w8a8-dynamic, per channel, head included) with its own int8 weights, in both forms
    qmodel = load_model(model_dir)
    quantize_pass(qmodel, None, scheme="w8a8-dynamic", exclude=())
    modules = {n: m for n, m in qmodel.named_modules() if isinstance(m, QuantizedLinear)}
    protos = {"prefill.onnx": export_prefill(dequantized_copy(qmodel)), "decode.onnx": export_decode(dequantized_copy(qmodel))}
    for style in ("integer", "qdq"):
        key = f"int8 (compressed dir, {style})"
        dirs[key] = work / f"{name}-w8a8-{style}"
        dirs[key].mkdir(parents=True, exist_ok=True)
        for f, proto in protos.items():
            proto = onnx.ModelProto.FromString(proto.SerializeToString())
            apply_stored_quantization(proto, modules, style)
            save_graph(proto, dirs[key] / f, external_data=False)
    dirs["peer: quantize_dynamic(fp32 export)"] = peer_quantize(dirs["fp32"], work / f"{name}-peer")
    print(f"exports: {time.perf_counter() - t0:.0f} s", flush=True)
    g = {k: graphs(d, n_layers) for k, d in dirs.items()}
    results = {"params": n_params}

    print("\nORT fp32 vs PyTorch eager fp32 (median ms)")
    for batch in (1, 8):
        tp, td = torch_fns(model, batch)
        op, od = ort_fns(g["fp32"], batch)
        t = median_times({"torch prefill": tp, "ort prefill": op, "torch decode": td, "ort decode": od}, reps)
        for what in ("prefill", "decode"):
            ratio = t[f"ort {what}"] / t[f"torch {what}"]
            results[f"ort/torch {what} b{batch}"] = ratio
            print(f"  batch {batch} {what:7s} ({CTX} {'tokens' if what == 'prefill' else 'cached'}): torch {t[f'torch {what}'] * 1e3:8.2f}"
                  f"  ort {t[f'ort {what}'] * 1e3:8.2f}  ratio ort/torch {ratio:.3f}", flush=True)

    print("\nint8 vs ORT fp32: decode step with a 128-token cache (median ms), decode.onnx size")
    size32 = (dirs["fp32"] / "decode.onnx").stat().st_size
    for batch in (1, 8):
        t = median_times({k: ort_fns(gr, batch)[1] for k, gr in g.items()}, reps)
        for k in dirs:
            ratio = t[k] / t["fp32"]
            results[f"{k} decode b{batch}"] = ratio
            print(f"  batch {batch} {k:40s} {t[k] * 1e3:8.2f} ms  ratio vs fp32 {ratio:.3f}", flush=True)
    for k, d in dirs.items():
        results[f"{k} size"] = (d / "decode.onnx").stat().st_size / size32
        print(f"  size {k:40s} {(d / 'decode.onnx').stat().st_size / 1e6:8.2f} MB  ratio vs fp32 {results[f'{k} size']:.3f}")

    for k in (OURS, "int8 (compressed dir, integer)", "int8 (compressed dir, qdq)"):
        print(f"decode latency {k} / peer: b1 {results[f'{k} decode b1'] / results[f'{PEER} decode b1']:.3f}, "
              f"b8 {results[f'{k} decode b8'] / results[f'{PEER} decode b8']:.3f}", flush=True)
    if not trained:
        print("\n(bits per byte skipped: random weights)")
        return results
    seq = min(model.config.max_seq_len, 256)
    print(f"\nbits per byte on {eval_tokens:,} held-out tokens (seq {seq})")
    with torch.inference_mode():
        bpb = {"torch fp32": evaluate(model, val, token_bytes, seq_len=seq, batch_size=4, max_tokens=eval_tokens)["val_bpb"]}
        for k, gr in g.items():
            bpb[k] = evaluate(None, val, token_bytes, seq_len=seq, batch_size=4, max_tokens=eval_tokens, score=_nll_score(gr))["val_bpb"]
    for k, v in bpb.items():
        results[f"{k} bpb"] = v
        print(f"  {k:40s} {v:.4f}")
    print(f"\nbits per byte, ours - peer: {bpb[OURS] - bpb[PEER]:+.4f}", flush=True)
    return results


def plot(all_results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = ["int8 (export --precision int8)", "int8 (compressed dir, integer)", "int8 (compressed dir, qdq)",
            "peer: quantize_dynamic(fp32 export)"]
    fig, ax = plt.subplots(figsize=(9, 4))
    width = 0.8 / len(all_results)
    for j, (name, r) in enumerate(all_results.items()):
        vals = [r[f"{k} decode b1"] for k in keys] + [r[f"{k} decode b8"] for k in keys]
        ax.bar(np.arange(len(vals)) + j * width, vals, width, label=name)
    short = ["export int8", "stored, integer", "stored, qdq", "peer"]
    ax.set_xticks(np.arange(2 * len(keys)) + 0.4 - width / 2, [f"{k}\nbatch {b}" for b in (1, 8) for k in short],
                  fontsize=8)
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_ylabel("decode latency / ORT fp32")
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    print(f"\nplot: {path}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="demo,base")
    ap.add_argument("--demo-dir", default="runs/demo/model")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--eval-tokens", type=int, default=16384)
    ap.add_argument("--out", default="runs/bench/export")
    args = ap.parse_args()
    torch.set_num_threads(THREADS)
    work = Path(args.out)
    work.mkdir(parents=True, exist_ok=True)
    tok = load_model_tokenizer(args.demo_dir)
    corpus = load_corpus(None, tok, max_bytes=1 << 16)
    results = {}
    for name in args.models.split(","):
        if name == "demo":
            model_dir = Path(args.demo_dir)
        else:
            torch.manual_seed(0)
            m = Transformer(get_preset(name))
            m.init_weights()
            model_dir = work / f"{name}-model"
            save_model(m, model_dir, stage="train", overwrite=True, command="benchmark")
        results[name] = bench_model(name, model_dir, work, args.reps, corpus.val, tok.token_bytes(), args.eval_tokens,
                                    trained=name == "demo")
    plot(results, work / "export_latency.png")
    shutil.rmtree(work / "base-model", ignore_errors=True)


if __name__ == "__main__":
    main()
