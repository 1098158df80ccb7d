"""A prunus model dir's config.json against its safetensors header, checked where it is cheap.

* :func:`check_config_fits_header`, before any module is built: one block per layer index
  ``0..n_layers-1`` and an embedding table of ``vocab_size x dim``. A config edited to a billion
  layers (or a huge vocabulary) is then one line, not minutes of building modules on the meta device.
* :func:`check_dtype_kinds`, once the module is built (on the meta device): each stored tensor is of the
  kind the module holds there (a float, an integer or a boolean tensor); an int32 tensor of the right
  byte size in place of a float weight is one line, not a ``load_state_dict`` traceback.

The shapes themselves are compared by :func:`prunus.artifacts.safetensors_header.check_shapes`.
"""

from __future__ import annotations

import re

import torch

from prunus.artifacts.errors import PrunusError

FIX = "the config does not fit the weights; re-create the model dir"
FLOAT_DTYPES = {"F16", "BF16", "F32", "F64", "F8_E4M3", "F8_E5M2"}
_LAYER = re.compile(r"^layers\.(\d{1,9})\.")


def check_config_fits_header(cfg, header: dict[str, dict], where: str) -> None:
    """``cfg`` (a ModelConfig read from ``where``) against the tensors of the model dir's safetensors header."""
    layers = {int(m[1]) for name in header if (m := _LAYER.match(name))}
    if len(layers) != cfg.n_layers or (layers and max(layers) != cfg.n_layers - 1):
        held = f"layers 0..{max(layers)}" if layers and len(layers) == max(layers) + 1 else f"{len(layers):,} layers"
        raise PrunusError(f"{where}: n_layers is {cfg.n_layers:,} but the weights hold {held}; {FIX}")
    embedding = header.get("tok_embeddings.weight")
    if embedding is not None and list(embedding["shape"]) != [cfg.vocab_size, cfg.dim]:
        raise PrunusError(f"{where}: vocab_size x dim is {cfg.vocab_size:,} x {cfg.dim:,} but tok_embeddings.weight "
                          f"has shape {tuple(embedding['shape'])}; {FIX}")


def check_dtype_kinds(weights, header: dict[str, dict], expected: dict[str, torch.Tensor]) -> None:
    """Each stored tensor that ``expected`` (the module's state dict) names is a float where the module holds a
    float, and otherwise of the module's exact dtype (int8 codes, packed int4 bytes)."""
    for name, tensor in expected.items():
        entry = header.get(name)
        if entry is None:
            continue
        stored = entry["dtype"]
        fits = stored in FLOAT_DTYPES if tensor.dtype.is_floating_point else stored == _SAFETENSORS_NAME.get(tensor.dtype)
        if not fits:
            raise PrunusError(f"{weights}: {name} is stored as {stored} but the module holds {str(tensor.dtype)[6:]} "
                              f"there; {FIX}")


_SAFETENSORS_NAME = {torch.int8: "I8", torch.uint8: "U8", torch.int16: "I16", torch.int32: "I32", torch.int64: "I64",
                     torch.bool: "BOOL"}
