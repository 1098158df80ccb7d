"""prunus model dir -> GGUF: ``to_gguf`` writes a file llama.cpp runs, through the ``gguf`` package.

The metadata is what llama.cpp's own converter (``convert_hf_to_gguf.py``) writes for a
Llama (``llama``), a Qwen2 (q/k/v biases: ``qwen2``) or a Qwen3 (q/k norms: ``qwen3``):
``general.*``, the ``<arch>.*`` shape keys, and the tokenizer with its merges (or
SentencePiece scores), special token ids and chat template. For ``llama``, q and k rows are
permuted into llama.cpp's rotary order; a tied output head is written once, as ``token_embd.weight``
(llama.cpp uses it for the output when ``output.weight`` is absent).

For a float model dir ``--type`` sets the 2-D weights' storage: ``f32`` (a round trip back through ``from_gguf``
is bit-exact), ``f16``, ``q8_0`` (blocks of 32 with one fp16 scale), ``q4_0`` (blocks of 32
4-bit values q with one fp16 scale d: w = (q - 8) d) or ``q4_1`` (with an fp16 offset m too:
w = q d + m). Blocks are made by ``gguf.quants.quantize``. A tensor whose rows do not split
into blocks of 32 falls back to F16, as llama.cpp's converter does. With q4_0 / q4_1 the
output head (``output.weight``, or ``token_embd.weight`` when the head is tied to it) is
written Q8_0, as ``llama-quantize`` does for a Q4 file whose head rows are not a multiple of
256 (it takes Q6_K otherwise, which the ``gguf`` package cannot write). Norm weights are
always F32.

A compressed prunus dir (stored int8 / int4 / fp8 weights) is written as the weights prunus runs, never quantized
again: under ``q8_0`` / ``q4_0`` / ``q4_1`` each stored int8 or int4 tensor goes in the block type that holds its
values exactly (Q8_0, Q4_0 or Q4_1, whatever ``--type`` names; :mod:`prunus.models.gguf_exact`), and every other
tensor (the float embedding and head, fp8 layers, int8 / int4 values whose scales are not fp16 values) in F32, its
dequantized values exactly. ``f32`` writes every tensor dequantized in F32 (exact); ``f16`` in F16, as asked.
``general.size_label`` counts the model's parameters (an int4 weight's values, not its packed bytes).
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
from .gguf_exact import exact_blocks, stored_codes
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
    # parameters as the model has them (an int4 weight's two values per byte count twice, its scales not at all)
    general = general_metadata(model_dir, read_manifest(model_dir), sum(w.numel() for w in weights.values()))
    compressed = any(callable(getattr(m, "dequantize", None)) for m in model.modules())
    codes = stored_codes(model) if type not in ("f32", "f16") else {}
    del model
    head = "tok_embeddings.weight" if cfg.tie_embeddings else "output.weight"
    with _atomic_file(out, overwrite) as tmp:
        writer = gguf.GGUFWriter(tmp, arch)
        _add_config(writer, cfg, general, type)
        add_tokenizer(writer, tok_meta)
        for name, w in weights.items():
            heads = rotary_heads(name, cfg.n_heads, cfg.n_kv_heads) if arch in PERMUTED else None
            rows = (lambda t: to_gguf_rows(t, heads)) if heads is not None else (lambda t: t)  # noqa: E731
            exact = exact_blocks(codes[name].rows(rows)) if name in codes else None
            if exact is not None:  # stored int8 / int4 values in the block type that holds them as they are
                data, qtype = exact[1], gguf.GGMLQuantizationType[exact[0]]
            else:  # a float tensor of a compressed dir, or stored values no block holds: F32, exact
                data, qtype = _storage(rows(w), "f32" if compressed and type not in ("f16",) else type, name == head)
            writer.add_tensor(gguf_name(name), data, raw_dtype=qtype)  # the shape follows from data and type
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
    return out
