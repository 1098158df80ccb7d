"""Many LoRA adapters over one base (prunus.runtime.lora_adapters): each row of a mixed batch (the base and two
adapters) has the logits of the adapter merged into the base by PEFT's formula (1e-5), prefill and decode; requests
pick an adapter by name; adapter dirs that do not fit the base are one PrunusError line naming the dir and module."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import save_file

from prunus.artifacts.errors import PrunusError
from prunus.models import Transformer, get_preset, load_model, save_model, stream_tokens
from prunus.serve import Engine

TOL = 1e-5
HF = {"attention.wq": "self_attn.q_proj", "attention.wk": "self_attn.k_proj", "attention.wv": "self_attn.v_proj",
      "attention.wo": "self_attn.o_proj", "feed_forward.w1": "mlp.gate_proj", "feed_forward.w2": "mlp.down_proj",
      "feed_forward.w3": "mlp.up_proj"}


def write_adapter(model, out, rank: int, alpha: float, targets, seed: int, **config) -> dict:
    """A PEFT-format adapter dir of random weights over ``model``; returns {prunus module: (A, B)}."""
    g = torch.Generator().manual_seed(seed)
    tensors, weights = {}, {}
    for name, module in model.named_modules():
        parts = name.split(".")
        if len(parts) != 4 or f"{parts[2]}.{parts[3]}" not in targets:
            continue
        A = torch.randn(rank, module.in_features, generator=g) * 0.1
        B = torch.randn(module.out_features, rank, generator=g) * 0.1
        hf = f"base_model.model.model.layers.{parts[1]}.{HF[parts[2] + '.' + parts[3]]}"
        tensors[f"{hf}.lora_A.weight"], tensors[f"{hf}.lora_B.weight"] = A, B
        weights[name] = (A, B)
    out.mkdir(parents=True)
    (out / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": alpha, "target_modules": sorted(HF[t].split(".")[1] for t in targets),
        "bias": "none", "fan_in_fan_out": False, "use_dora": False, "modules_to_save": None, **config}))
    save_file(tensors, out / "adapter_model.safetensors")
    return weights


def merged(model_dir, weights, scale: float) -> Transformer:
    """The base with the adapter folded in as PEFT merges it: W + scale * B @ A."""
    model = load_model(model_dir)
    modules = dict(model.named_modules())
    with torch.no_grad():
        for name, (A, B) in weights.items():
            modules[name].weight += scale * B @ A
    return model.eval()


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lora_serve")
    torch.manual_seed(0)
    model = Transformer(get_preset("tiny"))
    model.init_weights()
    base = save_model(model.eval(), tmp / "base", stage="test")
    a = write_adapter(model, tmp / "a", 4, 8.0, ("attention.wq", "attention.wv", "feed_forward.w2"), 1)
    b = write_adapter(model, tmp / "b", 2, 4.0, tuple(HF), 2)
    refs = {None: load_model(base), "a": merged(base, a, 2.0), "b": merged(base, b, 2.0)}
    return tmp, base, refs


def test_mixed_batch_rows_equal_the_merged_models_prefill_and_decode(setup):
    tmp, base, refs = setup
    with Engine.load(base, max_batch=4, compile=False, lora={"a": tmp / "a", "b": tmp / "b"}) as engine:
        backend = engine.backend
        names = ["a", None, "b", "a"]
        prompts = [[5, 6, 7, 8, 9], [1, 2, 3], [7, 7, 8, 9, 10, 11, 12], [40, 41]]
        rows = [0, 1, 2, 3]
        for row, name in zip(rows, names):
            backend.bind_adapter(row, engine.lora_adapter(name) if name else None)
        with torch.inference_mode():
            first = backend.prefill(rows, prompts)
            nxt = [11, 12, 13, 14]
            second = backend.decode(rows, nxt)
            for i, name in enumerate(names):
                model = refs[name]
                x = torch.tensor([prompts[i] + [nxt[i]]])
                full = model(x)[0]
                assert (first[i] - full[-2]).abs().max() <= TOL, (i, name)
                assert (second[i] - full[-1]).abs().max() <= TOL, (i, name)
            assert (first[0] - refs[None](torch.tensor([prompts[0]]))[0, -1]).abs().max() > 1e-3  # it differs
        for row in rows:
            backend.release(row)


def test_requests_pick_adapters_by_name_and_unload_waits_for_none(setup):
    tmp, base, refs = setup
    with Engine.load(base, max_batch=4, compile=False, lora={"a": tmp / "a"}) as engine:
        engine.load_adapter("b", tmp / "b")
        assert engine.adapter_names() == ["a", "b"]
        prompt = [3, 4, 5, 6]
        reqs = {n: engine.submit(prompt, 6, ignore_eos=True, adapter=n) for n in ("a", "b")}
        reqs[None] = engine.submit(prompt, 6, ignore_eos=True)
        engine.unload_adapter("b")  # the running request finishes with it
        for name, r in reqs.items():
            want = [int(t[0]) for t in stream_tokens(refs[name], torch.tensor([prompt]), 6)]
            assert engine.wait(r).token_ids == want, name
        assert engine.adapter_names() == ["a"]
        with pytest.raises(PrunusError, match="no adapter named 'b' is loaded; loaded: a"):
            engine.submit(prompt, 2, adapter="b")


def one_line(excinfo, *needles):
    text = str(excinfo.value)
    assert "\n" not in text
    for n in needles:
        assert n in text, text


def test_an_adapter_for_another_base_is_one_line_naming_dir_and_module(setup, tmp_path):
    tmp, base, _ = setup
    cfg = get_preset("tiny")
    other = Transformer(type(cfg)(**{**cfg.__dict__, "dim": cfg.dim * 2, "n_heads": cfg.n_heads}))
    write_adapter(other, tmp_path / "wide", 4, 8.0, ("attention.wq",), 3)
    with pytest.raises(PrunusError) as e:
        Engine.load(base, compile=False, lora={"wide": tmp_path / "wide"})
    one_line(e, str(tmp_path / "wide" / "adapter_model.safetensors"), "layers.0.attention.wq", "another base")


@pytest.mark.parametrize("change, needle", [
    (dict(use_dora=True), "use_dora=True is not supported"),
    (dict(r=3), "takes a float (3,"),
    (dict(peft_type="IA3"), "peft_type 'IA3' is not LORA"),
    (dict(r=0), "r=0 must be an integer rank"),
])
def test_bad_adapter_configs_are_one_line(setup, tmp_path, change, needle):
    tmp, base, _ = setup
    model = load_model(base)
    write_adapter(model, tmp_path / "x", 4, 8.0, ("attention.wq",), 4)
    path = tmp_path / "x" / "adapter_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **change}))
    with pytest.raises(PrunusError) as e:
        Engine.load(base, compile=False, lora={"x": tmp_path / "x"})
    one_line(e, needle, str(tmp_path / "x"))


def test_weights_outside_the_dir_and_missing_dirs_are_refused(setup, tmp_path):
    tmp, base, _ = setup
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "adapter_config.json").write_text((tmp / "a" / "adapter_config.json").read_text())
    os.symlink(tmp / "a" / "adapter_model.safetensors", tmp_path / "x" / "adapter_model.safetensors")
    with pytest.raises(PrunusError) as e:
        Engine.load(base, compile=False, lora={"x": tmp_path / "x"})
    one_line(e, "leads outside")
    with pytest.raises(PrunusError) as e:
        Engine.load(base, compile=False, lora={"y": tmp_path / "nope"})
    one_line(e, "not a directory")
    with pytest.raises(PrunusError) as e:
        Engine.load(base, compile=False, lora={"bad name!": tmp / "a"})
    one_line(e, "adapter name 'bad name!'")


@pytest.mark.parametrize("side, value, needles", [
    ("A", float("nan"), ["q_proj.lora_A.weight' holds nan at element 3 of 256", "the adapter is damaged"]),
    ("B", float("-inf"), ["q_proj.lora_B.weight' holds -inf at element 3 of 256", "the adapter is damaged"]),
    ("A", 1e30, ["the lora_A's output of layers.0.attention.wq can reach 1e+30 on an input of entries in [-1, 1], "
                 "beyond 1.84e+19 for a float32 base", "the adapter's weights are absurd"]),
    ("B", 1e30, ["the lora_B @ lora_A x 2 output of layers.0.attention.wq can reach", "beyond 1.84e+19"]),
])
def test_nonfinite_or_absurd_adapter_weights_are_one_line(setup, tmp_path, side, value, needles):
    """NaN or infinity in lora_A / lora_B, and finite weights so large that the update's bound for inputs in [-1, 1]
    passes what the next norm can square in float32: refused at load and while serving, naming the tensor or the
    module; the engine keeps serving without it."""
    from safetensors.torch import load_file

    tmp, base, _ = setup
    write_adapter(load_model(base), tmp_path / "x", 4, 8.0, ("attention.wq",), 5)
    weights = tmp_path / "x" / "adapter_model.safetensors"
    tensors = load_file(weights)
    tensors[f"base_model.model.model.layers.0.self_attn.q_proj.lora_{side}.weight"].view(-1)[3] = value
    save_file(tensors, weights)
    with pytest.raises(PrunusError) as e:
        Engine.load(base, compile=False, lora={"x": tmp_path / "x"})
    one_line(e, str(weights), *needles)
    with Engine.load(base, max_batch=2, compile=False, lora={"a": tmp / "a"}) as engine:
        with pytest.raises(PrunusError) as e:
            engine.load_adapter("x", tmp_path / "x")
        one_line(e, *needles)
        assert engine.adapter_names() == ["a"]
        assert len(engine.generate([5, 6, 7], max_new_tokens=3, temperature=0.0, adapter="a").token_ids) == 3


def test_the_update_bound_follows_the_base_dtype():
    """The bound is float32's square root under a float32 or bfloat16 base, float16's range under a float16 one; a
    trained-size adapter (rank 16, every entry 0.1, 4096 inputs, scale 2) passes under all three, and each weight
    must fit the base's dtype once cast."""
    from pathlib import Path

    from prunus.runtime.lora_adapters import check_update, update_limit

    assert update_limit(torch.float32) == update_limit(torch.bfloat16) == pytest.approx(1.8446742e19, rel=1e-6)
    assert update_limit(torch.float16) == 65504.0
    keys = {"A": "a.lora_A.weight", "B": "a.lora_B.weight"}
    A, B = torch.full((16, 4096), 0.1), torch.full((4096, 16), 0.1)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        check_update(Path("x"), "m", keys, A, B, 2.0, dtype)
    with pytest.raises(PrunusError, match=r"the lora_B @ lora_A x 2 output of m can reach 1.31e\+05 on an input of "
                                          r"entries in \[-1, 1\], beyond 6.55e\+04 for a float16 base"):
        check_update(Path("x"), "m", keys, A, B * 100, 2.0, torch.float16)
    check_update(Path("x"), "m", keys, A, B * 100, 2.0, torch.bfloat16)


