"""tp.thought_patch: one query gives the token patch; few queries interpolate; the streamed, cached
and recomputed fits are the same fit; the closed form is the ridge solution it claims; bad systems
warn and stay finite; the result is a Patch like any other."""

from __future__ import annotations

import itertools
import random
import warnings

import pytest
import torch
from conftest import build, ids, random_model, sweep
from hypothesis import given
from hypothesis import strategies as st

import tokenpatch as tp
from tokenpatch.arch import adapter_for
from tokenpatch.errors import InputError
from tokenpatch.thought.calibration import sample_calibration
from tokenpatch.thought.engine import TARGET_KEYS, Targets
from tokenpatch.thought.front import SELF_CALIBRATION, ThoughtWarning

COMBOS = list(itertools.product(sorted(tp.LAYERS), ["none", "pre", "post"], [True, False]))


def _dense(d):
    return d.dense() if isinstance(d, tp.LowRank) else d


def _close(a: tp.Patch, b: tp.Patch, tol: float) -> float:
    assert set(a) == set(b), (sorted(a), sorted(b))
    return max(float((_dense(a[n]).reshape(_dense(b[n]).shape) - _dense(b[n])).abs().max()) for n in a) <= tol


def _rel(a: tp.Patch, b: tp.Patch) -> float:
    return max(float((_dense(a[n]) - _dense(b[n])).abs().max() / _dense(a[n]).abs().max().clamp_min(1e-300)) for n in a)


def _setup(layer="softmax", norm="pre", residual=True, seed=0, m=5, t_q=1, p=4, d_mlp=6):
    config = tp.ICLConfig(
        d_in=3, d_model=4, n_layers=2, n_heads=2, d_mlp=d_mlp, layer=layer, norm=norm, residual=residual
    )
    model = random_model(config, seed)
    g = torch.Generator().manual_seed(seed)
    return (
        model,
        torch.randn(p, 3, generator=g, dtype=torch.float64),
        torch.randn(m, t_q, 3, generator=g, dtype=torch.float64),
    )


@pytest.mark.parametrize("layer,norm,residual", COMBOS)
@pytest.mark.parametrize("mode", ["sequential", "teacher"])
def test_one_query_gives_the_token_patch(layer, norm, residual, mode):
    model, prompt, q = _setup(layer, norm, residual, m=1)
    with pytest.warns(ThoughtWarning, match="span 1 of 4 dimensions"):  # one query: rank 1, the interpolating regime
        fit = tp.thought_patch(model, prompt, q, mode=mode, output="vector")
    token = tp.token_patch(model, torch.cat([prompt, q[0]])[None])
    assert _close(fit.patch, token, 1e-10)
    assert all(f.input_residual <= 1e-6 for f in fit.fits)  # read from the sums: ~sqrt(eps) resolution


@pytest.mark.parametrize("layer", sorted(tp.LAYERS))
def test_few_queries_interpolate_every_position(layer):
    model, prompt, q = _setup(layer, m=2, t_q=2, d_mlp=8)  # 4 positions <= d_in (4) and <= d_hidden + 1
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ThoughtWarning)  # rank 4 of 5 on the affine side: expected here
        fit = tp.thought_patch(model, prompt, q)
    ev = tp.evaluate_thought_patch(model, prompt, q, fit.patch)  # on the calibration queries themselves
    assert ev["mse_to_context"]["thought_patch"] <= 1e-20 < ev["mse_to_context"]["no_prompt"]


