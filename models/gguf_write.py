"""prunus model dir -> GGUF: ``to_gguf`` writes a file llama.cpp runs, through the ``gguf`` package.

The metadata is what llama.cpp's own converter (``convert_hf_to_gguf.py``) writes for a
Llama (``llama``), a Qwen2 (q/k/v biases: ``qwen2``) or a Qwen3 (q/k norms: ``qwen3``):
``general.*``, the ``<arch>.*`` shape keys, and the tokenizer with its merges (or
SentencePiece scores), special token ids and chat template. For ``llama``, q and k rows are
permuted into llama.cpp's rotary order; a tied output head is written once, as ``token_embd.weight``
(llama.cpp uses it for the output when ``output.weight`` is absent).

``--type`` sets the 2-D weights' storage: ``f32`` (a round trip back through ``from_gguf``
is bit-exact), ``f16``, ``q8_0`` (blocks of 32 with one fp16 scale), ``q4_0`` (blocks of 32
4-bit values q with one fp16 scale d: w = (q - 8) d) or ``q4_1`` (with an fp16 offset m too:
w = q d + m). Blocks are made by ``gguf.quants.quantize``. A tensor whose rows do not split
into blocks of 32 falls back to F16, as llama.cpp's converter does. With q4_0 / q4_1 the
output head (``output.weight``, or ``token_embd.weight`` when the head is tied to it) is
written Q8_0, as ``llama-quantize`` does for a Q4 file whose head rows are not a multiple of
256 (it takes Q6_K otherwise, which the ``gguf`` package cannot write). Norm weights are
always F32.

A compressed prunus dir is written from its dequantized weights (int8 / fp8 QuantizedLinear:
GGUF has no int8-with-per-channel-scale type, and llama.cpp does not quantize activations the
way w8a8 schemes do, so only the weights carry over), except stored int4 weights
(:class:`prunus.models.quantized_int4.Int4Linear`) with groups of 32 under ``q4_0`` (symmetric
ones, zero point 8) or ``q4_1`` (any zero point z: d = s, m = -z s): their 4-bit values are
copied into the blocks as they are and only the scale (and offset) is rounded to fp16, so
llama.cpp runs the same codes prunus stored. Other int4 layers (groups of 64 or 128, an
asymmetric layer under q4_0) are dequantized and quantized again.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from pathlib import Path

import torch

from prunus.artifacts.atomic import clean_stale_temps, disk_error, writable_parent
from .config import ModelConfig
from prunus.artifacts.errors import PrunusError
from .gguf_layout import PERMUTED, gguf_name, rotary_heads, to_gguf_rows
from .gguf_tokenizer import add_tokenizer, byte_tokenizer_metadata, hf_tokenizer_metadata
from .gguf_general import add_general, general_metadata
from .model_dir import load_model, load_model_tokenizer, read_manifest
from prunus.artifacts.paths import check_output
from .tokenizer import ByteTokenizer

TYPES = ("f32", "f16", "q8_0", "q4_0", "q4_1")
Q4 = ("q4_0", "q4_1")
BLOCK = 32  # values per Q8_0 / Q4_0 / Q4_1 block
# ModelConfig fields every GGUF written here describes (or that only matter for training), and the
# variant fields each architecture adds; any other field away from its default has no GGUF form here.
_PLAIN = {"dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "vocab_size", "max_seq_len", "rope_theta", "norm_eps",
          "tie_embeddings", "dtype", "head_dim", "top_k", "capacity_factor", "moe_aux_loss_coef", "moe_ffn_dim",
          "rope_type", "rope_factor"}


def architecture(cfg: ModelConfig, where: str) -> str:
    """The GGUF architecture that runs ``cfg`` as prunus does: llama (with Llama's optional attention
    biases), qwen2 (q/k/v biases) or qwen3 (q/k norms). Anything else is refused in one line."""
    if cfg.n_experts:
        raise PrunusError(f"{where}: a mixture-of-experts model ({cfg.n_experts} experts) is not written to GGUF; "
                          "convert a dense model")
    if cfg.qk_norm and not cfg.attn_qkv_bias and not cfg.attn_out_bias:
        arch = "qwen3"
    elif cfg.attn_qkv_bias and not cfg.attn_out_bias and not cfg.qk_norm:
        arch = "qwen2"
    else:
        arch = "llama"
    default = ModelConfig()
    allowed = _PLAIN | ({"attn_qkv_bias", "attn_out_bias"} if cfg.attn_qkv_bias == cfg.attn_out_bias else set()) \
        | {"qwen2": {"attn_qkv_bias"}, "qwen3": {"qk_norm"}, "llama": set()}[arch]
    extra = [f"{f.name}={getattr(cfg, f.name)!r}" for f in dataclasses.fields(cfg)
             if f.name not in allowed and getattr(cfg, f.name) != getattr(default, f.name)]
    if cfg.rope_type not in ("default", "linear"):
        extra.append(f"rope_type={cfg.rope_type!r}")
    if extra:
        raise PrunusError(f"{where}: architecture variant(s) {', '.join(extra[:4])} have no GGUF form prunus writes; "
                          "written are Llama, Qwen2 and Qwen3 models without sliding windows or rope scaling "
                          "other than linear")
    return arch


def float_weights(model, where: str) -> dict[str, torch.Tensor]:
    """The model's weights as float32 tensors under prunus names, quantized Linear layers dequantized."""
    out, quantized = {}, set()
    for name, module in model.named_modules():
        if callable(getattr(module, "dequantize", None)):
            out[f"{name}.weight"] = module.dequantize().float()
            quantized.add(name)
    for name, t in model.state_dict().items():
        if name.rpartition(".")[0] in quantized and not name.endswith(".bias"):
            continue  # the quantized values and scales, written dequantized above; a float bias goes as it is
        if model.config.tie_embeddings and name == "output.weight":
            continue  # written once, as token_embd.weight
        if gguf_name(name) is None:
            raise PrunusError(f"{where}: weight {name} has no GGUF name; only plain Llama models are written")
        out[name] = t.float()
    return out


