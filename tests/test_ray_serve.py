"""prunus serve --replicas on Ray Serve: one local Ray cluster on 127.0.0.1 for the whole file (starting it takes
tens of seconds on 2 cores), two replicas of a tiny random model behind one address. Greedy tokens equal the
one-process server's; a repeated prompt start goes to one replica (the prefix-aware router); the API key and Host
guards answer as on one process, /metrics too; /metrics holds every replica's registry, labelled; killing a
replica under load loses no request (each ends answered or with a one-line error) and Ray Serve starts another; a
LoRA adapter's requests (Ray Serve's multiplexing) give the one-process tokens and stay where it is loaded; a generic
module answers the Open Inference Protocol from replicas. The prefix tree, the settings and the CLI's one-line refusals are checked without Ray."""

from __future__ import annotations

import http.client
import json
import os
import re
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from prunus.cli.main import cli
from prunus.models import Transformer, get_preset, save_model
from prunus.serve.ray_prefix_tree import PrefixTree
from prunus.serve.ray_settings import RaySettings

sys.path.insert(0, str(Path(__file__).parent))
from test_serve_lora import write_adapter  # noqa: E402

pytestmark = pytest.mark.slow  # starts a Ray cluster
KEY = "test-key-123"
AUTH = {"Authorization": f"Bearer {KEY}"}
LOAD = {"backend": "torch", "max_batch": 4, "max_queue": 16, "compile": False, "threads": 1, "prefix_cache_mb": 8}
SYSTEM = "You are a careful assistant for Python code. Answer briefly and never invent APIs. " * 2
PROMPTS = ["def f(x):", "import os\n", "class A:\n    def ", "for i in range(", "x = {"]


# --- without Ray ---------------------------------------------------------------------------------------------

def test_prefix_tree_matches_the_longest_start_and_forgets_a_tenant():
    tree = PrefixTree(block=4)
    tree.insert("abcdefghijkl", "r1")
    tree.insert("abcdXXXX", "r2")
    assert tree.match("abcdefgh-rest", ["r1", "r2"]) == (8, ["r1"])
    assert tree.match("abcdYYYY", ["r1", "r2"]) == (4, ["r1", "r2"])
    assert tree.match("abcdefgh", ["r2"]) == (4, ["r2"])  # only the candidates given count
    assert tree.match("zzzz", ["r1", "r2"]) == (0, [])
    assert tree.smallest(["r1", "r2", "r3"]) == ["r3"]
    tree.remove_tenant("r1")
    assert tree.match("abcdefgh", ["r1", "r2"]) == (4, ["r2"])
    small = PrefixTree(block=4, max_nodes=3)
    small.insert("aaaabbbbccccdddd", "r1")
    assert len(small.nodes) == 3 and small.match("aaaabbbb", ["r1"]) == (8, ["r1"])  # the deepest went first


def test_settings_are_checked_in_one_line():
    assert not RaySettings().active and RaySettings(replicas=2).initial == 2
    s = RaySettings(replicas=2, min_replicas=1, max_replicas=4)
    assert s.autoscaling and (s.lowest, s.initial, s.highest) == (1, 2, 4)
    for bad, needle in [({"replicas": 0}, "--replicas 0"), ({"replicas": 3, "max_replicas": 2}, "rise"),
                        ({"replicas": 1, "replica_cpus": 0}, "--replica-cpus"), ({"router": "x"}, "--router")]:
        with pytest.raises(Exception, match=needle):
            RaySettings(**bad)


def test_cli_refuses_ray_options_in_one_line(tmp_path, assert_user_error, monkeypatch):
    runner = CliRunner()
    result = runner.invoke(cli, ["serve", str(tmp_path), "--max-replicas", "3"])
    assert_user_error(result, "--max-replicas applies to replicas on Ray Serve")
    result = runner.invoke(cli, ["serve", str(tmp_path), "--replicas", "2", "--print-k8s"])
    assert_user_error(result, "--print-k8s")
    result = runner.invoke(cli, ["serve", str(tmp_path), "--replicas", "2", "--tp", "2"])
    assert_user_error(result, "drop --tp")
    result = runner.invoke(cli, ["serve", str(tmp_path), "--replicas", "2", "--device-map", "auto"])
    assert_user_error(result, "drop --device-map")
    result = runner.invoke(cli, ["serve", str(tmp_path), "--replicas", "4", "--replica-cpus", "2", "--ray-cpus", "4"])
    assert_user_error(result, "4 replicas of 2 CPUs need 8 CPUs and --ray-cpus gives 4")
    result = runner.invoke(cli, ["serve", str(tmp_path), "--ray-address", "127.0.0.1:1", "--ray-cpus", "4"])
    assert_user_error(result, "drop --ray-cpus")
    monkeypatch.setitem(sys.modules, "ray", None)  # as if the extra were not installed
    result = runner.invoke(cli, ["serve", str(tmp_path), "--replicas", "2"])
    assert_user_error(result, "prunus[ray]")


