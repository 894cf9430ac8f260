"""Acceptance: float64 exactness over every combination of contextual layer x norm placement x
residual x query mode x removed chunk, for a single block and for 3-layer models, with sizes
drawn by hypothesis. Equivalence is algebra: the bound is 1e-10, errors are ~1e-15."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import SWEEP_EXAMPLES, random_block, random_model, sweep
from hypothesis import given
from hypothesis import strategies as st

import tokenpatch as tp

LAYERS = sorted(tp.LAYERS)
NORMS = ["none", "pre", "post"]
COMBOS = list(itertools.product(LAYERS, NORMS, [True, False], ["last", "all"], ["context", "chunk"]))


@st.composite
def sizes(draw):
    n_heads = draw(st.sampled_from([1, 2, 3]))
    d_model = n_heads * draw(st.integers(1, 4))
    seq_len = draw(st.integers(4, 10))
    # the removed chunk Y: any nonempty set of positions but the last one (the "last" query), from
    # position 0 on; a slice or a boolean mask [seq_len], contiguous or not
    if draw(st.booleans()):
        start = draw(st.integers(0, seq_len - 2))
        chunk = slice(start, draw(st.integers(start + 1, seq_len - 1)))
    else:
        bits = draw(st.integers(1, 2 ** (seq_len - 1) - 1))  # bit p set: position p removed
        chunk = torch.tensor([bool(bits >> p & 1) for p in range(seq_len)])
    return dict(
        n_heads=n_heads,
        d_model=d_model,
        d_in=draw(st.integers(1, 5)),
        d_mlp=draw(st.integers(1, 12)),
        batch=draw(st.integers(1, 3)),
        seq_len=seq_len,
        chunk=chunk,
        seed=draw(st.integers(0, 2**16)),
    )


def _kept_and_queries(seq_len, query, remove):
    """Independently of make_plan: the positions of C \\ Y and the query positions."""
    removed = set(range(seq_len)[remove]) if isinstance(remove, slice) else set(remove.nonzero().flatten().tolist())
    kept = [p for p in range(seq_len) if p not in removed]
    return kept, ([seq_len - 1] if query == -1 else kept if query == "all" else [q % seq_len for q in query])


def _check(model, inputs, query, remove):
    patch = tp.token_patch(model, inputs, query=query, remove=remove)
    result = tp.verify(model, patch, inputs)
    assert result.max_abs <= 1e-10, result.table()
    if remove is not None:  # the model on C \ Y as the test builds it, patched, gives the with-context outputs
        kept, queries = _kept_and_queries(inputs.shape[1], query, remove)
        assert list(patch.plan.query) == queries and patch.positions == tuple(kept.index(q) for q in queries)
        with torch.no_grad():
            out = tp.functional_call(model, patch, inputs[:, kept])  # [B, len(kept), d_out]
            ref = model(inputs)[:, queries]  # [B, len(queries), d_out]
        torch.testing.assert_close(out[:, list(patch.positions)], ref, rtol=0, atol=1e-10)
    # rank 1 per matrix and per query, stored as factors
    for delta in patch.values():
        if isinstance(delta, tp.LowRank):
            assert delta.rank == 1 and delta.u.shape[:2] == patch.lead
            assert torch.linalg.matrix_rank(delta.dense()).max() <= 1
    return patch, result


@pytest.mark.parametrize("layer,norm,residual,query,remove", COMBOS)
@sweep
@given(s=sizes())
def test_single_block_exact(layer, norm, residual, query, remove, s):
    """One block, h [batch, seq_len, d_model]: exact patches for the drawn sizes and chunk."""
    config = tp.ICLConfig(
        d_in=s["d_model"],
        d_model=s["d_model"],
        n_layers=1,
        n_heads=s["n_heads"],
        d_mlp=s["d_mlp"],
        layer=layer,
        norm=norm,
        residual=residual,
    )
    block = random_block(config, s["seed"])
    h = torch.randn(
        s["batch"], s["seq_len"], s["d_model"], generator=torch.Generator().manual_seed(s["seed"]), dtype=torch.float64
    )
    _check(block, h, -1 if query == "last" else "all", None if remove == "context" else s["chunk"])


@pytest.mark.parametrize("layer,norm,residual,query,remove", COMBOS)
@sweep
@given(s=sizes())
def test_three_layer_model_exact(layer, norm, residual, query, remove, s):
    """A 3-layer model, x [batch, seq_len, d_in] -> [batch, seq_len, 2]: exact patches."""
    config = tp.ICLConfig(
        d_in=s["d_in"],
        d_out=2,
        d_model=s["d_model"],
        n_layers=3,
        n_heads=s["n_heads"],
        d_mlp=s["d_mlp"],
        layer=layer,
        norm=norm,
        residual=residual,
    )
    model = random_model(config, s["seed"])
    x = torch.randn(
        s["batch"], s["seq_len"], s["d_in"], generator=torch.Generator().manual_seed(s["seed"]), dtype=torch.float64
    )
    _check(model, x, -1 if query == "last" else "all", None if remove == "context" else s["chunk"])


def test_sweep_size_follows_the_profile():
    """HYPOTHESIS_PROFILE=thorough enlarges both sweeps: a fresh interpreter importing this module
    under that profile sees SWEEP_EXAMPLES["thorough"] examples per case (a hard-coded
    max_examples on either decorator would pin it)."""
    sweeps = (test_single_block_exact, test_three_layer_model_exact)
    assert all(t._hypothesis_internal_use_settings.max_examples == sweep.max_examples for t in sweeps)
    here = Path(__file__).resolve().parent
    code = (
        "import test_equivalence as t; print(*(f._hypothesis_internal_use_settings.max_examples "
        "for f in (t.test_single_block_exact, t.test_three_layer_model_exact)))"
    )
    env = {
        **os.environ,
        "HYPOTHESIS_PROFILE": "thorough",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(here.parent), os.environ.get("PYTHONPATH")])),
    }
    run = subprocess.run([sys.executable, "-c", code], cwd=here, env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert [int(n) for n in run.stdout.split()] == [SWEEP_EXAMPLES["thorough"]] * 2
    assert SWEEP_EXAMPLES["thorough"] > SWEEP_EXAMPLES["default"]


@pytest.mark.parametrize("layer", LAYERS)
@pytest.mark.parametrize("norm", NORMS)
def test_bias_free_model_uses_output_matrix(layer, norm):
    """Without an output bias the residual term is a rank-1 patch of fc_out (section 3)."""
    model = random_model(
        tp.ICLConfig(d_in=3, d_model=6, n_layers=3, n_heads=2, layer=layer, norm=norm, bias=False), seed=3
    )
    x = torch.randn(2, 6, 3, dtype=torch.float64)
    patch, _ = _check(model, x, "all", None)
    assert isinstance(patch["blocks.1.mlp.fc_out.weight"], tp.LowRank)
    assert not any(name.endswith("bias") for name in patch)
    _check(model, x, [1, 4], slice(2, 4))


def test_multiple_queries_with_chunk_and_context_after_it():
    """Queries before, right after and well after the chunk; the context between chunk and query
    keeps the original weights in the no-context pass."""
    model = random_model(tp.ICLConfig(d_in=4, d_model=6, n_layers=4, n_heads=3, norm="pre"), seed=5)
    x = torch.randn(2, 12, 4, dtype=torch.float64)
    patch, _ = _check(model, x, [1, 6, 11], slice(3, 6))
    assert patch.positions == (1, 3, 8)
    # a query before the chunk sees no change: its patch is zero up to rounding (the two passes
    # run attention over sequences of different lengths), far below the other queries' patches
    norms = patch.norms()  # {name: [batch, query]}
    assert all(float(v[:, 0].max()) <= 1e-13 < float(v[:, 1].min()) for v in norms.values())


def test_removing_nothing_before_first_token_gives_zero_patch():
    model = random_model(tp.ICLConfig(d_in=4, d_model=6, n_layers=2, n_heads=2), seed=6)
    x = torch.randn(1, 5, 4, dtype=torch.float64)
    patch, _ = _check(model, x, "all", None)
    first = patch[:, 0].norms()
    assert all(float(v.max()) <= 1e-14 for v in first.values())


def test_unpatched_no_context_pass_is_far_off(small_model, small_inputs):
    """The comparison has teeth: without the patch the no-context pass is far from the with-context one."""
    patch = tp.token_patch(small_model, small_inputs)
    zero = patch.map(torch.zeros_like)
    assert tp.verify(small_model, zero, small_inputs).max_rel > 1e-2
    assert tp.verify(small_model, patch, small_inputs).max_abs <= 1e-10


def test_register_a_custom_adapter(small_model, small_inputs):
    """A new family is one adapter: here a wrapper model reusing the ICL adapter's knowledge."""
    from tokenpatch import arch

    class Wrapped(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, x, return_hidden=False):
            return self.inner(x, return_hidden)

    class WrappedAdapter(arch.ICLAdapter):
        name = "wrapped"

        def matches(self, model):
            return isinstance(model, Wrapped)

        def n_layers(self, model):
            return super().n_layers(model.inner)

        def check_inputs(self, model, inputs):
            return super().check_inputs(model.inner, inputs)

        def embed(self, model, inputs):
            return super().embed(model.inner, inputs)

        def mix(self, model, i, h):
            return super().mix(model.inner, i, h)

        def mix_with_alone(self, model, i, h, positions):
            return super().mix_with_alone(model.inner, i, h, positions)

        def finish(self, model, i, m, s):
            return super().finish(model.inner, i, m, s)

        def run(self, model, inputs):
            return model(inputs, return_hidden=True)

        def sites(self, model, i):
            s = super().sites(model.inner, i)
            return arch.Sites(tuple(f"inner.{n}" for n in s.inputs), (s.output[0], f"inner.{s.output[1]}"))

        def describe(self, model):
            return {"class": "Wrapped", "adapter": self.name}

    wrapped = Wrapped(small_model)
    with pytest.raises(tp.UnsupportedModelError):
        tp.token_patch(wrapped, small_inputs)
    with pytest.warns(DeprecationWarning, match="embed/mix/finish"):  # its passes are its mix and finish
        adapter = arch.register(WrappedAdapter())
    try:
        patch = tp.token_patch(wrapped, small_inputs, query="all")
        assert "inner.blocks.0.mlp.fc_in.weight" in patch
        assert tp.verify(wrapped, patch, small_inputs).max_abs <= 1e-10
    finally:
        arch.ADAPTERS.remove(adapter)


def test_bare_block_reports_one_site():
    block = random_block(tp.ICLConfig(d_in=4, d_model=4, n_layers=1, n_heads=2))
    h = torch.randn(2, 5, 4, dtype=torch.float64)
    result = tp.verify(block, tp.token_patch(block, h), h)
    assert [e.name for e in result.per_layer] == ["output"]
