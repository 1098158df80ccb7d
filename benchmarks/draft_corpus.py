"""The text a speculative-decoding draft is distilled on, built offline from Python's own files.

    python -m benchmarks.draft_corpus OUT.txt [--max-bytes 4000000]

Python source of the standard library (every ``.py`` file outside ``json/``, ``test/``, ``idlelib/`` and
``site-packages``, in path order) interleaved file by file with the training topics of ``pydoc_data.topics``
(the English prose ``data/prose.py`` splits; its held-out topics are left out), so that both the code and the
prose prompts of ``benchmarks/speculative.py`` (Python's ``json`` source, a held-out topic) are text the
student never saw. Then ``prunus compress TARGET --recipe R.yaml --data OUT.txt`` distills on it.
"""

from __future__ import annotations

import argparse
from pathlib import Path

SKIPPED_PACKAGES = ("json", "test", "idlelib", "lib2to3", "tkinter", "turtledemo")
MAX_LINE = 500  # longer lines (generated tables) are dropped


def source_files() -> list[Path]:
    from prunus.data.corpus import stdlib_files

    root, files = stdlib_files()
    return [f for f in files if f.relative_to(root).parts[0] not in SKIPPED_PACKAGES]


def clean(text: str) -> str:
    return "\n".join(line for line in text.splitlines() if len(line) <= MAX_LINE) + "\n\n"


def build(max_bytes: int) -> str:
    from prunus.data.prose import prose_documents

    code = [clean(f.read_text(encoding="utf-8", errors="replace")) for f in source_files()]
    prose = [clean(d.decode("utf-8")) for d in prose_documents()[0]]
    parts, size, i = [], 0, 0
    while size < max_bytes and (i < len(code) or i < len(prose)):
        for group in (code, prose):
            if i < len(group):
                parts.append(group[i])
                size += len(group[i])
        i += 1
    return "".join(parts)[:max_bytes]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out")
    ap.add_argument("--max-bytes", type=int, default=4_000_000)
    args = ap.parse_args()
    text = build(args.max_bytes)
    Path(args.out).write_text(text, encoding="utf-8")
    print(f"wrote {args.out}: {len(text.encode()):,} bytes")


if __name__ == "__main__":
    main()