# --- one Ray cluster for the rest ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    torch.manual_seed(0)
    model = Transformer(get_preset("tiny").replace(max_seq_len=512))
    model.init_weights()
    return save_model(model.eval(), tmp_path_factory.mktemp("ray") / "model", stage="test")


@pytest.fixture(scope="module")
def adapters(model_dir):
    """Two LoRA adapter dirs (PEFT's format) over the model: {name: dir}."""
    from prunus.models import load_model

    model = load_model(model_dir)
    write_adapter(model, model_dir.parent / "a", 4, 8.0, ("attention.wq", "attention.wv"), 1)
    write_adapter(model, model_dir.parent / "b", 2, 4.0, ("attention.wq", "feed_forward.w2"), 2)
    return {"a": str(model_dir.parent / "a"), "b": str(model_dir.parent / "b")}


@pytest.fixture(scope="module")
def app(model_dir, adapters):
    """The URL of 2 replicas (0.5 CPU each, the prefix router, an API key, two LoRA adapters of which a replica
    holds one at a time) on a local cluster of 2 CPUs."""
    pytest.importorskip("ray.serve", reason="the ray extra is not installed (pip install 'prunus[ray]')")
    os.environ["RAY_NODE_IP_ADDRESS"] = "127.0.0.1"
    from prunus.serve.http_access import ServeAccess
    from prunus.serve.ray_deployment import deploy, stop

    url = deploy(model_dir, {**LOAD, "lora": adapters}, {"access": ServeAccess(api_key=KEY), "shutdown_grace": 2.0},
                 RaySettings(replicas=2, replica_cpus=0.5, ray_cpus=2, adapters_per_replica=1), port=0)
    yield url
    stop()


def _call(url: str, method: str, path: str, body=None, headers=None, timeout=60.0):
    host, port = re.match(r"http://([^:]+):(\d+)", url).groups()
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout)
    data = None if body is None else json.dumps(body).encode()
    conn.request(method, path, data, {**({"Content-Type": "application/json"} if data else {}), **(headers or {})})
    resp = conn.getresponse()
    raw = resp.read().decode()
    conn.close()
    return resp.status, raw


def _complete(url: str, prompt: str, n: int = 8, **more) -> tuple[int, str]:
    return _call(url, "POST", "/v1/completions", {"model": "model", "prompt": prompt, "max_tokens": n,
                                                  "temperature": 0, **more}, AUTH)


def _replica_counts(url: str) -> dict[str, float]:
    """{replica: POST answers 200} from the aggregated /metrics, once every replica has pushed its registry."""
    time.sleep(1.2)  # a replica pushes its registry every 0.5 s
    status, text = _call(url, "GET", "/metrics", headers=AUTH)
    assert status == 200, text
    return {m.group(1): float(m.group(2)) for m in
            re.finditer(r'prunus_requests_total\{replica="([^"]+)",status="200"\} ([0-9.]+)', text)}


@pytest.fixture(scope="module")
def one_process(model_dir, adapters):
    """The URL of the one-process server of the same model, options and adapters."""
    from prunus.serve import Engine
    from prunus.serve.http_server import CompletionServer

    with Engine.load(model_dir, **{**LOAD, "lora": adapters}) as engine:
        server = CompletionServer(engine, "127.0.0.1", 0)
        threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        yield "http://%s:%d" % tuple(server.server_address[:2])
        server.shutdown()
        server.server_close()


def _text(url: str, model: str, prompt: str, n: int, headers=None) -> str:
    status, raw = _call(url, "POST", "/v1/completions", {"model": model, "prompt": prompt, "max_tokens": n,
                                                         "temperature": 0}, headers)
    assert status == 200, raw
    return json.loads(raw)["choices"][0]["text"]


def test_replicas_give_the_one_process_servers_greedy_tokens(app, one_process):
    for prompt in PROMPTS:
        assert _text(app, "model", prompt, 12, AUTH) == _text(one_process, "model", prompt, 12)
    status, raw = _call(app, "POST", "/v1/completions", {"model": "model", "prompt": PROMPTS[0], "max_tokens": 4,
                                                         "temperature": 0, "stream": True}, AUTH)
    assert status == 200 and raw.rstrip().endswith("data: [DONE]")
    status, raw = _call(app, "GET", "/v1/models", headers=AUTH)
    assert status == 200 and json.loads(raw)["data"][0]["id"] == "model"