def test_backends_without_lora_refuse_in_one_line():
    from prunus.runtime.backend import Capabilities
    from prunus.serve.engine import _attach_lora

    class Graph:  # a backend that does not declare LoRA
        name = "onnxruntime"
        capabilities = Capabilities(max_batch=2)

    with pytest.raises(PrunusError) as e:
        _attach_lora(Graph(), {"a": "dir"})
    one_line(e, "the onnxruntime backend cannot serve LoRA adapters")


def _call(server, method, path, body=None, key=None):
    import http.client

    conn = http.client.HTTPConnection(*server.server_address[:2], timeout=60)
    headers = {"Content-Type": "application/json"} if body is not None else {}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    conn.request(method, path, None if body is None else json.dumps(body), headers)
    resp = conn.getresponse()
    raw = resp.read().decode()
    conn.close()
    return resp.status, json.loads(raw)


def _serve(engine, **kwargs):
    import threading

    from prunus.serve.http_server import CompletionServer

    server = CompletionServer(engine, port=0, served_model_names=["base"], **kwargs)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def test_http_model_field_picks_adapters_and_admin_routes_need_a_key(setup):
    from prunus.serve.http_access import ServeAccess

    tmp, base, refs = setup
    prompt = [3, 4, 5, 6]
    with Engine.load(base, max_batch=4, compile=False, threads=1, lora={"a": tmp / "a"}) as engine:
        server = _serve(engine, access=ServeAccess(api_key="k"))
        try:
            status, models = _call(server, "GET", "/v1/models", key="k")
            assert status == 200 and [m["id"] for m in models["data"]] == ["base", "a"]
            assert models["data"][1]["parent"] == "base"
            status, card = _call(server, "GET", "/v1/models/a", key="k")
            assert status == 200 and card["id"] == "a" and card["parent"] == "base"
            for name in ("a", "base"):
                status, out = _call(server, "POST", "/v1/completions", {"model": name, "prompt": prompt,
                                                                       "max_tokens": 5, "temperature": 0}, key="k")
                want = engine.generate(prompt, 5, adapter=name if name == "a" else None)
                assert status == 200 and out["model"] == name and out["choices"][0]["text"] == want.text, name
            assert engine.generate(prompt, 5, adapter="a").token_ids != engine.generate(prompt, 5).token_ids
            status, out = _call(server, "POST", "/v1/load_lora_adapter", {"lora_name": "b", "lora_path": str(tmp / "b")})
            assert status == 401
            status, out = _call(server, "POST", "/v1/load_lora_adapter",
                                {"lora_name": "b", "lora_path": str(tmp / "b")}, key="k")
            assert status == 200 and engine.adapter_names() == ["a", "b"], out
            status, out = _call(server, "POST", "/v1/load_lora_adapter",
                                {"lora_name": "c", "lora_path": str(tmp / "nope")}, key="k")
            assert status == 400 and "not a directory" in out["error"]["message"]
            status, out = _call(server, "POST", "/v1/unload_lora_adapter", {"lora_name": "a"}, key="k")
            assert status == 200 and engine.adapter_names() == ["b"]
            status, out = _call(server, "POST", "/v1/completions", {"model": "a", "prompt": "x"}, key="k")
            assert status == 404 and out["error"]["code"] == "model_not_found"
            status, out = _call(server, "POST", "/v1/unload_lora_adapter", {"lora_name": "a"}, key="k")
            assert status == 404
            server.access = ServeAccess()  # no API key: the admin routes are refused
            status, out = _call(server, "POST", "/v1/unload_lora_adapter", {"lora_name": "b"})
            assert status == 403 and "--api-key" in out["error"]["message"] and engine.adapter_names() == ["b"]
        finally:
            server.shutdown()
            server.server_close()


