"""tp.finetune: R fine-tuning runs in one batched pass equal R separate runs of torch.optim on a
copy of the model (float64, 1e-12); tp.finetuned runs the fine-tuned models; cosine and simaou
are the formulas they state; bad inputs are one clear error; the model is never touched."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import random_model, sweep
from hypothesis import given
from hypothesis import strategies as st

import tokenpatch as tp
from tokenpatch import files
from tokenpatch.dynamics.diagnostics import cosine
from tokenpatch.errors import InputError
from tokenpatch.tasks.linreg import fresh_queries, training_points


def _reference(model, examples, targets, names, optimizer, lr, steps, batch_size=None):
    """Run r alone: torch.optim on a copy whose ``names`` are the only trainable parameters."""
    out = []
    n = examples.shape[1]
    for r in range(examples.shape[0]):
        m = copy.deepcopy(model)
        params = dict(m.named_parameters())
        for p in m.parameters():
            p.requires_grad_(False)
        trained = [params[nm].requires_grad_(True) for nm in names]
        opt = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam}[optimizer](trained, lr=lr)
        for step in range(steps):
            idx = (
                torch.arange(n) if batch_size is None else torch.arange(step * batch_size, (step + 1) * batch_size) % n
            )
            pred = m(examples[r, idx])[:, -1]  # [n', d_out]
            opt.zero_grad()
            ((pred - targets[r, idx]) ** 2).mean().backward()
            opt.step()
        before = dict(model.named_parameters())
        out.append({nm: (params[nm] - before[nm]).detach() for nm in names})
    return out


@pytest.mark.parametrize("layer", sorted(tp.LAYERS))
@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_batched_runs_equal_separate_torch_optim_runs(layer, optimizer):
    config = tp.ICLConfig(d_in=3, d_model=4, n_layers=2, n_heads=2, d_mlp=6, layer=layer, norm="pre")
    model = random_model(config, seed=5)
    g = torch.Generator().manual_seed(0)
    examples, targets = (
        torch.randn(3, 4, 2, 3, generator=g, dtype=torch.float64),
        torch.randn(3, 4, 1, generator=g, dtype=torch.float64),
    )
    ft = tp.finetune(model, examples, targets, optimizer=optimizer, lr=0.05, steps=3, output=True)
    ref = _reference(model, examples, targets, ft.names, optimizer, 0.05, 3)
    assert "blocks.0.mlp.fc_in.weight" in ft.names and "blocks.1.mlp.fc_out.bias" in ft.names
    for r, want in enumerate(ref):
        for nm, d in want.items():
            assert float(d.abs().max()) > 1e-4  # the run moved
            assert torch.allclose(ft.at()[nm][r], d, rtol=0, atol=1e-12), nm


@sweep
@given(
    seed=st.integers(0, 2**16), layers=st.sampled_from([0, 1, [0, 1], None]), batch_size=st.sampled_from([None, 1, 2])
)
def test_one_layer_and_minibatches_cycle_in_order(seed, layers, batch_size):
    model = random_model(tp.ICLConfig(d_in=3, d_model=4, n_layers=2, n_heads=2, d_mlp=5, norm="post"), seed=seed)
    g = torch.Generator().manual_seed(seed)
    examples, targets = (
        torch.randn(2, 3, 1, 3, generator=g, dtype=torch.float64),
        torch.randn(2, 3, generator=g, dtype=torch.float64),
    )
    ft = tp.finetune(model, examples, targets, layers=layers, steps=4, lr=0.1, batch_size=batch_size, record=[1, 2])
    want = [
        f"blocks.{i}.mlp.fc_in.weight"
        for i in ([0, 1] if layers is None else [layers] if isinstance(layers, int) else layers)
    ]
    assert ft.names == want and sorted(ft.deltas) == [1, 2, 4]
    ref = _reference(model, examples, targets[..., None], want, "sgd", 0.1, 4, batch_size)
    for r, d in enumerate(ref):
        for nm in want:
            assert torch.allclose(ft.at(4)[nm][r], d[nm], rtol=0, atol=1e-12)
    # losses: on all examples before each step and after the last, per run
    assert ft.losses.shape == (2, 5)
    with tp.finetuned(model, ft.at(2)):
        after_two = ((model(examples.flatten(0, 1))[:, -1, 0].reshape(2, 3) - targets) ** 2).mean(1)
    assert torch.allclose(ft.losses[:, 2], after_two, rtol=0, atol=1e-12)


def test_finetuned_runs_each_model_and_restores():
    model = random_model(tp.ICLConfig(d_in=3, d_model=4, n_layers=2, n_heads=2, norm="pre"), seed=2)
    g = torch.Generator().manual_seed(1)
    names = ["blocks.0.mlp.fc_in.weight", "blocks.1.mlp.fc_out.bias"]
    params = dict(model.named_parameters())
    deltas = {nm: torch.randn(2, *params[nm].shape, generator=g, dtype=torch.float64) for nm in names}
    x = torch.randn(2 * 3, 5, 3, generator=g, dtype=torch.float64)  # 3 sequences per run
    before = model(x)
    with tp.finetuned(model, deltas):
        got = model(x)
    for r in range(2):
        m = copy.deepcopy(model)
        with torch.no_grad():
            for nm in names:
                dict(m.named_parameters())[nm].add_(deltas[nm][r])
        assert torch.allclose(got[3 * r : 3 * r + 3], m(x[3 * r : 3 * r + 3]), rtol=0, atol=1e-12)
    assert torch.equal(model(x), before)  # hooks gone
    with pytest.raises(RuntimeError, match="boom"), tp.finetuned(model, deltas):
        raise RuntimeError("boom")
    assert torch.equal(model(x), before)
    with pytest.raises(InputError, match="not a multiple of the 2"), tp.finetuned(model, deltas):
        model(x[:3])


def test_the_model_is_never_touched():
    model = tp.load_model(dtype="float64")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    flags = [p.requires_grad for p in model.parameters()]
    batch = tp.LinRegTask(4, 8, 0.1).sample(2, torch.Generator().manual_seed(0), dtype=torch.float64)
    ft = tp.finetune(model, *training_points(batch), optimizer="adam", steps=2)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
    assert [p.requires_grad for p in model.parameters()] == flags and all(p.grad is None for p in model.parameters())
    assert ft.losses[:, -1].lt(ft.losses[:, 0]).all()
    assert files.fingerprint(model) == files.fingerprint(tp.load_model(dtype="float64"))


def test_training_points_and_fresh_queries():
    batch = tp.LinRegTask(3, 5, 0.0).sample(2, torch.Generator().manual_seed(0), dtype=torch.float64)
    x, y = training_points(batch, 4)
    assert x.shape == (2, 4, 1, 4) and y.shape == (2, 4, 1)
    assert (
        torch.equal(x[:, :, 0, :3], batch.x[:, :4])
        and (x[..., 3] == 0).all()
        and torch.equal(y[..., 0], batch.y[:, :4])
    )
    q, t = fresh_queries(batch, 6, generator=torch.Generator().manual_seed(1))
    assert q.shape == (2, 6, 4) and (q[..., 3] == 0).all()
    assert torch.allclose(t, torch.einsum("bmd,bd->bm", q[..., :3], batch.w), atol=1e-12)
    with pytest.raises(InputError, match="n must be in 1..5"):
        training_points(batch, 6)


@sweep
@given(seed=st.integers(0, 2**16), rank=st.integers(1, 3))
def test_cosine_from_factors_equals_the_dense_cosine(seed, rank):
    g = torch.Generator().manual_seed(seed)
    a = tp.LowRank(
        torch.randn(2, 3, rank, 5, generator=g, dtype=torch.float64),
        torch.randn(2, 3, rank, 4, generator=g, dtype=torch.float64),
    )
    d = torch.randn(2, 3, 5, 4, generator=g, dtype=torch.float64)
    dense = a.dense()
    want = (dense * d).sum((-1, -2)) / (dense.flatten(-2).norm(dim=-1) * d.flatten(-2).norm(dim=-1))
    for got in (cosine(a, d), cosine(d, a), cosine(dense, d)):
        assert torch.allclose(got, want, rtol=0, atol=1e-12)
    assert torch.allclose(cosine(a, a), torch.ones(2, 3, dtype=torch.float64), atol=1e-12)
    assert (cosine(a, torch.zeros_like(d)) == 0).all()
    with pytest.raises(InputError, match="cannot compare"):
        cosine(a, d.transpose(-1, -2))


def test_simaou():
    g = torch.Generator().manual_seed(0)
    h0, hc, hf = (torch.randn(4, 7, generator=g, dtype=torch.float64) for _ in range(3))
    want = torch.nn.functional.cosine_similarity(hc - h0, hf - h0, dim=-1)
    assert torch.allclose(tp.simaou(hc, h0, hf), want, atol=1e-12)
    assert torch.allclose(tp.simaou(hc, h0, h0 + 2 * (hc - h0)), torch.ones(4, dtype=torch.float64), atol=1e-12)
    assert (tp.simaou(hc, h0, h0) == 0).all()


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(optimizer="sgdd"), "unknown optimizer 'sgdd'"),
        (dict(lr=0), "lr must be a positive number"),
        (dict(steps=0), "steps must be an int >= 1"),
        (dict(batch_size=5), r"batch_size must be an int in 1..3"),
        (dict(record=[9]), r"record must list steps in 1..2"),
        (dict(layers=[0, 0]), "layers must be distinct layer indices"),
        (dict(layers=7), "layers must be distinct layer indices"),
    ],
)
def test_bad_arguments_are_one_clear_error(kwargs, match):
    model = random_model(tp.ICLConfig(d_in=3, d_model=4, n_layers=2, n_heads=2), seed=0)
    x, y = torch.zeros(2, 3, 1, 3, dtype=torch.float64), torch.zeros(2, 3, 1, dtype=torch.float64)
    with pytest.raises(InputError, match=match):
        tp.finetune(model, x, y, **{"steps": 2, **kwargs})


def test_bad_shapes_are_one_clear_error():
    model = random_model(tp.ICLConfig(d_in=3, d_model=4, n_layers=2, n_heads=2), seed=0)
    x = torch.zeros(2, 3, 1, 3, dtype=torch.float64)
    with pytest.raises(InputError, match=r"examples must be a tensor \[runs, n, pos, d_in\]"):
        tp.finetune(model, x[:, :, 0], torch.zeros(2, 3))
    with pytest.raises(InputError, match=r"targets must be \[runs, n, d_out\] = \[2, 3, d_out\]"):
        tp.finetune(model, x, torch.zeros(2, 4))
    with pytest.raises(InputError, match="the model reads width 3"):
        tp.finetune(model, torch.zeros(2, 3, 1, 4, dtype=torch.float64), torch.zeros(2, 3))
    with pytest.raises(InputError, match="not recorded"):
        tp.finetune(model, x, torch.zeros(2, 3, dtype=torch.float64), steps=2).at(1)
    with (
        pytest.raises(InputError, match=r"is not \[runs"),
        tp.finetuned(model, {"blocks.0.mlp.fc_in.weight": torch.zeros(3)}),
    ):
        pass
