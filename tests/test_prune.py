"""Pruning passes: exact sparsity, the 2:4 pattern, Wanda against magnitude, and structured surgery."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from prunus.compress.context import PassContext
from prunus.compress.prune import input_norms, prunable_linears, prune_pass, semi_structured_available, to_semi_structured
from prunus.compress.prune_structured import prune_structured_pass
from prunus.models import ByteTokenizer, PrunusError, Transformer, get_preset, load_model, save_model
from prunus.models.compression_state import compression_state


def make_ctx(model, seq_len=32) -> PassContext:
    """Calibration from real text: the source of the json package, as bytes."""
    tok = ByteTokenizer()
    text = b"".join(p.read_bytes() for p in sorted(Path(json.__file__).parent.glob("*.py")))
    tokens = tok.encode_array(text)
    half = len(tokens) // 2
    return PassContext(teacher=model, tokenizer=tok, train_tokens=tokens[:half], val_tokens=tokens[half:],
                       token_bytes=tok.token_bytes(), seq_len=seq_len)


def logits(model, tokens):
    with torch.no_grad():
        return model(tokens)


TOKENS = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(1))


# --- unstructured ----------------------------------------------------------------------------


@pytest.mark.parametrize("method", ["magnitude", "wanda"])
@pytest.mark.parametrize("sparsity", [0.5, 0.3])
def test_layer_scope_exact_sparsity(tiny_model, method, sparsity):
    params = {name: p for name, p in tiny_model.named_parameters()}
    before = {name: p.detach().clone() for name, p in params.items()}
    model = prune_pass(tiny_model, make_ctx(tiny_model), method=method, sparsity=sparsity, n_calib=2)
    rec = compression_state(model).sparsity
    linears = prunable_linears(model)
    assert sorted(rec["per_module"]) == sorted(linears) and len(linears) == 2 * 7 and rec["excluded"] == ["output"]
    for name, m in linears.items():
        zeros = m.weight == 0
        if method == "wanda":  # ranked per output row: every row at the target
            assert (zeros.sum(1) == round(sparsity * m.in_features)).all(), name
        else:
            assert int(zeros.sum()) == round(sparsity * m.weight.numel()), name
        assert rec["per_module"][name] == int(zeros.sum()) / m.weight.numel()
        kept = ~zeros
        assert torch.equal(m.weight[kept], before[name + ".weight"][kept])  # survivors untouched
        # applied for good: no reparametrization, same Parameter object
        assert not hasattr(m, "parametrizations") and not hasattr(m, "weight_orig") and not m._forward_pre_hooks
        assert m.weight is params[name + ".weight"]
    assert torch.equal(model.output.weight, before["output.weight"])
    assert torch.equal(model.tok_embeddings.weight, before["tok_embeddings.weight"])
    assert rec["achieved"] == pytest.approx(sparsity, abs=0.01)
    assert rec["method"] == method and rec["scope"] == "layer" and rec["target"] == sparsity


@pytest.mark.parametrize("method", ["magnitude", "wanda"])
def test_global_scope_one_threshold(tiny_model, method):
    ctx = make_ctx(tiny_model)
    dense = {name: m.weight.detach().clone() for name, m in prunable_linears(tiny_model).items()}
    norms = input_norms(tiny_model, prunable_linears(tiny_model), ctx.calibration(2)) if method == "wanda" else None
    model = prune_pass(tiny_model, ctx, method=method, sparsity=0.6, scope="global", n_calib=2)
    rec = compression_state(model).sparsity
    total = sum(w.numel() for w in dense.values())
    zeros = sum(int((m.weight == 0).sum()) for m in prunable_linears(model).values())
    assert zeros == round(0.6 * total) and rec["achieved"] == zeros / total
    assert len({round(v, 3) for v in rec["per_module"].values()}) > 1  # layers end at different sparsities
    # every pruned score is at most every kept score, across all layers
    pruned, kept = [], []
    for name, w in dense.items():
        score = w.abs()
        if norms is not None:
            score = score * norms[name] / norms[name].mean()
        mask = prunable_linears(model)[name].weight == 0
        pruned.append(score[mask]), kept.append(score[~mask])
    assert torch.cat(pruned).max() <= torch.cat(kept).min()


def test_row_scope_and_records_history(tiny_model):
    ctx = make_ctx(tiny_model)
    model = prune_pass(tiny_model, ctx, method="magnitude", sparsity=0.25, scope="row")
    for m in prunable_linears(model).values():
        assert ((m.weight == 0).sum(1) == round(0.25 * m.in_features)).all()
    model = prune_pass(model, ctx, method="magnitude", sparsity=0.5, scope="row")
    rec = compression_state(model).sparsity
    assert rec["achieved"] == 0.5 and rec["previous"]["target"] == 0.25


@pytest.mark.parametrize("method", ["2:4", "2:4-magnitude"])
def test_two_four_pattern(tiny_model, method):
    ctx = make_ctx(tiny_model)
    dense = {name: m.weight.detach().clone() for name, m in prunable_linears(tiny_model).items()}
    norms = input_norms(tiny_model, prunable_linears(tiny_model), ctx.calibration(2))
    model = prune_pass(tiny_model, ctx, method=method, n_calib=2)
    for name, m in prunable_linears(model).items():
        groups = (m.weight == 0).reshape(-1, 4)
        assert (groups.sum(1) == 2).all(), name  # exactly 2 of every 4 consecutive inputs
        score = dense[name].abs() * (norms[name] if method == "2:4" else 1)
        score = score.reshape(-1, 4)
        assert (score.masked_fill(~groups, -1).max(1).values <= score.masked_fill(groups, float("inf")).min(1).values).all()
    assert compression_state(model).sparsity["pattern"] == "2:4" and compression_state(model).sparsity["achieved"] == 0.5


class Probe(nn.Module):
    """tokens -> proj(emb(tokens)), with the embedding's channel scales chosen by the test."""

    def __init__(self, scales: torch.Tensor, out: int = 8):
        super().__init__()
        dim = len(scales)
        g = torch.Generator().manual_seed(0)
        self.emb = nn.Embedding(256, dim)
        self.proj = nn.Linear(dim, out, bias=False)
        with torch.no_grad():
            signs = torch.randint(0, 2, (256, dim), generator=g).float() * 2 - 1  # |x_j| = scale_j for every token
            self.emb.weight.copy_(signs * scales)
            self.proj.weight.copy_(torch.randn(out, dim, generator=g))

    def forward(self, tokens):
        return self.proj(self.emb(tokens))


