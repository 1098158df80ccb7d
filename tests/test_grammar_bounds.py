"""Structured-output compiles are bounded: a constraint past a cap is one fast 400 naming its field; an at-cap
schema compiles well under the deadline; a compile past the deadline is one 400 and frees its worker; while a
grammar bomb compiles, a plain request is answered within a second and a second constraint finds the queue full
(429); a client that leaves stops its compile; a seeded, time-bounded fuzz of hostile constraints never gets a
500 nor runs past the deadline."""

from __future__ import annotations

import json
import os
import random
import socket
import time

import pytest
import torch

pytest.importorskip("xgrammar")

from prunus.artifacts.errors import PrunusError  # noqa: E402
from prunus.models import Transformer, get_preset, save_model  # noqa: E402
from prunus.serve import Engine  # noqa: E402
from prunus.serve.grammar_limits import GrammarLimits, check_regex, check_schema, regex_size  # noqa: E402
from prunus.serve.grammar_worker import WALL_FACTOR, cpu_seconds  # noqa: E402
from prunus.serve.structured_output import compile_constraint, pool_of, set_limits  # noqa: E402

from test_openai_api import call, start  # noqa: E402

OPEN = dict(max_string=10**6, max_strings=10**6, max_regex=10**7, max_regexes=10**7)  # caps out of a bomb's way


def bomb(n: int = 6000) -> dict:
    """Four enum strings sharing a prefix: minutes of xgrammar's compile at 24,000 characters."""
    return {"enum": ["a" * n + str(i) for i in range(4)]}


def fmt(schema) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}


