"""What ``Engine.load`` asks of a runtime, checked once before any runtime loads (torch-free: the CLI reads it)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import PurePath

from prunus.artifacts.errors import PrunusError

PREFILL_CHUNK = 256  # tokens per row per prefill pass of the torch backend; see prunus.serve.engine.Engine.load
PREFILL_AUTO = "auto"  # prefill_chunk left to the backend: PREFILL_CHUNK on torch, its own on a genai export
NATIVE_AUTO = "auto"  # native left to the load: a model dir or genai export on a CPU the kernels run on (native_choice)
DTYPES = ("float32", "bfloat16", "float16")


MAX_DRAFT_TOKENS = 16


def check_budget(mb) -> None:
    """``prefix_cache_mb``: None or a number of MiB >= 0 (0 and None: no prefix cache)."""
    if mb is not None and (isinstance(mb, bool) or not isinstance(mb, (int, float)) or not 0 <= mb < 2**40):
        raise PrunusError(f"prefix_cache_mb={mb!r} must be a number of MiB >= 0 (0 or None: no prefix cache; "
                          "--prefix-cache-mb)")


@dataclass(frozen=True)
class ServingFeatures:
    """Prefix caching and speculative decoding (which runtimes serve them: the ``accepts`` of their rows in
    :mod:`prunus.runtime.registry`). Each field is an ``Engine.load`` keyword; ``metadata`` gives its CLI flag and
    help (``prunus serve`` / ``generate`` build their options from these fields)."""

    prefix_cache_mb: float | None = field(default=None, metadata={
        "flag": "--prefix-cache-mb", "type": float,
        "help": "MiB of KV blocks of prompt prefixes kept for reuse (automatic prefix caching; torch backend, or an "
                "ONNX Runtime genai export with or without --native): a "
                "prompt that starts like an earlier one runs only its new tokens. Default: off."})
    draft: str | None = field(default=None, metadata={
        "flag": "--speculative", "type": str, "metavar": "DRAFT_DIR|DRAFT_DIR+ngram|ngram|auto",
        "help": "Speculative decoding (a model dir on torch, or a genai export on the native kernels): an EAGLE "
                "draft dir (prunus compress --distill eagle), a draft model dir with the same tokenizer, ngram "
                "(drafts copied from the prompt), a dir and ngram together (DIR+ngram: each step takes the draft "
                "likelier to pay), or auto (an EAGLE draft dir trained for the target in the target's folder, "
                "with ngram; else ngram alone). Default: off."})
    draft_tokens: int = field(default=4, metadata={
        "flag": "--draft-tokens", "type": int,
        "help": f"With --speculative: tokens drafted per step, checked in one pass of the model (1 to {MAX_DRAFT_TOKENS})."})

    @property
    def enabled(self) -> bool:
        return bool(self.prefix_cache_mb) or self.draft is not None

    def check(self) -> None:
        """One PrunusError line for a malformed value (whether a runtime serves it: prunus.runtime.registry)."""
        check_budget(self.prefix_cache_mb)
        k = self.draft_tokens
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_DRAFT_TOKENS:
            raise PrunusError(f"draft_tokens={k!r} must be an integer from 1 to {MAX_DRAFT_TOKENS} (--draft-tokens)")
        if self.draft is not None and (not isinstance(self.draft, (str, PurePath)) or not str(self.draft)):
            raise PrunusError(f"draft={self.draft!r} must be a draft dir, 'ngram', 'DIR+ngram' or 'auto' "
                              "(--speculative)")


@dataclass(frozen=True)
class LoadOptions:
    tp: int = 1
    device: str = "cpu"
    max_batch: int = 8
    max_len: int | None = None  # None: the artifact's max_seq_len (set by :meth:`with_max_len`)
    dtype: str | None = None
    threads: int | None = None
    compile: bool | str = "auto"
    prefill_chunk: int | str | None = PREFILL_AUTO  # "auto": the backend's own (chunk_for)
    device_map: object = None
    max_memory: object = None
    prompt_graph: bool = False
    native: bool | str = NATIVE_AUTO  # a model dir / genai export in prunus's kernels: True, False, or "auto" (where they run)
    kv_dtype: str = "f32"  # the native decoder's KV cache: "f32", or "f16" (half the memory; its own buffers)
    trust_factory: object = None  # a generic module dir's factory may be imported (prunus.models.module_factory)
    features: ServingFeatures = ServingFeatures()  # prefix caching, speculative decoding

    def check(self) -> None:
        """One PrunusError line for a malformed value. Whether a runtime serves what the options ask (tp, compile,
        native, prefix cache, draft, ...) is the runtime table's to say (prunus.runtime.registry.check_options)."""
        tp, compile = self.tp, self.compile
        if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
            raise PrunusError(f"tp={tp!r} must be a positive integer")
        if compile not in (True, False, "auto"):
            raise PrunusError(f"compile={compile!r}: choose True, False or 'auto'")
        if not (isinstance(self.native, bool) or self.native == NATIVE_AUTO):
            raise PrunusError(f"native={self.native!r}: choose True, False or 'auto' (--native / --no-native)")
        if self.kv_dtype not in ("f32", "f16"):
            raise PrunusError(f"kv_dtype={self.kv_dtype!r}: choose 'f32' or 'f16' (--kv-dtype)")
        if self.kv_dtype == "f16" and self.native is False:
            raise PrunusError("kv_dtype='f16' is the native decoder's KV cache; drop native=False (--no-native) or "
                              "drop it (--kv-dtype)")
        chunk = self.prefill_chunk
        if chunk not in (None, PREFILL_AUTO) and (isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1):
            raise PrunusError(f"prefill_chunk={chunk!r} must be a positive integer, 'auto' or None (whole prompts)")
        if not isinstance(self.max_batch, int) or self.max_batch < 1:
            raise PrunusError(f"max_batch={self.max_batch!r} must be a positive integer")
        threads = self.threads
        if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
            raise PrunusError(f"threads={threads!r} must be a positive integer (or None to time 1 against all)")
        if self.dtype is not None and self.dtype not in DTYPES:
            raise PrunusError(f"dtype {self.dtype!r}: choose one of {', '.join(DTYPES)}")
        if self.max_memory is not None and self.device_map is None:
            raise PrunusError("max_memory applies with device_map='auto'; add device_map='auto' (--device-map auto)")
        self.features.check()

    def chunk_for(self, default: int | None) -> int | None:
        """``prefill_chunk`` with "auto" resolved to the backend's ``default``."""
        return default if self.prefill_chunk == PREFILL_AUTO else self.prefill_chunk

    def max_len_for(self, config: dict) -> int:
        """``max_len``, or the artifact's context where it is None; checked against that context."""
        if config.get("kind") == "module":  # a non-generative model has no context
            return self.max_len
        limit = (config.get("export") or config["model"]).get("max_seq_len") or config["model"]["max_seq_len"]
        max_len = limit if self.max_len is None else self.max_len
        if not 1 < max_len <= limit:
            raise PrunusError(f"max_len={max_len} must be between 2 and the model's max_seq_len {limit}")
        return max_len