def _storage(w: torch.Tensor, kind: str, head: bool = False):
    """(numpy data, GGML type) for one float tensor under ``--type kind`` (``head``: the output head)."""
    import gguf

    q = gguf.GGMLQuantizationType
    a = w.contiguous().numpy()
    if w.ndim == 1 or kind == "f32":
        return a, q.F32
    if kind == "f16" or w.shape[-1] % BLOCK:
        return a.astype("float16"), q.F16
    if head and kind in Q4:
        kind = "q8_0"
    qtype = q[kind.upper()]
    return gguf.quants.quantize(a, qtype), qtype


def stored_int4(model, kind: str) -> dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """{prunus weight name: (4-bit values (out, in), scales, zero points (out, in // 32))} of the Int4Linear
    layers whose stored values go into ``kind``'s blocks as they are: groups of 32, and for q4_0 zero point
    8 everywhere (symmetric), the only zero point Q4_0 has. Empty for the other types."""
    from .quantized_int4 import Int4Linear

    out = {}
    for name, m in model.named_modules():
        if kind not in Q4 or not isinstance(m, Int4Linear) or m.group_size != BLOCK:
            continue
        if kind == "q4_0" and not bool((m.weight_zero == 8).all()):
            continue
        s = m.weight_scale.float()
        if not bool(torch.isfinite(s.half()).all() and torch.isfinite((m.weight_zero.float() * s).half()).all()):
            continue  # a scale past fp16's range: requantized from the dequantized weight instead
        out[f"{name}.weight"] = (m.unpacked(), s, m.weight_zero)
    return out


