"""Device-map inference (serve/device_map.py): placement by a memory budget, as Accelerate places it, and the
same greedy tokens whatever the placement (blocks on the CPU and streamed from the disk)."""

import json

import pytest
import torch

from prunus.artifacts.errors import PrunusError
from prunus.models import Transformer, get_preset, load_model, load_tokenizer, save_model
from prunus.serve import Engine
from prunus.runtime.device_map import infer_device_map, module_sizes, parse_max_memory, parse_size, resolve_device_map

PROMPTS = ["def f(", "import os\n"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    torch.manual_seed(0)
    model = Transformer(get_preset("tiny").replace(n_layers=4, tie_embeddings=True))
    model.init_weights()
    return save_model(model, tmp_path_factory.mktemp("dm") / "model", tokenizer=load_tokenizer(None), stage="train")


@pytest.fixture(scope="module")
def reference_tokens(model_dir):
    with Engine.load(model_dir) as engine:
        return [r.token_ids for r in engine.generate(PROMPTS, max_new_tokens=10)]


def _sizes(model_dir):
    return module_sizes(load_model(model_dir, device="meta", placement=lambda name: None))


def _budgets(sizes):
    block = sizes["layers.0"]
    return [block, block * 2 + 1, sizes[""] // 2, sizes[""] - block, sizes[""] * 2]


def test_placements_generate_the_same_tokens(model_dir, reference_tokens):
    seen_disk = False
    tokens = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = load_model(model_dir)(tokens)
    for cpu in _budgets(_sizes(model_dir)):
        with Engine.load(model_dir, device_map="auto", max_memory={"cpu": cpu}) as engine:
            placed = engine.info["device_map"]
            seen_disk |= "disk" in placed.values()
            got = [r.token_ids for r in engine.generate(PROMPTS, max_new_tokens=10)]
            with torch.no_grad():
                assert torch.equal(engine.backend.model(tokens), logits), placed  # the same arithmetic, to the bit
        assert got == reference_tokens, (cpu, placed)
    assert seen_disk
    by_hand = {"tok_embeddings": "cpu", "layers.0": "disk", "layers.1": "cpu", "layers.2": "disk", "layers.3": "cpu",
               "norm": "disk", "output": "cpu"}  # output tied to the embedding: placed with it
    with Engine.load(model_dir, device_map=by_hand) as engine:
        assert [r.token_ids for r in engine.generate(PROMPTS, max_new_tokens=10)] == reference_tokens


def test_streamed_blocks_hold_no_weights_between_forwards(model_dir):
    with Engine.load(model_dir, device_map={"": "cpu", "layers.1": "disk", "layers.2": "disk"}) as engine:
        engine.generate(PROMPTS[0], max_new_tokens=3)
        model = engine.backend.model
        assert all(p.is_meta for i in ("1", "2") for p in model.layers[i].parameters())
        assert not any(p.is_meta for p in model.layers["0"].parameters())


def _hf_model(model_dir, tmp_path):
    transformers = pytest.importorskip("transformers")
    from prunus.models.hf_convert import to_hf

    hf_dir = to_hf(model_dir, tmp_path / "hf")
    with torch.device("meta"):
        hf = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(hf_dir))
    hf.tie_weights()
    return hf


HF_NAMES = {"tok_embeddings": "model.embed_tokens", "norm": "model.norm", "output": "lm_head"}


def _by_module(device_map: dict, names: list[str]) -> dict:
    """{module name: device} for each of ``names`` from a cleaned map (its longest prefix)."""
    from prunus.runtime.device_map import placement_of

    return {n: placement_of(device_map, n) for n in names}


def test_planner_matches_accelerate(model_dir, tmp_path):
    accelerate = pytest.importorskip("accelerate")
    hf = _hf_model(model_dir, tmp_path)
    ours = load_model(model_dir, device="meta", placement=lambda name: None)
    n = len(ours.layers)
    names = ["tok_embeddings", *(f"layers.{i}" for i in range(n)), "norm", "output"]
    hf_names = [HF_NAMES.get(x, "model." + x) for x in names]
    sizes = module_sizes(ours)
    budgets = _budgets(sizes) + [sizes["tok_embeddings"] + 3 * sizes["layers.0"], sizes[""] - 1]
    for cpu in budgets:
        theirs = accelerate.infer_auto_device_map(hf, max_memory={"cpu": cpu}, no_split_module_classes=["LlamaDecoderLayer"])
        # the same algorithm on the same (Hugging Face) module tree: the same map
        assert dict(infer_device_map(hf, parse_max_memory({"cpu": cpu}), no_split=("LlamaDecoderLayer",))) == dict(theirs)
        # and on prunus's own model, block by block
        mine = infer_device_map(ours, parse_max_memory({"cpu": cpu}))
        assert list(_by_module(mine, names).values()) == list(_by_module(theirs, hf_names).values()), cpu


@pytest.mark.parametrize("kwargs, message", [
    (dict(device_map="auto", max_memory={3: "1GiB", "cpu": "1GiB"}), "does not exist"),
    (dict(device_map={"layers.0": "tpu"}), "is not a device"),
    (dict(device_map="auto", max_memory={"cpu": 1000}), "below one block"),
    (dict(device_map="auto"), "needs max_memory"),
    (dict(device_map={"layers.9": "cpu"}), "no module of this model"),
    (dict(device_map={"layers.0": "cpu"}), "places no module holding"),
    (dict(max_memory={"cpu": "1GiB"}), "applies with device_map='auto'"),
    (dict(device_map="auto", max_memory="cpu=lots"), "is not a size"),
])
def test_bad_device_maps_are_one_line(model_dir, kwargs, message):
    with pytest.raises(PrunusError, match=message) as e:
        Engine.load(model_dir, **kwargs)
    assert "\n" not in str(e.value)


def test_sizes_and_budgets_parse():
    assert parse_size("10GiB") == 10 * 2**30 and parse_size("1.5MB") == 1_500_000 and parse_size(123) == 123
    assert list(parse_max_memory("cpu=30GiB,disk=1TB")) == ["cpu", "disk"]


def test_cli_bad_device_is_exit_2(model_dir):
    from click.testing import CliRunner

    from prunus.cli.main import cli

    import signal

    before = signal.getsignal(signal.SIGTERM)
    r = CliRunner().invoke(cli, ["serve", str(model_dir), "--device-map", "auto", "--max-memory", "5=1GiB,cpu=1GiB"])
    assert r.exit_code == 2 and "does not exist" in r.output and len(r.output.strip().splitlines()) == 1, r.output
    assert signal.getsignal(signal.SIGTERM) is before  # serve's SIGTERM handler does not outlive the command


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a GPU placement needs a CUDA device; this machine has none")
def test_gpu_cpu_and_disk_placement_generates_the_same_tokens(model_dir):
    with Engine.load(model_dir, device="cuda") as engine:
        reference = [r.token_ids for r in engine.generate(PROMPTS, max_new_tokens=10)]
    sizes = _sizes(model_dir)
    budget = {0: sizes["tok_embeddings"] + 2 * sizes["layers.0"] + 1, "cpu": 2 * sizes["layers.0"] + 1}
    with Engine.load(model_dir, device_map="auto", max_memory=budget) as engine:
        placed = engine.info["device_map"]
        got = [r.token_ids for r in engine.generate(PROMPTS, max_new_tokens=10)]
    print(f"device map {placed}: tokens {got} vs one GPU {reference}")
    assert {"0", "cpu", "disk"} <= set(placed.values()) and got == reference
