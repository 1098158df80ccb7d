"""prunus serve PATH --print-k8s: the manifests checked against the Kubernetes client's models (pydantic, unknown
fields forbidden, strict types) and the InferenceService against KServe's CRD schema (a cut of it in
tests/fixtures); parsed back as YAML, the container runs prunus serve with the options given. No cluster runs."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import pydantic
import pytest
import torch
import yaml
from click.testing import CliRunner

from prunus.cli.main import cli
from prunus.models import Transformer, get_preset
from prunus.models.model_dir import save_model
from prunus.models.module_dir import save_module
from prunus.models.module_factory import build_module
from prunus.serve.k8s_manifests import K8sSettings, check_label, label_from, resources

k8s = pytest.importorskip("kubernetes.client")
KSERVE = json.loads((Path(__file__).parent / "fixtures" / "kserve_inferenceservice_v1beta1.json").read_text())
MODELS = {("apps/v1", "Deployment"): k8s.V1Deployment, ("v1", "Service"): k8s.V1Service,
          ("autoscaling/v2", "HorizontalPodAutoscaler"): k8s.V2HorizontalPodAutoscaler}


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("k8s")
    torch.manual_seed(0)
    model = Transformer(get_preset("tiny"))
    model.init_weights()
    save_model(model, tmp / "Tiny_Chat.v2", stage="test")
    save_module(build_module("torch.nn:Linear", {"in_features": 4, "out_features": 2}), tmp / "lin", stage="test",
                task="regression", input={"shape": [4], "dtype": "float32"})
    return tmp / "Tiny_Chat.v2", tmp / "lin"


def _run(*args):
    return CliRunner().invoke(cli, ["serve", *map(str, args)])


def _docs(*args) -> list[dict]:
    result = _run(*args)
    assert result.exit_code == 0, result.output
    return list(yaml.safe_load_all(result.stdout))


def check_k8s(obj: dict) -> None:
    """A core object through the client's model: unknown fields and wrong types fail, nothing is dropped."""
    model = MODELS[obj["apiVersion"], obj["kind"]]
    client = k8s.ApiClient()
    assert client.sanitize_for_serialization(model.model_validate(obj, strict=True)) == obj
    read = client.deserialize(json.dumps(obj), model.__name__, "application/json")  # as from the API server
    assert client.sanitize_for_serialization(read) == obj


def _same(model, obj: dict) -> bool:
    return k8s.ApiClient().sanitize_for_serialization(model.model_validate(obj, strict=True)) == obj


def check_schema(value, schema: dict, where: str = "") -> None:
    """``value`` against a CRD's structural OpenAPI v3 schema: a field the schema lacks, a missing required field,
    a wrong type or a value outside an enum fails."""
    if schema.get("x-kubernetes-int-or-string") or "anyOf" in schema:
        assert isinstance(value, (int, str)) and not isinstance(value, bool), where
        return
    kind = schema.get("type")
    if kind == "object":
        assert isinstance(value, dict), where
        assert not set(schema.get("required", ())) - set(value), (where, schema["required"])
        props, extra = schema.get("properties"), schema.get("additionalProperties")
        if props is None and schema.get("x-kubernetes-preserve-unknown-fields"):
            return
        for key, item in value.items():
            sub = (props or {}).get(key, extra)
            assert isinstance(sub, dict), f"{where}.{key}: not in the schema"
            check_schema(item, sub, f"{where}.{key}")
    elif kind == "array":
        assert isinstance(value, list), where
        for i, item in enumerate(value):
            check_schema(item, schema["items"], f"{where}[{i}]")
    else:
        types = {"string": str, "integer": int, "boolean": bool, "number": (int, float)}
        assert isinstance(value, types[kind]) and (kind == "boolean" or not isinstance(value, bool)), where
        if schema.get("format") == "int32":
            assert -2**31 <= value < 2**31, where
        assert value in schema.get("enum", [value]), where


def _container(obj: dict) -> dict:
    spec = obj["spec"]["predictor"] if obj["kind"] == "InferenceService" else obj["spec"]["template"]["spec"]
    (container,) = spec["containers"]
    return container


