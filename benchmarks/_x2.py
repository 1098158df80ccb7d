import os, sys, time, statistics
from pathlib import Path
from prunus.runtime.native_backend import load
from prunus.runtime.load_options import LoadOptions
from prunus.runtime.artifact import read_artifact_config
p = Path(sys.argv[1]); cfg = read_artifact_config(p)
be = load(p, cfg, LoadOptions(max_batch=1, max_len=1024, threads=int(os.environ.get("T", "1")))).backend
pl = be.decoder.plan
print(pl.how)
for k, v in pl.plans.items(): print(" ", k, v)
print([ (k, getattr(be.packed, k).dtype if hasattr(getattr(be.packed, k), "dtype") else None) for k in dir(be.packed) if not k.startswith("_")][:30])
