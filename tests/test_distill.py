"""Distillation: students derived from a teacher, the KD loss by hand, training on the parallel engine.

The teacher is a tiny 4-block model trained for a few steps; distillation runs use a few
steps on 32-token windows. Two ranks (DDP and FSDP, one spawn; and the torchrun launch of
``distill(nproc=2)``) must give the losses of one process within 1e-5.
"""

import copy
import math
from pathlib import Path

import pytest
import torch

from prunus.compress.context import build_context
from prunus.compress import distill_loss
from prunus.compress.distill import default_schedule, distill, distill_pass
from prunus.compress.distill_loss import DistillObjective, chunked_ce_kd, kd_loss, layer_map
from prunus.compress.student import make_student
from prunus.artifacts.errors import PrunusError
from prunus.models import Transformer, load_model, save_model
from prunus.models.compression_state import compression_state
from prunus.train_parallel import TrainConfig, train

TOL = 1e-5
WORKER = Path(__file__).with_name("parallel_worker.py")
CONTEXT = dict(max_corpus_bytes=200_000, seq_len=32, eval_tokens=1024)
SHORT = dict(batch_size=4, seq_len=32, progress=False)


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("teacher") / "run"
    r = train(TrainConfig(out=str(out), preset="tiny", model={"n_layers": 4}, seq_len=32, batch_size=4, steps=8,
                          warmup_steps=2, eval_every=8, eval_tokens=1024, ckpt_every=0, max_corpus_bytes=200_000,
                          progress=False))
    return r.model_dir


@pytest.fixture(scope="module")
def ctx(teacher_dir):
    return build_context(teacher_dir, **CONTEXT)


def blocks_equal(a, b) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_keep_every_copies_every_kth_block(ctx):
    t = ctx.teacher
    for k, kept in ((2, [0, 2]), (3, [0, 3]), (1, [0, 1, 2, 3])):
        s = make_student(t, f"keep-every:{k}")
        assert s.config == t.config.replace(n_layers=len(kept)) and list(s.layers) == [str(i) for i in range(len(kept))]
        for i, j in enumerate(kept):
            assert blocks_equal(s.layers[str(i)], t.layers[str(j)])
            assert s.layers[str(i)].attention.layer_id == i
        for name in ("tok_embeddings", "norm", "output"):
            assert blocks_equal(getattr(s, name), getattr(t, name))
    for bad in ("keep-every:0", "keep-every:5", "keep-every:1.5", "keep-every:x"):
        with pytest.raises(PrunusError, match="keep-every"):
            make_student(t, bad)


