"""The serving API: ``Engine.load(path)`` → ``generate`` / ``stream`` / ``submit`` → ``close``.

    from prunus.serve import Engine
    with Engine.load("runs/demo/model", tp=2) as engine:
        for r in engine.generate(["def f(", "import "], max_new_tokens=64):
            print(r.text, r.time_to_first_token_s, r.decode_tokens_per_s)
        for tok in engine.stream("class A", max_new_tokens=32):
            print(tok.text, end="", flush=True)

One API over every runtime of :mod:`prunus.runtime` (torch in this process, torch in ``tp`` worker
processes, ONNX Runtime, prunus's native kernels, TensorRT): requests go through one continuous-batching
scheduler that holds up to ``max_batch`` sequences of up to ``max_len`` tokens in a preallocated KV cache.
"""

from __future__ import annotations

import atexit
import weakref
from collections.abc import Iterator
from pathlib import Path

import torch

from prunus.artifacts.errors import PrunusError
from prunus.runtime.registry import load_runtime

from . import events
from .dynamic_batcher import DynamicBatcher, as_torch_future
from .engine_options import EngineOptions
from .request import GenerationResult, Request, SamplingParams, StreamToken
from .scheduler import Scheduler

# Engines not closed yet. At interpreter exit they are closed before the runtimes' own teardown: a process that
# left two ONNX Runtime Engines open (their scheduler threads idle) ended in "terminate called without an active
# exception" every time, one Engine never.
_OPEN: weakref.WeakSet = weakref.WeakSet()


@atexit.register
def _close_open_engines() -> None:
    for engine in list(_OPEN):
        try:
            engine.close()
        except Exception:
            pass


