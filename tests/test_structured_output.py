"""Structured outputs on a tiny random model (the strictest test: only the mask keeps it inside the grammar):
every answer under a JSON schema parses and validates, for several seeds at temperature 1.0, on completions and
chat; json_object gives a JSON object; guided_regex matches; a schema or regex that does not compile is one 400
naming its field; the grammar is compiled once per schema text."""

from __future__ import annotations

import json
import re

import pytest
import torch

pytest.importorskip("xgrammar")

from prunus.models import Transformer, get_preset, save_model  # noqa: E402
from prunus.serve import Engine  # noqa: E402
from prunus.serve.structured_output import cache_info  # noqa: E402

from test_openai_api import call, start  # noqa: E402

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "kind", "n", "tags", "inner"],
          "properties": {"name": {"type": "string", "pattern": "^[a-z]{1,8}$"},
                         "kind": {"enum": ["alpha", "beta", 3]},
                         "n": {"type": "integer", "minimum": -50, "maximum": 50},
                         "x": {"type": "number"},
                         "tags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3},
                         "inner": {"type": "object", "additionalProperties": False, "required": ["ok"],
                                   "properties": {"ok": {"type": "boolean"},
                                                  "ids": {"type": "array", "items": {"type": "integer"},
                                                          "minItems": 1, "maxItems": 2}}}}}
TYPES = {"object": dict, "array": list, "string": str, "boolean": bool, "null": type(None)}


def check(value, schema: dict, where: str = "$") -> None:
    """A hand validator of the schema subset used here (jsonschema is not a dependency)."""
    if "enum" in schema:
        assert value in schema["enum"] and type(value) in {type(e) for e in schema["enum"]}, where
        return
    kind = schema["type"]
    if kind in ("integer", "number"):
        assert isinstance(value, (int, float)) and not isinstance(value, bool), where
        assert kind == "number" or isinstance(value, int), where
        assert schema.get("minimum", value) <= value <= schema.get("maximum", value), where
        return
    assert isinstance(value, TYPES[kind]), where
    if kind == "string" and "pattern" in schema:
        assert re.fullmatch(schema["pattern"].strip("^$"), value), where
    if kind == "array":
        assert schema.get("minItems", 0) <= len(value) <= schema.get("maxItems", len(value)), where
        for i, item in enumerate(value):
            check(item, schema["items"], f"{where}[{i}]")
    if kind == "object":
        assert set(schema.get("required", ())) <= set(value), where
        assert schema.get("additionalProperties", True) or set(value) <= set(schema["properties"]), where
        for key, item in value.items():
            check(item, schema["properties"][key], f"{where}.{key}")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    torch.manual_seed(0)
    model = Transformer(get_preset("tiny").replace(max_seq_len=512))
    model.init_weights()
    path = save_model(model.eval(), tmp_path_factory.mktemp("structured") / "model", stage="test")
    with Engine.load(path, max_batch=4, threads=1) as engine:
        server = start(engine)
        yield server
        server.shutdown()
        server.server_close()


def test_every_answer_validates_against_the_schema(server):
    fmt = {"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA, "strict": True}}
    texts = []
    for seed in range(3):
        status, body = call(server, "POST", "/v1/completions", {"prompt": "x", "max_tokens": 400, "temperature": 1.0,
                                                                "seed": seed, "n": 2, "response_format": fmt})
        assert status == 200, body
        texts += [(c["text"], c["finish_reason"]) for c in body["choices"]]
    status, body = call(server, "POST", "/v1/completions", {"prompt": "y", "max_tokens": 400, "temperature": 1.0,
                                                            "seed": 9, "guided_json": SCHEMA})
    assert status == 200, body
    texts.append((body["choices"][0]["text"], body["choices"][0]["finish_reason"]))
    for text, finish in texts:
        assert finish == "stop", text
        check(json.loads(text), SCHEMA)


def test_json_object_and_regex(server):
    status, body = call(server, "POST", "/v1/completions", {
        "prompt": "a", "max_tokens": 60, "temperature": 1.0, "seed": 1, "n": 3,
        "guided_regex": r"(yes|no)-[0-9]{2,4}"})
    assert status == 200, body
    for c in body["choices"]:
        assert re.fullmatch(r"(yes|no)-[0-9]{2,4}", c["text"]) and c["finish_reason"] == "stop", c
    status, body = call(server, "POST", "/v1/completions", {
        "prompt": "a", "max_tokens": 300, "temperature": 1.0, "seed": 2, "n": 3,
        "response_format": {"type": "json_object"}})
    assert status == 200, body
    for c in body["choices"]:  # a random model's JSON may run long: what ends is an object, what is cut a prefix
        assert c["text"].startswith("{"), c
        if c["finish_reason"] == "stop":
            assert isinstance(json.loads(c["text"]), dict)


@pytest.mark.parametrize("fields, param, words", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     "response_format", "not a JSON schema prunus can enforce"),
    ({"guided_regex": "(ab"}, "guided_regex", "not a regular expression prunus can enforce"),
    ({"response_format": {"type": "json_schema"}}, "response_format", "needs 'json_schema'"),
    ({"guided_regex": "a", "guided_json": {"type": "integer"}}, "guided_regex", "not several"),
    ({"guided_regex": "a", "min_tokens": 2}, "min_tokens", "cannot be combined with 'guided_regex'"),
])
def test_bad_constraints_are_one_400_naming_the_field(server, fields, param, words):
    status, body = call(server, "POST", "/v1/completions", {"prompt": "a", "max_tokens": 4, **fields})
    assert status == 400, body
    assert body["error"]["param"] == param and words in body["error"]["message"], body
    assert "\n" not in body["error"]["message"]