def at_cap(limits: GrammarLimits) -> dict:
    """One schema at every cap at once: the longest strings sharing a prefix up to the characters' cap, two
    patterns of the largest size, the optional and counted properties' caps, nested to the depth cap."""
    left = limits.max_optionals - limits.max_counted  # the counted object's properties are optional too
    sizes = [limits.max_optional] * (left // limits.max_optional) + [left % limits.max_optional]
    optional = [{"type": "object", "properties": {f"o{i}": {"type": "integer"} for i in range(n)}} for n in sizes]
    counted = {"type": "object", "properties": {f"c{i}": {"type": "integer"} for i in range(limits.max_counted)},
               "minProperties": limits.max_counted // 2}
    pattern = {"type": "string", "pattern": f"[a-z]{{{limits.max_regex}}}"}
    props = {"enum": None, "pat1": pattern, "pat2": pattern,
             "optional": {"type": "array", "items": {"anyOf": optional}}, "counted": counted}
    names = sum(len(k) for k in props) + sum(len(k) for o in optional + [counted] for k in o["properties"])
    props["enum"] = {"enum": ["e" * (limits.max_string - 4) + f"{i:04d}"
                              for i in range((limits.max_strings - names) // limits.max_string)]}
    schema = {"type": "object", "properties": props, "required": list(props)}
    for _ in range(limits.max_depth - 8):  # the deepest path: 8 levels inside
        schema = {"type": "array", "items": schema}
    return schema


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    torch.manual_seed(0)
    model = Transformer(get_preset("tiny").replace(max_seq_len=256))
    model.init_weights()
    path = save_model(model.eval(), tmp_path_factory.mktemp("bounds") / "model", stage="test")
    with Engine.load(path, max_batch=4, threads=1) as engine:
        set_limits(engine.tokenizer, engine.backend.vocab_size, GrammarLimits(queue=0))
        server = start(engine)
        try:
            status, body = call(server, "POST", "/v1/completions", {  # the worker's start (xgrammar's import)
                "prompt": "a", "max_tokens": 2, "guided_regex": "[ab]{2}"})
            assert status == 200, body
            yield server
        finally:
            server.shutdown()
            server.server_close()


def limits(server, **caps) -> GrammarLimits:
    """The server's model compiles under ``caps`` (one worker, no queue) from now on."""
    chosen = GrammarLimits(queue=0, **caps)
    set_limits(server.engine.tokenizer, server.engine.backend.vocab_size, chosen)
    return chosen


def pool(server):
    return pool_of(server.engine.tokenizer, server.engine.backend.vocab_size)


def timed(server, body: dict) -> tuple[int, dict, float]:
    t0 = time.perf_counter()
    status, out = call(server, "POST", "/v1/completions", {"prompt": "a", "max_tokens": 2, **body})
    return status, out, time.perf_counter() - t0


# --- the caps ---------------------------------------------------------------------------------------------

def test_regex_size_writes_repetitions_out():
    assert regex_size(r"^\d{4}-\d{2}-\d{2}$") == 10
    assert regex_size("[a-z]{2048}") == 2048
    assert regex_size(".{0,512}") == 2048  # '.' may match 4 UTF-8 bytes
    assert regex_size("(ab|cd){1024}") == 4096
    assert regex_size("(.{0,45}){0,45}") == 4 * 45 * 45  # nested repetitions multiply
    assert regex_size("[^x]{10}") == 40 and regex_size(r"[\]a]{3}") == 3 and regex_size(r"\p{L}{3}") == 12
    assert regex_size("(a|b)*c+d?") == 4 and regex_size("x{2,}") == 2
    assert regex_size("(" * 50 + "a{1000}" + "){1000}" * 50, stop_above=5000) <= 10**6  # stops once past


@pytest.mark.parametrize("schema, words", [
    (bomb(24_000), "enum / const value or property name of 24,001 characters"),
    ({"const": "x" * 513}, "of 513 characters"),
    ({"enum": [f"{i:0500d}" for i in range(33)]}, "characters or more of enum / const values"),
    ({"type": "object", "properties": {"k" * 600: {"type": "integer"}}}, "property name of 600"),
    ({"type": "string", "pattern": "(.{0,1000}){0,1000}"}, "regex of size"),
    ({"type": "object", "properties": {c: {"type": "string", "pattern": "[a-z]{900}"} for c in "abc"}},
     "patterns of size"),
    ({"type": "object", "properties": {f"p{i}": {} for i in range(300)}}, "300 optional properties"),
    ({"type": "array", "items": [{"type": "object", "properties": {f"p{i}": {} for i in range(100)}}] * 6},
     "optional properties or more in all"),
    ({"type": "object", "properties": {f"p{i}": {} for i in range(100)}, "minProperties": 50,
      "required": [f"p{i}" for i in range(100)]}, "minProperties / maxProperties"),
    (json.loads('{"type": "array", "items": ' * 80 + "{}" + "}" * 80), "deep"),
])
def test_limits_refuse_past_each_cap(schema, words):
    with pytest.raises(PrunusError) as e:
        check_schema(schema, GrammarLimits(), "response_format")
    message = str(e.value)
    assert words in message and message.startswith("'response_format' ") and "PRUNUS_GRAMMAR_" in message, message


def test_limits_read_the_schema_not_its_names():
    """A property named like a keyword ("enum", "pattern", "const") is a property, and data is not a schema."""
    schema = {"type": "object", "properties": {"enum": {"type": "string"}, "pattern": {"type": "string"},
                                               "const": {"enum": ["a", "b"]}},
              "examples": [{"enum": "z" * 5000}], "required": ["enum", "pattern", "const"]}
    check_schema(schema, GrammarLimits(), "guided_json")
    check_regex(r"^[A-Z][a-z]+(, [A-Z][a-z]+)*$", GrammarLimits(), "guided_regex")
    with pytest.raises(PrunusError, match="'guided_regex' has a regex of size"):
        check_regex("((a|b|.){0,300}[a-z]{1,300}){0,300}", GrammarLimits(), "guided_regex")


def test_limits_come_from_the_environment_and_a_bad_value_is_one_line():
    env = {"PRUNUS_GRAMMAR_TIMEOUT_S": "2.5", "PRUNUS_GRAMMAR_WORKERS": "2", "PRUNUS_GRAMMAR_MAX_STRING": "64"}
    assert GrammarLimits.from_env(env) == GrammarLimits(timeout_s=2.5, workers=2, max_string=64)
    for name, value in [("PRUNUS_GRAMMAR_TIMEOUT_S", "0"), ("PRUNUS_GRAMMAR_QUEUE", "-1"),
                        ("PRUNUS_GRAMMAR_MAX_DEPTH", "deep")]:
        with pytest.raises(PrunusError) as e:
            GrammarLimits.from_env({name: value})
        assert str(e.value).startswith(f"{name}={value!r}: give ") and "\n" not in str(e.value)


@pytest.mark.parametrize("field, value", [
    ("response_format", fmt(bomb(24_000))),  # the 96 KB schema that held a core for minutes
    ("guided_json", json.dumps({"enum": ["b" * 20_000 + str(i) for i in range(4)]})),  # as JSON text
    ("guided_regex", "|".join("c" * 3000 + str(i) for i in range(4))),
    ("guided_regex", "(.{0,1000}){0,1000}"),
])
def test_over_cap_constraints_are_one_fast_400(server, field, value):
    limits(server)
    status, body, took = timed(server, {field: value})
    assert status == 400 and body["error"]["param"] == field, body
    assert "PRUNUS_GRAMMAR_" in body["error"]["message"] and "\n" not in body["error"]["message"]
    assert took < 1.0, took


@pytest.mark.slow
def test_an_at_cap_schema_compiles_well_under_the_deadline(server):
    """Under the default caps with 60% of the default deadline: the worker's compile must finish in 6 CPU seconds
    (about 1 s on an idle 2-core EPYC; CPU time, so a loaded machine, where the niced worker gets a fraction of a
    core, gives the same answer); the serving process's own compile follows (as long again)."""
    default = GrammarLimits()
    limits(server, timeout_s=0.6 * default.timeout_s)
    tokenizer, vocab = server.engine.tokenizer, server.engine.backend.vocab_size
    schema = at_cap(default)
    check_schema(schema, default, "guided_json")  # at every cap, past none
    grammar = compile_constraint(tokenizer, vocab, "json_schema", schema, "guided_json")
    assert grammar.what == "json_schema" and grammar.matcher(()).accept_string("[" * 56 + '{"enum": "' + "e" * 508)


# --- the deadline, the queue, the client gone ---------------------------------------------------------------

def test_the_deadline_counts_cpu_time_not_the_clocks():
    """A process's CPU seconds grow while it computes and not while it sleeps: the compile deadline's measure."""
    before = cpu_seconds(os.getpid())
    if before is None:
        pytest.skip("/proc/PID/stat cannot be read here: the deadline is the clock's")
    time.sleep(0.3)
    slept = cpu_seconds(os.getpid())
    end = time.process_time() + 0.3
    while time.process_time() < end:
        pass
    busy = cpu_seconds(os.getpid())
    assert slept - before < 0.1 and busy - slept >= 0.25, (before, slept, busy)


@pytest.mark.slow
def test_a_compile_past_the_deadline_is_400_and_frees_the_worker(server):
    limits(server, timeout_s=1.0, **OPEN)
    status, body, took = timed(server, {"response_format": fmt(bomb(5000))})
    assert status == 400 and body["error"]["param"] == "response_format", body
    assert "took longer than 1 s to compile (PRUNUS_GRAMMAR_TIMEOUT_S)" in body["error"]["message"], body
    assert 1.0 <= took < WALL_FACTOR * 1.0 + 2.0, took  # 1 CPU second; a loaded machine waits longer
    assert pool(server).busy == 0
    status, body, took = timed(server, {"guided_json": {"type": "boolean"}})
    assert status == 200 and body["choices"][0]["text"] in ("true", "false", "t", "tr", "f", "fa"), body
    status, body, took = timed(server, {"response_format": fmt(bomb(5000))})  # remembered: refused at once
    assert status == 400 and "took longer than" in body["error"]["message"] and took < 0.5, (body, took)


def _post_raw(server, body: dict) -> socket.socket:
    data = json.dumps({"model": server.model_name, **body}).encode()
    host, port = server.server_address[:2]
    sock = socket.create_connection((host, port))
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: %s:%d\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n" % (host.encode(), port, len(data)) + data)
    return sock


def _until(predicate, timeout_s: float) -> bool:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()


@pytest.mark.slow
def test_a_plain_request_is_answered_while_a_grammar_bomb_compiles(server):
    limits(server, timeout_s=60.0, **OPEN)
    sock = _post_raw(server, {"prompt": "a", "max_tokens": 2, "response_format": fmt(bomb(8000))})
    try:
        assert _until(lambda: pool(server).busy == 1, 5.0), sock.recv(1000)
        time.sleep(0.3)  # the compile under way in its worker
        status, body, took = timed(server, {})
        assert status == 200 and took < 1.0, (status, took)
        status, body, took = timed(server, {"guided_regex": "[xy]{3}"})  # one worker, no queue: 429 at once
        assert status == 429 and body["error"]["param"] == "guided_regex" and took < 1.0, body
        assert "PRUNUS_GRAMMAR_QUEUE" in body["error"]["message"] and "\n" not in body["error"]["message"]
        assert pool(server).busy == 1
    finally:
        sock.close()  # the client leaves: its compile is stopped
    assert _until(lambda: pool(server).busy == 0, 3.0)
    status, body, took = timed(server, {"guided_regex": "[xy]{3}"})
    assert status == 200 and len(body["choices"][0]["text"]) <= 3 and took < 2.0, (body, took)


# --- fuzz ---------------------------------------------------------------------------------------------------

def _regex(rng: random.Random) -> str:
    atoms = [".", "[a-z]", "(a|b)", r"\d", "[^x]", "a", "(ab|ac)", r"\w", "é"]
    text = rng.choice(atoms)
    for _ in range(rng.randint(1, 3)):
        low = rng.choice([0, 1, rng.randint(0, 5000)])
        high = rng.choice(["", str(low), str(low + rng.randint(0, 5000))])
        text = f"({text}{rng.choice(atoms)}){{{low},{high}}}" if rng.random() < 0.7 else f"({text})*{rng.choice(atoms)}"
    return text


def _hostile(rng: random.Random):
    """(field, value) of one hostile constraint, at most about 200,000 characters (the body cap is 1 MiB)."""
    n, k = int(10 ** rng.uniform(1, 4.5)), rng.randint(2, 64)
    n = min(n, 200_000 // k)
    shapes = [
        lambda: {"enum": ["a" * n + str(i) for i in range(k)]},
        lambda: {"anyOf": [{"const": "p" * (n // 8) + str(i)} for i in range(3 * k)]},
        lambda: {"type": "string", "pattern": _regex(rng)},
        lambda: {"type": "object", "properties": {f"q{i}": {"type": "integer"} for i in range(rng.randint(1, 600))},
                 **({"minProperties": rng.randint(0, 80)} if rng.random() < 0.5 else {})},
        lambda: _deep(rng.randint(1, 120)),
        lambda: {"type": "integer", "minimum": -(10 ** rng.randint(1, 40)), "maximum": 10 ** rng.randint(1, 40)},
        lambda: {"type": rng.choice(["nope", 3, None]), "pattern": "(ab"},
    ]
    schema = rng.choice(shapes)()
    if rng.random() < 0.3:
        schema = {"type": "object", "properties": {"x": schema, "y": rng.choice(shapes)()}, "required": ["x"]}
    if json.dumps(schema).count("{") > 24:  # a request body nests 32 levels at most: send deep ones as text
        return "guided_json", json.dumps(schema)
    return rng.choice([("response_format", fmt(schema)), ("guided_json", schema), ("guided_regex", _regex(rng))])


def _deep(depth: int) -> dict:
    schema: dict = {"type": "integer"}
    for _ in range(depth):
        schema = {"type": "array", "items": schema}
    return schema


@pytest.mark.slow
def test_fuzzed_hostile_constraints_never_500_nor_pass_the_deadline(server):
    """Seeded and time-bounded: under the default caps (most refused at once) and with the caps open (so that
    bombs reach the compiler and meet the deadline). A request's compile takes at most the deadline of CPU time
    in the worker (``WALL_FACTOR`` times that on a loaded machine's clock) plus as long again in the serving
    process."""
    rng, end, seen = random.Random(1234), time.monotonic() + 12.0, {"ok": 0, "refused": 0, "deadline": 0}
    while time.monotonic() < end:
        chosen = limits(server, timeout_s=1.5, **(OPEN if rng.random() < 0.4 else {}))
        field, value = _hostile(rng)
        status, body, took = timed(server, {field: value})
        assert status in (200, 400), (status, body, field, json.dumps(value)[:200])
        if status == 400:
            assert body["error"]["param"] == field and "\n" not in body["error"]["message"], body
        assert took < (WALL_FACTOR + 2) * chosen.timeout_s + 1.5, (took, field, json.dumps(value)[:200])
        seen["ok" if status == 200 else "deadline" if "took longer" in body["error"]["message"] else "refused"] += 1
    assert all(seen.values()), seen
    assert pool(server).busy == 0
