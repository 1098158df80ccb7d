"""Tokenizers in GGUF metadata (``tokenizer.ggml.*``) to and from Hugging Face ``tokenizer.json``.

A GGUF carries no ``tokenizer.json``: llama.cpp stores the token list, the token types,
the merges (or SentencePiece scores), the special token ids, a named pre-tokenizer
(``tokenizer.ggml.pre``) and the chat template as metadata. Two tokenizer models are
understood, both ways:

* ``gpt2``: byte-level BPE with merges. ``tokenizer.ggml.pre`` names how llama.cpp
  splits text before the merges; each name maps to the Hugging Face pre-tokenizer that
  splits the same way (llama.cpp's ``llama-vocab.cpp`` regexes). A name prunus does
  not know is refused rather than tokenized differently from llama.cpp.
* ``llama``: SentencePiece BPE with byte fallback. GGUF stores a score per token, Hugging
  Face a ranked merge list; merges are derived from the scores (as transformers does,
  highest score first) and scores from the merge ranks on the way out.

prunus's byte tokenizer (bytes 0..255, end-of-text 256) is written as a ``gpt2`` vocabulary
of the 256 byte symbols with one merge that never applies (``BYTE_VOCAB_MERGE``: llama.cpp
refuses a ``gpt2`` vocabulary without a merge list, and the ``gguf`` package drops an empty
one), which llama.cpp runs as is, and read back as the byte tokenizer. The ``tokenizers`` library builds ``tokenizer.json``; transformers is not needed.
"""

from __future__ import annotations

import json
from pathlib import Path

from prunus.artifacts.errors import PrunusError
from prunus.artifacts.validate import short

# llama.cpp token types (gguf.TokenType)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
EOT = "<|endoftext|>"

_BYTE_LEVEL = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
_BYTE_LEVEL_NO_REGEX = {**_BYTE_LEVEL, "use_regex": False}
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


def _split_then_bytes(regex: str) -> dict:
    split = {"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated", "invert": False}
    return {"type": "Sequence", "pretokenizers": [split, _BYTE_LEVEL_NO_REGEX]}


