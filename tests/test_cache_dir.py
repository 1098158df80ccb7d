"""The caches prunus keeps for itself (prunus.artifacts.cache_dir): private dirs and lock files, never followed
through a symlink, and an entry used only when it verifies, else rebuilt atomically; the native kernels' build
cache (a planted library is never loaded) and TensorRT's timing cache keep the same rules."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess

import pytest

from prunus.artifacts import cache_dir
from prunus.artifacts.errors import PrunusError
from prunus.artifacts.manifest_schema import sha256_file
from prunus.export import tensorrt_timing
from prunus.native import build
from prunus.native.build import unavailable

FIX = "or set THE_ENV to a dir of your own"


def test_a_cache_dir_is_made_private_and_a_symlinked_one_refused(tmp_path):
    base = tmp_path / "base"
    made = cache_dir.safe_dir(base / "a" / "b", base, FIX)
    assert [stat.S_IMODE(os.lstat(p).st_mode) for p in (base, base / "a", made)] == [0o700] * 3
    os.chmod(made, 0o755)
    cache_dir.safe_dir(made, base, FIX)
    assert stat.S_IMODE(os.lstat(made).st_mode) == 0o700
    (tmp_path / "elsewhere").mkdir()
    (base / "link").symlink_to(tmp_path / "elsewhere", target_is_directory=True)
    with pytest.raises(PrunusError, match=f"^{base / 'link'}: is a symlink .*; remove it, {FIX}$"):
        cache_dir.safe_dir(base / "link" / "c", base, FIX)
    assert list((tmp_path / "elsewhere").iterdir()) == []
    os.chmod(base, 0o777)  # a base others may write to: refused, not narrowed behind the user's back
    with pytest.raises(PrunusError, match="is writable by other users"):
        cache_dir.safe_dir(made, base, FIX)


@pytest.mark.parametrize("planted", ["symlink", "fifo"])
def test_a_lock_path_that_is_no_plain_file_is_refused(tmp_path, planted):
    lock = tmp_path / ".x.lock"
    if planted == "symlink":
        lock.symlink_to(tmp_path / "target")
    else:
        os.mkfifo(lock)
    with pytest.raises(PrunusError, match=f"^{lock}: is (a symlink|not a lock file)"):
        with cache_dir.locked(lock, FIX):
            pass
    assert not (tmp_path / "target").exists()


def test_a_lock_file_is_created_private(tmp_path):
    with cache_dir.locked(tmp_path / ".x.lock", FIX):
        assert stat.S_IMODE(os.lstat(tmp_path / ".x.lock").st_mode) == 0o600


def test_a_failed_rebuild_leaves_nothing_half_written(tmp_path):
    entry = tmp_path / "entry"

    def build(tmp):
        tmp.mkdir()
        (tmp / "half").write_bytes(b"x")
        raise PrunusError("the build failed")
    with pytest.raises(PrunusError, match="the build failed"):
        cache_dir.verified_or_rebuilt(entry, cache_dir.entry_problem, build, tmp_path / ".entry.lock", FIX)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".entry.lock"]


def test_an_entry_holding_a_symlink_does_not_verify(tmp_path):
    (tmp_path / "entry").mkdir()
    (tmp_path / "entry" / "f").symlink_to("/etc/hostname")
    assert cache_dir.entry_problem(tmp_path / "entry") == "holds f, which is not a plain file"


# --- the native kernels' build cache ----------------------------------------------------------------------------

needs_native = pytest.mark.skipif(unavailable() is not None, reason=f"native kernels unavailable: {unavailable()}")


@pytest.fixture()
def native_cache(tmp_path, monkeypatch):
    """An empty build cache; a rebuild copies this process's verified library instead of compiling (counted)."""
    real = build.library()._name
    builds = []

    def fake_build(cc, record, tmp):
        builds.append(tmp)
        tmp.mkdir()
        shutil.copyfile(real, tmp / build.LIB)
        (tmp / build.RECORD).write_text(json.dumps({**record, "files": {build.LIB: sha256_file(tmp / build.LIB)}}))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setattr(build, "_build", fake_build)
    build.library.cache_clear()
    yield builds
    build.library.cache_clear()


def _entry():
    record = build.build_record(build._compiler())
    return build.build_dir(record), record


@needs_native
@pytest.mark.parametrize("record", ["none", "another hash"])
def test_a_planted_library_in_the_build_cache_is_never_loaded(native_cache, tmp_path, record):
    marker = tmp_path / "loaded"
    src = tmp_path / "planted.c"
    src.write_text('#include <stdio.h>\n__attribute__((constructor)) static void run(void) '
                   f'{{ FILE *f = fopen("{marker}", "w"); if (f) fclose(f); }}\n')
    entry, saved = _entry()
    entry.mkdir(parents=True)
    subprocess.run(["cc", "-shared", "-fPIC", str(src), "-o", str(entry / build.LIB)], check=True)
    if record == "another hash":
        (entry / build.RECORD).write_text(json.dumps({**saved, "files": {build.LIB: "0" * 64}}))
    assert build.build_problem(entry, saved) is not None
    lib = build.library()
    assert not marker.exists() and len(native_cache) == 1 and build.build_problem(entry, saved) is None
    assert lib.prunus_abi() == build.ABI
    assert stat.S_IMODE(os.lstat(build._cache_dir()).st_mode) == 0o700