def test_width_student_takes_the_strongest_channels_heads_and_units(ctx):
    t = copy.deepcopy(ctx.teacher)  # tiny: dim 64, 4 heads in 2 kv groups of 16, ffn 192
    with torch.no_grad():  # make residual channel 5, kv group 0 of every block and unit 7 of block 1 worthless
        for name, p in t.named_parameters():
            if name == "tok_embeddings.weight" or name == "output.weight" or name.endswith(("wq.weight", "wk.weight", "wv.weight", "w1.weight", "w3.weight")):
                p[:, 5] = 0
            if name.endswith(("wo.weight", "w2.weight")):
                p[5, :] = 0
            if name.endswith(("wk.weight", "wv.weight")):
                p[:16] = 0
            if name.endswith("wq.weight"):
                p[:32] = 0
            if name.endswith("wo.weight"):
                p[:, :32] = 0
        t.layers["1"].feed_forward.w1.weight[7] = 0
    s = make_student(t, "width:2")
    c = s.config
    assert (c.dim, c.n_heads, c.n_kv_heads, c.ffn_dim, c.head_dim, c.n_layers) == (32, 2, 1, 96, 16, 4)
    ch = compression_state(s).student_channels
    assert len(ch) == 32 and 5 not in ch.tolist()
    torch.testing.assert_close(s.tok_embeddings.weight, t.tok_embeddings.weight[:, ch], rtol=0, atol=0)
    torch.testing.assert_close(s.output.weight, t.output.weight[:, ch], rtol=0, atol=0)
    for i in range(4):
        sb, tb = s.layers[str(i)], t.layers[str(i)]
        # the kept kv group is group 1 (rows 16..31 of wk / wv, q heads 2 and 3 = rows 32..63 of wq)
        torch.testing.assert_close(sb.attention.wk.weight, tb.attention.wk.weight[16:32][:, ch], rtol=0, atol=0)
        torch.testing.assert_close(sb.attention.wq.weight, tb.attention.wq.weight[32:64][:, ch], rtol=0, atol=0)
        torch.testing.assert_close(sb.attention.wo.weight, tb.attention.wo.weight[ch][:, 32:64], rtol=0, atol=0)
        torch.testing.assert_close(sb.attention_norm.weight, tb.attention_norm.weight[ch], rtol=0, atol=0)
        w1 = tb.feed_forward.w1.weight[:, ch]
        rows = [next(j for j in range(192) if torch.equal(w1[j], r)) for r in sb.feed_forward.w1.weight]
        assert rows == sorted(rows) and len(set(rows)) == 96 and (i != 1 or 7 not in rows)
        torch.testing.assert_close(sb.feed_forward.w2.weight, tb.feed_forward.w2.weight[ch][:, rows], rtol=0, atol=0)
    assert s(torch.zeros(1, 8, dtype=torch.long)).shape == (1, 8, 320)
    assert sum(p.numel() for p in s.parameters()) <= sum(p.numel() for p in t.parameters()) / 2
    with pytest.raises(PrunusError, match="width"):
        make_student(t, "width:4")  # 2 kv heads / 4: none left


def test_config_students_copy_what_fits(ctx):
    t = ctx.teacher
    s = make_student(t, {"n_layers": 2})
    assert s.config == t.config.replace(n_layers=2) and blocks_equal(s.layers["1"], t.layers["1"])
    s = make_student(t, {"dim": 32, "n_heads": 2, "n_kv_heads": 1, "ffn_dim": 64})
    assert s.config.dim == 32 and s.tok_embeddings.weight.shape == (320, 32)
    assert make_student(t, "tiny").config.vocab_size == t.config.vocab_size
    both = make_student(t, "keep-every:2,width:2")  # left to right: blocks 0 and 2, then half width
    half = make_student(make_student(t, "keep-every:2"), "width:2")
    assert both.config == half.config and both.config.n_layers == 2 and both.config.dim == 32 and blocks_equal(both, half)
    for bad, needle in (("huge", "unknown student"), ({"vocab_size": 512}, "vocabulary"), ({"depth": 2}, "unknown field"), (3, "student")):
        with pytest.raises(PrunusError, match=needle):
            make_student(t, bad)


def test_kd_loss_matches_a_hand_computation():
    s = torch.tensor([[[1.0, 0.0, -1.0], [0.5, 0.5, 2.0]]])
    t = torch.tensor([[[2.0, 0.0, 0.0], [0.0, 1.0, 1.0]]])
    T = 2.0

    def softmax(row):
        e = [math.exp(v / T) for v in row]
        return [v / sum(e) for v in e]

    def kl(p, q):
        return sum(a * math.log(a / b) for a, b in zip(p, q))

    ps, pt = [softmax(r) for r in s[0].tolist()], [softmax(r) for r in t[0].tolist()]
    fwd = sum(kl(a, b) for a, b in zip(pt, ps)) / 2 * T**2
    rev = sum(kl(a, b) for a, b in zip(ps, pt)) / 2 * T**2
    assert float(kd_loss(s, t, T)) == pytest.approx(fwd, rel=1e-5)
    assert float(kd_loss(s, t, T, reverse_kl=1.0)) == pytest.approx(rev, rel=1e-5)
    assert float(kd_loss(s, t, T, reverse_kl=0.3)) == pytest.approx(0.7 * fwd + 0.3 * rev, rel=1e-5)
    assert float(kd_loss(s, t, 1.0)) != pytest.approx(float(kd_loss(s, t, T)))
    assert layer_map(2, 4) == [1, 3] and layer_map(3, 4) == [0, 1, 3] and layer_map(4, 4) == [0, 1, 2, 3]


