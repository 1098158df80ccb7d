"""Tool calling on /v1/chat/completions with a Qwen2.5-style template (tools in the system turn, Hermes
``<tool_call>`` answers, ``tool`` turns) on a tiny random model: the prompt equals transformers'
apply_chat_template(..., tools=...), forced calls ("required", a named function) come back as OpenAI tool_calls
whose arguments follow the tool's schema, the history takes tool calls and tool results, and what cannot be
served is one 400 naming its field."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("xgrammar")
transformers = pytest.importorskip("transformers")

from prunus.models import HFTokenizer, Transformer, get_preset, save_model  # noqa: E402
from prunus.serve import Engine  # noqa: E402
from prunus.serve.tool_calls import parse_tool_calls, template_messages  # noqa: E402

from test_chat import CHAT_TEMPLATE, hf_tokenizer_dir  # noqa: E402
from test_openai_api import call, start  # noqa: E402
from test_structured_output import check  # noqa: E402

QWEN_TOOLS = (
    "{%- if tools %}{{- '<|im_start|>system\\n' }}{%- if messages[0]['role'] == 'system' %}"
    "{{- messages[0]['content'] }}{%- else %}{{- 'You are a helpful assistant.' }}{%- endif %}"
    "{{- \"\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>\" }}"
    "{%- for tool in tools %}{{- \"\\n\" }}{{- tool | tojson }}{%- endfor %}"
    "{{- \"\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\\"name\\\": <function-name>, \\\"arguments\\\": "
    "<args-json-object>}\\n</tool_call><|im_end|>\\n\" }}"
    "{%- else %}{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{%- endif %}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if (message.role == 'user') or (message.role == 'system' and not loop.first) or "
    "(message.role == 'assistant' and not message.tool_calls) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}"
    "{%- elif message.role == 'assistant' %}{{- '<|im_start|>' + message.role }}"
    "{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}"
    "{%- for tool_call in message.tool_calls %}{%- if tool_call.function is defined %}"
    "{%- set tool_call = tool_call.function %}{%- endif %}"
    "{{- '\\n<tool_call>\\n{\"name\": \"' }}{{- tool_call.name }}{{- '\", \"arguments\": ' }}"
    "{{- tool_call.arguments | tojson }}{{- '}\\n</tool_call>' }}{%- endfor %}{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != 'tool') %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' }}{{- message.content }}{{- '\\n</tool_response>' }}"
    "{%- if loop.last or (messages[loop.index0 + 1].role != 'tool') %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")

WEATHER = {"type": "object", "additionalProperties": False, "required": ["city", "days"],
           "properties": {"city": {"enum": ["Paris", "Rome"]}, "days": {"type": "integer", "minimum": 1, "maximum": 7}}}
TOOLS = [{"type": "function",
          "function": {"name": "get_weather", "description": "The forecast.", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "now", "description": "The time.",
                                           "parameters": {"type": "object", "properties": {},
                                                          "additionalProperties": False}}}]
HISTORY = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"},
           {"role": "assistant", "content": None, "tool_calls": [
               {"id": "call_1", "type": "function",
                "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\", \"days\": 2}"}}]},
           {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
           {"role": "user", "content": "And Rome?"}]


def _serve(tmp_path, template):
    torch.manual_seed(0)
    model = Transformer(get_preset("tiny").replace(max_seq_len=1536))
    model.init_weights()
    tok = hf_tokenizer_dir(tmp_path / "tok", template)
    return tok, Engine.load(save_model(model.eval(), tmp_path / "model", stage="test", tokenizer=HFTokenizer(tok)),
                            max_batch=4, threads=1)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    tok, engine = _serve(tmp_path_factory.mktemp("tools"), QWEN_TOOLS)
    with engine:
        server = start(engine)
        yield tok, engine, server
        server.shutdown()
        server.server_close()


def test_prompt_equals_transformers_with_tools(served):
    tok, engine, server = served
    hf = transformers.AutoTokenizer.from_pretrained(tok)
    for messages in (HISTORY, HISTORY[1:2]):
        hf_messages = [{**m, "tool_calls": [{**c, "function": {**c["function"], "arguments": json.loads(
            c["function"]["arguments"])}} for c in m["tool_calls"]]} if m.get("tool_calls") else m for m in messages]
        ref = hf.apply_chat_template(hf_messages, tools=TOOLS, tokenize=False, add_generation_prompt=True)
        assert engine.tokenizer.apply_chat_template(template_messages(messages), tools=TOOLS) == ref
        status, body = call(server, "POST", "/v1/chat/completions", {"messages": messages, "tools": TOOLS,
                                                                     "max_tokens": 2, "tool_choice": "none"})
        assert status == 200 and body["usage"]["prompt_tokens"] == len(engine.encode(ref)), body


@pytest.mark.parametrize("choice, names", [({"type": "function", "function": {"name": "get_weather"}},
                                            {"get_weather"}),
                                           ("required", {"get_weather", "now"})])
def test_forced_calls_come_back_as_tool_calls(served, choice, names):
    _, _, server = served
    status, body = call(server, "POST", "/v1/chat/completions", {
        "messages": HISTORY, "tools": TOOLS, "tool_choice": choice, "max_tokens": 200, "temperature": 1.0,
        "seed": 3, "n": 3})
    assert status == 200, body
    for c in body["choices"]:
        assert c["finish_reason"] == "tool_calls" and c["message"]["content"] is None, c
        (tool_call,) = c["message"]["tool_calls"]
        assert tool_call["type"] == "function" and tool_call["id"].startswith("call_")
        fn = tool_call["function"]
        assert fn["name"] in names and isinstance(fn["arguments"], str)
        schema = next(t["function"]["parameters"] for t in TOOLS if t["function"]["name"] == fn["name"])
        check(json.loads(fn["arguments"]), schema)


def test_hermes_calls_are_parsed():
    text = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome", "days": 1}}\n'
            '</tool_call>\n<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>')
    content, calls = parse_tool_calls(text)
    assert content == "Let me check."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Rome", "days": 1}), ("now", {})]
    assert parse_tool_calls("no calls here") is None
    assert parse_tool_calls("<tool_call>{not json</tool_call>") is None
    from prunus.serve.chat_api import _choice
    from prunus.serve.openai_generate import Choice

    answer = Choice(index=0, prompt_tokens=1, text=text, finish_reason="stop")
    assert len(_choice(None, answer, False, parse=True)["message"]["tool_calls"]) == 2
    one = _choice(None, answer, False, parse=True, one_call=True)  # parallel_tool_calls: false
    assert [c["function"]["name"] for c in one["message"]["tool_calls"]] == ["get_weather"]


@pytest.mark.parametrize("fields, param, words", [
    ({"tools": TOOLS, "stream": True}, "tools", "cannot be streamed"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
     "'tool_choice' must be"),
    ({"tool_choice": "required"}, "tool_choice", "needs 'tools'"),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools", "tools[0].function.name"),
    ({"tools": TOOLS, "tool_choice": "required", "guided_regex": "a"}, "tool_choice", "not both"),
])
def test_refusals_name_their_field(served, fields, param, words):
    _, _, server = served
    status, body = call(server, "POST", "/v1/chat/completions", {"messages": HISTORY[1:2], "max_tokens": 2, **fields})
    assert status == 400 and body["error"]["param"] == param and words in body["error"]["message"], body


def test_template_without_tools_refuses_them(tmp_path):
    _, engine = _serve(tmp_path, CHAT_TEMPLATE)
    with engine:
        server = start(engine)
        try:
            status, body = call(server, "POST", "/v1/chat/completions", {
                "messages": [{"role": "user", "content": "hi"}], "tools": TOOLS, "max_tokens": 2})
            assert status == 400 and body["error"]["param"] == "tools", body
            assert "does not take tools" in body["error"]["message"]
        finally:
            server.shutdown()
            server.server_close()


def test_auto_parses_what_the_model_writes(served):
    """With tool_choice "auto" the answer is free; a regex makes the random model write a Hermes call and some
    text, which come back as tool_calls and content."""
    _, _, server = served
    status, body = call(server, "POST", "/v1/chat/completions", {
        "messages": HISTORY, "tools": TOOLS, "max_tokens": 200, "temperature": 1.0, "seed": 1,
        "guided_regex": r'Sure\.\n<tool_call>\n\{"name": "now", "arguments": \{\}\}\n</tool_call>'})
    assert status == 200, body
    (choice,) = body["choices"]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] == "Sure."
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in choice["message"]["tool_calls"]] == [
        ("now", "{}")]


def test_an_answer_too_deep_to_parse_comes_back_as_content(served):
    """A call nested deeper than the parser's bound (a regex makes the model write one) is the answer's text,
    never a 500 after generation; the same call in the history is one 400 naming messages."""
    _, _, server = served
    deep = "<tool_call>\n" + "[" * 40
    status, body = call(server, "POST", "/v1/chat/completions", {
        "messages": HISTORY, "tools": TOOLS, "max_tokens": 200, "temperature": 1.0, "seed": 1,
        "guided_regex": r"<tool_call>\n\[{40}"})
    assert status == 200, body
    (choice,) = body["choices"]
    assert choice["message"] == {"role": "assistant", "content": deep} and choice["finish_reason"] == "stop", choice
    assert parse_tool_calls("<tool_call>" + "[" * 1200) is None  # json.loads alone would raise RecursionError
    turn = {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "now", "arguments": "[" * 100_000}}]}
    status, body = call(server, "POST", "/v1/chat/completions", {"messages": [*HISTORY[:2], turn], "tools": TOOLS,
                                                                 "max_tokens": 2})
    assert status == 400 and body["error"]["param"] == "messages" and "deeper than 32" in body["error"]["message"]
