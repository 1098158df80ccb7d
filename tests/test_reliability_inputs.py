"""Every bad input is one line (issue 14, items 10-15): non-regular files in data dirs, bounded recipes
and configs that never echo a huge value, export dirs checked against their manifest, a damaged newest
checkpoint skipped for the newest intact one, wrong types in every JSON file prunus reads, bad flag
values; and the input is left byte-for-byte as it was."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from prunus.cli.main import cli
from prunus.artifacts.errors import PrunusError
from prunus.models import save_model
from tree_snapshot import snapshot

TINY = ["--preset", "tiny", "--seq-len", "32", "--batch-size", "4", "--warmup-steps", "1", "--eval-every", "2",
        "--eval-tokens", "512", "--no-progress", "--steps", "2", "--ckpt-every", "0"]


def run(*args):
    return CliRunner().invoke(cli, [str(a) for a in args])


def rehash(d: Path) -> None:
    """Rewrite the manifest's hashes, as someone who edits files to get past the check would."""
    m = json.loads((d / "prunus.json").read_text())
    for name in m["files"]:
        m["files"][name] = hashlib.sha256((d / name).read_bytes()).hexdigest()
    (d / "prunus.json").write_text(json.dumps(m))


# --- data dirs ---------------------------------------------------------------------------------


def _data(tmp_path: Path, kind: str) -> Path:
    d = tmp_path / "data"
    d.mkdir()
    for name in ("a.txt", "b.txt"):
        (d / name).write_text("the quick brown fox jumps over the lazy dog\n" * 200)
    if kind == "fifo":
        os.mkfifo(d / "pipe")
    elif kind == "dangling":
        (d / "gone").symlink_to(tmp_path / "nowhere")
    elif kind == "loop":
        (d / "loop").symlink_to(d / "loop")
    elif kind == "empty-bin":
        (d / "train.bin").write_bytes(b"")
    return d


@pytest.mark.parametrize("verb", ["train", "compress"])
@pytest.mark.parametrize("kind, words", [("fifo", "a FIFO, not a regular file"), ("dangling", "a dangling symlink"),
                                         ("loop", "a symlink loop"), ("empty-bin", "holds no tokens")])
def test_data_dirs_with_non_regular_files(tmp_path, kind, words, verb, tiny_model, assert_user_error):
    data = _data(tmp_path, kind)
    before = snapshot(tmp_path)
    if verb == "train":
        r = run("train", *TINY, "--data", data, "--out", tmp_path / "run")
    else:
        save_model(tiny_model, tmp_path / "m", stage="test")
        before = snapshot(tmp_path)
        r = run("compress", tmp_path / "m", "--quantize", "int8-weight-only", "--data", data, "--out", tmp_path / "c",
                "--no-latency")
    assert_user_error(r, words, str(data))
    assert snapshot(tmp_path) == before


# --- recipes and configs: bounded, and no huge value echoed ----------------------------------------

