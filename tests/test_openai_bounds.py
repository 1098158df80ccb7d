"""Bounds of the OpenAI surface on a tiny random model served on 127.0.0.1: every number outside OpenAI's
documented range (and prunus's extensions outside vLLM's) is one 400 naming the field; ``logit_bias`` keys are
read by one strict rule; ``model`` is required; roles are OpenAI's; tool-call arguments in the history and
tool calls in an answer are parsed within depth and size bounds; the fields OpenAI's clients send by default are
taken where they ask for nothing prunus cannot do. A seeded, time-bounded fuzz posts random and hostile bodies to
both endpoints: never a 5xx, and every 4xx is one line of JSON in OpenAI's error shape."""

from __future__ import annotations

import http.client
import json
import random
import time

import pytest
import torch

pytest.importorskip("transformers")

from prunus.models import HFTokenizer, Transformer, get_preset, save_model  # noqa: E402
from prunus.serve import Engine  # noqa: E402
from prunus.serve.bounded_json import MAX_DEPTH, TooDeep, json_depth, loads_bounded  # noqa: E402
from prunus.serve.chat_api import _choice  # noqa: E402
from prunus.serve.http_guard import BadRequest  # noqa: E402
from prunus.serve.integer_keys import integer_key, token_id  # noqa: E402
from prunus.serve.openai_generate import Choice  # noqa: E402
from prunus.serve.tool_calls import parse_tool_calls  # noqa: E402

from test_chat import CHAT_TEMPLATE, hf_tokenizer_dir  # noqa: E402
from test_openai_api import call, start  # noqa: E402

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
USER = [{"role": "user", "content": "Hello there"}]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bounds")
    torch.manual_seed(0)
    model = Transformer(get_preset("tiny").replace(max_seq_len=128))
    model.init_weights()
    tok = HFTokenizer(hf_tokenizer_dir(tmp / "tok", CHAT_TEMPLATE))
    with Engine.load(save_model(model.eval(), tmp / "model", stage="test", tokenizer=tok), max_batch=4,
                     threads=1) as engine:
        server = start(engine)
        yield engine, server
        server.shutdown()
        server.server_close()


def body_for(path: str, **fields) -> dict:
    base = {"messages": USER} if path == CHAT else {"prompt": "def f(x):"}
    return {**base, "max_tokens": 2, **fields}


def refused(server, path: str, body: dict, param: str, *words: str) -> dict:
    status, answer = call(server, "POST", path, body)
    error = answer["error"] if isinstance(answer, dict) else {}
    assert status == 400 and error.get("param") == param, (body, status, answer)
    assert error["type"] == "invalid_request_error" and "\n" not in error["message"], answer
    assert all(w in error["message"] for w in words), (words, answer)
    return error


# --- bounded JSON ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("text, depth", [("1", 0), ("[]", 1), ('{"a": [1, {"b": 2}]}', 3),
                                         ('["[[[", "}}"]', 1), ('["\\\\", ["\\"[["]]', 2), ("[" * 1200, 1200)])
def test_json_depth_counts_brackets_outside_strings(text, depth):
    assert json_depth(text) == depth


def test_json_depth_stops_once_past_the_bound():
    assert json_depth("[" * 100_000, stop_above=MAX_DEPTH) == MAX_DEPTH + 1


TOO_DEEP = "[" * (MAX_DEPTH + 1) + "]" * (MAX_DEPTH + 1)
NOT_TAKEN = [("[" * 100_000, TooDeep), (TOO_DEEP, TooDeep), ('"' + "x" * (1 << 20) + '"', TooDeep),
             ("NaN", ValueError), ("[1e400]", ValueError), ('"\\ud800"', ValueError), ("1" * 5000, ValueError),
             ("{", ValueError)]


@pytest.mark.parametrize("text, kind", NOT_TAKEN, ids=range(len(NOT_TAKEN)))
def test_loads_bounded_refuses_with_a_value_error(text, kind):
    with pytest.raises(kind):
        loads_bounded(text)


