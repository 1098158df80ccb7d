"""The native kernels' parity check of a model dir they serve directly (no export to record it in): the export's check
(:mod:`prunus.export.served_parity`, the same limits, :data:`prunus.export.parity.TOLERANCES`) of the dir's weights
packed in memory as the native runtime packs them (:func:`prunus.runtime.native_backend.pack_model`) against the
PyTorch model, on this CPU's kernel path, decoded through the native backend that serves
(:mod:`prunus.export.backend_parity`).

It costs a pass of the PyTorch model over the held-out slice and the kernels' passes over it, so it runs once per dir
content, kernel path and prunus version: ``prunus serve MODEL_DIR`` runs it before serving the dir natively (through
:func:`prunus.export.prepared.prepared_path`) and keeps the record where :func:`prunus.runtime.native_parity.dir_verdict_path`
names it; every later load, ``Engine.load(MODEL_DIR)`` included, reads it there, and kernels whose check failed do not
serve the dir (:func:`prunus.runtime.native_parity.recorded_dir_native_off`).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from prunus.runtime.native_parity import INT_ACTIVATIONS, chosen_isa, dir_parity, dir_verdict_path

from .backend_parity import native_graphs
from .parity import compare, torch_reference
from .served_parity import runtime_record

FIX = "or set PRUNUS_CACHE_DIR to a dir of your own"


def check_native_dir(model_dir: Path) -> dict:
    """The kernels' parity record of ``model_dir`` (its manifest verified by the load), computed now."""
    from prunus.data.corpus import default_data, load_corpus
    from prunus.models import load_model, load_model_tokenizer
    from prunus.runtime.native_backend import pack_model, packed_precision

    model = load_model(model_dir).float().eval()
    tokenizer, cfg = load_model_tokenizer(model_dir), model.config
    packed = pack_model(model_dir, model)
    precision = packed_precision(packed)
    corpus = load_corpus(default_data(None, tokenizer), tokenizer, max_bytes=1 << 16, vocab_size=cfg.vocab_size)
    token_bytes = tokenizer.token_bytes()
    ref = torch_reference(model, corpus.val, token_bytes)
    report = compare(ref, native_graphs(packed, os.cpu_count()), corpus.val, token_bytes, precision)
    activations = "float32" if precision == "fp32" else INT_ACTIVATIONS
    return runtime_record(report, isa=chosen_isa(), activations=activations, precision=precision)


def native_dir_record(model_dir: Path, parent_hash: str, progress: bool = True) -> dict:
    """The kept parity record of the kernels on ``model_dir`` (content hash ``parent_hash``), checked and kept first
    where there is none for this kernel path."""
    from prunus.artifacts.atomic import atomic_write_json
    from prunus.artifacts.cache_dir import cache_base, safe_dir

    record = dir_parity(model_dir)
    if record is not None:
        return record
    path = dir_verdict_path(parent_hash)
    if progress:
        print(f"prunus: checking the native kernels on {model_dir} against PyTorch, once (kept in {path})",
              file=sys.stderr, flush=True)
    record = {**check_native_dir(model_dir), "parent": parent_hash}
    safe_dir(path.parent, cache_base(), FIX)
    atomic_write_json(path, record)
    return record