class Engine:
    def __init__(self, backend, tokenizer, *, max_queue: int | None = None, info: dict | None = None,
                 threads: int | None = None, max_delay_ms: float = 2.0, speculator=None):
        self.backend = backend
        self.speculator = speculator
        self.tokenizer = tokenizer
        self.max_len = backend.max_len
        self.info = info or {}
        if backend.capabilities.predict:  # a non-generative model: dynamic batching (prunus.serve.dynamic_batcher)
            self.scheduler = DynamicBatcher(backend, max_delay_ms, max_queue)
            self.info["max_delay_ms"] = max_delay_ms
        else:
            self.scheduler = Scheduler(backend, max_queue=max_queue, threads=threads, speculator=speculator)
            if speculator is not None:
                self.info["speculative"] = speculator.stats  # live: drafted, accepted, acceptance rate
        if self.scheduler.start_error is not None:
            error = self.scheduler.start_error
            self.scheduler.close()
            backend.close()
            raise PrunusError(f"the engine could not start: {type(error).__name__}: {error}") from error
        if self.scheduler.threads is not None:
            self.info["threads"] = self.scheduler.threads.describe()
        self.info.update(backend.describe())  # what warm-up settled (a compile that failed left decoding eager)
        self._closed = False
        _OPEN.add(self)

    @classmethod
    def load(cls, path: str | Path, backend: str | None = None, *, options: EngineOptions | None = None,
             **keywords) -> "Engine":
        """A model dir (plain or compressed) or an export dir; ``backend`` defaults to the one it needs, and the
        runtime that loads it is the row of :mod:`prunus.runtime.registry` that recognises it.

        The settings come as keywords or as one ``options=EngineOptions(...)``
        (:mod:`prunus.serve.engine_options`), never both: ``tp=1, device="cpu", max_batch=8, max_len=None``
        (the artifact's), ``max_queue=None, dtype=None, threads=None, compile="auto", prefill_chunk="auto",
        device_map=None, max_memory=None, prompt_graph=False, native="auto", kv_dtype="f32",
        trust_factory=None, max_delay_ms=2.0, prefix_cache_mb=None, draft=None, draft_tokens=4, lora=None,
        prepare=None``.

        ``threads``: CPU threads per forward pass of the in-process torch backend (by default
        each pass gets 1 or all of them, whichever was faster when timed at load,
        :mod:`prunus.serve.pass_threads`), or ONNX Runtime's intra-op threads. ``compile``: decode steps through ``torch.compile``
        (:mod:`prunus.runtime.compiled_decode`, the torch backend in one process): True, False, or "auto",
        which compiles where torch.compile runs here and its rule (:func:`prunus.runtime.compiled_decode.choose_compile`) says it pays;
        where it cannot run, decoding stays eager with a one-line warning. ``prefill_chunk``: prompt tokens per
        row per prefill pass (None: whole prompts; "auto": 256 on the torch backend, 64 on a genai export); a
        longer prompt goes through the cache in chunks, between other requests' decode steps. ``device_map``: "auto" (with ``max_memory``, e.g. {0: "10GiB", "cpu": "30GiB"}) or
        {module: device}: the model's blocks placed across GPUs, the CPU and the disk (:mod:`prunus.runtime.device_map`).
        ``prompt_graph``: for a genai export of int8 / int4 weights, long prompt passes also through its prompt twin
        (:mod:`prunus.runtime.genai_prompt_graph`: float activations, faster prefill, a second copy of the weights).
        ``native``: for a transformer model dir (its weights packed at load, no export) or a genai export, every pass
        in prunus's own CPU kernels (:mod:`prunus.runtime.native_backend`, compiled on first use; the CPU's kernel
        path is the info's ``native_isa``) with no ONNX Runtime session in memory: "auto" (the default) wherever they
        run and no option needs torch (``backend="torch"``, LoRA, a dtype, a device map, tp, compile) or ONNX Runtime,
        else torch / ONNX Runtime with the reason in the info's ``native`` (:mod:`prunus.runtime.native_choice`);
        True asks for them, False keeps torch / ONNX Runtime. ``kv_dtype="f16"`` keeps
        the native KV cache in float16 (half the memory and bandwidth at long contexts).
        A generic model dir (any ``nn.Module``; its factory imported only when ``trust_factory`` trusts it) or its
        ONNX export dir serves :meth:`predict` instead, with dynamic batching: up to ``max_batch`` rows of
        concurrent callers per pass, the first waiting up to ``max_delay_ms`` for others.
        ``prefix_cache_mb``: MiB of KV blocks kept for prompts that start like earlier ones (automatic prefix
        caching, :mod:`prunus.runtime.prefix_cache`; the torch backend in one process, or a genai export). ``draft``: speculative
        decoding (:mod:`prunus.runtime.speculative`) with a draft model dir of the same tokenizer, or "ngram" (prompt
        lookup, :mod:`prunus.runtime.prompt_lookup`), ``draft_tokens`` drafted per step; a lone decoding request
        speculates, several decode plainly together. The info's ``prefix_cache`` and ``speculative`` count reuse
        and acceptance. ``lora``: {name: PEFT adapter dir}, LoRA adapters served over the base per row
        (:mod:`prunus.runtime.lora_adapters`; the torch backend in one process); a request picks one by name.
        ``prepare``: a step run before the load, ``prepare(path, backend, options, has_lora) -> (path, info)``;
        :func:`prunus.export.prepared_path` serves a transformer model dir on a CPU that the native kernels do not
        serve from its ONNX Runtime genai export, made once and cached (``prunus serve`` passes it by default), unless
        an option needs the torch backend; the info's ``prepared`` says which, and why."""
        if options is None:
            options = EngineOptions.from_keywords(backend, **keywords)
        elif keywords or backend is not None:
            raise TypeError("Engine.load() takes options=EngineOptions(...) or keywords, not both")
        return cls._load(Path(path), options)

    @classmethod
    def _load(cls, path: Path, options: EngineOptions) -> "Engine":
        load, lora, features = options.load, options.lora, options.features
        if features.draft is not None and str(features.draft) == "auto":  # beside the dir asked for, not its export
            from dataclasses import replace

            from prunus.runtime.eagle_drafter import find_draft

            features = replace(features, draft=find_draft(path))
            load = replace(load, features=features)
        prepared = None
        if options.prepare is not None:
            path, prepared = options.prepare(path, options.backend, load, bool(lora))
        if lora and load.native == "auto":  # LoRA adapters are the torch backend's
            from dataclasses import replace

            load = replace(load, native=False)
        loaded = load_runtime(path, options.backend, load)
        if lora and options.load.native == "auto" and "native" in loaded.info:
            loaded.info["native"] = "off: LoRA adapters are served by the torch backend"
        if prepared is not None:  # the info names the dir asked for; its prepared export is the entry's
            loaded.info.update(path=prepared.get("from", loaded.info["path"]), prepared=prepared)
        speculator = None
        try:
            if lora:
                _attach_lora(loaded.backend, lora)
            if features.draft is not None:
                from prunus.runtime.speculative import load_speculator

                speculator = load_speculator(path, loaded.backend, loaded.info.get("draft", features.draft),
                                             features.draft_tokens)
        except BaseException:
            loaded.backend.close()
            raise
        return cls(loaded.backend, loaded.tokenizer, max_queue=options.max_queue, info=loaded.info,
                   threads=load.threads, max_delay_ms=options.max_delay_ms, speculator=speculator)

    # --- non-generative models ------------------------------------------------------------

    def predict(self, batch, timeout: float | None = None):
        """The outputs of ``batch`` (rows of the model's input: numpy, or torch for torch outputs), computed in
        a pass shared with concurrent callers; one line for an input the model does not take."""
        return self.submit_predict(batch).result(timeout)

    def submit_predict(self, batch):
        """A Future of ``batch``'s outputs (see :meth:`predict`); QueueFull at once when the queue is full."""
        from prunus.runtime.tensor_spec import as_rows

        if self._closed:
            raise PrunusError("the engine is closed; load it again")
        if not self.backend.capabilities.predict:
            raise PrunusError("this engine serves a generative model; use generate or stream, not predict")
        array, as_torch = as_rows(batch, self.backend.inputs[0])
        future = self.scheduler.submit(array)
        return as_torch_future(future) if as_torch else future

    # --- requests --------------------------------------------------------------------------

    def submit(self, prompt: str | list[int], max_new_tokens: int = 128, temperature: float = 0.0,
               top_k: int | None = None, top_p: float | None = None, seed: int | None = None,
               stop: str | list[str] | None = None, ignore_eos: bool = False, logits=None,
               stop_token_ids=(), adapter: str | None = None, *, params: SamplingParams | None = None) -> Request:
        """Queue one prompt (text, or token ids); read its ``events`` or wait with :meth:`result`.
        ``logits``: a :class:`prunus.serve.logits_processors.LogitsSettings` (penalties, logit_bias, min_tokens,
        logprobs); ``stop_token_ids``: more tokens that end the request, besides the model's own; ``adapter``: the
        name of a loaded LoRA adapter to run with (None: the base). Or all of it as one ``params``
        (:class:`prunus.serve.request.SamplingParams`, the HTTP routes' one parse of a request): checked here,
        once, with the prompt against the context."""
        if self._closed:
            raise PrunusError("the engine is closed; load it again")
        if self.backend.capabilities.predict:
            raise PrunusError("this engine serves a non-generative model; use predict, not generate or stream")
        if params is None:
            stop = (stop,) if isinstance(stop, str) else tuple(stop or ())
            params = SamplingParams(max_new_tokens, temperature, top_k, top_p, seed, stop, ignore_eos, logits,
                                    tuple(stop_token_ids or ()), adapter)
        params.check(self.backend.vocab_size)
        ids = self.encode(prompt)
        if len(ids) + params.max_new_tokens > self.max_len:
            raise PrunusError(
                f"prompt ({len(ids)} tokens) + max_new_tokens ({params.max_new_tokens}) exceeds the context of "
                f"{self.max_len} tokens; shorten the prompt or lower max_new_tokens")
        stops = () if params.ignore_eos else tuple(getattr(self.tokenizer, "stop_ids", ())) + params.stop_token_ids
        lora = self.lora_adapter(params.adapter) if params.adapter is not None else None
        return self.scheduler.submit(Request(ids, params, self.tokenizer, stop_ids=stops, adapter=lora))

    def embed(self, texts, pooling: str = "last", normalize: bool = True, adapter: str | None = None) -> torch.Tensor:
        """(len(texts), dim) float32 embeddings: the final hidden state (after the final norm) pooled over each
        input's tokens ("last" or "mean"), L2-normalized unless ``normalize`` is False (:mod:`prunus.serve.embeddings`;
        the torch backend in one process). ``texts``: a string, token ids, or a list of them."""
        from .embeddings import check_inputs, embed_ids

        if self._closed:
            raise PrunusError("the engine is closed; load it again")
        return embed_ids(self, check_inputs(self, texts), pooling, normalize, adapter)

    # --- LoRA adapters (prunus.runtime.lora_adapters) -------------------------------------

    def _lora(self):
        """The backend's loaded adapters (a LoraSet), or None: a backend without LoRA, or none loaded yet."""
        return self.backend.lora if self.backend.capabilities.lora else None

    def adapter_names(self) -> list[str]:
        lora = self._lora()
        return list(lora.adapters) if lora is not None else []

    def lora_adapter(self, name: str):
        lora = self._lora()
        if lora is None:
            raise PrunusError(f"adapter {str(name)[:60]!r}: this engine serves no LoRA adapters; load it with lora= "
                              "(prunus serve --lora NAME=DIR)")
        return lora.get(name)

    def load_adapter(self, name: str, path: str | Path) -> None:
        """Load one more LoRA adapter while serving (the torch backend in one process)."""
        _attach_lora(self.backend, {name: path})

    def unload_adapter(self, name: str) -> None:
        """Forget adapter ``name``: new requests cannot pick it; requests already running with it finish with it."""
        lora = self._lora()
        if lora is None:
            raise PrunusError(f"adapter {str(name)[:60]!r}: this engine serves no LoRA adapters")
        lora.unload(name)

    def chat_prompt(self, messages) -> str:
        """The prompt text of a conversation (``[{"role", "content"}, ...]``) in the model's chat template,
        ending where the assistant's answer begins; a missing or failing template is a PrunusError."""
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)

    def encode(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt)
        elif isinstance(prompt, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            ids = list(prompt)
            vocab = self.backend.vocab_size
            if any(not 0 <= t < vocab for t in ids):
                raise PrunusError(f"prompt token ids must lie in [0, {vocab})")
        else:
            raise PrunusError(f"a prompt is a string or a list of token ids, not {type(prompt).__name__}")
        if not ids:
            raise PrunusError("the prompt is empty; give at least one token of prompt")
        return ids

    @staticmethod
    def wait(request: Request) -> GenerationResult:
        return events.result(request)

    def generate(self, prompts, max_new_tokens: int = 128, **sampling) -> GenerationResult | list[GenerationResult]:
        """One result per prompt (a list for a list of prompts). All prompts run in one continuous batch."""
        single = isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int))
        batch = [prompts] if single else list(prompts)
        if not batch:
            raise PrunusError("no prompts given")
        requests = []
        try:
            for p in batch:
                requests.append(self.submit(p, max_new_tokens, **sampling))
            results = [self.wait(r) for r in requests]
        except BaseException:
            for r in requests:
                r.cancelled.set()
            raise
        return results[0] if single else results

    def stream(self, prompt: str | list[int], max_new_tokens: int = 128, **sampling) -> Iterator[StreamToken]:
        """Yield each token (id and text piece) as it is made; closing the iterator cancels the request."""
        request = self.submit(prompt, max_new_tokens, **sampling)
        try:
            yield from events.tokens(request)
        finally:
            request.cancelled.set()

    # --- lifetime --------------------------------------------------------------------------

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        _OPEN.discard(self)
        self.scheduler.close()
        if self.speculator is not None:
            self.speculator.close()  # the draft model's backend
        self.backend.close()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


def _attach_lora(backend, adapters: dict) -> None:
    """Load ``adapters`` ({name: dir}) onto ``backend``, or one line where the backend cannot serve them."""
    if not isinstance(adapters, dict):
        raise PrunusError("lora must be a dict {name: PEFT adapter dir}")
    if not backend.capabilities.lora:
        name = getattr(backend, "name", type(backend).__name__)
        raise PrunusError(f"--lora: the {name} backend cannot serve LoRA adapters; serve the model dir with the torch "
                          "backend in one process (no --tp, --native or export dir), or merge the adapter first")
    backend.attach_lora(adapters)
