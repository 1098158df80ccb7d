"""Every numeric argument of every compression pass follows one rule (compress/pass_arguments.py Span): a
finite number in its documented range, else one line naming the argument, before any model is loaded;
through a recipe, the API's check and the CLI shortcuts (``--distill width:nan``, ``--prune wanda:inf``,
``--distill-lr nan``, ``--max-quality-drop inf``)."""

from __future__ import annotations

import math
import re

import pytest
import torch
from click.testing import CliRunner

from prunus.artifacts.errors import PrunusError
from prunus.cli.main import cli
from prunus.compress.pass_arguments import VALUE_CHECKS, Span
from prunus.compress.quantize import scheme_options
from prunus.compress.recipe import PASSES, check_pass, pass_parameters
from prunus.models import Transformer, get_preset, save_model

NEEDED = {"prune": {"method": "magnitude"}, "prune_structured": {"target": "heads", "amount": 0.25},
          "distill_module": {"student": "m:f"}}


def needed(name: str, arg: str) -> dict:
    """The arguments ``name`` needs beside ``arg`` (quantize: a scheme that takes it)."""
    if name == "quantize":
        return {"scheme": "int4-weight-only" if arg in scheme_options("int4-weight-only") else "w8a8-static"}
    return {k: v for k, v in NEEDED.get(name, {}).items() if k != arg}


def spans() -> list[tuple[str, str, Span]]:
    return [(name, arg, check) for (name, arg), (check, _) in VALUE_CHECKS.items() if isinstance(check, Span)]


def bad_values(s: Span) -> list:
    """Values outside ``s``: non-finite, past each end, the wrong kind."""
    out = [math.nan, math.inf, -math.inf, True, "1"]
    step = 1 if s.integer else 1e-9 * max(1, abs(s.lo))
    out.append(s.lo if s.open_lo else s.lo - step)
    if math.isfinite(s.hi):
        out.append(s.hi if s.open_hi else s.hi + (1 if s.integer else 1e-6 * max(1.0, s.hi)))
    if s.integer:
        out.append(float(s.lo + 1))  # a float where a whole count is meant
    return out


@pytest.mark.parametrize("name, arg, s", spans(), ids=lambda v: v if isinstance(v, str) else "")
def test_every_numeric_argument_refuses_what_is_outside_its_range(name, arg, s):
    base = needed(name, arg)
    for value in bad_values(s):
        with pytest.raises(PrunusError) as e:
            check_pass(name, {**base, arg: value}, where="r.yaml: pass 1")
        msg = str(e.value)
        assert msg.startswith(f"r.yaml: pass 1: {name}.{arg}=") and "\n" not in msg, (value, msg)
    for value in (s.lo if not s.open_lo else None, s.hi if math.isfinite(s.hi) and not s.open_hi else None):
        if value is not None:  # each closed end is taken
            assert s(value) and s(int(value) if s.integer else value)


def test_every_numeric_argument_of_every_pass_is_checked_by_the_rule():
    """An int or float argument added to a pass without a range in VALUE_CHECKS fails here."""
    found = set()
    for name in PASSES:
        families = [needed(name, s) for s in ("granularity", "algorithm")] if name == "quantize" else [needed(name, "")]
        for args in families:
            for arg, p in pass_parameters(name, args)[0].items():
                if re.search(r"\b(int|float)\b", str(p.annotation)):
                    found.add((name, arg))
    unchecked = {k for k in found if not isinstance(VALUE_CHECKS.get(k, (None,))[0], Span)}
    assert unchecked == {("prune_structured", "amount")}  # a fraction or a count: both Spans, joined
    check, _ = VALUE_CHECKS[("prune_structured", "amount")]
    assert all(not check(v) for v in (math.nan, math.inf, 0, 1.0, -1, 1.5, True))
    assert check(0.25) and check(2)


@pytest.mark.parametrize("spec, words", [
    ("width:nan", "width:F takes a finite number of at least 1, not nan"),
    ("width:inf", "width:F takes a finite number of at least 1, not inf"),
    ("width:-1", "width:F takes a finite number of at least 1, not -1"),
    ("width:0", "width:F takes a finite number of at least 1, not 0"),
    ("keep-every:nan", "keep-every:K takes a finite number"),
    ("depth:inf", "depth:N takes a finite number"),
    ("keep-every:1.5", "keep-every:K takes a whole number of blocks, not 1.5"),
    ("depth:x", "depth:N takes a number, not 'x'"),
    ("keep-every:2,tiny", "'tiny' is no derivation"),
])
def test_student_specs_are_checked_before_any_model_is_read(spec, words):
    with pytest.raises(PrunusError, match=re.escape(f"--distill: distill.student={spec!r} is not valid: {words}")):
        check_pass("distill", {"student": spec}, where="--distill")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    torch.manual_seed(0)
    model = Transformer(get_preset("tiny"))
    model.init_weights()
    return save_model(model.eval(), tmp_path_factory.mktemp("numbers") / "m", stage="test")