@pytest.mark.parametrize("scope", ["row", "global"])
def test_wanda_equals_magnitude_for_uniform_input_norms(scope):
    a, b = Probe(torch.full((16,), 3.0)), Probe(torch.full((16,), 3.0))
    ctx = make_ctx(a)
    norms = input_norms(a, prunable_linears(a), ctx.calibration(2))
    n_tokens = sum(t.numel() for t in ctx.calibration(2))
    assert torch.allclose(norms["proj"], torch.full((16,), 3.0 * n_tokens ** 0.5))
    prune_pass(a, ctx, method="wanda", scope=scope, exclude=(), n_calib=2)
    prune_pass(b, ctx, method="magnitude", scope=scope, exclude=(), n_calib=2)
    assert torch.equal(a.proj.weight, b.proj.weight)


def test_wanda_differs_from_magnitude_for_skewed_inputs():
    scales = torch.logspace(-1.5, 1.5, 16)  # channel j's inputs are 1000x larger at the top than at the bottom
    a, b = Probe(scales), Probe(scales)
    ctx = make_ctx(a)
    prune_pass(a, ctx, method="wanda", exclude=(), n_calib=2)
    prune_pass(b, ctx, method="magnitude", scope="row", exclude=(), n_calib=2)
    assert not torch.equal(a.proj.weight == 0, b.proj.weight == 0)
    kept = (a.proj.weight != 0).sum(0)  # per input channel
    assert kept[:4].sum() < kept[-4:].sum()  # Wanda keeps the weights fed by large inputs
    x = a.emb(TOKENS).detach()
    dense = Probe(scales).proj(x)
    err_wanda = (a.proj(x) - dense).norm()
    err_magnitude = (b.proj(x) - dense).norm()
    assert err_wanda < err_magnitude  # and so preserves the layer's output better