@sweep
@given(
    seed=st.integers(0, 2**16),
    mode=st.sampled_from(["sequential", "teacher"]),
    ridge=st.sampled_from([0.0, 0.3]),
    output=st.sampled_from(["affine", "vector"]),
)
def test_streamed_cached_and_recomputed_fits_agree(seed, mode, ridge, output):
    model, prompt, q = _setup(seed=seed, m=23, t_q=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ThoughtWarning)
        one = tp.thought_patch(model, prompt, q, mode=mode, ridge=ridge, output=output)
        streamed = tp.thought_patch(model, prompt, q, mode=mode, ridge=ridge, output=output, batch_size=5)
        recomputed = tp.thought_patch(
            model, prompt, list(q.split(7)), mode=mode, ridge=ridge, output=output, cache_bytes=0
        )
    # the same sums in another order: equal up to rounding amplified by the condition number
    cond = max(c for f in one.fits for c in (f.input_condition, f.output_condition or 1) if c != float("inf"))
    tol = max(1e-10, 1e-14 * cond)
    assert set(one.patch) == set(streamed.patch) == set(recomputed.patch)
    assert _rel(one.patch, streamed.patch) <= tol and _rel(one.patch, recomputed.patch) <= tol
    assert [f.n for f in one.fits] == [46, 46]


def _one_block(seed: int, m: int):
    """A bare Pre-LN block (inputs are hidden states), a 3-token prompt and ``m`` one-token queries."""
    config = tp.ICLConfig(d_in=4, d_model=4, n_layers=1, n_heads=2, d_mlp=5, norm="pre")
    block = random_model(config, seed + 3).blocks[0]
    g = torch.Generator().manual_seed(seed)
    return (
        block,
        torch.randn(3, 4, generator=g, dtype=torch.float64),
        torch.randn(m, 1, 4, generator=g, dtype=torch.float64),
    )


def test_the_input_side_is_the_ridge_solution():
    """One block: S, Delta formed explicitly; dW = W Delta S^T (S S^T + n lambda I)^-1."""
    block, prompt, q = _one_block(0, 9)
    lam = 0.2
    fit = tp.thought_patch(block, prompt, q, ridge=lam, output=None)
    s_c = block.mix(torch.cat([prompt.expand(9, 3, 4), q], 1))[1][:, -1]  # [m, d]
    s_0 = block.mix(q)[1][:, 0]
    w = block.mlp.fc_in.weight.detach()
    want = w @ (s_c - s_0).T @ s_0 @ torch.linalg.inv(s_0.T @ s_0 + 9 * lam * torch.eye(4, dtype=torch.float64))
    assert torch.allclose(fit.patch["mlp.fc_in.weight"].dense()[0, 0], want, rtol=0, atol=1e-12)
    assert fit.fits[0].ridge == lam and fit.fits[0].input_rank == 4 and fit.fits[0].input_condition >= 1


def test_rank_deficient_calibration_warns_and_stays_finite():
    model, prompt, q = _setup(m=1)
    same = q.expand(30, 1, 3).clone()  # 30 copies of one query: rank 1
    with pytest.warns(ThoughtWarning) as caught:  # both sides of both layers
        fit = tp.thought_patch(model, prompt, same)
    messages = [str(w.message) for w in caught]
    assert (
        len(messages) == 4
        and "layer 0 input side: the least-squares system is rank-deficient (the calibration "
        "positions span 1 of 4 dimensions, condition number inf)"
        in messages[0]
    )
    assert all(torch.isfinite(_dense(d)).all() for d in fit.patch.values())
    with warnings.catch_warnings():
        warnings.simplefilter("error", ThoughtWarning)  # a ridge makes it well posed: no warning
        tp.thought_patch(model, prompt, same, ridge=1e-3)


