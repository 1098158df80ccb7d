"""The serving API: ``Engine.load(path)`` → ``generate`` / ``stream`` / ``submit`` → ``close``.

    from prunus.serve import Engine
    with Engine.load("runs/demo/model", tp=2) as engine:
        for r in engine.generate(["def f(", "import "], max_new_tokens=64):
            print(r.text, r.time_to_first_token_s, r.decode_tokens_per_s)
        for tok in engine.stream("class A", max_new_tokens=32):
            print(tok.text, end="", flush=True)

One API over every backend (torch in this process, torch in ``tp`` worker processes,
ONNX Runtime, TensorRT): requests go through one continuous-batching scheduler that
holds up to ``max_batch`` sequences of up to ``max_len`` tokens in a preallocated
KV cache.
"""

from __future__ import annotations

import atexit
import weakref
from collections.abc import Iterator
from pathlib import Path

import torch

from prunus.artifacts.errors import PrunusError
from prunus.models import load_model, load_model_tokenizer, load_tokenizer
from prunus.models.tokenizer import check_vocab

from .artifact import resolve_backend
from .backend_torch import PREFILL_CHUNK
from .request import GenerationResult, Request, SamplingParams, StreamToken
from .scheduler import Scheduler

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

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
                 threads: int | None = None):
        self.backend = backend
        self.tokenizer = tokenizer
        self.max_len = backend.max_len
        self.info = info or {}
        self.scheduler = Scheduler(backend, max_queue=max_queue, threads=threads)
        if self.scheduler.start_error is not None:
            error = self.scheduler.start_error
            self.scheduler.close()
            backend.close()
            raise PrunusError(f"the engine could not start: {type(error).__name__}: {error}") from error
        if self.scheduler.threads is not None:
            self.info["threads"] = self.scheduler.threads.describe()
        if self.info.get("compile"):  # a compile that failed at warm-up left decoding eager
            self.info["compile"] = getattr(backend, "compiled", None) is not None
        self._closed = False
        _OPEN.add(self)

    @classmethod
    def load(cls, path: str | Path, backend: str | None = None, *, tp: int = 1, device: str = "cpu",
             max_batch: int = 8, max_len: int | None = None, max_queue: int | None = None,
             dtype: str | None = None, threads: int | None = None, compile: bool | str = "auto",
             prefill_chunk: int | None = PREFILL_CHUNK, device_map=None, max_memory=None,
             prompt_graph: bool = False, native: bool = False) -> "Engine":
        """A model dir (plain or compressed) or an export dir; ``backend`` defaults to the one it needs.

        ``threads``: CPU threads per forward pass of the in-process torch backend (by default
        each pass gets 1 or all of them, whichever was faster when timed at load,
        :mod:`prunus.serve.pass_threads`), or ONNX Runtime's intra-op threads. ``compile``: decode steps through ``torch.compile``
        (:mod:`prunus.serve.compiled_decode`, the torch backend in one process): True, False, or "auto",
        which compiles where torch.compile runs here and its rule (:func:`prunus.serve.compiled_decode.choose_compile`) says it pays;
        where it cannot run, decoding stays eager with a one-line warning. ``prefill_chunk``: prompt tokens per
        row per prefill pass of the torch backend (None: whole prompts); a longer prompt goes through the cache
        in chunks, between other requests' decode steps. ``device_map``: "auto" (with ``max_memory``, e.g. {0: "10GiB", "cpu": "30GiB"}) or
        {module: device}: the model's blocks placed across GPUs, the CPU and the disk (:mod:`prunus.serve.device_map`).
        ``prompt_graph``: for a genai export of int8 / int4 weights, long prompt passes also through its prompt twin
        (:mod:`prunus.export.genai_prompt_graph`: float activations, faster prefill, a second copy of the weights).
        ``native``: for a genai export, decode steps (and int8 prompts of up to 64 tokens) in prunus's own CPU kernels
        (:mod:`prunus.native.decoder`, AVX2, compiled on first use) over the same weights and KV buffers."""
        path = Path(path)
        backend, config = resolve_backend(path, backend)
        if not isinstance(tp, int) or tp < 1:
            raise PrunusError(f"tp={tp!r} must be a positive integer")
        if compile not in (True, False, "auto"):
            raise PrunusError(f"compile={compile!r}: choose True, False or 'auto'")
        if compile is True and (backend != "torch" or tp > 1):
            raise PrunusError(f"compile=True applies to the torch backend in one process, not {backend} with tp={tp}")
        if tp > 1 and backend != "torch":
            raise PrunusError(f"tp={tp} needs the torch backend (a model dir); the {backend} backend runs one process")
        for wanted, name in ((prompt_graph, "prompt_graph"), (native, "native")):
            if wanted and backend != "onnxruntime":
                raise PrunusError(f"{name} applies to an ONNX Runtime export dir, not the {backend} backend; "
                                  f"drop it (--{name.replace('_', '-')})")
        if not isinstance(max_batch, int) or max_batch < 1:
            raise PrunusError(f"max_batch={max_batch!r} must be a positive integer")
        if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
            raise PrunusError(f"threads={threads!r} must be a positive integer (or None to time 1 against all)")
        if dtype is not None and dtype not in DTYPES:
            raise PrunusError(f"dtype {dtype!r}: choose one of {', '.join(DTYPES)}")
        limit = (config.get("export") or config["model"]).get("max_seq_len") or config["model"]["max_seq_len"]
        max_len = limit if max_len is None else max_len
        if not 1 < max_len <= limit:
            raise PrunusError(f"max_len={max_len} must be between 2 and the model's max_seq_len {limit}")
        info = {"path": str(path), "backend": backend, "tp": tp, "device": device, "max_batch": max_batch, "max_len": max_len,
                "compile": compile is True}
        if device_map is not None:
            if backend != "torch" or tp > 1 or compile is True:
                raise PrunusError(f"device_map places a model dir's modules for the torch backend in one process, not "
                                  f"{backend} with tp={tp}{' and compile' if compile is True else ''}")
            from .backend_torch import TorchBackend
            from .device_map import load_dispatched, place_cache

            model, placed = load_dispatched(path, device_map, max_memory, dtype=DTYPES[dtype] if dtype else None)
            impl = TorchBackend(model, max_batch, max_len, prefill_chunk=prefill_chunk)
            place_cache(impl.cache, model)
            tokenizer = load_model_tokenizer(path)
            info["device_map"] = {k: str(v) for k, v in placed.items()}
        elif max_memory is not None:
            raise PrunusError("max_memory applies with device_map='auto'; add device_map='auto' (--device-map auto)")
        elif backend == "torch" and tp > 1:
            from .backend_tp import TPBackend

            impl = TPBackend(path, tp, n_slots=max_batch, max_len=max_len, device=device, dtype=dtype)
            tokenizer = load_model_tokenizer(path)
        elif backend == "torch":
            from .backend_torch import TorchBackend
            from .compiled_decode import choose_compile

            model = load_model(path, device=device, dtype=DTYPES[dtype] if dtype else None)
            info["compile"] = compile = choose_compile(compile, model)
            impl = TorchBackend(model, max_batch, max_len, compile=compile, prefill_chunk=prefill_chunk)
            tokenizer = load_model_tokenizer(path)
        else:
            tokenizer = load_tokenizer(config.get("tokenizer"), base_dir=path)
            check_vocab(tokenizer, config["model"]["vocab_size"], path)
            if backend == "onnxruntime":
                from .backend_onnxruntime import load_onnxruntime_backend

                impl = load_onnxruntime_backend(path, config, max_batch, max_len, threads=threads,
                                                prompt_graph=prompt_graph, native=native)
                if prompt_graph:
                    info["prompt_graph_min_tokens"] = impl.session.prompt_min_tokens
                if native:
                    info["native_prompt_tokens"] = impl.session.native_prompt_tokens
            else:
                from .backend_tensorrt import load_tensorrt_backend

                impl = load_tensorrt_backend(path, config, max_batch, max_len, device=device)
            info["precision"] = config["export"].get("precision")
        return cls(impl, tokenizer, max_queue=max_queue, info=info, threads=threads)

    # --- requests --------------------------------------------------------------------------

    def submit(self, prompt: str | list[int], max_new_tokens: int = 128, temperature: float = 0.0,
               top_k: int | None = None, top_p: float | None = None, seed: int | None = None,
               stop: str | list[str] | None = None, ignore_eos: bool = False) -> Request:
        """Queue one prompt (text, or token ids); read its ``events`` or wait with :meth:`result`."""
        if self._closed:
            raise PrunusError("the engine is closed; load it again")
        stop = (stop,) if isinstance(stop, str) else tuple(stop or ())
        params = SamplingParams(max_new_tokens, temperature, top_k, top_p, seed, stop, ignore_eos).check()
        ids = self.encode(prompt)
        if len(ids) + max_new_tokens > self.max_len:
            raise PrunusError(
                f"prompt ({len(ids)} tokens) + max_new_tokens ({max_new_tokens}) exceeds the context of "
                f"{self.max_len} tokens; shorten the prompt or lower max_new_tokens")
        stops = () if ignore_eos else tuple(getattr(self.tokenizer, "stop_ids", ()))
        return self.scheduler.submit(Request(ids, params, self.tokenizer, stop_ids=stops))

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
        while True:
            event = request.events.get()
            if isinstance(event, BaseException):
                raise event
            if isinstance(event, GenerationResult):
                return event

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
            while True:
                event = request.events.get()
                if isinstance(event, BaseException):
                    raise event
                if isinstance(event, GenerationResult):
                    return
                yield event
        finally:
            request.cancelled.set()

    # --- lifetime --------------------------------------------------------------------------

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        _OPEN.discard(self)
        self.scheduler.close()
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
