"""``prunus compress TARGET --distill eagle[:vocab=N] --out DRAFT``: train an EAGLE draft head for a target model dir.

The draft (:class:`prunus.models.eagle_draft.EagleDraft`) is trained on the target's own outputs over a corpus
(self-distillation): windows of the corpus go through the target (no gradient), which gives its final-norm hidden
states ``h``; the draft reads ``(h_t, embed(x_{t+1}))`` and is trained towards the target's next position:

    loss = KL(target || draft) over the draft vocabulary + smooth_l1(draft feature, h_{t+1})

The target's distribution is its own logits over the draft head's rows (the same frozen rows the draft scores
with), so the draft learns what the target would say, not what the corpus says.

``passes=P`` (``--distill eagle:vocab=N,passes=P``): each batch of windows is trained on P times, its teacher pass
made once and kept (the target's forward pass, not the draft's step, is most of a step's time: SmolLM2-135M in fp32
on two cores, 2.3 s against 0.5 s for 4 windows of 256 tokens), so a run of S steps makes S / P teacher passes.
Step s trains on batch s mod ceil(S / P); the kept states are bounded by :data:`MAX_KEPT_BYTES`.

``nproc=R`` (``--distill eagle:...,nproc=R``, or every rank of a torchrun / Slurm job calling it): data parallel
over R processes (``prunus.compress.eagle_spawn`` starts them locally with the engine's launcher): each rank runs
the teacher and the draft on its share of every batch (``get_batch``'s rows for rank r of R, so the shares make up
the one-process batch) and the draft's gradients are averaged before each step, so the R ranks train the draft one
process would, to rounding (a test), with the teacher's passes, most of a step, split R ways. Rank 0 saves the
state and writes the draft dir.

Start: ``fc`` passes the token's embedding through (``[0 | I]``), the block is a copy of the target's first block,
the norm the target's final norm, and the head the target's output rows of the ``vocab`` tokens most frequent in the
training corpus (frozen). AdamW with a warmup of a twentieth of the steps and a cosine down to lr / 10.

Resumable: every ``save_every`` steps the draft, the optimizer's moments and the step are written to
``OUT.eagle-state/`` (safetensors and JSON, atomically); a run given the same target, corpus and settings continues
from there, and the dir is removed once the draft dir is written. The draft dir's manifest names the target (path
and content hash) as its parent; ``config.json`` records the hash again beside the training settings.
"""

from __future__ import annotations

import math
import shutil
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from prunus.artifacts.errors import PrunusError

DEFAULT_VOCAB = 16384
DEFAULTS = {"steps": 200, "batch_size": 4, "lr": 1e-3, "seq_len": 256}
MAX_VOCAB_SPEC = "eagle[:vocab=N][,passes=P][,nproc=R]"
MAX_KEPT_BYTES = 8 << 30  # the teacher states a run with passes > 1 keeps in memory


def parse_eagle(spec: str) -> dict:
    """``eagle`` with any of ``vocab=N``, ``passes=P``, ``nproc=R`` after a colon, joined by commas -> {"vocab": N
    or None, "passes": P or None, "nproc": R or None}; one PrunusError line otherwise."""
    name, _, rest = spec.partition(":")
    if name != "eagle":
        raise PrunusError(f"--distill {spec}: not an EAGLE draft; write {MAX_VOCAB_SPEC}")
    parsed = {"vocab": None, "passes": None, "nproc": None}
    for item in rest.split(",") if rest else []:
        key, _, value = item.partition("=")
        if key not in parsed or parsed[key] is not None or not value.isdigit() or int(value) < 1:
            raise PrunusError(f"--distill {spec}: write {MAX_VOCAB_SPEC} with N, P and R positive whole numbers, each "
                              "at most once (e.g. eagle:vocab=16384 or eagle:vocab=4096,passes=3,nproc=2)")
        parsed[key] = int(value)
    return parsed