def test_a_thought_patch_is_a_patch(tmp_path):
    model, prompt, q = _setup(m=40)
    fit = tp.thought_patch(model, prompt, q, ridge=1e-2)
    assert fit.patch.lead == (1, 1) and fit.patch.acts == "everywhere"
    tp.save_patch(fit.patch, tmp_path / "t.safetensors")
    back = tp.load_patch(tmp_path / "t.safetensors")
    assert _close(back, fit.patch, 0)
    x = torch.randn(6, 2, 3, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    hooked = tp.functional_call(model, back, x)  # a static patch runs on any no-prompt inputs
    with tp.apply(model, back):
        written = model(x)
    assert torch.allclose(hooked, written, rtol=0, atol=1e-12)
    # rank-k truncation: the best rank-k approximation of every matrix delta
    cut = fit.truncate(1)
    for n, d in fit.patch.items():
        if isinstance(d, tp.LowRank):
            u, s, vh = torch.linalg.svd(d.dense()[0, 0])
            assert torch.allclose(cut[n].dense()[0, 0], s[0] * torch.outer(u[:, 0], vh[0]), atol=1e-12)
        else:
            assert torch.equal(cut[n], d)
    assert set(fit.vector()) | set(fit.matrices()) == set(fit.patch)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(mode="both"), "mode must be 'sequential' or 'teacher'"),
        (dict(output="matrix"), "output must be 'affine', 'vector' or None"),
        (dict(ridge=-1), "ridge must be a number >= 0"),
        (dict(inputs=False, output=None), "nothing to fit"),
    ],
)
def test_bad_arguments_are_one_clear_error(kwargs, match):
    model, prompt, q = _setup()
    with pytest.raises(InputError, match=match):
        tp.thought_patch(model, prompt, q, **kwargs)


def test_bad_inputs_are_one_clear_error():
    model, prompt, q = _setup()
    with pytest.raises(InputError, match="one-shot iterator"):
        tp.thought_patch(model, prompt, iter(q.split(2)))
    with pytest.raises(InputError, match=r"one prompt per thought patch .* got 2 rows"):
        tp.thought_patch(model, prompt[None].expand(2, -1, -1), q)
    with pytest.raises(InputError, match="the model reads width 3"):
        tp.thought_patch(model, prompt, torch.zeros(2, 1, 5, dtype=torch.float64))
    nobias = random_model(tp.ICLConfig(d_in=3, d_model=4, n_layers=2, n_heads=2, bias=False), 0)
    with pytest.raises(InputError, match="without a bias; a thought vector needs a bias"):
        tp.thought_patch(nobias, prompt, q, output="vector")


def test_the_shipped_model_generalises_past_the_interpolation_threshold():
    model = tp.load_model(dtype="float64")
    task = tp.tasks.linreg.task_of(model)
    g = torch.Generator().manual_seed(0)
    batch = task.sample(1, g, dtype=torch.float64)
    prompt = batch.tokens[0, :-1]
    test = torch.cat(
        [torch.randn(500, 1, 4, generator=g, dtype=torch.float64), torch.zeros(500, 1, 1, dtype=torch.float64)], -1
    )
    gaps = {}
    for m in (64, 2048):
        cal = torch.cat(
            [torch.randn(m, 1, 4, generator=g, dtype=torch.float64), torch.zeros(m, 1, 1, dtype=torch.float64)], -1
        )
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ThoughtWarning)
            fit = tp.thought_patch(model, prompt, cal)
        gaps[m] = tp.evaluate_thought_patch(model, prompt, test, fit.patch)["gap_closed"]["thought_patch"]
    assert gaps[2048] >= 0.9 > gaps[64]


def test_the_output_side_is_the_affine_ridge_fit_with_a_free_intercept():
    block, prompt, q = _one_block(1, 12)
    lam = 0.1
    fit = tp.thought_patch(block, prompt, q, ridge=lam)
    m_c, s_c = (t[:, -1] for t in block.mix(torch.cat([prompt.expand(12, 3, 4), q], 1)))
    m_0, s_0 = (t[:, 0] for t in block.mix(q))
    w_in = block.mlp.fc_in.weight.detach() + fit.patch["mlp.fc_in.weight"].dense()[0, 0]
    hidden = block.mlp.act(s_0 @ w_in.T + block.mlp.fc_in.bias.detach())  # [m, H] with the input patch
    f = block.mlp.fc_out
    t = (m_c + f(block.mlp.hidden(s_c))) - (m_0 + f(hidden))  # [m, d]
    x = torch.cat([hidden, torch.ones(12, 1, dtype=torch.float64)], 1)  # [m, H+1]
    pen = torch.diag(torch.tensor([1.0] * 5 + [0.0], dtype=torch.float64))
    a = torch.linalg.solve(x.T @ x / 12 + lam * pen, x.T @ t / 12).T  # [d, H+1]
    assert torch.allclose(fit.patch["mlp.fc_out.weight"].dense()[0, 0], a[:, :-1], rtol=0, atol=1e-12)
    assert torch.allclose(fit.patch["mlp.fc_out.bias"][0, 0], a[:, -1], rtol=0, atol=1e-12)


