"""Hugging Face interop: ``from_hf`` reads a transformers checkpoint dir (config.json +
safetensors, one file or sharded) into a prunus model dir, ``to_hf`` writes a prunus model dir
back out as one that transformers loads.

The families and what each sets are in ``models/hf_families.py`` (llama, qwen2, qwen3,
mistral, phi3, gemma2, mixtral, qwen3_moe); tensors are renamed, split or joined by
``models/hf_tensors.py`` and never cast, so a round trip is bit-exact; files are read and
written by ``models/hf_weights.py``. Anything a family's config asks for that prunus does
not compute is refused in one line rather than converted into a different model, and
nothing is half-written (``atomic_dir``). Transformers itself is not needed.

The Hugging Face config's token ids (bos / eos / pad / unk) and model_type are kept in the
prunus config.json (``"hf"``), so ``to_hf`` writes them back.
"""

from __future__ import annotations

from pathlib import Path

import torch

from prunus.artifacts.atomic import atomic_dir, atomic_write_json
from prunus.artifacts.contained import inside
from prunus.artifacts.errors import PrunusError
from .hf_config_check import check_fits_weights, check_hf_config
from .hf_families import FAMILIES, TOKEN_IDS, config_from_hf, config_to_hf, get_family, inexpressible
from .hf_tensors import state_from_hf, state_to_hf
from .hf_weights import read_headers, read_weights, shard_files, write_weights
from .llama import Transformer
from .compression_state import compression_state
from .model_dir import load_model, load_model_tokenizer, save_model, state_dict_for_save
from prunus.artifacts.paths import check_output
from prunus.artifacts.validate import read_dir_json, read_json_object
from .tokenizer import FIX_TOKENIZER, MAX_TOKENIZER_BYTES, TOKENIZER_FILE, ByteTokenizer, HFTokenizer

DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def _read_hf_config(hf_dir: Path) -> dict:
    hf = read_dir_json(hf_dir, "config.json",
                       no_dir="no such directory; give a Hugging Face checkpoint dir (config.json + *.safetensors)",
                       no_file="no config.json; give a Hugging Face checkpoint dir written by save_pretrained",
                       bad_json="re-download or re-save the checkpoint")
    check_hf_config(hf, str(hf_dir / "config.json"))  # types and sizes of every key prunus reads
    return hf


def _config(hf_dir: Path, hf: dict, dtype: str):
    """(family, ModelConfig) of config.json, or one line naming what it lacks or what prunus does not support."""
    where = hf_dir / "config.json"
    try:
        return config_from_hf(hf, dtype)
    except KeyError as e:
        raise PrunusError(f"{where}: missing {e.args[0]}; re-save the checkpoint with save_pretrained") from None
    except (TypeError, ValueError) as e:  # a null where a family needs a value: check_hf_config typed the rest
        raise PrunusError(f"{where}: a value prunus needs is null or of the wrong type ({e}); fix config.json or "
                          "re-save the checkpoint with save_pretrained") from None
    except PrunusError as e:
        raise PrunusError(f"{where}: {e}") from None


def _build(hf_dir: Path, hf: dict, hf_state: dict) -> Transformer:
    """The prunus Transformer holding the checkpoint's tensors (assigned, not copied)."""
    dtypes = {t.dtype for t in hf_state.values()}
    if len(dtypes) != 1 or not dtypes <= DTYPES.keys():
        raise PrunusError(f"{hf_dir}: weights are stored as {sorted(map(str, dtypes))}; "
                          "only one of float32, bfloat16 or float16 for all tensors is supported")
    fam, cfg = _config(hf_dir, hf, DTYPES[dtypes.pop()])
    try:
        state, unknown = state_from_hf(fam, cfg, hf_state)
    except PrunusError as e:
        raise PrunusError(f"{hf_dir}: {e}") from None
    with torch.device("meta"):
        model = Transformer(cfg)
    try:
        missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    except RuntimeError as e:  # shape mismatch
        raise PrunusError(f"{hf_dir}: weights do not match config.json ({str(e).splitlines()[-1].strip()})") from None
    missing = [k for k in missing if not (cfg.tie_embeddings and k == "output.weight")]
    if missing or unexpected or unknown:
        raise PrunusError(f"{hf_dir}: weights do not match a {fam.model_type} with this config.json (missing "
                          f"{missing[:3]}, unrecognised {(unexpected + unknown)[:3]}); give an unmodified "
                          f"{fam.architecture} checkpoint")
    if cfg.tie_embeddings:
        model.output.weight = model.tok_embeddings.weight
    model.init_buffers(device=torch.device("cpu"))
    model.hf_origin = {"model_type": fam.model_type, **{k: hf.get(k) for k in TOKEN_IDS}}
    return model.eval()