# The Hugging Face pre-tokenizer of each llama.cpp pre-tokenizer family, and the name written for it.
PRE_TOKENIZERS = {
    "gpt-2": _BYTE_LEVEL,
    "smollm": {"type": "Sequence", "pretokenizers": [{"type": "Digits", "individual_digits": True}, _BYTE_LEVEL]},
    "llama-bpe": _split_then_bytes(_LLAMA3_SPLIT),
    "qwen2": _split_then_bytes(_QWEN2_SPLIT),
}
# llama.cpp names that split text the same way as one of the above (llama-vocab.cpp)
PRE_ALIASES = {
    **{n: "gpt-2" for n in ("gpt-2", "mpt", "olmo", "jais")},
    **{n: "smollm" for n in ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone")},
    **{n: "llama-bpe" for n in ("llama-bpe", "llama3", "llama-v3", "falcon3", "smaug-bpe", "dbrx")},
    **{n: "qwen2" for n in ("qwen2", "deepseek-r1-qwen", "stablelm2")},
}
_SPM_DECODER = [{"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "}, {"type": "ByteFallback"},
                {"type": "Fuse"}]


# a merge of two symbols no text ever holds (a pair of byte symbols, which no other merge makes)
BYTE_VOCAB_MERGE = "\u0100\u0100 \u0100\u0100"


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map, the alphabet of byte-level BPE vocabularies."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def _shape(pre):
    """A pre-tokenizer's JSON without the fields that do not change token ids."""
    if isinstance(pre, dict):
        return {k: _shape(v) for k, v in pre.items() if k not in ("trim_offsets",)}
    if isinstance(pre, list):
        return [_shape(v) for v in pre]
    return pre


def pre_tokenizer_name(pre: dict | None, where: str) -> str:
    """The llama.cpp pre-tokenizer name for a byte-level tokenizer.json's ``pre_tokenizer``: the family its
    split regexes and steps identify (llama.cpp's converter names the same families by hashing the token ids
    of a check text). One that matches none is refused: there is no safe default name."""
    for name, known in PRE_TOKENIZERS.items():
        if _shape(pre) == _shape(known):
            return name
    raise PrunusError(f"{where}: its byte-level pre-tokenizer is none llama.cpp knows by name, and a guessed name "
                      "would split text differently; supported: GPT-2 byte-level (gpt-2), digits + byte-level (smollm), "
                      "the Llama 3 (llama-bpe) and Qwen2 (qwen2) split regexes; convert it with llama.cpp's "
                      "convert_hf_to_gguf.py instead")


# --------------------------------------------------------------------------- GGUF -> tokenizer.json


MAX_TOKEN_CHARS = 1024  # no vocabulary has longer tokens; merges derived from scores cost its square per token
SPECIAL_IDS = ("bos_token_id", "eos_token_id", "unknown_token_id", "padding_token_id")
# tokenizer metadata key -> (what each value must be, whether the value is a list of them)
_SCHEMA = {"tokenizer.ggml.model": ("str", False), "tokenizer.ggml.pre": ("str", False),
           "tokenizer.ggml.tokens": ("str", True), "tokenizer.ggml.token_type": ("int", True),
           "tokenizer.ggml.scores": ("number", True), "tokenizer.ggml.merges": ("str", True),
           "tokenizer.ggml.add_bos_token": ("bool", False), "tokenizer.ggml.add_eos_token": ("bool", False),
           "tokenizer.ggml.add_space_prefix": ("bool", False), "tokenizer.chat_template": ("str", False),
           **{f"tokenizer.ggml.{key}": ("int", False) for key in SPECIAL_IDS}}
_WORDS = {"str": "text", "int": "an integer", "bool": "true or false", "number": "a number"}


def _fits(value, kind: str) -> bool:
    if kind == "bool" or isinstance(value, bool):
        return kind == "bool" and isinstance(value, bool)
    return isinstance(value, {"str": str, "int": int, "number": (int, float)}[kind])


def check_tokenizer_metadata(meta: dict, where: str) -> None:
    """Every ``tokenizer.*`` value prunus reads, of its type, tokens of a sane length, special token ids
    inside the vocabulary: one line naming the file and the key otherwise."""
    for key, (kind, is_list) in _SCHEMA.items():
        value = meta.get(key)
        if value is None:
            continue
        if not (isinstance(value, list) and all(_fits(v, kind) for v in value) if is_list else _fits(value, kind)):
            raise PrunusError(f"{where}: metadata {key}={short(value)} must be {'a list of ' if is_list else ''}"
                              f"{_WORDS[kind]}; re-convert the file")
    tokens = meta.get("tokenizer.ggml.tokens") or []
    for key in ("tokenizer.ggml.token_type", "tokenizer.ggml.scores"):
        if key in meta and len(meta[key]) != len(tokens):
            raise PrunusError(f"{where}: metadata {key} has {len(meta[key])} items for {len(tokens)} tokens; "
                              "re-convert the file")
    for i, t in enumerate(tokens):
        if len(t) > MAX_TOKEN_CHARS:
            raise PrunusError(f"{where}: metadata tokenizer.ggml.tokens item {i} is {len(t):,} characters long, above "
                              f"the {MAX_TOKEN_CHARS} a token may have; re-convert the file")
    for key in SPECIAL_IDS:
        i = meta.get(f"tokenizer.ggml.{key}")
        if i is not None and not 0 <= i < len(tokens):
            raise PrunusError(f"{where}: metadata tokenizer.ggml.{key}={i} is not a token id of its {len(tokens)}-token "
                              "vocabulary; re-convert the file")


def _merge_pairs(merges: list[str], vocab: dict[str, int], where: str) -> list[tuple[str, str]]:
    """The merges as pairs, each joining two tokens of ``vocab`` into a third (the tokenizers library aborts
    on any other)."""
    pairs = []
    for i, m in enumerate(merges):
        pair = m.split(" ", 1)
        if len(pair) != 2 or pair[0] not in vocab or pair[1] not in vocab or pair[0] + pair[1] not in vocab:
            raise PrunusError(f"{where}: metadata tokenizer.ggml.merges item {i} ({short(m)}) does not join two tokens "
                              "of the vocabulary into a third; re-convert the file")
        pairs.append((pair[0], pair[1]))
    return pairs


def _special_names(meta: dict, tokens: list[str]) -> dict[str, str | None]:
    names = {}
    for name, key in (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"),
                      ("unk_token", "unknown_token_id"), ("pad_token", "padding_token_id")):
        i = meta.get(f"tokenizer.ggml.{key}")
        names[name] = tokens[i] if i is not None and 0 <= i < len(tokens) else None
    return names


def is_byte_vocab(meta: dict) -> bool:
    """True for the vocabulary :func:`byte_tokenizer_metadata` writes (prunus's byte tokenizer; files written
    before the placeholder merge have none)."""
    tokens = meta.get("tokenizer.ggml.tokens") or []
    b2u = bytes_to_unicode()
    merges = list(meta.get("tokenizer.ggml.merges") or [])
    return (meta.get("tokenizer.ggml.model") == "gpt2" and merges in ([], [BYTE_VOCAB_MERGE])
            and len(tokens) >= 257 and tokens[:256] == [b2u[b] for b in range(256)] and tokens[256] == EOT
            and meta.get("tokenizer.ggml.eos_token_id") == 256
            and all(t == f"[PAD{i}]" for i, t in enumerate(tokens[257:], start=257)))


def _byte_level_model(meta: dict, tokens: list[str], types: list[int], where: str):
    from tokenizers import Tokenizer, decoders, models

    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre not in PRE_ALIASES:
        raise PrunusError(f"{where}: tokenizer.ggml.pre={pre!r} is a pre-tokenizer prunus does not know; "
                          f"supported: {', '.join(sorted(PRE_ALIASES))}")
    b2u = bytes_to_unicode()
    alphabet = set(b2u.values())
    vocab = {}
    for i, t in enumerate(tokens):  # a normal token outside the byte alphabet is spelled in it (as transformers does)
        if types[i] == NORMAL and not set(t) <= alphabet:
            t = "".join(b2u[b] for b in t.encode("utf-8"))
        vocab.setdefault(t, i)
    merges = _merge_pairs(meta.get("tokenizer.ggml.merges") or [], vocab, where)
    tok = Tokenizer(models.BPE(vocab, merges, dropout=None, fuse_unk=False, byte_fallback=False))
    tok.decoder = decoders.ByteLevel()
    return tok, PRE_ALIASES[pre]


def generate_merges(vocab: dict[str, int], scores: dict[str, float]) -> list[tuple[str, str]]:
    """SentencePiece merges from token scores: every split of a token into two tokens, best score first."""
    merges = []
    for token, score in scores.items():
        local = [(token[:k], token[k:], score) for k in range(1, len(token)) if token[:k] in vocab and token[k:] in vocab]
        merges.extend(sorted(local, key=lambda m: (vocab[m[0]], vocab[m[1]])))
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(a, b) for a, b, _ in merges]


