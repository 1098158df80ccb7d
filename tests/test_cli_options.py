"""The CLI's options come from the library: train's from TrainConfig's fields, the choices from one constant each;
one --device default; --moe-top-k; compress's --distill-* arguments; messages that fit their caller."""

from __future__ import annotations

import dataclasses
import json
import shutil

import click
import pytest
from click.testing import CliRunner

from prunus.cli.main import cli
from prunus.cli.train import config_options
from prunus.artifacts.errors import PrunusError
from prunus.runtime.registry import BACKENDS
from prunus.train_parallel.config import PP_SCHEDULES, TrainConfig


def run(*args):
    return CliRunner().invoke(cli, [str(a) for a in args])


def params(verb: str) -> dict[str, click.Parameter]:
    command = cli.get_command(click.Context(cli), verb)
    return {p.name: p for p in command.params}


def test_every_train_setting_is_an_option_with_help():
    options = params("train")
    for f in dataclasses.fields(TrainConfig):
        if f.name == "model":  # set through the MoE options (and --config)
            continue
        assert f.name in options, f.name
        assert f.metadata["help"].strip(), f.name
    for p in options.values():
        assert isinstance(p, click.Argument) or p.hidden or (p.help or "").strip(), p.name
    assert options["steps"].type is click.INT and options["lr"].type is click.FLOAT
    assert options["timeout_s"].opts == ["--timeout"] and options["seq_len"].default is None
    assert options["bf16"].secondary_opts == ["--no-bf16"]
    assert options["async_checkpoint"].secondary_opts == ["--sync-checkpoint"]


def test_every_option_of_every_verb_has_help():
    from prunus.cli.main import VERBS

    for verb in VERBS:
        for p in params(verb).values():
            assert not isinstance(p, click.Option) or p.hidden or (p.help or "").strip(), (verb, p.opts)


def test_a_new_setting_is_one_field():
    @dataclasses.dataclass
    class Settings:
        warmup_ratio: float | None = dataclasses.field(default=None, metadata={"help": "Warm up over this fraction."})
        schedule: str = dataclasses.field(default="b", metadata={"help": "The schedule.", "choices": ("a", "b")})
        fused: bool = dataclasses.field(default=True, metadata={"help": "Fused kernels."})

    ratio, schedule, fused = config_options(Settings)
    assert ratio.opts == ["--warmup-ratio"] and ratio.type is click.FLOAT and ratio.help == "Warm up over this fraction."
    assert "One of: a, b." in schedule.help and schedule.default == "b"
    assert fused.opts == ["--fused"] and fused.secondary_opts == ["--no-fused"] and fused.default is True


def test_choices_come_from_the_library_constants():
    from prunus.train_parallel.pipeline import pipeline_parallel

    assert pipeline_parallel.SCHEDULES is PP_SCHEDULES
    assert all(name in params("train")["pp_schedule"].help for name in PP_SCHEDULES)
    for verb in ("generate", "serve"):
        assert tuple(params(verb)["backend"].type.choices) == BACKENDS


def test_one_device_default():
    for verb in ("train", "serve", "generate", "eval"):
        device = params(verb)["device"]
        assert device.default == "auto" and "cuda when available, else cpu" in device.help, verb


def test_moe_top_k(tmp_path, assert_user_error):
    r = run("train", "--preset", "tiny", "--n-experts", 4, "--moe-top-k", 1, "--print-config")
    assert r.exit_code == 0, r.output
    assert "top_k = 1" in r.output and "n_experts = 4" in r.output
    assert_user_error(run("train", "--preset", "tiny", "--n-experts", 4, "--top-k", 1, "--out", tmp_path / "o"),
                      "--moe-top-k")
    assert not (tmp_path / "o").exists()


def test_generate_checks_sampling_with_the_library_before_loading(tmp_path, assert_user_error):
    absent = tmp_path / "absent"  # never read: the sampling arguments are refused first
    assert_user_error(run("generate", absent, "--prompt", "x", "--max-new-tokens", 0), "--max-new-tokens 0", "positive")
    assert_user_error(run("generate", absent, "--prompt", "x", "--top-p", 2), "--top-p 2.0", "(0, 1]")


def test_compress_distill_arguments_reach_the_pass(tmp_path, trained_run, assert_user_error):
    from prunus.cli.compress import passes_from

    passes, _ = passes_from(None, None, None, "keep-every:2", {"steps": 7, "batch_size": 2, "lr": 5e-4})
    assert passes == [("distill", {"student": "keep-every:2", "steps": 7, "batch_size": 2, "lr": 5e-4})]
    assert_user_error(run("compress", trained_run / "model", "--quantize", "int8-weight-only", "--distill-steps", 3,
                          "--out", tmp_path / "o"), "--distill-steps", "--distill")
    assert_user_error(run("compress", trained_run / "model", "--distill", "keep-every:2", "--distill-steps", -1,
                          "--out", tmp_path / "o"), "steps")
    assert not (tmp_path / "o").exists()


def test_compress_ranges_are_checked_by_the_library(tmp_path, trained_run):
    from prunus.compress import compress

    for kwargs, needle in (({"eval_tokens": 0}, "--eval-tokens 0"), ({"seq_len": 0}, "--seq-len 0"),
                           ({"max_corpus_bytes": 0}, "--max-corpus-bytes 0")):
        with pytest.raises(PrunusError, match=needle):
            compress(trained_run / "model", [("quantize", {"scheme": "int8-weight-only"})], tmp_path / "o", **kwargs)
    assert not (tmp_path / "o").exists()


def test_run_dir_messages_name_api_arguments_and_the_cli_names_flags(tmp_path, trained_run, assert_user_error):
    from prunus.train_parallel.run_dir import check_run_dir

    out = tmp_path / "run"
    shutil.copytree(trained_run, out)
    with pytest.raises(PrunusError) as e:
        check_run_dir(TrainConfig(out=str(out), preset="tiny"), resume=False, overwrite=False)
    assert "overwrite=True" in str(e.value) and "--" not in str(e.value)
    assert_user_error(run("train", "--preset", "tiny", "--out", out), "--resume", "--overwrite", "another --out")


def test_http_error_names_the_request_field(tmp_path):
    import threading
    import urllib.error
    import urllib.request

    import torch

    from prunus.models import Transformer, get_preset, save_model
    from prunus.serve import Engine
    from prunus.serve.http_server import CompletionServer

    torch.manual_seed(0)
    model = Transformer(get_preset("tiny"))
    model.init_weights()
    path = save_model(model.eval(), tmp_path / "model", stage="test")
    with Engine.load(path, max_batch=1, threads=1) as engine:
        server = CompletionServer(engine, "127.0.0.1", 0)
        thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        thread.start()
        try:
            request = urllib.request.Request(server.url + "/v1/completions", method="POST",
                                             data=json.dumps({"model": "model", "prompt": "x", "max_tokens": 0}).encode(),
                                             headers={"Content-Type": "application/json"})
            with pytest.raises(urllib.error.HTTPError) as e:
                urllib.request.urlopen(request, timeout=60)
            message = json.loads(e.value.read())["error"]["message"]
        finally:
            server.shutdown()
            server.server_close()
    assert e.value.code == 400 and "max_tokens" in message and "max_new_tokens" not in message, message
