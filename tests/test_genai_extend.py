"""Chunked prefill (``extend``) and automatic prefix caching on the genai backend (ONNX Runtime, and the native
kernels with float32 and float16 KV caches): logits after ``extend`` equal a whole-prompt prefill, a row continuing
while others decode included; the engine's greedy tokens with prompts in chunks equal whole prompts; with the prefix
cache on, tokens equal those without it (greedy and seeded sampling) and a hit skips the cached tokens."""

from __future__ import annotations

import numpy as np
import pytest

from family_variants import family_model
from prunus.export import export_model
from prunus.export.genai_graph import GENAI_GRAPH
from prunus.models import save_model
from prunus.native.build import unavailable
from prunus.runtime.genai_session import GenaiSession
from prunus.runtime.ort_genai import GenaiBackend
from prunus.runtime.prefix_cache import BLOCK
from prunus.serve import Engine

NATIVE_WHY = unavailable()
# (native, kv_dtype): ONNX Runtime, the native runtime, the native runtime's float16 cache
NEEDS_NATIVE = pytest.mark.skipif(NATIVE_WHY is not None, reason=f"native kernels unavailable: {NATIVE_WHY}")
MODES = [(False, "f32"), pytest.param(True, "f32", marks=NEEDS_NATIVE), pytest.param(True, "f16", marks=NEEDS_NATIVE)]
# float32 logits of the same sums in another order (ONNX Runtime's per-row pass, native's tiles); float16 keys and
# values rounded at other positions than a whole prompt's pass rounds them: a tolerance relative to the largest logit
TOLERANCE = {"f32": 1e-4, "f16": 2e-2}
RNG = np.random.default_rng(0)
SYSTEM = [int(t) for t in RNG.integers(1, 300, 3 * BLOCK + 5)]  # three full blocks and a part
PROMPTS = [SYSTEM + [int(t) for t in RNG.integers(1, 300, n)] for n in (4, 11, 1, 20)]


@pytest.fixture(scope="module")
def export_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("genai_extend")
    save_model(family_model("llama"), root / "model", stage="train")
    export_model(root / "model", root / "export", progress=False)
    return root / "export"


def _backend(export_dir, native: bool, kv_dtype: str, **kw) -> GenaiBackend:
    from prunus.export.export_dir import genai_dims
    from prunus.models import load_model

    dims = genai_dims(load_model(export_dir.parent / "model"))
    dims = {k: dims[k] for k in ("n_layers", "n_kv_heads", "head_dim", "vocab_size")}
    if native:  # the native runtime over the export's native weights: every pass in the kernels, rows are slots
        from prunus.native.weights import native_weights_file, read_native_weights
        from prunus.runtime.native_backend import NativeBackend

        packed = read_native_weights(native_weights_file(export_dir), dims)
        return NativeBackend(packed, 3, 96, threads=1, kv_dtype=kv_dtype, **kw)
    session = GenaiSession(export_dir / GENAI_GRAPH, **dims, n_slots=3, max_len=96, threads=1)
    return GenaiBackend(session, 3, 96, **kw)


def _slots(backend, rows: list[int]) -> list[int]:
    """Where ``rows`` are held: the genai backend's slots, the native runtime's rows themselves."""
    return [backend.slot_of[r] for r in rows] if hasattr(backend, "slot_of") else rows


@pytest.mark.parametrize("native, kv_dtype", MODES)
def test_extend_gives_the_logits_of_a_whole_prompt(export_dir, native, kv_dtype):
    """Rows 0 and 2 take their prompts in pieces of different lengths (one pass, rows at different positions)
    while row 1 joins whole and decodes between the pieces; every row's logits equal a whole-prompt prefill's."""
    whole = _backend(export_dir, native, kv_dtype)
    a, b, c = PROMPTS[3], PROMPTS[1], PROMPTS[0]
    want = whole.prefill([0, 1, 2], [a, b, c]).numpy()
    want_step = whole.decode([1], [7]).numpy()
    chunked = _backend(export_dir, native, kv_dtype)
    chunked.prefill([0, 2], [a[:10], c[:30]])
    got_b = chunked.prefill([1], [b]).numpy()
    got_step = chunked.decode([1], [7]).numpy()  # row 1 decodes alone: the rows still prefilling wait
    chunked.extend([2, 0], [c[30:40], a[10:33]])
    got = chunked.extend([0, 2], [a[33:], c[40:]]).numpy()
    scale = TOLERANCE[kv_dtype] * np.abs(want).max()
    assert np.abs(got[0] - want[0]).max() < scale and np.abs(got[1] - want[2]).max() < scale
    assert np.abs(got_b - want[1]).max() < scale
    assert np.abs(got_step - want_step).max() < scale
    assert list(chunked.lengths[_slots(chunked, [0, 1, 2])]) == [len(a), len(b) + 1, len(c)]


