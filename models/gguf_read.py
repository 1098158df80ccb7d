"""GGUF -> prunus model dir: ``from_gguf`` reads a llama.cpp GGUF file of the Llama, Qwen2 or Qwen3 architecture.

Quantized tensors (Q8_0, Q4_0/1, Q5_0/1, the k-quants Q2_K..Q6_K) are dequantized with
``gguf.quants.dequantize`` into float32 (or the dtype asked for); F32, F16 and BF16 are
read as they are. q and k rows of ``llama`` files are put back from llama.cpp's rotary
order (:mod:`prunus.models.gguf_layout`). The architecture comes from the ``<arch>.*``
metadata and the tensors present (q/k/v biases, q/k norms), the tokenizer and chat
template from ``tokenizer.*`` (:mod:`prunus.models.gguf_tokenizer`).
Anything prunus would run differently from llama.cpp (another architecture, rope
scaling other than linear, experts, sliding windows, a tensor type or a tensor it does
not know) is refused in one line.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
import torch

from .config import ModelConfig
from prunus.artifacts.errors import PrunusError
from .gguf_layout import ARCHITECTURES, PERMUTED, from_gguf_rows, prunus_name, rotary_heads
from .gguf_tokenizer import write_tokenizer_files
from .llama import Transformer
from .model_dir import save_model
from prunus.artifacts.paths import check_output
from .tokenizer import ByteTokenizer, HFTokenizer

READ_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def open_gguf(path: str | Path):
    """A ``gguf.GGUFReader`` on ``path``, or one PrunusError line for a file that is not a whole GGUF."""
    import gguf

    path = Path(path)
    if not path.is_file():
        raise PrunusError(f"{path}: no such file; give a .gguf file")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise PrunusError(f"{path}: not a GGUF file (it does not start with 'GGUF'); give a .gguf file written by llama.cpp")
    try:
        reader = gguf.GGUFReader(path)
    except Exception as e:  # the reader raises ValueError / struct errors on a cut or damaged file
        raise PrunusError(f"{path}: truncated or corrupt GGUF ({type(e).__name__}: {str(e)[:80]}); "
                          "re-download or re-convert it") from None
    size = path.stat().st_size
    for t in reader.tensors:
        if t.data_offset + t.n_bytes > size:
            raise PrunusError(f"{path}: truncated GGUF (tensor {t.name} ends past the end of the file); re-download it")
    return reader


def read_metadata(reader) -> dict:
    """Every metadata key with its Python value (strings decoded, arrays as lists)."""
    return {name: field.contents() for name, field in reader.fields.items() if not name.startswith("GGUF.")}


def _refuse_unsupported(meta: dict, tensor_names: set[str], where: str) -> str:
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise PrunusError(f"{where}: general.architecture={arch!r} is not supported; supported: {', '.join(ARCHITECTURES)} "
                          "(Llama, SmolLM, Mistral 7B and others llama.cpp writes as 'llama'; Qwen2 / 2.5; Qwen3)")
    a = arch
    bad = []
    if meta.get(f"{a}.expert_count"):
        bad.append(f"{a}.expert_count={meta[f'{a}.expert_count']} (mixture of experts)")
    scaling = meta.get(f"{a}.rope.scaling.type")
    if scaling not in (None, "none", "linear"):
        bad.append(f"rope scaling {scaling!r}")
    if "rope_freqs.weight" in tensor_names:
        bad.append("rope_freqs.weight (Llama 3.1 rope scaling)")
    for key in (f"{a}.attention.head_count", f"{a}.attention.head_count_kv", f"{a}.feed_forward_length"):
        if isinstance(meta.get(key), list):
            bad.append(f"{key} varying per layer")
    if meta.get(f"{a}.attention.sliding_window"):
        bad.append(f"{a}.attention.sliding_window")
    if bad:
        raise PrunusError(f"{where}: unsupported feature(s) {', '.join(bad)}; converted are Llama / Qwen2 / Qwen3 "
                          "without experts, rope scaling other than linear, or sliding windows")
    return a


def _variant_fields(meta: dict, arch: str, names: set[str], where: str) -> dict:
    """The ModelConfig fields beyond plain Llama this file sets: biases, q/k norms, linear rope scaling."""
    qkv_bias, out_bias = "blk.0.attn_q.bias" in names, "blk.0.attn_output.bias" in names
    qk_norm = "blk.0.attn_q_norm.weight" in names
    expected = {"llama": (qkv_bias, qkv_bias, False), "qwen2": (True, False, False), "qwen3": (False, False, True)}[arch]
    if (qkv_bias, out_bias, qk_norm) != expected:
        raise PrunusError(f"{where}: a {arch} file with q/k/v bias={qkv_bias}, output bias={out_bias}, "
                          f"q/k norm={qk_norm} is not a layout prunus converts")
    fields = {"attn_qkv_bias": qkv_bias, "attn_out_bias": out_bias, "qk_norm": qk_norm}
    if meta.get(f"{arch}.rope.scaling.type") == "linear" or meta.get(f"{arch}.rope.scale_linear") not in (None, 1.0):
        fields["rope_type"] = "linear"
        fields["rope_factor"] = _f32(meta.get(f"{arch}.rope.scaling.factor", meta.get(f"{arch}.rope.scale_linear")))
    return fields


def _f32(value) -> float:
    """A float32 metadata value as the shortest decimal that is the same float32 (1e-05, not 9.99999974e-06),
    so a float64 config value written as float32 reads back as itself; the float32 arithmetic is unchanged."""
    return float(str(np.float32(value)))


def config_from_gguf(meta: dict, tensors: dict, where: str, dtype: str) -> ModelConfig:
    """The ModelConfig the ``llama.*`` metadata and the tensor shapes describe."""
    a = _refuse_unsupported(meta, set(tensors), where)
    if "token_embd.weight" not in tensors:
        raise PrunusError(f"{where}: no token_embd.weight tensor; not a complete model GGUF")
    vocab_size = int(tensors["token_embd.weight"].shape[1])  # GGUF shapes are (columns, rows)
    try:
        dim, n_heads = int(meta[f"{a}.embedding_length"]), int(meta[f"{a}.attention.head_count"])
        head_dim = int(meta.get(f"{a}.attention.key_length", dim // n_heads))
        if int(meta.get(f"{a}.attention.value_length", head_dim)) != head_dim:
            raise PrunusError(f"{where}: {a}.attention.value_length differs from key_length; prunus needs them equal")
        if int(meta.get(f"{a}.rope.dimension_count", head_dim)) != head_dim:
            raise PrunusError(f"{where}: {a}.rope.dimension_count={meta[f'{a}.rope.dimension_count']} rotates part "
                              f"of a head of {head_dim}; prunus rotates whole heads")
        if meta.get(f"{a}.vocab_size") not in (None, vocab_size):
            raise PrunusError(f"{where}: {a}.vocab_size={meta[f'{a}.vocab_size']} but token_embd.weight has "
                              f"{vocab_size} rows; the file is inconsistent")
        return ModelConfig(
            dim=dim, n_layers=int(meta[f"{a}.block_count"]), n_heads=n_heads,
            n_kv_heads=int(meta.get(f"{a}.attention.head_count_kv", n_heads)),
            ffn_dim=int(meta[f"{a}.feed_forward_length"]), vocab_size=vocab_size,
            max_seq_len=int(meta.get(f"{a}.context_length", 2048)),
            rope_theta=_f32(meta.get(f"{a}.rope.freq_base", 10000.0)),
            norm_eps=_f32(meta.get(f"{a}.attention.layer_norm_rms_epsilon", 1e-5)),
            tie_embeddings="output.weight" not in tensors, dtype=dtype,
            head_dim=None if head_dim == dim // n_heads else head_dim,
            **_variant_fields(meta, a, set(tensors), where),
        )
    except KeyError as e:
        raise PrunusError(f"{where}: missing metadata {e.args[0]}; not a complete model GGUF") from None
    except PrunusError as e:
        raise PrunusError(f"{where}: {e}" if not str(e).startswith(where) else str(e)) from None


def _tensor(t, where: str) -> torch.Tensor:
    """One GGUF tensor as a float32 torch tensor in prunus's (rows, columns) order."""
    from gguf.quants import dequantize

    kind = t.tensor_type.name
    if kind not in READ_TYPES:
        raise PrunusError(f"{where}: tensor {t.name} is of type {kind}, which prunus does not read; "
                          f"supported: {', '.join(READ_TYPES)}")
    shape = tuple(int(n) for n in reversed(t.shape))
    data = dequantize(np.asarray(t.data), t.tensor_type)
    return torch.from_numpy(np.array(data, dtype=np.float32).reshape(shape))


