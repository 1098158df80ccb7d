"""Decode steps through ``torch.compile``, gpt-fast style: one graph per batch bucket.

A compiled graph wants fixed shapes, and a continuous batch changes size every few
steps. So the batch is padded to a bucket (1, 2, 4, ... up to the slot count; the
padding repeats the first row, whose writes are then the same values to the same
place). Attention reads each row's cache line up to a key length rounded up to
``KEY_STEP`` positions past the longest row, with a mask of each row's own length;
that key length is the graph's one dynamic size, so a step reads the keys the rows
hold, not the whole ``max_len`` line (a 8,192-token line of SmolLM2-135M is 377 MB of
keys and values per row), and one graph serves every length (a layer's sliding window
narrows the mask in the model, as in the eager path): a short row's step is then faster than
one reading the whole line, and than eager. The prefill stays eager: prompts come in any
length, and one prefill per request is not where the time goes.

Compiled steps gain most for one row, whose step is per-operator overhead, and little for many
rows, bound by their matmuls; compiling costs seconds per bucket at load for the demo model and
minutes for SmolLM2-135M (the Engine's figures are in docs/results.md, Serving): see
:func:`choose_compile` for when ``compile="auto"`` turns it on.
"""

from __future__ import annotations

import warnings

import torch

from prunus.artifacts.errors import PrunusError

KEY_STEP = 64  # the compiled step's key length is the longest row's, rounded up to this
# compile="auto" compiles on these device types only (see choose_compile for the figures behind it)
AUTO_DEVICES = ("cuda",)


class CompileUnavailable(UserWarning):
    """torch.compile cannot build the decode graphs here; the engine decodes eagerly."""


def compile_unavailable(device: torch.device) -> str | None:
    """Why torch.compile cannot build decode graphs for ``device`` here, in a few words, or None.

    Inductor writes C++ for the CPU (a C++ compiler must be on the PATH) and Triton for CUDA.
    """
    try:
        if device.type == "cpu":
            from torch._inductor.cpp_builder import get_cpp_compiler

            get_cpp_compiler()
        elif device.type == "cuda":
            import triton  # noqa: F401
        else:
            return f"no inductor backend for {device.type}"
    except Exception as e:  # a missing compiler or package, whatever torch raises for it
        return f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else 'not found'}"
    return None


def choose_compile(compile, model) -> bool:
    """Whether the torch backend compiles its decode steps: ``compile`` True, False or "auto".

    "auto" compiles on the device types in ``AUTO_DEVICES`` (CUDA) where torch.compile runs, and
    decodes eagerly on the CPU, because there the compile does not pay for itself: a CPU decode step is bound
    by its fp32 matmuls, which compiling does not speed up, and a compile takes minutes per batch bucket; on a
    GPU a small model's step is bound by kernel launches, which one compiled graph per bucket removes (gpt-fast's
    static cache; vLLM's captured decode graphs). docs/defaults.md has the CPU measurements; the GPU side was
    not timed on prunus's machines.

    Where torch.compile cannot run, True (and "auto" where it would compile) decodes eagerly after a
    one-line :class:`CompileUnavailable` warning, never an error.
    """
    if compile is False:
        return False
    device = getattr(model, "input_device", None) or model.tok_embeddings.weight.device
    if compile == "auto" and device.type not in AUTO_DEVICES:
        return False
    why = compile_unavailable(device)
    if why is not None:
        warnings.warn(f"torch.compile cannot run here ({why}); decoding eagerly", CompileUnavailable, stacklevel=3)
        return False
    return True


def buckets(n_slots: int) -> list[int]:
    out, b = [], 1
    while b < n_slots:
        out.append(b)
        b *= 2
    return out + [n_slots]


class StaticStep:
    """The ``cache`` a compiled step's model sees: rows, positions and key indices as tensors.

    ``prunus.models.kv_cache.KVCacheProtocol`` over a :class:`prunus.runtime.batch_cache.BatchKVCache`'s
    storage. Needs ``update`` (writes at each row's position, returns the rows' cache lines up to
    ``len(keys)``, the whole line without ``keys``) and ``attn_mask`` (each row's keys up to its
    position). ``advance`` does nothing: the lengths move outside the graph
    (:meth:`CompiledDecode.__call__`). ``seq_len`` is None: the step passes positions.
    """

    seq_len = None

    def __init__(self, cache, rows: torch.Tensor, pos: torch.Tensor, keys: torch.Tensor | None = None):
        self.cache, self.rows, self.pos = cache, rows, pos
        keys = torch.arange(cache.max_len, device=pos.device) if keys is None else keys
        self.k_len = keys.shape[0]
        self.mask = (keys[None, :] <= pos).view(pos.shape[0], 1, 1, self.k_len)

    def update(self, layer_id: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        ck, cv = self.cache.k[layer_id], self.cache.v[layer_id]
        ck[self.rows[:, None], :, self.pos] = k.transpose(1, 2)
        cv[self.rows[:, None], :, self.pos] = v.transpose(1, 2)
        return ck[self.rows, :, :self.k_len], cv[self.rows, :, :self.k_len]

    def attn_mask(self, q_len: int, k_len: int) -> torch.Tensor:
        return self.mask

    def advance(self, n: int) -> None:
        pass


class CompiledDecode:
    def __init__(self, model, cache):
        self.model, self.cache = model, cache
        self.buckets = buckets(cache.n_slots)
        # freezing: the weights become constants, folded and prepacked; cpp_wrapper: the graph's calls from C++
        self._fn = torch.compile(self._step, dynamic=False, fullgraph=True,
                                 options={"freezing": True, "cpp_wrapper": True})

    def _step(self, tokens: torch.Tensor, rows: torch.Tensor, pos: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        return self.model(tokens, cache=StaticStep(self.cache, rows, pos, keys), positions=pos)[:, -1]

    def bucket(self, n: int) -> int:
        return next(b for b in self.buckets if b >= n)

    def key_len(self, longest: int) -> int:
        """Keys a step reads: ``longest`` (the longest row's, its new token included) rounded up to
        ``KEY_STEP``, within the cache; at least 2, so the dynamic size is never specialised as 0 or 1."""
        return max(2, min(self.cache.max_len, -(-longest // KEY_STEP) * KEY_STEP))

    @torch.inference_mode()
    def __call__(self, rows: list[int], tokens: list[int]) -> torch.Tensor:
        n = len(rows)
        pad = self.bucket(n) - n
        rows_t = torch.tensor(rows + rows[:1] * pad, dtype=torch.long)
        pos = self.cache.lengths[rows_t].view(-1, 1)
        longest = int(pos.max()) + 1
        if longest > self.cache.max_len:
            raise PrunusError(f"KV cache: {longest} tokens exceed its capacity of {self.cache.max_len}; "
                              "shorten the prompt or the output")
        device = self.cache.device
        keys = torch.arange(self.key_len(longest), device=device)
        torch._dynamo.maybe_mark_dynamic(keys, 0)
        tok = torch.tensor(tokens + tokens[:1] * pad, dtype=torch.long, device=device).view(-1, 1)
        logits = self._fn(tok, rows_t.to(device), pos.to(device), keys)[:n]
        self.cache.lengths[rows_t[:n]] += 1
        return logits.float()

    def warm_up(self, set_threads=None) -> None:
        """Compile every bucket now (rows from 0, cache rows used as scratch), not on a request's step."""
        for b in self.buckets:
            if set_threads is not None:
                set_threads(b)
            self.cache.lengths[:b] = 0
            self(list(range(b)), [0] * b)
        self.cache.lengths.zero_()
