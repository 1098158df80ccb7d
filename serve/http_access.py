"""Who may use the HTTP server: an API key, the ``Host`` a request names, the web page it comes from.

:class:`ServeAccess` holds the settings (``prunus serve`` makes one option of each field). The
server asks :meth:`ServeAccess.refusal` about every request before it reads a body:

* ``Host`` must name this server: the address it listens on with its port (``localhost``,
  ``127.0.0.1`` and ``[::1]`` too when that is a loopback address; any IP address when it listens on
  all of them), or a name given with ``--allowed-hosts``. A web page whose domain was re-pointed at
  this machine (DNS rebinding) names its own domain, and is refused (403).
* ``Origin`` (sent by browsers with every cross-origin request) must be one listed with
  ``--allowed-origins``; then, and only then, answers carry CORS headers for it and an ``OPTIONS``
  preflight is answered.
* With an API key (``--api-key`` or ``PRUNUS_API_KEY``), every route but the health probes (``GET /health``,
  ``/v2/health/live``, ``/v2/health/ready``) needs
  ``Authorization: Bearer KEY``, compared in constant time; otherwise 401 in OpenAI's shape
  (``code: invalid_api_key``).

The server also takes POST bodies only as ``Content-Type: application/json`` (415 otherwise), so a
plain HTML form or a ``text/plain`` fetch of another site (which need no preflight) cannot drive it.
"""

from __future__ import annotations

import hmac
import ipaddress
import re
from dataclasses import dataclass, field, fields

from prunus.artifacts.errors import PrunusError

LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")
WILDCARD_HOSTS = ("", "0.0.0.0", "::")
PREFLIGHT_MAX_AGE_S = 600
PUBLIC_PATHS = ("/health", "/v2/health/live", "/v2/health/ready")  # probes: no API key needed
_HOST_NAME = re.compile(r"^(\*|\[[0-9a-f:.]+\]|[a-z0-9_.-]+)(:\d{1,5})?$")
_ORIGIN = re.compile(r"^(\*|null|[a-z][a-z0-9+.-]*://(\[[0-9a-f:.]+\]|[a-z0-9_.-]+)(:\d{1,5})?)$")


