"""How a pass and its arguments are named in a compression report's rows: ``prune(ratio=0.5)``."""

from __future__ import annotations


def pass_label(name: str, args: dict) -> str:
    if not args:
        return name
    return f"{name}(" + ", ".join(f"{k}={v}" for k, v in args.items()) + ")"