def test_loads_bounded_takes_json_within_the_bounds():
    deep = "[" * MAX_DEPTH + "]" * MAX_DEPTH
    assert loads_bounded(deep) == json.loads(deep)
    assert loads_bounded('{"city": "Pa]ris\\"", "days": [2, 3.5]}') == {"city": 'Pa]ris"', "days": [2, 3.5]}


# --- tool calls: history and answers ----------------------------------------------------------------------------

@pytest.mark.parametrize("answer", ["<tool_call>" + "[" * 1200, "<tool_call>" + "[" * 40 + "]" * 40 + "</tool_call>",
                                    '<tool_call>{"name": "f", "arguments": ' + "[" * 40 + "]" * 40 + "}</tool_call>",
                                    '<tool_call>{"name": "f", "arguments": {"x": "\\ud800"}}</tool_call>',
                                    '<tool_call>{"name": "f", "arguments": {"x": 1e400}}</tool_call>'])
def test_an_answer_whose_call_does_not_parse_comes_back_as_text(answer):
    assert parse_tool_calls(answer) is None
    out = _choice(None, Choice(0, 1, text=answer, finish_reason="stop"), with_logprobs=False, parse=True)
    assert out["message"] == {"role": "assistant", "content": answer} and out["finish_reason"] == "stop"
    assert json.dumps(out, ensure_ascii=False).encode()  # the answer can be sent


def test_calls_within_the_bounds_still_parse():
    deep = "[" * (MAX_DEPTH - 2) + "]" * (MAX_DEPTH - 2)
    content, calls = parse_tool_calls(f'<tool_call>{{"name": "f", "arguments": {{"a": {deep}}}}}</tool_call>')
    assert content is None and json.loads(calls[0]["function"]["arguments"]) == {"a": json.loads(deep)}


@pytest.mark.parametrize("arguments, words", [("[" * 100_000, "nested deeper than 32"),
                                              ("[" * 33 + "]" * 33, "nested deeper than 32"),
                                              ("{" * 50 + '"a": 1', "nested deeper than 32"),
                                              ('{"x": "\\udc00"}', "lone surrogate"), ("NaN", "NaN"),
                                              ("{not json", "Expecting")])
