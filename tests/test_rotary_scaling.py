"""Rotary scaling that changes with the sequence length (``rope_parameters`` of type ``longrope``,
Phi-3-128k's, and ``dynamic``), on tiny random float64 models whose threshold (6 positions) the
test sequences cross: a forward rotates every position by its own length's factors, so a key
rotated in a longer forward is not the key of a shorter one (``tokenpatch/arch/rotary.py``).

The claims: ``tp.trajectory``'s prefix patches and increments are ``tp.token_patch`` of each prefix
(prefixes of one rotation regime share a pass, each padded to its own longest); a one-query thought
patch gives the model's own prompted forward whether or not the prompt alone crosses the threshold;
token patches reproduce the with-context logits (a token alone attends to itself only, its
rotation is immaterial). ``transformers``' dynamic rotation keeps the longest forward's frequencies
until a forward shorter than ``max_position_embeddings``: every reference forward here starts fresh
(``_fresh``), as tokenpatch's own passes do.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import tokenpatch as tp
from tokenpatch.arch import adapter_for
from tokenpatch.arch.rotary import length_scaling

pytest.importorskip("transformers", reason="the Hugging Face extra (pip install 'tokenpatch[hf]') is not installed")
from conftest import ids  # noqa: E402

THRESHOLD = 6


def _longrope(half: int = 8) -> dict:
    g = torch.Generator().manual_seed(1)
    short = (1 + torch.rand(half, generator=g, dtype=torch.float64)).tolist()
    long = (2 + 4 * torch.rand(half, generator=g, dtype=torch.float64)).tolist()
    params = {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": short, "long_factor": long}
    return dict(
        rope_parameters={**params, "original_max_position_embeddings": THRESHOLD},
        original_max_position_embeddings=THRESHOLD,
        max_position_embeddings=4 * THRESHOLD,
    )


DYNAMIC = dict(
    rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 4.0}, max_position_embeddings=THRESHOLD
)
MODELS = {
    "phi3_longrope": ("phi3", _longrope()),
    "llama_longrope": ("llama", _longrope()),
    "llama_dynamic": ("llama", DYNAMIC),
}


def build(key: str):
    name, overrides = MODELS[key]
    with warnings.catch_warnings():  # transformers' advice on the longrope factor and a too-large eos id
        warnings.simplefilter("ignore")
        return tp.testing.tiny_hf_model(name, **overrides)


@torch.no_grad()
def _fresh(model) -> None:
    """A forward shorter than the threshold: transformers' dynamic rotation back to a fresh model's."""
    model(torch.ones(1, 1, dtype=torch.long))


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def test_the_length_dependent_scalings_are_found_in_the_config():
    config = lambda key: tp.testing.tiny_hf_config(MODELS[key][0], **MODELS[key][1])  # noqa: E731
    longrope, dynamic = length_scaling(config("phi3_longrope")), length_scaling(config("llama_dynamic"))
    assert [longrope.regime(n) for n in (1, 6, 7, 30)] == [(False,), (False,), (True,), (True,)]
    assert [dynamic.regime(n) for n in (1, 5, 6, 7, 30)] == [(0,), (0,), (6,), (7,), (30,)]
    assert "rope_parameters['rope_type'] = 'longrope'" in longrope.describe()
    assert length_scaling(tp.testing.tiny_hf_config("llama")) is None
    per_type = type(
        "Config", (), {"max_position_embeddings": 8, "rope_parameters": {"full": DYNAMIC["rope_parameters"]}}
    )
    assert length_scaling(per_type).regime(9) == (9,)
    model = build("llama_longrope")  # the adapter's method reads it
    assert adapter_for(model).length_scaling(model) == length_scaling(model.config)


@torch.no_grad()
@pytest.mark.parametrize("key", list(MODELS))
def test_trajectory_is_the_token_patch_of_every_prefix_across_the_threshold(key):
    model, x = build(key), ids(1, 9, seed=3)
    model(ids(1, 16))  # a longer forward first: transformers' dynamic rotation keeps its frequencies
    traj = tp.trajectory(model, x, steps=True)  # prefixes of 1..9 tokens: both sides of 6
    for i in range(traj.query + 1):
        prefix = traj.prefix_inputs(x, i)
        _fresh(model)
        assert _max_diff(traj.patch(i).dense(), tp.token_patch(model, prefix).dense()) <= 1e-12, i
        if i:
            _fresh(model)
            want = tp.token_patch(model, prefix, remove=slice(i - 1, i)).dense()
            assert _max_diff(traj.step(i).dense(), want) <= 1e-12, i
    for i in (4, 7):  # the patch reproduces the prefix's own with-context logits
        _fresh(model)
        assert tp.verify(model, traj.patch(i), traj.prefix_inputs(x, i)).max_abs <= 1e-12, i


@torch.no_grad()
@pytest.mark.parametrize("key", list(MODELS))
def test_token_patches_reproduce_the_with_context_logits(key):
    """Each query alone (at 11, past the threshold, and at 3, 7): one token attends to itself, so
    its rotation does not matter; a removed chunk keeps the last position, and so the rotation."""
    model, x = build(key), ids(2, 12, seed=4)
    _fresh(model)
    want = model(x).logits
    patch = tp.token_patch(model, x, query=[-1, 3, 7])
    got = tp.functional_call(model, patch, **tp.strip_context(model, x, query=[-1, 3, 7])).logits[:, 0]
    assert float((got.view(2, 3, -1) - want[:, [11, 3, 7]]).abs().max()) <= 1e-12
    chunk = tp.token_patch(model, x, remove=slice(2, 5))
    got = tp.functional_call(model, chunk, **tp.strip_context(model, x, remove=slice(2, 5))).logits[:, -1]
    assert float((got - want[:, -1]).abs().max()) <= 1e-12


@torch.no_grad()
@pytest.mark.parametrize("key", list(MODELS))
@pytest.mark.parametrize(
    "prompt_len", [4, 8]
)  # the prompt alone below the threshold (and with its query past it), or past
def test_thought_patch_of_one_query_is_the_prompted_forward(key, prompt_len):
    model = build(key)
    prompt, query = ids(1, prompt_len, seed=5)[0], ids(1, 3, seed=6)
    model(ids(1, 16))  # a longer forward first (a dynamic rotation's state)
    with pytest.warns(tp.ThoughtWarning, match="rank-deficient"):
        fit = tp.thought_patch(model, prompt, query)
    _fresh(model)
    want = model(torch.cat([prompt[None], query], 1)).logits[:, prompt_len:]
    _fresh(model)
    got = tp.functional_call(model, fit.patch, query).logits
    assert float((got - want).abs().max()) <= 1e-12


@torch.no_grad()
@pytest.mark.parametrize("key", list(MODELS))
def test_thought_patch_of_ragged_queries_either_side_of_the_threshold(key):
    """Queries of 4 and 3 tokens after a 3-token prompt (7 and 6 positions: one padded batch would
    rotate the short one as the long one) and a kept BOS: each calibration query alone gets the
    prompted logits."""
    model = build(key)
    prompt, queries = ids(1, 3, seed=7)[0], [ids(1, 4, seed=8), ids(1, 3, seed=9)]
    model(ids(1, 16))  # a longer forward first (a dynamic rotation's state)
    with pytest.warns(tp.ThoughtWarning, match="rank-deficient"):
        fit = tp.thought_patch(model, prompt, queries, keep_bos=True)
    for q in queries:
        _fresh(model)
        want = model(torch.cat([prompt[None], q], 1)).logits[:, 3:]
        _fresh(model)
        got = tp.functional_call(model, fit.patch, torch.cat([prompt[None, :1], q], 1)).logits[:, 1:]
        assert float((got - want).abs().max()) <= 1e-12


@torch.no_grad()
@pytest.mark.parametrize("key", [*MODELS, "llama"])
def test_a_chunk_patch_refuses_position_ids_that_rotate_its_kept_tokens_otherwise(key):
    """Compacted position ids (0, 1, .. after the removed chunk) change the kept tokens' distances:
    refused in one line, for any rotary model; a run shifted as a whole keeps them, but moves the
    longest position, so it is refused only where the rotation changes with the length."""
    model = build(key) if key in MODELS else tp.testing.tiny_hf_model(key)
    x = ids(1, 12, seed=4)
    patch = tp.token_patch(model, x, remove=slice(2, 5))
    stripped = tp.strip_context(model, x, remove=slice(2, 5))  # kept positions 0, 1, 5..11
    want = model(x).logits[:, -1]
    got = tp.functional_call(model, patch, **stripped).logits[:, -1]
    assert float((got - want).abs().max()) <= 1e-12
    compact = {**stripped, "position_ids": torch.arange(9)[None]}
    with pytest.raises(tp.InputError, match=r"kept positions \[0, 1, 5, .*row 0 .*distances") as err:
        tp.functional_call(model, patch, **compact)
    assert "\n" not in str(err.value)
    tail = tp.token_patch(model, x, remove=slice(0, 3))  # kept 3..11: shifted to 0..8, the same distances
    shifted = {**tp.strip_context(model, x, remove=slice(0, 3)), "position_ids": torch.arange(9)[None]}
    if key in MODELS:
        with pytest.raises(tp.InputError, match=r"shifted as a whole, with rope_parameters\['rope_type'\]"):
            tp.functional_call(model, tail, **shifted)
    else:  # plain rotary: the same rotation at any offset (to the rotary tables' float32 rounding)
        tp.functional_call(model, tail, **shifted)