def test_input_norms_match_a_hand_computation(tiny_model):
    batches = make_ctx(tiny_model).calibration(2)
    norms = input_norms(tiny_model, prunable_linears(tiny_model), batches)
    layer = tiny_model.layers["0"]
    with torch.no_grad():
        x = torch.cat([layer.attention_norm(tiny_model.tok_embeddings(t)).reshape(-1, 64) for t in batches])
    assert torch.allclose(norms["layers.0.attention.wq"], x.norm(dim=0), rtol=1e-5)
    assert torch.equal(norms["layers.0.attention.wq"], norms["layers.0.attention.wv"])


def test_prune_errors(tiny_model):
    ctx = make_ctx(tiny_model)
    for kwargs, needle in [
        (dict(method="random"), "method 'random' is unknown"),
        (dict(method="wanda", sparsity=1.0), "sparsity 1.0"),
        (dict(method="2:4", sparsity=0.7), "50% sparse by construction"),
        (dict(method="2:4", scope="global"), "drop scope=global"),
        (dict(method="wanda", scope="block"), "scope 'block'"),
        (dict(method="wanda", exclude=("layers", "output")), "no float Linear"),
    ]:
        with pytest.raises(PrunusError, match=needle):
            prune_pass(tiny_model, ctx, **kwargs)
    odd = Probe(torch.ones(6))
    with pytest.raises(PrunusError, match="proj has 6 input features, not a multiple of 4"):
        prune_pass(odd, ctx, method="2:4-magnitude", exclude=())


@pytest.mark.skipif(not semi_structured_available()[0], reason=semi_structured_available()[1])
def test_semi_structured_on_cuda(tiny_model):
    model = prune_pass(tiny_model, make_ctx(tiny_model), method="2:4", n_calib=2).half().cuda()
    tokens = TOKENS.cuda()
    dense = logits(model, tokens)
    assert len(to_semi_structured(model)) == 14
    assert torch.allclose(logits(model, tokens), dense, atol=2e-2)


def test_semi_structured_refuses_without_cuda(tiny_model):
    if semi_structured_available()[0]:
        pytest.skip("CUDA 2:4 kernels are present")
    with pytest.raises(PrunusError, match="need CUDA"):
        to_semi_structured(tiny_model)


# --- structured ------------------------------------------------------------------------------


def check_model(model, tmp_path):
    """Config matches shapes and parameter count; save/load gives identical logits."""
    cfg = model.config
    assert sum(p.numel() for p in model.parameters()) == cfg.num_params()
    assert list(model.layers) == [str(i) for i in range(cfg.n_layers)]
    for i, layer in enumerate(model.layers.values()):
        assert layer.attention.layer_id == i
    out = save_model(model, tmp_path / "pruned", stage="compress")
    loaded = load_model(out)
    assert loaded.config == cfg
    assert torch.equal(logits(loaded, TOKENS), logits(model, TOKENS))


