"""int4 quality beside onnxruntime-genai's model builder: cross-entropy over fp32 on one held-out window.

    OMP_WAIT_POLICY=PASSIVE .venv/bin/python -m benchmarks.ort_genai_quality --model /tmp/smol/model-dir \\
        --int4 "prunus int4 AWQ->GPTQ=/tmp/smol/int4-awq-gptq" --export "...=EXPORT_DIR" [--builder DIR] [--hf DIR]

Every row scores the same tokens: the first ``--windows`` windows of ``--window`` tokens (default one window
of the evaluation length, 1,024 for SmolLM2) of the held-out text prunus's compress quality benchmarks score
(``prunus.data.evaluate`` on ``default_data``: English prose shipped with Python for a pretrained tokenizer).

* fp32: the prunus model dir in torch;
* ``--int4 LABEL=DIR``: a prunus int4 model dir in torch (its stored codes, as ``prunus eval`` scores it);
* ``--export LABEL=DIR``: a prunus genai export in ONNX Runtime, every position's logits from its graph
  (``export_graphs``: the runtime table's ONNX Runtime backend over the graph og and prunus serve);
* the model builder's int4 (``onnxruntime_genai.models.builder -p int4 -e cpu``, built once into ``--builder``
  from ``--hf`` when missing): its ``model.onnx`` in ONNX Runtime with an empty past, every position's logits.

Prints cross-entropy (nats per token), bits per byte and each one's increase over fp32. Nothing fails on a figure.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import benchmarks._omp  # noqa: F401  (OMP_WAIT_POLICY=PASSIVE unless set; before torch loads)

import numpy as np
import torch

from benchmarks._ort_genai_peer import builder_int4, genai_graph, graph_summary
from benchmarks.harness import machine_line


class BuilderLogits:
    """``tokens (batch, seq) -> logits``: a model builder graph (input_ids, attention_mask, past_key_values.N.*)
    run in ONNX Runtime with an empty past, so its logits cover every position."""

    def __init__(self, model_dir: Path, threads: int | None = None):
        from prunus.runtime.ort_session import ort_session

        decoder = json.loads((model_dir / "genai_config.json").read_text())["model"]["decoder"]
        self.kv = (decoder["num_key_value_heads"], decoder["head_size"])
        self.session = ort_session(genai_graph(model_dir), threads, spinning=False)
        self.past = [i.name for i in self.session.get_inputs() if i.name.startswith("past_key_values.")]

    def __call__(self, tokens: torch.Tensor) -> torch.Tensor:
        b, s = tokens.shape
        feeds = {"input_ids": tokens.long().numpy(), "attention_mask": np.ones((b, s), np.int64)}
        for name in self.past:  # (batch, kv heads, 0, head size): no past
            feeds[name] = np.zeros((b, self.kv[0], 0, self.kv[1]), np.float32)
        return torch.from_numpy(self.session.run(["logits"], feeds)[0]).float()


def export_logits(export: Path, threads: int | None):
    """A prunus genai export as the runtime table's ONNX Runtime backend serves it, every position's logits."""
    from prunus.export.backend_parity import export_graphs

    return export_graphs(export, json.loads((export / "config.json").read_text()), threads=threads)


def labelled(text: str) -> tuple[str, Path]:
    label, sep, path = text.partition("=")
    if not (sep and label and Path(path).is_dir()):
        raise SystemExit(f"{text!r}: write LABEL=DIR with DIR an existing dir")
    return label, Path(path)


def main() -> None:
    from prunus.data.corpus import default_data, load_corpus
    from prunus.data.evaluate import default_seq_len, evaluate
    from prunus.models import load_model, load_model_tokenizer

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True, help="the fp32 prunus model dir")
    ap.add_argument("--int4", action="append", default=[], type=labelled, metavar="LABEL=DIR")
    ap.add_argument("--export", action="append", default=[], type=labelled, metavar="LABEL=DIR")
    ap.add_argument("--builder", default=None, help="the model builder's int4 dir (built here from --hf when missing)")
    ap.add_argument("--hf", default=None, help="with --builder: the Hugging Face dir of the same weights, built from "
                    "when --builder is missing or older")
    ap.add_argument("--window", type=int, default=None, help="tokens per window (default the evaluation window)")
    ap.add_argument("--windows", type=int, default=1)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    print(machine_line())
    model_dir = Path(args.model)
    tok = load_model_tokenizer(model_dir)
    fp32 = load_model(model_dir).eval()
    data = default_data(None, tok)
    corpus = load_corpus(data, tok, max_bytes=16 << 20, vocab_size=fp32.config.vocab_size)
    window = args.window or default_seq_len(fp32.config.max_seq_len)
    print(f"text: {corpus.name}, held-out split, the first {args.windows} window(s) of {window} tokens")

    def score(label: str, model) -> tuple[str, dict]:
        with torch.inference_mode():
            r = evaluate(model, corpus.val, tok.token_bytes(), seq_len=window, max_tokens=window * args.windows)
        print(f"   {label}: {r['val_loss']:.4f} nats per token, {r['val_bpb']:.4f} bits per byte "
              f"({r['val_tokens']} tokens)", flush=True)
        return label, r

    rows = [score("fp32 (prunus model dir, torch)", fp32)]
    del fp32
    rows += [score(f"{label} (model dir, torch)", load_model(d).eval()) for label, d in args.int4]
    rows += [score(f"{label} (genai export, onnxruntime)", export_logits(d, args.threads)) for label, d in args.export]
    if args.builder:
        built = builder_int4(Path(args.hf), Path(args.builder)) if args.hf else Path(args.builder)
        print(f"   builder int4 graph: {graph_summary(built)}")
        rows.append(score("onnxruntime-genai builder int4 (onnxruntime)", BuilderLogits(built, args.threads)))
    base = rows[0][1]
    print("\n| model | cross-entropy (nats/token) | Δ vs fp32 | bits/byte | Δ vs fp32 |\n|---|---|---|---|---|")
    for label, r in rows:
        print(f"| {label} | {r['val_loss']:.4f} | {r['val_loss'] - base['val_loss']:+.4f} "
              f"({100 * (r['val_loss'] / base['val_loss'] - 1):+.2f}%) | {r['val_bpb']:.4f} | "
              f"{100 * (r['val_bpb'] / base['val_bpb'] - 1):+.2f}% |")
    print(f"\n{rows[0][1]['val_tokens']} scored tokens per row; perplexity fp32 {math.exp(base['val_loss']):.2f}")


if __name__ == "__main__":
    main()
