"""The serving Engine: greedy tokens equal to prunus.models.generate, batched and continuously batched
requests equal to each run alone, streaming, tensor-parallel workers (one spawn of 2 for many checks)
equal to one process, no orphaned workers, the ONNX Runtime backend, and bad input."""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from pathlib import Path

import pytest
import torch

from prunus.artifacts.errors import PrunusError
from prunus.models import Transformer, get_preset, load_model, load_model_tokenizer, save_model, stream_tokens
from prunus.serve import Engine

PROMPTS = ["def f(x):", "import os\n", "class A:\n    def __init__(self", "x", "    return self.assertEqual("]
N_NEW = 24


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    torch.manual_seed(0)
    model = Transformer(get_preset("tiny"))
    model.init_weights()
    return save_model(model.eval(), tmp_path_factory.mktemp("serve") / "model", stage="test")


@pytest.fixture(scope="module")
def reference(model_dir):
    """Each prompt alone through prunus.models.stream_tokens (greedy, stopping at end of text)."""
    model, tok = load_model(model_dir), load_model_tokenizer(model_dir)
    out = {}
    for p in PROMPTS:
        ids = [int(t[0]) for t in stream_tokens(model, torch.tensor([tok.encode(p)]), N_NEW, eos_id=tok.eos_id)]
        out[p] = [t for t in ids if t != tok.eos_id]
    return out


@pytest.fixture(scope="module")
def engine(model_dir):
    with Engine.load(model_dir, max_batch=4, backend="torch") as e:  # the torch backend's scheduling and timing
        yield e


def test_greedy_equals_models_generate_alone_and_batched(engine, reference):
    # five prompts of different lengths through four slots: a batch, then a row freed and reused
    batched = engine.generate(PROMPTS, max_new_tokens=N_NEW)
    assert [r.token_ids for r in batched] == [reference[p] for p in PROMPTS]
    for p in PROMPTS[:2]:
        alone = engine.generate(p, max_new_tokens=N_NEW)
        assert alone.token_ids == reference[p]
        assert alone.text == engine.tokenizer.decode(reference[p])
    r = batched[0]
    assert r.prompt_tokens == len(PROMPTS[0]) and r.finish_reason in ("length", "stop")
    assert r.time_to_first_token_s > 0 and r.decode_tokens_per_s > 0 and r.total_s >= r.time_to_first_token_s


def test_one_options_object_loads_the_same_engine(model_dir, reference):
    """Engine.load(path, options=EngineOptions(...)) is Engine.load(path, **keywords): the same backend and tokens;
    both at once, or a keyword that is no setting, is refused."""
    from prunus.runtime.load_options import LoadOptions, ServingFeatures
    from prunus.serve.engine_options import EngineOptions

    options = EngineOptions("torch", LoadOptions(max_batch=2, compile=False, features=ServingFeatures(draft_tokens=3)),
                            max_queue=16)
    assert EngineOptions.from_keywords("torch", max_batch=2, compile=False, draft_tokens=3, max_queue=16) == options
    with Engine.load(model_dir, options=options) as e:
        assert e.info["max_batch"] == 2 and e.info["runtime"] == "torch"
        p = PROMPTS[0]
        assert e.generate(p, max_new_tokens=N_NEW).token_ids[:len(reference[p])] == reference[p]
    with pytest.raises(TypeError, match="not both"):
        Engine.load(model_dir, options=options, max_batch=4)
    with pytest.raises(TypeError, match="max_batches"):
        Engine.load(model_dir, max_batches=4)


def test_continuous_batching_joins_and_leaves(engine, reference):
    """Requests submitted while others decode join at the next step and get the tokens they get alone."""
    long = engine.submit(PROMPTS[2], max_new_tokens=N_NEW, ignore_eos=True)
    first = [long.events.get() for _ in range(3)]  # the first request is decoding
    steps_before = engine.scheduler.steps
    late = [engine.submit(p, max_new_tokens=N_NEW) for p in (PROMPTS[0], PROMPTS[3])]
    results = [Engine.wait(r) for r in late]
    rest = Engine.wait(long)
    assert [r.token_ids for r in results] == [reference[PROMPTS[0]], reference[PROMPTS[3]]]
    assert [t.id for t in first] == rest.token_ids[:3]
    assert rest.token_ids[:len(reference[PROMPTS[2]])] == reference[PROMPTS[2]]
    # they ran beside the first one: it had not finished when they started
    assert min(r.first_token_at for r in late) < long.last_token_at
    assert engine.scheduler.steps - steps_before < 3 * N_NEW  # shared steps, not one run after another
    assert sorted(engine.scheduler.free) == [0, 1, 2, 3] and engine.scheduler.n_active == 0