def _sentencepiece_model(meta: dict, tokens: list[str], types: list[int], where: str):
    from tokenizers import Tokenizer, models

    scores = meta.get("tokenizer.ggml.scores")
    if scores is None or len(scores) < len(tokens):
        raise PrunusError(f"{where}: a SentencePiece ('llama') vocabulary without tokenizer.ggml.scores; re-convert it")
    vocab = {}
    for i, t in enumerate(tokens):
        vocab.setdefault(t, i)
    ranked = {t: scores[i] for i, t in enumerate(tokens)}  # every token, as transformers' GGUF reader does
    unk = _special_names(meta, tokens)["unk_token"]
    tok = Tokenizer(models.BPE(vocab, generate_merges(vocab, ranked), unk_token=unk, fuse_unk=True, byte_fallback=True))
    return tok, None


def _with_json_parts(tok, pre: str | None, meta: dict):
    """``tok`` with the pre-tokenizer and decoder written into its JSON (what tokenizer.json holds)."""
    from tokenizers import Tokenizer

    data = json.loads(tok.to_str())
    if pre is not None:
        data["pre_tokenizer"] = PRE_TOKENIZERS[pre]
    else:  # SentencePiece: a "▁" for every space, one before the text unless the file says not to
        prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
        data["pre_tokenizer"] = {"type": "Metaspace", "replacement": "\u2581",
                                 "prepend_scheme": "first" if prefix else "never", "split": False}
        strip = [{"type": "Strip", "content": " ", "start": 1, "stop": 0}] if prefix else []
        data["decoder"] = {"type": "Sequence", "decoders": _SPM_DECODER + strip}
    return Tokenizer.from_str(json.dumps(data))