def frequency_ranked(tokens: np.ndarray, vocab_size: int, n: int) -> torch.Tensor:
    """The ``n`` ids most frequent in ``tokens`` (ties and unseen ids by id), most frequent first."""
    counts = np.bincount(np.asarray(tokens, dtype=np.int64), minlength=vocab_size)[:vocab_size]
    order = np.lexsort((np.arange(vocab_size), -counts))
    return torch.from_numpy(order[:n].astype(np.int64))


@torch.no_grad()
def new_draft(target, token_ids: torch.Tensor):
    """A draft to start training from (see the module docstring)."""
    from prunus.models.eagle_draft import EagleDraft

    draft = EagleDraft(target.config, len(token_ids))
    dim = target.config.dim
    draft.fc.weight.zero_()
    draft.fc.weight[:, dim:] = torch.eye(dim)
    draft.block.load_state_dict(target.layers[next(iter(target.layers.keys()))].state_dict())
    draft.norm.load_state_dict(target.norm.state_dict())
    draft.head.weight.copy_(target.output.weight[token_ids])
    draft.head.weight.requires_grad_(False)
    draft.token_ids.copy_(token_ids)
    return draft


def eagle_loss(draft, h: torch.Tensor, embeds: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """The training loss over windows: ``h`` (batch, seq, dim) the target's final-norm states, ``embeds`` its
    input embeddings of the same tokens. Position t reads (h_t, embeds_{t+1}) and is scored against h_{t+1}."""
    features, logits = draft(h[:, :-1], embeds[:, 1:])
    with torch.no_grad():
        teacher = draft.head(h[:, 1:]).float()
    log_q = F.log_softmax(logits.float(), dim=-1)
    p = F.softmax(teacher, dim=-1)
    kl = (p * (F.log_softmax(teacher, dim=-1) - log_q)).sum(-1).mean()
    reg = F.smooth_l1_loss(features, h[:, 1:])
    agree = (logits.argmax(-1) == teacher.argmax(-1)).float().mean()
    return kl + reg, {"kl": float(kl.detach()), "reg": float(reg.detach()), "agree": float(agree)}


def lr_at(step: int, steps: int, lr: float) -> float:
    warm = max(1, steps // 20)
    if step < warm:
        return lr * (step + 1) / warm
    t = (step - warm) / max(1, steps - warm)
    return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))


def trainable(draft) -> list[torch.nn.Parameter]:
    return [p for p in draft.parameters() if p.requires_grad]


def save_state(state_dir: Path, draft, opt, step: int, meta: dict) -> None:
    """The run so far, atomically: the draft's weights, AdamW's moments per parameter, the step and settings."""
    from safetensors.torch import save_file

    from prunus.artifacts.atomic import atomic_write_json

    tensors = {f"draft.{k}": v.detach().contiguous() for k, v in draft.state_dict().items()}
    for i, p in enumerate(trainable(draft)):
        s = opt.state.get(p, {})
        if s:
            tensors[f"adam.{i}.exp_avg"] = s["exp_avg"].contiguous()
            tensors[f"adam.{i}.exp_avg_sq"] = s["exp_avg_sq"].contiguous()
            tensors[f"adam.{i}.step"] = torch.as_tensor(s["step"], dtype=torch.float32).reshape(1)
    state_dir.mkdir(parents=True, exist_ok=True)
    tmp = state_dir / "state.safetensors.tmp"
    save_file(tensors, tmp)
    tmp.replace(state_dir / "state.safetensors")
    atomic_write_json(state_dir / "state.json", {**meta, "step": step})


def load_state(state_dir: Path, draft, opt, meta: dict) -> int:
    """The step a saved run reached (0: none saved), its weights and moments loaded into ``draft`` and ``opt``; a
    saved run of other settings is refused in one line rather than continued or overwritten."""
    from safetensors.torch import load_file

    from prunus.artifacts.validate import read_json_object

    if not (state_dir / "state.json").is_file():
        return 0
    saved = read_json_object(state_dir / "state.json", fix=f"remove {state_dir} to start afresh")
    if {k: saved.get(k) for k in meta} != meta:
        raise PrunusError(f"{state_dir}: holds a draft training run of other settings or another target; remove it to "
                          "start afresh, or give the settings it was started with")
    tensors = load_file(state_dir / "state.safetensors")
    draft.load_state_dict({k[len("draft."):]: v for k, v in tensors.items() if k.startswith("draft.")})
    for i, p in enumerate(trainable(draft)):
        if f"adam.{i}.exp_avg" in tensors:
            opt.state[p] = {"exp_avg": tensors[f"adam.{i}.exp_avg"], "exp_avg_sq": tensors[f"adam.{i}.exp_avg_sq"],
                            "step": tensors[f"adam.{i}.step"].reshape(())}
    return int(saved["step"])