@needs_native
def test_a_verified_build_is_loaded_without_building_and_a_symlinked_one_replaced(native_cache, tmp_path):
    build.library()
    entry, saved = _entry()
    assert len(native_cache) == 1
    build.library.cache_clear()
    build.library()
    assert len(native_cache) == 1  # verified: loaded as it is
    elsewhere = shutil.copytree(entry, tmp_path / "elsewhere")
    shutil.rmtree(entry)
    entry.symlink_to(elsewhere, target_is_directory=True)
    build.library.cache_clear()
    build.library()
    assert len(native_cache) == 2 and entry.is_dir() and not entry.is_symlink() and (elsewhere / build.LIB).is_file()


@needs_native
def test_a_symlinked_build_cache_dir_is_refused(native_cache, tmp_path):
    (tmp_path / "elsewhere").mkdir()
    build._cache_dir().parent.mkdir(parents=True)
    build._cache_dir().symlink_to(tmp_path / "elsewhere", target_is_directory=True)
    with pytest.raises(PrunusError, match=r"native: is a symlink .*set XDG_CACHE_HOME"):
        build.library()
    assert list((tmp_path / "elsewhere").iterdir()) == [] and native_cache == []


# --- TensorRT's timing cache ------------------------------------------------------------------------------------

def test_tensorrt_timings_are_read_only_from_an_entry_that_verifies(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    entry = tensorrt_timing.timing_entry("10.9", "NVIDIA H100")
    assert tensorrt_timing.cached_timings(entry) == b""  # none yet: the build measures
    timings = tmp_path / "timings"
    timings.write_bytes(b"timings")
    tensorrt_timing.store_timings(entry, timings)
    assert tensorrt_timing.cached_timings(entry) == b"timings"
    assert entry != tensorrt_timing.timing_entry("10.9", "NVIDIA H200")  # keyed by what they were measured on
    (entry / tensorrt_timing.TIMING).write_bytes(b"planted")
    assert tensorrt_timing.cached_timings(entry) == b""
    elsewhere = shutil.copytree(entry, tmp_path / "elsewhere")
    shutil.rmtree(entry)
    entry.symlink_to(elsewhere, target_is_directory=True)
    assert tensorrt_timing.cached_timings(entry) == b""  # a symlinked entry is not followed...
    tensorrt_timing.store_timings(entry, timings)  # ...and is replaced, its target untouched
    assert not entry.is_symlink() and tensorrt_timing.cached_timings(entry) == b"timings"
    assert (elsewhere / tensorrt_timing.TIMING).read_bytes() == b"planted"


# --- finite weights (prunus.artifacts.finite_weights): what a re-hashed cache entry cannot hide ---------------------

@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "float64", "float8_e4m3fn"])
def test_a_nan_or_infinity_is_found_in_safetensors_of_every_float_type(tmp_path, dtype):
    import torch
    from safetensors.torch import save_file

    from prunus.artifacts.finite_weights import nonfinite_weights

    good = torch.randn(3, 5).to(getattr(torch, dtype))
    bad = good.clone()
    bad[2, 4] = float("inf") if dtype == "float16" else float("nan")
    save_file({"a": good, "codes": torch.arange(6, dtype=torch.uint8)}, tmp_path / "good.safetensors")
    save_file({"a": good, "b": bad}, tmp_path / "bad.safetensors")
    assert nonfinite_weights(tmp_path, ["good.safetensors", "notes.txt"]) is None
    found = nonfinite_weights(tmp_path, ["good.safetensors", "bad.safetensors"])
    assert found == "bad.safetensors: b holds NaN or infinity"


@pytest.mark.parametrize("stored", ["raw", "typed field", "external data"])
def test_a_nan_is_found_in_an_onnx_initializer_however_it_is_stored(tmp_path, stored):
    import numpy as np
    import onnx
    from onnx import helper, numpy_helper

    from prunus.artifacts.finite_weights import nonfinite_weights

    values = np.arange(2048, dtype=np.float32)
    values[1000] = np.nan
    if stored == "typed field":
        weight = helper.make_tensor("w", onnx.TensorProto.FLOAT, [2048], values.tolist())
    else:
        weight = numpy_helper.from_array(values, "w")
    graph = helper.make_graph([helper.make_node("Add", ["x", "w"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2048])],
                              [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [2048])], [weight])
    model = helper.make_model(graph)
    external = {"save_as_external_data": True, "location": "g.onnx.data", "size_threshold": 0}
    onnx.save_model(model, str(tmp_path / "g.onnx"), **(external if stored.startswith("ext") else {}))
    assert (tmp_path / "g.onnx.data").exists() == stored.startswith("ext")
    assert nonfinite_weights(tmp_path, ["g.onnx"]) == "g.onnx: initializer 'w' holds nan at element 1000 of 2048"
