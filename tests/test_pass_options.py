"""Every option of every compression pass does what it says: each pass runs on a tiny model with the option at
two values, and the two results differ in the way the pass documents. An option a pass does not take, or one
given where it would change nothing (``n_calib`` to a scheme that does not calibrate), is refused in one line;
so is a module listed both in ``int8`` and in ``exclude``, while ``int8: [output]`` alone quantizes the head.
A new option without a case here fails :func:`test_every_option_of_every_pass_has_a_case`."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Callable

import pytest
import torch
from click.testing import CliRunner
from torch import nn

from prunus.artifacts.errors import PrunusError
from prunus.cli.main import cli
from prunus.compress.context import build_context
from prunus.compress.pass_arguments import APPLIES
from prunus.compress.quantize import scheme_options
from prunus.compress.recipe import PASSES, check_pass, get_pass, pass_parameters
from prunus.compress.run import run_pass
from prunus.models import Transformer, get_preset, save_model
from prunus.models.compression_state import compression_state
from prunus.models.quantized import QuantizedLinear
from prunus.models.quantized_int4 import Int4Linear
from prunus.models.schemes import SCHEMES

WQ = "layers.0.attention.wq"
MODULE_DATA = "synthetic:classification?n=48&shape=3x8x8&classes=4&val=16"


# --- the tiny models the passes run on --------------------------------------------------------------

def cnn(width: int = 8, classes: int = 4):
    """A small CNN with a BatchNorm (the generic passes' model; built by name, ``test_pass_options:cnn``)."""
    return nn.Sequential(nn.Conv2d(3, width, 3, padding=1, bias=False), nn.BatchNorm2d(width), nn.ReLU(),
                         nn.Conv2d(width, width, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         nn.Linear(width, classes))


def mlp(hidden: int = 16, classes: int = 4):
    return nn.Sequential(nn.Flatten(), nn.Linear(3 * 8 * 8, hidden), nn.ReLU(), nn.Linear(hidden, classes))


@pytest.fixture(scope="module")
def ctx(tmp_path_factory):
    root = tmp_path_factory.mktemp("passes")
    torch.manual_seed(0)
    model = Transformer(get_preset("tiny"))
    model.init_weights()
    save_model(model.eval(), root / "m", stage="test")
    corpus = root / "corpus.txt"
    corpus.write_text("".join(f"line {i}: the quick brown fox {i * 7 % 13} jumps over the lazy dog\n" for i in range(600)))
    return build_context(root / "m", data=str(corpus), seq_len=32, eval_tokens=256)


@pytest.fixture(scope="module")
def module_ctx(tmp_path_factory):
    pytest.importorskip("torch_pruning")
    from prunus.compress.module_compress import _load
    from prunus.models.module_dir import save_module
    from prunus.models.module_factory import build_module

    torch.manual_seed(0)
    d = save_module(build_module("test_pass_options:cnn", {}), tmp_path_factory.mktemp("cnn") / "cnn", stage="train",
                    task="classification", input={"shape": [3, 8, 8], "dtype": "float32"})
    return _load(d, MODULE_DATA, True, 0)


def run(context, name: str, args: dict):
    """(the model the pass made, its report notes): the recipe check first, then the runner's call."""
    model, ctx = context
    check_pass(name, args, where="test")
    ctx.take_notes()
    model = copy.deepcopy(model)
    for p in model.parameters():
        p.requires_grad_(True)
    torch.manual_seed(0)
    extra = {"progress": False} if PASSES[name].shows_progress else {}
    out = run_pass(get_pass(name), name, model, ctx, {**args, **extra})
    return out, ctx.take_notes()


# --- what the cases look at ------------------------------------------------------------------------

def same_weights(a: nn.Module, b: nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(sa[k].shape == sb[k].shape and torch.equal(sa[k], sb[k]) for k in sa)


def differ(a, b):
    assert not same_weights(a[0], b[0])


def mod(out, name: str = WQ) -> nn.Module:
    return out[0].get_submodule(name)


def quant(out) -> dict:
    return compression_state(out[0]).quantization


def sparsity(out) -> dict:
    return compression_state(out[0]).sparsity


def distilled(out) -> dict:
    return compression_state(out[0]).distillation


def input_scales(out) -> dict:
    return {n: float(m.input_scale) for n, m in out[0].named_modules() if isinstance(m, QuantizedLinear)}


def smaller_somewhere(low: dict, high: dict) -> None:
    """Every value of ``low`` at most ``high``'s, one strictly below."""
    assert low.keys() == high.keys() and all(low[k] <= high[k] for k in low) and any(low[k] < high[k] for k in low)


def params(out) -> int:
    return sum(p.numel() for p in out[0].parameters())


def moved(ctx_model, out) -> float:
    """How far a student moved from where it started (distill: keep-every:2 of the teacher, block 0)."""
    start = ctx_model.layers["0"].attention.wq.weight
    return float((out[0].layers["0"].attention.wq.weight - start).detach().norm())


def check_fake_spawn(monkeypatch):
    """Replace distillation's torchrun launch by a stand-in that records how many processes it was asked for."""
    from prunus.compress import distill

    asked = []

    def fake(ctx, student, cfg, work, loss_args, channels, nproc):
        asked.append(nproc)
        return student, [1.0] * cfg.steps, {}

    monkeypatch.setattr(distill, "spawn", fake)
    return asked


# --- the cases: (pass, arguments besides the option, option, two values, what must differ) -------------

@dataclass
class Case:
    name: str
    base: dict
    option: str
    a: object
    b: object
    check: Callable
    on_modules: bool = False  # a generic module's pass

    @property
    def id(self) -> str:
        scheme = self.base.get("scheme", "")
        return f"{self.name}{'[' + scheme + ']' if scheme else ''}-{self.option}"


EIGHT = {"scheme": "int8-weight-only"}
STATIC = {"scheme": "w8a8-static", "n_calib": 2}
INT4 = {"scheme": "int4-weight-only", "group_size": 32}
GPTQ = {**INT4, "algorithm": "gptq", "n_calib": 2}
STUDENT = {"student": "keep-every:2", "steps": 2, "batch_size": 2, "seq_len": 16}
FINETUNE = {"amount": 0.25, "finetune_steps": 2, "batch_size": 8}
PUPIL = {"student": "test_pass_options:mlp", "steps": 2, "batch_size": 8}

CASES = [
    # quantize, int8 / float8 schemes (compress/quantize.py eight_bit_pass)
    Case("quantize", {}, "scheme", "int8-weight-only", "fp8-weight-only",
         lambda a, b: (mod(a).weight.dtype, mod(b).weight.dtype) == (torch.int8, torch.float8_e4m3fn)),
    Case("quantize", EIGHT, "granularity", "per_channel", "per_tensor",
         lambda a, b: (mod(a).weight_scale.shape, mod(b).weight_scale.shape) == ((64, 1), (1, 1))),
    Case("quantize", {**EIGHT, "granularity": "per_group"}, "group_size", 16, 32,
         lambda a, b: (mod(a).weight_scale.shape, mod(b).weight_scale.shape) == ((64, 4), (64, 2))),
    Case("quantize", STATIC, "calibration", "minmax", "percentile",
         lambda a, b: quant(a)["calibration"]["method"] == "minmax" and quant(b)["calibration"]["method"] == "percentile"
         and smaller_somewhere(input_scales(b), input_scales(a)) is None),
    Case("quantize", {**STATIC, "calibration": "percentile"}, "percentile", 50.0, 99.9,
         lambda a, b: smaller_somewhere(input_scales(a), input_scales(b)) is None),
    Case("quantize", {"scheme": "w8a8-static"}, "n_calib", 1, 4,  # minmax over 4 batches, the first the same
         lambda a, b: (quant(a)["calibration"]["n_batches"], quant(b)["calibration"]["n_batches"]) == (1, 4)
         and smaller_somewhere(input_scales(a), input_scales(b)) is None),
    Case("quantize", EIGHT, "exclude", ["output"], ["output", "layers.0"],
         lambda a, b: isinstance(mod(a), QuantizedLinear) and type(mod(b)) is nn.Linear
         and WQ in quant(b)["excluded"] and WQ not in quant(a)["excluded"]),
    # quantize, int4 (compress/int4.py)
    Case("quantize", INT4, "algorithm", "rtn", "hqq",
         lambda a, b: (mod(a).algorithm, mod(b).algorithm) == ("rtn", "hqq") and differ(a, b) is None),
    Case("quantize", INT4, "group_size", 32, 64,
         lambda a, b: (mod(a).group_size, mod(b).group_size) == (32, 64) and mod(a).weight_scale.shape == (64, 2)),
    Case("quantize", INT4, "symmetric", True, False,
         lambda a, b: bool((mod(a).weight_zero == 8).all()) and not bool((mod(b).weight_zero == 8).all())),
    Case("quantize", GPTQ, "act_order", False, True, differ),
    Case("quantize", GPTQ, "damp", 0.001, 0.5, differ),
    Case("quantize", INT4, "int8", [], ["layers.0"],
         lambda a, b: isinstance(mod(a), Int4Linear) and isinstance(mod(b), QuantizedLinear)
         and mod(b).weight.dtype == torch.int8 and isinstance(mod(b, "layers.1.attention.wq"), Int4Linear)),
    Case("quantize", INT4, "exclude", ["output"], ["output", "layers.-1"],
         lambda a, b: isinstance(mod(a, "layers.1.attention.wq"), Int4Linear)
         and type(mod(b, "layers.1.attention.wq")) is nn.Linear and isinstance(mod(b), Int4Linear)),
    Case("quantize", GPTQ, "n_calib", 1, 4, differ),
    Case("quantize", {**INT4, "symmetric": False}, "float_zero", False, True,
         lambda a, b: not mod(a).weight_zero.is_floating_point() and mod(b).weight_zero.is_floating_point()
         and quant(b)["modules"][WQ]["float_zero"] is True),
    Case("quantize", EIGHT, "gguf_scales", False, True,  # Q8_0's d: a half value
         lambda a, b: not torch.equal(mod(a).weight_scale, mod(a).weight_scale.half().float())
         and torch.equal(mod(b).weight_scale, mod(b).weight_scale.half().float()) and quant(b)["gguf_scales"] is True),
    Case("quantize", INT4, "gguf_scales", False, True,  # Q4_0's d: a half value
         lambda a, b: not torch.equal(mod(a).weight_scale, mod(a).weight_scale.half().float())
         and torch.equal(mod(b).weight_scale, mod(b).weight_scale.half().float()) and quant(b)["gguf_scales"] is True),
    Case("quantize", INT4, "clip", "none", "mse",
         lambda a, b: "clipped" not in a[1][0] and "ranges clipped by mse search" in b[1][0] and differ(a, b) is None),
    # smoothquant: the scales move into the norms, the float model computes the same
    Case("smoothquant", {}, "alpha", 0.2, 0.8,
         lambda a, b: not torch.equal(mod(a, "layers.0.attention_norm").weight, mod(b, "layers.0.attention_norm").weight)),
    Case("smoothquant", {"alpha": 0.8}, "n_calib", 1, 4,
         lambda a, b: not torch.equal(mod(a, "layers.0.attention_norm").weight, mod(b, "layers.0.attention_norm").weight)),
    # prune (compress/prune.py)
    Case("prune", {}, "method", "magnitude", "wanda",
         lambda a, b: (sparsity(a)["method"], sparsity(b)["method"]) == ("magnitude", "wanda") and differ(a, b) is None),
    Case("prune", {"method": "magnitude"}, "sparsity", 0.25, 0.5,
         lambda a, b: abs(sparsity(a)["achieved"] - 0.25) < 0.01 and abs(sparsity(b)["achieved"] - 0.5) < 0.01),
    Case("prune", {"method": "magnitude", "sparsity": 0.5}, "scope", "layer", "global",
         lambda a, b: len({round(v, 3) for v in sparsity(a)["per_module"].values()}) == 1
         and len({round(v, 3) for v in sparsity(b)["per_module"].values()}) > 1),
    Case("prune", {"method": "wanda"}, "n_calib", 1, 4,
         lambda a, b: (sparsity(a)["calibration_batches"], sparsity(b)["calibration_batches"]) == (1, 4)
         and differ(a, b) is None),
    Case("prune", {"method": "magnitude"}, "exclude", ["output"], ["output", "layers.0"],
         lambda a, b: bool((mod(a).weight == 0).any()) and not bool((mod(b).weight == 0).any())),
    # prune_structured: a smaller dense model
    Case("prune_structured", {"amount": 0.5}, "target", "heads", "channels",
         lambda a, b: (a[0].config.n_heads, a[0].config.ffn_dim) == (2, 192)
         and (b[0].config.n_heads, b[0].config.ffn_dim) == (4, 96)),
    Case("prune_structured", {"target": "channels"}, "amount", 0.25, 0.5,
         lambda a, b: (a[0].config.ffn_dim, b[0].config.ffn_dim) == (144, 96)),
    Case("prune_structured", {"target": "channels", "amount": 0.5}, "n_calib", 1, 4, differ),
    # distill: a student trained against the teacher
    Case("distill", {k: v for k, v in STUDENT.items() if k != "student"}, "student", "keep-every:2", "width:2",
         lambda a, b: (a[0].config.n_layers, a[0].config.dim) == (1, 64) and (b[0].config.n_layers, b[0].config.dim) == (2, 32)),
    Case("distill", STUDENT, "steps", 2, 3,
         lambda a, b: (distilled(a)["steps"], distilled(b)["steps"]) == (2, 3) and "distilled 3 steps" in b[1][0]
         and differ(a, b) is None),
    Case("distill", STUDENT, "batch_size", 2, 4,
         lambda a, b: "x 4 rows" in b[1][0] and differ(a, b) is None),
    Case("distill", STUDENT, "seq_len", 8, 16,
         lambda a, b: "x 8 tokens" in a[1][0] and "x 16 tokens" in b[1][0] and differ(a, b) is None),
    Case("distill", STUDENT, "lr", 1e-5, 1e-2, None),  # checked against the teacher below
    Case("distill", STUDENT, "temperature", 1.0, 4.0, differ),
    Case("distill", STUDENT, "kd_weight", 0.5, 1.0, differ),
    Case("distill", STUDENT, "reverse_kl", 0.0, 1.0, differ),
    Case("distill", {**STUDENT, "student": "width:2"}, "hidden_weight", 0.0, 1.0, differ),
    Case("distill", STUDENT, "seed", 0, 1, differ),
    Case("distill", STUDENT, "nproc", 1, 2, None),  # test_distill_nproc_runs_that_many_processes
    # generic modules: prune_channels (torch-pruning), distill_module
    Case("prune_channels", {}, "amount", 0.25, 0.5, lambda a, b: params(b) < params(a), on_modules=True),
    Case("prune_channels", {"amount": 0.5}, "by", "channels", "params", lambda a, b: params(a) != params(b), on_modules=True),
    Case("prune_channels", {"amount": 0.5}, "importance", "magnitude", "group_norm", differ, on_modules=True),
    Case("prune_channels", {"amount": 0.25}, "finetune_steps", 0, 2,
         lambda a, b: not any("fine-tuned" in n for n in a[1]) and "fine-tuned 2 steps" in b[1][-1] and differ(a, b) is None,
         on_modules=True),
    Case("prune_channels", FINETUNE, "lr", 1e-4, 1e-1, differ, on_modules=True),
    Case("prune_channels", FINETUNE, "batch_size", 4, 8, lambda a, b: "batch 8" in b[1][-1] and differ(a, b) is None,
         on_modules=True),
    # allow_unchanged acts only where torch-pruning cuts nothing (test_module_prune_kinds)
    Case("prune_channels", {"amount": 0.5}, "allow_unchanged", False, True, None, on_modules=True),
    Case("distill_module", {k: v for k, v in PUPIL.items() if k != "student"}, "student", "test_pass_options:mlp",
         "test_pass_options:cnn", lambda a, b: type(a[0][1]) is nn.Linear and type(b[0][0]) is nn.Conv2d, on_modules=True),
    Case("distill_module", PUPIL, "student_args", {"hidden": 8}, {"hidden": 32},
         lambda a, b: (a[0][1].out_features, b[0][1].out_features) == (8, 32), on_modules=True),
    Case("distill_module", PUPIL, "steps", 2, 3, lambda a, b: "distilled 3 steps" in b[1][0] and differ(a, b) is None,
         on_modules=True),
    Case("distill_module", PUPIL, "lr", 1e-4, 1e-1, differ, on_modules=True),
    Case("distill_module", PUPIL, "batch_size", 4, 8, differ, on_modules=True),
    Case("distill_module", PUPIL, "temperature", 1.0, 4.0, lambda a, b: "T 4" in b[1][0] and differ(a, b) is None,
         on_modules=True),
    Case("distill_module", PUPIL, "alpha", 0.2, 0.9, lambda a, b: "alpha 0.9" in b[1][0] and differ(a, b) is None,
         on_modules=True),
]


@pytest.mark.parametrize("case", [c for c in CASES if c.check is not None], ids=lambda c: c.id)
def test_each_option_changes_what_it_says(case, request):
    context = request.getfixturevalue("module_ctx" if case.on_modules else "ctx")
    context = context if case.on_modules else (context.teacher, context)
    outs = [run(context, case.name, {**case.base, case.option: value}) for value in (case.a, case.b)]
    result = case.check(*outs)
    assert result is None or result is True, f"{case.id}: {case.a!r} -> {case.b!r} did not change what it says"


def test_a_larger_distillation_lr_moves_the_student_further(ctx):
    small, large = (run((ctx.teacher, ctx), "distill", {**STUDENT, "lr": lr}) for lr in (1e-5, 1e-2))
    assert moved(ctx.teacher, small) < moved(ctx.teacher, large) / 10


def test_distill_nproc_runs_that_many_processes(ctx, monkeypatch):
    asked = check_fake_spawn(monkeypatch)
    run((ctx.teacher, ctx), "distill", {**STUDENT, "nproc": 1})
    assert asked == []  # one process: in this one
    out = run((ctx.teacher, ctx), "distill", {**STUDENT, "nproc": 2})
    assert asked == [2] and distilled(out)["nproc"] == 2


def test_a_distillation_window_longer_than_the_run_allows_is_refused_not_cut(ctx):
    with pytest.raises(PrunusError, match="^distill: seq_len=64 is above the longest window here, 32 tokens"):
        run((ctx.teacher, ctx), "distill", {**STUDENT, "seq_len": 64})  # the context's window is 32


def test_smoothquant_keeps_the_float_model_equivalent(ctx):
    x = ctx.calibration(1, 2, 16)[0]
    for alpha in (0.2, 0.8):
        model, _ = run((ctx.teacher, ctx), "smoothquant", {"alpha": alpha})
        torch.testing.assert_close(model(x), ctx.teacher(x), rtol=1e-4, atol=1e-4)


def _options() -> set[tuple[str, str, tuple]]:
    """(pass, option, the options of its family) for every option of every pass (quantize: of each scheme)."""
    out = {("quantize", "scheme", ())}
    for scheme in SCHEMES:
        out |= {("quantize", o, tuple(sorted(scheme_options(scheme)))) for o in scheme_options(scheme)}
    required = {"prune": {"method": "magnitude"}, "prune_structured": {"target": "heads", "amount": 0.25},
                "distill_module": {"student": "m:f"}}
    for name in PASSES:
        if name != "quantize":
            out |= {(name, o, ()) for o in pass_parameters(name, required.get(name, {}))[0]}
    return out


def test_every_option_of_every_pass_has_a_case():
    covered = {(c.name, c.option, tuple(sorted(scheme_options(c.base["scheme"]))) if c.name == "quantize"
                and c.option != "scheme" else ()) for c in CASES}
    missing = _options() - covered
    assert not missing, f"options without a case in CASES: {sorted(missing)}"


# --- refused: options a pass does not take, options that would change nothing -------------------------

NEEDED = {"prune": {"method": "magnitude"}, "prune_structured": {"target": "heads", "amount": 0.25},
          "distill_module": {"student": "m:f"}}
NEEDED.update({f"quantize[{s}]": {"scheme": s} for s in SCHEMES})


@pytest.mark.parametrize("entry", [n for n in PASSES if n != "quantize"] + [f"quantize[{s}]" for s in SCHEMES])
def test_an_option_a_pass_does_not_take_is_refused(entry):
    name = entry.split("[")[0]
    for bogus in ("bogus", "progress" if name == "distill" else "sparsity_target"):
        with pytest.raises(PrunusError) as e:
            check_pass(name, {**NEEDED.get(entry, {}), bogus: 1}, where="r.yaml: pass 1")
        msg = str(e.value)
        assert msg.startswith(f"r.yaml: pass 1: pass '{name}' has no argument '{bogus}'") and "\n" not in msg, msg
        assert "its arguments: " in msg


@pytest.mark.parametrize("scheme", SCHEMES)
def test_an_option_of_another_scheme_is_refused_naming_the_scheme(scheme):
    other = "algorithm" if scheme != "int4-weight-only" else "granularity"
    with pytest.raises(PrunusError, match=f"has no argument '{other}' for scheme {scheme}; its arguments: "):
        check_pass("quantize", {"scheme": scheme, other: "x"}, where="r.yaml: pass 1")


# (pass, option) -> arguments where the option would change nothing
NO_EFFECT = {
    ("quantize", "calibration"): {"scheme": "w8a8-dynamic", "calibration": "percentile"},
    ("quantize", "percentile"): {"scheme": "w8a8-static", "percentile": 99.0},  # calibration minmax
    ("quantize", "n_calib"): {"scheme": "int8-weight-only", "n_calib": 4},
    ("quantize", "group_size"): {"scheme": "int8-weight-only", "group_size": 32},  # per_channel
    ("quantize", "act_order"): {"scheme": "int4-weight-only", "algorithm": "awq", "act_order": True},
    ("quantize", "damp"): {"scheme": "int4-weight-only", "damp": 0.1},  # rtn
    ("quantize", "float_zero"): {"scheme": "int4-weight-only", "float_zero": True},  # symmetric
    ("quantize", "clip"): {"scheme": "int4-weight-only", "algorithm": "hqq", "clip": "mse"},
    ("quantize", "gguf_scales"): {"scheme": "fp8-weight-only", "gguf_scales": True},
    ("prune", "n_calib"): {"method": "magnitude", "n_calib": 4},
    ("prune", "scope"): {"method": "2:4", "scope": "row"},
    ("prune", "sparsity"): {"method": "2:4-magnitude", "sparsity": 0.5},
    ("distill", "temperature"): {"kd_weight": 0.0, "temperature": 4.0},
    ("distill", "reverse_kl"): {"kd_weight": 0.0, "reverse_kl": 0.5},
    ("prune_channels", "lr"): {"lr": 0.01},  # no fine-tune
    ("prune_channels", "batch_size"): {"batch_size": 8},
}


@pytest.mark.parametrize("key", list(NO_EFFECT), ids=lambda k: f"{k[0]}.{k[1]}")
def test_an_option_that_would_change_nothing_is_refused(key):
    name, option = key
    with pytest.raises(PrunusError) as e:
        check_pass(name, NO_EFFECT[key], where="r.yaml: pass 1")
    msg = str(e.value)
    assert msg.startswith(f"r.yaml: pass 1: {name}.{option} acts only with ") and msg.endswith("drop it"), msg
    assert "\n" not in msg


def test_every_conditional_option_has_a_refusal_case():
    assert set(NO_EFFECT) == set(APPLIES)


def test_the_same_options_where_they_act_are_taken():
    for name, option in NO_EFFECT:
        where = {("quantize", "calibration"): {"scheme": "w8a8-static"},
                 ("quantize", "percentile"): {"scheme": "w8a8-static", "calibration": "percentile"},
                 ("quantize", "n_calib"): {"scheme": "w8a8-static"},
                 ("quantize", "group_size"): {"scheme": "int8-weight-only", "granularity": "per_group"},
                 ("quantize", "act_order"): {"scheme": "int4-weight-only", "algorithm": "gptq"},
                 ("quantize", "damp"): {"scheme": "int4-weight-only", "algorithm": "awq-gptq"},
                 ("quantize", "float_zero"): {"scheme": "int4-weight-only", "symmetric": False},
                 ("quantize", "clip"): {"scheme": "int4-weight-only", "algorithm": "gptq"},
                 ("quantize", "gguf_scales"): {"scheme": "int8-weight-only"},
                 ("prune", "n_calib"): {"method": "wanda"}, ("prune", "scope"): {"method": "wanda"},
                 ("prune", "sparsity"): {"method": "magnitude"}, ("distill", "temperature"): {"kd_weight": 0.5},
                 ("distill", "reverse_kl"): {"kd_weight": 0.5}, ("prune_channels", "lr"): {"finetune_steps": 2},
                 ("prune_channels", "batch_size"): {"finetune_steps": 2}}[(name, option)]
        check_pass(name, {**where, option: NO_EFFECT[(name, option)][option]}, where="r.yaml: pass 1")


# --- int8 and exclude: an explicit list wins over the default, two explicit lists must not conflict ----

def test_int8_output_alone_puts_the_head_at_int8(ctx):
    model, notes = run((ctx.teacher, ctx), "quantize", {**INT4, "int8": ["output"]})
    assert isinstance(model.output, QuantizedLinear) and model.output.weight.dtype == torch.int8
    assert "int8-weight-only: output" in notes[0] and "float: output" not in notes[0]
    default, notes = run((ctx.teacher, ctx), "quantize", INT4)  # not named: the head stays in float
    assert type(default.output) is nn.Linear and "float: output" in notes[0]


@pytest.mark.parametrize("args, words", [
    ({"int8": ["output"], "exclude": ["output"]}, "quantize lists output both in int8 and in exclude"),
    ({"int8": "layers.0", "exclude": ["layers.0", "output"]}, "quantize lists layers.0 both in int8 and in exclude"),
])
def test_the_same_module_in_int8_and_exclude_is_refused_up_front(args, words):
    with pytest.raises(PrunusError, match=f"^r.yaml: pass 1: {words}; keep each module in one list"):
        check_pass("quantize", {**INT4, **args}, where="r.yaml: pass 1")


def test_overlapping_int8_and_exclude_patterns_are_refused_by_the_pass(ctx):
    check_pass("quantize", {**INT4, "int8": [WQ], "exclude": ["layers.0"]}, where="r.yaml: pass 1")  # differ as text
    with pytest.raises(PrunusError, match=rf"^quantize: {WQ} in both int8=\['{WQ}'\] and exclude=\['layers.0'\]; keep"):
        run((ctx.teacher, ctx), "quantize", {**INT4, "int8": [WQ], "exclude": ["layers.0"]})


@pytest.mark.parametrize("name, args, words", [
    ("quantize", {**EIGHT, "exclude": ["outptu"]}, "quantize: exclude 'outptu' names no module of the model"),
    ("quantize", {**INT4, "exclude": ["layers.9"]}, "quantize: exclude 'layers.9' names no module of the model"),
    ("quantize", {**INT4, "int8": ["tok_embeddings"]}, "quantize: int8 'tok_embeddings' names no float Linear module"),
    ("prune", {"method": "magnitude", "exclude": "w9"}, "prune: exclude 'w9' names no module of the model"),
])
def test_a_name_that_matches_no_module_is_refused(ctx, name, args, words):
    with pytest.raises(PrunusError, match=f"^{words}"):
        run((ctx.teacher, ctx), name, args)


def test_cli_refuses_conflicting_and_idle_options_in_one_line(tmp_path, ctx, assert_user_error):
    recipes = {"both.yaml": ("passes:\n  - quantize: {scheme: int4-weight-only, int8: [output], exclude: [output]}\n",
                             "pass 1: quantize lists output both in int8 and in exclude"),
               "idle.yaml": ("passes:\n  - quantize: {scheme: int8-weight-only, n_calib: 4}\n",
                             "pass 1: quantize.n_calib acts only with scheme w8a8-static"),
               "bogus.yaml": ("passes:\n  - prune: {method: wanda, sparsity_target: 0.5}\n",
                              "pass 1: pass 'prune' has no argument 'sparsity_target'")}
    for file, (text, words) in recipes.items():
        (tmp_path / file).write_text(text)
        r = CliRunner().invoke(cli, ["compress", str(ctx.source), "--recipe", str(tmp_path / file), "--out",
                                     str(tmp_path / "out"), "--no-latency"])
        assert_user_error(r, words)
        assert not (tmp_path / "out").exists()
