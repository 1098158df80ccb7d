"""llama.cpp decode worker for ``benchmarks/serve_throughput.py --peer llamacpp`` and ``benchmarks/eagle.py``.

Runs in any interpreter that imports ``llama_cpp`` (llama-cpp-python), often a venv of its own,
and drives llama.cpp through its low-level C API: one ``llama_batch`` per step that holds one
token per sequence (seq ids 0..B-1), so B sequences decode together in one context.
Greedy: the next token is the argmax of the logits llama.cpp returns.

Protocol (``_worker_process``): one JSON request per line on stdin, one JSON answer per line on stdout.

    {"op": "info"}                                      -> {"version", "system"}
    {"op": "load", "name", "path", "n_seq", "n_ctx_seq"} -> {"n_vocab"}
    {"op": "generate", "name", "n_seq", "threads", "prompts": [[ids]], "n_new"}
        -> {"seconds", "ttft", "tokens": [[ids]]}   (timed here, so the pipe is not in the figure)
    {"op": "spec_load", "name", "path", "n_ctx", "lookup_k"}     -> {}
    {"op": "spec_generate", "name", "prompt": [ids], "n_new", "threads"}
        -> {"seconds", "tokens": [ids]}   (seconds from the first new token to the last: prefill left out)
    {"op": "quit"}

``spec_*`` drive llama-cpp-python's high-level ``Llama`` instead (``benchmarks/eagle.py --llamacpp-python``): its
greedy ``generate``, plain or speculating with its own prompt lookup (``LlamaPromptLookupDecoding``).

A failure answers {"error": "..."}. llama.cpp's own log is kept off stdout: its last lines go into
the error of a load that fails.
"""

from __future__ import annotations

import sys
import time

import llama_cpp as L
import numpy as np
from benchmarks.harness import serve


LOG: list[str] = []  # llama.cpp's recent log lines (its load log would fill the benchmark's output)


@L.llama_log_callback
def _keep(level, text, user_data):  # noqa: ARG001
    LOG.append(text.decode(errors="replace") if text else "")
    del LOG[:-20]


class Model:
    """One GGUF file with a context per sequence count (a batch-1 context, one for B sequences)."""

    def __init__(self, path: str, n_ctx_seq: int):
        LOG.clear()
        self.model = L.llama_model_load_from_file(path.encode(), L.llama_model_default_params())
        if not self.model:
            why = [line.strip() for line in LOG if "error" in line.lower()] or ["no reason logged"]
            raise RuntimeError(f"llama.cpp could not load {path}: {why[0]}")
        self.n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(self.model))
        self.n_ctx_seq, self.contexts = n_ctx_seq, {}

    def context(self, n_seq: int):
        """(context, batch) for ``n_seq`` sequences, each with ``n_ctx_seq`` positions of KV cache."""
        if n_seq not in self.contexts:
            p = L.llama_context_default_params()
            p.n_ctx = n_seq * self.n_ctx_seq
            p.n_batch = p.n_ctx
            p.n_seq_max = n_seq
            p.n_threads = p.n_threads_batch = 1
            p.no_perf = True
            ctx = L.llama_init_from_model(self.model, p)
            if not ctx:
                raise RuntimeError(f"llama.cpp could not make a context for {n_seq} sequences")
            self.contexts[n_seq] = (ctx, L.llama_batch_init(p.n_batch, 0, 1))
        return self.contexts[n_seq]

    def generate(self, prompts: list[list[int]], n_new: int, threads: int, n_seq: int) -> dict:
        """Greedy decoding of every prompt at once: one prefill batch, then one token per sequence a step."""
        ctx, batch = self.context(n_seq)
        if len(prompts) > n_seq:
            raise RuntimeError(f"{len(prompts)} prompts for a context of {n_seq} sequences")
        L.llama_set_n_threads(ctx, threads, threads)
        L.llama_memory_clear(L.llama_get_memory(ctx), True)
        t0 = time.perf_counter()
        rows = []
        for s, ids in enumerate(prompts):
            for p, token in enumerate(ids):
                rows.append((token, p, s, p == len(ids) - 1))
        tokens = [[t] for t in self._step(ctx, batch, rows)]
        ttft = time.perf_counter() - t0
        pos = [len(ids) for ids in prompts]
        for _ in range(n_new - 1):
            nxt = self._step(ctx, batch, [(tokens[s][-1], pos[s], s, True) for s in range(len(prompts))])
            for s, t in enumerate(nxt):
                tokens[s].append(t)
                pos[s] += 1
        return {"seconds": time.perf_counter() - t0, "ttft": ttft, "tokens": tokens}

    def _step(self, ctx, batch, rows) -> list[int]:
        """Decode ``rows`` (token, position, sequence, wants logits) in one batch; the argmax of each output."""
        out = []
        for i, (token, pos, seq, logits) in enumerate(rows):
            batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = token, pos, 1, logits
            batch.seq_id[i][0] = seq
            if logits:
                out.append(i)
        batch.n_tokens = len(rows)
        rc = L.llama_decode(ctx, batch)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}")
        return [int(np.ctypeslib.as_array(L.llama_get_logits_ith(ctx, i), shape=(self.n_vocab,)).argmax())
                for i in out]


