"""A model dir served on a CPU by the fastest runtime: prunus's native kernels reading the model dir itself
(:mod:`prunus.runtime.native_backend`, no export), or, where they do not serve it (``--no-native``, ``--prompt-graph``,
a CPU or weights the kernels do not take, :mod:`prunus.runtime.native_choice`), its genai export in ONNX Runtime,
prepared once and cached.

``prunus serve MODEL_DIR`` on a CPU does not decode through the torch Engine by default: the genai export decodes
faster in ONNX Runtime, and faster again in the native kernels (docs/defaults.md, docs/results.md). So where the
native kernels do not serve the dir, the first time it is served :func:`prepare` exports it (``prunus export --graph
genai``, at the dir's own precision, with the
export's parity check against PyTorch: a graph that fails it is not served) into a cache dir, and every later
serve of the same dir loads the cached export at once.

The cache is ``$PRUNUS_CACHE_DIR/prepared`` (default ``~/.cache/prunus/prepared``), one export dir per model dir,
named by a hash of what the export is made from: the bytes of the dir's config, manifest, tokenizer and
generation files, the name, size and modification time of every other file in it (the weights), and prunus's and
ONNX Runtime's versions. A changed model dir gets a new export; the model dir itself is never written to. Two
servers preparing the same dir at once take turns on a lock file, and the second loads what the first wrote.

The name only finds an entry; what is served is decided by its content (:func:`entry_problem`). The model dir
is verified against its own manifest first (as the torch backend does: a dir whose files fail it is refused in
one line, whatever the cache holds). An entry is served only when it is a plain dir of this user's, its
manifest names that dir's content hash as its parent, every file it lists has the hash listed, and its weights
(the graphs' initializers, the native weights) are finite. Anything else (planted, a symlink, another dir's
export, damaged, half-written) is prepared again in a temporary dir beside it and renamed over it, never
followed; where that fails, the dir is served by the torch Engine with one line saying why. The cache dirs are
``0o700``, its files and lock files ``0o600`` (:mod:`prunus.artifacts.cache_dir`).

Serving takes it as a step before the load: ``Engine.load(MODEL_DIR, prepare=prepared_path)`` (what ``prunus serve``
does; the serve stage never imports the export stage itself). Where the native kernels serve the dir itself
(:func:`native_direct`) nothing is prepared, and the info's ``prepared.skipped`` says so. The torch Engine stays a
choice (``--backend torch``, or ``--no-prepare --no-native``), and is what serves whatever neither can: a GPU, tensor
parallelism, a device map, a dtype override, ``compile``, LoRA adapters, speculative decoding with the native kernels
off, or a model the genai graph does not support (the reason is the info's ``prepared.skipped``).
"""

from __future__ import annotations

import hashlib
import os
import sys
from pathlib import Path

from prunus.artifacts.cache_dir import entry_problem as plain_entry_problem
from prunus.artifacts.cache_dir import cache_base, safe_dir, verified_or_rebuilt
from prunus.artifacts.errors import PrunusError
from prunus.runtime.load_options import LoadOptions

HASHED = ("config.json", "prunus.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json",
          "special_tokens_map.json", "chat_template.jinja")  # small files whose bytes name the export
MAX_HASHED_BYTES = 64 << 20  # a larger "small" file is named by its size and time, as the weights are
FORMAT = b"prunus-prepared-1"
FIX = "or set PRUNUS_CACHE_DIR to a dir of your own"


def cache_root() -> Path:
    return cache_base() / "prepared"


def cache_key(model_dir: Path) -> str:
    """The hash of what an export of ``model_dir`` is made from (the module docstring)."""
    import onnxruntime

    import prunus

    h = hashlib.sha256(FORMAT + f"|{prunus.__version__}|{onnxruntime.__version__}".encode())
    for entry in sorted(os.scandir(model_dir), key=lambda e: e.name):
        if not entry.is_file():  # follows links (a hub snapshot's files are links to its blobs)
            continue
        st = entry.stat()
        h.update(f"|{entry.name}|{st.st_size}".encode())
        if entry.name in HASHED and st.st_size <= MAX_HASHED_BYTES:
            h.update(Path(entry.path).read_bytes())
        else:
            h.update(f"|{st.st_mtime_ns}".encode())
    return h.hexdigest()[:24]


def skipped(backend: str | None, options: LoadOptions, lora: bool) -> str | None:
    """Why a model dir is served by the torch Engine rather than a prepared export (None: it may be prepared)."""
    reasons = ((backend is not None, f"--backend {backend} was asked for"),
               (options.device != "cpu", f"it runs on {options.device}"),
               (options.tp > 1, f"tp={options.tp}"),
               (options.device_map is not None, "a device map places it"),
               (options.dtype is not None, f"dtype={options.dtype}"),
               (options.compile is True, "compile=True"),
               (lora, "LoRA adapters are served by the torch backend"),
               (not native_draft(options.features.draft, options.native),
                "speculative decoding runs on the torch backend where the native kernels cannot verify the draft"))
    return next((why for hit, why in reasons if hit), None)


def native_direct(path: Path, config: dict, options: LoadOptions) -> bool:
    """Whether the native runtime serves the model dir itself (:mod:`prunus.runtime.native_backend`, its weights packed
    at load), so that no export is prepared: native not turned off, no prompt graph (an ONNX Runtime graph), and
    nothing the kernels cannot take (:func:`prunus.runtime.native_choice.model_dir_off`)."""
    from prunus.runtime.native_choice import model_dir_off

    return (options.native is not False and not options.prompt_graph
            and model_dir_off(path, config, options, parity=False) is None)  # the check follows (_native_checked)


