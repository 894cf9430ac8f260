"""Head-resolved token patches (``tokenpatch/interp/head_patches.py``): the parts sum to the patch,
the patch is ``token_patch``'s, and the linear case is the split of ``W_O dz`` by heads. float64."""

from __future__ import annotations

import pytest
import torch

import tokenpatch as tp
from tokenpatch.errors import InputError, UnsupportedModelError
from tokenpatch.interp.ablation import ablate_heads
from tokenpatch.interp.head_patches import head_patches, pooled_share, split_by_heads
from tokenpatch.models.icl import ICLConfig, ICLTransformer


def ours(norm: str, layer: str = "softmax") -> ICLTransformer:
    torch.manual_seed(0)
    model = ICLTransformer(ICLConfig(d_in=5, d_out=2, d_model=16, n_layers=2, n_heads=4, norm=norm, layer=layer))
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 1:  # norm scales and biases off their initial values
                p.add_(0.3 * torch.randn_like(p))
    return model.double().eval()


def test_split_of_a_linear_map_is_w_o_times_each_heads_slice():
    torch.manual_seed(1)
    a = torch.randn(6, 8, dtype=torch.float64)
    z0, zc = torch.randn(3, 8, dtype=torch.float64), torch.randn(3, 8, dtype=torch.float64)
    exact, first = split_by_heads(lambda z: z @ a.T, z0, zc, n_heads=2, nodes=3)
    dz = zc - z0
    by_hand = torch.stack([dz[:, :4] @ a[:, :4].T, dz[:, 4:] @ a[:, 4:].T], 1)  # [N, H, d]
    torch.testing.assert_close(exact, by_hand, rtol=0, atol=1e-14)
    torch.testing.assert_close(first, by_hand, rtol=0, atol=1e-14)


@pytest.mark.parametrize("norm", ["pre", "post", "none"])
def test_parts_sum_to_the_token_patch_of_our_models(norm):
    model, x = ours(norm), torch.randn(2, 7, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    hp = head_patches(model, x, query="all")
    patch = tp.token_patch(model, x, query="all")
    for layer, block in enumerate(model.blocks):  # W ds is the fc_in patch's out-side factor
        u = patch[f"blocks.{layer}.mlp.fc_in.weight"].u[..., 0, :]  # [B, Q, hidden]
        torch.testing.assert_close(hp.delta[layer] @ block.mlp.fc_in.weight.T, u, rtol=0, atol=1e-12)
    moved = hp.patch_norm > 1e-9  # the first position has no context
    assert moved[:, :, 1:].all() and not moved[:, :, 0].any()
    assert hp.closure[moved].max() < 1e-12
    assert (hp.share.sum(-1)[moved] - 1).abs().max() < 1e-12
    torch.testing.assert_close(pooled_share(hp).sum(-1), torch.ones(2, dtype=torch.float64), rtol=0, atol=1e-12)
    if norm == "none":  # affine F: the first-order split is the exact one
        assert hp.linear_error[moved].max() < 1e-12
    else:  # a norm in between: the first-order split misses
        assert hp.linear_error[moved].median() > 1e-3


def test_an_ablated_head_carries_nothing():
    model, x = ours("pre"), torch.randn(2, 7, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    with ablate_heads(model, [(1, 2)]):
        hp = head_patches(model, x, query=[4, 6])
    assert hp.norm[1, :, :, 2].abs().max() == 0 and hp.share[1, :, :, 2].abs().max() == 0
    assert hp.norm[1, :, :, 1].min() > 0 and hp.norm[0].min() > 0


def test_pooled_share_weights_each_patch_by_its_size():
    from tokenpatch.interp.head_patches import HeadPatches

    share = torch.tensor([[[[1.0, 0.0], [0.0, 1.0]]]], dtype=torch.float64)  # [L=1, B=1, Q=2, H=2]
    norm = torch.tensor([[[1.0, 10.0]]], dtype=torch.float64)  # |D|_F of the two patches
    hp = HeadPatches(share, share, norm, norm * 0, norm * 0, torch.zeros(1, 1, 2, 3), [0, 1])
    torch.testing.assert_close(pooled_share(hp), torch.tensor([[1.0, 100.0]], dtype=torch.float64) / 101)


def test_mean_ablation_runs_through_the_lone_pass_and_resampling_is_refused():
    model, x = ours("pre"), torch.randn(3, 7, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    with ablate_heads(model, [(0, 1)], mode="mean", reference=x):
        hp = head_patches(model, x, query=[5, 6])
    assert hp.closure.max() < 1e-12 and torch.isfinite(hp.share).all()
    with ablate_heads(model, [(0, 1)], mode="resample", reference=x), pytest.raises(InputError, match="resample"):
        head_patches(model, x, query=[5, 6])


def test_recurrent_layers_are_refused():
    with pytest.raises(UnsupportedModelError, match="attention layers"):
        head_patches(ours("pre", layer="gru"), torch.randn(1, 4, 5, dtype=torch.float64))


@pytest.fixture
def float64_norms(monkeypatch):
    """Hugging Face RMSNorms compute in float32 whatever the model dtype; evaluate them in float64."""
    from transformers.models.gemma3 import modeling_gemma3
    from transformers.models.llama import modeling_llama

    def gemma(self, x):
        return self._norm(x) * (1.0 + self.weight)

    def llama(self, x):
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)

    monkeypatch.setattr(modeling_gemma3.Gemma3RMSNorm, "forward", gemma)
    monkeypatch.setattr(modeling_llama.LlamaRMSNorm, "forward", llama)


@pytest.mark.parametrize("name", ["llama", "gemma3", "gpt2", "opt", "opt_post", "bloom"])
def test_parts_sum_to_the_token_patch_of_hugging_face_models(name, float64_norms):
    pytest.importorskip("transformers", reason="the Hugging Face extra is not installed")
    from test_hf import build, ids

    model, x = build(name), ids(2, 10)
    hp = head_patches(model, x, query=[3, 9])
    patch = tp.token_patch(model, x, query=[3, 9])
    inputs = [k for k in patch if k.endswith(":input")]
    assert len(inputs) == model.config.num_hidden_layers == hp.delta.shape[0]
    for layer, key in enumerate(inputs):  # the input change s_C - s_0 of every matrix reading the MLP input
        torch.testing.assert_close(hp.delta[layer], patch[key].u[..., 0, :], rtol=0, atol=1e-10)
    assert hp.closure.max() < 1e-11 and (hp.share.sum(-1) - 1).abs().max() < 1e-11
    assert hp.share.shape == (3, 2, 2, model.config.num_attention_heads)
    with ablate_heads(model, [(1, 2)]):  # the per-head slices belong to the right heads
        ablated = head_patches(model, x, query=[3, 9])
    assert ablated.norm[1, :, :, 2].abs().max() == 0 and ablated.norm[1, :, :, [0, 1, 3]].min() > 0
    assert torch.equal(ablated.norm[0], hp.norm[0])  # the layer below is untouched


def test_a_parallel_block_is_refused():
    pytest.importorskip("transformers", reason="the Hugging Face extra is not installed")
    from test_hf import build, ids

    with pytest.raises(UnsupportedModelError, match="parallel"):
        head_patches(build("gpt_neox"), ids(1, 5))