def test_serve_cli_takes_lora(setup, monkeypatch, assert_user_error):
    from click.testing import CliRunner

    from prunus.cli.main import cli
    from prunus.serve.http_server import CompletionServer

    tmp, base, _ = setup
    seen = []

    def record(self, poll_interval=0.5):
        seen.append(self.engine.adapter_names())
        raise KeyboardInterrupt
    monkeypatch.setattr(CompletionServer, "serve_forever", record)
    args = ["serve", str(base), "--port", "0", "--max-batch", "1", "--no-compile"]
    r = CliRunner().invoke(cli, [*args, "--lora", f"a={tmp / 'a'}", "--lora", f"b={tmp / 'b'}"])
    assert r.exit_code == 0, r.output
    assert seen == [["a", "b"]]
    assert_user_error(CliRunner().invoke(cli, [*args, "--lora", "a"]), "--lora 'a': give NAME=ADAPTER_DIR")
    assert_user_error(CliRunner().invoke(cli, [*args, "--lora", f"w={tmp}"]), f"{tmp}", "adapter_config.json")


def test_embeddings_with_an_adapter_equal_the_merged_model(setup):
    tmp, base, refs = setup
    ids = [5, 6, 7, 8]
    with Engine.load(base, max_batch=2, compile=False, lora={"a": tmp / "a"}) as engine:
        got = engine.embed([ids, ids], adapter="a", normalize=False)
        plain = engine.embed([ids], normalize=False)
    for model, vector in ((refs["a"], got[0]), (refs["a"], got[1]), (refs[None], plain[0])):
        seen = {}
        handle = model.output.register_forward_pre_hook(lambda m, a: seen.setdefault("h", a[0]))
        with torch.no_grad():
            model(torch.tensor([ids]))
        handle.remove()
        assert (vector - seen["h"][0, -1]).abs().max() <= TOL
    assert (got[0] - plain[0]).abs().max() > 1e-3


