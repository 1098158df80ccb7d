"""Speculative decoding at batch 1: decode tokens/s of plain decoding beside speculative decoding, in one run.

The target is SmolLM2-135M (``/tmp/smol/model-dir`` or ``--model``; else a random model of its shape). Contenders,
each an Engine with one cache row and ``--threads`` threads per pass, greedy, ``--new-tokens`` tokens after each
prompt, in alternating rounds:

* ``plain``: one decode pass per token;
* ``ngram``: prompt-lookup drafting (``draft="ngram"``), the first of ``--draft-tokens`` per step;
* ``D kK``: a draft model dir D, ``--draft DIR[,DIR...]`` (e.g. a student ``prunus compress --distill depth:N`` made from
  the target; its lineage is printed from its manifest), or by default a stand-in made here: the target's first
  ``--draft-layers`` blocks with its final norm and head (no training: a truncated copy, not a distilled student);
  one contender per draft and K of ``--draft-tokens 2,4``, named by the dir's last part;
* ``D alone``: the draft model decoding by itself, plain: its cost per token beside the target's.

Prompts: a repetitive code-like one (a table of similar functions), a piece of Python's own ``json`` source and
English prose (the first held-out topic of ``pydoc_data.topics``, ``data/prose.py``'s split: text a draft distilled
on ``benchmarks/draft_corpus.py`` never saw, as it never saw ``json``). Prints each contender's decode tokens/s
(median and range), its acceptance rate and tokens per step, whether its tokens equal plain decoding's, and the
ratio to plain. Timings never fail the run; losses are printed as they are.

    OMP_WAIT_POLICY=PASSIVE python -m benchmarks.speculative [--model DIR] [--draft DIR[,DIR]] [--draft-tokens 2,4]
        [--threads 1] [--rounds 2] [--no-ngram]
        [--prompts repetitive,json,prose]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import benchmarks._omp  # noqa: F401  (OMP_WAIT_POLICY=PASSIVE unless set; before torch loads)

REPETITIVE = "".join(f"def get_{name}(record):\n    \"\"\"The record's {name}.\"\"\"\n    return record[\"{name}\"]\n\n\n"
                     for name in ("id", "name", "email", "address", "phone", "city")) + "def get_"


def truncated_draft(target: Path, layers: int) -> Path:
    """The target's first ``layers`` blocks, its final norm and head, saved as a model dir with its tokenizer."""
    from dataclasses import replace

    import torch

    from prunus.models import Transformer, load_model, load_model_tokenizer, save_model

    model = load_model(target)
    small = Transformer(replace(model.config, n_layers=layers))
    state = {k: v for k, v in model.state_dict().items()
             if not k.startswith("layers.") or int(k.split(".")[1]) < layers}
    small.load_state_dict(state, strict=False)
    out = Path(tempfile.mkdtemp(prefix="prunus-draft-")) / "draft"
    with torch.no_grad():
        return save_model(small.eval(), out, tokenizer=load_model_tokenizer(target), stage="benchmark")


def lineage(draft: Path) -> str:
    """Where a draft model dir came from, in words, from its manifest and distillation record."""
    import json

    from prunus.models.model_dir import read_manifest

    manifest = read_manifest(draft)
    record = json.loads((draft / "config.json").read_text()).get("compression", {}).get("distillation") or {}
    parent = (manifest.get("parent") or {}).get("path", "none")
    text = f"{draft} ({manifest['stage']} of {parent}"
    if record:
        text += (f"; distilled student {record.get('student')} from the teacher's blocks {record.get('teacher_blocks')}, "
                 f"{record.get('steps')} steps x {record.get('batch_size')} x {record.get('seq_len')} tokens, "
                 f"{record.get('student_params'):,} of {record.get('teacher_params'):,} params")
    return text + ")"


def prose_prompt() -> str:
    from prunus.data.prose import prose_documents

    return prose_documents()[1][0].decode("utf-8")[:1500]


def run(engine, prompt: str, new_tokens: int) -> tuple[float, list[int]]:
    r = engine.generate(prompt, max_new_tokens=new_tokens, ignore_eos=True)
    return r.decode_tokens_per_s, r.token_ids


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="a prunus model dir (default: /tmp/smol/model-dir)")
    ap.add_argument("--draft", default=None, help="draft model dirs, comma-separated (default: a truncated copy of the target)")
    ap.add_argument("--draft-layers", type=int, default=8)
    ap.add_argument("--draft-tokens", default="4", help="draft tokens per step, one value or several: 2,4")
    ap.add_argument("--no-ngram", action="store_true", help="leave out prompt-lookup drafting")
    ap.add_argument("--prompts", default="repetitive,json,prose", help="which prompts, of: repetitive, json, prose")
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    if not set(args.prompts.split(",")) <= {"repetitive", "json", "prose"}:
        ap.error(f"--prompts {args.prompts}: choose from repetitive, json, prose")
    return args