def read_state(reader, cfg: ModelConfig, arch: str, where: str, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The prunus state dict of a GGUF (llama's q/k rows back in rotate-half order, cast to ``dtype``)."""
    state, unknown = {}, []
    for t in reader.tensors:
        name = prunus_name(t.name)
        if name is None:
            unknown.append(t.name)
            continue
        w = _tensor(t, where)
        heads = rotary_heads(name, cfg.n_heads, cfg.n_kv_heads) if arch in PERMUTED else None
        if heads is not None:
            w = from_gguf_rows(w, heads)
        state[name] = w.to(dtype)
    if unknown:
        raise PrunusError(f"{where}: tensor(s) {', '.join(unknown[:3])} are not part of a Llama / Qwen2 / Qwen3 model; "
                          "this GGUF uses a feature prunus does not convert")
    return state


def _build(cfg: ModelConfig, state: dict, where: str) -> Transformer:
    with torch.device("meta"):
        model = Transformer(cfg)
    try:
        missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    except RuntimeError as e:  # a shape that disagrees with the metadata
        raise PrunusError(f"{where}: tensors do not match the metadata ({str(e).splitlines()[-1].strip()})") from None
    missing = [k for k in missing if not (cfg.tie_embeddings and k == "output.weight")]
    if missing or unexpected:
        raise PrunusError(f"{where}: tensors do not match a Llama with this metadata (missing {missing[:3]}); "
                          "the file is incomplete")
    if cfg.tie_embeddings:
        model.output.weight = model.tok_embeddings.weight
    model.init_buffers(device=torch.device("cpu"))
    return model.eval()


def from_gguf(path: str | Path, out: str | Path, *, dtype: str = "float32", overwrite: bool = False) -> Path:
    """Convert the GGUF file ``path`` into a prunus model dir at ``out`` (weights in ``dtype``)."""
    path, out = Path(path), Path(out)
    if dtype not in DTYPES:
        raise PrunusError(f"convert: dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    check_output(out, [("--from-gguf", path)])  # prunus.artifacts.paths: never over an input
    reader = open_gguf(path)
    where = str(path)
    meta = read_metadata(reader)
    tensors = {t.name: t for t in reader.tensors}
    cfg = config_from_gguf(meta, tensors, where, dtype)
    state = read_state(reader, cfg, meta["general.architecture"], where, DTYPES[dtype])
    model = _build(cfg, state, where)
    types = sorted({t.tensor_type.name for t in reader.tensors})
    with tempfile.TemporaryDirectory() as tmp:
        hf = write_tokenizer_files(meta, Path(tmp), where, cfg.vocab_size, cfg.max_seq_len)
        tokenizer = HFTokenizer(tmp) if hf else ByteTokenizer()
        return save_model(model, out, tokenizer=tokenizer, stage="convert", overwrite=overwrite,
                          metrics={"gguf_source": str(path.resolve()), "gguf_tensor_types": types})