BOMB = "".join(f"{n}: &{n} [{', '.join([f'*{p}'] * 9)}]\n" for p, n in zip("abcdefg", "bcdefgh"))
CONFIG_CASES = [  # (file name, content, words)
    ("r.yaml", 'a: &a ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]\n' + BOMB
     + "passes:\n  - quantize: {scheme: int8-weight-only, exclude: [*h, *h]}\n", "expands to more than"),
    ("r.yaml", "passes:\n  - quantize: {scheme: " + "x" * 200_000 + "}\n", "is not valid"),
    ("r.yaml", b"passes:\n  - quantize: {scheme: \xff}\n", "not UTF-8"),
    ("r.yaml", "passes: " + "[" * 5000 + "]" * 5000 + "\n", "nested too deeply"),
    ("r.yaml", "#" * (2 << 20), "bytes, above"),
    ("r.yaml", "passes:\n  - distill: {student: 'keep-every:2', temperature: hot}\n", "pass 1: distill.temperature='hot'"),
    ("r.yaml", "passes:\n  - prune: {method: magnitude}\n  - distill: {kd_weight: x}\n", "pass 2: distill.kd_weight='x'"),
    ("r.yaml", "passes:\n  - smoothquant: {alpha: x}\n", "r.yaml: pass 1: smoothquant.alpha='x'"),
    ("r.yaml", "passes:\n  - distill: {steps: ten}\n", "distill.steps='ten'"),
    ("r.yaml", "passes:\n  - quantize: {scheme: int4-weight-only, symmetric: 'yes'}\n",
     "r.yaml: pass 1: quantize: symmetric='yes' must be true or false"),
    ("c.toml", b"steps = 3\nlr = \xff\n", "not UTF-8"),
    ("c.toml", "lr = nan\n", "lr=nan must be a finite number"),
    ("c.toml", "steps = '100'\n", "steps='100' must be an integer"),
    ("c.toml", "seed = -1\n", "--seed -1"),
    ("c.toml", "[model]\nmax_seq_len = 1000000000\n", "above 1,048,576"),
    ("c.toml", "[model]\nnorm_eps = -1.0\n", "norm_eps=-1.0 must be a positive number"),
    ("c.toml", "[model]\ntie_embeddings = 'yes'\n", "tie_embeddings='yes' must be true or false"),
    ("c.toml", "[model]\nbogus = 1\n", "unknown field(s) bogus"),
]


@pytest.mark.parametrize("name, content, words", CONFIG_CASES, ids=[f"{c[0]}-{c[2][:20]}" for c in CONFIG_CASES])
def test_recipes_and_configs(tmp_path, tiny_model, name, content, words, assert_user_error):
    path = tmp_path / name
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    save_model(tiny_model, tmp_path / "m", stage="test")
    before = snapshot(tmp_path)
    if name.endswith(".yaml"):
        r = run("compress", tmp_path / "m", "--recipe", path, "--out", tmp_path / "c", "--no-latency")
    else:
        r = run("train", "--config", path, "--preset", "tiny", "--out", tmp_path / "run")
    assert_user_error(r, words)
    assert len(r.stderr) < 400, "an error echoed a huge value"
    assert snapshot(tmp_path) == before


def test_every_pass_argument_is_typed_and_checked():
    """Each argument of every pass is refused in one line naming it when its value has the wrong type, so
    a recipe is checked whole before any pass runs (an argument added later without a type fails here)."""
    from prunus.compress.recipe import PASSES, check_pass, pass_parameters
    from prunus.models.schemes import SCHEMES

    needed = [("quantize", {"scheme": scheme}) for scheme in SCHEMES]
    needed += [("prune", {"method": "magnitude"}), ("prune_structured", {"target": "heads", "amount": 0.25}),
               ("distill_module", {"student": "my_models:small"})]
    needed += [(name, {}) for name in PASSES if name not in {n for n, _ in needed}]
    for name, args in needed:
        check_pass(name, args, where="r.yaml: pass 1")
        for key in pass_parameters(name, args)[0]:
            with pytest.raises(PrunusError) as e:
                check_pass(name, {**args, key: object()}, where="r.yaml: pass 1")
            assert str(e.value).startswith("r.yaml: pass 1: ") and key in str(e.value) and "\n" not in str(e.value)


# --- files prunus reads: every JSON format, safetensors headers, shapes --------------------------

def _cfg(key, value):
    def edit(d: Path):
        c = json.loads((d / "config.json").read_text())
        c["model"][key] = value
        (d / "config.json").write_text(json.dumps(c))
        rehash(d)
    return edit


def _write(name, data: bytes, fix=True):
    def edit(d: Path):
        (d / name).write_bytes(data)
        if fix:
            rehash(d)
    return edit


def _safetensors(cut):
    def edit(d: Path):
        b = (d / "model.safetensors").read_bytes()
        (d / "model.safetensors").write_bytes(cut(b))
        rehash(d)
    return edit


