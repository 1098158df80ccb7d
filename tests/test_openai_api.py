"""The OpenAI surface of prunus serve against a real uvicorn server on 127.0.0.1 (a free port): HTTP tokens equal
Engine.generate with the same settings (penalties, logit_bias, min_tokens, stop_token_ids, seeds, n), logprobs
equal the engine's, /v1/models and its aliases, unknown fields and models refused by name, OpenAI's error fields,
echo, streaming with include_usage, generation_config.json defaults, /docs."""

from __future__ import annotations

import http.client
import json
import threading

import pytest
import torch

from prunus.models import Transformer, get_preset, save_model
from prunus.serve import Engine
from prunus.serve.http_server import CompletionServer
from prunus.serve.logits_processors import LogitsSettings
from prunus.serve.sampling_defaults import sampling_defaults

PROMPT = "def f(x):"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    torch.manual_seed(0)
    model = Transformer(get_preset("tiny").replace(max_seq_len=128))
    model.init_weights()
    return save_model(model.eval(), tmp_path_factory.mktemp("openai") / "model", stage="test")


@pytest.fixture(scope="module")
def engine(model_dir):
    with Engine.load(model_dir, max_batch=4, threads=1, backend="torch") as engine:  # echo logprobs: torch's pass
        yield engine


def start(engine, **kwargs) -> CompletionServer:
    server = CompletionServer(engine, port=0, **kwargs)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


@pytest.fixture(scope="module")
def server(engine):
    server = start(engine, served_model_names=["tiny", "tiny-alias"])
    yield server
    server.shutdown()
    server.server_close()


OPENAI_ROUTES = ("/v1/completions", "/v1/chat/completions")


def call(server, method: str, path: str, body=None) -> tuple[int, dict | str]:
    """(status, JSON or text) of one request; a body POSTed to the completion routes names the served model
    (``model`` is required) unless it names one itself."""
    if path in OPENAI_ROUTES and isinstance(body, dict) and "model" not in body:
        body = {"model": server.model_name, **body}
    conn = http.client.HTTPConnection(*server.server_address[:2], timeout=60)
    conn.request(method, path, None if body is None else json.dumps(body),
                 {"Content-Type": "application/json"} if body is not None else {})
    resp = conn.getresponse()
    raw = resp.read().decode()
    conn.close()
    return resp.status, json.loads(raw) if resp.getheader("Content-Type", "").startswith("application/json") else raw


def events(server, path: str, body: dict) -> list:
    status, text = call(server, "POST", path, {**body, "stream": True})
    assert status == 200, text
    payloads = [line[6:] for line in text.split("\n\n") if line.startswith("data: ")]
    assert payloads[-1] == "[DONE]"
    return [json.loads(p) for p in payloads[:-1]]


def test_models_and_aliases(server):
    status, listed = call(server, "GET", "/v1/models")
    assert status == 200 and listed["object"] == "list" and [m["id"] for m in listed["data"]] == ["tiny", "tiny-alias"]
    assert all(m["object"] == "model" and m["owned_by"] == "prunus" for m in listed["data"])
    assert call(server, "GET", "/v1/models/tiny-alias")[1]["id"] == "tiny-alias"
    for method, path, body in (("GET", "/v1/models/gpt-4", None),
                               ("POST", "/v1/completions", {"prompt": "x", "model": "gpt-4", "max_tokens": 1}),
                               ("POST", "/v1/chat/completions", {"messages": [], "model": "gpt-4"})):
        status, answer = call(server, method, path, body)
        error = answer["error"]
        assert status == 404 and error["code"] == "model_not_found" and error["type"] == "invalid_request_error"
        assert "gpt-4" in error["message"] and "tiny, tiny-alias" in error["message"]
    status, answer = call(server, "POST", "/v1/completions", {"prompt": "x", "model": "tiny-alias", "max_tokens": 1})
    assert status == 200 and answer["model"] == "tiny-alias"


