"""Drafting with an EAGLE draft head (:mod:`prunus.models.eagle_draft`) over the serving target's own hidden states.

The target backend reports the final-norm output of every position it computes (prefill, chunks, plain decode
steps, ``verify``) to :meth:`EagleDrafter.take_hidden` (its ``hidden_sink``). Per row the drafter keeps its own
one-block KV cache of the positions it has read with the target's true states (``fed``) and the target states it
has not read yet (``pending``). A draft (:meth:`EagleDrafter.propose`) first reads the pending states with the
tokens that followed them in one pass (its output at the last one is the first draft token and the draft's guess of
the next state), then drafts on from its own guesses one token per pass. After the target's check,
:meth:`EagleDrafter.rollback` drops the cache entries built on guesses and the target states of rejected tokens.

The draft cache is indexed from the first position a row's states start at (rotary attention sees only relative
positions, so the index serves as the position). A gap in the reported states (a prompt prefix restored from the
prefix cache reports none) starts the row's draft cache afresh after it, and so do more than ``MAX_CATCH_UP`` unread
states (a long prompt, a row that decoded plainly for a while): the row keeps the last ``MAX_CATCH_UP`` of them
only, so that its next draft reads them in a pass that stays cheap beside the target's, and a row that decodes
plainly for a long while holds a few states, not all of them. The target's states carry the earlier context; the
draft only proposes, and the target checks every token. (SmolLM2-135M with a 4,096-token draft, drafts of 3
tokens resumed at 50 points of a prose and a code continuation: 0.72-0.76 and 0.74-0.84 tokens accepted per
draft whether it read the last 2, 4, 8, 16, 32 or 64 states: the window does not change what is accepted, and a
64-state pass cost about two int8 decode steps of the target.)
"""

from __future__ import annotations

from pathlib import Path

import torch

from prunus.models.eagle_draft import EagleDraft

from .batch_cache import BatchKVCache
from .drafter import LOOKUP, Drafter, split_draft
from .sampling import RowSampling, sampling_probs


MAX_CATCH_UP = 4  # unread target states a row keeps, the most the draft reads before drafting (see the docstring)


class TorchDraft:
    """The draft module's passes in torch over a batch KV cache of its own (its linear layers wherever the backend
    put them)."""

    def __init__(self, draft: EagleDraft, n_slots: int, max_len: int):
        cfg = draft.config
        self.draft, self.config, self.token_ids = draft, cfg, draft.token_ids
        self.cache = BatchKVCache([0], n_slots, cfg.n_kv_heads, cfg.head_dim, max_len)

    @torch.inference_mode()
    def __call__(self, row: int, start: int, hidden: torch.Tensor, embeds: torch.Tensor):
        """(features, logits) of the last of ``len(hidden)`` positions at ``start...`` of ``row``'s cache."""
        self.cache.lengths[row] = start
        step = self.cache.step([row], q_len=len(embeds))
        features, logits = self.draft(hidden[None], embeds[None], cache=step, positions=step.positions, last_only=True)
        return features[0, -1], logits[0, -1].float()

    def close(self) -> None:
        pass


