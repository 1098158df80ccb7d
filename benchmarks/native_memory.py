"""Memory of a genai export served natively (the default) against the same export in ONNX Runtime (--no-native).

Each contender runs in a fresh process: prunus and torch are imported, the peak resident set is reset
(``/proc/self/clear_refs``), then ``Engine.load`` of the export, one request (a prompt of ``--prompt-tokens`` ids and
``--new-tokens`` greedy tokens) and its close. Printed per export and runtime: the resident set after the load, the
peak over load and request (both above what the imports held), and the ratio native / ONNX Runtime (under 1:
native holds less). The KV buffers are the same in both (float32, ``--max-batch`` x ``--max-len``).

    python -m benchmarks.native_memory --export int8=/tmp/smol/int8-genai [--export fp32=DIR ...] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from benchmarks.harness import machine_line, show

MODES = {"native": True, "onnxruntime": False}


def _status(key: str) -> int:
    """A /proc/self/status entry in bytes (VmRSS, VmHWM)."""
    line = next(x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith(key + ":"))
    return int(line.split()[1]) * 1024


def measure(export: str, native: bool, args: dict) -> dict:
    """In this process: load, one request, close; bytes above the imports' resident set."""
    from prunus.serve import Engine

    base = _status("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # the peak resident set starts again from now
    engine = Engine.load(export, native=native, threads=args["threads"], max_batch=args["max_batch"],
                         max_len=args["max_len"])
    loaded = _status("VmRSS")
    prompt = [(7 * i) % 1000 + 10 for i in range(args["prompt_tokens"])]
    with engine:
        engine.wait(engine.submit(prompt, args["new_tokens"], temperature=0.0, ignore_eos=True))
        runtime = engine.info["runtime"]
    return {"runtime": runtime, "loaded": loaded - base, "peak": _status("VmHWM") - base}


def _child(export: str, native: bool, args: dict) -> dict:
    code = ("import json, sys; from benchmarks.native_memory import measure; "
            "print(json.dumps(measure(sys.argv[1], sys.argv[2] == '1', json.loads(sys.argv[3]))))")
    done = subprocess.run([sys.executable, "-c", code, export, "1" if native else "0", json.dumps(args)],
                          capture_output=True, text=True, cwd=Path(__file__).resolve().parents[1])
    if done.returncode != 0:
        raise SystemExit(f"{export}: {done.stderr.strip().splitlines()[-1:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--export", action="append", required=True, help="PRECISION=genai export dir (repeat)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-batch", type=int, default=8)
    ap.add_argument("--max-len", type=int, default=2048)
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=32)
    a = ap.parse_args()
    args = {"threads": a.threads, "max_batch": a.max_batch, "max_len": a.max_len, "prompt_tokens": a.prompt_tokens,
            "new_tokens": a.new_tokens}
    print(machine_line())
    rows = []
    for item in a.export:
        name, _, path = item.partition("=")
        got = {mode: _child(path, native, args) for mode, native in MODES.items()}
        mb = {mode: (g["loaded"] / 2**20, g["peak"] / 2**20) for mode, g in got.items()}
        rows.append([name, *(f"{mb[m][0]:,.0f} / {mb[m][1]:,.0f} MiB ({got[m]['runtime']})" for m in MODES),
                     f"{mb['native'][0] / mb['onnxruntime'][0]:.2f}x / {mb['native'][1] / mb['onnxruntime'][1]:.2f}x"])
    show(f"Resident memory above the imports, after load / peak over load and one request (max_batch "
         f"{a.max_batch}, max_len {a.max_len}, {a.prompt_tokens}-token prompt, {a.new_tokens} new tokens)",
         ["export", "native (default)", "ONNX Runtime (--no-native)", "native / ONNX Runtime"], rows)


if __name__ == "__main__":
    main()