@pytest.mark.parametrize("mode", ["sequential", "teacher"])
def test_deeper_anchors_come_from_the_patched_model_or_the_teacher(mode):
    """Layer 1's input fit, by hand: sequential anchors are the layer-0-patched no-prompt states,
    teacher anchors the with-prompt ones."""
    model, prompt, q = _setup(m=30, d_mlp=7)
    lam = 0.05
    fit = tp.thought_patch(model, prompt, q, mode=mode, ridge=lam, output=None)
    below = tp.Patch({"blocks.0.mlp.fc_in.weight": fit.patch["blocks.0.mlp.fc_in.weight"]}, None, fit.patch.meta)
    with_prompt = model(torch.cat([prompt.expand(30, -1, -1), q], 1), return_hidden=True)[1][0][:, 4:]  # [m, 1, d]
    student = tp.functional_call(model, below, q, broadcast=True, any_length=True, return_hidden=True)[1][0]
    anchors = model.blocks[1].mix(student if mode == "sequential" else with_prompt)[1][:, 0]  # [m, d]
    ctx = model.blocks[0](model.read_in(prompt)[None].expand(30, -1, -1))
    s_c = model.blocks[1].mix(torch.cat([ctx, with_prompt], 1))[1][:, -1]
    w = model.blocks[1].mlp.fc_in.weight.detach()
    want = (
        w
        @ (s_c - anchors).T
        @ anchors
        @ torch.linalg.inv(anchors.T @ anchors + 30 * lam * torch.eye(4, dtype=torch.float64))
    )
    assert torch.allclose(fit.patch["blocks.1.mlp.fc_in.weight"].dense()[0, 0], want, rtol=0, atol=1e-11)


def test_states_are_kept_only_within_the_memory_budget():
    model, prompt, q = _setup(m=10)
    batches = list(q.split(4))
    prompted = adapter_for(model).prompted(model, prompt[None], TARGET_KEYS)
    need = sum(t.numel() * t.element_size() for r in prompted(q) for t in r.tensors().values())  # every batch's records
    assert Targets(prompted, batches, need).cached
    assert not Targets(prompted, batches, need - 1).cached
    calls = []
    counted = lambda x: calls.append(len(x)) or prompted(x)  # noqa: E731
    streamed = Targets(counted, batches, 0)
    assert [len(r.s) for r in streamed[2]] == [2, 2] and calls == [4, 2]  # recomputed at each use


def test_rank_during_the_fit_cuts_every_matrix_and_the_layers_above_see_it():
    model, prompt, q = _setup(m=40, d_mlp=7)
    full = tp.thought_patch(model, prompt, q, ridge=1e-3)
    cut = tp.thought_patch(model, prompt, q, ridge=1e-3, rank=1)
    assert all(d.rank == 1 for d in cut.patch.values() if isinstance(d, tp.LowRank))
    assert max(d.rank for d in full.patch.values() if isinstance(d, tp.LowRank)) > 1
    # layer 0's input side is the same fit, cut; above it the fits differ (they see the cut patch)
    name = "blocks.0.mlp.fc_in.weight"
    assert torch.allclose(cut.patch[name].dense(), full.truncate(1)[name].dense(), atol=1e-12)
    assert not torch.allclose(
        cut.patch["blocks.1.mlp.fc_in.weight"].dense(), full.truncate(1)["blocks.1.mlp.fc_in.weight"].dense()
    )
    assert _close(tp.thought_patch(model, prompt, q, ridge=1e-3, rank=100).patch, full.patch, 1e-12)


