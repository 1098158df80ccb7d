"""Continuous batching: one thread runs the backend; requests join and leave between steps.

Each step the scheduler (1) admits waiting requests into free cache rows and runs
their prefill together in one pass, sampling each one's first token, then (2) runs
one decode pass over every active row. With a backend that prefills in chunks
(``capabilities.extend`` and ``prefill_chunk``: the torch and genai backends) step (1) takes at most one chunk
of each prompt; a longer prompt's next chunk comes in the next step, after the decode
pass, so a long prompt delays the running requests' tokens by a chunk's pass per step
instead of stalling them for its whole prefill. A request that finishes (its length, end of
text, a stop string), is cancelled (a client went away) or fails leaves the batch and frees
its row before the next step (``backend.release(row)``), so a new request never waits for a whole
batch to end.

The scheduler knows a backend by its contract (:class:`prunus.runtime.backend.Backend`) and what it can
do by ``backend.capabilities`` alone. Sampling is per request (:func:`prunus.runtime.sampling.sample`
with the request's own settings and generator), so a request's tokens do not depend on its batch-mates;
it runs where the logits are and brings back token ids.

With a prefix cache (``capabilities.prefix_cache``, :mod:`prunus.runtime.prefix_cache`) a joining request whose
prompt starts like an earlier one starts its row from the cached blocks and runs only the rest of its prompt,
through ``extend`` like a long prompt's later chunk; its full blocks are cached once its prompt is in (for the
requests after it) and again when it leaves (prompt and answer, for the next turn of a conversation). A request
that shares at least half its prompt with one being prefilled waits, holding its row, until that one's blocks are
cached, so a burst of requests with one long system prompt computes it once.

With a speculator (:mod:`prunus.runtime.speculative`) a decode step drafts tokens for every decoding request and
checks them all in one pass (``verify_rows``, where the backend has it; else only a lone request speculates and
several decode plainly together, the draft catching up later). Each row drafts as many tokens as its own running
acceptance makes worth checking, none where speculation measured slower than plain decoding. A request with logits
processing (``SamplingParams.logits``) decodes plainly, in a pass of its own beside the speculative rows'.
"""

from __future__ import annotations

import collections
import threading

import torch

from prunus.artifacts.errors import PrunusError
from prunus.runtime.prefix_cache import BLOCK
from prunus.runtime.sampling import RowSampling, sample

from .logits_processors import process, token_logprobs
from .pass_threads import PassThreads, tune_pass_threads
from .request import Request


class QueueFull(PrunusError):
    """The bounded wait queue is full (the HTTP server answers 429)."""


