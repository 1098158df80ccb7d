"""prune_channels on attention and on every benchmarked model kind: each head keeps its own channels, a user
attention module's head width follows its cut, every cut module reloads from its shapes to the very outputs of the
module in memory (a ViT-like classifier, an nn.TransformerEncoder over tokens, an MLP, a 1-D CNN regressor), and a
layer that cannot take the cut is one line naming it, with nothing written."""

from __future__ import annotations

import pytest
import torch
from click.testing import CliRunner
from torch import nn

from prunus.compress import compress
from prunus.models.module_dir import load_module, save_module
from prunus.models.module_factory import build_module
from prunus.models.module_reshape import shape_changes

tp = pytest.importorskip("torch_pruning")

from prunus.compress.module_prune import prune_channels  # noqa: E402  (needs torch-pruning)


class UserAttention(nn.Module):
    """timm's attention: a fused qkv projection, heads split by num_heads and head_dim."""

    def __init__(self, dim=16, heads=4, fixed=False):
        super().__init__()
        self.num_heads, self.head_dim, self.fixed = heads, dim // heads, fixed
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)

    def forward(self, x):
        b, n, _ = x.shape
        hd = 4 if self.fixed else self.head_dim  # fixed: a width of its own, which no cut can follow
        q, k, v = self.qkv(x).reshape(b, n, 3, self.num_heads, hd).permute(2, 0, 3, 1, 4).unbind(0)
        out = nn.functional.scaled_dot_product_attention(q, k, v)
        return self.proj(out.transpose(1, 2).reshape(b, n, -1))


class UserViT(nn.Module):
    def __init__(self, fixed=False):
        super().__init__()
        self.embed, self.attn = nn.Linear(8, 16), UserAttention(fixed=fixed)
        self.mlp = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))
        self.head = nn.Linear(16, 3)

    def forward(self, x):
        h = self.embed(x)
        h = h + self.attn(h)
        return self.head((h + self.mlp(h)).mean(1))


def user_vit(fixed=False):
    return UserViT(fixed)


class SeparateAttention(UserAttention):
    """Llama's layout: q_proj, k_proj, v_proj, o_proj, heads by num_heads and head_dim."""

    def __init__(self, dim=16, heads=4):
        nn.Module.__init__(self)
        self.num_heads, self.head_dim = heads, dim // heads
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(dim, dim) for _ in range(4))

    def forward(self, x):
        b, n, _ = x.shape
        split = lambda t: t.view(b, n, self.num_heads, self.head_dim).transpose(1, 2)  # noqa: E731
        out = nn.functional.scaled_dot_product_attention(split(self.q_proj(x)), split(self.k_proj(x)),
                                                         split(self.v_proj(x)))
        return self.o_proj(out.transpose(1, 2).reshape(b, n, -1))


def separate_vit():
    model = UserViT()
    model.attn = SeparateAttention()
    return model


def cnn1d():
    return nn.Sequential(nn.Unflatten(1, (1, -1)), nn.Conv1d(1, 8, 3, padding=1), nn.BatchNorm1d(8), nn.ReLU(),
                         nn.Conv1d(8, 16, 3, stride=2, padding=1), nn.BatchNorm1d(16), nn.ReLU(),
                         nn.AdaptiveAvgPool1d(1), nn.Flatten(), nn.Linear(16, 1))


KINDS = {  # spec -> an input batch
    "test_module_prune_kinds:vit": lambda: torch.randn(3, 3, 8, 8),
    "test_module_prune_kinds:token_encoder": lambda: torch.randint(0, 20, (3, 6)),
    "test_module_prune_kinds:mlp": lambda: torch.randn(3, 6),
    "test_prune_attention:cnn1d": lambda: torch.randn(3, 16),
    "test_prune_attention:user_vit": lambda: torch.randn(3, 5, 8),
    "test_prune_attention:separate_vit": lambda: torch.randn(3, 5, 8),
}


@pytest.mark.parametrize("spec", list(KINDS))
def test_every_kind_reloads_to_the_outputs_of_the_cut_module(spec, tmp_path):
    torch.manual_seed(0)
    model, x = build_module(spec, {}), KINDS[spec]()
    with torch.device("meta"):
        reference = build_module(spec, {}).state_dict()
    done = prune_channels(model, x[:2], 0.5)
    assert done["params_after"] < done["params_before"]
    for m in model.modules():  # a BatchNorm's statistics not at their defaults
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            m.running_mean.uniform_(-1, 1), m.running_var.uniform_(0.5, 2)
    save_module(model, tmp_path / "d", stage="compress", pruned_shapes=shape_changes(model, reference))
    loaded = load_module(tmp_path / "d", trust_factory=True)
    with torch.no_grad():
        assert torch.equal(loaded(x), model.eval()(x))


def _tagged_mha(model):
    """Each query / key / value row's bias set to its own index, so the rows a cut keeps can be read back."""
    mha = next(m for m in model.modules() if isinstance(m, nn.MultiheadAttention))
    with torch.no_grad():
        mha.in_proj_bias.copy_(torch.arange(3 * mha.embed_dim, dtype=torch.float32))
    return mha