def test_stream_yields_the_generated_tokens(engine, reference):
    p = PROMPTS[1]
    pieces = list(engine.stream(p, max_new_tokens=N_NEW))
    assert [t.id for t in pieces if t.id != engine.tokenizer.eos_id] == reference[p]
    assert "".join(t.text for t in pieces) == engine.generate(p, max_new_tokens=N_NEW).text
    # a stop string ends the text before it, in generate and in stream alike
    full = engine.tokenizer.decode(reference[p])
    stop = full[5:7]
    r = engine.generate(p, max_new_tokens=N_NEW, stop=[stop])
    assert r.finish_reason == "stop" and r.text == full[:full.find(stop)]
    assert "".join(t.text for t in engine.stream(p, max_new_tokens=N_NEW, stop=stop)) == r.text


def test_closing_a_stream_frees_its_slot(engine):
    it = engine.stream(PROMPTS[0], max_new_tokens=100, ignore_eos=True)
    next(it), next(it)
    it.close()
    deadline = time.monotonic() + 10
    while engine.scheduler.n_active and time.monotonic() < deadline:
        time.sleep(0.01)
    assert engine.scheduler.n_active == 0 and len(engine.scheduler.free) == 4


def test_seeded_sampling_does_not_depend_on_the_batch(engine):
    kw = dict(max_new_tokens=16, temperature=0.9, top_k=50, top_p=0.95, seed=7)
    batched = engine.generate(PROMPTS[:3], **kw)
    alone = [engine.generate(p, **kw) for p in PROMPTS[:3]]
    assert [r.token_ids for r in batched] == [r.token_ids for r in alone]
    assert engine.generate(PROMPTS[0], **{**kw, "seed": 8}).token_ids != alone[0].token_ids


def test_pass_threads_are_tuned_per_pass_size_and_do_not_change_tokens(model_dir, reference):
    from prunus.serve.pass_threads import PassThreads

    main_threads = torch.get_num_threads()
    torch.set_num_threads(2)  # new threads start from the main thread's setting: 1 against 2 is timed
    try:
        with Engine.load(model_dir, max_batch=4, backend="torch") as e:  # the torch backend tunes its threads
            plan = e.scheduler.threads
            assert set(plan.by_tokens) == {1, 4, 4 * 16}  # decode of 1 row, of 4, a prefill
            assert set(plan.by_tokens.values()) <= {1, 2} and e.info["threads"] == plan.describe()
            assert [r.token_ids for r in e.generate(PROMPTS[:3], max_new_tokens=N_NEW)] == [reference[p] for p in PROMPTS[:3]]
        assert torch.get_num_threads() == 2  # the scheduler thread's settings stay its own
        for n in (1, 2):  # tokens do not depend on the thread count
            with Engine.load(model_dir, max_batch=4, threads=n, backend="torch") as e:
                assert e.scheduler.threads.by_tokens == {1: n}
                assert [r.token_ids for r in e.generate(PROMPTS[:3], max_new_tokens=N_NEW)] == [reference[p] for p in PROMPTS[:3]]
    finally:
        torch.set_num_threads(main_threads)
    split = PassThreads({1: 1, 8: 2, 128: 4})
    assert [split.for_tokens(t) for t in (1, 2, 3, 8, 30, 33, 500)] == [1, 1, 2, 2, 2, 4, 4]
    for bad in (0, -1, 1.5, True):
        with pytest.raises(PrunusError, match="threads="):
            Engine.load(model_dir, threads=bad)


def test_compiled_decode_gives_the_eager_tokens(model_dir, reference):
    # one batch bucket (max_batch=1) keeps the compile to one graph; requests queue and take turns
    with Engine.load(model_dir, max_batch=1, compile=True) as e:
        assert e.backend.compiled is not None and e.backend.compiled.buckets == [1]
        assert [r.token_ids for r in e.generate(PROMPTS[:2], max_new_tokens=N_NEW)] == [reference[p] for p in PROMPTS[:2]]
    with pytest.raises(PrunusError, match="serves tp=2 and compile=True together; drop --tp or --compile"):
        Engine.load(model_dir, tp=2, compile=True)