def test_chunked_loss_matches_the_whole_one_with_its_gradients(ctx, monkeypatch):
    """CE + KD over chunks of 7 positions (checkpointed, teacher logits from its hidden states) equals the
    loss on whole logits, value and gradient."""
    student = make_student(ctx.teacher, "keep-every:2").train()
    x = ctx.calibration(1, 3, 32)[0]
    y = torch.roll(x, -1, dims=1)
    with torch.no_grad():
        t_logits = ctx.teacher(x)

    def grads(loss_fn):
        student.zero_grad()
        loss = loss_fn(student(x))
        loss.backward()
        return float(loss.detach()), [p.grad.clone() for p in student.parameters()]

    def whole(logits):
        ce = torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())
        return 0.3 * ce + 0.7 * kd_loss(logits, t_logits, 2.0, 0.25)

    monkeypatch.setattr(distill_loss, "LOGITS_BYTES", 4 * ctx.teacher.config.vocab_size * 7)
    obj = DistillObjective(ctx.teacher, student, kd_weight=0.7, temperature=2.0, reverse_kl=0.25)
    want, want_g = grads(whole)
    got, got_g = grads(lambda logits: obj(logits, x, y))
    obj.close()
    assert obj._head_last and got == pytest.approx(want, rel=1e-5)
    for a, b in zip(got_g, want_g):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    ce, kd = chunked_ce_kd(t_logits, y, t_logits, None, ce=False)
    assert float(ce) == 0 and abs(float(kd)) < 1e-6


