"""Prefix-aware routing against Ray Serve's own router, on ``prunus serve --replicas 2``.

Two replicas of a random model of the ``small`` preset's shape (torch backend, one thread each, automatic prefix
caching of ``--cache-mb`` MiB each: by default room for about half of the system prompts' KV blocks, so a replica
that sees every system prompt keeps evicting them) behind one Ray Serve address. ``--clients`` threads each send
``--requests`` streamed completions back to back: one of ``--systems`` system prompts (``--system-chars``
characters each, one byte-level token a character), picked at random with a fixed seed, then a question of its
own; ``--tokens`` new tokens each (``min_tokens`` equal, so every answer runs to its length).

The same workload runs once with each router per round (``--rounds``; the order flips every round), each on a
freshly deployed application (empty caches), after a warm-up of two short requests. Reported per router: time to
the first token (mean and p50 / p90 over the requests), output tokens/s (all requests' tokens / wall time), and
per replica the prefix cache's hit rate (hits / lookups) and the share of prompt tokens it restored, read from
the replicas' own metrics (``GET /metrics``, labelled ``replica``); then the ratios prefix / default. Timings
never fail the run; the machine is named, and the load average at the start and end says how busy it was.

    OMP_WAIT_POLICY=PASSIVE python -m benchmarks.ray_prefix_routing [--clients 8] [--requests 6] [--systems 6]
        [--rounds 2] [--imbalance 2] [--json F]
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import re
import statistics
import tempfile
import threading
import time
from pathlib import Path

import benchmarks._omp  # noqa: F401  (OMP_WAIT_POLICY=PASSIVE unless set; before torch loads)

from benchmarks.harness import machine_line, show, write_results

ROUTERS = ("prefix", "default")
WORDS = ("parse the config and return a dict of settings; check every key against the schema; raise on unknown "
         "fields; keep the order of the sections; log each default that was filled in; ").split()


def model_dir(where: Path) -> Path:
    import torch

    from prunus.models import Transformer, get_preset, save_model

    torch.manual_seed(0)
    model = Transformer(get_preset("small").replace(max_seq_len=2048))
    model.init_weights()
    return save_model(model.eval(), where / "model", stage="benchmark")


def workload(args) -> list[list[str]]:
    """Each client's prompts: a system prompt picked at random, then a question of its own."""
    rng = random.Random(0)
    systems = [f"System {i}: " + " ".join(rng.choice(WORDS) for _ in range(args.system_chars // 4))
               for i in range(args.systems)]
    systems = [s[:args.system_chars] for s in systems]
    return [[rng.choice(systems) + f"\nUser {c}.{r}: what does line {rng.randrange(1000)} do?\nAnswer:"
             for r in range(args.requests)] for c in range(args.clients)]


def cache_mb(args) -> float:
    """Room for about half of the system prompts' KV blocks (small preset: 4 layers, 4 KV heads of 32, float32)."""
    per_token = 2 * 4 * 4 * 32 * 4
    return round(max(1, args.systems // 2) * args.system_chars * per_token * 1.1 / 2**20, 2)


def stream_one(port: int, prompt: str, tokens: int) -> tuple[float | None, int]:
    """(seconds to the first text chunk, completion tokens) of one streamed completion; (None, 0) on failure."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    body = {"model": "model", "prompt": prompt, "max_tokens": tokens, "min_tokens": tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    first, made = None, 0
    for line in resp:
        if not line.startswith(b"data: {"):
            continue
        event = json.loads(line[6:])
        if first is None and any(c.get("text") for c in event.get("choices", [])):
            first = time.perf_counter() - t0
        made = (event.get("usage") or {}).get("completion_tokens", made)
    conn.close()
    return (first, made) if resp.status == 200 else (None, 0)


def drive(port: int, work: list[list[str]], tokens: int) -> dict:
    ttfts, made, failed, lock = [], [0], [0], threading.Lock()

    def client(prompts):
        for p in prompts:
            first, n = stream_one(port, p, tokens)
            with lock:
                (ttfts.append(first) if first is not None else failed.__setitem__(0, failed[0] + 1))
                made[0] += n
    threads = [threading.Thread(target=client, args=(w,)) for w in work]
    t0 = time.perf_counter()
    [t.start() for t in threads]
    [t.join() for t in threads]
    return {"ttft": ttfts, "tokens": made[0], "wall_s": time.perf_counter() - t0, "failed": failed[0]}


def replica_cache(port: int) -> dict[str, dict[str, float]]:
    """{replica: {lookups, hits, prompt_tokens, reused_tokens}} from the aggregated /metrics."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    conn.request("GET", "/metrics")
    text = conn.getresponse().read().decode()
    conn.close()
    out: dict[str, dict[str, float]] = {}
    for name, replica, value in re.findall(r'prunus_prefix_cache_(\w+)_total\{replica="([^"]+)"\} ([0-9.e+]+)', text):
        out.setdefault(replica, {})[name] = float(value)
    return out


def run_router(router: str, path: Path, args, work) -> dict:
    from ray import serve

    from prunus.serve.ray_deployment import APP_NAME, deploy
    from prunus.serve.ray_settings import RaySettings

    load = {"backend": "torch", "max_batch": 4, "max_queue": 256, "compile": False, "threads": 1,
            "prefix_cache_mb": args.cache_mb}
    settings = RaySettings(replicas=2, replica_cpus=args.replica_cpus, router=router, ray_cpus=args.ray_cpus,
                           imbalance=args.imbalance)
    url = deploy(path, load, {"shutdown_grace": 1.0}, settings, port=args.port)
    port = int(url.rsplit(":", 1)[1])
    try:
        for p in ("warm up one", "warm up two"):
            stream_one(port, p, 2)
        result = drive(port, work, args.tokens)
        time.sleep(1.5)  # the replicas push their registries every 0.5 s
        result["cache"] = replica_cache(port)
    finally:
        serve.delete(APP_NAME)
    return result


def summary(router: str, runs: list[dict]) -> dict:
    ttft = [t for r in runs for t in r["ttft"]]
    q = statistics.quantiles(ttft, n=10) if len(ttft) > 1 else ttft * 9
    tps = [r["tokens"] / r["wall_s"] for r in runs]
    return {"router": router, "ttft_mean_s": statistics.mean(ttft), "ttft_p50_s": statistics.median(ttft),
            "ttft_p90_s": q[8], "tokens_per_s": statistics.median(tps), "failed": sum(r["failed"] for r in runs),
            "requests": len(ttft), "cache": [r["cache"] for r in runs]}


def cache_words(cache: dict[str, dict[str, float]]) -> str:
    parts = []
    for replica, c in sorted(cache.items()):
        hit = c.get("hits", 0) / c["lookups"] if c.get("lookups") else 0.0
        reused = c.get("reused_tokens", 0) / c["prompt_tokens"] if c.get("prompt_tokens") else 0.0
        parts.append(f"{replica}: {hit:.0%} hits, {reused:.0%} tokens ({int(c.get('lookups', 0))} prompts)")
    return "; ".join(parts)


def report(results: dict[str, dict], args) -> None:
    rows = [[r["router"], f"{r['ttft_mean_s'] * 1e3:,.0f}", f"{r['ttft_p50_s'] * 1e3:,.0f}",
             f"{r['ttft_p90_s'] * 1e3:,.0f}", f"{r['tokens_per_s']:,.1f}", str(r["failed"]),
             " | ".join(cache_words(c) for c in r["cache"])] for r in results.values()]
    show(f"prunus serve --replicas 2 on Ray Serve: {args.clients} clients x {args.requests} requests, "
         f"{args.systems} system prompts of {args.system_chars} chars, {args.tokens} tokens each",
         ["router", "TTFT mean ms", "p50 ms", "p90 ms", "tokens/s", "failed", "prefix cache per replica"], rows,
         width=180)
    p, d = results["prefix"], results["default"]
    print(f"ratio prefix / default: time to first token (mean) {p['ttft_mean_s'] / d['ttft_mean_s']:.2f}x, "
          f"p90 {p['ttft_p90_s'] / d['ttft_p90_s']:.2f}x, throughput {p['tokens_per_s'] / d['tokens_per_s']:.2f}x")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--requests", type=int, default=6, help="requests per client")
    ap.add_argument("--systems", type=int, default=6, help="distinct system prompts")
    ap.add_argument("--system-chars", type=int, default=1200)
    ap.add_argument("--tokens", type=int, default=8, help="new tokens per request")
    ap.add_argument("--cache-mb", type=float, default=None, help="prefix cache per replica (default: half the prompts)")
    ap.add_argument("--replica-cpus", type=float, default=1.0)
    ap.add_argument("--ray-cpus", type=int, default=None, help="CPUs of the local Ray cluster (default: enough for both)")
    ap.add_argument("--imbalance", type=int, default=2, help="the prefix router's load imbalance threshold")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    args.cache_mb = args.cache_mb or cache_mb(args)
    if args.port == 0:  # one port for every deployment: Serve's proxy keeps the address it started on
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            args.port = s.getsockname()[1]
    os.environ.setdefault("RAY_NODE_IP_ADDRESS", "127.0.0.1")
    print(machine_line(), f"| load average at the start {os.getloadavg()[0]:.1f}")
    print(f"prefix cache {args.cache_mb} MiB per replica")
    from prunus.serve.ray_deployment import stop

    work, runs = workload(args), {r: [] for r in ROUTERS}
    with tempfile.TemporaryDirectory() as tmp:
        path = model_dir(Path(tmp))
        try:
            for i in range(args.rounds):
                for router in (ROUTERS if i % 2 == 0 else ROUTERS[::-1]):
                    runs[router].append(run_router(router, path, args, work))
        finally:
            stop()
    results = {r: summary(r, runs[r]) for r in ROUTERS}
    report(results, args)
    print(f"load average at the end {os.getloadavg()[0]:.1f} (timings are rough: other work shared the cores)")
    if args.json:
        write_results(args.json, vars(args), results)


if __name__ == "__main__":
    main()