@pytest.mark.parametrize("path, body, field", [
    ("/v1/completions", {"prompt": "x", "bogus": 1}, "bogus"),
    ("/v1/completions", {"prompt": "x", "stream_options": {"include_usage": True, "extra": 1}, "stream": True},
     "stream_options.extra"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "guided_grammar": "x"},
     "guided_grammar"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                              "response_format": {"type": "json_object", "extra": 1}}, "response_format.extra"),
])
def test_unknown_fields_are_refused_by_name(server, path, body, field):
    status, answer = call(server, "POST", path, body)
    error = answer["error"]
    assert status == 400 and error["code"] == "unknown_field" and error["param"] == field.split(".")[0]
    assert f"unknown field '{field}'" in error["message"]


@pytest.mark.parametrize("body, param, code, words", [
    ({"prompt": "x", "max_tokens": 10_000}, "max_tokens", "context_length_exceeded", "exceeds the context of 128"),
    ({"prompt": "x" * 200, "max_tokens": 1}, "max_tokens", "context_length_exceeded", "prompt (200 tokens)"),
    ({"prompt": "x", "temperature": "hot"}, "temperature", None, "temperature='hot'"),
    ({"prompt": "x", "n": 0}, "n", None, "'n'"),
    ({"prompt": "x", "logit_bias": {"a": 1}}, "logit_bias", None, "not a token id"),
    ({"prompt": "x", "suffix": "y"}, "suffix", None, "'suffix'"),
    ({"prompt": "x", "best_of": 3}, "best_of", None, "'best_of'"),
    ({"prompt": "x", "presence_penalty": 2.5}, "presence_penalty", None, "presence_penalty=2.5"),
    ({"prompt": "x", "logprobs": 21}, "logprobs", None, "logprobs"),
    ({"prompt": "x", "logit_bias": {"99999999": 1}}, "logit_bias", None, "99999999"),
    ({"prompt": "x", "frequency_penalty": -2.5}, "frequency_penalty", None, "frequency_penalty=-2.5"),
])
def test_errors_carry_openai_fields(server, body, param, code, words):
    status, answer = call(server, "POST", "/v1/completions", body)
    error = answer["error"]
    assert status == 400 and error["type"] == "invalid_request_error" and error["param"] == param, answer
    assert error["code"] == code and words in error["message"] and "\n" not in error["message"], answer


SAMPLING = [  # the request's fields, and the same settings as Engine.generate keyword arguments
    ({"temperature": 0}, {"temperature": 0}),
    ({"temperature": 0.9, "seed": 7, "top_k": 20}, {"temperature": 0.9, "seed": 7, "top_k": 20}),
    ({"temperature": 0, "presence_penalty": 1.0, "frequency_penalty": 0.5, "repetition_penalty": 1.3,
      "logit_bias": {"101": 4.0, "32": -5.0}, "min_tokens": 6},
     {"temperature": 0, "logits": LogitsSettings(1.0, 0.5, 1.3, ((101, 4.0), (32, -5.0)), 6)}),
    ({"temperature": 0.7, "seed": 3, "top_p": 0.9, "frequency_penalty": 1.5, "stop": ["\n\n"],
      "stop_token_ids": [58]}, {"temperature": 0.7, "seed": 3, "top_p": 0.9, "stop": ["\n\n"],
                                "logits": LogitsSettings(frequency_penalty=1.5), "stop_token_ids": (58,)}),
]


@pytest.mark.parametrize("fields, kwargs", SAMPLING, ids=range(len(SAMPLING)))
def test_http_tokens_equal_engine_generate(server, engine, fields, kwargs):
    body = {"prompt": PROMPT, "max_tokens": 12, **fields}
    status, answer = call(server, "POST", "/v1/completions", body)
    want = engine.generate(PROMPT, 12, **kwargs)
    assert status == 200 and answer["choices"][0]["text"] == want.text
    assert answer["choices"][0]["finish_reason"] == want.finish_reason
    streamed = events(server, "/v1/completions", body)
    assert "".join(c["choices"][0]["text"] for c in streamed) == want.text


