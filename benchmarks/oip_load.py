"""64 concurrent Open Inference Protocol clients against ``prunus serve`` of a small classifier.

The classifier is the digits CNN of :mod:`benchmarks.any_model_digits` (1 x 8 x 8 in, 10 logits out; seeded
random weights: the figures are serving, not accuracy), saved as a generic model dir and exported to ONNX
(fp32) by prunus. Each target, the ONNX Runtime export dir and the torch model dir, is served by
``prunus serve`` in a process of its own (``--max-batch``, ``--max-queue``, ``--max-delay-ms`` as given);
``--clients`` threads each send ``--requests`` ``POST /v2/models/NAME/infer`` of one row, back to back on
one connection each.

Reported: requests answered 200 and any other answer or failure (lost), the p50 / p99 / max latency,
requests/s, and the dynamic batcher's counters as ``GET /metrics`` gives them (passes, rows, requests merged,
mean occupancy = rows / (passes x max batch), the most requests in one pass), read after the load.

    OMP_WAIT_POLICY=PASSIVE python -m benchmarks.oip_load [--clients 64] [--requests 20] [--json F]
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import benchmarks._omp  # noqa: F401  (OMP_WAIT_POLICY=PASSIVE unless set; before torch loads)

from benchmarks.harness import machine_line, show, timed_threads, write_results

ROOT = Path(__file__).resolve().parent.parent
NAME = "digits"
SPEC = "benchmarks.any_model_digits:digits_cnn"


def make_dirs(tmp: Path) -> dict[str, tuple[Path, list[str]]]:
    """{target: (dir, extra serve options)}: the torch model dir and its ONNX export."""
    import torch

    from prunus.export import export_model
    from prunus.models.module_dir import input_spec, save_module
    from prunus.models.module_factory import build_module

    torch.manual_seed(0)
    module = build_module(SPEC, {}).eval()
    model = save_module(module, tmp / "model", stage="train", task="classification",
                        input=input_spec(torch.zeros(1, 8, 8)))
    export_model(model, tmp / "onnx", trust_factory=True, progress=False)
    return {"ONNX Runtime export": (tmp / "onnx", []), "torch model dir": (model, ["--trust-factory"])}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def call(port: int, method: str, path: str, body: bytes | None = None, conn=None):
    conn = conn or http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    conn.request(method, path, body, {"Content-Type": "application/json"} if body else {})
    resp = conn.getresponse()
    return resp.status, resp.read().decode()


def start_server(path: Path, extra: list[str], args) -> tuple[subprocess.Popen, int]:
    port = free_port()
    cmd = [sys.executable, "-m", "prunus.cli.main", "serve", str(path), "--port", str(port), "--served-model-name",
           NAME, "--max-batch", str(args.max_batch), "--max-queue", str(args.max_queue), "--max-delay-ms",
           str(args.max_delay_ms), *extra]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"prunus serve {path} exited {proc.returncode}: {proc.stderr.read()[-2000:]}")
        try:
            if call(port, "GET", "/v2/health/ready")[0] == 200:
                return proc, port
        except OSError:
            time.sleep(0.2)
    proc.kill()
    raise SystemExit(f"prunus serve {path}: not ready in 120 s")


def client(port: int, n: int, seed: int, latencies: list, failures: list) -> None:
    import random

    rng = random.Random(seed)
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    for i in range(n):
        body = json.dumps({"id": f"{seed}-{i}", "inputs": [{"name": "input", "shape": [1, 1, 8, 8], "datatype": "FP32",
                                                            "data": [rng.random() for _ in range(64)]}]}).encode()
        t0 = time.perf_counter()
        try:
            status, text = call(port, "POST", f"/v2/models/{NAME}/infer", body, conn)
        except OSError as e:
            failures.append(f"{type(e).__name__}: {e}")
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
            continue
        if status == 200 and json.loads(text)["outputs"][0]["shape"] == [1, 10]:
            latencies.append(time.perf_counter() - t0)
        else:
            failures.append(f"{status} {text[:200]}")


def batch_metrics(port: int) -> dict:
    """The dynamic batcher's counters from ``GET /metrics`` (an empty dict when it exposes none)."""
    text = call(port, "GET", "/metrics")[1]
    out = {}
    for line in text.splitlines():
        if line.startswith("prunus_batch_"):
            key, value = line.rsplit(" ", 1)
            out[key] = float(value)
    return out


def load(path: Path, extra: list[str], args) -> dict:
    proc, port = start_server(path, extra, args)
    try:
        latencies, failures = [], []
        threads = [threading.Thread(target=client, args=(port, args.requests, i, latencies, failures))
                   for i in range(args.clients)]
        wall = timed_threads(threads)
        return {"ok": len(latencies), "lost": len(failures), "failures": failures[:5], "wall_s": wall,
                "latencies": latencies, "metrics": batch_metrics(port)}
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


def report(results: dict, args) -> None:
    rows = []
    for target, r in results.items():
        lat, m = r["latencies"], r["metrics"]
        occ = f"{m['prunus_batch_occupancy']:.3f}" if "prunus_batch_occupancy" in m else "not exposed"
        per_pass = f"{m['prunus_batch_rows_total'] / m['prunus_batch_passes_total']:.1f}" \
            if m.get("prunus_batch_passes_total") else "n/a"
        rows.append([target, f"{r['ok']:,}", str(r["lost"]), f"{1e3 * statistics.median(lat):.1f}",
                     f"{1e3 * pct(lat, 0.99):.1f}", f"{1e3 * max(lat):.1f}", f"{r['ok'] / r['wall_s']:,.0f}",
                     f"{m.get('prunus_batch_passes_total', 0):,.0f}", per_pass, occ,
                     f"{m.get('prunus_batch_max_requests_per_pass', 0):.0f}"])
    show(f"{args.clients} OIP clients x {args.requests} requests of 1 row (max batch {args.max_batch}, max delay "
         f"{args.max_delay_ms} ms, max queue {args.max_queue})",
         ["target", "answered", "lost", "p50 ms", "p99 ms", "max ms", "req/s", "passes", "rows / pass",
          "occupancy", "most requests / pass"], rows, width=160)
    for target, r in results.items():
        if r["failures"]:
            print(f"{target}: first failures: {r['failures']}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--requests", type=int, default=20, help="requests per client")
    parser.add_argument("--max-batch", type=int, default=32)
    parser.add_argument("--max-queue", type=int, default=128)
    parser.add_argument("--max-delay-ms", type=float, default=2.0)
    parser.add_argument("--json", default=None, help="write the figures here as JSON")
    args = parser.parse_args(argv)
    print(machine_line())
    print(f"load average at start: {' '.join(f'{v:.2f}' for v in os.getloadavg())}")
    with tempfile.TemporaryDirectory(prefix="prunus-oip-") as tmp:
        results = {target: load(path, extra, args) for target, (path, extra) in make_dirs(Path(tmp)).items()}
    print(f"load average at end: {' '.join(f'{v:.2f}' for v in os.getloadavg())}")
    report(results, args)
    if args.json:
        write_results(args.json, vars(args), results)


if __name__ == "__main__":
    main()