def _native_checked(path: Path, parent_hash: str, options: LoadOptions, progress: bool) -> bool:
    """Whether the kernels' parity check of the dir (kept, or run now: :mod:`prunus.export.native_dir_parity`) let
    them serve it; where it failed under native="auto" the dir's export is prepared instead (native=True: served
    natively all the same, as asked)."""
    from .native_dir_parity import native_dir_record

    record = native_dir_record(path, parent_hash, progress)
    if record.get("passed") is not False or options.native is True:
        return True
    if progress:
        print(f"prunus: the native kernels failed their parity check on {path} ({', '.join(record.get('failed') or [])});"
              " preparing its ONNX Runtime export", file=sys.stderr, flush=True)
    return False


def native_draft(draft, native) -> bool:
    """Whether the native kernels can serve ``draft`` (none, prompt lookup, an EAGLE draft dir or a draft model dir:
    they verify drafts in one pass): where they run and are not turned off (``native``)."""
    if draft is None:
        return True
    from prunus.runtime.native_choice import cpu_problem

    return native is not False and cpu_problem() is None


def entry_problem(out: Path, parent_hash: str) -> str | None:
    """Why the cache entry ``out`` may not be served for a model dir of content hash ``parent_hash`` (a phrase that
    names no fix: the entry is prepared again), or None: it is a plain dir of this user's, its manifest names
    that parent, its files have the hashes it lists, and its weights are finite."""
    from prunus.artifacts.finite_weights import nonfinite_weights
    from prunus.artifacts.manifest_schema import MANIFEST, check_manifest
    from prunus.artifacts.validate import read_dir_json
    from prunus.runtime.artifact import read_artifact_config, verify_export_dir

    why = plain_entry_problem(out)
    if why is not None:
        return why
    try:
        manifest = check_manifest(read_dir_json(out, MANIFEST, no_dir="", no_file="no manifest", bad_json=""), out)
        if (manifest.get("parent") or {}).get("hash") != parent_hash:
            return "its manifest names another model dir as its parent"
        verify_export_dir(out, read_artifact_config(out).get("export"))
        bad = nonfinite_weights(out, manifest["files"])
    except PrunusError as e:
        return str(e).split("; ")[0]  # what is wrong, without the fix the export's reader would suggest
    return bad


def prepare(model_dir: Path, progress: bool = True, parent_hash: str | None = None) -> tuple[Path, bool]:
    """The cached genai export of ``model_dir``, verified (:func:`entry_problem`), or written first when there is
    none that verifies: (its path, whether it was already there). ``parent_hash``: the model dir's content hash,
    when the caller has verified it. Raises PrunusError when the export cannot be made (unsupported model, parity
    failed, no space, an unusable cache dir)."""
    from prunus.models.model_dir import dir_hash, verify_model_dir

    from .export_dir import export_model

    if parent_hash is None:
        parent_hash = dir_hash(verify_model_dir(model_dir)["files"])
    root = safe_dir(cache_root(), cache_base(), FIX)
    out = root / f"{model_dir.resolve().name[:60]}-{cache_key(model_dir)}"

    def announce(why: str) -> None:
        if progress:
            line = (f"once (cached in {out})" if why == "missing" else
                    f"again: the one cached in {out} is not used ({why[:200]})")
            print(f"prunus: preparing {model_dir}'s genai export, {line}", file=sys.stderr, flush=True)

    def build(tmp: Path) -> None:
        export_model(model_dir, tmp, format="onnx", graph="genai", progress=progress,
                     command=f"prunus serve {model_dir} (prepared)")

    done = verified_or_rebuilt(out, lambda p: entry_problem(p, parent_hash), build, root / f".{out.name}.lock",
                               FIX, announce)
    return done.path, done.cached


def prepared_path(path: str | Path, backend: str | None, options: LoadOptions, lora: bool,
                  progress: bool = True) -> tuple[Path, dict | None]:
    """What to load for ``path``: its prepared export where a transformer model dir may be served from one, else
    ``path`` itself; and the info's ``prepared`` entry (None: not a model dir this applies to)."""
    from prunus.models.model_dir import dir_hash, read_config_json, verify_model_dir
    from prunus.runtime.artifact import resolve_backend
    from prunus.runtime.registry import check_options

    path = Path(path)
    try:
        config = read_config_json(path)
    except PrunusError:
        return path, None  # not a model dir: the load names what is wrong
    if "export" in config or config.get("kind") == "module":
        return path, None
    why = skipped(backend, options, lora)
    direct = why is None and native_direct(path, config, options)
    # a bad option is one line before minutes of export, checked against the backend that will serve the dir
    check_options(path, resolve_backend(path, backend)[0] if why is not None or direct else "onnxruntime", options)
    if why is not None:
        return path, {"skipped": why}
    from .parity import ParityFailed

    parent_hash = dir_hash(verify_model_dir(path)["files"])  # a dir that fails its manifest: one line, no fallback
    if direct and _native_checked(path, parent_hash, options, progress):
        return path, {"skipped": "the native kernels read the model dir's weights directly"}
    try:
        out, cached = prepare(path, progress, parent_hash)
    except (PrunusError, ParityFailed) as e:  # served as it is, by the torch Engine: the reason is kept
        if options.native is True or options.kv_dtype == "f16":
            raise PrunusError(f"{path}: --native serves its genai export, which could not be made ({str(e)[:300]}); "
                              "drop --native / --kv-dtype to serve it on the torch backend") from None
        if progress:
            print(f"prunus: serving {path} on the torch backend: {str(e)[:300]}", file=sys.stderr, flush=True)
        return path, {"skipped": str(e)[:300]}
    return out, {"from": str(path), "export": str(out), "cached": cached}