def write_tokenizer_files(meta: dict, directory: Path, where: str, n_vocab: int, max_len: int | None = None) -> bool:
    """Write tokenizer.json + tokenizer_config.json for the GGUF tokenizer metadata ``meta``
    into ``directory``. Returns False (writing nothing) for prunus's byte tokenizer."""
    kind = meta.get("tokenizer.ggml.model")
    if kind is None:
        raise PrunusError(f"{where}: no tokenizer.ggml.model in its metadata; give a GGUF that carries its tokenizer")
    check_tokenizer_metadata(meta, where)
    if is_byte_vocab(meta):
        return False
    if kind not in ("gpt2", "llama"):
        raise PrunusError(f"{where}: tokenizer.ggml.model={short(kind)} is not supported; supported: gpt2 (byte-level "
                          "BPE), llama (SentencePiece BPE)")
    tokens = list(meta.get("tokenizer.ggml.tokens") or [])
    types = list(meta.get("tokenizer.ggml.token_type") or [NORMAL] * len(tokens))
    if not tokens or len(types) != len(tokens):
        raise PrunusError(f"{where}: tokenizer.ggml.tokens / token_type are missing or of different lengths")
    if len(tokens) > n_vocab:
        raise PrunusError(f"{where}: {len(tokens)} tokens but the embedding has {n_vocab} rows; the file is inconsistent")
    config = _tokenizer_config(meta, tokens, kind, max_len)
    try:
        _hf_tokenizer(meta, kind, tokens, types, config, where).save(str(directory / "tokenizer.json"))
    except PrunusError:
        raise
    except Exception as e:  # the tokenizers library raises plain Exceptions on a vocabulary it cannot build
        raise PrunusError(f"{where}: its tokenizer.ggml.* metadata does not form a tokenizer "
                          f"({(str(e).splitlines() or [''])[0][:120]}); re-convert the file") from None
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    return True


def _hf_tokenizer(meta: dict, kind: str, tokens: list[str], types: list[int], config: dict, where: str):
    """The ``tokenizers.Tokenizer`` of a checked ``gpt2`` or ``llama`` vocabulary."""
    from tokenizers import AddedToken, processors

    if kind == "gpt2":
        tok, pre = _byte_level_model(meta, tokens, types, where)
    else:
        tok, pre = _sentencepiece_model(meta, tokens, types, where)
    tok = _with_json_parts(tok, pre, meta)
    # control tokens (<|im_start|>) are matched whole and are special; user-defined ones are matched whole too
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t, k in zip(tokens, types) if k == CONTROL])
    tok.add_tokens([AddedToken(t, normalized=False, special=False) for t, k in zip(tokens, types) if k == USER_DEFINED])
    if config.get("add_bos_token") and config.get("bos_token"):
        bos = config["bos_token"]
        bos_id = meta["tokenizer.ggml.bos_token_id"]
        tok.post_processor = processors.TemplateProcessing(single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 {bos}:1 $B:1",
                                                           special_tokens=[(bos, bos_id)])
    return tok


def _tokenizer_config(meta: dict, tokens: list[str], kind: str, max_len: int | None) -> dict:
    config = {"tokenizer_class": "PreTrainedTokenizerFast", **_special_names(meta, tokens),
              # llama.cpp adds a BOS to SentencePiece vocabularies unless told otherwise
              "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", kind == "llama")),
              "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False)),
              "clean_up_tokenization_spaces": False}
    if max_len:
        config["model_max_length"] = max_len
    template = meta.get("tokenizer.chat_template")
    if template:
        config["chat_template"] = template
    return {k: v for k, v in config.items() if v is not None}


# --------------------------------------------------------------------------- tokenizer.json -> GGUF


def byte_tokenizer_metadata(vocab_size: int) -> dict:
    """prunus's byte tokenizer as a GGUF vocabulary: the 256 byte symbols, end-of-text, unused padding."""
    b2u = bytes_to_unicode()
    tokens = [b2u[b] for b in range(256)] + [EOT] + [f"[PAD{i}]" for i in range(257, vocab_size)]
    types = [NORMAL] * 256 + [CONTROL] + [UNUSED] * (vocab_size - 257)
    return {"model": "gpt2", "pre": "gpt-2", "tokens": tokens, "types": types, "merges": [BYTE_VOCAB_MERGE],
            "special": {"eos": 256}, "add_bos": False, "add_eos": False, "add_space_prefix": False}


def _token_id(name, vocab: dict[str, int]) -> int | None:
    name = name.get("content") if isinstance(name, dict) else name
    return vocab.get(name) if name else None


def _chat_template(directory: Path, config: dict):
    if config.get("chat_template"):
        return config["chat_template"]
    jinja = directory / "chat_template.jinja"
    return jinja.read_text() if jinja.is_file() else None


def _merge_strings(merges: list) -> list[str]:
    return [m if isinstance(m, str) else " ".join(m) for m in merges]


def _sentencepiece_scores(tokens: list[str], merges: list[str]) -> list[float]:
    """A score per token from the merge that makes it: earlier merges score higher, as SentencePiece's do."""
    rank = {}
    for r, m in enumerate(merges):
        rank.setdefault(m.replace(" ", "", 1), r)
    return [-float(rank[t]) if t in rank else (0.0 if len(t) == 1 else -1e9) for t in tokens]