MODEL_DIR_CASES = [
    ("max_seq_len 1e9", _cfg("max_seq_len", 1e9), "max_seq_len=1000000000.0 must be an integer"),
    ("max_seq_len 10**9", _cfg("max_seq_len", 10**9), "above 1,048,576"),
    ("dim string", _cfg("dim", "64"), "dim='64' must be an integer"),
    ("dim list", _cfg("dim", [64]), "dim=[64] must be an integer"),
    ("norm_eps < 0", _cfg("norm_eps", -1e-5), "norm_eps=-1e-05 must be a positive number"),
    ("tie_embeddings string", _cfg("tie_embeddings", "false"), "must be true or false"),
    ("shapes", _cfg("ffn_dim", 128), "config.json builds"),
    ("config a list", _write("config.json", b"[1, 2]"), "holds a JSON list"),
    ("config not UTF-8", _write("config.json", b'{"model": "\xff"}'), "not UTF-8"),
    ("config NaN", _write("config.json", b'{"model": {"norm_eps": NaN}}'), "not valid JSON"),
    ("manifest files a list", _write("prunus.json", b'{"files": ["config.json"]}', fix=False), "'files' must be"),
    ("manifest leaves the dir", _write("prunus.json", json.dumps({"files": {"../../etc/passwd": "0" * 64}}).encode(),
                                       fix=False), "not a file name inside the dir"),
    ("manifest hash a number", _write("prunus.json", b'{"files": {"config.json": 5}}', fix=False), "not a SHA-256"),
    ("safetensors truncated", _safetensors(lambda b: b[: len(b) // 2]), "lie outside the file"),
    ("safetensors header length", _safetensors(lambda b: (10**12).to_bytes(8, "little") + b[8:]), "truncated or not"),
    ("safetensors header garbage", _safetensors(lambda b: b[:8] + b"\xff" * 16 + b[24:]), "not valid JSON"),
]


@pytest.fixture(scope="module")
def good_model(tmp_path_factory):
    import torch

    from prunus.models import Transformer, get_preset

    torch.manual_seed(0)
    model = Transformer(get_preset("tiny"))
    model.init_weights()
    return save_model(model.eval(), tmp_path_factory.mktemp("good") / "m", stage="test")


@pytest.mark.parametrize("name, edit, words", MODEL_DIR_CASES, ids=[c[0] for c in MODEL_DIR_CASES])
def test_model_dir_files(tmp_path, good_model, name, edit, words, assert_user_error):
    d = tmp_path / "m"
    shutil.copytree(good_model, d)
    edit(d)
    before = snapshot(tmp_path)
    assert_user_error(run("generate", d, "--prompt", "x", "--max-new-tokens", 1), words)
    assert snapshot(tmp_path) == before


# --- run dirs and checkpoints ------------------------------------------------------------------

@pytest.fixture(scope="module")
def stopped_run(tmp_path_factory, text_file_module):
    """A tiny run stopped at step 4 of 6 with checkpoints at steps 2 and 4."""
    out = tmp_path_factory.mktemp("ckpt") / "run"
    r = run("train", *TINY[:-4], "--steps", 6, "--ckpt-every", 2, "--stop-at", 4, "--data", text_file_module, "--out", out)
    assert r.exit_code == 0, r.output
    return out


@pytest.fixture(scope="module")
def text_file_module(tmp_path_factory):
    path = tmp_path_factory.mktemp("corpus") / "corpus.txt"
    path.write_text("the quick brown fox jumps over the lazy dog\n" * 400)
    return path


def test_a_damaged_newest_checkpoint_falls_back_to_the_newest_intact_one(tmp_path, stopped_run):
    out = tmp_path / "run"
    shutil.copytree(stopped_run, out)
    shard = next((out / "checkpoints" / "step-4").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:1000])
    (out / "checkpoints" / ".step-99.tmp").mkdir()  # a killed run's half checkpoint: cleaned up
    r = run("train", "--resume", "--out", out, "--no-progress")
    assert r.exit_code == 0, r.output
    assert not (out / "checkpoints" / ".step-99.tmp").exists()
    note = [line for line in r.stderr.splitlines() if line.startswith("resume:")]
    assert len(note) == 1 and "step-4 is damaged" in note[0] and "resuming from step-2" in note[0], r.stderr
    assert (out / "model" / "prunus.json").is_file()


RUN_CASES = [  # (edit of the run dir, words)
    (lambda d: (d / "run.json").write_text("[]"), "holds a JSON list"),
    (lambda d: (d / "run.json").write_bytes(b'{"train": "\xff"}'), "not UTF-8"),
    (lambda d: (d / "run.json").write_text(json.dumps({**json.loads((d / "run.json").read_text()), "train": 5})),
     "no 'train' object"),
    (lambda d: (d / "run.json").write_text(json.dumps({"train": {**json.loads((d / "run.json").read_text())["train"],
                                                                  "steps": "6"}})), "steps='6' must be an integer"),
    (lambda d: [(c / "train_state.json").write_text('{"step": "4", "tokens": 0, "elapsed_s": 0}')
                for c in (d / "checkpoints").iterdir()], "every checkpoint"),
    (lambda d: [shutil.rmtree(c / ".metadata", ignore_errors=True) or (c / ".metadata").write_bytes(b"\x80garbage")
                for c in (d / "checkpoints").iterdir()], "every checkpoint"),
]


@pytest.mark.parametrize("edit, words", RUN_CASES, ids=[w + str(i) for i, (_, w) in enumerate(RUN_CASES)])
def test_run_dir_files(tmp_path, stopped_run, edit, words, assert_user_error):
    out = tmp_path / "run"
    shutil.copytree(stopped_run, out)
    edit(out)
    before = snapshot(tmp_path)
    assert_user_error(run("train", "--resume", "--out", out, "--no-progress"), words)
    assert snapshot(tmp_path) == before


def _half_a_shard_then_full(state, checkpoint_id, **kwargs):
    """dcp.save that writes half a shard, then finds the disk full."""
    Path(checkpoint_id).mkdir(parents=True, exist_ok=True)
    (Path(checkpoint_id) / "__0_0.distcp").write_bytes(b"half")
    raise OSError(28, "No space left on device")


def test_disk_full_while_checkpointing(tmp_path, text_file, monkeypatch, tiny_cfg):
    """One line that is true: nothing complete was written, so the run dir this run created is gone."""
    import torch.distributed.checkpoint as dcp

    from prunus.train_parallel import train

    monkeypatch.setattr(dcp, "save", _half_a_shard_then_full)
    with pytest.raises(PrunusError, match="no space left on the device") as e:
        train(tiny_cfg(tmp_path / "run", data=str(text_file), steps=4, ckpt_every=2))
    assert str(e.value) == (f"{tmp_path / 'run'}: writing the run failed (no space left on the device); nothing was "
                            "written (the incomplete run dir is removed); free space or choose another --out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus.txt"]


def test_disk_full_after_a_checkpoint_keeps_it(tmp_path, text_file, monkeypatch, tiny_cfg):
    """A complete checkpoint is never removed: the message names it and --resume finishes the run."""
    import torch.distributed.checkpoint as dcp

    from prunus.train_parallel import train

    real, calls = dcp.save, []

    def second_is_full(*a, **k):  # step 2's checkpoint is written whole, step 4's finds the disk full
        calls.append(1)
        return (real if len(calls) == 1 else _half_a_shard_then_full)(*a, **k)

    monkeypatch.setattr(dcp, "save", second_is_full)
    cfg = tiny_cfg(tmp_path / "run", data=str(text_file), steps=4, ckpt_every=2)
    with pytest.raises(PrunusError) as e:
        train(cfg)
    kept = tmp_path / "run" / "checkpoints" / "step-2"
    assert str(e.value).endswith(f"(no space left on the device); {kept} is kept; free space and continue with --resume")
    assert sorted(p.name for p in kept.parent.iterdir()) == ["step-2"]
    monkeypatch.setattr(dcp, "save", real)
    assert train(cfg, resume=True).model_dir == tmp_path / "run" / "model"


@pytest.mark.parametrize("where", ["new", "empty", "overwrite"])
def test_disk_full_anywhere_is_one_line(tmp_path, text_file, trained_run, monkeypatch, assert_user_error, where):
    """A write that is not through an atomic writer (run.json here) still ends in one line; an empty --out someone
    made is left empty, an overwritten run as it was, and no staging dir remains."""
    import shutil

    out = tmp_path / "run"
    if where == "empty":
        out.mkdir()
    elif where == "overwrite":
        shutil.copytree(trained_run, out)
    before = snapshot(tmp_path)

    def full(*a, **k):
        raise OSError(28, "No space left on device", str(out / "run.json"))

    monkeypatch.setattr("prunus.train_parallel.run_dir.atomic_write_json", full)
    r = run("train", *TINY, "--data", text_file, "--out", out, *(["--overwrite"] if where == "overwrite" else []))
    left = {"new": "the incomplete run dir is removed", "empty": f"{out} is empty again", "overwrite": f"{out} is as it was"}
    assert_user_error(r, "no space left on the device", f"nothing was written ({left[where]})")
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("line, words", [
    ('{"text": ' + "[" * 100_000 + "]" * 100_000 + "}", "line 2: JSON nested more than 100 deep"),
    ('{"text": "ab", "n": ' + "9" * 5000 + "}", "line 2: not usable JSON (an integer of more than 4,300 digits)"),
    ('{"text": "a\\ud800b"}', "line 2: holds text that is not valid UTF-8 (a lone surrogate '\\ud800')"),
], ids=["deep", "bigint", "surrogate"])
def test_hostile_training_rows_through_the_cli(tmp_path, line, words, assert_user_error):
    """Fine-tuning rows that once gave tracebacks: one line naming the file and line, exit 2, no run dir."""
    data = tmp_path / "rows.jsonl"
    data.write_text('{"text": "a fine row"}\n' + line + "\n")
    assert_user_error(run("train", *TINY, "--data", data, "--out", tmp_path / "run"), f"{data} {words}")
    assert not (tmp_path / "run").exists()


# --- flags ---------------------------------------------------------------------------------------

FLAG_CASES = [
    (["train", *TINY, "--seed", "-1"], "--seed -1"),
    (["train", *TINY, "--seed", str(2**64)], "--seed"),
    (["train", *TINY, "--lr", "nan"], "lr=nan must be a finite number"),
    (["train", *TINY, "--lr", "inf"], "lr=inf must be a finite number"),
    (["train", *TINY, "--lr", "-1"], "--lr -1.0 must be positive"),
    (["train", *TINY, "--max-corpus-bytes", "-5"], "--max-corpus-bytes -5"),
    (["train", *TINY, "--steps", "ten"], "'ten' is not a valid integer"),
    (["generate", "{m}", "--prompt", "x", "--max-new-tokens", "2", "--seed", str(2**70)], "--seed"),
    (["compress", "{m}", "--quantize", "int8-weight-only", "--out", "{t}/c", "--seed", str(2**70)], "--seed"),
    (["train", *TINY, "--out", "/proc/prunus-run"], "cannot be created"),
    (["serve", "{m}", "--port", "70000"], "70000 is not in the range"),
    (["serve", "{m}", "--max-batch", "0"], "--max-batch"),
]


@pytest.mark.parametrize("args, words", FLAG_CASES, ids=[" ".join(a[-2:]) for a, _ in FLAG_CASES])
def test_flag_values(tmp_path, good_model, args, words, assert_user_error):
    args = [a.replace("{m}", str(good_model)).replace("{t}", str(tmp_path)) for a in args]
    out = ["--out", str(tmp_path / "run")] if args[0] == "train" and "--out" not in args else []
    assert_user_error(run(*args, *out), words)
    assert not (tmp_path / "run").exists()


def test_an_argument_that_is_not_utf8(tmp_path):
    arg = os.fsdecode(b"/tmp/\xff\xfe")
    proc = subprocess.run([sys.executable, "-m", "prunus.cli.main", "info", arg], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "not valid UTF-8" in proc.stderr, proc.stderr


# --- export dirs ------------------------------------------------------------------------------------

def _graph(path: Path, inputs: list[str]) -> None:
    import onnx
    from onnx import TensorProto, helper

    ins = [helper.make_tensor_value_info(n, TensorProto.INT64, None) for n in inputs]
    out = helper.make_tensor_value_info("logits", TensorProto.INT64, None)
    graph = helper.make_graph([helper.make_node("Identity", [inputs[0]], ["logits"])], "g", ins, [out])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9), str(path))


@pytest.fixture
def export_dir(tmp_path, good_model):
    from prunus.export.graphs import graph_names

    d = tmp_path / "exp"
    d.mkdir()
    config = json.loads((good_model / "config.json").read_text())
    m = config["model"]
    config["export"] = {"format": "onnx", "precision": "fp32", "graphs": {"prefill": "prefill.onnx", "decode": "decode.onnx"},
                        "n_layers": m["n_layers"], "n_kv_heads": m["n_kv_heads"], "head_dim": m["dim"] // m["n_heads"],
                        "vocab_size": m["vocab_size"], "max_seq_len": m["max_seq_len"]}
    (d / "config.json").write_text(json.dumps(config))
    names = graph_names(m["n_layers"])
    _graph(d / "prefill.onnx", names["prefill_inputs"])
    _graph(d / "decode.onnx", names["decode_inputs"])
    (d / "prunus.json").write_text(json.dumps({"format": "prunus-export/1", "files": {}}))
    rehash_all(d)
    return d


def rehash_all(d: Path) -> None:
    m = json.loads((d / "prunus.json").read_text())
    m["files"] = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in d.iterdir() if p.name != "prunus.json"}
    (d / "prunus.json").write_text(json.dumps(m))


