"""Tiny GGUF files for the hostile-input tests: a valid one written by ``gguf.GGUFWriter``, raw headers
written byte by byte, and the byte positions of a valid file's fields, to corrupt them one at a time."""

from __future__ import annotations

import struct
from pathlib import Path

import gguf
import numpy as np

from prunus.models.gguf_tokenizer import byte_tokenizer_metadata

V = gguf.GGUFValueType
DIM, FFN, VOCAB, HEADS, KV_HEADS = 32, 64, 260, 2, 1
NAME = "prunus-tiny"
SCALAR_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}


def tiny_metadata(n_layers: int = 1) -> dict[str, tuple]:
    """{key: (value, type[, item type])} of a tiny Llama with prunus's byte tokenizer."""
    tok = byte_tokenizer_metadata(VOCAB)
    return {
        "general.name": (NAME, V.STRING),
        "llama.block_count": (n_layers, V.UINT32), "llama.context_length": (64, V.UINT32),
        "llama.embedding_length": (DIM, V.UINT32), "llama.feed_forward_length": (FFN, V.UINT32),
        "llama.attention.head_count": (HEADS, V.UINT32), "llama.attention.head_count_kv": (KV_HEADS, V.UINT32),
        "llama.rope.freq_base": (10000.0, V.FLOAT32), "llama.attention.layer_norm_rms_epsilon": (1e-5, V.FLOAT32),
        "tokenizer.ggml.model": (tok["model"], V.STRING), "tokenizer.ggml.pre": (tok["pre"], V.STRING),
        "tokenizer.ggml.tokens": (tok["tokens"], V.ARRAY, V.STRING),
        "tokenizer.ggml.token_type": (tok["types"], V.ARRAY, V.INT32),
        "tokenizer.ggml.merges": (tok["merges"], V.ARRAY, V.STRING),
        "tokenizer.ggml.eos_token_id": (256, V.UINT32),
        "tokenizer.ggml.add_bos_token": (False, V.BOOL), "tokenizer.ggml.add_eos_token": (False, V.BOOL),
    }


def tiny_tensors(n_layers: int = 1, seed: int = 0) -> dict[str, np.ndarray]:
    """Random float32 weights of the tiny Llama, in row-major (numpy) shapes."""
    rng = np.random.default_rng(seed)
    kv = KV_HEADS * DIM // HEADS
    shapes = {"token_embd.weight": (VOCAB, DIM), "output_norm.weight": (DIM,), "output.weight": (VOCAB, DIM)}
    for i in range(n_layers):
        shapes.update({f"blk.{i}.attn_norm.weight": (DIM,), f"blk.{i}.attn_q.weight": (DIM, DIM),
                       f"blk.{i}.attn_k.weight": (kv, DIM), f"blk.{i}.attn_v.weight": (kv, DIM),
                       f"blk.{i}.attn_output.weight": (DIM, DIM), f"blk.{i}.ffn_norm.weight": (DIM,),
                       f"blk.{i}.ffn_gate.weight": (FFN, DIM), f"blk.{i}.ffn_up.weight": (FFN, DIM),
                       f"blk.{i}.ffn_down.weight": (DIM, FFN)})
    return {name: (rng.standard_normal(s) * 0.1).astype(np.float32) for name, s in shapes.items()}


def write_tiny(path: str | Path, *, meta: dict | None = None, tensors: dict | None = None, n_layers: int = 1) -> Path:
    """A valid tiny Llama GGUF, with ``meta`` entries ({key: (value, type[, item type])}, None to leave a key
    out) and ``tensors`` ({name: array}, None to leave one out) replacing the valid ones or added."""
    path = Path(path)
    w = gguf.GGUFWriter(path, "llama")
    for key, entry in {**tiny_metadata(n_layers), **(meta or {})}.items():
        if entry is not None:
            w.add_key_value(key, entry[0], entry[1], entry[2] if len(entry) > 2 else None)
    for name, array in {**tiny_tensors(n_layers), **(tensors or {})}.items():
        if array is not None:
            w.add_tensor(name, array)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def gguf_string(text: str | bytes) -> bytes:
    raw = text.encode() if isinstance(text, str) else text
    return struct.pack("<Q", len(raw)) + raw


def raw_header(n_tensors: int, n_kv: int, body: bytes = b"", version: int = 3) -> bytes:
    """``GGUF``, a version and two counts as a file states them (true or not), then ``body``."""
    return b"GGUF" + struct.pack("<IQQ", version, n_tensors, n_kv) + body


def layout(data: bytes) -> dict:
    """Byte positions in a valid GGUF: {"counts": [tensor count, kv count], "kv": {key: (key length, value type,
    value, [array count])}, "tensors": {name: {"name_len", "n_dims", "dims", "type", "offset"}}}; every
    length and count field is listed so a test can overwrite it."""
    pos, out = 24, {"counts": [8, 16], "kv": {}, "tensors": {}, "lengths": []}
    n_tensors, n_kv = struct.unpack_from("<QQ", data, 8)

    def string(p):
        n = struct.unpack_from("<Q", data, p)[0]
        out["lengths"].append(p)
        return data[p + 8:p + 8 + n].decode(), p + 8 + n

    for _ in range(n_kv):
        key_pos = pos
        key, pos = string(pos)
        kind = struct.unpack_from("<I", data, pos)[0]
        entry = [key_pos, pos, pos + 4]
        pos += 4
        if kind == 8:
            _, pos = string(pos)
        elif kind == 9:
            item, n = struct.unpack_from("<IQ", data, pos)
            entry.append(pos + 4)
            out["lengths"].append(pos + 4)
            pos += 12
            for _ in range(n):
                pos = string(pos)[1] if item == 8 else pos + SCALAR_BYTES[item]
        else:
            pos += SCALAR_BYTES[kind]
        out["kv"][key] = tuple(entry)
    for _ in range(n_tensors):
        name_pos = pos
        name, pos = string(pos)
        n_dims = struct.unpack_from("<I", data, pos)[0]
        out["tensors"][name] = {"name_len": name_pos, "n_dims": pos, "dims": pos + 4,
                                "type": pos + 4 + 8 * n_dims, "offset": pos + 8 + 8 * n_dims}
        pos += 16 + 8 * n_dims
    out["end"] = pos
    return out


def patched(data: bytes, pos: int, fmt: str, value) -> bytes:
    """``data`` with ``value`` packed as ``fmt`` (little-endian) at ``pos``."""
    raw = struct.pack("<" + fmt, value)
    return data[:pos] + raw + data[pos + len(raw):]