def test_the_qr_solver_is_the_same_fit_with_exact_residuals():
    model, prompt, q = _setup(m=40, d_mlp=7)
    normal = tp.thought_patch(model, prompt, q, ridge=1e-2)
    qr = tp.thought_patch(model, prompt, q, ridge=1e-2, solver="qr", batch_size=7)
    assert _rel(normal.patch, qr.patch) <= 1e-10
    few = q[:2]  # 2 positions: the fit interpolates, and the QR residual says so to rounding
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ThoughtWarning)
        exact = tp.thought_patch(model, prompt, few, solver="qr")
    assert all(f.input_residual <= 1e-12 and f.output_residual <= 1e-12 for f in exact.fits)
    with pytest.raises(InputError, match="solver must be 'normal' or 'qr'"):
        tp.thought_patch(model, prompt, q, solver="lu")


def test_the_qr_solver_makes_batchings_agree_on_the_ill_conditioned_shipped_model():
    """Condition numbers up to ~1e11 at ridge 0: the normal equations amplify the rounding of
    different batchings to ~5e-5 (measured); the streamed QR keeps the fits within 1e-10."""
    model = tp.load_model(dtype="float64")
    g = torch.Generator().manual_seed(0)
    prompt = tp.tasks.linreg.task_of(model).sample(1, g, dtype=torch.float64).tokens[0, :-1]
    q = torch.cat(
        [torch.randn(3000, 1, 4, generator=g, dtype=torch.float64), torch.zeros(3000, 1, 1, dtype=torch.float64)], -1
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ThoughtWarning)
        one = tp.thought_patch(model, prompt, q, solver="qr", batch_size=3000)
        streamed = tp.thought_patch(model, prompt, q, solver="qr", batch_size=333, cache_bytes=0)
    assert max(f.input_condition for f in one.fits[1:]) > 1e8  # the hard case it is meant for
    assert _rel(one.patch, streamed.patch) <= 1e-10


def test_one_verb_and_the_0_2_spellings_warn_with_the_new_ones(tmp_path):
    model, prompt, cal = _setup(m=40, t_q=2)
    fit = tp.thought_patch(model, prompt, cal, ridge=1e-3)
    assert fit.patch.meta["thought"]["fits"] == [f.to_dict() for f in fit.fits]  # the fit record travels
    tp.save_patch(fit.patch, tmp_path / "t.safetensors")
    assert tp.load_patch(tmp_path / "t.safetensors").meta["thought"]["fits"][0]["n"] == 80
    with pytest.warns(DeprecationWarning, match=r"use tp.thought_patch\(model, prompt, calibration") as caught:
        old = tp.compress(model, prompt, cal, ridge=1e-3)
    assert caught[0].filename == __file__
    assert _rel(fit.patch, old) == 0 and old.meta == fit.patch.meta
    with pytest.warns(
        DeprecationWarning, match=r"thought_patch\(queries=...\) is deprecated; the argument is now calibration="
    ):
        again = tp.thought_patch(model, prompt, queries=cal, ridge=1e-3)
    assert _rel(fit.patch, again.patch) == 0
    with pytest.raises(InputError, match="pass calibration= only"):
        tp.thought_patch(model, prompt, calibration=cal, queries=cal)
    with pytest.warns(DeprecationWarning, match="the argument is now inputs="):
        ev = tp.evaluate_thought_patch(model, prompt, queries=cal, patches=fit.patch)
    assert set(ev["mse_to_context"]) == {"no_prompt", "thought_patch"}  # snake_case keys only
    assert set(ev["gap_closed"]) == {"no_prompt", "thought_patch"}
    with pytest.raises(InputError, match="may not be named 'no_prompt'"):
        tp.evaluate_thought_patch(model, prompt, cal, {"no_prompt": fit.patch})