def test_static_decode_steps_pad_to_buckets_and_equal_the_ragged_cache(model_dir):
    """The compiled path's Python side, run eagerly: padded buckets, full-length masks, row gathers."""
    from prunus.runtime.torch import TorchBackend
    from prunus.runtime.compiled_decode import CompiledDecode

    model = load_model(model_dir)
    ragged, static = TorchBackend(model, 4, 64), TorchBackend(model, 4, 64)
    static_decode = CompiledDecode(model, static.cache)
    static_decode._fn = static_decode._step  # no compile: the same graph, eager
    assert static_decode.buckets == [1, 2, 4] and static_decode.bucket(3) == 4
    prompts = [[5, 6, 7], [9] * 10, [3, 4], [8] * 6]
    for be in (ragged, static):
        be.prefill([0, 1, 2, 3], prompts)
    for step, rows in enumerate([[0, 1, 2, 3], [0, 2, 3], [1], [1, 3], [0, 1, 2], [2, 3]]):
        tokens = [(7 * step + r) % 300 for r in rows]
        torch.testing.assert_close(static_decode(rows, tokens), ragged.decode(rows, tokens), atol=1e-5, rtol=0)
    assert torch.equal(static.cache.lengths, ragged.cache.lengths)
    static.cache.lengths[0] = 64
    with pytest.raises(PrunusError, match="exceed its capacity"):
        static_decode([0], [1])


def test_bad_input_is_one_clear_error(engine, model_dir, tmp_path):
    too_long = "x" * 130
    with pytest.raises(PrunusError, match="exceeds the context of 128"):
        engine.generate(too_long, max_new_tokens=4)
    with pytest.raises(PrunusError, match="exceeds the context"):
        engine.generate("x", max_new_tokens=10**9)
    for bad in (0, -3, True, 2.5):
        with pytest.raises(PrunusError, match="max_new_tokens"):
            engine.generate("x", max_new_tokens=bad)
    with pytest.raises(PrunusError, match="empty"):
        engine.generate("", max_new_tokens=4)
    with pytest.raises(PrunusError, match="temperature"):
        engine.generate("x", temperature=-1)
    with pytest.raises(PrunusError, match="tp=3 does not divide .*n_kv_heads=2"):
        Engine.load(model_dir, tp=3)
    with pytest.raises(PrunusError, match="cannot load a model dir"):
        Engine.load(model_dir, backend="onnxruntime")
    with pytest.raises(PrunusError, match="no such directory"):
        Engine.load(tmp_path / "absent")
    fake = tmp_path / "export"
    fake.mkdir()
    (fake / "config.json").write_text((model_dir / "config.json").read_text()[:-2] + ', "export": {"format": "onnx", '
                                      '"graphs": {"prefill": "prefill.onnx", "decode": "decode.onnx"}, "n_layers": 2, '
                                      '"n_kv_heads": 2, "head_dim": 16, "vocab_size": 320, "max_seq_len": 128}}')
    (fake / "prefill.onnx").write_bytes(b"not a graph")
    (fake / "decode.onnx").write_bytes(b"not a graph")
    with pytest.raises(PrunusError, match="missing prunus.json"):  # checked against its manifest like a model dir
        Engine.load(fake)
    (fake / "prunus.json").write_text(json.dumps({"files": {
        n: hashlib.sha256((fake / n).read_bytes()).hexdigest() for n in ("config.json", "prefill.onnx", "decode.onnx")}}))
    with pytest.raises(PrunusError, match="prefill.onnx: ONNX Runtime cannot load it"):
        Engine.load(fake)
    with pytest.raises(PrunusError, match="the torch backend cannot load an export dir"):
        Engine.load(fake, backend="torch")
    with pytest.raises(PrunusError, match="tensorrt backend cannot load an export dir in onnx"):
        Engine.load(fake, backend="tensorrt")
    assert engine.generate("x", max_new_tokens=2).token_ids  # still serving


def test_tensorrt_backend_needs_tensorrt_and_a_gpu():
    from prunus.runtime.tensorrt import check_tensorrt

    try:
        import tensorrt  # noqa: F401
        have = torch.cuda.is_available()
    except ImportError:
        have = False
    if have:
        pytest.skip("TensorRT and a GPU are present: the end-to-end path runs in test_export's engines")
    with pytest.raises(PrunusError, match="tensorrt"):
        check_tensorrt()


