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

A GGUF is input from outside, so it is checked in order before anything is allocated:
the header (:mod:`prunus.artifacts.gguf_header`: every count, length and offset bounded by
the file's size, strings UTF-8, tensors inside the file and apart), then the metadata
(typed, in range), then every tensor's name, type and shape against the model the metadata
describes (:func:`check_tensors`: a block count or width the tensors do not hold is never
built), then the tokenizer metadata; weights are read last and must be finite.
"""

from __future__ import annotations

import math
import re
import tempfile
from pathlib import Path

import numpy as np
import torch

from .config import MAX_SEQ_LEN, ModelConfig
from prunus.artifacts.errors import PrunusError
from prunus.artifacts.gguf_header import MAX_TENSORS, GGUFTensor, read_gguf_header
from prunus.artifacts.validate import check_int_range, short
from .gguf_layout import ARCHITECTURES, PERMUTED, from_gguf_rows, gguf_name, prunus_name, rotary_heads
from .gguf_tokenizer import write_tokenizer_files
from .llama import Transformer
from .gguf_general import gguf_general_of
from .model_dir import save_model
from prunus.artifacts.paths import check_output
from .tokenizer import ByteTokenizer, HFTokenizer

READ_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
MIN_ROPE_BYTES = 256 << 20  # rotary tables any file may ask for (131072 positions of heads of 256)
MAX_WIDTH = 1 << 31  # a model dimension or head count read from metadata; the tensors must then hold it
_REQUIRED = object()


def _int(meta: dict, key: str, where: str, default=_REQUIRED, hi: int = MAX_WIDTH) -> int | None:
    """The integer metadata ``key`` (1 to ``hi``), ``default`` when absent, or one line naming the file and key."""
    if key not in meta:
        if default is _REQUIRED:
            raise PrunusError(f"{where}: missing metadata {key}; not a complete model GGUF")
        return default
    check_int_range(meta[key], f"metadata {key}", 1, hi, where)
    return meta[key]


def _float(meta: dict, key: str, where: str, default: float) -> float:
    """The positive, finite number metadata ``key`` as its float32 value, ``default`` when absent."""
    value = meta.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise PrunusError(f"{where}: metadata {key}={short(value)} must be a positive finite number")
    return _f32(value)


def _refuse_unsupported(meta: dict, tensor_names: set[str], where: str) -> str:
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise PrunusError(f"{where}: general.architecture={short(arch)} is not supported; supported: {', '.join(ARCHITECTURES)} "
                          "(Llama, SmolLM, Mistral 7B and others llama.cpp writes as 'llama'; Qwen2 / 2.5; Qwen3)")
    a = arch
    bad = []
    if meta.get(f"{a}.expert_count"):
        bad.append(f"{a}.expert_count={short(meta[f'{a}.expert_count'])} (mixture of experts)")
    scaling = meta.get(f"{a}.rope.scaling.type")
    if scaling not in (None, "none", "linear"):
        bad.append(f"rope scaling {short(scaling)}")
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
    linear_key, factor_key = f"{arch}.rope.scale_linear", f"{arch}.rope.scaling.factor"
    linear = _float(meta, linear_key, where, 1.0) if linear_key in meta else None
    if meta.get(f"{arch}.rope.scaling.type") == "linear" or linear not in (None, 1.0):
        key = factor_key if factor_key in meta else linear_key
        if key not in meta:
            raise PrunusError(f"{where}: linear rope scaling without metadata {factor_key}; re-convert it")
        fields["rope_type"], fields["rope_factor"] = "linear", _float(meta, key, where, 1.0)
    return fields


def _f32(value) -> float:
    """A float32 metadata value as the shortest decimal that is the same float32 (1e-05, not 9.99999974e-06),
    so a float64 config value written as float32 reads back as itself; the float32 arithmetic is unchanged."""
    return float(str(np.float32(value)))


def _head_dim(meta: dict, a: str, dim: int, n_heads: int, where: str) -> int | None:
    """key_length (or dim / head_count), checked against value_length and the rotary dimension count."""
    head_dim = _int(meta, f"{a}.attention.key_length", where, default=dim // n_heads if dim % n_heads == 0 else None)
    for key in (f"{a}.attention.value_length", f"{a}.rope.dimension_count"):
        value = _int(meta, key, where, default=None)
        if value is not None and value != head_dim:
            raise PrunusError(f"{where}: metadata {key}={value} differs from the head size {head_dim}; prunus needs "
                              "them equal (whole heads rotated, values as wide as keys)")
    return head_dim


def config_from_gguf(meta: dict, tensors: dict[str, GGUFTensor], where: str, dtype: str) -> ModelConfig:
    """The ModelConfig the ``<arch>.*`` metadata and the tensor shapes describe, every value checked."""
    a = _refuse_unsupported(meta, set(tensors), where)
    embd = tensors.get("token_embd.weight")
    if embd is None:
        raise PrunusError(f"{where}: no token_embd.weight tensor; not a complete model GGUF")
    if len(embd.shape) != 2:
        raise PrunusError(f"{where}: token_embd.weight has shape {list(embd.shape)}; an embedding has 2 dimensions")
    vocab_size = embd.shape[1]  # GGUF shapes are (columns, rows)
    if meta.get(f"{a}.vocab_size") not in (None, vocab_size):
        raise PrunusError(f"{where}: metadata {a}.vocab_size={short(meta[f'{a}.vocab_size'])} but token_embd.weight "
                          f"has {vocab_size} rows; the file is inconsistent")
    dim, n_heads = _int(meta, f"{a}.embedding_length", where), _int(meta, f"{a}.attention.head_count", where)
    head_dim = _head_dim(meta, a, dim, n_heads, where)
    fields = dict(
        dim=dim, n_layers=_int(meta, f"{a}.block_count", where, hi=MAX_TENSORS), n_heads=n_heads,
        n_kv_heads=_int(meta, f"{a}.attention.head_count_kv", where, default=n_heads),
        ffn_dim=_int(meta, f"{a}.feed_forward_length", where), vocab_size=vocab_size,
        max_seq_len=_int(meta, f"{a}.context_length", where, default=2048, hi=MAX_SEQ_LEN),
        rope_theta=_float(meta, f"{a}.rope.freq_base", where, 10000.0),
        norm_eps=_float(meta, f"{a}.attention.layer_norm_rms_epsilon", where, 1e-5),
        tie_embeddings="output.weight" not in tensors, dtype=dtype,
        head_dim=None if head_dim == dim // n_heads else head_dim,
        **_variant_fields(meta, a, set(tensors), where))
    try:
        cfg = ModelConfig(**fields)
    except PrunusError as e:
        raise PrunusError(f"{where}: {str(e).removeprefix('model config: ')}; the metadata is inconsistent") from None
    _check_rope_tables(cfg, a, sum(t.n_bytes for t in tensors.values()), where)
    return cfg


def _check_rope_tables(cfg: ModelConfig, a: str, data_bytes: int, where: str) -> None:
    """The rotary tables (cos and sin, context x head size, float32) are built from two metadata numbers, so
    they are bounded like the weights are: by the bytes the file holds (with a floor for small files)."""
    need, allowed = 8 * cfg.max_seq_len * cfg.head_dim, max(data_bytes, MIN_ROPE_BYTES)
    if need > allowed:
        raise PrunusError(f"{where}: metadata {a}.context_length={cfg.max_seq_len} with heads of {cfg.head_dim} needs "
                          f"{need >> 20:,} MiB of rotary tables, above the {allowed >> 20:,} MiB a file of this size "
                          "may ask for; the metadata is inconsistent")


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """{prunus state-dict key: shape} of the model ``cfg`` describes, from one layer built on the meta device
    (so a block count the file cannot hold is never built)."""
    with torch.device("meta"):
        one = Transformer(cfg.replace(n_layers=1))
    shapes = {}
    for key, value in one.state_dict().items():
        if key.startswith("layers.0."):
            shapes.update({f"layers.{i}.{key[len('layers.0.'):]}": tuple(value.shape) for i in range(cfg.n_layers)})
        elif not (cfg.tie_embeddings and key == "output.weight"):
            shapes[key] = tuple(value.shape)
    return shapes


def check_tensors(cfg: ModelConfig, tensors: dict[str, GGUFTensor], arch: str, where: str) -> dict[str, str]:
    """Every tensor of the file against the model the metadata describes, before any tensor is read:
    names, types and shapes. Returns {GGUF name: prunus key}."""
    unknown = [name for name in tensors if prunus_name(name) is None]
    if unknown:
        raise PrunusError(f"{where}: tensor(s) {', '.join(short(n) for n in unknown[:3])} are not part of a Llama / "
                          "Qwen2 / Qwen3 model; this GGUF uses a feature prunus does not convert")
    layers = 1 + max((int(m[1]) for n in tensors if (m := re.match(r"blk\.(\d+)\.", n))), default=-1)
    if cfg.n_layers != layers:
        raise PrunusError(f"{where}: metadata {arch}.block_count={cfg.n_layers} but the file holds tensors of "
                          f"{layers} layer(s); the file is inconsistent")
    expected = expected_shapes(cfg)
    names = {name: prunus_name(name) for name in tensors}
    missing = [gguf_name(k) for k in expected if k not in names.values()]
    if missing:
        raise PrunusError(f"{where}: tensor(s) {', '.join(missing[:3])} missing for the model its metadata "
                          "describes; the file is incomplete")
    for name, t in tensors.items():
        if t.type_name not in READ_TYPES:
            raise PrunusError(f"{where}: tensor {short(name)} is of type {t.type_name}, which prunus does not read; "
                              f"supported: {', '.join(READ_TYPES)}")
        want = expected.get(names[name])
        if want is None or t.rows_shape != want:
            raise PrunusError(f"{where}: tensor {short(name)} has shape {list(t.rows_shape)} but the metadata gives "
                              f"{list(want) if want else 'no such tensor'}; the file is inconsistent")
    return names


def _tensor(t: GGUFTensor, raw: np.ndarray, where: str) -> torch.Tensor:
    """One GGUF tensor (its bytes ``raw``) as a float32 torch tensor in prunus's (rows, columns) order."""
    import gguf
    from gguf.quants import dequantize

    rows = math.prod(t.shape[1:])
    with np.errstate(all="ignore"):
        data = np.asarray(dequantize(raw.reshape(rows, -1), gguf.GGMLQuantizationType[t.type_name]), dtype=np.float32)
        finite = bool(np.isfinite(data).all())
    if not finite:
        raise PrunusError(f"{where}: tensor {short(t.name)} holds NaN or infinite values; the file is damaged, "
                          "re-download or re-convert it")
    return torch.from_numpy(np.array(data.reshape(t.rows_shape), dtype=np.float32))


def read_state(path: Path, tensors: dict[str, GGUFTensor], names: dict[str, str], cfg: ModelConfig, arch: str,
               where: str, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The prunus state dict of a checked GGUF (llama's q/k rows back in rotate-half order, cast to ``dtype``)."""
    data = np.memmap(path, dtype=np.uint8, mode="r")
    state = {}
    for name, t in tensors.items():
        w = _tensor(t, data[t.offset:t.offset + t.n_bytes], where)
        key = names[name]
        heads = rotary_heads(key, cfg.n_heads, cfg.n_kv_heads) if arch in PERMUTED else None
        if heads is not None:
            w = from_gguf_rows(w, heads)
        state[key] = w.to(dtype)
    return state


def _build(cfg: ModelConfig, state: dict) -> Transformer:
    """The model of ``cfg`` holding ``state`` (names and shapes already checked by :func:`check_tensors`)."""
    with torch.device("meta"):
        model = Transformer(cfg)
    model.load_state_dict(state, strict=not cfg.tie_embeddings, assign=True)
    if cfg.tie_embeddings:
        model.output.weight = model.tok_embeddings.weight
    model.init_buffers(device=torch.device("cpu"))
    return model.eval()


def _tokenizer(meta: dict, tmp: Path, where: str, cfg: ModelConfig):
    hf = write_tokenizer_files(meta, tmp, where, cfg.vocab_size, cfg.max_seq_len)
    if not hf:
        return ByteTokenizer()
    try:
        return HFTokenizer(tmp)
    except PrunusError as e:
        raise PrunusError(f"{where}: its tokenizer.* metadata does not form a tokenizer "
                          f"({str(e).removeprefix(str(tmp))[:160]}); re-convert it") from None


def from_gguf(path: str | Path, out: str | Path, *, dtype: str = "float32", overwrite: bool = False) -> Path:
    """Convert the GGUF file ``path`` into a prunus model dir at ``out`` (weights in ``dtype``). The header,
    the metadata, the tensor entries and the tokenizer are all checked before any weight is read."""
    path, out = Path(path), Path(out)
    if dtype not in DTYPES:
        raise PrunusError(f"convert: dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    check_output(out, [("--from-gguf", path)])  # prunus.artifacts.paths: never over an input
    header = read_gguf_header(path)  # prunus.artifacts.gguf_header: every count and offset bounded by the file
    where, meta, tensors = str(path), header.metadata, header.tensors
    cfg = config_from_gguf(meta, tensors, where, dtype)
    arch = meta["general.architecture"]
    names = check_tensors(cfg, tensors, arch, where)
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer = _tokenizer(meta, Path(tmp), where, cfg)
        model = _build(cfg, read_state(path, tensors, names, cfg, arch, where, DTYPES[dtype]))
        types = sorted({t.type_name for t in tensors.values()})
        return save_model(model, out, tokenizer=tokenizer, stage="convert", overwrite=overwrite,
                          metrics={"gguf_source": str(path.resolve()), "gguf_tensor_types": types,
                                   "gguf_general": gguf_general_of(meta)})