# ----------------------------------------------------------------------------- self-generated calibration
class _Chars:
    """Characters as token ids (``ord``): enough to cut and re-tokenize continuations."""

    def decode(self, ids):
        return "".join(chr(i) for i in ids)

    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": [ord(c) for c in text]}


def test_the_demonstrations_the_model_wrote_are_cut_into_queries_of_their_own():
    """Each continuation cut at the separator; its last (cut-off) piece, blank and repeated pieces
    dropped; the rest in the order first written, then batched by length."""
    from tokenpatch.thought.calibration import batched, demonstrations

    rows = torch.tensor(
        [
            [ord(c) for c in "Q: a\nA: b\n\nQ: cc\nA: d\n\nQ: eeee"],
            [ord(c) for c in "Q: a\nA: b\n\n\n\nQ: f\nA: g\n\nQ: hhh"],
        ]
    )
    got = [_Chars().decode(p) for p in demonstrations(_Chars(), rows, "\n\n")]
    assert got == ["Q: a\nA: b", "Q: cc\nA: d", "Q: f\nA: g"]
    batches = batched(demonstrations(_Chars(), rows, "\n\n"))
    assert [tuple(b.shape) for b in batches] == [(2, 9), (1, 10)]
    assert demonstrations(_Chars(), rows[:1, :8], "\n\n") == []  # no separator written yet
    with pytest.raises(tp.InputError, match="separator"):
        demonstrations(_Chars(), rows, "")


def test_sample_calibration_is_the_models_own_seeded_continuations():
    model, prompt = build("llama"), ids(1, 6)[0]
    a = sample_calibration(model, prompt, n=5, length=4, batch_size=2, progress=False)
    assert a.shape == (5, 4) and a.dtype == torch.long
    assert torch.equal(a, sample_calibration(model, prompt, n=5, length=4, batch_size=2, progress=False))
    assert not torch.equal(a, sample_calibration(model, prompt, n=5, length=4, batch_size=2, seed=1, progress=False))
    cold = sample_calibration(model, prompt, n=3, length=4, temperature=1e-4, progress=False)  # ~ greedy decoding
    greedy = model.generate(prompt[None], max_new_tokens=4, do_sample=False)[0, 6:]
    assert all(torch.equal(row, greedy) for row in cold)
    for bad, message in [({"n": 0}, "n must be an int >= 1"), ({"temperature": 0}, "temperature must be a number > 0")]:
        with pytest.raises(tp.InputError, match=message):
            sample_calibration(model, prompt, **bad)
    with pytest.raises(tp.InputError, match="one prompt"):
        sample_calibration(model, ids(2, 6))
    begun = sample_calibration(model, prompt, n=3, length=5, start=torch.tensor([7, 8]), progress=False)
    assert begun.shape == (3, 5) and bool((begun[:, :2] == torch.tensor([7, 8])).all())
    cold = sample_calibration(
        model, prompt, n=2, length=5, start=torch.tensor([7, 8]), temperature=1e-4, progress=False
    )
    after = model.generate(torch.cat([prompt, torch.tensor([7, 8])])[None], max_new_tokens=3, do_sample=False)[0, 8:]
    assert all(torch.equal(row[2:], after) for row in cold)  # the model reads the start before it samples
    with pytest.raises(tp.InputError, match="start has 5 tokens, length=5"):
        sample_calibration(model, prompt, length=5, start=torch.arange(5))
    with pytest.raises(tp.InputError, match=r"input_ids must lie in \[0, 101\)"):
        sample_calibration(model, prompt, length=5, start=torch.tensor([500]))


