"""Shared fixtures: tiny models, small corpora, one trained run reused by the CLI tests."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

# Passive OpenMP waiting, as `make test` and every prunus command set it; it must precede torch's import.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# `prunus serve` prepares model dirs into a cache (prunus.export.prepared): the tests' own, never the user's.
_CACHE = __import__("tempfile").mkdtemp(prefix="prunus-test-cache-")
os.environ["PRUNUS_CACHE_DIR"] = _CACHE
__import__("atexit").register(__import__("shutil").rmtree, _CACHE, True)

import torch  # noqa: E402

from prunus.models import Transformer, get_preset
from prunus.train_parallel import TrainConfig, train

# helper modules beside the tests (hf_family_cases: the Hugging Face family table) import by name; none
# shares a name with a prunus module
sys.path.insert(0, str(Path(__file__).parent))

# A tiny run: seconds on 2 CPU cores, on a slice of the built-in corpus.
TINY_RUN = dict(preset="tiny", seq_len=32, batch_size=4, steps=6, warmup_steps=2, eval_every=3, eval_tokens=2048,
                ckpt_every=0, max_corpus_bytes=200_000, progress=False)


@pytest.fixture
def tiny_model():
    torch.manual_seed(0)
    model = Transformer(get_preset("tiny"))
    model.init_weights()
    return model.eval()


@pytest.fixture
def tiny_cfg():
    """TrainConfig of a tiny run writing to ``out``, with changes."""
    return lambda out, **changes: TrainConfig(out=str(out), **{**TINY_RUN, **changes})


@pytest.fixture(scope="session")
def trained_run(tmp_path_factory):
    """A finished tiny run (read-only for tests: copy before changing it)."""
    out = tmp_path_factory.mktemp("runs") / "tiny"
    train(TrainConfig(out=str(out), **TINY_RUN))
    return out


@pytest.fixture
def text_file(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text("the quick brown fox jumps over the lazy dog\n" * 400)
    return path


def _assert_user_error(result, *needles):
    """A CLI result that is a user's mistake: exit code 2, one ``Error:`` line holding every needle."""
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: "), result.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]
    assert result.exception is None or isinstance(result.exception, SystemExit)


@pytest.fixture
def assert_user_error():
    return _assert_user_error


def _child_pids(pid: int) -> list[int]:
    """Pids whose parent is ``pid`` (Linux /proc)."""
    kids = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                stat = (d / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                kids.append(int(d.name))
    return kids


@pytest.fixture
def children():
    return _child_pids


def _spawn_jobs(worker, nproc: int, jobs: list[dict], tmp_path) -> dict:
    """Run ``jobs`` in one torchrun process group of ``nproc`` ranks (one thread each) with the
    ``worker`` script; return what its rank 0 wrote, by job name."""
    spec, out = Path(tmp_path) / f"spec{nproc}.json", Path(tmp_path) / f"out{nproc}.json"
    spec.write_text(json.dumps(jobs))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
                           str(worker), str(spec), str(out)], env=env, capture_output=True, text=True, timeout=600)
    assert out.exists(), proc.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="session")
def spawn_jobs():
    return _spawn_jobs