@dataclass(frozen=True)
class ServeAccess:
    """The HTTP server's door; each field's ``metadata["help"]`` is its ``prunus serve`` option's help."""

    api_key: str | None = field(default=None, repr=False, metadata={
        "envvar": "PRUNUS_API_KEY",
        "help": "Require 'Authorization: Bearer KEY' on every route but the health probes (401 otherwise). Prefer the "
                "environment variable PRUNUS_API_KEY: a command line is visible to other users."})
    allowed_hosts: tuple[str, ...] = field(default=(), metadata={
        "help": "Host names (name or name:port, comma-separated or repeated; * for any) that requests may address "
                "besides the listening address, e.g. the name of a reverse proxy in front of the server."})
    allowed_origins: tuple[str, ...] = field(default=(), metadata={
        "help": "Web page origins (scheme://host[:port], comma-separated or repeated; * for any) whose browser "
                "requests are answered, with CORS headers. Default: none; requests with an Origin header get 403."})

    def __post_init__(self) -> None:
        key = self.api_key
        if key is not None and (not key or not key.isascii() or not key.isprintable() or " " in key):
            raise PrunusError("--api-key / PRUNUS_API_KEY must be a non-empty string of printable ASCII without "
                              "spaces; give another key or leave both unset")
        object.__setattr__(self, "allowed_hosts", _entries(self.allowed_hosts, _HOST_NAME, "--allowed-hosts",
                                                           "a host name, name:port or *"))
        object.__setattr__(self, "allowed_origins", _entries(self.allowed_origins, _ORIGIN, "--allowed-origins",
                                                             "scheme://host[:port] such as https://app.example.com, or *"))

    @classmethod
    def from_options(cls, **options) -> "ServeAccess":
        """From ``prunus serve``'s options: lists may come repeated, comma-separated, or both."""
        names = {f.name for f in fields(cls)}
        values = {}
        for name, value in options.items():
            if name not in names or value is None:
                continue
            if isinstance(value, (list, tuple)):
                value = tuple(part.strip() for v in value for part in str(v).split(",") if part.strip())
            values[name] = value
        return cls(**values)

    # --- the checks, in the order the server makes them -----------------------------------------------------

    def host_allowed(self, header: str | None, server_address) -> bool:
        """Whether a request's ``Host`` names this server (a request without one names nothing to refuse)."""
        if header is None or "*" in self.allowed_hosts:
            return header is None or _split_host(header) is not None
        parsed = _split_host(header)
        if parsed is None:
            return False
        name, port = parsed
        if name in self.allowed_hosts or f"{_bracket(name)}:{80 if port is None else port}" in self.allowed_hosts:
            return True
        bound, bound_port = str(server_address[0]).lower(), int(server_address[1])
        if (port if port is not None else 80) != bound_port:
            return False
        if bound in WILDCARD_HOSTS:
            return name in LOOPBACK_NAMES or _is_ip(name)
        return name == bound or (_is_loopback(bound) and name in LOOPBACK_NAMES)

    def origin_allowed(self, origin: str | None) -> bool:
        return origin is None or "*" in self.allowed_origins or origin.strip().lower().rstrip("/") in self.allowed_origins

    def key_accepted(self, authorization: str | None) -> bool:
        if self.api_key is None:
            return True
        scheme, _, token = (authorization or "").strip().partition(" ")
        given = token.strip().encode("latin-1", "replace")  # http.server decodes headers as latin-1
        return hmac.compare_digest(given, self.api_key.encode()) and scheme.lower() == "bearer"

    def refusal(self, method: str, path: str, headers, server_address) -> tuple[int, str, str] | None:
        """(status, message, code) for a request this door refuses, else None."""
        host, origin = headers.get("Host"), headers.get("Origin")
        if not self.host_allowed(host, server_address):
            return (403, f"Host {host[:100]!r} does not name this server; address it as "
                         f"{_bracket(str(server_address[0]))}:{server_address[1]}, or start prunus serve with "
                         "--allowed-hosts NAME for a name that points at it", "host_not_allowed")
        if not self.origin_allowed(origin):
            return (403, f"requests from the web origin {origin[:100]!r} are refused; start prunus serve with "
                         "--allowed-origins ORIGIN to answer that page", "origin_not_allowed")
        public = method == "OPTIONS" or (method in ("GET", "HEAD") and path in PUBLIC_PATHS)
        if not public and not self.key_accepted(headers.get("Authorization")):
            return (401, "missing or wrong API key; send the header 'Authorization: Bearer KEY' with the key "
                         "prunus serve was given (--api-key or PRUNUS_API_KEY)", "invalid_api_key")
        return None

    def cors_headers(self, origin: str | None) -> dict:
        """The CORS headers of an answer to a page of ``origin`` (none without an allowed Origin)."""
        if origin is None or not self.allowed_origins or not self.origin_allowed(origin):
            return {}
        return {"Access-Control-Allow-Origin": origin.strip(), "Vary": "Origin"}

    def preflight_headers(self, origin: str | None) -> dict:
        return {**self.cors_headers(origin), "Access-Control-Allow-Methods": "GET, POST, OPTIONS",
                "Access-Control-Allow-Headers": "Authorization, Content-Type",
                "Access-Control-Max-Age": str(PREFLIGHT_MAX_AGE_S)}


def is_json_content_type(header: str | None) -> bool:
    return (header or "").split(";", 1)[0].strip().lower() == "application/json"


def _entries(values, pattern: re.Pattern, option: str, expected: str) -> tuple[str, ...]:
    """The entries lower-cased, an origin without a trailing slash, a host as NAME or [V6]:PORT / NAME:PORT."""
    if isinstance(values, str):
        values = (values,)
    out = []
    for value in values:
        entry = str(value).strip().lower().rstrip("/")
        if not pattern.match(entry):
            raise PrunusError(f"{option} {str(value)[:100]!r} is not {expected}; fix the value")
        if pattern is _HOST_NAME and entry != "*":
            name, port = _split_host(entry)
            entry = name if port is None else f"{_bracket(name)}:{port}"
        out.append(entry)
    return tuple(out)


def _split_host(value: str) -> tuple[str, int | None] | None:
    """(name, port or None) of a Host header, lower-case, without brackets or a trailing dot; None if malformed."""
    value = value.strip().lower()
    if not _HOST_NAME.match(value) or value == "*":
        return None
    name, port = value, None
    if value.startswith("["):
        name, _, rest = value[1:].partition("]")
        port = int(rest[1:]) if rest else None
    elif ":" in value:
        name, _, digits = value.rpartition(":")
        port = int(digits)
    return name.rstrip("."), port


def _bracket(name: str) -> str:
    return f"[{name}]" if ":" in name else name


def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
        return True
    except ValueError:
        return False


def _is_loopback(name: str) -> bool:
    if name == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False