def test_thought_patch_without_calibration_samples_its_own():
    model, prompt = build("llama"), ids(1, 6)[0]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", tp.ThoughtWarning)
        own = tp.thought_patch(model, prompt, progress=False)
        given = tp.thought_patch(model, prompt, sample_calibration(model, prompt, **SELF_CALIBRATION), progress=False)
    assert own.patch.meta["thought"]["calibration"] == {"self_generated": True, **SELF_CALIBRATION}
    assert own.fits[0].n == SELF_CALIBRATION["n"] * SELF_CALIBRATION["length"]
    dense, same = own.patch.dense(), given.patch.dense()
    assert all(torch.equal(dense[k], same[k]) for k in dense)
    with warnings.catch_warnings():  # continuations begun with given tokens (a few-shot prompt's "Q:")
        warnings.simplefilter("ignore", tp.ThoughtWarning)
        primed = tp.thought_patch(model, prompt, start=[7, 8], progress=False)
        cal = sample_calibration(model, prompt, start=torch.tensor([7, 8]), **SELF_CALIBRATION)
        by_hand = tp.thought_patch(model, prompt, cal, progress=False)
    assert primed.patch.meta["thought"]["calibration"] == {"self_generated": True, **SELF_CALIBRATION, "start": [7, 8]}
    dense, same = primed.patch.dense(), by_hand.patch.dense()
    assert all(torch.equal(dense[k], same[k]) for k in dense)
    assert any(not torch.equal(dense[k], own.patch.dense()[k]) for k in dense)  # the start made a difference
    with pytest.raises(tp.InputError, match="start= begins the continuations it samples; calibration was given"):
        tp.thought_patch(model, prompt, cal, start=[7])
    with pytest.raises(tp.InputError, match="calibration inputs .* are needed"):
        tp.thought_patch(tp.load_model(), torch.randn(8, 5))


def test_the_ridge_is_chosen_by_the_prompt_kl_on_held_out_queries():
    """``choose_ridge``: each ridge's patch fitted on three quarters of the queries, scored by the
    mean next-token KL to the prompted model on the held-out quarter (written out here for one
    ridge); the least wins. ``prompt_kl`` is that mean, computed by hand."""
    from conftest import build, ids

    from tokenpatch.thought.calibration import batched
    from tokenpatch.thought.held_out import choose_ridge, prompt_kl

    model = build("llama")
    prompt = ids(1, 6, seed=3)[0]
    rows = [r.tolist() for r in ids(12, 4, seed=4)] + [r.tolist() for r in ids(4, 3, seed=5)]
    ridge, scores = choose_ridge(model, prompt, rows, (0.01, 1.0, 100.0), keep_bos=True, seed=2)
    assert ridge == min(scores, key=scores.get) and list(scores) == [0.01, 1.0, 100.0]
    assert len({round(v, 12) for v in scores.values()}) == 3  # the ridge matters
    order = list(range(16))
    random.Random(2).shuffle(order)
    held, kept = [rows[i] for i in order[:4]], [rows[i] for i in order[4:]]
    patch = tp.thought_patch(model, prompt, batched(kept), ridge=1.0, keep_bos=True).patch
    by_hand = []
    for q in held:
        q = torch.tensor([q])
        ref = model(input_ids=torch.cat([prompt[None], q], 1)).logits[0, 6:].log_softmax(-1)
        with tp.apply(model, patch):
            got = model(input_ids=torch.cat([prompt[None, :1], q], 1)).logits[0, 1:].log_softmax(-1)
        by_hand += (ref.exp() * (ref - got)).sum(-1).tolist()
    assert abs(scores[1.0] - sum(by_hand) / len(by_hand)) <= 1e-12 * scores[1.0]
    assert abs(prompt_kl(model, prompt, batched(held), patch, True) - scores[1.0]) <= 1e-12 * scores[1.0]
    with pytest.raises(tp.InputError, match="cannot be split"):
        choose_ridge(model, prompt, rows[:1], keep_bos=True)
    with pytest.raises(tp.InputError, match="held_out"):
        choose_ridge(model, prompt, rows, held_out=1.0)


def test_thought_section_refuses_a_gradient_count_outside_its_prompts(tmp_path):
    from tokenpatch.workbench.report.thought import thought_section

    for bad in (0, 5):
        with pytest.raises(tp.InputError, match="n_gradient must be between 1 and n_prompts = 4"):
            thought_section(tmp_path, n_prompts=4, n_gradient=bad)
