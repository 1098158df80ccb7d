"""The native kernels' row groupings measured per shape and row count (prunus.native.plan): any grouping gives the
same bits as the fixed rules on the batch-invariant paths (every row count 1..17, every kind), the calibrated plan is
cached by the cache rules (keyed, verified when read, never followed through a symlink), a damaged or foreign cache is
one line and measured again, PRUNUS_NATIVE_PLAN=off keeps the fixed rules, and the engine's info names the plan."""

from __future__ import annotations

import ctypes
import json
import os
import stat

import numpy as np
import pytest

from prunus.artifacts.errors import PrunusError
from prunus.native.build import batch_invariant, isa, unavailable

WHY = unavailable()
pytestmark = pytest.mark.skipif(WHY is not None, reason=f"native kernels unavailable: {WHY}")

from prunus.native import plan as plan_mod  # noqa: E402
from prunus.native.decoder import NativeDecoder, _linear  # noqa: E402
from prunus.native.plan import N_CODES, PLAN_ENV, PLAN_ROWS, Plan, fixed_rule, load_plan  # noqa: E402
from prunus.native.weights import PackedModel, pack_blocks, pack_f32  # noqa: E402

DIM, HIDDEN, VOCAB, HD = 64, 96, 80, 16


def _q(rng, n, k, bits, zero=False):
    q = rng.integers(0, 256 if bits == 8 else 16, (n, k)).astype(np.uint8)
    scale = rng.uniform(1e-3, 2e-2, (n, k // 32)).astype(np.float32)
    z = rng.integers(0, 16, (n, k // 32)).astype(np.float32) if zero else None
    return pack_blocks(q, scale, z, bits)


def tiny_packed(seed: int = 0) -> PackedModel:
    """Two layers mixing every kind: int8, int4 (with zero points), fp32; an fp32 head; 64 wide."""
    rng = np.random.default_rng(seed)
    dims = {"n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "head_dim": HD, "hidden": HIDDEN, "vocab_size": VOCAB}
    angles = np.outer(np.arange(32), 1e4 ** (-np.arange(HD // 2) / (HD // 2))).astype(np.float32)
    emb = (0.5 * rng.standard_normal((VOCAB, DIM))).astype(np.float32)
    model = PackedModel(dims, 1e-5, HD ** -0.5, emb, np.cos(angles), np.sin(angles), np.ones(DIM, np.float32))
    f32 = lambda n, k: pack_f32((0.1 * rng.standard_normal((n, k))).astype(np.float32),  # noqa: E731
                                (0.1 * rng.standard_normal(n)).astype(np.float32))
    for bits in (8, 4):
        model.layers.append({"q": _q(rng, 4 * HD, DIM, bits), "k": _q(rng, 2 * HD, DIM, bits, zero=True),
                             "v": f32(2 * HD, DIM), "o": _q(rng, DIM, 4 * HD, bits), "gate": _q(rng, HIDDEN, DIM, 8),
                             "up": _q(rng, HIDDEN, DIM, 4, zero=True), "down": f32(DIM, HIDDEN),
                             "attn_norm": np.ones(DIM, np.float32), "ffn_norm": np.ones(DIM, np.float32),
                             "window": 0})
    model.head = pack_f32(emb)
    return model


def _decoder(packed, rows=17, threads=2):
    shape = (rows, 2, 32, HD)
    kv = [[np.zeros(shape, np.float32) for _ in range(2)] for _ in range(2)]
    return NativeDecoder(packed, kv[0], kv[1], rows, 32, threads=threads)


def _steps(dec, m: int) -> np.ndarray:
    """A 3-token prompt in each of m rows, then one decode step of the m rows together: the step's logits."""
    rng = np.random.default_rng(m)
    ids = rng.integers(0, VOCAB, (m, 3))
    logits = np.zeros((17, VOCAB), np.float32)
    dec.forward(ids, np.zeros(m, np.int32), np.full(m, 3, np.int32), 0, logits)
    dec.forward(ids[:, :1], np.full(m, 3, np.int32), np.ones(m, np.int32), 0, logits)
    return logits[:m].copy()


@pytest.fixture
def cache_home(tmp_path, monkeypatch):
    """A cache of the test's own; every shape timed (even the tiny model's), once per candidate."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.delenv(PLAN_ENV, raising=False)
    monkeypatch.setattr(plan_mod, "MIN_BYTES", 0)
    monkeypatch.setattr(plan_mod, "REPS", 1)
    return tmp_path / "cache"


needs_invariant = pytest.mark.skipif(WHY is None and not batch_invariant(), reason="the kernel path is not invariant")


@needs_invariant
@pytest.mark.parametrize("kind", ["f32", "q8", "q4", "q4z"])
@pytest.mark.parametrize("threads", [1, 2])
def test_every_grouping_gives_the_fixed_rules_bits_at_1_to_17_rows(kind, threads):
    from prunus.native.build import library

    rng = np.random.default_rng(3)
    n, k = 44, 96  # 11 tiles, the last one partial
    lin = (pack_f32(rng.standard_normal((n, k)).astype(np.float32), rng.standard_normal(n).astype(np.float32))
           if kind == "f32" else _q(rng, n, k, 8 if kind == "q8" else 4, zero=kind == "q4z"))
    lib = library()
    pool = lib.prunus_pool_new(threads)
    try:
        for m in range(1, 18):
            x = rng.standard_normal((m, k)).astype(np.float32)
            want = np.empty((m, n), np.float32)
            c = _linear(lin)
            lib.prunus_linear(ctypes.addressof(c), pool, m, x.ctypes.data, want.ctypes.data)
            for code in range(N_CODES):
                codes = np.full(PLAN_ROWS, code, np.uint8)
                c.plan = codes.ctypes.data
                got = np.full((m, n), np.nan, np.float32)
                lib.prunus_linear(ctypes.addressof(c), pool, m, x.ctypes.data, got.ctypes.data)
                assert np.array_equal(got, want), (kind, m, code)
    finally:
        lib.prunus_pool_free(pool)


@needs_invariant
def test_calibrated_and_random_plans_give_the_same_logits_as_the_fixed_rules(cache_home):
    packed = tiny_packed()
    dec = _decoder(packed)
    try:
        want = {m: _steps(dec, m) for m in range(1, 18)}
        calibrated = load_plan(packed, dec.lib, dec.pool, isa(), dec.threads)
        assert calibrated.how.startswith("calibrated") and calibrated.plans
        rng = np.random.default_rng(5)
        shuffled = Plan({k: rng.integers(0, N_CODES, PLAN_ROWS).tolist() for k in calibrated.plans}, "random")
        for plan in (calibrated, shuffled):
            dec.use_plan(plan)
            for m in range(1, 18):
                assert np.array_equal(_steps(dec, m), want[m]), (plan.how, m)
    finally:
        dec.close()


def _load(packed, dec):
    return load_plan(packed, dec.lib, dec.pool, isa(), dec.threads)


@needs_invariant
def test_the_plan_is_cached_keyed_and_private(cache_home):
    packed = tiny_packed()
    dec = _decoder(packed, rows=2)
    try:
        first = _load(packed, dec)
        assert first.how.startswith("calibrated (") and "\n" not in first.how
        second = _load(packed, dec)
        assert second.how.startswith("cached (") and second.plans == first.plans
        files = list((cache_home / "prunus" / "native" / "plans").glob("plan-*.json"))
        assert len(files) == 1
        assert stat.S_IMODE(files[0].stat().st_mode) == 0o600
        assert stat.S_IMODE(files[0].parent.stat().st_mode) == 0o700
        saved = json.loads(files[0].read_text())
        assert saved["key"]["isa"] == isa() and saved["key"]["threads"] == dec.threads
        assert sorted(saved["plans"]) == saved["key"]["shapes"]
        other = _decoder(packed, rows=2, threads=1)  # another thread count: another key, another file
        try:
            assert _load(packed, other).how.startswith("calibrated (")
        finally:
            other.close()
        assert len(list(files[0].parent.glob("plan-*.json"))) == 2
    finally:
        dec.close()


def _spoil(path, how):
    obj = json.loads(path.read_text())
    if how == "garbage":
        path.write_bytes(b"\x00{not json")
        return
    if how == "cpu":
        obj["key"]["cpu"] = "Some Other CPU 9000"
    elif how == "library":
        obj["key"]["library"] = "0" * 64
    elif how == "entry":
        next(iter(obj["plans"].values()))[3] = 99
    path.write_text(json.dumps(obj))


@needs_invariant
@pytest.mark.parametrize("how, phrase", [("garbage", "not valid JSON"), ("cpu", "measured on another CPU"),
                                         ("library", "another kernel library"), ("entry", "an entry is no grouping")])
def test_a_damaged_or_foreign_cache_is_one_line_and_measured_again(cache_home, how, phrase):
    packed = tiny_packed()
    dec = _decoder(packed, rows=2)
    try:
        _load(packed, dec)
        path = next((cache_home / "prunus" / "native" / "plans").glob("plan-*.json"))
        _spoil(path, how)
        again = _load(packed, dec)
        assert again.how.startswith("calibrated (") and phrase in again.how and "measured again" in again.how
        assert "\n" not in again.how
        assert _load(packed, dec).how.startswith("cached (")  # rewritten whole
    finally:
        dec.close()


@needs_invariant
def test_a_symlink_in_the_plan_cache_is_never_followed(cache_home, tmp_path):
    packed = tiny_packed()
    dec = _decoder(packed, rows=2)
    try:
        _load(packed, dec)
        path = next((cache_home / "prunus" / "native" / "plans").glob("plan-*.json"))
        target = tmp_path / "elsewhere.json"
        target.write_text("kept")
        path.unlink()
        os.symlink(target, path)
        again = _load(packed, dec)
        assert "a symlink" in again.how and again.how.startswith("calibrated (")
        assert not path.is_symlink() and path.is_file()
        assert target.read_text() == "kept"  # never written through
        plans = cache_home / "prunus" / "native" / "plans"
        plans_target = tmp_path / "plans-elsewhere"
        os.rename(plans, plans_target)
        os.symlink(plans_target, plans)  # the cache dir itself a symlink: refused, measured without caching
        refused = _load(packed, dec)
        assert refused.how.startswith("calibrated, not cached (") and "symlink" in refused.how
    finally:
        dec.close()


def test_plan_off_keeps_the_fixed_rules_and_a_bad_mode_is_one_line(cache_home, monkeypatch):
    packed = tiny_packed()
    dec = _decoder(packed, rows=2)
    try:
        monkeypatch.setenv(PLAN_ENV, "off")
        assert _load(packed, dec).how == f"default ({PLAN_ENV}=off)"
        assert not (cache_home / "prunus" / "native" / "plans").exists()
        monkeypatch.setenv(PLAN_ENV, "sometimes")
        with pytest.raises(PrunusError) as e:
            _load(packed, dec)
        assert PLAN_ENV in str(e.value) and "\n" not in str(e.value)
    finally:
        dec.close()


def test_fixed_rule_mirrors_the_kernels_defaults():
    assert [fixed_rule("q8", m) for m in (1, 4, 5, 6, 15, 16)] == [2, 3, 3, 6, 6, 7]
    assert [fixed_rule("f32", m) for m in (3, 6, 16)] == [2, 6, 7]
    assert plan_mod.candidates("q8", 16) == [3, 7] and 0 in plan_mod.candidates("f32", 2)


@needs_invariant
def test_engine_info_names_the_plan(cache_home, tmp_path):
    from family_variants import family_model
    from prunus.export import export_model
    from prunus.models import save_model
    from prunus.serve import Engine

    save_model(family_model("llama"), tmp_path / "model", stage="train")
    export_model(tmp_path / "model", tmp_path / "export", progress=False)
    with Engine.load(tmp_path / "export", max_batch=2, max_len=32, native=True, threads=2) as engine:
        assert engine.info["native_plan"].startswith(("calibrated (", "cached ("))  # export's parity run may measure it
        first = engine.wait(engine.submit([5, 6, 7], 6, temperature=0.0, ignore_eos=True)).token_ids
    with Engine.load(tmp_path / "export", max_batch=2, max_len=32, native=True, threads=2) as engine:
        assert engine.info["native_plan"].startswith("cached (")
        assert engine.wait(engine.submit([5, 6, 7], 6, temperature=0.0, ignore_eos=True)).token_ids == first
