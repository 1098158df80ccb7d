"""Chat templates: a conversation (a list of ``{"role", "content"}`` messages) rendered into the
prompt text a chat model was trained on, exactly as Hugging Face transformers renders it.

The template is Jinja (a model's ``chat_template.jinja``, or ``tokenizer_config.json``'s
``chat_template``). It runs in the same environment as transformers'
``apply_chat_template(..., tokenize=False)`` (``transformers.utils.chat_template_utils``):
a sandbox that cannot change its inputs (``ImmutableSandboxedEnvironment``) with
``trim_blocks`` and ``lstrip_blocks``, ``{% break %}`` / ``{% continue %}``, a
``{% generation %}`` block that renders its body, ``raise_exception``, ``strftime_now``,
a ``tojson`` filter that leaves ``<``, ``>`` and non-ASCII text as they are, ``dict`` and
a ``namespace`` that refuses underscore names; the variables are ``messages``, ``tools``,
``documents``, ``add_generation_prompt`` and the tokenizer's named special tokens
(``bos_token``, ``eos_token``, ...). Sandboxed because templates come with downloaded models, and
bounded (:mod:`prunus.models.template_sandbox`): output size, what a render builds, loop steps and
time, so a template cannot exhaust memory or hang the process; every way a template fails is one
PrunusError line.
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache

import jinja2
import jinja2.ext
import jinja2.nodes

from prunus.artifacts.errors import PrunusError

from .template_sandbox import BoundedEnvironment, check_strftime_format, render_bounded

# names a message's reasoning may come under; templates read the first (transformers aliases them alike)
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class GenerationBlock(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` (marks assistant text for training masks): renders its body."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller):
        return caller()


def raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    """JSON without Jinja's HTML escaping, with json.dumps' options (as transformers defines it)."""
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def strftime_now(format):
    check_strftime_format(format)
    return datetime.now().strftime(format)


class TemplateDict:
    """``dict(...)`` for templates, without exposing the type itself."""

    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


class TemplateNamespace(jinja2.utils.Namespace):
    """Jinja's ``namespace`` refusing underscore-prefixed attributes (no way into Python internals)."""

    def __init__(*args, **kwargs):
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"chat templates cannot set underscore-prefixed attributes ({name!r})")


@lru_cache(maxsize=16)
def compile_template(source: str) -> jinja2.Template:
    """The compiled template, or one PrunusError line naming the syntax error and its line."""
    env = BoundedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[GenerationBlock, jinja2.ext.loopcontrols],
                             filters={"tojson": tojson},
                             globals={"raise_exception": raise_exception, "strftime_now": strftime_now,
                                      "dict": TemplateDict(), "namespace": TemplateNamespace})
    try:
        return env.from_string(source)
    except jinja2.exceptions.TemplateSyntaxError as e:
        raise PrunusError(f"the chat template is not valid Jinja (line {e.lineno}: {_line(e.message)}); "
                          "fix chat_template.jinja or tokenizer_config.json's chat_template") from None
    except (RecursionError, MemoryError) as e:  # nesting too deep for the parser
        raise PrunusError(f"the chat template cannot be compiled ({type(e).__name__}); "
                          "fix chat_template.jinja or tokenizer_config.json's chat_template") from None


def check_messages(messages) -> list[dict]:
    """``messages`` as plain dicts, or one PrunusError line saying which message is malformed.

    Each message is a dict with a string ``role`` and a ``content`` that is a string, or a list of
    OpenAI text parts (``{"type": "text", "text": ...}``, joined with newlines)."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise PrunusError("'messages' must be a non-empty list of {\"role\", \"content\"} objects")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise PrunusError(f"messages[{i}] must be an object with 'role' and 'content', not {type(m).__name__}")
        if not isinstance(m.get("role"), str) or not m["role"]:
            raise PrunusError(f"messages[{i}] needs a 'role' string (system, user, assistant, ...)")
        content = m.get("content")
        if content is None and m["role"] == "assistant" and isinstance(m.get("tool_calls"), list) and m["tool_calls"]:
            out.append(json.loads(json.dumps(m)))  # a turn of tool calls only: content may be null or absent
            continue
        if isinstance(content, list):
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
                raise PrunusError(f"messages[{i}].content: only text parts ({{\"type\": \"text\", \"text\": ...}}) are supported")
            content = "\n".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise PrunusError(f"messages[{i}] needs a 'content' string")
        out.append(json.loads(json.dumps({**m, "content": content})))  # plain JSON data only, a fresh copy
    return out


@lru_cache(maxsize=16)
def reads_variable(source: str, name: str) -> bool:
    """Whether the template reads the variable ``name`` (e.g. ``tools``) anywhere."""
    import jinja2.meta
    return name in jinja2.meta.find_undeclared_variables(compile_template(source).environment.parse(source))


def alias_reasoning(message: dict) -> dict:
    """A message's reasoning under every name templates read (``reasoning_content`` and ``thinking``)."""
    reasoning = next((message[k] for k in REASONING_FIELDS if message.get(k) is not None), None)
    return message if reasoning is None else {"thinking": reasoning, **message, "reasoning_content": reasoning}


def render_chat(source: str, messages, *, add_generation_prompt: bool = True, special_tokens: dict | None = None,
                tools: list | None = None, documents: list | None = None, **variables) -> str:
    """The prompt text for ``messages``; ``special_tokens`` (``{"bos_token": "<s>", ...}``) and
    ``variables`` become template variables. A template that fails (``raise_exception``, an undefined
    operation, a bound of the sandbox, deep recursion, any exception) is one PrunusError line carrying
    the template's own message."""
    template = compile_template(source)
    chat = [alias_reasoning(m) for m in check_messages(messages)]
    variables = {**(special_tokens or {}), **variables, "messages": chat, "tools": tools, "documents": documents,
                 "add_generation_prompt": add_generation_prompt}
    try:
        return render_bounded(template, variables)
    except jinja2.exceptions.TemplateError as e:
        detail = _line(e.message or type(e).__name__)
    except RecursionError:
        detail = "RecursionError: macros or loops nested too deep"
    except Exception as e:  # noqa: BLE001 (a template is code: whatever it raises is the template's failure)
        detail = _line(f"{type(e).__name__}: {e}")
    raise PrunusError(f"the chat template failed to render these messages: {detail}")


def _line(text, limit: int = 300) -> str:
    """A message from a template as one short line."""
    text = " ".join(str(text)[: 4 * limit].split())
    return text if len(text) <= limit else text[: limit - 3] + "..."
