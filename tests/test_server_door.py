"""The HTTP server's door (prunus.serve.http_access), against a real server on 127.0.0.1: an API key on every
route but /health (401 in OpenAI's shape, Bearer, constant-time), Host naming this server (DNS rebinding gets
403), Origin only from --allowed-origins (CORS headers and preflight for those alone), POST bodies only as
application/json (415); prunus serve's options and PRUNUS_API_KEY; stale tensor-parallel temporaries."""

from __future__ import annotations

import http.client
import json
import os
import subprocess
import sys
import threading

import pytest
import torch
from click.testing import CliRunner

from prunus.artifacts.pids import pid_prefix, remove_stale
from prunus.cli.main import cli
from prunus.models import Transformer, get_preset, save_model
from prunus.serve import Engine
from prunus.serve import http_access
from prunus.serve.http_access import ServeAccess
from prunus.serve.http_server import CompletionServer

BODY = json.dumps({"model": "model", "prompt": "x", "max_tokens": 1, "temperature": 0})  # the served dir's name
JSON = {"Content-Type": "application/json"}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    torch.manual_seed(0)
    model = Transformer(get_preset("tiny"))
    model.init_weights()
    return save_model(model.eval(), tmp_path_factory.mktemp("door") / "model", stage="test")


@pytest.fixture(scope="module")
def engine(model_dir):
    with Engine.load(model_dir, max_batch=2, threads=1) as engine:
        yield engine


@pytest.fixture
def serve(engine):
    """serve(access) -> a running server with that door; all are stopped at the end of the test."""
    servers = []

    def start(access: ServeAccess | None = None) -> CompletionServer:
        server = CompletionServer(engine, port=0, access=access)
        threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        servers.append(server)
        return server
    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


def ask(server, method: str, path: str, headers: dict | None = None, body: str | None = None, conn=None):
    """(status, headers, JSON body or None) of one request; ``conn`` keeps a connection across calls."""
    conn = conn or http.client.HTTPConnection(*server.server_address[:2], timeout=30)
    conn.request(method, path, body=body, headers=headers or {})
    resp = conn.getresponse()
    data = resp.read()
    head = {k.lower(): v for k, v in resp.getheaders()}
    return resp.status, head, json.loads(data) if data and head.get("content-type") == "application/json" else data.decode()


def test_api_key_on_every_route_but_health(serve, monkeypatch):
    compared = []
    real = http_access.hmac.compare_digest
    monkeypatch.setattr(http_access.hmac, "compare_digest", lambda a, b: compared.append(1) or real(a, b))
    server = serve(ServeAccess(api_key="s3cret-key"))
    good = {**JSON, "Authorization": "Bearer s3cret-key"}
    assert ask(server, "GET", "/health")[0] == 200  # a load balancer's probe needs no key
    for headers in (JSON, {**JSON, "Authorization": "Bearer wrong"}, {**JSON, "Authorization": "Basic s3cret-key"},
                    {**JSON, "Authorization": "Bearer s3cret-key-and-more"}):
        for method, path, body in (("POST", "/v1/completions", BODY), ("POST", "/v1/chat/completions", BODY),
                                   ("GET", "/metrics", None), ("GET", "/nowhere", None)):
            status, head, error = ask(server, method, path, headers, body)
            assert status == 401 and head["www-authenticate"] == "Bearer", (method, path, headers)
            assert error["error"]["type"] == "invalid_request_error" and error["error"]["code"] == "invalid_api_key"
            assert set(error["error"]) == {"message", "type", "param", "code"} and error["error"]["param"] is None
            assert "Authorization: Bearer" in error["error"]["message"] and "s3cret" not in error["error"]["message"]
    assert compared  # the key is compared in constant time
    status, _, answer = ask(server, "POST", "/v1/completions", good, BODY)
    assert status == 200 and answer["choices"][0]["finish_reason"] in ("length", "stop")
    assert ask(server, "GET", "/metrics", good)[0] == 200
    assert ask(server, "GET", "/nowhere", good)[0] == 404


def test_host_must_name_this_server(serve):
    server = serve()
    port = server.server_address[1]
    for host in (f"127.0.0.1:{port}", f"localhost:{port}", f"[::1]:{port}", f"LOCALHOST.:{port}"):
        assert ask(server, "GET", "/health", {"Host": host})[0] == 200, host
    for host in (f"evil.example:{port}", "evil.example", f"127.0.0.1:{port + 1}", "127.0.0.1", "a b"):
        status, head, error = ask(server, "POST", "/v1/completions", {**JSON, "Host": host}, BODY)
        assert status == 403 and error["error"]["code"] == "host_not_allowed", host
        assert "--allowed-hosts" in error["error"]["message"] and "access-control-allow-origin" not in head
    proxied = serve(ServeAccess(allowed_hosts=("api.example.com", "[::1]:9000")))
    assert ask(proxied, "POST", "/v1/completions", {**JSON, "Host": "api.example.com"}, BODY)[0] == 200
    assert ask(proxied, "GET", "/health", {"Host": "[::1]:9000"})[0] == 200
    assert ask(proxied, "GET", "/health", {"Host": "[::1]:9001"})[0] == 403