def test_an_adapter_prunus_train_wrote_serves_as_its_merged_model(tmp_path):
    from prunus.train_parallel import TrainConfig, train

    torch.manual_seed(0)
    model = Transformer(get_preset("tiny"))
    model.init_weights()
    base = save_model(model.eval(), tmp_path / "base", stage="train")
    cfg = TrainConfig(preset="tiny", seq_len=32, batch_size=4, steps=2, warmup_steps=1, eval_every=2, eval_tokens=512,
                      ckpt_every=0, max_corpus_bytes=50_000, progress=False, lr=1e-2, lora_rank=4, lora_alpha=8.0,
                      out=str(tmp_path / "run"), save_adapter=True)
    result = train(cfg, model=load_model(base).train())
    ids = [5, 6, 7, 8, 9]
    with Engine.load(base, max_batch=2, compile=False, lora={"t": result.run_dir / "adapter"}) as engine:
        backend = engine.backend
        backend.bind_adapter(0, engine.lora_adapter("t"))
        got = backend.prefill([0, 1], [ids, ids])
        backend.release(0)
    with torch.no_grad():
        want = load_model(result.model_dir)(torch.tensor([ids]))[0, -1]
        plain = load_model(base)(torch.tensor([ids]))[0, -1]
    assert (got[0] - want).abs().max() <= TOL and (got[1] - plain).abs().max() <= TOL
    assert (want - plain).abs().max() > 1e-4