def test_n_samples_use_seed_plus_index(server, engine):
    body = {"prompt": [PROMPT, "import "], "max_tokens": 8, "temperature": 1.0, "seed": 11, "n": 3}
    status, answer = call(server, "POST", "/v1/completions", body)
    assert status == 200 and [c["index"] for c in answer["choices"]] == list(range(6))
    want = [engine.generate(p, 8, temperature=1.0, seed=11 + j).text for p in body["prompt"] for j in range(3)]
    assert [c["text"] for c in answer["choices"]] == want
    assert answer["usage"]["prompt_tokens"] == len(PROMPT) + len("import ")
    chunks = events(server, "/v1/completions", {**body, "stream_options": {"include_usage": True}})
    texts = [""] * 6
    for c in chunks[:-1]:
        texts[c["choices"][0]["index"]] += c["choices"][0]["text"]
    assert texts == want and chunks[-1]["choices"] == [] and chunks[-1]["usage"] == answer["usage"]


def test_logprobs_on_both_endpoints(server, engine):
    status, answer = call(server, "POST", "/v1/completions",
                          {"prompt": PROMPT, "max_tokens": 6, "temperature": 0, "logprobs": 3})
    lp = answer["choices"][0]["logprobs"]
    request = engine.submit(PROMPT, 6, logits=LogitsSettings(logprobs=3))
    made = _made(request)
    assert status == 200 and len(lp["tokens"]) == len(made) == answer["usage"]["completion_tokens"]
    assert lp["token_logprobs"] == [t.logprob.logprob for t in made]
    for alternatives, t in zip(lp["top_logprobs"], made):  # keyed by text: ids decoding alike share one key
        assert set(alternatives.values()) <= {v for _, v in t.logprob.top}
        assert max(alternatives.values()) == t.logprob.top[0][1] == t.logprob.logprob  # greedy took the best
    assert lp["text_offset"][0] == 0 and "".join(lp["tokens"]) == answer["choices"][0]["text"]
    chunks = events(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 6, "temperature": 0, "logprobs": 3})
    assert [x for c in chunks for x in (c["choices"][0]["logprobs"] or {}).get("token_logprobs", [])] == lp["token_logprobs"]


def _made(request):
    from prunus.serve.request import StreamToken

    out = []
    while True:
        event = request.events.get(timeout=60)
        if not isinstance(event, StreamToken):
            return out
        out.append(event)


def test_echo_prepends_the_prompt(server, engine):
    status, answer = call(server, "POST", "/v1/completions", {"prompt": PROMPT, "max_tokens": 5, "temperature": 0,
                                                               "echo": True})
    assert status == 200 and answer["choices"][0]["text"] == PROMPT + engine.generate(PROMPT, 5).text
    chunks = events(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 5, "temperature": 0, "echo": True})
    assert "".join(c["choices"][0]["text"] for c in chunks) == answer["choices"][0]["text"]


def test_echo_with_logprobs_gives_the_prompts_by_a_teacher_forced_pass(server, engine, model_dir):
    from prunus.models import load_model

    body = {"prompt": PROMPT, "max_tokens": 4, "temperature": 0, "echo": True, "logprobs": 2}
    status, answer = call(server, "POST", "/v1/completions", body)
    lp, ids = answer["choices"][0]["logprobs"], engine.encode(PROMPT)
    with torch.no_grad():
        want = torch.log_softmax(load_model(model_dir).eval()(torch.tensor([ids])).float(), -1)[0]
    assert status == 200 and lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert len(lp["tokens"]) == len(ids) + answer["usage"]["completion_tokens"]
    for i in range(1, len(ids)):
        assert abs(lp["token_logprobs"][i] - want[i - 1, ids[i]].item()) < 1e-4
        assert abs(max(lp["top_logprobs"][i].values()) - want[i - 1].max().item()) < 1e-4
    assert "".join(lp["tokens"]) == answer["choices"][0]["text"] and lp["text_offset"][len(ids)] == len(PROMPT)
    chunks = events(server, "/v1/completions", body)
    assert chunks[0]["choices"][0]["logprobs"]["token_logprobs"] == lp["token_logprobs"][:len(ids)]


