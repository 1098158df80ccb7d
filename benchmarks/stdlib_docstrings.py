"""An instruction set built offline from the Python standard library: a function's signature as the prompt,
the first paragraph of its docstring as the completion.

    python -m benchmarks.stdlib_docstrings OUT_DIR      # writes train.jsonl, heldout.jsonl, train.txt

Rows are ``{"prompt", "completion", "module"}``: the prompt a comment naming the function, its ``def`` line
and an opening triple quote, the completion the docstring's first paragraph and the closing quotes; taken with
``inspect`` from public functions (and methods of public classes) whose signature ``inspect`` can read and
whose docstring is 20-400 characters in its first paragraph. The held-out split is by module: no function of
a held-out module is seen in training. ``train.txt`` holds the training rows as plain text (prompt and
completion, a blank line between rows) for training on raw text. The rows depend only on the Python version.
"""

from __future__ import annotations

import importlib
import inspect
import json
from pathlib import Path

TRAIN_MODULES = ("json", "textwrap", "string", "shutil", "random", "statistics", "fractions", "heapq", "bisect",
                 "functools", "os.path", "pathlib", "csv", "base64", "zipfile", "tarfile", "logging", "argparse",
                 "email.utils", "urllib.parse", "datetime", "collections", "copy", "pprint", "tempfile", "glob",
                 "fnmatch", "hashlib", "hmac", "secrets", "difflib", "configparser", "gettext", "locale", "codecs")
HELDOUT_MODULES = ("calendar", "ipaddress", "shlex", "wave", "uuid", "gzip", "html", "mimetypes")
MAX_ROWS_PER_MODULE = 40


def _summary(doc: str | None) -> str | None:
    """The docstring's first paragraph on one line, or None when it is missing, too short or too long."""
    if not doc:
        return None
    first = inspect.cleandoc(doc).split("\n\n")[0]
    text = " ".join(line.strip() for line in first.splitlines())
    return text if 20 <= len(text) <= 400 else None


def _functions(module):
    """(qualified name, function) of the module's public functions and its public classes' public methods."""
    for name, obj in sorted(vars(module).items()):
        if name.startswith("_") or getattr(obj, "__module__", None) != module.__name__:
            continue
        if inspect.isfunction(obj):
            yield name, obj
        elif inspect.isclass(obj):
            for mname, meth in sorted(vars(obj).items()):
                if not mname.startswith("_") and inspect.isfunction(meth):
                    yield f"{name}.{mname}", meth


def module_rows(module_name: str) -> list[dict]:
    """The rows of one module (at most MAX_ROWS_PER_MODULE, in name order)."""
    module = importlib.import_module(module_name)
    rows = []
    for qualname, fn in _functions(module):
        summary = _summary(fn.__doc__)
        try:
            signature = str(inspect.signature(fn))
        except (TypeError, ValueError):
            continue
        if summary is None or len(signature) > 200:
            continue
        name = qualname.rsplit(".", 1)[-1]
        rows.append({"module": module_name, "function": qualname,
                     "prompt": f'# {module_name}.{qualname}\ndef {name}{signature}:\n    """',
                     "completion": f'{summary}\n    """\n'})
        if len(rows) == MAX_ROWS_PER_MODULE:
            break
    return rows


def build(out: str | Path) -> dict:
    """Write train.jsonl, heldout.jsonl and train.txt under ``out``; returns their row counts."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    split = {"train": [r for m in TRAIN_MODULES for r in module_rows(m)],
             "heldout": [r for m in HELDOUT_MODULES for r in module_rows(m)]}
    for name, rows in split.items():
        with open(out / f"{name}.jsonl", "w") as f:
            for row in rows:
                f.write(json.dumps({"prompt": row["prompt"], "completion": row["completion"], "module": row["module"]}) + "\n")
    (out / "train.txt").write_text("\n\n".join(r["prompt"] + r["completion"] for r in split["train"]) + "\n")
    return {name: len(rows) for name, rows in split.items()}


def main(argv: list[str] | None = None) -> None:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", nargs="?", default="runs/stdlib_docstrings", help="the folder the three files go to")
    print(build(ap.parse_args(argv).out))


if __name__ == "__main__":
    main()