def hf_tokenizer_metadata(directory: Path, vocab_size: int) -> dict:
    """GGUF tokenizer metadata for the Hugging Face ``tokenizer.json`` (+ tokenizer_config.json) in ``directory``."""
    where = str(directory / "tokenizer.json")
    data = json.loads((directory / "tokenizer.json").read_text())
    config_path = directory / "tokenizer_config.json"
    config = json.loads(config_path.read_text()) if config_path.is_file() else {}
    model = data.get("model") or {}
    if model.get("type") != "BPE":
        raise PrunusError(f"{where}: a {model.get('type')} tokenizer has no GGUF form prunus writes; "
                          "supported: byte-level BPE and SentencePiece-style BPE with byte fallback")
    vocab = dict(model.get("vocab") or {})
    added = data.get("added_tokens") or []
    vocab.update({t["content"]: t["id"] for t in added})
    n = max(vocab.values(), default=-1) + 1
    if n > vocab_size:
        raise PrunusError(f"{where}: token ids go up to {n - 1} but the model's vocabulary has {vocab_size} rows; "
                          "the tokenizer does not belong to this model")
    tokens, types = [f"[PAD{i}]" for i in range(vocab_size)], [UNUSED] * vocab_size
    for t, i in vocab.items():
        tokens[i], types[i] = t, NORMAL
    for t in added:
        types[t["id"]] = CONTROL if t.get("special") else USER_DEFINED
    merges = _merge_strings(model.get("merges") or [])
    byte_level = "ByteLevel" in json.dumps(data.get("pre_tokenizer")) or (data.get("decoder") or {}).get("type") == "ByteLevel"
    meta = {"tokens": tokens, "types": types, "merges": merges,
            "special": {k: _token_id(config.get(f"{k}_token"), vocab) for k in ("bos", "eos", "unk", "pad")},
            "add_bos": _adds_bos(data, config), "add_eos": bool(config.get("add_eos_token", False)),
            "chat_template": _chat_template(directory, config)}
    if byte_level:
        return {**meta, "model": "gpt2", "pre": pre_tokenizer_name(data.get("pre_tokenizer"), where),
                "add_space_prefix": False}
    if not model.get("byte_fallback"):
        raise PrunusError(f"{where}: a BPE tokenizer that is neither byte-level nor SentencePiece-style (byte fallback); "
                          "llama.cpp has no equivalent")
    for i, t in enumerate(tokens):
        if len(t) == 6 and t.startswith("<0x") and t.endswith(">"):
            types[i] = BYTE
    if meta["special"]["unk"] is not None:
        types[meta["special"]["unk"]] = UNKNOWN
    pre = data.get("pre_tokenizer") or {}
    prefix = pre.get("prepend_scheme", "always") != "never" if pre.get("type") == "Metaspace" else \
        "Prepend" in json.dumps(data.get("normalizer"))
    return {**meta, "model": "llama", "pre": "default", "scores": _sentencepiece_scores(tokens, merges),
            "merges": None, "add_space_prefix": prefix}


def _adds_bos(data: dict, config: dict) -> bool:
    if "add_bos_token" in config:
        return bool(config["add_bos_token"])
    post = data.get("post_processor") or {}
    single = post.get("single") or []
    return bool(single) and "SpecialToken" in single[0]


def add_tokenizer(writer, meta: dict) -> None:
    """Write the tokenizer metadata ``meta`` (from the two functions above) with a ``gguf.GGUFWriter``."""
    writer.add_tokenizer_model(meta["model"])
    writer.add_tokenizer_pre(meta["pre"])
    writer.add_token_list(meta["tokens"])
    if meta.get("scores") is not None:
        writer.add_token_scores(meta["scores"])
    writer.add_token_types(meta["types"])
    if meta.get("merges") is not None:
        writer.add_token_merges(meta["merges"])
    special = meta["special"]
    for key, add in (("bos", writer.add_bos_token_id), ("eos", writer.add_eos_token_id),
                     ("unk", writer.add_unk_token_id), ("pad", writer.add_pad_token_id)):
        if special.get(key) is not None:
            add(special[key])
    writer.add_add_bos_token(meta["add_bos"])
    writer.add_add_eos_token(meta["add_eos"])
    if meta.get("add_space_prefix") is not None:
        writer.add_add_space_prefix(meta["add_space_prefix"])
    if meta.get("chat_template"):
        writer.add_chat_template(meta["chat_template"])