def test_grammar_is_compiled_once_per_schema_text(server):
    schema = {"type": "object", "properties": {"v": {"type": "boolean"}}, "required": ["v"],
              "additionalProperties": False}
    before = cache_info()
    for seed in range(2):
        status, body = call(server, "POST", "/v1/completions", {"prompt": "q", "max_tokens": 40, "seed": seed,
                                                                "temperature": 1.0, "guided_json": schema})
        assert status == 200 and json.loads(body["choices"][0]["text"])["v"] in (True, False), body
    after = cache_info()
    assert after.misses - before.misses == 1 and after.hits - before.hits == 1


def test_chat_answers_follow_the_schema_with_a_bpe_tokenizer(tmp_path):
    """A Hugging Face byte-level BPE tokenizer (multi-byte tokens, special tokens) under chat's response_format."""
    from test_chat import CHAT_TEMPLATE, hf_tokenizer_dir

    from prunus.models import HFTokenizer

    torch.manual_seed(0)
    model = Transformer(get_preset("tiny").replace(max_seq_len=512))
    model.init_weights()
    path = save_model(model.eval(), tmp_path / "chat", stage="test",
                      tokenizer=HFTokenizer(hf_tokenizer_dir(tmp_path / "tok", CHAT_TEMPLATE)))
    with Engine.load(path, max_batch=4, threads=1) as engine:
        server = start(engine)
        try:
            fmt = {"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA}}
            body = {"messages": [{"role": "user", "content": "Hello there"}], "max_tokens": 300, "n": 3,
                    "temperature": 1.0, "seed": 4, "response_format": fmt}
            status, out = call(server, "POST", "/v1/chat/completions", body)
            assert status == 200, out
            for c in out["choices"]:
                assert c["finish_reason"] == "stop", c
                check(json.loads(c["message"]["content"]), SCHEMA)
        finally:
            server.shutdown()
            server.server_close()


@pytest.mark.parametrize("temperature", [1.0, 0.0])
def test_a_regex_no_text_can_follow_ends_its_row_and_spares_its_neighbours(server, temperature):
    """A regex that matches nothing leaves no token to sample: the row ends at its stop token (no 500), and a
    plain request in the same batch is answered as usual."""
    import concurrent.futures

    dead = {"prompt": "a", "max_tokens": 8, "temperature": temperature, "seed": 0, "guided_regex": "a[^\\x00-\\U0010FFFF]"}
    plain = {"prompt": "b", "max_tokens": 8, "temperature": 0.0}
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(call, server, "POST", "/v1/completions", body) for body in (dead, plain)]
        (dead_status, dead_body), (plain_status, plain_body) = [f.result() for f in futures]
    assert dead_status == 200 and dead_body["choices"][0]["finish_reason"] == "stop", dead_body
    assert dead_body["choices"][0]["text"] in ("", "a")
    assert plain_status == 200 and plain_body["choices"][0]["text"], plain_body


def test_an_ambiguous_regex_stops_matching_at_its_time_budget(server):
    """``(a*a*)*b`` compiles at once but makes every step slower than the last (48 s for 200 tokens of 'a'
    unbounded): past the grammar's match budget (PRUNUS_GRAMMAR_MATCH_S, 2 s) the row may only stop, so the
    request ends within about that budget and a plain request after it is answered."""
    import time

    body = {"prompt": "a", "max_tokens": 300, "temperature": 0.0, "logit_bias": {"97": 100},
            "guided_regex": "(a*a*)*b"}
    start = time.perf_counter()
    status, answer = call(server, "POST", "/v1/completions", body)
    assert status == 200 and answer["choices"][0]["finish_reason"] == "stop", answer
    assert time.perf_counter() - start < 15
    assert set(answer["choices"][0]["text"]) <= {"a"}
    status, plain = call(server, "POST", "/v1/completions", {"prompt": "b", "max_tokens": 4, "temperature": 0.0})
    assert status == 200 and plain["choices"][0]["text"]