def test_openapi_docs(server):
    status, schema = call(server, "GET", "/openapi.json")
    assert status == 200 and {"/v1/completions", "/v1/chat/completions", "/v1/models"} <= set(schema["paths"])
    assert "CompletionRequest" in json.dumps(schema)
    status, page = call(server, "GET", "/docs")
    assert status == 200 and "swagger" in page.lower()


def test_generation_config_defaults_apply_when_left_out(model_dir, engine, tmp_path):
    (model_dir / "generation_config.json").write_text(json.dumps({"temperature": 0.0, "top_k": 5, "do_sample": False}))
    try:
        assert sampling_defaults(model_dir) == {"temperature": 0.0, "top_k": 5}
        server = start(engine)
        try:
            status, answer = call(server, "POST", "/v1/completions", {"prompt": PROMPT, "max_tokens": 10})
            assert status == 200 and answer["choices"][0]["text"] == engine.generate(PROMPT, 10).text  # greedy
            sampled = {"prompt": PROMPT, "max_tokens": 10, "temperature": 1.0, "seed": 5}
            assert call(server, "POST", "/v1/completions", sampled)[1]["choices"][0]["text"] == \
                engine.generate(PROMPT, 10, temperature=1.0, seed=5, top_k=5).text
        finally:
            server.shutdown()
            server.server_close()
    finally:
        (model_dir / "generation_config.json").unlink()
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "generation_config.json").write_text(json.dumps({"temperature": "hot"}))
    from prunus.artifacts.errors import PrunusError

    with pytest.raises(PrunusError, match="generation_config.json: temperature 'hot' must be a float"):
        sampling_defaults(bad)


def test_serve_cli_takes_served_model_names(model_dir, monkeypatch):
    from click.testing import CliRunner

    from prunus.cli.main import cli

    seen = []

    def record(self, poll_interval=0.5):  # the server the command built, then Ctrl-C
        seen.append(self.model_names)
        raise KeyboardInterrupt
    monkeypatch.setattr(CompletionServer, "serve_forever", record)
    args = ["serve", str(model_dir), "--port", "0", "--max-batch", "1"]
    r = CliRunner().invoke(cli, [*args, "--served-model-name", "a,b", "--served-model-name", "c"])
    assert r.exit_code == 0, r.output
    assert CliRunner().invoke(cli, args).exit_code == 0
    assert seen == [["a", "b", "c"], [model_dir.name]]


def test_chat_streams_n_samples_with_logprobs(tmp_path):
    from test_chat import CHAT_TEMPLATE, hf_tokenizer_dir

    from prunus.models import HFTokenizer

    torch.manual_seed(0)
    model = Transformer(get_preset("tiny"))
    model.init_weights()
    path = save_model(model.eval(), tmp_path / "chat", stage="test",
                      tokenizer=HFTokenizer(hf_tokenizer_dir(tmp_path / "tok", CHAT_TEMPLATE)))
    with Engine.load(path, max_batch=2, threads=1) as engine:
        server = start(engine)
        try:
            body = {"messages": [{"role": "user", "content": "Hello there"}], "max_tokens": 5, "n": 2,
                    "temperature": 0.8, "seed": 1, "logprobs": True, "top_logprobs": 1}
            status, plain = call(server, "POST", "/v1/chat/completions", body)
            assert status == 200 and [c["index"] for c in plain["choices"]] == [0, 1]
            chunks = events(server, "/v1/chat/completions", body)
            for i, choice in enumerate(plain["choices"]):
                mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == i]
                assert mine[0]["delta"] == {"role": "assistant", "content": ""}
                assert "".join(c["delta"].get("content", "") for c in mine) == choice["message"]["content"]
                streamed = [e for c in mine if c["logprobs"] for e in c["logprobs"]["content"]]
                assert streamed == choice["logprobs"]["content"] and mine[-1]["finish_reason"] in ("stop", "length")
        finally:
            server.shutdown()
            server.server_close()
