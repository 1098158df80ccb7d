"""A token's text in log-probabilities is its own text, special tokens included: an end-of-turn token reads as
itself with its bytes (never ``""`` / ``[]``, which a client cannot tell from an empty piece of text)."""

from __future__ import annotations

from test_chat import CHAT_TEMPLATE, hf_tokenizer_dir

from prunus.models.tokenizer import ByteTokenizer, HFTokenizer
from prunus.serve.logits_processors import TokenLogprob
from prunus.serve.logprobs import chat_logprobs, completion_logprobs


def test_an_end_of_turn_token_carries_its_text_and_bytes(tmp_path):
    tok = HFTokenizer(hf_tokenizer_dir(tmp_path / "tok", CHAT_TEMPLATE))
    eos, word = tok.eos_id, tok.encode("Hello")[0]
    assert tok.decode([eos]) == ""  # the answer's text leaves it out
    chat = chat_logprobs(tok, [word, eos], [TokenLogprob(-0.5, ((word, -0.5), (eos, -1.0))), TokenLogprob(-0.1)])
    entry = chat["content"][1]
    assert entry["token"] == "</s>" and entry["bytes"] == list(b"</s>") and entry["logprob"] == -0.1
    assert chat["content"][0]["top_logprobs"][1]["token"] == "</s>"
    assert chat["content"][0]["token"] == tok.decode([word])
    plain = completion_logprobs(tok, [word, eos], [TokenLogprob(-0.5), TokenLogprob(-0.1)])
    assert plain["tokens"] == [tok.decode([word]), "</s>"]
    assert plain["text_offset"] == [0, len(tok.decode([word]))]


def test_the_byte_tokenizers_end_of_text_has_a_name():
    tok = ByteTokenizer()
    entry = chat_logprobs(tok, [104, 256], [TokenLogprob(-1.0), TokenLogprob(-2.0)])["content"]
    assert [e["token"] for e in entry] == ["h", "<|endoftext|>"]
    assert entry[1]["bytes"] == list(b"<|endoftext|>")
