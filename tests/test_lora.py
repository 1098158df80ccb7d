"""LoRA and QLoRA (train_parallel/lora.py, peft_format.py): adapters on a frozen base.

* at step 0 a LoRA model computes exactly what its base computes; merging folds the adapters in;
* a run writes the merged model and, with save_adapter, a PEFT adapter that Hugging Face PEFT loads onto
  ``to_hf`` of the base with the merged model's logits (1e-5);
* TP x 2 and FSDP x 2 train to the one-process losses (1e-5), in one spawn; a stopped run resumes bit-exactly;
* QLoRA over int8 and int4 bases: the base's bytes unchanged, gradients on the adapters alone;
* bad settings: one PrunusError line.
"""

import json
from pathlib import Path

import pytest
import torch

from prunus.artifacts.errors import PrunusError
from prunus.models import Transformer, load_model, save_model
from prunus.models.compression_state import compression_state
from prunus.models.config import get_preset
from prunus.models.int4 import rtn_int4
from prunus.models.quant_registry import is_quantized
from prunus.models.quantized import QuantizedLinear
from prunus.models.quantized_int4 import Int4Linear
from prunus.train_parallel import TrainConfig, train
from prunus.train_parallel.lora import apply_lora, check_lora, frozen_bytes, lora_modules, merge_lora

TOL = 1e-5
WORKER = Path(__file__).with_name("parallel_worker.py")
BASE = dict(preset="tiny", seq_len=32, batch_size=8, steps=3, warmup_steps=1, eval_every=3, eval_tokens=1024,
            ckpt_every=0, max_corpus_bytes=100_000, progress=False, timeout_s=120, lr=1e-2,
            lora_rank=4, lora_alpha=8.0)


def tiny_model(seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    model = Transformer(get_preset("tiny"))
    model.init_weights()
    return model.eval()


def batch(seed: int = 1):
    return torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(seed))


def test_step_zero_is_the_base_and_merge_folds_adapters_in():
    model = tiny_model()
    x = batch()
    with torch.no_grad():
        base = model(x)
    cfg = TrainConfig(**BASE)
    check_lora(model, cfg)
    wrapped = apply_lora(model, cfg)
    assert len(wrapped) == 2 * 7  # every projection of both blocks
    with torch.no_grad():
        assert torch.equal(model(x), base)  # B starts at zero
        for m in lora_modules(model).values():
            m.lora.B.normal_()
        adapted = model(x)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora." in n for n in trainable)
    merge_lora(model)
    assert not lora_modules(model) and all(p.requires_grad for p in model.parameters())
    with torch.no_grad():
        assert (model(x) - adapted).abs().max() <= TOL
        assert (model(x) - base).abs().max() > 1e-2


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    """A base model dir and a 3-step LoRA run from it that writes its adapter."""
    tmp = tmp_path_factory.mktemp("lora")
    base_dir = save_model(tiny_model(), tmp / "base", stage="train")
    cfg = TrainConfig(**{**BASE, "out": str(tmp / "run"), "save_adapter": True})
    result = train(cfg, model=load_model(base_dir).train())
    return tmp, base_dir, result