def test_openais_own_client_is_answered_by_the_replicas(app, one_process):
    """OpenAI's Python client against the replicas: the same greedy text as the one-process server."""
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=app + "/v1", api_key=KEY, max_retries=0, timeout=60)
    answer = client.completions.create(model="model", prompt=PROMPTS[1], max_tokens=8, temperature=0)
    assert answer.choices[0].text == _text(one_process, "model", PROMPTS[1], 8)
    chunks = client.completions.create(model="model", prompt=PROMPTS[1], max_tokens=8, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == answer.choices[0].text


def test_a_repeated_prompt_start_goes_to_one_replica(app):
    before = _replica_counts(app)
    for i in range(6):
        status, raw = _complete(app, SYSTEM + f"Question {i}: what is {i} + {i}?", 2)
        assert status == 200, raw
    after = _replica_counts(app)
    gained = sorted(after.get(r, 0) - before.get(r, 0) for r in after)
    assert len(after) == 2 and gained == [0, 6], (before, after)


def test_an_adapters_requests_go_where_it_is_loaded_with_its_tokens(app, one_process, adapters):
    for name in adapters:
        assert _text(app, name, PROMPTS[0], 6, AUTH) == _text(one_process, name, PROMPTS[0], 6)
    time.sleep(2)  # the replicas report which adapters they hold
    before = _replica_counts(app)
    for prompt in PROMPTS[1:]:
        status, raw = _call(app, "POST", "/v1/completions", {"model": "a", "prompt": prompt, "max_tokens": 2}, AUTH)
        assert status == 200, raw
    after = _replica_counts(app)
    assert sorted(after[r] - before.get(r, 0) for r in after) == [0, len(PROMPTS) - 1], (before, after)


def test_the_guards_answer_as_on_one_process(app):
    status, raw = _call(app, "POST", "/v1/completions", {"model": "model", "prompt": "x", "max_tokens": 1})
    assert status == 401 and json.loads(raw)["error"]["code"] == "invalid_api_key"
    assert _call(app, "GET", "/metrics")[0] == 401
    assert _call(app, "GET", "/health")[0] == 200  # the probe needs no key
    status, raw = _call(app, "GET", "/v1/models", headers={**AUTH, "Host": "evil.example.com"})
    assert status == 403 and json.loads(raw)["error"]["code"] == "host_not_allowed"
    assert _call(app, "GET", "/metrics", headers={**AUTH, "Host": "evil.example.com"})[0] == 403
    status, raw = _complete(app, "x", n=100_000)
    assert status == 400 and "\n" not in json.loads(raw)["error"]["message"]
    status, raw = _call(app, "POST", "/v1/completions", {"model": "model", "prompt": "x" * (1 << 20)}, AUTH)
    assert status == 413 and "larger than" in json.loads(raw)["error"]["message"]  # the ingress's body limit


def _tokens_made(url: str) -> float:
    time.sleep(1.2)  # a replica pushes its registry every 0.5 s
    text = _call(url, "GET", "/metrics", headers=AUTH)[1]
    return sum(float(v) for v in re.findall(r'prunus_tokens_generated_total\{replica="[^"]+"\} ([0-9.e+]+)', text))


def test_a_client_leaving_a_stream_cancels_it_on_the_replica(app):
    host, port = re.match(r"http://([^:]+):(\d+)", app).groups()
    before = _tokens_made(app)
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    body = {"model": "model", "prompt": "x", "max_tokens": 480, "min_tokens": 480, "temperature": 0, "stream": True}
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json", **AUTH})
    resp = conn.getresponse()
    assert resp.status == 200 and resp.readline().startswith(b"data: ")
    conn.sock.shutdown(2)  # the client leaves after its first event
    conn.close()
    time.sleep(3)
    made = _tokens_made(app) - before
    print(f"a stream left after its first event: {made:g} of its 480 tokens made")
    assert 0 < made < 400, made  # the rest were never made


def test_metrics_hold_every_replica_labelled(app):
    before = sum(_replica_counts(app).values())
    for prompt in PROMPTS:
        assert _complete(app, prompt, 2)[0] == 200
    counts = _replica_counts(app)
    status, text = _call(app, "GET", "/metrics", headers=AUTH)
    assert len(counts) == 2 and sum(counts.values()) == before + len(PROMPTS)
    assert len(set(re.findall(r'prunus_tokens_generated_total\{replica="([^"]+)"\}', text))) == 2
    assert text.count("# TYPE prunus_requests_total counter") == 1  # one family, samples of both replicas
    assert "prunus_prefix_cache_hits_total{replica=" in text


def _client(url: str, stream: bool, until: float, tally: dict, lock: threading.Lock) -> None:
    """Requests in a loop until ``until``; each ends answered, failed (a 5xx with one line, or a stream's error
    event) or lost (no answer within the client's timeout, or a broken connection)."""
    while time.monotonic() < until:
        try:
            status, raw = _complete(url, SYSTEM + "go", 16, stream=stream) if stream else \
                _complete(url, "def g(y):", 16)
            if status == 200 and not ('"error"' in raw and stream):
                kind = "answered"
            elif (status >= 500 and len(raw.splitlines()) == 1) or (stream and '"replica_failed"' in raw):
                kind = "failed"
            else:
                kind = f"other {status}: {raw[:200]}"
        except (OSError, http.client.HTTPException) as e:
            kind = f"lost ({type(e).__name__})"
        with lock:
            tally[kind] = tally.get(kind, 0) + 1


def test_a_killed_replica_loses_no_request_and_is_replaced(app):
    import ray
    from ray import serve

    tally, lock, until = {}, threading.Lock(), time.monotonic() + 8
    clients = [threading.Thread(target=_client, args=(app, i % 2 == 0, until, tally, lock)) for i in range(6)]
    [c.start() for c in clients]
    time.sleep(2)
    name = next(n["name"] for n in ray.util.list_named_actors(all_namespaces=True)
                if n["name"].startswith("SERVE_REPLICA::prunus#PrunusReplica"))
    ray.kill(ray.get_actor(name, namespace="serve"), no_restart=True)
    [c.join(timeout=120) for c in clients]
    assert not any(c.is_alive() for c in clients), "a client hung"
    answered, failed = tally.pop("answered", 0), tally.pop("failed", 0)
    lost = sum(tally.values())
    print(f"killed {name}: answered {answered}, failed {failed}, lost {lost} {tally}")
    assert lost == 0 and answered > 0, tally
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        replicas = serve.status().applications["prunus"].deployments["PrunusReplica"].replica_states
        if replicas.get("RUNNING", 0) == 2:
            break
        time.sleep(1)
    assert replicas.get("RUNNING", 0) == 2, replicas
    assert all(_complete(app, p, 2)[0] == 200 for p in PROMPTS)


def test_a_generic_module_answers_the_open_inference_protocol_from_replicas(app, tmp_path, monkeypatch):
    """Last: the application is replaced by one serving a generic module (its factory trusted; the replicas import
    it from the current directory, as prunus serve --trust-factory does)."""
    import numpy as np
    from ray import serve

    from prunus.models.module_dir import save_module
    from prunus.models.module_factory import build_module
    from prunus.serve import Engine
    from prunus.serve.ray_deployment import APP_NAME, deploy

    factory = "test_serve_predict:tiny"
    monkeypatch.chdir(Path(__file__).parent)
    torch.manual_seed(0)
    save_module(build_module(factory, {}), tmp_path / "gm", stage="test", task="regression",
                input={"shape": [6], "dtype": "float32"})
    x = np.arange(12, dtype=np.float32).reshape(2, 6) / 10
    with Engine.load(tmp_path / "gm", trust_factory=factory, threads=1) as engine:
        want = engine.predict(x)
    serve.delete(APP_NAME)
    url = deploy(tmp_path / "gm", {"trust_factory": factory, "threads": 1, "max_batch": 8}, {},
                 RaySettings(replicas=2, replica_cpus=0.5, ray_cpus=2), port=int(app.rsplit(":", 1)[1]))
    body = {"inputs": [{"name": "input", "shape": [2, 6], "datatype": "FP32", "data": x.reshape(-1).tolist()}]}
    status, raw = _call(url, "POST", "/v2/models/gm/infer", body)
    assert status == 200, raw
    assert np.array_equal(np.array(json.loads(raw)["outputs"][0]["data"], dtype=np.float32), want.reshape(-1))
    status, raw = _call(url, "POST", "/v2/models/other/infer", body)
    assert status == 404 and list(json.loads(raw)) == ["error"] and "'gm'" in json.loads(raw)["error"]
    assert _call(url, "GET", "/v2/health/ready")[0] == 200


def test_replicas_that_cannot_load_are_one_line_naming_why(app, tmp_path):
    from ray import serve

    from prunus.artifacts.errors import PrunusError
    from prunus.serve.ray_deployment import APP_NAME, deploy

    serve.delete(APP_NAME)
    with pytest.raises(PrunusError, match=r"did not start: .*no config\.json") as info:
        deploy(tmp_path, {}, {}, RaySettings(replicas=1, replica_cpus=0.5), port=int(app.rsplit(":", 1)[1]))
    assert "\n" not in str(info.value)
