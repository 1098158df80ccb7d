"""A compressed generic module is written only once it reloads and runs.

The output dir is staged beside ``--out`` (``.NAME-check.tmp-PID``, cleaned like any prunus temporary), reloaded
through the loader ``prunus eval`` / ``export`` / ``serve`` use (:func:`prunus.models.model_dir.load_model`:
manifest verified, module rebuilt from its factory and recorded shapes, weights loaded strictly) and run on a
batch of the task's held-out inputs; its outputs must equal the compressed module's in memory (the report's
figures were measured on that one). Only then does the staged dir become ``--out``; on any failure it is
removed and the reason is one line.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch

from prunus.artifacts.errors import PrunusError

RTOL, ATOL = 1e-4, 1e-5


def staging_path(out: Path) -> Path:
    """Where the output is written before it is checked (a name :func:`~prunus.artifacts.atomic.clean_stale_temps`
    removes once this process is gone)."""
    return out.with_name(f".{out.name}-check.tmp-{os.getpid()}")


def check_reloads(path: Path, model: torch.nn.Module, batch: torch.Tensor, trust_factory) -> None:
    """Reload ``path`` as eval / serve do, run ``batch``; one line when that fails or disagrees with ``model``."""
    from prunus.models.model_dir import load_model
    from prunus.models.module_factory import reason

    try:
        loaded = load_model(path, trust_factory=trust_factory)
        with torch.inference_mode():
            got, want = loaded(batch), model.eval()(batch)
    except PrunusError as e:
        raise PrunusError(f"compress: the written module does not reload ({e}); nothing was written") from None
    except Exception as e:  # noqa: BLE001 - any failure of the rebuilt module: one line with the reason
        raise PrunusError(f"compress: the written module fails its first forward after reloading ({reason(e)}); "
                          "nothing was written; report the module's layers to prunus, or use another pass") from None
    if not isinstance(got, torch.Tensor) or got.shape != want.shape or not torch.allclose(
            got.float(), want.float(), rtol=RTOL, atol=ATOL):
        raise PrunusError("compress: the reloaded module's outputs differ from the compressed module's (a layer's "
                          "sizes were not restored); nothing was written; report the module's layers to prunus")


def write_checked(out: Path, overwrite: bool, write, model: torch.nn.Module, batch: torch.Tensor,
                  trust_factory) -> None:
    """``write(path)`` to a staging dir, :func:`check_reloads` it, then move it to ``out`` (replacing it only with
    ``overwrite``, and only a prunus output)."""
    from prunus.artifacts.atomic import replace_dir
    from prunus.artifacts.paths import check_replaceable

    if os.path.lexists(out):
        if not overwrite:
            raise PrunusError(f"{out}: already exists; choose another output path or pass --overwrite")
        check_replaceable(out)
    stage = staging_path(out)
    shutil.rmtree(stage, ignore_errors=True)
    try:
        write(stage)
        check_reloads(stage, model, batch, trust_factory)
        replace_dir(stage, out)
    finally:
        shutil.rmtree(stage, ignore_errors=True)