def test_deep_or_hostile_history_arguments_are_400(served, arguments, words):
    _, server = served
    call_turn = {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": arguments}}]}
    refused(server, CHAT, body_for(CHAT, messages=USER + [call_turn, *USER]), "messages", "messages[1].tool_calls",
            words)


# --- integer keys ------------------------------------------------------------------------------------------------

HOSTILE_KEYS = ["²", "٣", "３", "1" * 5000, " 3", "3 ", "+3", "3_0", "007", "-1", "", "3.0", "1e3", "0x1f",
                "\u0663\u0660", "99999999999", "320"]


@pytest.mark.parametrize("key", HOSTILE_KEYS, ids=range(len(HOSTILE_KEYS)))
def test_token_id_keys_follow_one_strict_rule(key):
    with pytest.raises(BadRequest) as e:
        token_id(key, "logit_bias", 320)
    assert e.value.param == "logit_bias" and "'logit_bias' key" in str(e.value) and len(str(e.value)) < 200
    assert [token_id(k, "logit_bias", 320) for k in ("0", "7", "319")] == [0, 7, 319]
    assert integer_key("-12", "f", -20, 20) == -12  # a sign only where the range has negatives


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
@pytest.mark.parametrize("key", ["²", "٣", "３", "1" * 5000, "007", "320"])
def test_hostile_logit_bias_keys_are_400_naming_the_key(served, path, key):
    _, server = served
    error = refused(server, path, body_for(path, logit_bias={key: 1}), "logit_bias", "'logit_bias' key")
    assert repr(key[:24])[:-1] in error["message"]


# --- ranges ------------------------------------------------------------------------------------------------------

OUT_OF_RANGE = [("temperature", 3), ("temperature", 2.0001), ("temperature", -0.1), ("top_p", 0), ("top_p", 1.5),
                ("top_p", -1), ("presence_penalty", 2.5), ("frequency_penalty", -3), ("n", 0), ("n", 17),
                ("max_tokens", 0), ("seed", 2**64), ("seed", -(2**63) - 1), ("top_k", -2),
                ("repetition_penalty", 1e-300), ("repetition_penalty", 0), ("repetition_penalty", 0.009), ("repetition_penalty", 101),
                ("min_tokens", -1), ("min_tokens", 3), ("logit_bias", {"5": 101}), ("logit_bias", {"5": -100.5}),
                ("logit_bias", {str(i): 1 for i in range(301)}), ("stop", ["x"] * 17), ("stop_token_ids", [320]),
                ("stop_token_ids", [-1])]


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
@pytest.mark.parametrize("field, value", OUT_OF_RANGE, ids=[f"{f}={str(v)[:12]}" for f, v in OUT_OF_RANGE])
def test_numbers_out_of_range_are_400_naming_the_field(served, path, field, value):
    refused(served[1], path, body_for(path, **{field: value}), field, field)


@pytest.mark.parametrize("path, field, value", [(CHAT, "max_completion_tokens", 0), (CHAT, "top_logprobs", 21),
                                                (COMPLETIONS, "logprobs", 21), (COMPLETIONS, "logprobs", -1),
                                                (COMPLETIONS, "best_of", 17)])
def test_endpoint_fields_out_of_range_are_400(served, path, field, value):
    fields = {field: value, "logprobs": True} if field == "top_logprobs" else {field: value}
    if field == "max_completion_tokens":
        fields["max_tokens"] = None
    refused(served[1], path, {**body_for(path), **fields}, field, field)


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_the_edges_of_each_range_are_served(served, path):
    for fields in ({"temperature": 2, "top_p": 1, "seed": 2**64 - 1}, {"temperature": 0, "seed": -(2**63)},
                   {"temperature": 1e-300, "top_p": 1e-300}, {"presence_penalty": 2, "frequency_penalty": -2},
                   {"repetition_penalty": 0.01}, {"repetition_penalty": 100}, {"top_k": -1}, {"top_k": 0},
                   {"top_k": 10**6}, {"logit_bias": {"0": 100, "319": -100}}, {"min_tokens": 2}, {"n": 16}):
        status, answer = call(served[1], "POST", path, body_for(path, **fields))
        assert status == 200 and all(c["finish_reason"] in ("stop", "length") for c in answer["choices"]), \
            (fields, answer)


# --- model, roles, the clients' default fields ---------------------------------------------------------------------

@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_model_is_required(served, path):
    _, server = served
    for body in (body_for(path), {k: v for k, v in body_for(path).items() if k in ("messages", "prompt")}):
        status, _, text = post_raw(server, path, body)  # no 'model' (call() would add the served one)
        error = json.loads(text)["error"]
        assert status == 400 and error["param"] == "model" and "'model' is required" in error["message"], text
        assert "GET /v1/models" in error["message"]
    refused(server, path, body_for(path, model=""), "model", "model")
    refused(server, path, body_for(path, model=None), "model", "model")
    status, answer = call(server, "POST", path, body_for(path, model="gpt-4"))
    assert status == 404 and answer["error"]["code"] == "model_not_found"


def test_roles_are_openais(served):
    _, server = served
    for role in ("wizard", "User", "", 7, None):
        refused(server, CHAT, body_for(CHAT, messages=[{"role": role, "content": "x"}]), "messages",
                "messages[0].role", "system, developer, user, assistant, tool, function")
    for role in ("developer", "tool", "function"):  # OpenAI's: only this model's template refuses them
        status, answer = call(server, "POST", CHAT, body_for(CHAT, messages=[{"role": role, "content": "x"}]))
        assert status == 400 and "Unknown role" in answer["error"]["message"], answer
    assert call(server, "POST", CHAT, body_for(CHAT, messages=[{"role": "system", "content": "Be brief."}, *USER]))[0] \
        == 200


SDK_TAKEN = {"store": False, "metadata": {"team": "a", "run": "7"}, "service_tier": "auto", "user": "u1",
             "safety_identifier": "hash-1", "prompt_cache_key": "k", "prompt_cache_retention": "in_memory",
             "modalities": ["text"], "verbosity": "medium", "audio": None, "prediction": None,
             "reasoning_effort": None, "web_search_options": None, "functions": None, "function_call": None,
             "parallel_tool_calls": True}
SDK_REFUSED = [("store", True, "stores no completions"), ("service_tier", "flex", '"auto"'),
               ("service_tier", "priority", '"auto"'), ("service_tier", "scale", '"auto"'),
               ("prompt_cache_retention", "24h", "in_memory"), ("modalities", ["text", "audio"], "text only"),
               ("audio", {"voice": "alloy", "format": "wav"}, "text only"), ("reasoning_effort", "low", "reasoning"),
               ("verbosity", "low", "verbosity"), ("prediction", {"type": "content", "content": "x"}, "predicted"),
               ("web_search_options", {}, "web"), ("functions", [{"name": "f"}], "'tools'"),
               ("function_call", "auto", "'tool_choice'"), ("moderation", {"a": 1}, "moderate"),
               ("prompt_cache_options", {"ttl": "1h"}, "cache")]


def test_the_clients_default_fields_are_taken_when_they_ask_for_nothing_more(served):
    _, server = served
    status, answer = call(server, "POST", CHAT, body_for(CHAT, **SDK_TAKEN))
    assert status == 200 and answer["object"] == "chat.completion", answer
    status, _ = call(server, "POST", CHAT, body_for(CHAT, service_tier="default", stream=True,
                                                    stream_options={"include_usage": True,
                                                                    "include_obfuscation": False}))
    assert status == 200


@pytest.mark.parametrize("field, value, words", SDK_REFUSED, ids=[f"{f}={str(v)[:10]}" for f, v, _ in SDK_REFUSED])
def test_the_clients_fields_that_ask_for_more_are_one_400(served, field, value, words):
    refused(served[1], CHAT, body_for(CHAT, **{field: value}), field, f"'{field}'", "not supported", words)


def test_oversized_client_fields_and_obfuscation_are_400(served):
    _, server = served
    refused(server, CHAT, body_for(CHAT, metadata={str(i): "x" for i in range(17)}), "metadata", "metadata")
    refused(server, CHAT, body_for(CHAT, metadata={"a": 1}), "metadata", "metadata")
    refused(server, CHAT, body_for(CHAT, stream=True, stream_options={"include_obfuscation": True}), "stream_options",
            "include_obfuscation")


# --- fuzz -----------------------------------------------------------------------------------------------------------

FUZZ_SECONDS = 2.5  # per seed
STRINGS = ["", "x", "²", "٣", "３", "\u0000", "a" * 3000, "<tool_call>" + "[" * 50, "[" * 100, "{", "null", "-1",
           "auto", "none", "required", "user", "assistant", "tool", "text", "json_object", "function", "0", "007"]
NUMBERS = [0, 1, -1, 2, 3, 16, 17, 20, 21, 100, 101, 320, 2**31, 2**63 - 1, -(2**63), 2**64 - 1, 0.0, -0.0, 1e-300,
           5e-324, 1e300, 2.0000001, -2.5, 0.5, 1e-3, 99.9]


def hostile(rng: random.Random, depth: int = 0):
    """A random JSON value, mostly of the kinds the fields take, at the edges of their ranges."""
    kind = rng.randrange(7 if depth < 4 else 4)
    if kind == 0:
        return rng.choice([None, True, False])
    if kind in (1, 2):
        return rng.choice(NUMBERS)
    if kind == 3:
        return rng.choice(STRINGS)
    if kind == 4:
        return [hostile(rng, depth + 1) for _ in range(rng.randrange(4))]
    if kind == 5:
        return {rng.choice(STRINGS + ["role", "content", "type", "name", "function", "arguments"]):
                hostile(rng, depth + 1) for _ in range(rng.randrange(4))}
    return rng.choice([{"type": "function", "function": {"name": "f", "parameters": {}}},
                       {"role": rng.choice(STRINGS), "content": hostile(rng, depth + 1)},
                       {str(rng.choice(NUMBERS)): rng.choice(NUMBERS)}])


def of_its_type(rng: random.Random, annotation: str):
    """A value of the type a field's annotation names, at the edges: most bodies then pass the schema and reach
    the range checks, the engine and generation."""
    kinds = [k for k in ("bool", "int", "float", "str", "list", "dict") if k in annotation]
    kind = rng.choice(kinds or ["none"])
    if kind == "bool":
        return rng.random() < 0.5
    if kind in ("int", "float"):
        return rng.choice([n for n in NUMBERS if kind == "float" or isinstance(n, int)])
    if kind == "str":
        return rng.choice(STRINGS)
    if kind == "list":
        return [rng.choice(NUMBERS if "int" in annotation else STRINGS) for _ in range(rng.randrange(4))]
    if kind == "dict":
        return {rng.choice(STRINGS): rng.choice(NUMBERS + STRINGS) for _ in range(rng.randrange(3))}
    return None


def mutated(rng: random.Random, path: str, fields: dict[str, str], model: str):
    """A body for ``path``: a valid one with one to four random changes, or now and then any JSON at all."""
    if rng.random() < 0.05:
        return hostile(rng)
    body = {"model": model, **body_for(path)}
    for _ in range(rng.randint(1, 4)):
        what = rng.random()
        if what < 0.35:
            name = rng.choice(sorted(fields))
            body[name] = of_its_type(rng, fields[name])
        elif what < 0.6:
            body[rng.choice(sorted(fields))] = hostile(rng)
        elif what < 0.7 and body:
            body.pop(rng.choice(sorted(body)))
        elif what < 0.8:
            body[rng.choice(STRINGS)] = hostile(rng)
        elif what < 0.9:
            body["logit_bias"] = {rng.choice(STRINGS + [str(n) for n in NUMBERS]): rng.choice(NUMBERS)}
        else:
            body["messages"] = USER + [{"role": "assistant", "content": None, "tool_calls": [
                {"id": "c", "type": "function", "function": {"name": "f", "arguments": rng.choice(STRINGS)}}]}]
    if isinstance(body.get("max_tokens"), int) and not isinstance(body["max_tokens"], bool):
        body["max_tokens"] = min(body["max_tokens"], 8)  # keep each answer short: the fuzz is about the input
    return body


def post_raw(server, path: str, body) -> tuple[int, str, str]:
    conn = http.client.HTTPConnection(*server.server_address[:2], timeout=60)
    try:
        conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, resp.getheader("Content-Type", ""), resp.read().decode()
    finally:
        conn.close()


@pytest.mark.parametrize("seed", [0, 1])
def test_fuzzed_bodies_never_get_a_5xx(served, seed):
    from prunus.serve.openai_schema import ChatCompletionRequest, CompletionRequest

    _, server = served
    rng = random.Random(seed)
    fields = {path: {name: str(f.annotation) for name, f in schema.model_fields.items()}
              for path, schema in ((CHAT, ChatCompletionRequest), (COMPLETIONS, CompletionRequest))}
    sent, deadline = 0, time.monotonic() + FUZZ_SECONDS
    while time.monotonic() < deadline or sent < 20:
        path = rng.choice([CHAT, COMPLETIONS])
        body = mutated(rng, path, fields[path], server.model_name)
        status, ctype, text = post_raw(server, path, body)
        sent += 1
        assert status < 500, (body, status, text[:500])
        if status >= 400:
            error = json.loads(text)["error"] if ctype.startswith("application/json") else None
            assert error and isinstance(error["message"], str) and "\n" not in error["message"], (body, text[:500])
            assert error["type"] in ("invalid_request_error", "rate_limit_error", "not_found_error"), (body, error)
        else:
            assert '"server_error"' not in text, (body, text[:500])  # nor an error mid-stream
    assert sent >= 20