# --- the quick tier: `make test-quick` runs `pytest -m "not slow"` -----------------------------------------
# A test is slow when it starts processes (it uses ``spawn_jobs``, or is listed below) or took over ~4 s on a
# busy 2-core machine (about 1.5 s on an idle one), as `pytest --durations=0` measured: a whole module
# ("test_x.py"), one test function with every parametrization ("test_x.py::name"), or one case
# ("test_x.py::name[id]"). Mark a new slow test here or with @pytest.mark.slow.
SLOW_REASONS = {
    "starts processes (torchrun groups, tensor-parallel workers, servers, fresh interpreters)": [
        "test_parallel.py", "test_parallel_cli.py", "test_context_parallel.py", "test_tp_nd.py",
        "test_parameter_server.py", "test_reliability_process.py", "test_restart.py", "test_serve_http.py",
        "test_server_door.py", "test_cli_startup.py", "test_cli_first_run.py",
        "test_families_stages.py::test_engine_tp2_workers_give_the_tp1_tokens",
        "test_serve.py::test_tensor_parallel_equals_one_process_and_leaves_no_workers",
        "test_serve.py::test_shared_memory_all_reduce_sums_identically_on_every_rank",
        "test_reliability_data.py::test_interrupted_overwrite_keeps_the_old_run",
        "test_export_logging.py::test_importing_the_quantizer_leaves_the_root_logger_alone",
    ],
    "every code block of README.md and docs/ in reading order": ["test_readme.py"],
    "ONNX export (torch.onnx.export: seconds to a minute a graph) or ONNX Runtime graphs": [
        "test_int4_export.py", "test_int4_qdq.py", "test_genai_graph.py", "test_genai_prompt_graph.py",
        "test_genai_compat.py",
        "test_export.py::test_export_dir_follows_the_contract",
        "test_export.py::test_int8_export_quantizes_every_matmul",
        "test_export.py::test_quantized_graphs_hold_the_stored_weights",
        "test_export_logging.py::test_export_and_quantize_log_nothing_under_a_root_logger_at_info",
        "test_families_stages.py::test_export_parity_and_onnxruntime_greedy",
        "test_families_stages.py::test_int8_export_of_a_model_with_biases",
        "test_int4_float_zero.py::test_float_zero_model_saves_loads_exports_and_writes_q4_1",
        "test_int8_export_outliers.py::test_planted_massive_activation_passes_int8_export_parity",
        "test_native_decoder.py::test_fp32_passes_equal_onnx_runtimes_on_the_same_buffers",
        "test_native_decoder.py::test_native_is_refused_where_it_cannot_run",
        "test_native_decoder.py::test_quantized_graphs_are_as_close_to_torch_as_onnx_runtimes",
        "test_native_decoder.py::test_the_parity_check_runs_through_the_native_kernels",
        "test_serve.py::test_onnxruntime_backend_greedy_equals_torch",
        "test_any_model.py::test_cli_trains_and_exports_any_module",
    ],
    "trains, compresses or compiles whole models": [
        "test_serve.py::test_compiled_decode_gives_the_eager_tokens",
        "test_train.py::test_a_loss_far_below_the_start_on_a_repetitive_text",
        "test_train.py::test_async_checkpoints_resume_like_sync_ones",
        "test_train.py::test_gradient_accumulation_matches_one_large_batch",
        "test_train.py::test_resumed_run_equals_uninterrupted_run_bit_exactly",
        "test_cli.py::test_train_eval_generate_info", "test_cli.py::test_train_stop_and_resume_via_cli",
        "test_init_from.py::test_fine_tuning_resumes_bit_exactly",
        "test_lora.py::test_a_stopped_lora_run_resumes_bit_exactly",
        "test_lora.py::test_peft_loads_the_adapter_with_the_merged_logits",
        "test_lora.py::test_qlora_keeps_the_base_quantized_and_trains_adapters_only",
        "test_distill.py::test_a_few_steps_reduce_the_kd_loss_and_the_pass_returns_a_clean_student",
        "test_compress.py::test_cli_compress_end_to_end",
        "test_compress.py::test_runner_chains_pruning_distillation_and_quantization",
        "test_int4.py::test_cli_int4_compress_and_bad_input",
        "test_int4.py::test_shipped_int4_recipes_quantize_the_head_to_int8_and_untie_it",
        "test_int4_clip.py::test_the_pass_reports_the_clip_and_refuses_bad_requests",
        "test_device_map.py::test_placements_generate_the_same_tokens",
        "test_gguf.py::test_transformers_reads_our_q4_0_gguf_with_prunus_logits",
        "test_no_code_runs.py::test_every_run_dir_file_planted_with_a_payload",
        "test_reliability_inputs.py::test_a_damaged_newest_checkpoint_falls_back_to_the_newest_intact_one",
        "test_reliability_inputs.py::test_recipes_and_configs[r.yaml-nested too deeply]",
        "test_plots.py::test_report_plot_layout",
    ],
}
SLOW = {entry for entries in SLOW_REASONS.values() for entry in entries}


def pytest_collection_modifyitems(config, items):
    for item in items:
        module = item.nodeid.split("::", 1)[0].rsplit("/", 1)[-1]
        names = {module, f"{module}::{getattr(item, 'originalname', item.name)}", f"{module}::{item.name}"}
        if "spawn_jobs" in item.fixturenames or names & SLOW:
            item.add_marker(pytest.mark.slow)