def test_peft_loads_the_adapter_with_the_merged_logits(lora_run):
    pytest.importorskip("peft")
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from prunus.models.hf_convert import to_hf

    tmp, base_dir, result = lora_run
    adapter = result.run_dir / "adapter"
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["lora_alpha"] == 8.0
    assert config["target_modules"] == sorted(["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    hf = AutoModelForCausalLM.from_pretrained(to_hf(base_dir, tmp / "base_hf"), dtype=torch.float32)
    peft_model = PeftModel.from_pretrained(hf, adapter).eval()
    merged = load_model(result.model_dir)
    x = batch()
    with torch.no_grad():
        ours, theirs = merged(x), peft_model(x).logits
        base = load_model(base_dir)(x)
    assert (ours - base).abs().max() > 1e-3  # the adapters learned something
    assert (ours - theirs).abs().max() <= TOL


def test_a_stopped_lora_run_resumes_bit_exactly(lora_run, tmp_path):
    _, base_dir, straight = lora_run
    cfg = TrainConfig(**{**BASE, "out": str(tmp_path / "run"), "stop_at": 2})
    first = train(cfg, model=load_model(base_dir).train())
    rest = train(TrainConfig(**{**BASE, "out": str(tmp_path / "run")}), resume=True, model=load_model(base_dir).train())
    assert first.losses + rest.losses == straight.losses
    a, b = load_model(rest.model_dir).state_dict(), load_model(straight.model_dir).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


LAYOUTS = {"lora_tp": dict(tp=2), "lora_fsdp": dict(dp_shard=2, zero=3), "lora_ddp": dict(zero=0),
           "lora_pp": dict(pp=2, pp_schedule="1F1B", microbatches=2)}


def test_lora_under_tp_fsdp_pp_matches_one_process(tmp_path, spawn_jobs):
    """Every layout's losses, validation loss and merged model dir against one process; and a LoRA checkpoint
    written under FSDP x 2 at step 2, resumed under TP x 2, ends where one process ends."""
    jobs = [{"name": n, "config": {**BASE, **c, "out": str(tmp_path / n)}} for n, c in LAYOUTS.items()]
    ckpt = {**BASE, "stop_at": 2, "zero": 3, "out": str(tmp_path / "ckpt_fsdp")}
    jobs += [{"name": "ckpt_fsdp", "config": ckpt},
             {"name": "resume_tp", "copy_from": ckpt["out"], "resume": True, "config": {"tp": 2, "out": str(tmp_path / "resume_tp")}}]
    results = spawn_jobs(WORKER, 2, jobs, tmp_path)
    ref = train(TrainConfig(**{**BASE, "out": str(tmp_path / "ref")}))
    for name in ("ckpt_fsdp", "resume_tp"):
        assert "error" not in results[name], f"{name}: {results[name].get('error')}\n{results[name].get('trace')}"
    assert results["ckpt_fsdp"]["losses"] == pytest.approx(ref.losses[:2], abs=TOL)
    assert results["resume_tp"]["losses"] == pytest.approx(ref.losses[2:], abs=TOL)
    assert abs(results["resume_tp"]["val_loss"] - ref.metrics["val_loss"]) <= TOL
    for name in LAYOUTS:
        got = results[name]
        assert "error" not in got, f"{name}: {got.get('error')}\n{got.get('trace')}"
        assert got["losses"] == pytest.approx(ref.losses, abs=TOL), name
        assert abs(got["val_loss"] - ref.metrics["val_loss"]) <= TOL, name
        # the consolidated, merged model dir equals the one-process one
        a, b = load_model(tmp_path / name / "model").state_dict(), load_model(ref.model_dir).state_dict()
        assert max((a[k] - b[k]).abs().max().item() for k in a) <= TOL, name


def quantized_base(kind: str) -> Transformer:
    """The tiny model with every block projection stored int8 (per channel) or int4 (group 32)."""
    model = tiny_model()
    modules = {}
    for name, linear in list(model.named_modules()):
        if name.startswith("layers.") and isinstance(linear, torch.nn.Linear):
            if kind == "int8":
                q = QuantizedLinear.from_linear(linear, "int8-weight-only")
            else:
                q = Int4Linear.from_quantized(linear, *rtn_int4(linear.weight.detach(), 32, False), 32, False, "rtn")
            model.set_submodule(name, q)
            modules[name] = q.spec()
    compression_state(model).quantization = {"modules": modules}
    return model


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_qlora_keeps_the_base_quantized_and_trains_adapters_only(kind, tmp_path):
    base_dir = save_model(quantized_base(kind), tmp_path / "base", stage="compress")
    model = load_model(base_dir).train()
    before = frozen_bytes(model)
    cfg = TrainConfig(**{**BASE, "out": str(tmp_path / "run"), "steps": 2, "eval_every": 2})
    check_lora(model, cfg)
    apply_lora(model, cfg)
    assert frozen_bytes(model) == before  # the base stays at its quantized size
    assert sum(is_quantized(m) for m in model.modules()) == 14
    model(batch()).float().pow(2).mean().backward()
    with_grad = {n for n, p in model.named_parameters() if p.grad is not None}
    assert with_grad == {n for n, p in model.named_parameters() if ".lora." in n}
    assert all(b.grad is None for b in model.buffers())
    # a run from the compressed model dir (--init-from) writes a plain (merged, float) model dir
    run_cfg = TrainConfig(**{**BASE, "preset": None, "init_from": str(base_dir), "out": str(tmp_path / "run"),
                             "steps": 2, "eval_every": 2})
    result = train(run_cfg)
    base = load_model(base_dir)
    merged = load_model(result.model_dir)
    assert torch.equal(merged.tok_embeddings.weight, base.tok_embeddings.weight)
    delta = merged.layers["0"].attention.wq.weight - base.layers["0"].attention.wq.dequantize()
    assert 0 < delta.abs().max() < 0.1  # the dequantized base plus the learned adapter
    assert not any(is_quantized(m) for m in merged.modules())
    assert "compression" not in json.loads((result.model_dir / "config.json").read_text())


@pytest.mark.parametrize("changes, needle", [
    (dict(lora_targets="wq,wz"), "--lora-targets wz names no module"),
    (dict(lora_targets=" , "), "--lora-targets is empty"),
    (dict(lora_rank=-1), "--lora-rank -1 must be at least 1"),
    (dict(lora_rank=0, save_adapter=True), "--lora-rank 0 must be at least 1"),
    (dict(lora_rank=100), "--lora-rank 100 exceeds"),
    (dict(lora_dropout=1.0), "--lora-dropout 1.0 must be in [0, 1)"),
])
def test_bad_lora_settings_are_one_line(tmp_path, changes, needle):
    cfg = TrainConfig(**{**BASE, "out": str(tmp_path / "run"), **changes})
    with pytest.raises(PrunusError) as e:
        train(cfg)
    assert needle in str(e.value) and "\n" not in str(e.value)
    assert not (tmp_path / "run").exists()


def test_a_model_with_nothing_trainable_is_refused(tmp_path):
    cfg = TrainConfig(**{**BASE, "out": str(tmp_path / "run"), "lora_rank": 0})
    with pytest.raises(PrunusError, match="quantized modules .* add --lora-rank"):
        train(cfg, model=quantized_base("int8").train())
    frozen = tiny_model().train().requires_grad_(False)
    with pytest.raises(PrunusError, match="nothing trainable"):
        train(cfg, model=frozen)
    assert not (tmp_path / "run").exists()


def test_cli_refuses_a_target_that_names_no_module(tmp_path, assert_user_error):
    from click.testing import CliRunner

    from prunus.cli.main import cli

    out = tmp_path / "run"
    result = CliRunner().invoke(cli, ["train", "--preset", "tiny", "--steps", "1", "--no-progress", "--out", str(out),
                                      "--lora-rank", "4", "--lora-targets", "wq,q_proj"])
    assert_user_error(result, "--lora-targets q_proj names no module", "Hugging Face's name of wq",
                      "choose among w1,w2,w3,wk,wo,wq,wv")
    assert not out.exists()
