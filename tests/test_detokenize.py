"""Incremental detokenization: after every token the text equals the decode of all the ids so far,
for raw bytes, byte-level BPE and SentencePiece-style (Metaspace, byte fallback) tokenizers, with
multi-byte characters split across tokens and invalid bytes; and a request streams the same text
and stops at the same place as the whole-text decode would."""

from __future__ import annotations

import json
import random

import pytest
import torch

from prunus.models.tokenizer import ByteTokenizer, HFTokenizer
from prunus.serve.detokenize import IncrementalText
from prunus.serve.request import Request, SamplingParams

tokenizers = pytest.importorskip("tokenizers")

TEXT = ["Hello there, naïve café — 東京 🍣 déjà vu. ", "Say it again, line by line: ünïcödé ∑ x² ≤ 10 🎉", "  a  b\n\tc "]


def byte_level_bpe():
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=320, special_tokens=["<eos>"],
                                             initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(TEXT * 10, trainer)
    return tok


def sentencepiece_like():
    """Llama-2's layout: '▁' for spaces, unknown characters as <0xNN> byte tokens, a leading space stripped."""
    tok = tokenizers.Tokenizer(tokenizers.models.BPE(byte_fallback=True, unk_token="<unk>", fuse_unk=True))
    tok.normalizer = tokenizers.normalizers.Sequence([tokenizers.normalizers.Prepend("▁"),
                                                      tokenizers.normalizers.Replace(" ", "▁")])
    tok.decoder = tokenizers.decoders.Sequence([
        tokenizers.decoders.Replace("▁", " "), tokenizers.decoders.ByteFallback(), tokenizers.decoders.Fuse(),
        tokenizers.decoders.Strip(" ", 1, 0)])
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=150, special_tokens=["<unk>", "<eos>"],
                                             initial_alphabet=["▁", *"abcdefghijklmnopqrstuvwxyzHS,.:"])
    tok.train_from_iterator([t.encode("ascii", "ignore").decode() for t in TEXT] * 10, trainer)
    spec = json.loads(tok.to_str())  # the 256 byte tokens join the model's vocabulary, as in Llama's
    vocab = spec["model"]["vocab"]
    vocab.update({f"<0x{b:02X}>": len(vocab) + b for b in range(256)})
    return tokenizers.Tokenizer.from_str(json.dumps(spec))


@pytest.fixture(scope="module", params=["byte", "bpe", "sentencepiece"])
def tokenizer(request, tmp_path_factory):
    if request.param == "byte":
        return ByteTokenizer()
    d = tmp_path_factory.mktemp(request.param)
    (byte_level_bpe() if request.param == "bpe" else sentencepiece_like()).save(str(d / "tokenizer.json"))
    return HFTokenizer(d)


def id_streams(tok) -> list[list[int]]:
    """The texts' own ids, and random ids (which split characters and make invalid UTF-8)."""
    rng = random.Random(0)
    vocab = 256 if isinstance(tok, ByteTokenizer) else tok.n_vocab
    return [tok.encode(t) for t in TEXT] + [[rng.randrange(vocab) for _ in range(80)] for _ in range(4)]


def test_the_text_is_the_whole_decode_after_every_token(tokenizer):
    for ids in id_streams(tokenizer):
        inc = IncrementalText(tokenizer)
        for n, t in enumerate(ids, 1):
            inc.add(t)
            assert inc.text == tokenizer.decode(ids[:n]), (ids[:n], inc.text)
        assert len(inc.settled) >= len(inc.text) - 8  # the window stays short: settled text keeps up
    # a sentencepiece-like decode drops the first piece's leading space; the window keeps it mid-text
    assert tokenizer.decode(tokenizer.encode(" b c")) in ("b c", " b c")


def streamed(tok, ids: list[int], stop: tuple[str, ...]) -> tuple[str, str, str]:
    r = Request([1], SamplingParams(max_new_tokens=len(ids), stop=stop), tok)
    for t in ids:
        r.add_token(t)
        if r.done:
            break
    pieces = []
    while not r.events.empty():
        pieces.append(r.events.get().text)
    return "".join(pieces), r.result().text, r.finish_reason


def test_a_request_streams_and_stops_as_the_whole_decode_says(tokenizer):
    for ids in id_streams(tokenizer)[:3]:
        full = tokenizer.decode(ids)
        joined, text, reason = streamed(tokenizer, ids, ())
        assert joined == text == full and reason == "length"
        for stop in filter(None, (full[10:13], full[-2:], full[3:4], "not in the text")):
            cut = full.find(stop)
            joined, text, reason = streamed(tokenizer, ids, (stop, "zzz-never"))
            assert joined == text, stop
            if cut >= 0:
                # the earliest place any prefix of the ids decodes to the stop string ends the text there
                first = min(n for n in range(1, len(ids) + 1) if stop in tokenizer.decode(ids[:n]))
                upto = tokenizer.decode(ids[:first])
                assert reason == "stop" and text == upto[:upto.find(stop)], stop
            else:
                assert reason == "length" and text == full


def test_greedy_next_matches_torch_argmax():
    torch.manual_seed(0)
    from prunus.models.generate import greedy_next
    x = torch.randn(5, 1000)
    x[2, 7] = x[2, 9] = 100.0  # a tie: the first index, as torch.argmax
    assert torch.equal(greedy_next(x), x.argmax(-1))
    assert torch.equal(greedy_next(x[:, ::2]), x[:, ::2].argmax(-1))  # a strided view
    assert torch.equal(greedy_next(x.bfloat16()), x.bfloat16().argmax(-1))
