"""Malformed request bodies and the shape of every error answer.

* :func:`parse_json_body`: a request body as JSON, refused with 400 when it is not UTF-8, not
  JSON, nested deeper than :data:`MAX_JSON_DEPTH`, holds a lone surrogate (which no tokenizer can
  encode), NaN, or an integer beyond 64 bits (``seed`` must fit torch's generator).
* :class:`BadRequest`: an error answer (status, one line, OpenAI's ``type``, ``param`` and ``code``);
  :func:`error_json` writes it in OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``.

The connection-level guards (the connection cap, the header deadline, malformed HTTP) are in
:mod:`prunus.serve.http_connection`; the request-level ones (the door, methods, media type, body size and
deadline) in :mod:`prunus.serve.asgi_guard`.
"""

from __future__ import annotations

import json

MAX_JSON_DEPTH = 32
INT_LIMIT = 1 << 64
SEED_RANGE = (-(1 << 63), 1 << 64)  # what torch.Generator.manual_seed accepts


class BadRequest(Exception):
    """An HTTP error answer: status, one-line message, OpenAI error type, the field it names and a code."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.kind, self.param, self.code, self.headers = status, kind, param, code, headers or {}

    def body(self) -> bytes:
        return error_json(str(self), self.kind, self.param, self.code)


def error_json(message: str, kind: str, param: str | None = None, code: str | None = None) -> bytes:
    return json.dumps({"error": {"message": message, "type": kind, "param": param, "code": code}}).encode()


def _reject_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


def _walk(obj) -> None:
    """Depth, strings and integers of a parsed body, without recursion."""
    stack = [(obj, 1, None)]
    while stack:
        value, depth, key = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise BadRequest(400, f"the request body is nested deeper than {MAX_JSON_DEPTH} levels")
        if isinstance(value, dict):
            for k, v in value.items():
                _check_str(k, k)
                stack.append((v, depth + 1, k if depth == 1 else key))
        elif isinstance(value, list):
            stack.extend((v, depth + 1, key) for v in value)
        elif isinstance(value, str):
            _check_str(value, key)
        elif isinstance(value, int) and not isinstance(value, bool) and abs(value) >= INT_LIMIT:
            raise BadRequest(400, f"'{key}' holds an integer beyond 64 bits", param=key)


def _check_str(text: str, key) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise BadRequest(400, f"'{key}' holds a lone surrogate (\\u{ord(text[e.start]):04x}), which is not text; "
                         "send valid UTF-16 pairs", param=key if isinstance(key, str) else None) from None


def parse_json_body(body: bytes):
    """The parsed body, or BadRequest(400) for a body no route should see (see the module docstring)."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as e:
        raise BadRequest(400, f"the request body is not UTF-8 (byte {e.start})") from None
    try:
        req = json.loads(text, parse_constant=_reject_constant)
    except json.JSONDecodeError as e:
        raise BadRequest(400, f"the request body is not valid JSON ({e.msg} at line {e.lineno} column {e.colno})") from None
    except RecursionError:
        raise BadRequest(400, f"the request body is nested deeper than {MAX_JSON_DEPTH} levels") from None
    except ValueError as e:  # NaN / Infinity, or an integer of more digits than Python converts
        raise BadRequest(400, f"the request body is not valid JSON ({str(e).splitlines()[0][:80]})") from None
    _walk(req)
    if isinstance(req, dict):
        seed = req.get("seed")
        if isinstance(seed, int) and not isinstance(seed, bool) and not SEED_RANGE[0] <= seed < SEED_RANGE[1]:
            raise BadRequest(400, "'seed' must be an integer from -2**63 to 2**64 - 1", param="seed")
    return req