@pytest.mark.parametrize("spec", ["test_module_prune_kinds:vit", "test_module_prune_kinds:token_encoder"])
def test_each_head_keeps_its_own_channels(spec):
    torch.manual_seed(0)
    model = build_module(spec, {})
    mha = _tagged_mha(model)
    width, heads = mha.embed_dim, mha.num_heads
    prune_channels(model, KINDS[spec]()[:2], 0.5)
    kept = mha.in_proj_bias.detach().long().tolist()
    cut_width = mha.embed_dim
    assert mha.num_heads == heads and cut_width == width // 2 and mha.head_dim == cut_width // heads
    for block in range(3):  # queries, keys, values: the j-th kept row of head h came from head h
        rows = kept[block * cut_width:(block + 1) * cut_width]
        assert [(r - block * width) // (width // heads) for r in rows] == [i // mha.head_dim for i in range(cut_width)]
    assert kept[:cut_width] == [r - width for r in kept[cut_width:2 * cut_width]]  # keys at the queries' offsets


def test_a_user_attention_module_keeps_its_heads_and_its_head_dim_follows():
    torch.manual_seed(0)
    model = user_vit()
    prune_channels(model, torch.randn(2, 5, 8), 0.5)
    attn = model.attn
    assert attn.num_heads == 4 and attn.qkv.out_features == 3 * 8 and attn.head_dim == 2
    assert attn.proj.in_features == 8 and model(torch.randn(2, 5, 8)).shape == (2, 3)


def test_a_layer_with_a_size_of_its_own_is_one_line_and_nothing_is_written(tmp_path):
    from prunus.cli.main import cli

    torch.manual_seed(0)
    src = save_module(build_module("test_prune_attention:user_vit", {"fixed": True}), tmp_path / "src",
                      stage="train", task="classification", input={"shape": [5, 8], "dtype": "float32"})
    res = CliRunner().invoke(cli, ["compress", str(src), "--recipe", "prune-channels-50", "--out",
                                   str(tmp_path / "o"), "--data", "synthetic:classification?n=24&shape=5x8&classes=3&val=8",
                                   "--trust-factory", "--no-latency"])
    text = res.output.strip()
    lines = text.splitlines()  # the pass's progress line, then the error: one line, the last
    assert res.exit_code == 2 and [ln for ln in lines if ln.startswith("Error")] == lines[-1:], text
    assert "Traceback" not in text
    assert "layer attn (UserAttention) fails after torch-pruning's cut" in text and "nothing was written" in text
    assert not (tmp_path / "o").exists()


def test_the_1d_cnn_regressor_prunes_fine_tunes_and_reloads(tmp_path):
    torch.manual_seed(0)
    src = save_module(build_module("test_prune_attention:cnn1d", {}), tmp_path / "src", stage="train",
                      task="regression", input={"shape": [16], "dtype": "float32"})
    report = compress(src, [("prune_channels", {"amount": 0.5, "finetune_steps": 2, "batch_size": 8})],
                      tmp_path / "o", data="synthetic:regression?n=32&shape=16&outputs=1&val=8", trust_factory=True,
                      latency=False)
    loaded = load_module(tmp_path / "o", trust_factory=True)
    assert report["rows"][1]["params"] == sum(p.numel() for p in loaded.parameters()) < report["rows"][0]["params"]
    assert loaded[1].out_channels == 4 and loaded(torch.randn(2, 16)).shape == (2, 1)


def _silent_units():
    """Hidden units 0 and 1 have the largest input weights but no path to the output."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
    with torch.no_grad():
        model[0].weight[:2] *= 10
        model[0].bias[:2] = 1.0
        model[2].weight[:, :2] = 0
    return model


def test_taylor_ranks_by_the_loss_where_magnitude_ranks_by_the_weights():
    from prunus.compress.prune_taylor import TaylorBatches
    from prunus.models.tasks import get_task

    data = torch.utils.data.TensorDataset(torch.randn(40, 4), torch.randn(40, 1))
    kept = {}
    for importance in ("magnitude", "taylor"):
        model = _silent_units()
        marked = model[0].weight[:, 0].clone()  # each hidden unit's first input weight names it
        taylor = TaylorBatches(data, get_task("regression").loss) if importance == "taylor" else None
        prune_channels(model, torch.randn(2, 4), 0.5, importance=importance, taylor=taylor)
        kept[importance] = sorted(int((marked == w).nonzero()) for w in model[0].weight[:, 0])
        assert all(p.grad is None for p in model.parameters())
    assert kept == {"magnitude": [0, 1], "taylor": [2, 3]}


@pytest.mark.parametrize("by", ["channels", "params"])
def test_a_user_attention_module_prunes_through_the_pass_and_reloads(by, tmp_path):
    """The pass's default (taylor, in rounds): the head width follows every round, and the dir reloads."""
    torch.manual_seed(0)
    src = save_module(build_module("test_prune_attention:user_vit", {}), tmp_path / "src", stage="train",
                      task="classification", input={"shape": [5, 8], "dtype": "float32"})
    report = compress(src, [("prune_channels", {"amount": 0.5, "by": by})], tmp_path / "o",
                      data="synthetic:classification?n=24&shape=5x8&classes=3&val=8", trust_factory=True,
                      latency=False)
    loaded = load_module(tmp_path / "o", trust_factory=True)
    assert loaded.attn.num_heads == 4 and loaded.attn.head_dim * 4 * 3 == loaded.attn.qkv.out_features
    assert report["rows"][1]["params"] == sum(p.numel() for p in loaded.parameters()) < report["rows"][0]["params"]
