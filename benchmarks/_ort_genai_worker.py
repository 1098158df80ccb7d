"""onnxruntime-genai's own runtime in a process of its own, for ``serve_throughput.py --peer llamacpp --ort-genai``.

Loads a genai model dir (the model builder's output, or a prunus genai export: both hold ``genai_config.json``)
with ``og.Config`` and sets only the decoder session's ``intra_op_num_threads`` through ``Config.overlay``; every
other setting is the dir's own (ONNX Runtime's spinning thread pool included). Greedy decode is og's own loop:
``append_tokens`` (the prompt's pass) then ``generate_next_token`` per token; ``min_length`` = ``max_length`` so
an end-of-sequence token does not stop a row early (as prunus's ``ignore_eos``). A batch of prompts of different
lengths is right-padded with the config's ``pad_token_id`` into one 2-D array: og counts a row's tokens as those
that are not the pad id and hands GroupQueryAttention ``seqlens_k`` for right padding (the genai graph takes no
position ids), so a left-padded row is decoded from the wrong positions. Right-padded, a row's greedy tokens
equal its tokens alone (tests/test_ort_genai_worker.py). A prompt of a multi-row batch that holds the pad id
itself would be miscounted, and is refused.

Protocol (``harness.serve``): {"op": "info"} -> {"version"}; {"op": "load", "path", "threads"} -> {"pad"};
{"op": "generate", "prompts": [[ids]], "n_new"} -> {"seconds", "tokens"} (timed here, from the generator's
creation to the last token); {"op": "quit"}.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import onnxruntime_genai as og

from benchmarks.harness import serve

STATE: dict = {}


def info() -> dict:
    return {"version": og.__version__}


def load(path: str, threads: int) -> dict:
    STATE.clear()
    config = og.Config(path)
    config.overlay(json.dumps({"model": {"decoder": {"session_options": {"intra_op_num_threads": threads}}}}))
    STATE["model"] = og.Model(config)
    genai = json.loads((Path(path) / "genai_config.json").read_text())["model"]
    STATE["pad"] = int(genai.get("pad_token_id", genai.get("eos_token_id", 0)))
    return {"pad": STATE["pad"], "threads_in_process": len(os.listdir("/proc/self/task"))}


def padded(prompts: list[list[int]], pad: int) -> np.ndarray:
    """The prompts right-padded with ``pad`` into one (rows, width) int32 array, as og reads a batch."""
    width = max(map(len, prompts))
    if len(prompts) > 1 and any(pad in p for p in prompts):
        raise ValueError(f"a prompt holds the pad token id {pad}: og would count it as padding in a batch; "
                         "run such prompts one at a time")
    return np.array([p + [pad] * (width - len(p)) for p in prompts], np.int32)


def generate(prompts: list[list[int]], n_new: int) -> dict:
    model, pad = STATE["model"], STATE["pad"]
    ids = padded(prompts, pad)
    width = ids.shape[1]
    t = time.perf_counter()
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=width + n_new, min_length=width + n_new, do_sample=False,
                              batch_size=len(prompts))
    gen = og.Generator(model, params)
    gen.append_tokens(ids)
    steps = []
    for _ in range(n_new):
        gen.generate_next_token()
        steps.append(gen.get_next_tokens().tolist())
    seconds = time.perf_counter() - t
    del gen
    return {"seconds": seconds, "tokens": [list(row) for row in zip(*steps)]}


if __name__ == "__main__":
    real_stdout, sys.stdout = sys.stdout, sys.stderr  # what og or its libraries print stays off the protocol
    serve({"info": info, "load": load, "generate": generate}, sys.stdin, real_stdout)
