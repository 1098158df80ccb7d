"""One prunus Engine in a process of its own, for ``benchmarks/serve_throughput.py --peer llamacpp``.

Each contender runs alone in its process, as llama.cpp does in its worker: no other Engine's
threads, no Hugging Face model and no benchmark bookkeeping beside it. In one process, four
Engines and Hugging Face cost the int8 graph 13% of its tokens/s at 2 threads (69 against 79
alone) and made the comparison with llama.cpp unfair to prunus.

Protocol (``_worker_process``): {"op": "load", "path", "max_batch", "max_len", "threads", "prompt_graph", "native"} -> {};
{"op": "generate", "prompts": [[ids]], "n_new"} -> {"seconds", "tokens"} (``Engine.generate``,
timed here); {"op": "quit"}.
"""

from __future__ import annotations

import sys
import time

import benchmarks._omp  # noqa: F401  (OMP_WAIT_POLICY=PASSIVE unless set; before torch loads)

from benchmarks.harness import serve

from prunus.serve import Engine

ENGINE: list[Engine] = []


def load(path: str, max_batch: int, max_len: int, threads: int, prompt_graph: bool = False,
         native: bool = False) -> dict:
    while ENGINE:
        ENGINE.pop().close()
    ENGINE.append(Engine.load(path, max_batch=max_batch, max_len=max_len, threads=threads, prompt_graph=prompt_graph,
                              native=native))
    return {}


def generate(prompts: list[list[int]], n_new: int) -> dict:
    t = time.perf_counter()
    results = ENGINE[0].generate(prompts, max_new_tokens=n_new, ignore_eos=True)
    return {"seconds": time.perf_counter() - t, "tokens": [list(r.token_ids) for r in results]}


if __name__ == "__main__":
    real_stdout, sys.stdout = sys.stdout, sys.stderr  # what prunus or its libraries print stays off the protocol
    serve({"load": load, "generate": generate}, sys.stdin, real_stdout)
    while ENGINE:
        ENGINE.pop().close()
