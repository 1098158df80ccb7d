"""onnxruntime-genai as a peer of prunus's CPU decode: its model builder's int4 model, and its runtime.

* :func:`builder_int4` runs onnxruntime-genai's model builder (``python -m onnxruntime_genai.models.builder
  -p int4 -e cpu``, no extra options: the builder's own int4, round to nearest) on a Hugging Face dir of the
  same weights, once, into a cache dir (written under a temporary name, then renamed); it is made again when
  the Hugging Face weights are newer.
* :class:`OrtGenaiWorker` runs og's own generator in a process of its own (``_ort_genai_worker.py``), one per
  model dir, as prunus's contenders and llama.cpp run in theirs, so og's thread pool shares no process.
* :func:`graph_summary` says what a genai graph holds (MatMulNBits bits / block / accuracy level, the head, a
  quantized embedding), printed beside the peer's figures.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from benchmarks.harness import WorkerProcess

WORKER = "benchmarks._ort_genai_worker"  # run with -m from the repository root, as the benchmarks are
BUILDER = "onnxruntime_genai.models.builder"


@dataclass(frozen=True)
class OgContender:
    """A model dir og's runtime decodes (``genai_config.json`` in it), and the precision it is compared at."""

    label: str
    path: Path
    precision: str


class OrtGenaiWorker(WorkerProcess):
    """og's runtime on one model dir, in its own process."""

    def __init__(self, c: OgContender):
        super().__init__([sys.executable, "-m", WORKER], f"onnxruntime-genai ({c.label})")
        self.path = c.path

    def info(self) -> dict:
        return self.call(op="info")

    def load(self, threads: int):
        self.call(op="load", path=str(self.path), threads=threads)
        return self.run

    def run(self, prompts: list[list[int]], n_new: int) -> dict:
        return self.call(op="generate", prompts=prompts, n_new=n_new)


def builder_command(hf_dir: Path, out: Path, cache: Path) -> list[str]:
    return [sys.executable, "-m", BUILDER, "-i", str(hf_dir), "-o", str(out), "-p", "int4", "-e", "cpu", "-c",
            str(cache)]


def builder_int4(hf_dir: Path, out: Path) -> Path:
    """``out``: the model builder's int4 CPU model of ``hf_dir``, made once (again when ``hf_dir``'s weights are
    newer). The builder writes into ``out`` + ".partial", renamed when it finished."""
    weights = hf_dir / "model.safetensors"
    done = out / "genai_config.json"
    if done.is_file() and (not weights.is_file() or done.stat().st_mtime >= weights.stat().st_mtime):
        return out
    tmp, cache = out.with_name(out.name + ".partial"), out.with_name(out.name + ".builder-cache")
    shutil.rmtree(tmp, ignore_errors=True)
    cmd = builder_command(hf_dir, tmp, cache)
    print(f"   building onnxruntime-genai's int4 model (once, cached in {out}): {' '.join(cmd[1:])} ...", flush=True)
    t0 = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True)
    shutil.rmtree(cache, ignore_errors=True)
    if r.returncode != 0 or not (tmp / "genai_config.json").is_file():
        tail = "\n".join((r.stderr or r.stdout).strip().splitlines()[-5:])
        raise RuntimeError(f"onnxruntime-genai's model builder failed (exit {r.returncode}):\n{tail}")
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    print(f"   ... {time.perf_counter() - t0:.0f} s", flush=True)
    return out


def genai_graph(model_dir: Path) -> Path:
    """The decoder graph a genai model dir's ``genai_config.json`` names."""
    config = json.loads((model_dir / "genai_config.json").read_text())
    return model_dir / config["model"]["decoder"]["filename"]


def graph_summary(model_dir: Path) -> str:
    """What the decoder graph of a genai model dir holds: its quantized operators with their settings, the
    output head's (the last MatMul / MatMulNBits), and how many float MatMuls remain."""
    import onnx

    graph = onnx.load(str(genai_graph(model_dir)), load_external_data=False).graph
    kinds = Counter()
    for n in graph.node:
        if n.op_type in ("MatMulNBits", "GatherBlockQuantized"):
            a = {x.name: onnx.helper.get_attribute_value(x) for x in n.attribute}
            kinds[(n.op_type, a.get("bits"), a.get("block_size"), a.get("accuracy_level", 0))] += 1
        elif n.op_type == "MatMul":
            kinds[("MatMul (float)", None, None, None)] += 1
    head = next((n for n in reversed(graph.node) if n.op_type in ("MatMul", "MatMulNBits")), None)
    parts = [f"{c} {op}" + (f" {bits}-bit block {block}" if bits else "")
             + (f" accuracy level {acc}" if op == "MatMulNBits" else "") for (op, bits, block, acc), c in kinds.items()]
    if head is not None:
        a = {x.name: onnx.helper.get_attribute_value(x) for x in head.attribute}
        parts.append(f"head {head.op_type}" + (f" {a.get('bits')}-bit" if head.op_type == "MatMulNBits" else " float"))
    return "; ".join(parts)