def test_heads_removed_by_importance(tiny_model, tmp_path):
    ref = logits(tiny_model, TOKENS)
    model = prune_structured_pass(tiny_model, make_ctx(tiny_model), target="heads", amount=0.5, n_calib=2)
    cfg = model.config
    assert (cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.dim) == (2, 1, 16, 64)
    assert model.layers["0"].attention.wq.weight.shape == (32, 64) and model.layers["0"].attention.wo.weight.shape == (64, 32)
    rec = compression_state(model).sparsity
    assert rec["target"] == "heads" and rec["params_after"] == cfg.num_params() < rec["params_before"]
    for key in ("0", "1"):
        entry = rec["per_module"][f"layers.{key}.attention"]
        imp = entry["importance"]
        assert entry["removed_kv_heads"] == [int(np.argmin(imp))]
        assert entry["removed_heads"] == [2 * g + r for g in entry["removed_kv_heads"] for r in range(2)]
    assert not torch.equal(logits(model, TOKENS), ref)
    check_model(model, tmp_path)


def test_channels_and_blocks_give_smaller_models(tiny_model, tmp_path):
    ctx = make_ctx(tiny_model)
    model = prune_structured_pass(tiny_model, ctx, target="channels", amount=0.25, n_calib=2)
    assert model.config.ffn_dim == 144 and model.layers["1"].feed_forward.w2.weight.shape == (64, 144)
    assert all(len(v["removed_channels"]) == 48 for v in compression_state(model).sparsity["per_module"].values())
    check_model(model, tmp_path / "channels")
    deeper = Transformer(get_preset("tiny").replace(n_layers=3))
    deeper.init_weights()
    model = prune_structured_pass(deeper.eval(), ctx, target="blocks", amount=2, n_calib=2)
    assert model.config.n_layers == 1 and compression_state(model).sparsity["amount"] == 2
    check_model(model, tmp_path / "blocks")


def test_zero_importance_units_are_removed_exactly(tiny_model, tmp_path):
    """Zeroed channels, a zeroed kv group and an identity block carry nothing: removing them
    leaves the logits unchanged, which checks the surgery index by index."""
    with torch.no_grad():
        for key, dead in (("0", [3, 50, 100]), ("1", [0, 7, 191])):
            tiny_model.layers[key].feed_forward.w3.weight[dead] = 0
        tiny_model.layers["0"].attention.wo.weight[:, 0:32] = 0  # kv group 0 = query heads 0, 1
        tiny_model.layers["1"].attention.wo.weight[:, 32:64] = 0  # kv group 1 = query heads 2, 3
    ctx = make_ctx(tiny_model)
    ref = logits(tiny_model, TOKENS)
    model = prune_structured_pass(tiny_model, ctx, target="channels", amount=3 / 192, n_calib=2)
    per_module = compression_state(model).sparsity["per_module"]
    assert per_module["layers.0.feed_forward"]["removed_channels"] == [3, 50, 100]
    assert per_module["layers.1.feed_forward"]["removed_channels"] == [0, 7, 191]
    assert torch.allclose(logits(model, TOKENS), ref, atol=1e-6, rtol=0)
    model = prune_structured_pass(model, ctx, target="heads", amount=0.5, n_calib=2)
    per_module = compression_state(model).sparsity["per_module"]
    assert per_module["layers.0.attention"]["removed_kv_heads"] == [0]
    assert per_module["layers.1.attention"]["removed_kv_heads"] == [1]
    assert compression_state(model).sparsity["previous"]["target"] == "channels"
    assert torch.allclose(logits(model, TOKENS), ref, atol=1e-6, rtol=0)
    deep = Transformer(get_preset("tiny").replace(n_layers=3))
    deep.init_weights()
    with torch.no_grad():
        deep.layers["1"].attention.wo.weight.zero_()
        deep.layers["1"].feed_forward.w2.weight.zero_()  # block 1 is the identity: cos(in, out) = 1
    deep.eval()
    ref = logits(deep, TOKENS)
    model = prune_structured_pass(deep, ctx, target="blocks", amount=1, n_calib=2)
    assert compression_state(model).sparsity["per_module"]["layers.1"]["removed"]
    assert compression_state(model).sparsity["per_module"]["layers.2"]["new_index"] == 1
    assert torch.equal(logits(model, TOKENS), ref)
    check_model(model, tmp_path)


