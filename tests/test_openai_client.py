"""The real ``openai`` Python client against prunus serve (a live uvicorn server on a free port, with an API key):
models.list, completions, chat (plain, streamed with usage, with logprobs and n), and its typed errors."""

from __future__ import annotations

import threading

import pytest
import torch

from prunus.models import HFTokenizer, Transformer, get_preset, save_model
from prunus.serve import Engine
from prunus.serve.http_access import ServeAccess
from prunus.serve.http_server import CompletionServer

openai = pytest.importorskip("openai")
pytest.importorskip("transformers")
from test_chat import CHAT_TEMPLATE, hf_tokenizer_dir  # noqa: E402

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 2?"}]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("client")
    torch.manual_seed(0)
    model = Transformer(get_preset("tiny").replace(max_seq_len=256))
    model.init_weights()
    path = save_model(model.eval(), root / "model", tokenizer=HFTokenizer(hf_tokenizer_dir(root / "tok", CHAT_TEMPLATE)),
                      stage="test")
    with Engine.load(path, max_batch=4, threads=1, backend="torch") as engine:  # embeddings: the torch backend's
        server = CompletionServer(engine, port=0, access=ServeAccess(api_key="k3y"), served_model_names=["tiny"])
        threading.Thread(target=server.serve_forever, daemon=True).start()
        yield engine, openai.OpenAI(base_url=server.url + "/v1", api_key="k3y", max_retries=0, timeout=60)
        server.shutdown()
        server.server_close()


def test_models_and_completions(served):
    engine, client = served
    assert [m.id for m in client.models.list()] == ["tiny"]
    answer = client.completions.create(model="tiny", prompt="Hello there", max_tokens=6, temperature=0)
    assert answer.choices[0].text == engine.generate("Hello there", 6).text
    assert answer.usage.completion_tokens == len(engine.generate("Hello there", 6).token_ids)


def test_chat_plain_streamed_and_logprobs(served):
    _, client = served
    plain = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=8, temperature=0)
    content = plain.choices[0].message.content
    stream = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=8, temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == content
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == plain.usage.completion_tokens
    with_logprobs = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=8, temperature=0,
                                                   logprobs=True, top_logprobs=2, n=2)
    assert [c.message.content for c in with_logprobs.choices] == [content, content]  # greedy: both samples agree
    entries = with_logprobs.choices[0].logprobs.content
    assert len(entries) == plain.usage.completion_tokens and all(len(e.top_logprobs) == 2 for e in entries)
    assert all(e.logprob == e.top_logprobs[0].logprob for e in entries)  # greedy took the likeliest


def test_typed_errors(served):
    _, client = served
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="gpt-4", prompt="x", max_tokens=1)
    assert e.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=MESSAGES, tools=[{"type": "function", "function":
                                                                                {"name": "f", "parameters": {}}}])
    assert e.value.param == "tools" and "does not take tools" in e.value.message  # a template without tools
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=client.base_url, api_key="wrong", max_retries=0).models.list()


def test_sampling_fields_through_the_client_equal_engine_generate(served):
    """Every sampling field OpenAI's client sends reaches the engine: the answer equals Engine.generate with the
    same settings (penalties, logit_bias, seed, top_p, stop), plain and streamed, and echo prepends the prompt."""
    from prunus.serve.logits_processors import LogitsSettings

    engine, client = served
    fields = dict(temperature=0.8, seed=5, top_p=0.9, presence_penalty=0.6, frequency_penalty=0.4,
                  logit_bias={"101": 3.0, "32": -4.0}, stop=["\n\n"])
    want = engine.generate("Hello there", 10, temperature=0.8, seed=5, top_p=0.9, stop=["\n\n"],
                           logits=LogitsSettings(presence_penalty=0.6, frequency_penalty=0.4,
                                                 logit_bias=((101, 3.0), (32, -4.0))))
    answer = client.completions.create(model="tiny", prompt="Hello there", max_tokens=10, **fields)
    assert answer.choices[0].text == want.text and answer.choices[0].finish_reason == want.finish_reason
    streamed = client.completions.create(model="tiny", prompt="Hello there", max_tokens=10, stream=True, **fields)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == want.text
    echoed = client.completions.create(model="tiny", prompt="Hello there", max_tokens=10, echo=True, **fields)
    assert echoed.choices[0].text == "Hello there" + want.text


def test_structured_output_and_embeddings_through_the_client(served):
    pytest.importorskip("xgrammar")
    import json

    engine, client = served
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    answer = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=40, temperature=1.0, seed=1,
                                            response_format={"type": "json_schema",
                                                             "json_schema": {"name": "flag", "schema": schema}})
    if answer.choices[0].finish_reason == "stop":  # a random model may run out of tokens inside the object
        assert isinstance(json.loads(answer.choices[0].message.content)["ok"], bool)
    else:
        assert answer.choices[0].message.content.startswith("{")
    vectors = client.embeddings.create(model="tiny", input=["Hello there", "What is 2 + 2?"])
    want = engine.embed(["Hello there", "What is 2 + 2?"])
    got = torch.tensor([v.embedding for v in vectors.data])
    assert torch.allclose(got, want, atol=1e-5) and vectors.usage.prompt_tokens > 0


def test_the_clients_default_fields_are_taken_and_what_they_cannot_get_is_a_typed_400(served):
    """What OpenAI's client sends for stored completions, tiers and caching is taken where it asks for nothing
    prunus cannot do; out of range or unsupported values come back as BadRequestError naming the field."""
    _, client = served
    answer = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=4, temperature=0, store=False,
                                            metadata={"team": "search"}, service_tier="auto", user="u-1",
                                            safety_identifier="h-1", prompt_cache_key="k", modalities=["text"])
    assert answer.choices[0].message.content == client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=4, temperature=0).choices[0].message.content
    for fields, param in (({"store": True}, "store"), ({"service_tier": "flex"}, "service_tier"),
                          ({"temperature": 3}, "temperature"), ({"logit_bias": {"²": 1}}, "logit_bias"),
                          ({"messages": [{"role": "wizard", "content": "x"}]}, "messages")):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(**{"model": "tiny", "messages": MESSAGES, "max_tokens": 1, **fields})
        assert e.value.param == param and "\n" not in e.value.message, (fields, e.value.message)
