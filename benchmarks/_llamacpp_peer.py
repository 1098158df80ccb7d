"""llama.cpp as a peer of prunus's CPU decode: the worker process and the GGUF files it runs.

llama.cpp is driven through llama-cpp-python in a worker process (``_llamacpp_worker.py``),
started in this interpreter when it imports ``llama_cpp``, else in the one given by
``--llamacpp-python PATH`` (llama-cpp-python builds from source, so it often lives in a venv of
its own). A worker of its own keeps llama.cpp's OpenMP thread pool apart from torch's and ONNX
Runtime's, and it runs under llama.cpp's own defaults: ``OMP_WAIT_POLICY`` / ``OMP_NUM_THREADS``
set for prunus are removed from its environment, and its thread count is set per request.

The GGUF files are written from the prunus model dir by prunus's own ``to_gguf``: F32 and Q8_0
from the model dir, Q4_0 from its stored int4 dir (RTN, groups of 32, symmetric), whose 4-bit
values ``to_gguf`` copies into the Q4_0 blocks as they are, so llama.cpp runs the very codes the
prunus int4 contender runs. Each is written once under ``<cache>/exports/<model>/gguf/`` and again when
its source is newer.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from benchmarks.harness import WorkerProcess

MISSING = "llama-cpp-python not installed (it builds from source in 20-30 min on 2 cores: pip install llama-cpp-python)"
WORKER = "benchmarks._llamacpp_worker"  # run with -m from the repository root, as the benchmarks are
# a prunus precision -> the GGUF type llama.cpp runs beside it, and the to_gguf --type that writes it
GGUF_TYPES = {"fp32": ("F32", "f32"), "int8": ("Q8_0", "q8_0"), "int4": ("Q4_0", "q4_0")}


@dataclass(frozen=True)
class Contender:
    """A prunus contender: any dir ``Engine.load`` takes (a model dir, an ONNX export dir, ...), and the
    precision it is compared at (fp32, int8 or int4: llama.cpp's F32, Q8_0 or Q4_0)."""

    label: str
    path: Path
    precision: str
    prompt_graph: bool = False  # Engine.load(prompt_graph=...): a quantized genai export's prompt twin
    native: bool = False  # Engine.load(native=...): a genai export decoded in prunus's own kernels


def parse_contender(text: str) -> Contender:
    """``LABEL=PATH:PRECISION`` (the ``--contender`` option) -> a Contender."""
    label, sep, rest = text.partition("=")
    path, sep2, precision = rest.rpartition(":")
    if not (sep and sep2 and label and path) or precision not in GGUF_TYPES:
        raise SystemExit(f"--contender {text!r}: write LABEL=PATH:PRECISION with PRECISION one of "
                         f"{', '.join(GGUF_TYPES)} (e.g. 'onnxruntime decode graph=runs/x/onnx-genai:fp32')")
    if not (Path(path) / "config.json").is_file():
        raise SystemExit(f"--contender {text!r}: {path} has no config.json; give a model dir or an export dir")
    return Contender(label, Path(path), precision)


def peer_python(given: str | None) -> tuple[str | None, str]:
    """(the interpreter to run the worker in, '') or (None, why the peer is skipped)."""
    if given:
        r = subprocess.run([given, "-c", "import llama_cpp, numpy"], capture_output=True, text=True)
        if r.returncode != 0:
            last = (r.stderr.strip().splitlines() or ["it did not start"])[-1]
            return None, f"--llamacpp-python {given}: cannot import llama_cpp ({last}); {MISSING}"
        return given, ""
    if importlib.util.find_spec("llama_cpp") is not None:
        return sys.executable, ""
    return None, MISSING + "; or point --llamacpp-python at an interpreter that has it"


class LlamaCppPeer(WorkerProcess):
    """The worker process: ``load`` GGUF files, then ``generate`` greedy tokens (timed inside the worker)."""

    def __init__(self, python: str):
        env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "OMP_NUM_THREADS")}
        super().__init__([python, "-m", WORKER], "llama.cpp", env)

    def info(self) -> dict:
        return self.call(op="info")

    def load(self, name: str, path: Path, n_ctx_seq: int) -> int:
        return self.call(op="load", name=name, path=str(path), n_ctx_seq=n_ctx_seq)["n_vocab"]

    def generate(self, name: str, prompts: list[list[int]], n_new: int, threads: int, n_seq: int) -> dict:
        return self.call(op="generate", name=name, prompts=prompts, n_new=n_new, threads=threads, n_seq=n_seq)

    def spec_load(self, name: str, path: Path, n_ctx: int, lookup_k: int) -> None:
        """llama-cpp-python's high-level ``Llama`` over ``path``, with its prompt lookup drafting ``lookup_k``
        tokens a step (0: plain)."""
        self.call(op="spec_load", name=name, path=str(path), n_ctx=n_ctx, lookup_k=lookup_k)

    def spec_generate(self, name: str, prompt: list[int], n_new: int, threads: int) -> dict:
        """{"seconds": first new token to last, "tokens"}: greedy ``Llama.generate`` (timed inside the worker)."""
        return self.call(op="spec_generate", name=name, prompt=prompt, n_new=n_new, threads=threads)


def cached_ggufs(sources: dict[str, Path], root: Path) -> dict[str, Path]:
    """{precision: GGUF file} written by prunus's ``to_gguf`` from ``sources`` ({precision: prunus model dir}),
    each at the GGUF type of :data:`GGUF_TYPES`, under ``root``; rewritten when its source is newer."""
    from prunus.models.gguf_write import to_gguf

    out = {}
    for precision, src in sources.items():
        name, kind = GGUF_TYPES[precision]
        path = root / f"{name}.gguf"
        if not path.is_file() or path.stat().st_mtime < (src / "prunus.json").stat().st_mtime:
            t0 = time.perf_counter()
            print(f"   writing {path} from {src} (prunus convert --to-gguf --type {kind}, once) ...", flush=True)
            root.mkdir(parents=True, exist_ok=True)
            to_gguf(src, path, type=kind, overwrite=True)
            print(f"   ... {time.perf_counter() - t0:.0f} s", flush=True)
        out[precision] = path
    return out
