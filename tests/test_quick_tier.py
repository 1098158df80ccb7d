"""The quick tier's list of slow tests (tests/conftest.py SLOW_REASONS) names tests that exist, so a renamed
or moved test cannot leave it silently and fall into `make test-quick`."""

import re
from pathlib import Path

from conftest import SLOW

HERE = Path(__file__).parent


def test_every_slow_entry_names_a_test_module_or_function():
    for entry in SLOW:
        module, _, test = entry.partition("::")
        path = HERE / module
        assert path.is_file(), entry
        if test:
            name = test.split("[", 1)[0]
            assert re.search(rf"^def {re.escape(name)}\(", path.read_text(), re.M), entry


def test_slow_is_a_registered_marker():
    text = (HERE.parent / "pyproject.toml").read_text()
    assert re.search(r'^markers = \["slow: ', text, re.M)
