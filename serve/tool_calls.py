"""Tool calling on /v1/chat/completions: OpenAI's ``tools`` and ``tool_choice`` in, ``message.tool_calls`` out.

* The tools reach the model through its own chat template's ``tools`` variable, as transformers'
  ``apply_chat_template(messages, tools=...)`` passes them (the OpenAI objects as given); a template that never
  reads ``tools`` cannot show them to the model, so the request is refused (400 naming ``tools``).
* History: assistant messages with ``tool_calls`` (``content`` may be null) and ``tool`` messages are taken;
  a call's ``arguments`` JSON string is handed to the template as the object it holds, as templates expect
  (parsed within :mod:`prunus.serve.bounded_json`'s depth and size bounds, else one 400 naming ``messages``).
* The answer is parsed for Hermes / Qwen-style calls, ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
  (one or more); when they parse, they become ``tool_calls`` (``id``, ``type`` "function", ``function.name``,
  ``function.arguments`` as a JSON string), the text around them the ``content`` (null when empty), and
  ``finish_reason`` "tool_calls". A call that does not parse (not JSON, deeper or longer than
  :mod:`prunus.serve.bounded_json` allows, no ``name``) leaves the whole answer as plain ``content``.
* ``tool_choice``: "auto" (the default with tools) lets the model choose; "none" shows the tools but parses
  nothing; "required" or ``{"type": "function", "function": {"name": ...}}`` forces one call by the
  structured-output mask (:mod:`prunus.serve.structured_output`): the answer is ``<tool_call>\\n`` + a JSON
  object whose ``name`` is a given tool's and whose ``arguments`` follow that tool's ``parameters`` schema +
  ``\\n</tool_call>``.
"""

from __future__ import annotations

import json
import re
import uuid

from .bounded_json import MAX_DEPTH, loads_bounded
from .http_guard import BadRequest

MAX_TOOLS = 128
NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)
OPEN, CLOSE = "<tool_call>\n", "\n</tool_call>"


def _refuse(message: str, param: str = "tools"):
    raise BadRequest(400, message, param=param)


def check_tools(tools, tool_choice) -> tuple[list[dict], str]:
    """The tools as given (each checked) and the choice: "none", "auto", "required" or a tool's name."""
    if tools is None:
        if tool_choice not in (None, "none"):
            _refuse("'tool_choice' needs 'tools'", "tool_choice")
        return [], "none"
    if not tools or len(tools) > MAX_TOOLS:
        _refuse(f"'tools' must list 1 to {MAX_TOOLS} tools (or be left out)")
    names = []
    for i, tool in enumerate(tools):
        fn = tool.get("function")
        if tool.get("type") != "function" or not isinstance(fn, dict):
            _refuse(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\", \"parameters\"}}}}")
        if not isinstance(fn.get("name"), str) or not NAME.fullmatch(fn["name"]):
            _refuse(f"tools[{i}].function.name must be 1 to 64 letters, digits, '_', '.' or '-'")
        if not isinstance(fn.get("parameters", {}), dict) or not isinstance(fn.get("description", ""), str):
            _refuse(f"tools[{i}].function: 'parameters' must be a JSON schema object, 'description' a string")
        names.append(fn["name"])
    if tool_choice is None or tool_choice in ("auto", "none", "required"):
        return list(tools), tool_choice or "auto"
    fn = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    if not isinstance(fn, dict) or tool_choice.get("type") != "function" or fn.get("name") not in names:
        _refuse(f"'tool_choice' must be \"none\", \"auto\", \"required\" or {{\"type\": \"function\", "
                f"\"function\": {{\"name\": one of {names[:8]}}}}}", "tool_choice")
    return list(tools), fn["name"]


def template_messages(messages) -> list:
    """``messages`` as chat templates read them: a tool call's ``arguments`` JSON string becomes its object."""
    out = []
    for i, m in enumerate(messages):
        calls = m.get("tool_calls") if isinstance(m, dict) else None
        if calls is None:
            out.append(m)
            continue
        if not isinstance(calls, list) or not all(isinstance(c, dict) and isinstance(c.get("function"), dict)
                                                  for c in calls):
            _refuse(f"messages[{i}].tool_calls must be a list of {{\"id\", \"type\", \"function\": {{\"name\", "
                    "\"arguments\"}}}}", "messages")
        out.append({**m, "tool_calls": [{**c, "function": {**c["function"], "arguments": _arguments(
            c["function"].get("arguments"), i)}} for c in calls]})
    return out


def _arguments(value, i: int):
    if not isinstance(value, str):
        return value
    try:
        return loads_bounded(value)
    except ValueError as e:
        _refuse(f"messages[{i}].tool_calls: 'arguments' must be a JSON object string of at most {MAX_DEPTH} levels "
                f"({str(e)[:80]})", "messages")


def call_schema(tools: list[dict], choice: str) -> dict:
    """The JSON schema of one call to the chosen tool ("required": to any of them)."""
    options = [{"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
                "properties": {"name": {"const": t["function"]["name"]},
                               "arguments": t["function"].get("parameters") or {"type": "object"}}}
               for t in tools if choice == "required" or t["function"]["name"] == choice]
    return options[0] if len(options) == 1 else {"anyOf": options}


def parse_tool_calls(text: str) -> tuple[str | None, list[dict]] | None:
    """(content, tool_calls) of an answer holding Hermes-style calls, or None where there is none that parses."""
    calls = []
    for body in CALL.findall(text):
        try:
            call = loads_bounded(body)
        except ValueError:
            return None
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            return None
        arguments = call.get("arguments", call.get("parameters", {}))
        calls.append({"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                      "function": {"name": call["name"], "arguments": arguments if isinstance(arguments, str)
                                   else json.dumps(arguments, ensure_ascii=False)}})
    if not calls:
        return None
    content = CALL.sub("", text).strip()
    return content or None, calls
