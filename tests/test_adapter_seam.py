"""The adapter seam (``tokenpatch/arch/base.py``): everything the library asks of a model family is a
declared method of ``Adapter``; an adapter that lacks one is refused with an error naming it; and
``Sites.output`` is the typed ``OutputSite`` record."""

from __future__ import annotations

import ast
import warnings
from pathlib import Path

import pytest
import torch
from conftest import build, ids, random_model

import tokenpatch as tp
from tokenpatch import arch
from tokenpatch.arch import Adapter, ICLAdapter, OutputSite, Sites
from tokenpatch.arch.outputs import KINDS, BiasOutput, MatrixOutput, ScaledMatrixOutput
from tokenpatch.baselines import site_modules
from tokenpatch.interp.ablation import ablate_heads, head_sites
from tokenpatch.interp.head_patches import head_patches
from tokenpatch.interp.induction import attention_patterns

PACKAGE = Path(__file__).resolve().parent.parent / "tokenpatch"
TRACED = ("recording", "trace", "anchors")
MODULE_MAP = (
    "layers",
    "n_heads",
    "output_projections",
    "attention_outputs",
    "attention_norms",
    "mlp_input_from_heads",
    "attention_patterns",
)


class Wrapped(torch.nn.Module):
    """Our model behind a module of a user's own type, which no built-in adapter matches."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x, return_hidden=False):
        return self.inner(x, return_hidden)


_ICL = ICLAdapter()


class Basics(Adapter):
    """A user's adapter with the layer-by-layer basics only (what ``token_patch`` needs)."""

    name = "mine"
    position_dependent_embedding = False

    def matches(self, model):
        return isinstance(model, Wrapped)

    def n_layers(self, model):
        return _ICL.n_layers(model.inner)

    def check_inputs(self, model, inputs):
        return _ICL.check_inputs(model.inner, inputs)

    def seq_len(self, inputs):
        return inputs.shape[1]

    def batch_size(self, inputs):
        return inputs.shape[0]

    def strip(self, inputs, positions, separate):
        return _ICL.strip(inputs, positions, separate)

    def embed(self, model, inputs):
        return _ICL.embed(model.inner, inputs)

    def mix(self, model, i, h):
        return _ICL.mix(model.inner, i, h)

    def finish(self, model, i, m, s):
        return _ICL.finish(model.inner, i, m, s)

    def sites(self, model, i):
        s = _ICL.sites(model.inner, i)
        return Sites(tuple(f"inner.{n}" for n in s.inputs), type(s.output)(f"inner.{s.output.name}"))

    def run(self, model, inputs):
        return model(inputs, return_hidden=True)


class ClaimsTraced(Basics):
    """The same adapter claiming ``traced`` passes it does not implement."""

    name = "mine_traced"
    traced = True


@pytest.fixture
def registered():
    """Register an adapter for the test; the registry is restored afterwards."""
    before = list(arch.ADAPTERS)
    try:
        yield lambda adapter: arch.register(adapter)
    finally:
        arch.ADAPTERS[:] = before


@pytest.fixture
def wrapped():
    return Wrapped(random_model(tp.ICLConfig(d_in=5, d_model=8, n_layers=2, n_heads=2, norm="pre"), seed=1))


def _missing(adapter: str, method: str) -> str:
    return rf"the {adapter} adapter does not implement {method}\(\) \(needed by .*\); see tokenpatch.arch.Adapter"


def test_a_basics_only_adapter_patches_and_is_refused_by_the_rest_naming_the_method(registered, wrapped):
    with pytest.warns(DeprecationWarning, match="embed/mix/finish"):  # written for the layer-by-layer passes
        registered(Basics())
    x = torch.randn(2, 5, 5, dtype=torch.float64)
    patch = tp.token_patch(wrapped, x)  # the basics are all token_patch needs
    assert tp.verify(wrapped, patch, x).max_abs <= 1e-10
    calls = {
        "recording": lambda: tp.generate(wrapped, x),
        "n_heads": lambda: head_patches(wrapped, x),
        "output_projections": lambda: head_sites(wrapped),
        "layers": lambda: site_modules(wrapped, "residual"),
        "attention_patterns": lambda: attention_patterns(wrapped, x),
        "mix_prefixes": lambda: tp.trajectory(wrapped, x),
    }
    for method, call in calls.items():
        with pytest.raises(tp.UnsupportedModelError, match=_missing("mine", method)):
            call()
    with pytest.raises(tp.UnsupportedModelError, match=_missing("mine", "output_projections")):
        with ablate_heads(wrapped, [(0, 0)]):
            pass
    assert r"tp.generate" in _message(lambda: tp.generate(wrapped, x))