def test_default_schedule_scales_with_the_model(ctx):
    from types import SimpleNamespace

    student = make_student(ctx.teacher, "keep-every:2")
    steps, rows, window = default_schedule(student, ctx)
    assert (rows, window) == (16, ctx.seq_len) and 20 <= steps <= 200
    assert default_schedule(student, ctx, steps=3, batch_size=4, seq_len=16) == (3, 4, 16)
    big = SimpleNamespace(seq_len=1024, teacher=ctx.teacher)  # a long context and a 49k vocabulary: fewer rows
    wide = make_student(ctx.teacher, {"vocab_size": ctx.teacher.config.vocab_size, "max_seq_len": 8192})
    wide.config = wide.config.replace(vocab_size=49152)
    steps, rows, window = default_schedule(wide, big, nproc=2)
    assert window == min(512, ctx.teacher.config.max_seq_len)
    assert rows == min(16, (1 << 30) // (16 * 49152 * window)) // 2 * 2  # logits memory bounds the rows, a multiple of nproc


def test_an_exact_copy_has_zero_kd_loss_and_zero_gradients(ctx):
    student = copy.deepcopy(ctx.teacher).train()
    for p in student.parameters():
        p.requires_grad_(True)
    x = ctx.calibration(1, 4, 32)[0]
    obj = DistillObjective(ctx.teacher, student, kd_weight=1.0, hidden_weight=1.0)
    loss = obj(student(x), x, x)
    loss.backward()
    obj.close()
    assert abs(float(loss.detach())) < 1e-6 and obj.history[0]["kd"] < 1e-6 and obj.history[0]["hidden"] == 0
    assert max(float(p.grad.abs().max()) for p in student.parameters()) < 1e-6
    # and through the engine: step 1's loss and gradient norm
    r = distill(copy.deepcopy(ctx.teacher), ctx, steps=1, kd_weight=1.0, **SHORT)
    assert abs(r.losses[0]) < 1e-6 and r.metrics["grad_norm"] < 1e-5


def test_a_few_steps_reduce_the_kd_loss_and_the_pass_returns_a_clean_student(ctx, tmp_path):
    r = distill(make_student(ctx.teacher, "keep-every:2"), ctx, steps=30, lr=3e-3, kd_weight=1.0, **SHORT)
    first, last = r.losses[0], sum(r.losses[-5:]) / 5
    assert last < 0.6 * first, r.losses
    m = distill_pass(ctx.teacher, ctx, student="width:2", steps=3, hidden_weight=1.0, **SHORT)
    assert not m.training and not hasattr(m, "distill_proj") and m.config.dim == 32
    assert set(m.state_dict()) == set(Transformer(m.config).state_dict())
    rec = compression_state(m).distillation
    assert rec["student"] == "width:2" and rec["student_params"] < rec["teacher_params"] / 2 and rec["val_bpb"] > 0
    back = load_model(save_model(m, tmp_path / "s", tokenizer=ctx.tokenizer, stage="compress"))
    x = ctx.calibration(1, 2, 16)[0]
    torch.testing.assert_close(back(x), m(x), rtol=0, atol=0)
    with pytest.raises(PrunusError, match="kd_weight"):
        distill_pass(ctx.teacher, ctx, kd_weight=1.5, **SHORT)


def test_fine_tuning_in_place_keeps_pruned_weights_at_zero(ctx):
    model = copy.deepcopy(ctx.teacher)
    w = model.layers["0"].feed_forward.w1.weight
    with torch.no_grad():
        w[:, ::2] = 0
    before = w.detach().clone()
    compression_state(model).sparsity = {"method": "magnitude", "achieved": 0.5}
    out = distill_pass(model, ctx, student=None, steps=3, **SHORT)
    assert out is model and compression_state(out).sparsity["achieved"] == 0.5
    after = out.layers["0"].feed_forward.w1.weight
    assert bool((after[:, ::2] == 0).all()) and not torch.equal(after[:, 1::2], before[:, 1::2])
    assert not any(p._backward_hooks for p in out.parameters())  # the masks went with the run


def reference_losses(ctx, student: str, args: dict) -> dict:
    r = distill(make_student(ctx.teacher, student), ctx, nproc=1, progress=False, **args)
    return {"losses": r.losses, "val_loss": r.metrics["val_loss"]}


def assert_close_runs(got: dict, ref: dict, name: str) -> None:
    assert "error" not in got, f"{name}: {got.get('error')}\n{got.get('trace')}"
    assert len(got["losses"]) == len(ref["losses"]), name
    for step, (a, b) in enumerate(zip(got["losses"], ref["losses"])):
        assert abs(a - b) <= TOL, f"{name} step {step + 1}: loss {a} vs {b} in one process"
    assert abs(got["val_loss"] - ref["val_loss"]) <= TOL, name


def test_two_ranks_distill_like_one_process(ctx, teacher_dir, tmp_path, spawn_jobs):
    args = dict(steps=3, batch_size=4, seq_len=32, hidden_weight=0.5, reverse_kl=0.25)
    # DDP with hidden-state projections (width:2), FSDP with same-width hidden states (keep-every:2)
    jobs = [{"name": name, "distill": {"model_dir": str(teacher_dir), "context": CONTEXT, "student": student,
                                        "args": {**args, "zero": zero}}}
            for name, student, zero in (("ddp", "width:2", 0), ("fsdp", "keep-every:2", 3))]
    results = spawn_jobs(WORKER, 2, jobs, tmp_path)
    assert_close_runs(results["ddp"], reference_losses(ctx, "width:2", args), "ddp")
    assert_close_runs(results["fsdp"], reference_losses(ctx, "keep-every:2", args), "fsdp")
    # distill(nproc=2) from a plain process launches torchrun itself
    r = distill(make_student(ctx.teacher, "keep-every:2"), ctx, nproc=2, steps=3, batch_size=4, seq_len=32, progress=False)
    assert_close_runs({"losses": r.losses, "val_loss": r.metrics["val_loss"]},
                      reference_losses(ctx, "keep-every:2", dict(steps=3, batch_size=4, seq_len=32)), "launched")
    assert r.model.config.n_layers == 2 and not r.model.training
