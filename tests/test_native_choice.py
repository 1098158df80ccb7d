"""native="auto", the default (prunus.runtime.native_choice): a genai export loads on the native kernels wherever
they run, with no ONNX Runtime session in memory, and on ONNX Runtime elsewhere with the reason in the info;
--no-native keeps ONNX Runtime, --native never falls back, and the f16 KV cache cannot fall back."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from click.testing import CliRunner

from family_variants import family_model
from prunus.artifacts.errors import PrunusError
from prunus.artifacts.native_layout import NATIVE_WEIGHTS
from prunus.cli.main import cli
from prunus.export import export_model
from prunus.models import generate, save_model
from prunus.native.build import unavailable
from prunus.runtime.load_options import LoadOptions
from prunus.runtime.native_backend import NativeBackend
from prunus.serve import Engine

WHY = unavailable()
needs_kernels = pytest.mark.skipif(WHY is not None, reason=f"native kernels unavailable: {WHY}")
PROMPT, N = [5, 6, 7, 8], 6


@pytest.fixture(scope="module")
def export_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("choice")
    model = family_model("llama")
    save_model(model, root / "model", stage="train")
    export_model(root / "model", root / "export", progress=False)
    with torch.no_grad():
        want = generate(model, torch.tensor([PROMPT]), N)[0, len(PROMPT):].tolist()
    return root / "export", want


def _load(path, **kwargs):
    engine = Engine.load(path, max_batch=1, max_len=32, threads=1, **kwargs)
    with engine:
        tokens = engine.wait(engine.submit(PROMPT, N, temperature=0.0, ignore_eos=True)).token_ids
    return engine.info, engine.backend, tokens


@needs_kernels
def test_a_genai_export_runs_natively_by_default_with_one_copy_of_the_weights(export_dir):
    path, want = export_dir
    info, backend, tokens = _load(path)
    assert info["runtime"] == "native" and info["native"] == "on" and info["native_isa"]
    assert isinstance(backend, NativeBackend) and tokens == want
    info, _, tokens = _load(path, native=False)
    assert info["runtime"] == "ort_genai" and info["native"] == "off: native=False (--no-native)" and tokens == want


@needs_kernels
def test_the_default_session_holds_no_onnx_runtime_session(export_dir):
    path, _ = export_dir
    with Engine.load(path, max_batch=2, max_len=32, threads=1) as engine:
        assert isinstance(engine.backend, NativeBackend) and not hasattr(engine.backend, "session")
        assert "native_prompt_tokens" not in engine.info  # every pass native


def test_an_export_without_native_weights_falls_back_with_the_reason(export_dir, tmp_path):
    path, want = export_dir
    old = shutil.copytree(path, tmp_path / "old")  # an export of an older prunus: its graph only
    (old / NATIVE_WEIGHTS).unlink()
    manifest = json.loads((old / "prunus.json").read_text())
    del manifest["files"][NATIVE_WEIGHTS]
    (old / "prunus.json").write_text(json.dumps(manifest))
    info, _, tokens = _load(old)
    assert info["runtime"] == "ort_genai" and tokens == want
    assert info["native"].startswith(f"off: the export has no {NATIVE_WEIGHTS}")
    with pytest.raises(PrunusError, match="kv_dtype='f16' is the native decoder's KV cache, and the export has no"):
        Engine.load(old, kv_dtype="f16", max_len=32)


def test_a_cpu_without_the_kernels_falls_back_and_f16_is_refused(export_dir, monkeypatch):
    path, want = export_dir
    monkeypatch.setattr("prunus.native.build.cpu_supported", lambda: "an x86-64 CPU with AVX2 (this is riscv64)")
    info, _, tokens = _load(path)
    assert info["runtime"] == "ort_genai" and tokens == want
    assert info["native"] == "off: the native kernels need an x86-64 CPU with AVX2 (this is riscv64)"
    with pytest.raises(PrunusError, match="f16.*native kernels need an x86-64 CPU with AVX2"):
        Engine.load(path, kv_dtype="f16", max_len=32)


def test_a_native_load_refused_in_one_line_falls_back_only_under_auto(export_dir, monkeypatch):
    path, want = export_dir

    def no_compiler(where):
        raise PrunusError(f"{where}: the native decoder is compiled on first use and no C compiler was found")
    monkeypatch.setattr("prunus.runtime.native_backend.check_native", no_compiler)
    info, _, tokens = _load(path)
    assert info["runtime"] == "ort_genai" and tokens == want
    assert info["native"].startswith("off: ") and "no C compiler was found" in info["native"]
    with pytest.raises(PrunusError, match="no C compiler was found"):
        Engine.load(path, native=True, max_len=32)


def test_the_prompt_twin_keeps_onnx_runtime_under_auto(export_dir):
    path, _ = export_dir
    with pytest.raises(PrunusError, match="--prompt-graph .* is for an export of int8 / int4 weights"):
        Engine.load(path, prompt_graph=True, max_len=32)  # reached ONNX Runtime's twin: not the native runtime


def test_native_takes_true_false_or_auto_and_the_cli_flags(export_dir, assert_user_error):
    path, want = export_dir
    with pytest.raises(PrunusError, match="native='yes': choose True, False or 'auto'"):
        LoadOptions(native="yes").check()
    with pytest.raises(PrunusError, match="native=1: choose True, False or 'auto'"):
        LoadOptions(native=1).check()
    LoadOptions().check()  # auto: nothing to refuse
    r = CliRunner().invoke(cli, ["generate", str(path), "--prompt", "ab", "--max-new-tokens", "2", "--no-native"])
    assert r.exit_code == 0, r.output
    r = CliRunner().invoke(cli, ["info", str(path)], env={"COLUMNS": "200"})
    assert r.exit_code == 0 and "native decoding on this machine" in r.output


@needs_kernels
def test_serve_says_which_runtime_serves(export_dir, monkeypatch):
    from prunus.native.build import isa
    from prunus.serve.http_server import CompletionServer

    path, _ = export_dir

    def stop(self, poll_interval=0.5):
        raise KeyboardInterrupt
    monkeypatch.setattr(CompletionServer, "serve_forever", stop)
    for flags, words in (([], f"on prunus's native kernels ({isa()}; parity passed on {isa()})"),
                         (["--no-native"], "on onnxruntime (native off: native=False (--no-native))")):
        r = CliRunner().invoke(cli, ["serve", str(path), "--port", "0", "--max-batch", "1", *flags])
        assert r.exit_code == 0 and words in r.stderr, r.stderr


@needs_kernels
def test_native_with_the_prompt_twin_is_refused_in_one_line(export_dir):
    """The prompt twin is an ONNX Runtime graph, the native runtime holds no ONNX Runtime session: --native
    --prompt-graph is one line naming where the prompt graph is served, before anything loads."""
    path, _ = export_dir
    with pytest.raises(PrunusError, match=r"no runtime of the onnxruntime backend serves native=True and prompt_graph "
                                          r"together; drop --native or --prompt-graph$"):
        Engine.load(path, native=True, prompt_graph=True, max_len=32)
