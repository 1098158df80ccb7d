"""One answer per request on a real model: greedy tokens of 8 prompts decoded alone, then all 8 together, per runtime.

On SmolLM2-135M (``/tmp/smol/model-dir`` or ``--model``) and its exports (``--export DIR``, as many as given: fp32 /
int8 / int4 genai exports made with ``prunus export``), every runtime that may serve them on this machine:

* ``native <path>``: the native kernels on each kernel path this CPU runs (``PRUNUS_NATIVE_ISA``), batch-invariant
  or not (``prunus.native.build.batch_invariant`` says which promise it);
* ``onnxruntime``: the same export with ``native=False``;
* ``torch``: the model dir itself.

Each prompt is a different piece of English prose or Python source (different lengths), ``--new-tokens`` greedy
tokens, ignore-eos, through the Engine's continuous-batching scheduler (the path ``prunus serve`` runs): first one
request at a time, then all eight submitted at once (a batch of 8 rows with seven different neighbours each). Prints,
per runtime, how many of the 8 answers are the same tokens both ways, and where the first one that differs parts.
With ``--json`` the results are written for the docs.

    OMP_WAIT_POLICY=PASSIVE python -m benchmarks.batch_invariance [--model DIR] --export DIR [--export DIR ...]
        [--new-tokens 64] [--json results.json]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import benchmarks._omp  # noqa: F401  (OMP_WAIT_POLICY=PASSIVE unless set; before torch loads)

from benchmarks.harness import machine_line, show


def prompts(n: int = 8) -> list[str]:
    """``n`` different texts of different lengths: paragraphs of Python's reference prose and of its own sources."""
    import inspect
    import json as json_module
    import textwrap

    from prunus.data.prose import prose_documents

    held_out = b"\n\n".join(prose_documents()[1]).decode()
    prose = [p.strip() for p in held_out.split("\n\n") if len(p.strip()) > 80]
    code = [textwrap.dedent(inspect.getsource(f)) for f in (json_module.dumps, json_module.loads, textwrap.dedent,
                                                            inspect.getsource)]
    texts = [t for pair in zip(prose, code) for t in pair] + prose[len(code):]
    return [t[:120 + 40 * i] for i, t in enumerate(texts[:n])]


def alone_and_together(engine, texts: list[str], new_tokens: int) -> tuple[list, list]:
    ids = [engine.encode(t) for t in texts]
    alone = [engine.wait(engine.submit(p, new_tokens, temperature=0.0, ignore_eos=True)).token_ids for p in ids]
    requests = [engine.submit(p, new_tokens, temperature=0.0, ignore_eos=True) for p in ids]
    return alone, [engine.wait(r).token_ids for r in requests]


def first_difference(a: list, b: list) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))


def contenders(model: Path, exports: list[Path]):
    """(name, path, Engine.load keywords, kernel path or None) for every runtime this machine can run."""
    from prunus.native.build import ISAS, isa_missing, unavailable

    out = [("torch (model dir)", model, {"backend": "torch"}, None)]
    for export in exports:
        precision = json.loads((export / "config.json").read_text())["export"]["precision"]
        out.append((f"{precision} onnxruntime", export, {"native": False}, None))
        if unavailable() is None:
            out += [(f"{precision} native {path}", export, {"native": True}, path) for path in ISAS
                    if isa_missing(path) is None]
    return out


def run_one(path: Path, load: dict, kernel_path: str | None, texts: list[str], new_tokens: int) -> dict:
    from prunus.native.build import batch_invariant, set_isa
    from prunus.serve import Engine

    before = set_isa(kernel_path) if kernel_path else None
    try:
        t0 = time.perf_counter()
        with Engine.load(path, max_batch=8, max_len=1024, **load) as engine:
            alone, together = alone_and_together(engine, texts, new_tokens)
            info = {k: engine.info.get(k) for k in ("runtime", "batch_invariant", "native_parity")}
    finally:
        if kernel_path:
            set_isa(before)
    diffs = [first_difference(a, b) for a, b in zip(alone, together)]
    return {"equal": sum(d is None for d in diffs), "rows": len(diffs), "first_differences": diffs,
            "promised": batch_invariant(kernel_path) if kernel_path else info["batch_invariant"],
            "info": info, "seconds": round(time.perf_counter() - t0, 1)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="/tmp/smol/model-dir")
    parser.add_argument("--export", action="append", default=[], help="A genai export dir (give several).")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--json", default=None, help="Write the results here.")
    args = parser.parse_args(argv)
    texts = prompts()
    print(f"{machine_line()}; {len(texts)} prompts, {args.new_tokens} greedy tokens, alone then all together")
    results, rows = {}, []
    for name, path, load, kernel_path in contenders(Path(args.model), [Path(e) for e in args.export]):
        r = results[name] = run_one(path, load, kernel_path, texts, args.new_tokens)
        parts = [str(d) for d in r["first_differences"] if d is not None]
        rows.append([name, f"{r['equal']}/{r['rows']}", str(r["promised"]), ", ".join(parts) or "-",
                     f"{r['seconds']:.0f}"])
        print(f"  {name}: {r['equal']}/{r['rows']} the same alone and together", flush=True)
    show("greedy tokens alone vs in a batch of 8", ["runtime", "same", "promised invariant",
                                                     "first differing token", "s"], rows)
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": machine_line(), "new_tokens": args.new_tokens,
                                               "results": results}, indent=1))


if __name__ == "__main__":
    main()
