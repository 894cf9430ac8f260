"""A patch's behaviour lives in its type: ``apply`` and ``functional_call`` agree on every derived patch.

``Patch.static``, ``Patch.plan``, ``Patch.readers`` and ``Patch.rows`` are fields that ``+``, ``.sum``,
``Patch.stack``, indexing and the patch files carry. The case that used to go wrong: on a Hugging Face
model the input change of each MLP (a ``"<module>:input"`` delta) is written into the weights by
``apply`` as ``W + W D`` on the matrices that read it; when that list lived in ``meta``, ``p + q`` lost it
and ``apply(model, p + q)`` silently left the input side out (off by 0.075 on a tiny Llama).

Each derived patch is run both ways, float64, on our model and on a tiny random model of every Hugging
Face family: summed with a zero patch, stacked and indexed back, summed over a batch of one, saved
and reloaded; a trajectory's prefix patch; a thought patch (the same combinations).
"""

from __future__ import annotations

import warnings

import pytest
import torch
from conftest import CONFIGS, build, hooks_left, ids, random_model

import tokenpatch as tp

TOL = 1e-12


def _variants(patch: tp.Patch, tmp_path) -> dict[str, tp.Patch]:
    """Patches that must run exactly as ``patch`` (a single ``[1, 1]`` patch)."""
    zero = patch.map(torch.zeros_like)
    tp.save_patch(patch + zero, tmp_path / "sum.safetensors")
    return {
        "itself": patch,
        "plus zero": patch + zero,
        "zero plus": zero + patch,
        "stacked, indexed": tp.Patch.stack([zero, patch], "batch")[1:2],
        "stacked on query, indexed": tp.Patch.stack([zero, patch], "query")[:, 1],
        "summed over batch": patch.sum("batch"),
        "reloaded sum": tp.load_patch(tmp_path / "sum.safetensors"),
    }


def _both_ways(model, patch: tp.Patch, run) -> tuple[torch.Tensor, torch.Tensor]:
    hooked = tp.functional_call(model, patch, **run) if isinstance(run, dict) else tp.functional_call(model, patch, run)
    with tp.apply(model, patch):
        written = model(**run) if isinstance(run, dict) else model(run)
    out = lambda o: o.logits if hasattr(o, "logits") else o
    assert hooks_left(model) == 0
    return out(hooked), out(written)


def _check(model, patch, run, want, tmp_path):
    before = [p.detach().clone() for p in model.parameters()]
    for label, variant in _variants(patch, tmp_path).items():
        hooked, written = _both_ways(model, variant, run)
        assert float((hooked - written).abs().max()) <= TOL, label
        if want is not None:
            assert float((hooked - want).abs().max()) <= 1e-10, label
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))  # every apply restored


@torch.no_grad()
@pytest.mark.parametrize("name", list(CONFIGS))
def test_token_patch_variants_run_the_same_both_ways(name, tmp_path, float64_gemma_norms):
    model, x = build(name), ids(1, 9)
    patch = tp.token_patch(model, x)
    want = model(x).logits[:, -1:]
    stripped = tp.strip_context(model, x)
    _check(model, patch, stripped, want, tmp_path)


@torch.no_grad()
@pytest.mark.parametrize("name", ["llama", "gpt2", "qwen2_moe", "gemma3"])
def test_the_input_side_survives_a_sum(name, float64_gemma_norms):
    """The reported case, kept apart: ``apply(p + 0)`` is the with-context output, not 0.075 off."""
    model, x = build(name), ids(1, 9)
    p = tp.token_patch(model, x)
    assert p.readers and (p + p.map(torch.zeros_like)).readers == p.readers
    want = model(x).logits[:, -1]
    with tp.apply(model, p + p.map(torch.zeros_like)):
        got = model(**tp.strip_context(model, x)).logits[:, -1]
    assert float((got - want).abs().max()) <= 1e-10


@torch.no_grad()
@pytest.mark.parametrize("name", ["llama", "gpt2", "gemma3"])
def test_trajectory_patch_variants(name, tmp_path, float64_gemma_norms):
    model, x = build(name), ids(1, 7)
    traj = tp.trajectory(model, x)
    patch = traj.patch(4)
    assert patch.plan == tp.make_plan(5, -1) and patch.readers == traj.patches.readers
    prefix = traj.prefix_inputs(x, 4)
    _check(model, patch, tp.strip_context(model, prefix), model(prefix).logits[:, -1:], tmp_path)


