"""Does a GGUF file written by ``prunus convert --to-gguf`` run the dir's weights? llama.cpp's logits on the file
beside prunus's on the dir, position by position, on held-out text.

For each ``--pair DIR=FILE`` (a model dir and the GGUF written from it): prunus scores a window of held-out prose
(the first ``--tokens`` tokens of ``data/prose.py``'s held-out split, Python's reference text) with the dir's own
PyTorch model, llama.cpp (llama-cpp-python in ``--llamacpp-python``, often a venv of its own) scores the same
tokens from the file with every position's logits. Prints, per pair: the tensor types in the file, top-1
agreement, max and mean |Δ logits|, and each side's cross-entropy. llama.cpp quantizes activations to 8 bits
for its Q8_0 / Q4_0 / Q4_1 products, so even identical weights give slightly different logits; the agreement
says whether the weights are the same (a requantized file agrees far less). The file is also compared with the
dir as prunus serves it on a CPU, its native kernels (which round activations to 8 bits in blocks of 32 too): the
same tokens prefilled and verified in one pass through the serving backend (``--threads`` threads).

    python -m benchmarks.gguf_agreement --llamacpp-python PY --pair DIR=FILE [--pair ...] [--tokens 512]
"""

from __future__ import annotations

import argparse
import collections
import json
import subprocess
import tempfile
from pathlib import Path

import benchmarks._omp  # noqa: F401  (OMP_WAIT_POLICY=PASSIVE unless set; before torch loads)

import numpy as np

from benchmarks.harness import machine_line, show

LLAMA_SCRIPT = """
import sys, numpy as np, llama_cpp as L
path, tokens_file, out, threads = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
tokens = np.load(tokens_file).tolist()
llm = L.Llama(model_path=path, n_ctx=len(tokens) + 8, n_batch=len(tokens), logits_all=True, verbose=False,
              n_threads=threads)
llm.eval(tokens)
np.save(out, np.asarray(llm.scores[:len(tokens)], dtype=np.float32))
"""


def held_out_tokens(model_dir: Path, n: int) -> np.ndarray:
    from prunus.data.prose import prose_documents, tokenize_documents
    from prunus.models import load_model_tokenizer

    ids = tokenize_documents(prose_documents()[1], load_model_tokenizer(model_dir))
    return np.asarray(ids[:n], dtype=np.int64)


def prunus_logits(model_dir: Path, tokens: np.ndarray) -> np.ndarray:
    import torch

    from prunus.models import load_model

    with torch.no_grad():
        return load_model(model_dir).eval()(torch.from_numpy(tokens)[None])[0].float().numpy()


def native_logits(model_dir: Path, tokens: np.ndarray, threads: int) -> np.ndarray:
    """Every position's logits of the dir in the native kernels, through the backend that serves it."""
    import torch

    from prunus.export.backend_parity import native_graphs
    from prunus.models import load_model
    from prunus.runtime.native_backend import pack_model

    graphs = native_graphs(pack_model(model_dir, load_model(model_dir).eval()), threads)
    try:
        return graphs(torch.from_numpy(tokens)[None])[0].float().numpy()
    finally:
        graphs.close()


def llama_logits(python: str, gguf_file: Path, tokens: np.ndarray, threads: int) -> np.ndarray:
    with tempfile.TemporaryDirectory() as tmp:
        np.save(Path(tmp) / "tokens.npy", tokens)
        out = Path(tmp) / "logits.npy"
        subprocess.run([python, "-c", LLAMA_SCRIPT, str(gguf_file), str(Path(tmp) / "tokens.npy"), str(out),
                        str(threads)], check=True)
        return np.load(out)


def cross_entropy(logits: np.ndarray, tokens: np.ndarray) -> float:
    z = logits[:-1] - logits[:-1].max(-1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(-1, keepdims=True))
    return float(-logp[np.arange(len(tokens) - 1), tokens[1:]].mean())


def tensor_types(gguf_file: Path) -> str:
    import gguf

    counts = collections.Counter(t.tensor_type.name for t in gguf.GGUFReader(gguf_file).tensors)
    return ", ".join(f"{k} x {v}" for k, v in counts.most_common())


def compare(model_dir: Path, gguf_file: Path, python: str, n: int, threads: int) -> dict:
    tokens = held_out_tokens(model_dir, n)
    ours, theirs = prunus_logits(model_dir, tokens), llama_logits(python, gguf_file, tokens, threads)
    served = native_logits(model_dir, tokens, threads)
    delta = np.abs(ours - theirs)
    return {"dir": str(model_dir), "gguf": str(gguf_file), "types": tensor_types(gguf_file), "tokens": int(len(tokens)),
            "top1_agreement": float((ours.argmax(-1) == theirs.argmax(-1)).mean()),
            "top1_agreement_native": float((served.argmax(-1) == theirs.argmax(-1)).mean()),
            "max_abs_logits_native": float(np.abs(served - theirs).max()),
            "top1_native_torch": float((served.argmax(-1) == ours.argmax(-1)).mean()),
            "max_abs_logits": float(delta.max()), "mean_abs_logits": float(delta.mean()),
            "ce_prunus": cross_entropy(ours, tokens), "ce_llamacpp": cross_entropy(theirs, tokens),
            "bytes": gguf_file.stat().st_size}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--llamacpp-python", required=True, help="A Python that imports llama_cpp.")
    parser.add_argument("--pair", action="append", required=True, help="MODEL_DIR=GGUF_FILE (give several).")
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    print(machine_line())
    results = []
    for pair in args.pair:
        d, f = pair.split("=", 1)
        results.append(compare(Path(d), Path(f), args.llamacpp_python, args.tokens, args.threads))
        print(f"  {f}: top-1 {results[-1]['top1_agreement']:.4f}", flush=True)
    show(f"llama.cpp on the GGUF file beside prunus on its dir ({args.tokens} held-out tokens)",
         ["file", "tensor types", "MB", "top-1 agreement", "max |Δ|", "mean |Δ|", "CE prunus", "CE llama.cpp",
          "top-1 vs native", "max |Δ| vs native", "native vs PyTorch top-1"],
         [[Path(r["gguf"]).name, r["types"], f"{r['bytes'] / 1e6:.0f}", f"{r['top1_agreement']:.4f}",
           f"{r['max_abs_logits']:.3f}", f"{r['mean_abs_logits']:.4f}", f"{r['ce_prunus']:.4f}",
           f"{r['ce_llamacpp']:.4f}", f"{r['top1_agreement_native']:.4f}", f"{r['max_abs_logits_native']:.3f}",
           f"{r['top1_native_torch']:.4f}"] for r in results])
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": machine_line(), "results": results}, indent=1))


if __name__ == "__main__":
    main()