CLI_CASES = [
    (["--distill", "width:nan"], "--distill: distill.student='width:nan' is not valid: width:F takes a finite number"),
    (["--distill", "width:inf"], "distill.student='width:inf' is not valid"),
    (["--distill", "width:-2"], "distill.student='width:-2' is not valid"),
    (["--distill", "keep-every:nan"], "distill.student='keep-every:nan' is not valid"),
    (["--distill", "depth:inf"], "distill.student='depth:inf' is not valid"),
    (["--distill", "depth:0"], "distill.student='depth:0' is not valid"),
    (["--distill", "width:2", "--distill-lr", "nan"], "distill.lr=nan is not valid; use a positive finite number"),
    (["--distill", "width:2", "--distill-lr", "inf"], "distill.lr=inf is not valid"),
    (["--distill", "width:2", "--distill-lr", "-1"], "distill.lr=-1.0 is not valid"),
    (["--distill", "width:2", "--distill-lr", "0"], "distill.lr=0.0 is not valid"),
    (["--distill", "width:2", "--distill-steps", "0"], "distill.steps=0 is not valid; use an integer from 1 to"),
    (["--distill", "width:2", "--distill-batch-size", "-4"], "distill.batch_size=-4 is not valid"),
    (["--prune", "wanda:nan"], "--prune: prune.sparsity=nan is not valid; use a number in [0, 1)"),
    (["--prune", "magnitude:inf"], "prune.sparsity=inf is not valid"),
    (["--prune", "magnitude:-0.1"], "prune.sparsity=-0.1 is not valid"),
    (["--prune", "heads:nan"], "prune_structured.amount=nan is not valid"),
    (["--prune", "channels:0"], "prune_structured.amount=0.0 is not valid"),
    (["--prune", "blocks:-1"], "prune_structured.amount=-1 is not valid"),
    (["--prune", "blocks:1.5"], "--prune blocks:1.5: '1.5' is not a whole number of blocks"),
    (["--quantize", "int8-weight-only", "--max-quality-drop", "nan"], "--max-quality-drop nan: must be a finite fraction"),
    (["--quantize", "int8-weight-only", "--max-quality-drop", "inf"], "--max-quality-drop inf: must be a finite fraction"),
    (["--quantize", "int8-weight-only", "--max-quality-drop", "-1"], "--max-quality-drop -1.0: must be a finite fraction"),
]


@pytest.mark.parametrize("args, words", CLI_CASES, ids=[" ".join(a[-2:]) for a, _ in CLI_CASES])
def test_cli_numbers_outside_their_range_are_one_line(tmp_path, model_dir, args, words, assert_user_error):
    r = CliRunner().invoke(cli, ["compress", str(model_dir), *args, "--out", str(tmp_path / "out"), "--no-latency"])
    assert_user_error(r, words)
    assert not (tmp_path / "out").exists()


RECIPE_CASES = [
    ("smoothquant: {alpha: .nan}", "pass 1: smoothquant.alpha=nan is not valid; use a number in [0, 1]"),
    ("distill: {temperature: .inf}", "pass 1: distill.temperature=inf is not valid; use a positive finite number"),
    ("distill: {hidden_weight: -.inf}", "pass 1: distill.hidden_weight=-inf is not valid"),
    ("quantize: {scheme: w8a8-static, calibration: percentile, percentile: .nan}", "quantize.percentile=nan is not valid"),
    ("quantize: {scheme: int4-weight-only, algorithm: gptq, damp: .inf}", "quantize.damp=inf is not valid"),
    ("quantize: {scheme: w8a8-static, n_calib: 100000000}", "quantize.n_calib=100000000 is not valid; use an integer from 1"),
    ("prune_structured: {target: blocks, amount: -1}", "prune_structured.amount=-1 is not valid"),
    ("distill: {steps: 1.0e+30}", "distill.steps=1e+30 is not valid"),
]


@pytest.mark.parametrize("entry, words", RECIPE_CASES, ids=[e.split(":")[0] + " " + w.split("=")[0][-12:]
                                                          for e, w in RECIPE_CASES])
def test_cli_recipe_numbers_outside_their_range_are_one_line(tmp_path, model_dir, entry, words, assert_user_error):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"passes:\n  - {entry}\n")
    r = CliRunner().invoke(cli, ["compress", str(model_dir), "--recipe", str(recipe), "--out", str(tmp_path / "out"),
                                 "--no-latency"])
    assert_user_error(r, words)
    assert not (tmp_path / "out").exists()