def from_hf(hf_dir: str | Path, out: str | Path, *, overwrite: bool = False) -> Path:
    """Convert a Hugging Face checkpoint dir of a supported family into a prunus model dir at ``out``."""
    hf_dir = Path(hf_dir)
    check_output(out, [("--from-hf", hf_dir)])  # prunus.artifacts.paths: never over an input
    hf = _read_hf_config(hf_dir)
    _, cfg = _config(hf_dir, hf, "float32")  # refuse an unsupported family or feature before reading any weights
    files = shard_files(hf_dir)  # each inside the dir (prunus.artifacts.contained)
    check_fits_weights(cfg, read_headers(files), str(hf_dir / "config.json"))  # before any module or tensor
    has_tokenizer = inside(hf_dir, TOKENIZER_FILE, fix=FIX_TOKENIZER, required=False) is not None
    tokenizer = HFTokenizer(hf_dir) if has_tokenizer else ByteTokenizer()
    model = _build(hf_dir, hf, read_weights(hf_dir, files))
    return save_model(model, out, tokenizer=tokenizer, stage="convert", overwrite=overwrite,
                      metrics={"hf_source": str(hf_dir.resolve()), "hf_model_type": model.hf_origin["model_type"]})


def _bos_id(model_dir: Path) -> int | None:
    """The id of tokenizer_config.json's bos_token in tokenizer.json, if both say so."""
    fix = "re-create the model dir"
    cfg, tok = (inside(model_dir, name, fix=fix, required=False) for name in ("tokenizer_config.json", TOKENIZER_FILE))
    if cfg is None or tok is None:
        return None
    bos = read_json_object(cfg, fix=fix).get("bos_token")
    bos = bos.get("content") if isinstance(bos, dict) else bos
    if not isinstance(bos, str):
        return None
    tok = read_json_object(tok, fix=fix, max_bytes=MAX_TOKENIZER_BYTES)
    added = tok.get("added_tokens") if isinstance(tok.get("added_tokens"), list) else []
    ids = {t["content"]: t.get("id") for t in added if isinstance(t, dict) and isinstance(t.get("content"), str)}
    vocab = tok.get("model").get("vocab") if isinstance(tok.get("model"), dict) else None
    found = ids.get(bos, vocab.get(bos) if isinstance(vocab, dict) else None)
    return found if isinstance(found, int) and not isinstance(found, bool) and found >= 0 else None


def pick_family(cfg, family: str | None, origin: dict | None, where: str):
    """The family to write: the one asked for, else the one converted from, else the first that expresses ``cfg``."""
    name = family or (origin or {}).get("model_type")
    if name is not None:
        fam = get_family(name, where=where)
        bad = inexpressible(fam, cfg)
        if bad:
            raise PrunusError(f"{where}: cannot be written as a Hugging Face {fam.model_type} ({', '.join(bad[:4])} "
                              f"has no {fam.model_type} equivalent); choose another family of {', '.join(FAMILIES)}")
        return fam
    for fam in FAMILIES.values():
        if not inexpressible(fam, cfg):
            return fam
    closest = FAMILIES["mixtral" if cfg.n_experts else "llama"]
    kind = "mixture-of-experts model" if cfg.n_experts else "model"
    raise PrunusError(f"{where}: no Hugging Face family expresses this {kind} ({', '.join(inexpressible(closest, cfg)[:4])} "
                      f"has no {closest.model_type} equivalent); supported: {', '.join(FAMILIES)}")


def _token_ids(model_dir: Path, tokenizer, origin: dict | None) -> dict:
    ids = {"bos_token_id": _bos_id(model_dir), "eos_token_id": tokenizer.eos_id}
    if origin:  # the converted checkpoint's own ids (a list of eos ids included)
        ids.update({k: origin[k] for k in TOKEN_IDS if origin.get(k) is not None})
    return ids


def to_hf(model_dir: str | Path, out: str | Path, *, overwrite: bool = False, family: str | None = None,
          max_shard_size: int | str | None = None) -> Path:
    """Write the prunus model dir ``model_dir`` as a Hugging Face checkpoint dir at ``out``.

    ``family``: the model_type to write (default: the one it was converted from, else the first
    family that expresses the model, llama for a plain one). ``max_shard_size`` (bytes, or "5GB"):
    write ``model-0000i-of-0000n.safetensors`` shards and their index instead of one file."""
    model_dir, out = Path(model_dir), Path(out)
    check_output(out, [("--to-hf", model_dir)])  # prunus.artifacts.paths: never over an input
    model = load_model(model_dir)  # verifies the manifest's hashes
    tokenizer = load_model_tokenizer(model_dir)
    cfg = model.config
    if compression_state(model).quantization:
        raise PrunusError(f"{model_dir}: holds quantized weights, which Hugging Face checkpoints do not describe; "
                          "convert the model dir from before quantization")
    origin = getattr(model, "hf_origin", None)
    fam = pick_family(cfg, family, origin, str(model_dir))
    state = state_to_hf(fam, state_dict_for_save(model))
    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    hf = {**config_to_hf(fam, cfg), "dtype": dtype, **_token_ids(model_dir, tokenizer, origin)}
    with atomic_dir(out, overwrite=overwrite) as tmp:
        atomic_write_json(tmp / "config.json", hf)
        write_weights(state, tmp, max_shard_size)
        if isinstance(tokenizer, HFTokenizer):
            tokenizer.save(tmp)
    return out
