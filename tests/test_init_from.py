"""Fine-tuning from a model dir (``--init-from``): the loaded model equals its source, every layout trains to
the same losses as one process from it (instruction data, loss on completions only), a fine-tuning run resumes
bit-exactly, a converted Hugging Face model trains as transformers trains it, and bad input is one line."""

import json
from pathlib import Path

import pytest
import torch

from prunus.artifacts.errors import PrunusError
from prunus.models import Transformer, get_preset, load_model, read_manifest, save_model
from prunus.train_parallel import TrainConfig, Trainer, read_metrics, resume_config, train

TOL = 1e-5
WORKER = Path(__file__).with_name("parallel_worker.py")
RUN = dict(seq_len=32, batch_size=8, steps=2, warmup_steps=0, lr=1e-3, min_lr=1e-3, eval_every=2, eval_tokens=256,
           ckpt_every=0, max_corpus_bytes=100_000, progress=False, timeout_s=120)


def source_dir(path: Path, tied: bool = True, n_layers: int = 4, seed: int = 0) -> str:
    torch.manual_seed(seed)
    model = Transformer(get_preset("tiny").replace(n_layers=n_layers, tie_embeddings=tied))
    model.init_weights()
    return str(save_model(model, path, stage="train"))


def instruct_file(path: Path, n: int = 64) -> str:
    """Prompt/completion rows of uneven lengths: ranks hold different numbers of trained tokens."""
    rows = [{"prompt": f"Q{i}: " + "why " * (i % 5), "completion": f" because {i}" + "!" * (i % 7)} for i in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("init_from")
    return {"tied": source_dir(tmp / "tied"), "untied": source_dir(tmp / "untied", tied=False),
            "data": instruct_file(tmp / "rows.jsonl"), "tmp": tmp}


def test_loaded_model_equals_its_source(sources, tmp_path):
    for kind in ("tied", "untied"):
        trainer = Trainer(TrainConfig(out=str(tmp_path / kind), init_from=sources[kind], **RUN))
        part = trainer.par.parts[0]
        x = torch.randint(0, 320, (2, 24), generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            assert torch.equal(part(x), load_model(sources[kind])(x)), kind
        assert trainer.start == 0 and trainer.train_state["tokens"] == 0
        assert (part.output.weight is part.tok_embeddings.weight) == (kind == "tied")


# name: (source model, layout, instruction rows or the built-in text corpus); packed rows refuse --cp
LAYOUTS = {
    "ddp": ("tied", dict(zero=0), True),
    "ddp_grad_accum": ("tied", dict(zero=0, grad_accum=2), True),
    "fsdp": ("tied", dict(zero=3), True),
    "tp_sp": ("tied", dict(tp=2), True),
    "pp_1f1b": ("untied", dict(pp=2, pp_schedule="1F1B", microbatches=2), True),
    "fsdp_text": ("tied", dict(zero=3), False),
    "cp_ring_text": ("tied", dict(cp=2), False),
}


@pytest.fixture(scope="module")
def two_rank(sources, spawn_jobs):
    tmp = sources["tmp"]
    jobs = [{"name": n, "config": {**RUN, **c, "init_from": sources[src], "out": str(tmp / n),
                                   **({"data": sources["data"]} if rows else {})}}
            for n, (src, c, rows) in LAYOUTS.items()]
    return spawn_jobs(WORKER, 2, jobs, tmp)


REFERENCES: dict = {}


def reference(tmp_path: Path, **config) -> dict:
    r = train(TrainConfig(**{**RUN, **config, "out": str(tmp_path / f"ref{len(list(tmp_path.iterdir()))}")}))
    return {"losses": r.losses, "val_loss": r.metrics["val_loss"]}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_layouts_fine_tune_as_one_process(two_rank, sources, tmp_path, layout):
    got = two_rank[layout]
    assert "error" not in got, f"{layout}: {got.get('error')}\n{got.get('trace')}"
    src, changes, rows = LAYOUTS[layout]
    data = {"data": sources["data"]} if rows else {}
    key = (src, changes.get("grad_accum", 1), rows)  # layouts with the same one-process run share it
    if key not in REFERENCES:
        REFERENCES[key] = reference(tmp_path, init_from=sources[src], grad_accum=key[1], **data)
    ref = REFERENCES[key]
    assert got["losses"] == pytest.approx(ref["losses"], abs=TOL), layout
    assert got["val_loss"] == pytest.approx(ref["val_loss"], abs=TOL), layout


def test_lora_adapters_start_from_their_initial_values(sources, tmp_path):
    """Built on the meta device with the base, the adapters get apply_lora's values: B zero (the model is its
    source), A drawn from the seed and the module's name."""
    from prunus.train_parallel.lora import apply_lora

    cfg = TrainConfig(out=str(tmp_path / "o"), init_from=sources["tied"], lora_rank=4, **RUN)
    part = Trainer(cfg).par.parts[0]
    x = torch.randint(0, 320, (2, 24), generator=torch.Generator().manual_seed(1))
    expected = load_model(sources["tied"])
    apply_lora(expected, cfg)
    with torch.no_grad():
        assert torch.equal(part(x), expected(x))
    for (name, p), (name_e, p_e) in zip(part.named_parameters(), expected.named_parameters()):
        assert name == name_e and torch.equal(p, p_e), name


def test_fine_tuning_resumes_bit_exactly(sources, tmp_path):
    cfg = dict(RUN, steps=4, eval_every=2, init_from=sources["tied"], data=sources["data"])
    whole = train(TrainConfig(**cfg, out=str(tmp_path / "whole")))
    first = train(TrainConfig(**cfg, stop_at=2, out=str(tmp_path / "split")))
    rest = train(resume_config(tmp_path / "split"), resume=True)
    assert first.losses + rest.losses == whole.losses  # bit-exact: same batches, same state
    assert rest.metrics["val_loss"] == whole.metrics["val_loss"]
    steps = [r["step"] for r in read_metrics(tmp_path / "split")]
    assert steps == [1, 2, 3, 4]


def test_converted_hf_model_trains_as_transformers(tmp_path):
    transformers = pytest.importorskip("transformers")
    from test_chat import hf_llama

    from prunus.models.hf_convert import from_hf
    from prunus.train_parallel.schedule import lr_at

    hf_llama(tmp_path / "hf")
    from_hf(tmp_path / "hf", tmp_path / "model")
    cfg = TrainConfig(out=str(tmp_path / "run"), init_from=str(tmp_path / "model"), **{**RUN, "steps": 3, "eval_every": 3,
                                                                                         "warmup_steps": 1})
    trainer = Trainer(cfg)
    batches = [trainer.step_batches(s)[0] for s in range(3)]
    result = trainer.train()
    norms = [r["grad_norm"] for r in read_metrics(tmp_path / "run")]
    # the fine-tuned dir names its parent and stays a llama of Hugging Face's (exportable with to_hf)
    assert read_manifest(result.model_dir)["parent"]["path"] == str((tmp_path / "model").resolve())
    assert json.loads((result.model_dir / "config.json").read_text())["hf"]["model_type"] == "llama"

    hf = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf", torch_dtype=torch.float32).train()
    params = [p for p in hf.parameters() if p.requires_grad]
    opt = torch.optim.AdamW([{"params": [p for p in params if p.ndim >= 2], "weight_decay": cfg.weight_decay},
                             {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}],
                            lr=cfg.lr, betas=(cfg.beta1, cfg.beta2))
    for step, (x, y) in enumerate(batches):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, lr=cfg.lr, min_lr=cfg.min_lr, warmup_steps=cfg.warmup_steps, total_steps=cfg.steps)
        loss = torch.nn.functional.cross_entropy(hf(x).logits.float().flatten(0, 1), y.flatten())
        loss.backward()
        loss = loss.detach()
        norm = torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
        opt.step()
        opt.zero_grad()
        assert abs(loss.item() - result.losses[step]) <= TOL, step
        assert abs(float(norm) - norms[step]) <= TOL * max(1.0, float(norm)), step


def test_architecture_must_agree_with_the_model_dir(sources, tmp_path):
    src = sources["tied"]
    with pytest.raises(PrunusError, match=r"--init-from .*differs from --preset small \(dim 256 vs 64"):
        TrainConfig(out=str(tmp_path / "o"), init_from=src, preset="small").validate()
    with pytest.raises(PrunusError, match=r"differs from --preset tiny \(n_layers 2 vs 4"):
        TrainConfig(out=str(tmp_path / "o"), init_from=src, preset="tiny").validate()
    with pytest.raises(PrunusError, match=r"model setting n_heads=8 differs from its config.json \(4\)"):
        TrainConfig(out=str(tmp_path / "o"), init_from=src, model={"n_heads": 8}).validate()
    same = source_dir(tmp_path / "same", tied=False, n_layers=2)  # exactly the tiny preset
    assert TrainConfig(out=str(tmp_path / "o"), init_from=same, preset="tiny").model_config() == get_preset("tiny")
    with pytest.raises(PrunusError, match=r"--init-from .*nowhere: no such model dir"):
        TrainConfig(out=str(tmp_path / "o"), init_from=str(tmp_path / "nowhere")).validate()


def test_cli_refuses_bad_fine_tuning_input(sources, tmp_path, assert_user_error):
    from click.testing import CliRunner

    from prunus.cli.main import cli

    def run(*args):
        return CliRunner().invoke(cli, ["train", *map(str, args), "--no-progress", "--seq-len", "32", "--steps", "1"])

    out = tmp_path / "o"
    assert_user_error(run("--init-from", sources["tied"], "--preset", "small", "--out", out),
                      "--init-from", "differs from --preset small", "drop --preset")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a", "completion": "b"}\n{"prompt": "a"}\n')
    assert_user_error(run("--init-from", sources["tied"], "--data", bad, "--out", out), "bad.jsonl line 2",
                      "'completion' must be a string")
    pytest.importorskip("transformers")
    from test_chat import CHAT_TEMPLATE, hf_tokenizer_dir

    tok = hf_tokenizer_dir(tmp_path / "tok", CHAT_TEMPLATE)
    assert_user_error(run("--init-from", sources["tied"], "--tokenizer", tok, "--data", bad, "--out", out),
                      f"--tokenizer {tok} has", "--init-from", "drop --tokenizer")
    assert not out.exists()


def test_truncated_rows_are_reported(sources, tmp_path, capsys):
    data = tmp_path / "long.jsonl"
    data.write_text("".join(json.dumps({"prompt": "p" * (60 if i % 10 == 0 else 3), "completion": "c"}) + "\n"
                            for i in range(40)))
    train(TrainConfig(out=str(tmp_path / "o"), init_from=sources["tied"], data=str(data), **{**RUN, "steps": 1,
                                                                                             "progress": True}))
    err = capsys.readouterr()
    assert "rows of" in err.out + err.err and "are longer than --seq-len 32 and were truncated" in err.out + err.err


def test_cli_fine_tunes_from_a_model_dir(sources, tmp_path):
    from click.testing import CliRunner

    from prunus.cli.main import cli

    out = tmp_path / "ft"
    r = CliRunner().invoke(cli, ["train", "--init-from", sources["tied"], "--data", sources["data"], "--seq-len", "32",
                                 "--batch-size", "4", "--steps", "2", "--warmup-steps", "0", "--eval-every", "2",
                                 "--no-progress", "--out", str(out)])
    assert r.exit_code == 0, r.output
    assert read_manifest(out / "model")["parent"]["path"] == str(Path(sources["tied"]).resolve())
    run = json.loads((out / "run.json").read_text())
    assert run["train"]["init_from"] == sources["tied"] and run["train"]["preset"] is None


def test_parameter_server_mode_refuses_fine_tuning(sources, tmp_path):
    """--dp-mode ps runs its own loop from random weights: fine-tuning input is refused, not ignored."""
    for extra in ({"init_from": sources["tied"]}, {"data": sources["data"]}):
        with pytest.raises(PrunusError, match=r"--dp-mode ps trains from random weights"):
            TrainConfig(out=str(tmp_path / "o"), dp_mode="ps", **extra).validate()