class EagleDrafter(Drafter):
    name = "eagle"

    def __init__(self, runner, embed, n_slots: int):
        """``runner``: the draft's passes (:class:`TorchDraft`, or the backend's own: ``Backend.draft_runner``);
        ``embed``: token ids (n,) -> the target's input embeddings (n, dim), float32."""
        self.runner, self.embed = runner, embed
        self.length = [0] * n_slots  # entries in the row's draft cache
        self.base = [0] * n_slots  # the position of the row's draft cache entry 0
        self.fed = [0] * n_slots  # entries built from the target's own states
        self.pending: list[torch.Tensor | None] = [None] * n_slots  # states after them, not read yet

    def _expected(self, row: int) -> int:
        p = self.pending[row]
        return self.base[row] + self.fed[row] + (0 if p is None else len(p))

    def take_hidden(self, row: int, start: int, hidden: torch.Tensor) -> None:
        """The target computed positions ``start ...`` of ``row``: their final-norm outputs (n, dim)."""
        hidden = hidden.detach().float().cpu()
        p = self.pending[row]
        if start < self.base[row] + self.fed[row] or start > self._expected(row):  # a new prompt, or a gap
            self.base[row], self.fed[row], self.length[row], p = start, 0, 0, None
        keep = start - self.base[row] - self.fed[row]  # pending states before ``start`` stay
        p = hidden if p is None or keep == 0 else torch.cat([p[:keep], hidden])
        if len(p) > MAX_CATCH_UP:  # the last ones only, the draft's cache started afresh before them
            self.base[row], self.fed[row], self.length[row] = start + len(hidden) - MAX_CATCH_UP, 0, 0
        self.pending[row] = p[-MAX_CATCH_UP:].clone()

    def _pass(self, row: int, hidden: torch.Tensor, tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        embeds = self.embed(torch.tensor(tokens, dtype=torch.long)).float()
        out = self.runner(row, self.length[row], hidden, embeds)
        self.length[row] += len(tokens)
        return out

    def _choose(self, logits: torch.Tensor, sampling: RowSampling | None, vocab: int):
        """(a full-vocabulary token id, its draft distribution over the full vocabulary or None when greedy)."""
        ids = self.runner.token_ids
        if sampling is None:
            return int(ids[int(logits.argmax())]), None
        q_small = sampling_probs(logits[None], sampling)[0].cpu()
        i = int(torch.multinomial(q_small, 1, generator=sampling.generator))
        q = torch.zeros(vocab)
        q[ids] = q_small
        return int(ids[i]), q

    def offers(self, row: int, seq: list[int], k: int) -> list[tuple[str, int]]:
        """A draft of up to ``k`` tokens once the target's states of ``seq`` (but its last token) are all here."""
        ready = self.pending[row] is not None and self._expected(row) == len(seq) - 1
        return [(self.name, k)] if ready else []

    def propose(self, row: int, seq: list[int], k: int, sampling: RowSampling | None):
        """Up to ``k`` draft tokens after ``seq`` (whose last token the target has not computed yet) and, when
        sampling, their distributions (k, vocab); none when the target's states of ``seq`` are not all here."""
        n, pending = len(seq), self.pending[row]
        if pending is None or self._expected(row) != n - 1 or not k:
            return [], None
        first = self.base[row] + self.fed[row]
        feature, logits = self._pass(row, pending, seq[first + 1:n])
        self.fed[row] += len(pending)
        self.pending[row] = None
        drafts, qs = [], []
        vocab = self.runner.config.vocab_size
        for i in range(k):
            token, q = self._choose(logits, sampling, vocab)
            drafts.append(token)
            qs.append(q)
            if i < k - 1:
                feature, logits = self._pass(row, feature[None], [token])
        return drafts, (torch.stack(qs) if sampling is not None else None)

    def rollback(self, row: int, length: int) -> None:
        """The target keeps its first ``length`` tokens: drop the entries drafted on guesses, and the states of the
        tokens it rejected."""
        self.length[row] = self.fed[row]
        p = self.pending[row]
        if p is not None:
            keep = max(0, length - self.base[row] - self.fed[row])
            self.pending[row] = p[:keep] if keep else None

    def release(self, row: int) -> None:
        self.base[row], self.fed[row], self.length[row], self.pending[row] = 0, 0, 0, None

    def close(self) -> None:
        self.runner.close()


def _digest(path) -> str:
    import hashlib

    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def lineage_hashes(target) -> list[str]:
    """The content hashes of ``target`` and of the dirs it came from (its manifest's parent, that dir's parent while
    it is still where its child's manifest says and hashes as recorded), nearest first."""
    from pathlib import Path

    from prunus.models.model_dir_manifest import dir_hash, read_manifest

    manifest = read_manifest(target)
    hashes = [dir_hash(manifest["files"])]
    for _ in range(8):
        parent = manifest.get("parent") or {}
        if not isinstance(parent.get("hash"), str):
            break
        hashes.append(parent["hash"])
        path = Path(str(parent.get("path", "")))
        try:
            manifest = read_manifest(path)
        except Exception:
            break
        if dir_hash(manifest["files"]) != parent["hash"]:
            break
    return hashes


def check_eagle_draft(target, target_config: dict, draft) -> dict:
    """The EAGLE draft dir ``draft``'s config.json once it fits the target at ``target`` (a model dir or its export):
    the same tokenizer, hidden size and vocabulary, trained for this target or the model dir it came from; one
    PrunusError line otherwise. Reads config files and manifests only (no weights)."""
    from pathlib import Path

    from prunus.artifacts.errors import PrunusError
    from prunus.models.model_dir_manifest import read_config_json, read_manifest

    draft, target = Path(draft), Path(target)
    config = read_config_json(draft)
    read_manifest(draft)
    model, eagle = config.get("model") or {}, config.get("eagle") or {}
    tmodel = target_config.get("model") or {}
    if config.get("tokenizer") != target_config.get("tokenizer") or (
            (draft / "tokenizer.json").is_file() != (target / "tokenizer.json").is_file()) or (
            (draft / "tokenizer.json").is_file() and _digest(draft / "tokenizer.json") != _digest(target / "tokenizer.json")):
        raise PrunusError(f"--speculative {draft}: its tokenizer is not the target {target}'s; train a draft for this "
                          "target (prunus compress TARGET --distill eagle)")
    for key in ("dim", "vocab_size"):
        if model.get(key) != tmodel.get(key):
            raise PrunusError(f"--speculative {draft}: {key} {model.get(key)} is not the target {target}'s "
                              f"{tmodel.get(key)}; train a draft for this target (prunus compress TARGET --distill eagle)")
    if eagle.get("target_hash") not in lineage_hashes(target):
        raise PrunusError(f"--speculative {draft}: trained for another model (content hash "
                          f"{str(eagle.get('target_hash'))[:12]}), not {target} or the model dir it was made from; "
                          "train a draft for this target (prunus compress TARGET --distill eagle)")
    return config


def load_eagle_drafter(draft, backend) -> EagleDrafter:
    """The drafter over the loaded target ``backend`` (checked by :func:`check_eagle_draft` before it loaded); the
    backend reports its hidden states to it from now on, and runs the draft's passes (``draft_runner``: beside the
    native kernels, in them at int8, :mod:`prunus.runtime.eagle_native`)."""
    from prunus.artifacts.errors import PrunusError
    from prunus.models.eagle_draft import load_eagle_draft

    if not backend.capabilities.hidden_states:
        raise PrunusError(f"--speculative {draft}: an EAGLE draft reads the target's hidden states, which the "
                          f"{backend.name} backend does not report; serve a model dir (torch) or a genai export on "
                          "the native kernels")
    runner = backend.draft_runner(load_eagle_draft(draft)[0])  # beside the native kernels: in them, at int8
    drafter = EagleDrafter(runner, backend.embed_tokens, backend.n_slots)
    backend.report_hidden(drafter.take_hidden)
    return drafter


def is_eagle_dir(path: Path) -> bool:
    """Whether ``path`` holds an EAGLE draft (its config.json says so; anything unreadable: no)."""
    from prunus.artifacts.errors import PrunusError
    from prunus.models.eagle_draft import is_eagle_draft
    from prunus.models.model_dir_manifest import read_config_json

    try:
        return (path / "config.json").is_file() and is_eagle_draft(read_config_json(path))
    except PrunusError:
        return False


def check_draft(target_path, target_config: dict, draft) -> None:
    """Before the target loads: an EAGLE draft dir that does not fit the target is refused in one line."""
    folder = split_draft(draft)[0] if draft is not None else None
    if folder is not None and is_eagle_dir(Path(folder)):
        check_eagle_draft(Path(target_path), target_config, Path(folder))


AUTO = "auto"
MAX_SIBLINGS = 256  # entries of the target's folder looked at by draft="auto"


def find_draft(target) -> str:
    """``draft="auto"``: an EAGLE draft dir beside ``target`` (in the same folder) trained for it or for the model
    dir it came from (the most recently written one) with prompt lookup beside it ("DIR+ngram"), else "ngram"
    (prompt lookup alone, no model)."""
    import itertools

    from prunus.models.model_dir_manifest import read_config_json

    target = Path(target).resolve()
    hashes = set(lineage_hashes(target))
    found = []
    for entry in itertools.islice(sorted(target.parent.iterdir()), MAX_SIBLINGS):
        if entry == target or not entry.is_dir() or not is_eagle_dir(entry):
            continue
        if (read_config_json(entry).get("eagle") or {}).get("target_hash") in hashes:
            found.append((entry.stat().st_mtime, str(entry)))
    return f"{max(found)[1]}+{LOOKUP}" if found else LOOKUP