def test_cross_origin_requests_and_cors(serve):
    server = serve()  # no --allowed-origins: no web page may use it, and no CORS header is ever sent
    page = {**JSON, "Origin": "https://evil.example"}
    status, head, error = ask(server, "POST", "/v1/completions", page, BODY)
    assert status == 403 and error["error"]["code"] == "origin_not_allowed" and "--allowed-origins" in error["error"]["message"]
    assert not [k for k in head if k.startswith("access-control")]
    preflight = {"Origin": "https://evil.example", "Access-Control-Request-Method": "POST"}
    assert ask(server, "OPTIONS", "/v1/completions", preflight)[0] == 403
    assert ask(server, "OPTIONS", "/v1/completions")[0] == 405
    status, head, _ = ask(server, "POST", "/v1/completions", JSON, BODY)
    assert status == 200 and not [k for k in head if k.startswith("access-control")]

    app = "https://app.example.com"
    allowed = serve(ServeAccess(allowed_origins=(app + "/",), api_key="k"))
    status, head, _ = ask(allowed, "OPTIONS", "/v1/chat/completions",  # a preflight carries no key
                          {"Origin": app, "Access-Control-Request-Method": "POST",
                           "Access-Control-Request-Headers": "authorization, content-type"})
    assert status == 204 and head["access-control-allow-origin"] == app and head["vary"] == "Origin"
    assert "POST" in head["access-control-allow-methods"]
    assert {"authorization", "content-type"} <= {h.strip().lower() for h in head["access-control-allow-headers"].split(",")}
    status, head, _ = ask(allowed, "POST", "/v1/completions", {**JSON, "Origin": app, "Authorization": "Bearer k"}, BODY)
    assert status == 200 and head["access-control-allow-origin"] == app
    status, head, _ = ask(allowed, "POST", "/v1/completions", {**JSON, "Origin": app}, BODY)  # errors carry it too
    assert status == 401 and head["access-control-allow-origin"] == app
    assert ask(allowed, "POST", "/v1/completions", {**JSON, "Origin": "https://other.example",
                                                     "Authorization": "Bearer k"}, BODY)[0] == 403


def test_post_bodies_must_be_json(serve):
    server = serve()
    conn = http.client.HTTPConnection(*server.server_address[:2], timeout=30)
    for headers in ({"Content-Type": "text/plain"}, {"Content-Type": "application/x-www-form-urlencoded"},
                    {"Content-Type": "multipart/form-data; boundary=x"}, {}):
        status, _, error = ask(server, "POST", "/v1/completions", headers, BODY, conn=conn)
        assert status == 415 and error["error"]["code"] == "unsupported_media_type", headers
        assert "application/json" in error["error"]["message"]
    # the refused bodies were read off: the same connection goes on serving
    assert ask(server, "POST", "/v1/completions", {"Content-Type": "application/json; charset=utf-8"}, BODY,
               conn=conn)[0] == 200
    assert ask(server, "POST", "/nowhere", {"Content-Type": "text/plain"}, BODY, conn=conn)[0] == 404
    status, _, metrics = ask(server, "GET", "/metrics", conn=conn)
    assert status == 200 and 'prunus_requests_total{status="415"} 4' in metrics


def test_serve_cli_access_options(model_dir, monkeypatch, assert_user_error):
    runner = CliRunner()
    args = ["serve", str(model_dir), "--port", "0"]
    assert_user_error(runner.invoke(cli, args, env={"PRUNUS_API_KEY": "has space"}), "PRUNUS_API_KEY")
    assert_user_error(runner.invoke(cli, [*args, "--allowed-origins", "app.example.com"]), "--allowed-origins",
                      "app.example.com", "scheme://host")
    assert_user_error(runner.invoke(cli, [*args, "--allowed-hosts", "http://x"]), "--allowed-hosts", "http://x")
    seen = []

    def record(self, poll_interval=0.5):  # the server the command built, then Ctrl-C
        seen.append(self.access)
        raise KeyboardInterrupt
    monkeypatch.setattr(CompletionServer, "serve_forever", record)
    r = runner.invoke(cli, [*args, "--allowed-hosts", "a.example,b.example:81", "--allowed-hosts", "c.example",
                            "--allowed-origins", "https://app.example.com"], env={"PRUNUS_API_KEY": "k3y"})
    assert r.exit_code == 0, r.output
    assert seen == [ServeAccess(api_key="k3y", allowed_hosts=("a.example", "b.example:81", "c.example"),
                                allowed_origins=("https://app.example.com",))]
    assert "k3y" not in repr(seen[0]) and "k3y" not in r.output
    r = runner.invoke(cli, [*args, "--host", "0.0.0.0"], env={"PRUNUS_API_KEY": None})
    assert r.exit_code == 0 and "no --api-key" in r.stderr and seen[-1].api_key is None


def test_stale_tp_temporaries_are_removed(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    mine = tmp_path / f"{pid_prefix('prunus-tp-')}abc"
    stale = [tmp_path / f"prunus-tp-{dead.pid}-x1y2", tmp_path / f"prunus-tp-{dead.pid}-shm"]
    others = [tmp_path / "prunus-tp-k2j3h4_x", tmp_path / f"prunus-distill-{dead.pid}-a", mine]
    stale[0].mkdir()
    (stale[0] / "sock").write_text("")
    stale[1].write_bytes(b"\0" * 8)
    for path in others:
        path.mkdir()
    assert sorted(remove_stale(tmp_path, "prunus-tp-")) == sorted(stale)
    assert not any(p.exists() for p in stale) and all(p.exists() for p in others)
    assert mine.name.startswith(f"prunus-tp-{os.getpid()}-")