def test_heads_report_what_was_actually_removed():
    """SmolLM2's layout in miniature: 9 heads in 3 kv groups of 3; 0.25 asked -> one group, 3 of 9 heads."""
    torch.manual_seed(0)
    model = Transformer(get_preset("tiny").replace(dim=36, n_heads=9, n_kv_heads=3, head_dim=4)).eval()
    model.init_weights()
    ctx = make_ctx(model)
    new = prune_structured_pass(model, ctx, target="heads", amount=0.25, n_calib=1)
    rec = compression_state(new).sparsity
    assert (new.config.n_heads, new.config.n_kv_heads) == (6, 2)
    assert rec["amount"] == 0.25 and rec["removed_fraction"] == pytest.approx(1 / 3)
    (note,) = ctx.take_notes()
    assert note == rec["summary"]
    assert note.startswith("removed 3 of 9 attention heads in every block (33.3%): heads go in whole kv groups of 3")
    assert "0.25 was asked, 0.333 is the nearest achievable amount" in note
    with pytest.raises(PrunusError, match="achievable amounts: 0.333, 0.667"):
        prune_structured_pass(model, ctx, target="heads", amount=0.1, n_calib=1)
    exact = prune_structured_pass(model, ctx, target="channels", amount=0.5, n_calib=1)
    assert "was asked" not in compression_state(exact).sparsity["summary"]


def test_amount_zero_is_identical(tiny_model):
    ref = logits(tiny_model, TOKENS)
    for target in ("heads", "channels", "blocks"):
        model = prune_structured_pass(tiny_model, make_ctx(tiny_model), target=target, amount=0, n_calib=1)
        assert model is not tiny_model and model.config == tiny_model.config
        assert torch.equal(logits(model, TOKENS), ref)


def test_structured_errors(tiny_model):
    ctx = make_ctx(tiny_model)
    for kwargs, needle in [
        (dict(target="neurons", amount=0.5), "target 'neurons' is unknown"),
        (dict(target="heads", amount=0.1), "removes none of the 2 kv head groups"),
        (dict(target="heads", amount=0.9), "would remove 2 of the 2 kv head groups"),
        (dict(target="channels", amount=1.5), "must be a fraction in"),
        (dict(target="blocks", amount=2), "would remove 2 of the 2 blocks"),
        (dict(target="channels", amount=0.5, n_calib=0), "n_calib 0"),
    ]:
        with pytest.raises(PrunusError, match=needle):
            prune_structured_pass(tiny_model, ctx, **kwargs)


def test_head_dim_config_field():
    cfg = get_preset("small")
    assert cfg.head_dim == 32 and cfg.replace(dim=128).head_dim == 16  # derived: follows dim
    pruned = cfg.replace(n_heads=6, n_kv_heads=3, head_dim=32)  # 256 is not divisible by 6: fine with head_dim set
    assert pruned.head_dim == 32 and pruned.replace(dtype="bfloat16").head_dim == 32
    with pytest.raises(PrunusError, match="divisible by n_heads"):
        cfg.replace(n_heads=6)
    with pytest.raises(PrunusError, match="must be even"):
        cfg.replace(head_dim=15)


def test_mixture_of_experts_router_is_kept():
    torch.manual_seed(0)
    moe = Transformer(get_preset("tiny").replace(n_experts=4, top_k=2))
    moe.init_weights()
    routers = {name: m.weight.detach().clone() for name, m in moe.named_modules() if name.endswith(".router")}
    assert len(routers) == 2
    ctx = make_ctx(moe)
    prune_pass(moe.eval(), ctx, method="wanda", n_calib=1)
    for name, w in routers.items():
        assert torch.equal(moe.get_submodule(name).weight, w)
    assert compression_state(moe).sparsity["achieved"] == 0.5
    with pytest.raises(PrunusError, match="mixture-of-experts"):
        prune_structured_pass(moe, ctx, target="channels", amount=0.25)