def q4_blocks(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, kind: str):
    """Stored int4 values as GGUF Q4_0 / Q4_1 rows (uint8, (out, in // 32 * block bytes)).

    A block is fp16 d (Q4_1: then fp16 m), then 16 bytes, byte i holding value i in its low nibble and
    value i + 16 in its high one. prunus's value (q - z) s is (q - 8) d with d = s for Q4_0 (z = 8),
    and q d + m with d = s, m = -z s for Q4_1."""
    import numpy as np

    rows, groups = scale.shape
    codes = q.to(torch.uint8).reshape(rows, groups, 2, BLOCK // 2)
    nibbles = (codes[:, :, 0] | (codes[:, :, 1] << 4)).numpy()
    half = lambda t: t.float().numpy().astype(np.float16)[..., None].view(np.uint8)  # noqa: E731
    parts = [half(scale)] + ([half(-zero.float() * scale.float())] if kind == "q4_1" else []) + [nibbles]
    return np.concatenate(parts, axis=-1).reshape(rows, -1)


def _add_config(writer, cfg: ModelConfig, general: dict, kind: str) -> None:
    """The ``general.*`` and ``<arch>.*`` keys llama.cpp's converter writes (``writer`` knows the arch)."""
    import gguf

    ftype = {"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16,
             "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0, "q4_0": gguf.LlamaFileType.MOSTLY_Q4_0,
             "q4_1": gguf.LlamaFileType.MOSTLY_Q4_1}[kind]
    writer.add_type("model")
    add_general(writer, general)  # name, license, size label, ... (prunus.models.gguf_general)
    writer.add_vocab_size(cfg.vocab_size)
    writer.add_context_length(cfg.max_seq_len)
    writer.add_embedding_length(cfg.dim)
    writer.add_block_count(cfg.n_layers)
    writer.add_feed_forward_length(cfg.ffn_dim)
    writer.add_rope_dimension_count(cfg.head_dim)
    writer.add_head_count(cfg.n_heads)
    writer.add_head_count_kv(cfg.n_kv_heads)
    writer.add_rope_freq_base(cfg.rope_theta)
    writer.add_layer_norm_rms_eps(cfg.norm_eps)
    if cfg.head_dim != cfg.dim // cfg.n_heads:
        writer.add_key_length(cfg.head_dim)
        writer.add_value_length(cfg.head_dim)
    if cfg.rope_type == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(cfg.rope_factor)
    writer.add_file_type(ftype)
    if kind in ("q8_0", *Q4):
        writer.add_quantization_version(gguf.GGML_QUANT_VERSION)


@contextlib.contextmanager
def _atomic_file(path: Path, overwrite: bool):
    """Yield a temporary sibling of ``path`` (``.NAME.tmp-PID``, which prunus.artifacts.atomic cleans up
    after a killed process); on success it is fsynced and renamed to ``path``, on error removed."""
    if path.is_dir():
        raise PrunusError(f"--out {path}: is a directory; give a file name such as model.gguf")
    if path.exists() and not overwrite:
        raise PrunusError(f"{path}: already exists; choose another output path or pass --overwrite")
    writable_parent(path)
    clean_stale_temps(path.parent)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        yield tmp
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        reason = disk_error(e)
        if reason:
            raise PrunusError(f"{path}: writing failed ({reason}); nothing was written, free space or choose "
                              "another --out") from None
        raise
    finally:
        tmp.unlink(missing_ok=True)


def to_gguf(model_dir: str | Path, out: str | Path, *, type: str = "f32", overwrite: bool = False) -> Path:
    """Write the prunus model dir ``model_dir`` as a llama.cpp GGUF file at ``out``."""
    import gguf

    model_dir, out = Path(model_dir), Path(out)
    if type not in TYPES:
        raise PrunusError(f"convert: --type {type!r} is not one of {', '.join(TYPES)}")
    check_output(out, [("--to-gguf", model_dir)])  # prunus.artifacts.paths: never over or inside an input
    model = load_model(model_dir)  # verifies the manifest's hashes
    cfg = model.config
    arch = architecture(cfg, str(model_dir))
    tokenizer = load_model_tokenizer(model_dir)
    tok_meta = (byte_tokenizer_metadata(cfg.vocab_size) if isinstance(tokenizer, ByteTokenizer)
                else hf_tokenizer_metadata(model_dir, cfg.vocab_size))
    weights = float_weights(model, str(model_dir))
    general = general_metadata(model_dir, read_manifest(model_dir), sum(p.numel() for p in model.parameters()))
    codes = stored_int4(model, type)
    del model
    head = "tok_embeddings.weight" if cfg.tie_embeddings else "output.weight"
    with _atomic_file(out, overwrite) as tmp:
        writer = gguf.GGUFWriter(tmp, arch)
        _add_config(writer, cfg, general, type)
        add_tokenizer(writer, tok_meta)
        for name, w in weights.items():
            heads = rotary_heads(name, cfg.n_heads, cfg.n_kv_heads) if arch in PERMUTED else None
            if name in codes:  # stored int4 values, copied into Q4 blocks (rows permuted as the weight's)
                q, scale, zero = (to_gguf_rows(t, heads) if heads is not None else t for t in codes[name])
                data, qtype = q4_blocks(q, scale, zero, type), gguf.GGMLQuantizationType[type.upper()]
            else:
                data, qtype = _storage(to_gguf_rows(w, heads) if heads is not None else w, type, name == head)
            writer.add_tensor(gguf_name(name), data, raw_dtype=qtype)  # the shape follows from data and type
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
    return out
