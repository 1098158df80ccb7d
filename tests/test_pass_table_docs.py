"""docs/compression.md's tables of pass arguments are what the recipe check accepts: each table between its
``<!-- pass-table NAME -->`` markers is :func:`prunus.compress.pass_table.markdown_table`'s output, every argument
the pass function takes has a row, and every ``--distill-*`` option of ``prunus compress`` sets an argument the
docs name; the documented ``--distill`` forms and recipe line pass the check."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from prunus.compress.pass_arguments import VALUE_CHECKS
from prunus.compress.pass_table import markdown_table
from prunus.compress.recipe import parse_recipe, pass_parameters, shortcut_passes

DOCS = Path(__file__).resolve().parents[1] / "docs" / "compression.md"


def _block(name: str) -> str:
    found = re.search(rf"<!-- pass-table {name}:[^\n]*-->\n(.*?)<!-- end pass-table -->", DOCS.read_text(), re.S)
    assert found, f"docs/compression.md has no pass-table {name} block"
    return found.group(1)


@pytest.mark.parametrize("name", ["distill", "distill_module"])
def test_docs_table_is_the_generated_one(name):
    assert _block(name) == markdown_table(name), f"regenerate it: python -m prunus.compress.pass_table {name}"


@pytest.mark.parametrize("name", ["distill", "distill_module"])
def test_every_accepted_argument_has_a_row(name):
    params, _ = pass_parameters(name, {})
    rows = _block(name)
    assert params and all(f"| `{key}` |" in rows for key in params)
    assert {k for p, k in VALUE_CHECKS if p == name} <= set(params)  # no check of an argument the pass lacks


def test_every_distill_cli_option_sets_a_documented_argument():
    from prunus.cli.compress import command

    params, _ = pass_parameters("distill", {})
    text = DOCS.read_text()
    options = [o for p in command.params for o in p.opts if o.startswith("--distill-")]
    assert options
    for option in options:
        key = option.removeprefix("--distill-").replace("-", "_")
        assert key in params and option in text and f"`{key}`" in text, option


@pytest.mark.parametrize("form", ["keep-every:2", "depth:6", "width:1.25", "keep-every:2,width:1.25", "tiny"])
def test_documented_distill_forms_pass_the_check(form):
    assert form in DOCS.read_text()
    assert shortcut_passes(distill=form) == [("distill", {"student": form})]


def test_documented_recipe_line_passes_the_check():
    line = "- distill: {student: depth:6, steps: 100, kd_weight: 0.5}"
    assert line in DOCS.read_text()
    assert parse_recipe(f"passes:\n  {line}\n") == [("distill", {"student": "depth:6", "steps": 100, "kd_weight": 0.5})]