def chosen_prompts(names: str) -> dict[str, str]:
    import inspect
    import json

    known = {"repetitive": ("repetitive code", lambda: REPETITIVE),
             "json": ("json source", lambda: inspect.getsource(json)[:1500]), "prose": ("prose", prose_prompt)}
    return {known[c][0]: known[c][1]() for c in names.split(",")}


def load_engines(target: Path, drafts: list[Path], named: bool, ks: list[int], args) -> dict:
    """plain, prompt lookup (unless --no-ngram), each draft alone and the target with each draft at each k."""
    from prunus.serve import Engine

    common = dict(max_batch=1, max_len=2048, threads=args.threads, compile=False)
    engines = {"plain": Engine.load(target, **common)}
    if not args.no_ngram:
        engines["ngram"] = Engine.load(target, draft="ngram", draft_tokens=ks[0], **common)
    for draft in drafts:
        name = draft.name if named else "draft"
        engines[f"{name} alone"] = Engine.load(draft, **common)
        for k in ks:
            engines[f"{name} k{k}"] = Engine.load(target, draft=draft, draft_tokens=k, **common)
    return engines


def contender_line(name: str, speeds, got: dict, engine, before: dict, same: bool, width: int) -> str:
    from benchmarks.harness import median_range, median_ratio

    line = f"  {name:{width}s} {median_range(speeds, '.1f')} tokens/s"
    if name.endswith(" alone"):
        return line + f", cost per token {median_ratio(got['plain'], speeds, '.2f')} of the target's"
    if name == "plain":
        return line
    s = engine.info["speculative"]
    drafted, accepted = s["drafted"] - before.get("drafted", 0), s["accepted"] - before.get("accepted", 0)
    steps = s["steps"] - before.get("steps", 0)
    return line + (f", acceptance {accepted / drafted if drafted else 0:.2f}, "
                   f"{(accepted + steps) / steps if steps else 0:.2f} tokens per step, "
                   f"same tokens as plain: {'yes' if same else 'no'}, "
                   f"ratio to plain {median_ratio(speeds, got['plain'], '.2f')}")


def time_prompt(engines: dict, label: str, prompt: str, args) -> None:
    from benchmarks.harness import alternating_rounds

    tokens: dict[str, list[int]] = {}
    before = {k: dict(e.info.get("speculative", {})) for k, e in engines.items()}

    def contender(name):
        def go():
            speed, ids = run(engines[name], prompt, args.new_tokens)
            tokens[name] = ids
            return speed
        return go

    got = alternating_rounds({k: contender(k) for k in engines}, args.rounds)
    print(f"\nprompt: {label} ({len(engines['plain'].encode(prompt))} tokens)")
    width = max(map(len, engines))
    for name, speeds in got.items():
        print(contender_line(name, speeds, got, engines[name], before[name], tokens[name] == tokens["plain"], width))


def main() -> None:
    from benchmarks._smol_dir import smol_model_dir
    from benchmarks.harness import machine_line

    args = parse_args()
    target, what = smol_model_dir(args.model)
    drafts = [Path(d) for d in args.draft.split(",")] if args.draft else [truncated_draft(target, args.draft_layers)]
    draft_what = ("\n  ".join(lineage(d) for d in drafts) if args.draft
                  else f"the target's first {args.draft_layers} blocks, untrained (a stand-in draft)")
    ks = [int(k) for k in str(args.draft_tokens).split(",")]
    prompts = chosen_prompts(args.prompts)
    engines = load_engines(target, drafts, bool(args.draft), ks, args)
    print(machine_line())
    print(f"target: {what}\ndraft: {draft_what}\nbatch 1, greedy, {args.new_tokens} new tokens, draft tokens per step "
          f"{', '.join(map(str, ks))}, {args.threads} thread(s) per pass")
    for label, prompt in prompts.items():
        time_prompt(engines, label, prompt, args)
    for e in engines.values():
        e.close()


if __name__ == "__main__":
    main()