class Scheduler:
    def __init__(self, backend, max_queue: int | None = None, threads: int | None = None, speculator=None):
        """``threads``: per pass of an in-process torch backend; None times 1 against all at start.
        ``speculator``: a :class:`prunus.runtime.speculative.Speculator` over ``backend``, or None."""
        self.backend = backend
        self.speculator = speculator
        self.caps = backend.capabilities
        self.max_queue = max_queue
        self.threads: PassThreads | None = None
        self._want_threads = threads
        self._started = threading.Event()
        self.start_error: Exception | None = None
        self.free = list(range(self.caps.max_batch))
        self.waiting: collections.deque[Request] = collections.deque()
        self.active: dict[int, Request] = {}
        self.prefilling: dict[int, Request] = {}  # slot -> request whose prompt is partly in the cache
        self.prefilled: dict[int, int] = {}  # slot -> prompt tokens the cache holds
        self.deferred: dict[int, Request] = {}  # slot -> request waiting for another's prompt blocks (prefix cache)
        self.tokens_generated = 0
        self.steps = 0
        self._cond = threading.Condition()
        self._running = True
        self._thread = threading.Thread(target=self._loop, name="prunus-scheduler", daemon=True)
        self._thread.start()
        self._started.wait()

    @property
    def queue_depth(self) -> int:
        return len(self.waiting)

    @property
    def n_active(self) -> int:
        """Requests holding a cache row: decoding, or with their prompt partly prefilled."""
        return len(self.active) + len(self.prefilling) + len(self.deferred)

    def submit(self, request: Request) -> Request:
        with self._cond:
            if not self._running:
                raise PrunusError("the engine is closed; load it again")
            if self.max_queue is not None and len(self.waiting) >= self.max_queue:
                raise QueueFull(f"the request queue is full ({self.max_queue} waiting); retry later")
            self.waiting.append(request)
            self._cond.notify()
        return request

    def close(self) -> None:
        with self._cond:
            self._running = False
            self._cond.notify()
        if self._thread is not threading.current_thread():
            self._thread.join()
        closed = PrunusError("the engine was closed before this request finished")
        for r in list(self.waiting) + list(self.active.values()) + list(self.prefilling.values()) + list(self.deferred.values()):
            r.fail(closed)
        self.waiting.clear()
        self.active.clear()
        self.prefilling.clear()
        self.prefilled.clear()
        self.deferred.clear()

    # --- the loop -------------------------------------------------------------------------

    def _choose_threads(self) -> None:
        """Runs on the scheduler thread: OpenMP's thread count belongs to the thread that sets it;
        then a backend's ``warm_up`` (compiled decode graphs) runs at those settings."""
        caps = self.caps
        try:
            if caps.tunable_threads:
                try:
                    if self._want_threads is not None:
                        self.threads = PassThreads.fixed(self._want_threads)
                    else:
                        self.threads = tune_pass_threads(self.backend, torch.get_num_threads())
                except Exception:  # a backend that cannot run fails its first request with its own error
                    self.threads = None
            elif caps.host_threads:
                torch.set_num_threads(caps.host_threads)  # this thread's setting alone
            if caps.warm_up:
                self.backend.warm_up(self._set_threads)
        except Exception as e:  # Engine.load reports it
            self.start_error = e
        finally:
            self._started.set()

    def _set_threads(self, tokens: int) -> None:
        if self.threads is not None:
            self.threads.set(tokens)

    def _loop(self) -> None:
        self._choose_threads()
        while True:
            with self._cond:
                while self._running and not self.waiting and not self.active and not self.prefilling and not self.deferred:
                    self._cond.wait()
                if not self._running:
                    return
                joining = []
                while self.waiting and self.free:
                    r = self.waiting.popleft()
                    if r.cancelled.is_set():
                        r.finish()
                        continue
                    self.free.sort()
                    r.slot = self.free.pop(0)
                    if r.adapter is not None:  # a LoRA adapter (prunus.runtime.lora_adapters) for this row
                        self.backend.bind_adapter(r.slot, r.adapter)
                    joining.append(r)
            try:
                if joining or self.prefilling or self.deferred:
                    self._prefill(joining)
                if self.active:
                    self._decode()
            except Exception as e:  # a failed pass fails the requests in it; the loop serves the next ones
                self._fail(joining + list(self.active.values()) + list(self.prefilling.values())
                           + list(self.deferred.values()), e)

    def _fail(self, reqs: list[Request], error: Exception) -> None:
        for r in reqs:
            if not r.done:
                r.fail(error)
            if r.slot is not None and r.slot not in self.free:
                self._free(r.slot)
        self.active.clear()
        self.prefilling.clear()
        self.prefilled.clear()
        self.deferred.clear()

    def _free(self, slot: int) -> None:
        """The row's request has left: the backend releases it, the row goes back to the free list."""
        self.free.append(slot)
        try:
            self.backend.release(slot)
            if self.speculator is not None:
                self.speculator.release(slot)
        except Exception:  # a backend that failed mid-pass: its next prefill of the row starts it afresh
            pass

    def _chunk(self) -> int | None:
        """Prompt tokens per row per prefill pass, or None where the backend takes whole prompts only."""
        return self.caps.prefill_chunk if self.caps.extend else None

    def _prefill(self, joining: list[Request]) -> None:
        """One chunk of every prompt being prefilled (the whole prompt without chunking): the joining
        requests' first chunks start their rows, earlier requests' next chunks extend theirs; a request
        whose prompt is all in the cache samples its first token and joins the decode batch."""
        chunk = self._chunk()
        for slot, r in list(self.prefilling.items()) + list(self.deferred.items()):
            if r.cancelled.is_set():
                self.prefilling.pop(slot, None)
                self.prefilled.pop(slot, None)
                self.deferred.pop(slot, None)
                r.finish_reason = "cancelled"
                self._free(slot)
                r.finish()
        joining = self._restore(joining)
        continuing = list(self.prefilling.values())
        complete, logits = [], []
        for reqs, fresh in ((continuing, False), (joining, True)):
            if not reqs:
                continue
            starts = [0 if fresh else self.prefilled[r.slot] for r in reqs]
            pieces = [r.prompt_ids[s:s + chunk] if chunk else r.prompt_ids[s:] for r, s in zip(reqs, starts)]
            self._set_threads(sum(map(len, pieces)))
            run = self.backend.prefill if fresh else self.backend.extend
            out = run([r.slot for r in reqs], pieces)
            for i, (r, s, piece) in enumerate(zip(reqs, starts, pieces)):
                held = s + len(piece)
                if held < len(r.prompt_ids):
                    self.prefilling[r.slot], self.prefilled[r.slot] = r, held
                    continue
                self.prefilling.pop(r.slot, None)
                self.prefilled.pop(r.slot, None)
                complete.append(r)
                logits.append(out[i])
        if complete:
            if self.caps.prefix_cache:
                for r in complete:
                    self.backend.store_prefix(r.slot, r.prompt_ids)
            self._sample(complete, torch.stack(logits))
            for r in complete:
                self.active[r.slot] = r
            self._retire(complete)

    def _restore(self, joining: list[Request]) -> list[Request]:
        """With a prefix cache: a joining (or deferred) request whose prompt starts like a cached one holds that
        prefix now and goes on as a prompt being prefilled. One that shares at least half its prompt with a prompt
        being prefilled (a burst of requests with one system prompt) waits for that one's blocks, holding its row;
        the others (returned) start afresh."""
        if not self.caps.prefix_cache:
            return joining
        candidates = list(self.deferred.values()) + joining
        self.deferred.clear()
        leaders = list(self.prefilling.values())
        fresh = []
        for r in candidates:
            if any(_worth_waiting(r.prompt_ids, leader.prompt_ids) for leader in leaders):
                self.deferred[r.slot] = r  # looks up the cache once its leader's prompt is in
                continue
            held = self.backend.restore_prefix(r.slot, r.prompt_ids)
            if held:
                self.prefilling[r.slot], self.prefilled[r.slot] = r, held
            else:
                fresh.append(r)
                leaders.append(r)
        return fresh

    def _decode(self) -> None:
        rows = sorted(self.active)
        if self.speculator is not None:
            spec = [s for s in rows if self.active[s].params.logits is None]  # penalties, logprobs...: plainly
            if spec and (len(spec) == 1 or self.caps.verify_rows):
                rows = [s for s in rows if s not in spec]
                self._speculate(spec)
                if not rows:
                    return
        reqs = [self.active[s] for s in rows]
        self._set_threads(len(rows))
        logits = self.backend.decode(rows, [r.last_token for r in reqs])
        self.steps += 1
        self._sample(reqs, logits)
        self._retire(reqs)

    def _speculate(self, slots: list[int]) -> None:
        """One speculative step of ``slots``' requests, their drafts checked in one pass: for each, the tokens the
        speculator accepted and the one it sampled."""
        reqs = [self.active[s] for s in slots]
        self._set_threads(len(slots) * (1 + self.speculator.k))
        samplings = [RowSampling(r.params.temperature, r.params.top_k, r.params.top_p, r.generator,
                                 r.params.seed is not None) for r in reqs]
        out = self.speculator.step_rows(slots, [r.prompt_ids + r.generated for r in reqs], samplings,
                                        [r.params.max_new_tokens - len(r.generated) for r in reqs])
        self.steps += 1
        for r, tokens in zip(reqs, out):
            for t in tokens:
                r.last_token = t
                r.add_token(t)
                self.tokens_generated += 1
                if r.done:
                    break
        self._retire(reqs)

    def _sample(self, reqs: list[Request], logits: torch.Tensor) -> None:
        logits = process(reqs, logits)  # per-row penalties, logit_bias, min_tokens (prunus.serve.logits_processors)
        tokens = sample(logits, [RowSampling(r.params.temperature, r.params.top_k, r.params.top_p, r.generator)
                                 for r in reqs])
        for r, t, logprob in zip(reqs, tokens, token_logprobs(reqs, logits, tokens)):
            r.last_token = t
            r.add_token(t, logprob)
        self.tokens_generated += len(reqs)

    def _retire(self, reqs: list[Request]) -> None:
        for r in reqs:
            if r.done or r.cancelled.is_set():
                if not r.done:
                    r.finish_reason = "cancelled"
                if self.caps.prefix_cache:  # prompt and answer, for the next turn (the row holds all but the last)
                    self.backend.store_prefix(r.slot, r.prompt_ids + r.generated)
                del self.active[r.slot]
                self._free(r.slot)
                r.finish()


def _worth_waiting(prompt: list[int], leader: list[int]) -> bool:
    """Whether ``prompt`` shares at least half its tokens (and a whole block) with ``leader``, whose blocks the
    prefix cache will hold once its prompt is in."""
    shared = 0
    for a, b in zip(prompt, leader):
        if a != b:
            break
        shared += 1
    usable = min(shared, len(prompt) - 1) // BLOCK * BLOCK
    return usable > 0 and 2 * usable >= len(prompt)
