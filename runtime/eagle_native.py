"""An EAGLE draft's linear layers in prunus's native int8 kernels, on the target's own thread pool.

Beside a target served by the native kernels (an int8 export reads about 160 MB of weights per token for
SmolLM2-135M), a float32 draft of one block and a 16k-row head reads 54 MB: on a CPU whose decode is bound by
memory bandwidth that is a third of the target's cost, and the draft's gain is gone. Stored as int8 in blocks of 32
(one float scale per block, symmetric) and run by ``prunus_linear`` (the decoder's own kernels, activations
quantized per block as the target's are) it reads a quarter of that. The draft only proposes: its rounding changes
what is drafted, never what is accepted (the target checks every token).
"""

from __future__ import annotations

import ctypes

import numpy as np
import torch
from torch import nn

from prunus.native.decoder import _linear
from prunus.native.weights import pack_blocks


def int8_blocks(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """w (n, k), k a multiple of 32 -> (codes (n, k) uint8 stored as q + 128, scales (n, k / 32)): symmetric int8."""
    n, k = w.shape
    blocks = w.reshape(n, k // 32, 32)
    scale = np.abs(blocks).max(-1) / 127
    scale[scale == 0] = 1.0
    q = np.clip(np.rint(blocks / scale[..., None]), -127, 127).astype(np.int16) + 128
    return q.astype(np.uint8).reshape(n, k), scale.astype(np.float32)


class NativeLinear(nn.Module):
    """``linear``'s weights as int8 blocks, run by the native kernels on ``decoder``'s pool (float32 in and out)."""

    def __init__(self, linear: nn.Linear, decoder):
        super().__init__()
        w = linear.weight.detach().float().numpy()
        bias = None if linear.bias is None else linear.bias.detach().float().numpy().copy()
        self.n, self.k = w.shape
        self.packed = pack_blocks(*int8_blocks(w), None, 8, bias)
        self.c = _linear(self.packed)  # points into self.packed's arrays, which live as long as this module
        self.lib, self.decoder = decoder.lib, decoder

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        a = np.ascontiguousarray(x.reshape(-1, self.k).float().numpy())
        y = np.empty((a.shape[0], self.n), np.float32)
        self.lib.prunus_linear(ctypes.byref(self.c), self.decoder.pool, a.shape[0], a.ctypes.data, y.ctypes.data)
        return torch.from_numpy(y).reshape(*lead, self.n)


def native_linears(draft: nn.Module, decoder) -> nn.Module:
    """``draft`` with every ``nn.Linear`` whose input width is a multiple of 32 replaced by a :class:`NativeLinear`."""
    for module in list(draft.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, nn.Linear) and child.in_features % 32 == 0:
                setattr(module, name, NativeLinear(child, decoder))
    return draft


def _int8_codes(weight_t: np.ndarray, bits: int) -> tuple[np.ndarray, np.ndarray]:
    """:class:`~prunus.runtime.native_tensors.Source`'s codes of an (in, out) weight: symmetric int8 blocks of 32."""
    return int8_blocks(np.ascontiguousarray(weight_t.T))


def draft_tensors(draft) -> tuple[dict, dict]:
    """The native weights (tensors, metadata) of an EAGLE draft's block, final norm and head as a one-layer model, its
    linear layers int8 (the head's rows as its embedding, which a pass of input vectors never reads)."""
    import dataclasses
    from types import SimpleNamespace

    from .native_tensors import Source, tensors_of

    cfg = dataclasses.replace(draft.config, scale_embeddings=False)  # the block reads fc's output, not an embedding
    model = SimpleNamespace(config=cfg, layers={"0": draft.block}, tok_embeddings=draft.head, norm=draft.norm,
                            output=draft.head)
    return tensors_of(model, Source({}, lambda m: "", 8, _int8_codes))


class NativeDraft:
    """An EAGLE draft's passes in the native kernels: ``fc(concat(h, e))`` one int8 linear layer, then the block, the
    final norm and the head as a one-layer model over KV buffers of its own (``prunus_forward_x``: input vectors in
    place of token embeddings), on the target decoder's thread pool. Two native calls a pass, no torch module on the
    way: the same weights and math as :class:`~prunus.runtime.eagle_drafter.TorchDraft` over :class:`NativeLinear`
    layers, whose pass paid for a torch module call per operation. The draft only proposes: its rounding changes what
    is drafted, never what is accepted."""

    def __init__(self, draft, decoder, n_slots: int, max_len: int):
        """One PrunusError line where the kernels do not mirror the draft's block (the caller keeps torch's)."""
        from prunus.native.build import isa
        from prunus.native.decoder import NativeDecoder
        from prunus.native.plan import load_plan
        from prunus.native.weights import pack_tensors

        cfg = draft.config
        dims = {"n_layers": 1, "n_kv_heads": cfg.n_kv_heads, "head_dim": cfg.head_dim, "vocab_size": draft.vocab}
        packed = pack_tensors("the EAGLE draft", *draft_tensors(draft), dims)
        shape = (n_slots, cfg.n_kv_heads, min(max_len, packed.cos.shape[0]), cfg.head_dim)
        self.kv = ([np.zeros(shape, np.float32)], [np.zeros(shape, np.float32)])
        self.decoder = NativeDecoder(packed, *self.kv, n_slots, shape[2], decoder.threads, pool=decoder.pool)
        self.decoder.use_plan(load_plan(packed, self.decoder.lib, decoder.pool, isa(), decoder.threads))
        self.fc = NativeLinear(draft.fc, decoder)
        self.config, self.token_ids = cfg, draft.token_ids
        self.logits = np.zeros(draft.vocab, np.float32)

    def __call__(self, row: int, start: int, hidden: torch.Tensor, embeds: torch.Tensor):
        """(features, logits) of the last of ``len(hidden)`` positions at ``start...`` of ``row``'s cache."""
        x = np.ascontiguousarray(self.fc(torch.cat([hidden, embeds], dim=-1)).numpy())
        out = np.empty_like(x)
        self.decoder.forward_x(x, start, row, self.logits, out)
        return torch.from_numpy(out[-1].copy()), torch.from_numpy(self.logits.copy())

    def close(self) -> None:
        self.decoder.close()
