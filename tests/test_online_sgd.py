"""Both sides of the step-by-step comparison are what they say (``tokenpatch.dynamics.online_sgd``):
the online gradient is the autograd gradient of the stated loss at the implicit weights, online SGD
is ``torch.optim.SGD`` with batch 1, and on a one-block model the implicit step is the online
gradient step of the normalised-LMS loss, so the alignment reads exactly 1 there."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import random_model

import tokenpatch as tp
from tokenpatch.dynamics.online_sgd import derangement, gradient_at, matrix_deltas, online_alignment, online_sgd
from tokenpatch.errors import InputError
from tokenpatch.lowrank import LowRank

N_CTX = 5


@pytest.fixture
def setting():
    """A 3-layer Pre-LN model, 3 contexts of 5 examples, the examples as no-context training points."""
    model = random_model(tp.ICLConfig(d_in=4, d_model=8, n_layers=3, n_heads=2, norm="pre"), seed=3)
    g = torch.Generator().manual_seed(4)
    tokens = torch.randn(3, N_CTX + 1, 4, generator=g, dtype=torch.float64)  # [R, N + 1, d]
    xs = tokens[:, :N_CTX].clone()
    xs[..., -1] = 0  # example i: the token [x_i; 0], target y_i
    ys = tokens[:, :N_CTX, -1]  # [R, N]
    names = [f"blocks.{i}.mlp.fc_in.weight" for i in range(3)]

    def loss(i: int) -> torch.Tensor:  # the stated loss: (y_hat([x_i; 0]) - y_i)^2, per run
        return (model(xs[:, i : i + 1])[:, -1, 0] - ys[:, i]) ** 2

    return model, tokens, xs, ys, names, loss


def _own_loss(model, xs, ys, b: int, i: int) -> torch.Tensor:
    return (model(xs[b : b + 1, i : i + 1])[0, -1, 0] - ys[b, i]) ** 2


def test_the_online_gradient_is_the_autograd_gradient_of_the_stated_loss_at_the_implicit_weights(setting):
    model, tokens, xs, ys, names, loss = setting
    traj = tp.trajectory(model, tokens)
    for i in (1, 3):
        patch = traj.patch(i)  # W + dW_i: the weights before example i + 1 (0-based i)
        got = gradient_at(model, loss, i, names, patch=patch)
        for b in range(3):
            twin = copy.deepcopy(model)
            with tp.apply(twin, patch[b, 0]):  # every delta of run b's patch, written into the weights
                params = dict(twin.named_parameters())
                want = torch.autograd.grad(_own_loss(twin, xs, ys, b, i), [params[n] for n in names])
            for n, w in zip(names, want):
                assert torch.allclose(got[n].dense()[b], w, rtol=0, atol=1e-12), (i, b, n)
                assert w.abs().max() > 1e-6  # not a vacuous zero gradient


@pytest.mark.parametrize("shuffled", [False, True])
def test_online_sgd_is_torch_sgd_with_batch_one(setting, shuffled):
    model, _, xs, ys, names, loss = setting
    order = derangement(N_CTX, torch.Generator().manual_seed(0)) if shuffled else list(range(N_CTX))
    lr = 0.05
    steps = list(online_sgd(model, loss, N_CTX, names, lr, order if shuffled else None))
    assert len(steps) == N_CTX
    for b in range(3):
        twin = copy.deepcopy(model)
        params = dict(twin.named_parameters())
        for p in twin.parameters():
            p.requires_grad_(False)
        trained = [params[n].requires_grad_(True) for n in names]
        opt = torch.optim.SGD(trained, lr=lr)
        start = [p.detach().clone() for p in trained]
        for step, k in enumerate(order):
            opt.zero_grad()
            _own_loss(twin, xs, ys, b, k).backward()
            opt.step()
            _, d = steps[step]
            for n, p, p0 in zip(names, trained, start):
                assert torch.allclose(d[n].dense()[b], p.detach() - p0, rtol=0, atol=1e-12), (b, step, n)
        assert any(float(d.dense().abs().max()) > 1e-4 for d in steps[-1][1].values())


def _one_block_setting():
    """One block; two runs share their query (so one step size h = 1/|a|^2) and differ in context."""
    model = random_model(tp.ICLConfig(d_in=4, d_model=8, n_layers=1, n_heads=2, norm="pre"), seed=5)
    g = torch.Generator().manual_seed(6)
    tokens = torch.randn(2, N_CTX + 1, 4, generator=g, dtype=torch.float64)
    tokens[1, -1] = tokens[0, -1]
    name = "blocks.0.mlp.fc_in.weight"
    fc_in = model.get_submodule("blocks.0.mlp.fc_in")
    seen = {}
    handle = fc_in.register_forward_pre_hook(lambda m, args: seen.__setitem__("s", args[0][:, -1].detach()))
    with torch.no_grad():
        model(tokens[:, -1:])  # the query alone: the anchor a
        a = seen["s"]  # [2, d]
        targets = []
        for i in range(1, N_CTX + 1):  # s_i: the MLP input at the query after c_1..c_i
            model(torch.cat([tokens[:, :i], tokens[:, -1:]], 1))
            targets.append(seen["s"] @ fc_in.weight.T)  # W s_i  [2, rows]
    handle.remove()
    out = {}

    def nlms(i: int) -> torch.Tensor:  # L_i(W') = 1/2 |W' a - W s_i|^2, W' a read from fc_in on the query alone
        # registered last, so it reads fc_in's output after the hooks that add the patch and the leaves
        hook = fc_in.register_forward_hook(lambda m, args, y: out.__setitem__("y", y[:, -1]))
        try:
            model(tokens[:, -1:])
        finally:
            hook.remove()
        return 0.5 * ((out["y"] - fc_in.bias - targets[i]) ** 2).sum(-1)

    return model, tokens, name, a, nlms


def test_on_one_block_the_implicit_step_is_the_online_gradient_step_of_the_nlms_loss():
    model, tokens, name, a, nlms = _one_block_setting()
    traj = tp.trajectory(model, tokens)
    patches = [traj.patch(i) for i in range(N_CTX + 1)]
    h = 1 / float((a[0] ** 2).sum())
    for i in range(1, N_CTX + 1):
        step = matrix_deltas(model, patches[i])[name].dense() - matrix_deltas(model, patches[i - 1])[name].dense()
        g = gradient_at(model, nlms, i - 1, [name], patch=patches[i - 1])[name].dense()  # [2, rows, cols]
        assert torch.allclose(step[:, 0], -h * g, rtol=0, atol=1e-12), i
        assert step.abs().max() > 1e-6
    al = online_alignment(model, patches, nlms, lrs=[h, 2 * h], generator=torch.Generator().manual_seed(0))
    assert al.names == [name]
    assert torch.allclose(al.gradient, torch.ones_like(al.gradient), rtol=0, atol=1e-10)
    # online SGD at lr = h retraces the trajectory: every step and every prefix's weights
    assert torch.allclose(al.sgd_step[0], torch.ones_like(al.sgd_step[0]), rtol=0, atol=1e-10)
    assert torch.allclose(al.sgd_weights[0], torch.ones_like(al.sgd_weights[0]), rtol=0, atol=1e-10)
    assert al.sgd_weights[1, :, 1:].max() < 1 - 1e-6  # at 2h it leaves the trajectory after step 1
    for control in (al.gradient_shuffled, al.random, al.shuffled_sgd_step):
        assert control.abs().max() < 1 - 1e-3
    assert al.heldout is None and sorted(al.order) == list(range(N_CTX))


def test_heldout_losses_follow_online_sgd(setting):
    model, tokens, xs, ys, names, loss = setting
    traj = tp.trajectory(model, tokens)
    patches = [traj.patch(i) for i in range(N_CTX + 1)]
    queries = torch.randn(3, 4, 1, 4, generator=torch.Generator().manual_seed(9), dtype=torch.float64)

    def heldout() -> torch.Tensor:
        return model(queries.reshape(12, 1, 4))[:, -1, 0].reshape(3, 4).pow(2).mean(1)

    al = online_alignment(model, patches, loss, lrs=[0.1], names=names[:2], heldout=heldout)
    assert al.gradient.shape == (3, N_CTX, 2) and al.sgd_step.shape == (1, 3, N_CTX, 2)
    assert al.heldout.shape == (1, 3, N_CTX + 1)
    *_, d = list(online_sgd(model, loss, N_CTX, names[:2], 0.1))[-1]
    with tp.finetuned(model, d), torch.no_grad():
        assert torch.allclose(al.heldout[0, :, -1], heldout(), rtol=0, atol=1e-12)
    with torch.no_grad():
        assert torch.allclose(al.heldout[0, :, 0], heldout(), rtol=0, atol=1e-12)
    assert ((al.sgd_ceiling > 0) & (al.sgd_ceiling <= 1 + 1e-12)).all()
    assert 0.5 < float(al.random.std()) * (8 * 32) ** 0.5 < 1.5  # a random 32 x 8 matrix: cos ~ +-1/16
    at_last = online_alignment(model, patches, loss, lrs=[0.1], names=names[:2], ceiling_steps=[N_CTX])
    assert at_last.sgd_ceiling[..., :-1, :].isnan().all()
    assert torch.equal(at_last.sgd_ceiling[..., -1, :], al.sgd_ceiling[..., -1, :])


def test_matrix_deltas_of_an_input_change_are_what_apply_writes():
    pytest.importorskip("transformers")
    from conftest import build, ids

    model = build("llama")
    patch = tp.token_patch(model, ids(1, 7))
    deltas = matrix_deltas(model, patch)
    assert any(n.endswith("gate_proj.weight") for n in deltas)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with tp.apply(model, patch[0, 0]):
        after = dict(model.named_parameters())
        for n, d in deltas.items():
            assert torch.allclose(d.dense()[0, 0], after[n].detach() - before[n], rtol=0, atol=1e-12), n


def test_bad_inputs_get_one_clear_line(setting):
    model, tokens, _, _, names, loss = setting
    traj = tp.trajectory(model, tokens)
    patches = [traj.patch(i) for i in range(N_CTX + 1)]
    with pytest.raises(InputError, match="N >= 2"):
        online_alignment(model, patches[:2], loss, lrs=[0.1])
    with pytest.raises(InputError, match="lead"):
        online_alignment(model, [p[:1] for p in patches], loss, lrs=[0.1])
    with pytest.raises(InputError, match="no learning rate"):
        online_alignment(model, patches, loss, lrs=[])
    with pytest.raises(InputError, match="change no matrix"):
        online_alignment(model, patches, loss, lrs=[0.1], names=["blocks.0.attn.q.weight"])
    with pytest.raises(InputError, match="lr must be"):
        next(online_sgd(model, loss, N_CTX, names, -1.0))
    with pytest.raises(InputError, match="not the weight matrix"):
        gradient_at(model, loss, 0, ["blocks.0.mlp.fc_in.bias"])
    with pytest.raises(InputError, match="one differentiable loss per run"):
        gradient_at(model, lambda i: loss(i).sum(), 0, names, patch=patches[1])
    with pytest.raises(InputError, match="at least 2"):
        derangement(1)


def test_derangement_moves_every_example():
    for seed in range(20):
        n = 2 + seed % 7
        perm = derangement(n, torch.Generator().manual_seed(seed))
        assert sorted(perm) == list(range(n)) and all(p != j for j, p in enumerate(perm))


def test_low_rank_deltas_run_as_their_dense_matrices(setting):
    model, _, xs, _, names, loss = setting
    g = torch.Generator().manual_seed(7)
    low = {
        n: LowRank(
            torch.randn(3, 2, 32, generator=g, dtype=torch.float64),
            torch.randn(3, 2, 8, generator=g, dtype=torch.float64),
        )
        for n in names
    }
    with torch.no_grad():
        with tp.finetuned(model, low):
            a = loss(1)
        with tp.finetuned(model, {n: d.dense() for n, d in low.items()}):
            b = loss(1)
        plain = loss(1)
    assert torch.allclose(a, b, rtol=0, atol=1e-12) and (a - plain).abs().max() > 1e-3
    with pytest.raises(InputError, match="lead \\[runs\\]"):
        with tp.finetuned(model, {names[0]: LowRank(low[names[0]].u[None], low[names[0]].v[None])}):
            pass


def test_the_rank1_ceiling_from_factors_is_the_dense_one():
    from tokenpatch.dynamics.diagnostics import rank1_ceiling

    g = torch.Generator().manual_seed(8)
    for rank in (1, 3, 9):  # below both sides, then past the smaller one (dense)
        d = LowRank(
            torch.randn(4, rank, 12, generator=g, dtype=torch.float64),
            torch.randn(4, rank, 7, generator=g, dtype=torch.float64),
        )
        sv = torch.linalg.svdvals(d.dense())
        assert torch.allclose(rank1_ceiling(d), sv[:, 0] / sv.norm(dim=-1), rtol=0, atol=1e-12)
        assert torch.allclose(rank1_ceiling(d.dense()), rank1_ceiling(d), rtol=0, atol=1e-12)
        assert torch.allclose(rank1_ceiling(d.dense().mT), rank1_ceiling(d), rtol=0, atol=1e-12)  # wide: D D^T
    assert rank1_ceiling(LowRank(torch.ones(1, 1, 3), torch.ones(1, 1, 2)))[0] == pytest.approx(1.0)
    assert rank1_ceiling(torch.zeros(2, 3, 3))[0] == 0