@torch.no_grad()
@pytest.mark.parametrize("name", ["llama", "gpt2", "qwen2_moe", "gemma3"])
def test_thought_patch_variants(name, tmp_path, float64_gemma_norms):
    model = build(name)
    prompt, queries, new = ids(1, 10, seed=4)[0], ids(6, 3, seed=5), ids(2, 3, seed=6)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", tp.ThoughtWarning)
        fit = tp.thought_patch(model, prompt, queries)
    assert fit.patch.static and fit.patch.plan is None
    for label, variant in _variants(fit.patch, tmp_path).items():
        assert variant.static, label
        hooked, written = _both_ways(model, variant, new)  # any no-prompt input: a static patch
        assert float((hooked - written).abs().max()) <= TOL, label
    cut = fit.truncate(2)
    assert cut.static and cut.readers == fit.patch.readers


@torch.no_grad()
def test_our_model_token_and_thought_patches(tmp_path, small_model, small_inputs):
    x = small_inputs[:1]
    patch = tp.token_patch(small_model, x)
    _check(small_model, patch, x[:, -1:], small_model(x)[:, -1:], tmp_path)
    traj = tp.trajectory(small_model, x)
    prefix = traj.prefix_inputs(x, 3)
    _check(small_model, traj.patch(3), prefix[:, -1:], small_model(prefix)[:, -1:], tmp_path)
    cal = torch.randn(40, 2, 5, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    fit = tp.thought_patch(small_model, x[0, :-2], cal, ridge=1e-3)
    for label, variant in _variants(fit.patch, tmp_path).items():
        hooked, written = _both_ways(small_model, variant, cal[:4])
        assert variant.static and float((hooked - written).abs().max()) <= TOL, label


def test_fields_travel_and_combine():
    model = random_model(tp.ICLConfig(d_in=5, d_model=8, n_layers=2, n_heads=2, norm="pre"), seed=3)
    x = torch.randn(2, 6, 5, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    p = tp.token_patch(model, x, query=[3, 5])
    assert p.plan == tp.make_plan(6, [3, 5]) and p.rows is None and not p.static
    assert p[1, 0].plan == tp.make_plan(6, [3]) and p[1, 0].rows == (1,)
    assert (p + p).plan == p.plan and p.sum("query").plan is None
    assert tp.Patch.stack([p[:, 0], p[:, 1]], "query").plan == p.plan
    assert tp.Patch.stack([p[0], p[1]], "batch").rows == (0, 1)
    assert "query" not in p.meta and "static" not in p.meta  # meta is provenance only
    chunk = tp.token_patch(model, x, query=-1, remove=slice(1, 3))
    assert chunk.plan.mode == "chunk" and chunk.positions == (3,)


def test_old_behaviour_keys_in_meta_still_work_and_warn():
    model = random_model(tp.ICLConfig(d_in=5, d_model=8, n_layers=2, n_heads=2, norm="pre"), seed=3)
    x = torch.randn(1, 6, 5, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    p = tp.token_patch(model, x)
    with pytest.warns(DeprecationWarning, match="meta is provenance only"):
        old = tp.Patch(dict(p.items()), None, {**p.meta, "static": True, "seq_len": 6, "query": [5], "removed": None})
    assert old.static and old.plan == p.plan and "static" not in old.meta


def test_an_input_change_without_its_readers_is_refused():
    model, x = build("llama"), ids(1, 6)
    p = tp.token_patch(model, x)
    bare = tp.Patch(dict(p.items()), None, p.meta)  # readers left out
    with pytest.raises(tp.InputError, match="names no matrices that read it"):
        with tp.apply(model, bare):
            pass


def test_deltas_of_two_dtypes_are_refused_naming_the_parameters():
    """A model whose parameters mix dtypes (transformers' from_pretrained keeps some modules in float32)
    gives deltas of two dtypes: refused, naming which parameters hold which and what to do."""
    deltas = {"a.weight": torch.zeros(1, 1, 2, 3, dtype=torch.float64), "b.weight": torch.zeros(1, 1, 2, 3)}
    with pytest.raises(tp.InputError, match=r"float64: a\.weight; float32: b\.weight .*model\.to\(dtype\)"):
        tp.Patch(deltas)