# --- tensor parallelism: one spawn of two workers for every check ----------------------------------


@pytest.fixture(scope="module")
def mixed_model_dir(tmp_path_factory):
    """Block 0 quantized (int8 weights, per-group scales), block 1 plain: both kinds of sharding in one model."""
    from prunus.compress.quantize import quantize_pass

    torch.manual_seed(1)
    model = Transformer(get_preset("tiny"))
    model.init_weights()
    quantize_pass(model.eval(), None, scheme="int8-weight-only", granularity="per_group", group_size=16,
                  exclude=("output", "layers.1"))
    return save_model(model, tmp_path_factory.mktemp("serve") / "mixed", stage="test")


def test_tensor_parallel_equals_one_process_and_leaves_no_workers(mixed_model_dir, children):
    model, tok = load_model(mixed_model_dir), load_model_tokenizer(mixed_model_dir)
    assert type(model.layers["0"].attention.wo).__name__ == "QuantizedLinear"
    reference = {}
    for p in PROMPTS:
        ids = [int(t[0]) for t in stream_tokens(model, torch.tensor([tok.encode(p)]), N_NEW, eos_id=tok.eos_id)]
        reference[p] = [t for t in ids if t != tok.eos_id]
    kw = dict(max_new_tokens=12, temperature=0.9, top_k=40, seed=3)
    with Engine.load(mixed_model_dir, max_batch=4) as one:
        sampled = [r.token_ids for r in one.generate(PROMPTS[:2], **kw)]
    before = set(children(os.getpid())) if sys.platform.startswith("linux") else set()
    tp = Engine.load(mixed_model_dir, tp=2, max_batch=4)
    try:
        pids = tp.backend.worker_pids()
        assert len(pids) == 2
        if tp.backend._shm:  # the shared all-reduce file is unlinked once mapped: nothing to leak
            assert not Path(tp.backend._shm).exists()
        batched = tp.generate(PROMPTS, max_new_tokens=N_NEW)
        assert [r.token_ids for r in batched] == [reference[p] for p in PROMPTS]
        assert [r.token_ids for r in tp.generate(PROMPTS[:2], **kw)] == sampled
        # continuous batching across the workers: a request joins one that is decoding
        long = tp.submit(PROMPTS[2], max_new_tokens=N_NEW, ignore_eos=True)
        long.events.get()
        late = Engine.wait(tp.submit(PROMPTS[4], max_new_tokens=N_NEW))
        assert late.token_ids == reference[PROMPTS[4]]
        assert Engine.wait(long).token_ids[:len(reference[PROMPTS[2]])] == reference[PROMPTS[2]]
        streamed = [t.id for t in tp.stream(PROMPTS[1], max_new_tokens=N_NEW)]
        assert [t for t in streamed if t != tok.eos_id] == reference[PROMPTS[1]]
        with pytest.raises(PrunusError, match="exceeds the context"):
            tp.generate("x" * 200, max_new_tokens=1)
        assert tp.generate(PROMPTS[3], max_new_tokens=N_NEW).token_ids == reference[PROMPTS[3]]
    finally:
        tp.close()
    for pid in pids:
        assert not Path(f"/proc/{pid}").exists(), f"worker {pid} still running after close()"
    if sys.platform.startswith("linux"):
        assert set(children(os.getpid())) <= before


def test_shared_memory_all_reduce_sums_identically_on_every_rank(tmp_path):
    import subprocess

    from prunus.runtime.shm_all_reduce import ShmAllReduce

    sys.path.insert(0, str(Path(__file__).parent))
    from shm_worker import SLOT, tensors

    world, path = 3, tmp_path / "shm"
    ShmAllReduce.create(path, world, slot_floats=SLOT)
    worker = Path(__file__).parent / "shm_worker.py"
    procs = [subprocess.Popen([sys.executable, str(worker), str(path), str(r), str(world), str(tmp_path / f"{r}.pt")])
             for r in range(world)]
    assert [p.wait(120) for p in procs] == [0] * world
    results = [torch.load(tmp_path / f"{r}.pt") for r in range(world)]
    for name in tensors(0):
        inputs = [tensors(r)[name].float() for r in range(world)]
        expected = inputs[0] + inputs[1] + inputs[2]  # rank order, as the slots are summed
        for res in results:
            assert torch.equal(res[name], results[0][name]), f"{name}: ranks disagree"
            assert res[name].shape == inputs[0].shape and res[name].dtype == tensors(0)[name].dtype
            assert torch.allclose(res[name].float(), expected.to(tensors(0)[name].dtype).float(), atol=1e-6, rtol=0)
    for res in results[:-1]:
        assert "rank 2" in res["after_exit"] and "exited" in res["after_exit"]


