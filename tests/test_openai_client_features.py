"""The serving features driven through OpenAI's own Python client, against the same engine's plain answers:
prefix caching (a shared system prompt reused, the answers unchanged), speculative decoding (prompt-lookup drafts,
greedy text equal to plain decoding), tools (a forced call parsed back into ``tool_calls``), and LoRA adapters
picked by ``model`` (listed, and equal to the engine's own rows with that adapter)."""

from __future__ import annotations

import json
import threading

import pytest
import torch

from prunus.models import HFTokenizer, Transformer, get_preset, save_model
from prunus.serve import Engine
from prunus.serve.http_access import ServeAccess
from prunus.serve.http_server import CompletionServer

openai = pytest.importorskip("openai")
pytest.importorskip("transformers")
from test_chat import hf_tokenizer_dir  # noqa: E402
from test_serve_lora import write_adapter  # noqa: E402
from test_tool_calls import QWEN_TOOLS, TOOLS  # noqa: E402

SYSTEM = "You answer questions about the weather in a few words, politely, and never make anything up. " * 3
QUESTIONS = ("Weather in Paris?", "Weather in Rome?", "Weather in Oslo?")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("features")
    torch.manual_seed(0)
    model = Transformer(get_preset("tiny").replace(max_seq_len=1536))
    model.init_weights()
    tok = HFTokenizer(hf_tokenizer_dir(root / "tok", QWEN_TOOLS))
    path = save_model(model.eval(), root / "model", tokenizer=tok, stage="test")
    write_adapter(model, root / "ad", 4, 8.0, ("attention.wq", "attention.wv", "feed_forward.w2"), 1)
    return path, root / "ad"


def _client(engine):
    server = CompletionServer(engine, port=0, access=ServeAccess(api_key="k"), served_model_names=["tiny"])
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, openai.OpenAI(base_url=server.url + "/v1", api_key="k", max_retries=0, timeout=60)


def _chat(client, model: str, question: str, **kw) -> str:
    answer = client.chat.completions.create(model=model, max_tokens=12, temperature=0.0, **kw, messages=[
        {"role": "system", "content": SYSTEM}, {"role": "user", "content": question}])
    return answer.choices[0].message.content


def test_prefix_cache_lora_and_tools_through_the_client(model_dir):
    path, adapter = model_dir
    with Engine.load(path, max_batch=4, threads=1) as plain:
        want = {q: plain.generate(plain.chat_prompt([{"role": "system", "content": SYSTEM},
                                                     {"role": "user", "content": q}]), max_new_tokens=12).text
                for q in QUESTIONS}
    with Engine.load(path, max_batch=4, threads=1, prefix_cache_mb=4, lora={"ad": adapter}) as engine:
        server, client = _client(engine)
        try:
            assert {"tiny", "ad"} <= {m.id for m in client.models.list().data}
            assert {q: _chat(client, "tiny", q) for q in QUESTIONS} == want  # the cache changes no answer
            stats = engine.info["prefix_cache"]
            assert stats["hits"] >= 2 and stats["reused_tokens"] >= 2 * 16  # later questions reuse the system prompt
            prompt = engine.chat_prompt([{"role": "system", "content": SYSTEM}, {"role": "user", "content": "x"}])
            assert _chat(client, "ad", "x") == engine.generate(prompt, max_new_tokens=12, adapter="ad").text
            call = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Paris?"}],
                                                  tools=TOOLS, tool_choice="required", max_tokens=200,
                                                  temperature=1.0, seed=1)
            calls = call.choices[0].message.tool_calls
            assert call.choices[0].finish_reason == "tool_calls" and calls
            assert calls[0].function.name in {t["function"]["name"] for t in TOOLS}
            assert isinstance(json.loads(calls[0].function.arguments), dict)
        finally:
            server.shutdown()
            server.server_close()


def test_speculative_decoding_through_the_client_equals_plain(model_dir):
    path, _ = model_dir
    text = "def f(x):\n    return x + 1\n\ndef g(x):\n    return x + 1\n\ndef h(x):\n"
    with Engine.load(path, max_batch=2, threads=1) as plain:
        want = plain.generate(text, max_new_tokens=24).text
    with Engine.load(path, max_batch=2, threads=1, draft="ngram", draft_tokens=4) as engine:
        server, client = _client(engine)
        try:
            got = client.completions.create(model="tiny", prompt=text, max_tokens=24, temperature=0.0)
            streamed = "".join(c.choices[0].text for c in client.completions.create(
                model="tiny", prompt=text, max_tokens=24, temperature=0.0, stream=True))
            assert got.choices[0].text == streamed == want
            assert engine.info["speculative"]["drafted"] > 0  # drafts were made and checked, not skipped
        finally:
            server.shutdown()
            server.server_close()