class NoPasses(Adapter):
    """A user's adapter that says where the patch goes but implements neither pass."""

    name = "mine_no_passes"
    matches, n_layers, check_inputs = Basics.matches, Basics.n_layers, Basics.check_inputs
    seq_len, batch_size, strip, sites = Basics.seq_len, Basics.batch_size, Basics.strip, Basics.sites


def test_an_adapter_without_passes_is_refused_naming_the_pass(registered, wrapped):
    registered(NoPasses())
    x = torch.randn(2, 5, 5, dtype=torch.float64)
    with pytest.raises(tp.UnsupportedModelError, match=_missing("mine_no_passes", "trace")):
        tp.token_patch(wrapped, x)
    with pytest.raises(tp.UnsupportedModelError, match=_missing("mine_no_passes", "recording")):
        tp.generate(wrapped, x)


def test_an_adapter_claiming_traced_passes_gets_them_from_its_layers(registered, wrapped):
    """``traced`` no longer picks an engine: every adapter's patch comes from ``trace`` and ``anchors``,
    which an adapter written for ``mix`` and ``finish`` gets from them (``arch.layered``)."""
    with pytest.warns(DeprecationWarning, match="embed/mix/finish"):
        registered(ClaimsTraced())
    x = torch.randn(2, 5, 5, dtype=torch.float64)
    assert tp.verify(wrapped, tp.token_patch(wrapped, x, query="all"), x).max_abs <= 1e-10
    assert tp.verify(wrapped, tp.token_patch(wrapped, x, query=[2, 4], remove=[1]), x).max_abs <= 1e-10
    with pytest.raises(tp.UnsupportedModelError, match=_missing("mine_traced", "recording")):
        tp.generate(wrapped, x)


def test_the_registry_is_restored(wrapped):
    assert not any(isinstance(a, Basics) for a in arch.ADAPTERS)
    with pytest.raises(tp.UnsupportedModelError, match="no adapter"):
        tp.token_patch(wrapped, torch.randn(1, 3, 5, dtype=torch.float64))


def _message(call) -> str:
    try:
        call()
    except tp.UnsupportedModelError as exc:
        return str(exc)
    raise AssertionError("no error")


def test_adapter_declares_the_traced_passes_and_the_module_map():
    for method in (*TRACED, *MODULE_MAP):
        assert method in vars(Adapter) and callable(getattr(Adapter, method)), method
        assert (getattr(Adapter, method).__doc__ or "").strip(), f"Adapter.{method} has no docstring"
    # the built-in adapters implement what their callers need
    hf, icl = arch.HFAdapter(), ICLAdapter()
    assert all(hf.implements(m) for m in (*TRACED, *MODULE_MAP))
    assert all(
        icl.implements(m)
        for m in (
            "layers",
            "n_heads",
            "output_projections",
            "mlp_input_from_heads",
            "attention_patterns",
            "mix_prefixes",
        )
    )
    assert all(icl.implements(m) for m in (*TRACED, "alone_anchor"))  # our models are recorded too
    assert not hasattr(hf, "_layers")