# --- sharding quantized layers -----------------------------------------------------------------------


@pytest.mark.parametrize("scheme,granularity", [
    ("int8-weight-only", "per_channel"), ("int8-weight-only", "per_group"), ("int8-weight-only", "per_tensor"),
    ("w8a8-dynamic", "per_channel"), ("fp8-weight-only", "per_channel"),
])
def test_sharded_quantized_linear_equals_the_whole(scheme, granularity):
    """Column shards concatenate, and row shards sum, to the unsharded QuantizedLinear's output."""
    import copy

    from prunus.models.quantized import QuantizedLinear
    from prunus.runtime.tp_shard import shard_linear

    torch.manual_seed(0)
    q = QuantizedLinear.from_linear(torch.nn.Linear(64, 32, bias=False), scheme, granularity,
                                    16 if granularity == "per_group" else None)
    x = torch.randn(3, 64)
    whole = q(x)
    cols, rows = [], []
    for rank in range(2):
        c, r = copy.deepcopy(q), copy.deepcopy(q)
        shard_linear(c, "column", rank, 2)
        shard_linear(r, "row", rank, 2)
        assert c.weight.dtype == q.weight.dtype and c.out_features == 16 and r.in_features == 32
        cols.append(c(x))
        rows.append(r(x[:, rank * 32:(rank + 1) * 32]))
    torch.testing.assert_close(torch.cat(cols, dim=-1), whole, rtol=0, atol=0)
    # w8a8-dynamic quantizes each rank's slice of the activations with its own per-token scale
    atol = 0.02 * whole.abs().max().item() if scheme == "w8a8-dynamic" else 1e-5
    torch.testing.assert_close(rows[0] + rows[1], whole, rtol=0, atol=atol)


def test_per_group_scales_that_a_rank_would_split_are_refused():
    from prunus.models.quantized import QuantizedLinear
    from prunus.runtime.tp_shard import shard_linear

    q = QuantizedLinear.from_linear(torch.nn.Linear(48, 8, bias=False), "int8-weight-only", "per_group", 16)
    with pytest.raises(PrunusError, match="group size 16"):
        shard_linear(q, "row", 0, 2)  # 24 inputs per rank: not whole groups of 16


# --- ONNX Runtime: a real export of the trained tiny model --------------------------------------------


@pytest.fixture(scope="module")
def onnx_export(trained_run, tmp_path_factory):
    export = pytest.importorskip("prunus.export")
    out = tmp_path_factory.mktemp("serve") / "onnx"
    export.export_model(trained_run / "model", out, progress=False, eval_tokens=512, graph="torch")  # the two-graph backend
    return out


def test_onnxruntime_backend_greedy_equals_torch(onnx_export, trained_run):
    prompts = ["import ", "def main(", "x = [", "class Config:\n    "]
    with Engine.load(trained_run / "model", max_batch=3) as torch_engine:
        ref = [r.token_ids for r in torch_engine.generate(prompts, max_new_tokens=N_NEW)]
    with Engine.load(onnx_export, max_batch=3, threads=1) as ort:  # backend inferred from the export dir
        assert ort.info["backend"] == "onnxruntime" and ort.info["precision"] == "fp32"
        assert ort.backend.runner.sessions["decode"].get_session_options().intra_op_num_threads == 1
        # four prompts through three rows: ragged batches, a freed row reused
        assert [r.token_ids for r in ort.generate(prompts, max_new_tokens=N_NEW)] == ref
        long = ort.submit(prompts[3], max_new_tokens=N_NEW)
        long.events.get()
        assert Engine.wait(ort.submit(prompts[1], max_new_tokens=N_NEW)).token_ids == ref[1]
        assert Engine.wait(long).token_ids == ref[3]
        assert [t.id for t in ort.stream(prompts[0], max_new_tokens=N_NEW) if t.id != ort.tokenizer.eos_id] == ref[0]
        with pytest.raises(PrunusError, match="exceeds the context"):
            ort.generate("x" * 300, max_new_tokens=1)
