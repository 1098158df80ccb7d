import os, sys, time, statistics
from pathlib import Path
from prunus.runtime.native_backend import load
from prunus.runtime.load_options import LoadOptions
from prunus.runtime.artifact import read_artifact_config
p = Path(sys.argv[1]); cfg = read_artifact_config(p)
be = load(p, cfg, LoadOptions(max_batch=1, max_len=1024, threads=int(os.environ.get("T", "1")))).backend
CTX = int(os.environ.get("CTX", "400")); be.prefill([0], [list(range(100, 100 + CTX))])
times = {n: [] for n in range(1, 8)}
for rep in range(30):
    for n in times:
        t = time.perf_counter()
        be.verify(0, list(range(600, 600 + n)))
        times[n].append(time.perf_counter() - t)
        be.truncate(0, CTX)
base = statistics.median(times[1])
print(" ".join(f"{n}:{statistics.median(v)*1e3:.2f}ms({statistics.median(v)/base:.2f})" for n, v in times.items()))
