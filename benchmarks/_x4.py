import cProfile, pstats, sys
from benchmarks.eagle import prompts
from prunus.serve import Engine
d = sys.argv[1] if sys.argv[1] != "none" else None
e = Engine.load("/tmp/smol/export-int8", max_batch=1, threads=1, draft=d, draft_tokens=6)
p = prompts(1500)["code"]
e.generate(p, max_new_tokens=256, ignore_eos=True)
pr = cProfile.Profile(); pr.enable()
r = e.generate(p, max_new_tokens=256, ignore_eos=True)
pr.disable()
print(r.decode_tokens_per_s)
pstats.Stats(pr).sort_stats("tottime").print_stats(14)