def _attributes_read_on_adapters() -> dict[str, list[str]]:
    """Every attribute the library (outside ``tokenpatch/arch``) reads on an adapter: on a name ``adapter``,
    on ``self.adapter``, or on ``adapter_for(...)``."""
    used: dict[str, list[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        if path.relative_to(PACKAGE).parts[0] == "arch":
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.Attribute):
                continue
            v = node.value
            if (
                (isinstance(v, ast.Name) and v.id == "adapter")
                or (isinstance(v, ast.Attribute) and v.attr == "adapter")
                or (isinstance(v, ast.Call) and isinstance(v.func, ast.Name) and v.func.id == "adapter_for")
            ):
                used.setdefault(node.attr, []).append(f"{path.relative_to(PACKAGE)}:{node.lineno}")
    return used


def test_callers_use_only_declared_public_adapter_members():
    used = _attributes_read_on_adapters()
    assert {"trace", "anchors", "recording", "layers"} <= set(used)  # the finder sees the traced callers
    undeclared = {k: v for k, v in used.items() if k.startswith("_") or not hasattr(Adapter, k)}
    assert undeclared == {}


def test_no_family_checks_outside_arch():
    """No ``isinstance(..., HFAdapter)``, no ``HFAdapter.family``, no ``hasattr(model, "blocks")``."""
    found = []
    for path in PACKAGE.rglob("*.py"):
        if path.relative_to(PACKAGE).parts[0] == "arch":
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Name) and node.id == "HFAdapter":
                found.append(f"{path.name}:{node.lineno} HFAdapter")
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id in ("hasattr", "getattr")
                and len(node.args) >= 2
                and isinstance(node.args[0], ast.Name)
                and node.args[0].id == "model"
                and isinstance(node.args[1], ast.Constant)
                and node.args[1].value == "blocks"
            ):
                found.append(f"{path.name}:{node.lineno} {node.func.id}(model, 'blocks')")
    assert found == []


# ----------------------------------------------------------------------------- the typed output site
@pytest.mark.parametrize(
    "name,kinds",
    [
        ("llama", {"matrix"}),
        ("gpt2", {"bias"}),
        ("gpt_neox", {"bias"}),
        ("gemma2", {"matrix+scale"}),
        ("qwen2_moe", {"gated", "matrix"}),
    ],
)
def test_hf_output_sites_are_typed(name, kinds):
    model = build(name)
    adapter = tp.adapter_for(model)
    params = dict(model.named_parameters())
    seen = set()
    for i in range(adapter.n_layers(model)):
        out = adapter.sites(model, i).output
        assert isinstance(out, OutputSite) and type(out) is KINDS[out.kind]  # one class per kind
        seen.add(out.kind)
        assert all(n in params for n in out.names)
        assert (out.norm is not None) == (out.kind == "matrix+scale")
    assert seen == kinds


def test_icl_output_sites_are_typed():
    sites = lambda **kw: ICLAdapter().sites(  # noqa: E731
        random_model(tp.ICLConfig(d_in=3, d_model=4, n_layers=2, n_heads=2, **kw)), 1
    )
    assert sites().output == BiasOutput("blocks.1.mlp.fc_out.bias")
    assert sites(bias=False).output == MatrixOutput("blocks.1.mlp.fc_out.weight")
    assert sites(residual=False).output is None


def test_output_site_record():
    site = ScaledMatrixOutput("l.down.weight", "l.norm.weight")
    assert site.names == ("l.down.weight", "l.norm.weight") and site.name == "l.down.weight"
    assert (site[0], site[1:]) == ("matrix+scale", ("l.down.weight", "l.norm.weight"))  # the tuple it replaced
    assert Sites((), ("bias", "b")).output == BiasOutput("b")  # an adapter written against the tuple
    with pytest.raises(AttributeError):
        site.kind = "bias"  # frozen
    for bad in (("vector", "x"), ("matrix+scale", "w"), ("bias", "b", "n")):
        with pytest.raises(tp.UnsupportedModelError, match="OutputSite"), warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # the spelling of earlier versions
            OutputSite(*bad)


def test_hf_module_map():
    model = build("gemma2")
    adapter = tp.adapter_for(model)
    layers = list(model.model.layers)
    assert list(adapter.layers(model)) == layers and adapter.n_heads(model) == model.config.num_attention_heads
    assert adapter.output_projections(model) == [layer.self_attn.o_proj for layer in layers]
    assert (
        adapter.attention_outputs(model)
        == adapter.attention_norms(model)
        == [layer.post_attention_layernorm for layer in layers]
    )
    llama = build("llama")
    assert tp.adapter_for(llama).attention_norms(llama) == [None] * 3
    pats = attention_patterns(llama, ids(1, 6))
    assert len(pats) == 3 and pats[0].shape == (1, 4, 6, 6)
