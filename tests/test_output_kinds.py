"""Output kinds are classes (``tokenpatch.arch.outputs``): each computes its own token patch, thought-fit
pairs and next stream; the spelling of earlier versions (``OutputSite(kind, ...)``, a tuple in ``Sites``)
builds the same class."""

from __future__ import annotations

import pytest
import torch

import tokenpatch as tp
from tokenpatch.arch import Sites
from tokenpatch.arch.outputs import (
    KINDS,
    OUTPUT_KINDS,
    BiasOutput,
    ExpertsOutput,
    GatedOutput,
    MatrixOutput,
    OutputSite,
    ScaledMatrixOutput,
)
from tokenpatch.arch.record import LayerRecord


def test_every_kind_is_one_class_found_by_its_name():
    assert OUTPUT_KINDS == ("bias", "matrix", "matrix+scale", "gated", "experts")
    assert {cls.kind: cls for cls in KINDS.values()} == KINDS
    assert all(issubclass(cls, OutputSite) and cls is not OutputSite for cls in KINDS.values())
    assert len(set(KINDS.values())) == len(KINDS)


@pytest.mark.parametrize(
    "old, new",
    [
        (("bias", "l.fc.bias"), BiasOutput("l.fc.bias")),
        (("matrix", "l.fc.weight"), MatrixOutput("l.fc.weight")),
        (("matrix+scale", "l.fc.weight", "l.n.weight"), ScaledMatrixOutput("l.fc.weight", "l.n.weight")),
        (("gated", "l.fc.weight"), GatedOutput("l.fc.weight")),
        (("experts", "l.experts.down_proj"), ExpertsOutput("l.experts.down_proj")),
    ],
)
def test_the_earlier_spellings_build_the_class(old, new):
    with pytest.warns(DeprecationWarning, match=type(new).__name__):
        assert OutputSite(*old) == new
    assert type(Sites((), old).output) is type(new) and Sites((), old).output == new
    assert new[0] == old[0] and tuple(new[1:]) == old[1:]  # read as the tuple it replaced
    assert new != MatrixOutput(new.name) or type(new) is MatrixOutput


def test_what_each_kind_fits_and_writes():
    assert BiasOutput("a.fc.bias").matrix == "a.fc.weight" and BiasOutput("a.fc.bias").affine
    assert MatrixOutput("a.fc.weight").matrix == "a.fc.weight" and not MatrixOutput("a.fc.weight").affine
    assert ExpertsOutput("a.experts.down_proj").matrix == "a.experts.down_proj"  # the stacked tensor itself
    assert ScaledMatrixOutput("a.fc.weight", "a.n.weight").names == ("a.fc.weight", "a.n.weight")
    assert {cls.kind for cls in KINDS.values() if cls.plain} == {"bias", "matrix"}  # what our models' fit takes
    with pytest.raises(tp.UnsupportedModelError, match="OutputSite"):
        ScaledMatrixOutput("a.fc.weight")  # no norm
    with pytest.raises(tp.UnsupportedModelError, match="OutputSite"):
        BiasOutput("a.fc.bias", "a.n.weight")  # a norm on a kind without one


def test_the_gate_divides_the_shift_and_the_scale_too():
    """``GatedOutput``: ``dW h_C = (m_C - m_0) / (scale sigmoid(gate))``, so that the block's
    ``scale sigmoid(gate) dW h_C`` adds exactly the shift."""
    g = torch.Generator().manual_seed(0)
    m_c, m_0, hidden, gate = (torch.randn(2, 3, k, generator=g, dtype=torch.float64) for k in (4, 4, 5, 1))
    site = GatedOutput("l.fc.weight", scale=0.5)
    shift = site.shift(m_c, m_0, LayerRecord(hidden=hidden, gate=gate))
    assert torch.allclose(0.5 * torch.sigmoid(gate) * shift, m_c - m_0, rtol=0, atol=1e-14)
    assert torch.equal(BiasOutput("b", scale=0.5).shift(m_c, m_0, LayerRecord()), (m_c - m_0) / 0.5)