def _swap(d: Path) -> None:
    a, b = (d / "prefill.onnx").read_bytes(), (d / "decode.onnx").read_bytes()
    (d / "prefill.onnx").write_bytes(b)
    (d / "decode.onnx").write_bytes(a)
    rehash_all(d)


def _escape(d: Path) -> None:
    m = json.loads((d / "prunus.json").read_text())
    m["files"]["../secret.txt"] = "0" * 64
    (d / "prunus.json").write_text(json.dumps(m))


def _symlink_out(d: Path) -> None:
    outside = d.parent / "elsewhere.onnx"
    shutil.move(d / "decode.onnx", outside)
    (d / "decode.onnx").symlink_to(outside)


EXPORT_CASES = [
    (_swap, "is a decode graph where the prefill graph belongs"),
    (_escape, "not a file name inside the dir"),
    (_symlink_out, "names 'decode.onnx', which leads outside"),
    (lambda d: (d / "decode.onnx").write_bytes(b"changed"), "content hash does not match"),
    (lambda d: (d / "prunus.json").unlink(), "missing prunus.json"),
    (lambda d: ((d / "config.json").write_text(json.dumps({**json.loads((d / "config.json").read_text()),
                                                           "export": {"format": "onnx", "graphs": ["../x"]}})),
                rehash_all(d)), "does not name the graph files"),
]


@pytest.mark.parametrize("edit, words", EXPORT_CASES, ids=[w[:30] for _, w in EXPORT_CASES])
def test_export_dirs_are_checked_against_their_manifest(tmp_path, export_dir, edit, words):
    from prunus.serve import Engine

    edit(export_dir)
    before = snapshot(tmp_path)
    with pytest.raises(PrunusError, match=words) as e:
        Engine.load(export_dir)
    assert "\n" not in str(e.value)
    assert snapshot(tmp_path) == before
