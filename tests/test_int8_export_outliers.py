"""Massive activations (SmolLM2-135M has a 2,991 peak at its first position) survive the int8 export.

A tiny trained model gets a planted outlier: one token (the newline byte, frequent in the built-in
corpus, as the first token and the delimiters carry LLMs' massive activations) writes a residual
channel that no other token touches, and one hidden unit of the first block's MLP turns it into an
input of about 3,000 to ``w2`` while it stays 0 for every other token. ``--precision int8``
(ONNX Runtime's 8-bit ``MatMulNBits``, activations quantized to int8 per block of 32 inside the
kernel) must still pass its parity check against the PyTorch model. The first block's MLP is made to
matter: rounding its other units away, as one per-tensor int8 activation scale would, costs more
top-1 agreement than parity allows (checked in PyTorch).
"""

from __future__ import annotations

import numpy as np
import torch

from prunus.data.corpus import default_data, load_corpus
from prunus.export import export_model
from prunus.models import load_model, load_model_tokenizer, save_model

TOKEN, CHANNEL, HIDDEN, PEAK = 10, 5, 7, 3000.0  # TOKEN: the byte "\n" in the byte-level tokenizer
MLP_GAIN = 4.0


def _plant(model) -> None:
    """Give TOKEN a residual channel of its own and the first block's MLP a hidden unit reading only it."""
    dim = model.config.dim
    with torch.no_grad():
        model.tok_embeddings.weight[:, CHANNEL] = 0  # the channel is TOKEN's alone ...
        model.tok_embeddings.weight[TOKEN] = 0
        model.tok_embeddings.weight[TOKEN, CHANNEL] = 1.0
        for block in model.layers.values():  # ... and no block writes it
            block.attention.wo.weight[CHANNEL] = 0
            block.feed_forward.w2.weight[CHANNEL] = 0
        ff, norm = model.layers["0"].feed_forward, model.layers["0"].ffn_norm
        norm.weight[CHANNEL] = 1.0
        # after the norm TOKEN's channel is sqrt(dim) (its only non-zero one): silu(a x) * (b x) = PEAK there
        x = dim ** 0.5
        ff.w1.weight[HIDDEN] = 0
        ff.w3.weight[HIDDEN] = 0
        ff.w1.weight[HIDDEN, CHANNEL] = 4.0 / x
        ff.w3.weight[HIDDEN, CHANNEL] = PEAK / (x * torch.nn.functional.silu(torch.tensor(4.0)).item())
        ff.w2.weight.mul_(MLP_GAIN)  # the first block's MLP matters (see the test) ...
        ff.w2.weight[:, HIDDEN] *= 1e-3 / MLP_GAIN  # ... and the peak reaches the residual at the others' size


def _w2_inputs(model, tokens, keep_only_the_peak: bool = False):
    """(the first block's w2 inputs, logits); ``keep_only_the_peak`` zeroes every other unit, as one int8 step of
    PEAK / 127 ~ 24 per tensor (a per-tensor activation scale) would round them (about 1 in size) away."""
    seen = []

    def hook(module, args):
        x = args[0].clone()
        if keep_only_the_peak:
            x[..., torch.arange(x.shape[-1]) != HIDDEN] = 0
        seen.append(x)
        return (x,)

    handle = model.layers["0"].feed_forward.w2.register_forward_pre_hook(hook)
    with torch.no_grad():
        logits = model(tokens)
    handle.remove()
    return seen[0], logits


def test_planted_massive_activation_passes_int8_export_parity(trained_run, tmp_path):
    model = load_model(trained_run / "model")
    _plant(model)
    tokens = torch.tensor([[TOKEN, 100, 101, 102, TOKEN, 103, 104, 105]])
    x, _ = _w2_inputs(model, tokens)
    peak = x[0, :, HIDDEN]
    assert 2000 < float(peak[0]) < 4000 and 2000 < float(peak[4]) < 4000  # at the token, wherever it occurs
    assert float(peak[1:4].abs().max()) == 0 and float(x[0, 1:4].abs().max()) < 0.01 * float(peak[0])
    tok = load_model_tokenizer(trained_run / "model")
    val = load_corpus(default_data(None, tok), tok, max_bytes=1 << 16, vocab_size=model.config.vocab_size).val
    held_out = torch.from_numpy(np.asarray(val[:512], dtype=np.int64)).reshape(4, 128)
    assert float((held_out == TOKEN).float().mean()) > 0.01  # the planted token is common in the scored text
    _, ref = _w2_inputs(model, held_out)
    _, lost = _w2_inputs(model, held_out, keep_only_the_peak=True)
    assert float((lost.argmax(-1) == ref.argmax(-1)).float().mean()) < 0.9  # what rounding them away would cost
    save_model(model, tmp_path / "planted", stage="train")
    result = export_model(tmp_path / "planted", tmp_path / "int8", precision="int8", progress=False)
    parity = result.parity
    assert parity["passed"] and parity["precision"] == "int8", parity
    assert parity["top1_agreement"] >= 0.9 and parity["bpb_increase"] <= 0.05