MODELS: dict[str, Model] = {}


def info() -> dict:
    return {"version": getattr(L, "__version__", "?"), "system": L.llama_print_system_info().decode()}


def load(name: str, path: str, n_ctx_seq: int) -> dict:
    MODELS[name] = Model(path, n_ctx_seq)
    return {"n_vocab": MODELS[name].n_vocab}


def generate(name: str, prompts: list[list[int]], n_new: int, threads: int, n_seq: int) -> dict:
    return MODELS[name].generate(prompts, n_new, threads, n_seq)


SPEC: dict[str, L.Llama] = {}


def spec_load(name: str, path: str, n_ctx: int, lookup_k: int) -> dict:
    """A high-level ``Llama`` over ``path``: plain when ``lookup_k`` is 0, else drafting with llama-cpp-python's
    ``LlamaPromptLookupDecoding(num_pred_tokens=lookup_k)`` (its defaults otherwise: n-grams of 2 down to 1)."""
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    draft = LlamaPromptLookupDecoding(num_pred_tokens=lookup_k) if lookup_k else None
    LOG.clear()
    SPEC[name] = L.Llama(model_path=path, n_ctx=n_ctx, n_batch=min(n_ctx, 512), n_threads=1, n_threads_batch=1,
                         draft_model=draft, logits_all=bool(lookup_k), verbose=False)
    # logits_all: a draft model makes Llama keep every position's logits, but its score buffer is sized by the
    # argument (n_batch rows without it), too small for a prompt longer than n_batch
    return {}


def spec_generate(name: str, prompt: list[int], n_new: int, threads: int) -> dict:
    """``n_new`` greedy tokens after ``prompt`` (no stop at end of text), from a fresh cache. Timed as prunus's
    ``decode_tokens_per_s`` is: from the moment the first new token is out (after prefill) to the last one."""
    llm = SPEC[name]
    L.llama_set_n_threads(llm.ctx, threads, threads)
    llm.reset()  # the prompt is prefilled again, not taken from the previous call's cache
    tokens, stamps = [], []
    for token in llm.generate(prompt, temp=0.0, repeat_penalty=1.0, reset=True):
        stamps.append(time.perf_counter())
        tokens.append(int(token))
        if len(tokens) >= n_new:
            break
    return {"seconds": stamps[-1] - stamps[0], "tokens": tokens}


if __name__ == "__main__":
    L.llama_log_set(_keep, None)
    L.llama_backend_init()
    serve({"info": info, "load": load, "generate": generate, "spec_load": spec_load, "spec_generate": spec_generate},
          sys.stdin, sys.stdout)