def test_onnx_runtime_extends_row_by_row_exactly(export_dir):
    """Without the native kernels every piece is its own batch-1 pass of GroupQueryAttention: the same sums in the
    same order as the whole prompt, so the logits are the whole prompt's to float32 rounding."""
    whole, chunked = _backend(export_dir, False, "f32"), _backend(export_dir, False, "f32")
    want = whole.prefill([0, 1], PROMPTS[:2]).numpy()
    chunked.prefill([0, 1], [PROMPTS[0][:5], PROMPTS[1][:17]])
    got = chunked.extend([1, 0], [PROMPTS[1][17:], PROMPTS[0][5:]]).numpy()
    assert np.abs(got[[1, 0]] - want).max() < 1e-5 * np.abs(want).max()


def _answers(engine, **sampling):
    requests = [engine.submit(p, 10, ignore_eos=True, **sampling) for p in PROMPTS]
    return [engine.wait(r).token_ids for r in requests]


@pytest.mark.parametrize("native, kv_dtype", MODES)
def test_chunked_prompts_and_the_prefix_cache_keep_the_tokens(export_dir, native, kv_dtype):
    """Four requests at once, two rows (the others wait for a row): prompts in chunks of 8 tokens give the greedy
    tokens of whole prompts; with a prefix cache, the same tokens greedy and seeded, and the requests after the first
    start from the shared prompt's cached blocks."""
    kw = dict(max_batch=2, max_len=96, threads=1, native=native, kv_dtype=kv_dtype)
    with Engine.load(export_dir, prefill_chunk=None, **kw) as plain:
        greedy, seeded = _answers(plain), _answers(plain, temperature=0.9, top_k=20, seed=3)
    with Engine.load(export_dir, prefill_chunk=8, **kw) as chunked:
        assert chunked.backend.capabilities.extend and chunked.backend.capabilities.prefill_chunk == 8
        assert _answers(chunked) == greedy
    with Engine.load(export_dir, prefill_chunk=8, prefix_cache_mb=1, **kw) as cached:
        assert _answers(cached) == greedy
        assert _answers(cached, temperature=0.9, top_k=20, seed=3) == seeded
        stats = dict(cached.info["prefix_cache"])
    assert stats["hits"] >= 2 * len(PROMPTS) - 1  # all but the very first found the shared prompt's blocks
    assert stats["reused_tokens"] >= stats["hits"] * 3 * BLOCK
    assert stats["lookups"] == 2 * len(PROMPTS)


def test_a_hit_runs_only_the_tokens_after_the_cached_blocks(export_dir):
    """restore_prefix holds the cached blocks (whole ones, never the prompt's last token), and the one extend after
    it runs the rest: the logits of the whole prompt, from a pass over the uncached tokens alone."""
    backend = _backend(export_dir, False, "f32", prefix_cache_mb=1)
    first, second = PROMPTS[1], PROMPTS[2]
    backend.prefill([0], [first])
    backend.store_prefix(0, first)
    want = _backend(export_dir, False, "f32").prefill([0], [second]).numpy()
    ran, extend = [], backend.session.extend

    def counted(start, held, pieces):  # the tokens each pass runs
        ran.append(sum(map(len, pieces)))
        return extend(start, held, pieces)

    backend.session.extend = counted
    held = backend.restore_prefix(1, second)
    assert held == 3 * BLOCK and backend.prefix.stats["reused_tokens"] == held
    got = backend.extend([1], [second[held:]]).numpy()
    assert ran == [len(second) - held]
    assert np.abs(got - want).max() < 1e-5 * np.abs(want).max()
    assert backend.restore_prefix(2, [999 % 300] + second[1:]) == 0  # another first token: nothing matches
    assert 2 not in backend.slot_of


def test_speculative_decoding_on_a_genai_export_needs_the_native_kernels(export_dir):
    """A genai export speculates on the native kernels (they verify drafts in one pass); on ONNX Runtime it is refused
    in one line naming its flag."""
    from prunus.artifacts.errors import PrunusError

    refusal = r"speculative decoding is not served for an ONNX export dir .*only for: .*prunus's kernels.*drop --speculative"
    with pytest.raises(PrunusError, match=refusal) as e:
        Engine.load(export_dir, max_batch=1, max_len=96, threads=1, native=False, draft="ngram")
    assert "\n" not in str(e.value)
    with Engine.load(export_dir, max_batch=1, max_len=96, threads=1, prefix_cache_mb=1, draft="ngram") as engine:
        assert engine.info["runtime"] == "native" and engine.backend.capabilities.verify


@pytest.mark.parametrize("given, chunk", [({}, 64), ({"prefill_chunk": 24}, 24), ({"prefill_chunk": 256}, 256),
                                          ({"prefill_chunk": None}, None)])
def test_the_prefill_chunk_is_the_backends_own_unless_given(export_dir, given, chunk):
    """The default, "auto" (256 on the torch backend), is the genai backend's measured 64; a chunk given is kept
    (256 too), and None prefills whole prompts through ``extend`` still (a prefix cache's rest of a prompt)."""
    with Engine.load(export_dir, max_batch=1, max_len=96, threads=1, **given) as engine:
        caps = engine.backend.capabilities
        assert caps.extend and caps.prefill_chunk == chunk