def test_a_generative_model_is_a_deployment_a_service_and_an_autoscaler_the_client_accepts(dirs):
    docs = _docs(dirs[0], "--print-k8s", "--k8s-replicas", 2, "--k8s-max-replicas", 6, "--k8s-namespace", "ml")
    assert [d["kind"] for d in docs] == ["Deployment", "Service", "HorizontalPodAutoscaler"]
    for obj in docs:
        check_k8s(obj)
        assert obj["metadata"] == {**obj["metadata"], "name": "tiny-chat-v2", "namespace": "ml"}
    deploy, svc, hpa = docs
    assert deploy["spec"]["replicas"] == 2 and (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (2, 6)
    assert hpa["spec"]["metrics"][0]["resource"]["target"] == {"type": "Utilization", "averageUtilization": 70}
    assert hpa["spec"]["scaleTargetRef"]["name"] == deploy["metadata"]["name"]
    assert svc["spec"]["selector"].items() <= deploy["spec"]["template"]["metadata"]["labels"].items()
    c = _container(deploy)
    assert {c[p]["httpGet"]["path"] for p in ("readinessProbe", "livenessProbe", "startupProbe")} == {"/health"}
    weights = sum(f.stat().st_size for f in dirs[0].iterdir())  # the manifest lists every file of the dir
    assert c["resources"]["requests"]["memory"] == f"{math.ceil((2 * weights + (1 << 30)) / (1 << 20))}Mi"
    assert c["image"] == "prunus-tiny-chat-v2:latest"


def test_the_container_runs_prunus_serve_with_the_options_given_and_no_key(dirs, monkeypatch):
    monkeypatch.setenv("PRUNUS_API_KEY", "s3cret-key")
    result = _run(dirs[0], "--max-batch", 4, "--no-prepare", "--served-model-name", "a", "--served-model-name", "b",
                  "--kv-dtype", "f16", "--host", "127.0.0.1", "--port", 9000, "--print-k8s", "--k8s-image", "r/x:1")
    assert result.exit_code == 0, result.output
    assert "s3cret-key" not in result.stdout
    deploy = list(yaml.safe_load_all(result.stdout))[0]
    c = _container(deploy)
    assert c["command"][:7] == ["prunus", "serve", "/models/Tiny_Chat.v2", "--host", "0.0.0.0", "--port", "8000"]
    options = c["command"][7:]
    hosts = options.index("--allowed-hosts")
    assert options[:hosts] == ["--max-batch", "4", "--kv-dtype", "f16", "--no-prepare", "--served-model-name", "a",
                               "--served-model-name", "b"]
    assert "9000" not in options and "127.0.0.1" not in options and "--api-key" not in options
    assert "tiny-chat-v2.default.svc.cluster.local" in options
    key = next(e for e in c["env"] if e["name"] == "PRUNUS_API_KEY")
    assert key["valueFrom"]["secretKeyRef"] == {"name": "tiny-chat-v2-api-key", "key": "api-key"}
    assert c["image"] == "r/x:1"


def test_a_generic_module_is_a_kserve_inference_service_speaking_v2(dirs):
    (isvc,) = _docs(dirs[1], "--print-k8s", "--trust-factory", "--k8s-min-replicas", 1, "--k8s-max-replicas", 3)
    assert (isvc["apiVersion"], isvc["kind"]) == ("serving.kserve.io/v1beta1", "InferenceService")
    check_schema(isvc, KSERVE["schema"])
    c = _container(isvc)
    assert _same(k8s.V1Container, c)
    for volume in isvc["spec"]["predictor"]["volumes"]:
        assert _same(k8s.V1Volume, volume)
    assert c["name"] == "kserve-container" and {"name": "PROTOCOL", "value": "v2"} in c["env"]
    assert c["readinessProbe"]["httpGet"]["path"] == "/v2/health/ready"
    assert c["livenessProbe"]["httpGet"]["path"] == "/v2/health/live"
    assert c["command"][:8] == ["prunus", "serve", "/models/lin", "--host", "0.0.0.0", "--port", "8000",
                                "--trust-factory"]
    predictor = isvc["spec"]["predictor"]
    assert (predictor["minReplicas"], predictor["maxReplicas"], predictor["scaleMetric"]) == (1, 3, "cpu")


def test_the_checks_refuse_an_unknown_field_and_a_wrong_type(dirs):
    deploy = _docs(dirs[0], "--print-k8s")[0]
    (isvc,) = _docs(dirs[1], "--print-k8s")
    for change in (lambda d: _container(d).update(bogus=1), lambda d: d["spec"].update(replicas="1"),
                   lambda d: _container(d)["ports"][0].update(containerPort="8000")):
        bad = copy.deepcopy(deploy)
        change(bad)
        with pytest.raises(pydantic.ValidationError):
            check_k8s(bad)
    for change in (lambda d: _container(d).update(bogus=1), lambda d: d["spec"]["predictor"].update(scaleMetric="gpu"),
                   lambda d: d["spec"]["predictor"].update(minReplicas="1"), lambda d: d["spec"].update(bogus={})):
        bad = copy.deepcopy(isvc)
        change(bad)
        with pytest.raises(AssertionError):
            check_schema(bad, KSERVE["schema"])


def test_pvc_mode_mounts_the_claim_and_the_dockerfile_copies_nothing(dirs):
    deploy = _docs(dirs[0], "--print-k8s", "--k8s-model-from", "pvc", "--k8s-pvc", "weights")[0]
    check_k8s(deploy)
    pod = deploy["spec"]["template"]["spec"]
    assert {"name": "model", "persistentVolumeClaim": {"claimName": "weights", "readOnly": True}} in pod["volumes"]
    assert {"name": "model", "mountPath": "/models", "readOnly": True} in _container(deploy)["volumeMounts"]
    result = _run(dirs[0], "--print-k8s", "dockerfile", "--k8s-model-from", "pvc")
    assert result.exit_code == 0 and "COPY --chown" not in result.stdout


def test_the_dockerfile_installs_torch_cpu_then_the_wheel_and_copies_the_model(dirs):
    result = _run(dirs[0], "--print-k8s", "dockerfile")
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    torch_line = next(i for i, s in enumerate(lines) if "--index-url https://download.pytorch.org/whl/cpu torch==" in s)
    wheel_line = next(i for i, s in enumerate(lines) if s.startswith("RUN pip install /tmp/prunus-"))
    assert torch_line < wheel_line
    assert "COPY --chown=10001:10001 Tiny_Chat.v2 /models/Tiny_Chat.v2" in lines
    cmd = json.loads(next(s for s in lines if s.startswith("CMD "))[4:])
    assert cmd == ["prunus", "serve", "/models/Tiny_Chat.v2", "--host", "0.0.0.0", "--port", "8000"]


def test_nothing_is_loaded_weights_that_would_not_load_still_print(dirs, tmp_path):
    broken = tmp_path / "broken"
    broken.mkdir()
    for f in dirs[0].iterdir():
        (broken / f.name).write_bytes(f.read_bytes())
    (broken / "model.safetensors").write_bytes(b"not weights")
    assert _docs(broken, "--print-k8s")[0]["kind"] == "Deployment"


@pytest.mark.parametrize("args, needle", [
    (["--print-k8s", "--k8s-name", "Bad_Name"], "is not a DNS label"),
    (["--print-k8s", "--k8s-name", "9lives"], "is not a DNS label"),
    (["--print-k8s", "--k8s-namespace", "a.b"], "--k8s-namespace 'a.b' is not a DNS label"),
    (["--print-k8s", "--k8s-replicas", "0"], "--k8s-replicas 0 is out of range"),
    (["--print-k8s", "--k8s-max-replicas", "1001"], "--k8s-max-replicas 1001 is out of range"),
    (["--print-k8s", "--k8s-replicas", "3", "--k8s-max-replicas", "2"], "must rise in that order"),
    (["--print-k8s", "--k8s-pvc", "claim"], "add that, or drop --k8s-pvc"),
    (["--print-k8s", "--k8s-image", "bad image"], "is not an image reference"),
    (["--print-k8s", "--lora", "a=/x"], "--lora names adapter dirs"),
    (["--print-k8s", "--speculative", "/draft"], "names a draft dir"),
    (["--k8s-replicas", "2"], "--k8s-replicas applies with --print-k8s"),
])
def test_bad_options_are_one_line_exit_2(dirs, assert_user_error, args, needle):
    assert_user_error(_run(dirs[0], *args), needle)


def test_a_path_that_is_no_model_or_export_dir_is_one_line(dirs, tmp_path, assert_user_error):
    assert_user_error(_run(tmp_path / "missing", "--print-k8s"), "no such directory")
    assert_user_error(_run(tmp_path, "--print-k8s"), "no config.json")
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text('{"model_type": "llama"}')
    assert_user_error(_run(hf, "--print-k8s"), "not a prunus model dir or export dir")
    trt = tmp_path / "trt"
    trt.mkdir()
    (trt / "config.json").write_text('{"export": {"format": "tensorrt"}}')
    (trt / "prunus.json").write_text('{"files": {}}')
    assert_user_error(_run(trt, "--print-k8s"), "a TensorRT export needs a GPU")


def test_an_onnx_export_dir_is_recognised_and_sized_from_its_manifest(tmp_path):
    exp = tmp_path / "exp"
    exp.mkdir()
    (exp / "config.json").write_text(json.dumps({"kind": "module", "export": {"format": "onnx", "graph": "module"}}))
    (exp / "model.onnx").write_bytes(b"\0" * (3 << 20))
    (exp / "prunus.json").write_text(json.dumps({"files": {"config.json": "0" * 64, "model.onnx": "0" * 64}}))
    (isvc,) = _docs(exp, "--print-k8s")
    assert isvc["kind"] == "InferenceService"
    check_schema(isvc, KSERVE["schema"])
    assert "trust-factory" not in yaml.safe_dump(isvc)


def test_names_from_dirs_are_dns_labels_and_resources_grow_with_the_weights():
    for raw, label in (("My_Model.v2", "my-model-v2"), ("123", "model-123"), ("---", "model"), ("x" * 80, "x" * 63)):
        assert label_from(raw) == label and check_label(label, "--k8s-name") == label
    assert resources(3 << 30) == {"requests": {"cpu": "6", "memory": "7168Mi"}, "limits": {"memory": "11264Mi"}}
    assert resources(0)["requests"]["cpu"] == "1" and resources(1 << 40)["requests"]["cpu"] == "16"
    assert K8sSettings(replicas=5).highest == 5 and K8sSettings().lowest == 1