@torch.no_grad()
def agreement(target, draft, tokens: np.ndarray, seq_len: int, windows: int = 4) -> float:
    """On held-out windows: how often the draft's first token equals the target's greedy token (full vocabulary),
    the acceptance rate of the first drafted token under greedy decoding."""
    from prunus.data.evaluate import final_hidden
    from prunus.models.eagle_draft import target_embeds

    n = min(windows, max(1, (len(tokens) - 1) // seq_len))
    x = torch.from_numpy(np.asarray(tokens[:n * seq_len], dtype=np.int64).reshape(n, seq_len))
    h = final_hidden(target, x)
    _, logits = draft(h[:, :-1], target_embeds(target, x[:, 1:]))
    drafted = draft.token_ids[logits.argmax(-1)]
    wanted = target.output(h[:, 1:]).argmax(-1)
    return float((drafted == wanted).float().mean())


def batches(settings: dict) -> int:
    """How many distinct batches of windows a run trains on: its steps over its passes, rounded up."""
    return -(-settings["steps"] // settings["passes"])


def check_kept(settings: dict, dim: int) -> None:
    """A run with passes > 1 keeps every batch's teacher states: refused in one line when they would not fit."""
    kept = batches(settings) * settings["batch_size"] * settings["seq_len"] * dim * 4 * 2
    if settings["passes"] > 1 and kept > MAX_KEPT_BYTES:
        raise PrunusError(f"eagle: passes={settings['passes']} would keep {kept / 2**30:.1f} GiB of teacher states "
                          f"(limit {MAX_KEPT_BYTES >> 30} GiB); raise passes or lower --distill-steps / batch size")


def run_steps(target, draft, opt, tokens: np.ndarray, settings: dict, first: int, state_dir: Path, meta: dict,
              log) -> dict:
    """Steps ``first`` .. ``settings["steps"]`` of the run; the last step's figures. In a process group of R ranks
    each rank takes its share of every batch (the rows :func:`prunus.data.batches.get_batch` gives rank r of R, so
    the R shares are the one-process batch), and the draft's gradients are averaged before each step: every rank
    keeps the same draft, the one a single process would train (a test)."""
    from prunus.data.batches import get_batch
    from prunus.data.evaluate import final_hidden
    from prunus.models.eagle_draft import target_embeds

    rank, world = group()
    steps, save_every, n_batches = settings["steps"], settings["save_every"], batches(settings)
    figures, start, kept = {}, time.perf_counter(), {}
    for step in range(first, steps):
        b = step % n_batches
        if b not in kept:
            x, _ = get_batch(tokens, seed=settings["seed"], step=b, micro_batch=settings["batch_size"] // world,
                             seq_len=settings["seq_len"], rank=rank, world=world)
            with torch.no_grad():
                kept[b] = final_hidden(target, x), target_embeds(target, x)
        h, embeds = kept[b] if settings["passes"] > 1 else kept.pop(b)
        for group_ in opt.param_groups:
            group_["lr"] = lr_at(step, steps, settings["lr"])
        loss, figures = eagle_loss(draft, h, embeds)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        figures = averaged(draft, figures, world)
        torch.nn.utils.clip_grad_norm_(trainable(draft), 1.0)
        opt.step()
        done = step + 1
        if done % save_every == 0 or done == steps:
            if rank == 0:
                save_state(state_dir, draft, opt, done, meta)
            barrier(world)
        if log is not None and rank == 0 and (done % max(1, steps // 20) == 0 or done == steps):
            rate = (done - first) * settings["batch_size"] * settings["seq_len"] / (time.perf_counter() - start)
            log(f"step {done}/{steps}: kl {figures['kl']:.3f}, feature loss {figures['reg']:.4f}, "
                f"top-1 agreement {figures['agree']:.3f}, {rate:.0f} tokens/s")
    return figures


def group() -> tuple[int, int]:
    """(rank, ranks) of the process group this run is in; (0, 1) alone."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def barrier(world: int) -> None:
    if world > 1:
        import torch.distributed as dist

        dist.barrier()


def averaged(draft, figures: dict, world: int) -> dict:
    """Every rank's gradients of the draft averaged in place (each rank's loss is its share's mean, the shares of
    equal size); the step's figures averaged the same way."""
    if world == 1:
        return figures
    import torch.distributed as dist

    grads = [p.grad for p in trainable(draft)]
    flat = torch.cat([g.reshape(-1) for g in grads] + [torch.tensor([figures[k] for k in ("kl", "reg", "agree")])])
    dist.all_reduce(flat)
    flat /= world
    at = 0
    for g in grads:
        g.copy_(flat[at:at + g.numel()].view_as(g))
        at += g.numel()
    return dict(zip(("kl", "reg", "agree"), flat[at:].tolist()))


def train_eagle(target_dir, out, *, vocab: int | None = None, passes: int | None = None, nproc: int | None = None,
                data=None, steps: int | None = None, batch_size: int | None = None, lr: float | None = None,
                seq_len: int | None = None, seed: int = 0, max_corpus_bytes: int | None = 16 << 20,
                overwrite: bool = False, save_every: int = 25, log=print, command: str | None = None) -> dict:
    """Train an EAGLE draft for the model dir ``target_dir`` and write it to ``out`` (see the module docstring);
    returns the draft's figures (held-out first-token agreement, seconds). ``nproc`` > 1 outside a process group:
    the run goes to that many local processes (torchrun), each its share of every batch; in a group (torchrun,
    Slurm) every rank calls it."""
    from prunus.train_parallel.launch.launch import env_ranks, init_distributed

    target_dir, out = Path(target_dir), Path(out)
    if out.resolve() == target_dir.resolve():
        raise PrunusError(f"--out {out}: is the target model dir; the draft never overwrites its input")
    if out.exists() and not overwrite:
        raise PrunusError(f"{out}: already exists; choose another output path or pass --overwrite")
    ranks = env_ranks()[1]
    if (batch_size or DEFAULTS["batch_size"]) % max(nproc or 1, ranks):
        raise PrunusError(f"eagle: batch size {batch_size or DEFAULTS['batch_size']} is not divisible by the "
                          f"{max(nproc or 1, ranks)} processes; give --distill-batch-size a multiple of them")
    if (nproc or 1) > 1 and ranks == 1:
        keywords = dict(vocab=vocab, passes=passes, nproc=nproc, data=None if data is None else str(data), steps=steps,
                        batch_size=batch_size, lr=lr, seq_len=seq_len, seed=seed, max_corpus_bytes=max_corpus_bytes,
                        overwrite=overwrite, save_every=save_every, command=command)
        return spawn(str(target_dir), str(out), keywords, nproc, progress=log is not None)
    if ranks > 1 and nproc not in (None, ranks):
        raise PrunusError(f"eagle: nproc={nproc} inside a group of {ranks} processes; drop nproc or launch {nproc}")
    init_distributed()
    return _train(target_dir, out, vocab, passes, data, steps, batch_size, lr, seq_len, seed, max_corpus_bytes,
                  overwrite, save_every, log, command)


def spawn(target_dir: str, out: str, keywords: dict, nproc: int, progress: bool = True) -> dict:
    """The figures of a run of ``train_eagle(target_dir, out, **keywords)`` on ``nproc`` local processes (rank 0
    printing its progress when ``progress``)."""
    import json
    import tempfile

    from prunus.train_parallel.launch.launch import run_module_ranks

    with tempfile.TemporaryDirectory(prefix="prunus-eagle-") as work:
        spec, result = Path(work) / "spec.json", Path(work) / "result.json"
        spec.write_text(json.dumps({"target": target_dir, "out": out, "keywords": keywords, "result": str(result),
                                    "progress": progress}))
        rc = run_module_ranks(nproc, "prunus.compress.eagle_spawn", [str(spec)])
        if rc != 0 or not result.is_file():
            raise PrunusError(f"eagle: the {nproc}-process run failed (exit code {rc}); its output above says why")
        return json.loads(result.read_text())


def _train(target_dir: Path, out: Path, vocab, passes, data, steps, batch_size, lr, seq_len, seed, max_corpus_bytes,
           overwrite, save_every, log, command) -> dict:
    from prunus.data.corpus import load_corpus
    from prunus.models import load_model, load_model_tokenizer
    from prunus.models.eagle_draft import save_eagle_draft
    from prunus.models.model_dir import parent_entry

    t0 = time.perf_counter()
    target = load_model(target_dir).eval()
    for p in target.parameters():
        p.requires_grad_(False)
    tokenizer = load_model_tokenizer(target_dir)
    corpus = load_corpus(data, tokenizer, max_bytes=max_corpus_bytes, vocab_size=target.config.vocab_size)
    settings = {**DEFAULTS, **{k: v for k, v in (("steps", steps), ("batch_size", batch_size), ("lr", lr),
                                                  ("seq_len", seq_len)) if v is not None}}
    settings["seq_len"] = min(settings["seq_len"], target.config.max_seq_len, len(corpus.train) - 1)
    for key in ("steps", "batch_size", "seq_len"):
        if isinstance(settings[key], bool) or not isinstance(settings[key], int) or settings[key] < 1:
            raise PrunusError(f"eagle: {key}={settings[key]!r} must be a positive whole number (--distill-{key.replace('_', '-')})")
    settings.update(seed=seed, save_every=save_every, passes=passes or 1)
    rank, world = group()
    check_kept({**settings, "batch_size": settings["batch_size"] // world}, target.config.dim)
    n_vocab = min(vocab or DEFAULT_VOCAB, target.config.vocab_size)
    token_ids = frequency_ranked(corpus.train, target.config.vocab_size, n_vocab)
    torch.manual_seed(seed)
    draft = new_draft(target, token_ids)
    opt = torch.optim.AdamW(trainable(draft), lr=settings["lr"], betas=(0.9, 0.95), weight_decay=0.0)
    meta = {"target_hash": parent_entry(target_dir)["hash"], "corpus": corpus.name, "vocab": n_vocab,
            **{k: settings[k] for k in ("steps", "batch_size", "lr", "seq_len", "seed", "passes")}}
    state_dir = out.with_name(out.name + ".eagle-state")
    first = load_state(state_dir, draft, opt, meta)
    if log is not None and first:
        log(f"resuming from step {first} ({state_dir})")
    figures = run_steps(target, draft, opt, corpus.train, settings, first, state_dir, meta, log)
    record = {"corpus": corpus.name, "steps": settings["steps"], "batch_size": settings["batch_size"],
              "seq_len": settings["seq_len"], "lr": settings["lr"], "seed": seed, "passes": settings["passes"],
              "train_tokens": batches(settings) * settings["batch_size"] * settings["seq_len"], "processes": world}
    metrics = {"train_kl": round(figures.get("kl", 0.0), 4)}
    if rank == 0:
        metrics["heldout_first_token_agreement"] = round(agreement(target, draft.eval(), corpus.val,
                                                                   settings["seq_len"]), 4)
        metrics["seconds"] = round(time.perf_counter() - t0, 1)
        save_eagle_draft(draft, out, target=target_dir, tokenizer=tokenizer, record=record, metrics=metrics,
                         overwrite=overwrite, command=command)
        shutil.rmtree(state_dir, ignore_errors=True)
    barrier(world)
    return {"out": str(out), "vocab": n_vocab, **record, **metrics}
