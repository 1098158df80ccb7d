import sys
from benchmarks.eagle import prompts
from prunus.serve import Engine
kind = sys.argv[1]; k = int(sys.argv[2]); T = int(sys.argv[3])
for d in ("/tmp/eagle/draft4k-p2+ngram", "/tmp/eagle/draft4k-p2", None):
    e = Engine.load("/tmp/smol/export-int8", max_batch=1, threads=T, draft=d, draft_tokens=k)
    p = prompts(1500)[kind]
    e.generate(p, max_new_tokens=256, ignore_eos=True)
    sp = []
    for _ in range(2):
        r = e.generate(p, max_new_tokens=256, ignore_eos=True)
        sp.append(round(r.decode_tokens_per_s, 1))
    st = e.info.get("speculative", {})
    print(d, sp, st.get("tokens_per_step"), {s: (c["drafted"], c["accepted"]) for s, c in st.get("sources", {}).items()})
    e.close()
