"""The prompt-compression baselines (task vectors, function vectors, attention shift, thought
vector), their injection, and the comparison runner, on tiny random Hugging Face models, float64."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import non_snake_keys

import tokenpatch as tp

pytest.importorskip("transformers", reason="the Hugging Face extra (pip install 'tokenpatch[hf]') is not installed")
from conftest import build, hooks_left, ids  # noqa: E402
from conftest import float64_gemma_norms as _float64_gemma_norms  # noqa: E402

from tokenpatch.arch import adapter_for  # noqa: E402
from tokenpatch.baselines import (
    Steering,
    attention_shift,
    function_vectors,
    head_contribution,  # noqa: E402
    head_effects,
    heads_set,
    mean_heads,
    pad_left,
    recording_heads,
    site_modules,
    steer,
    task_vectors,
    thought_vector,
)
from tokenpatch.baselines.vectors import _states  # noqa: E402
from tokenpatch.stats import wilson
from tokenpatch.tasks.wordpairs import MAIN_TASKS, RESERVE_TASKS, Format, WordPairs, is_correct, load_task, task_names  # noqa: E402
from tokenpatch.workbench.compare import compare
from tokenpatch.workbench.extract import ICV_PAIRINGS, ICV_STRENGTHS
from tokenpatch.workbench.methods import Method, greedy

float64_gemma_norms = _float64_gemma_norms  # test_hf's fixture, shared

FAMILIES = ["llama", "gemma3", "gpt2", "gpt_neox", "opt"]  # opt: its MLP runs on [B * T, d]
BOS = 1


def batches(seed: int = 0, n: int = 6, prompt_len: int = 9):
    """A prompt in front of ragged queries (left-padded), and the same queries alone, both after a BOS."""
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(3, 101, (prompt_len,), generator=g).tolist()
    queries = [torch.randint(3, 101, (int(k),), generator=g).tolist() for k in torch.randint(2, 5, (n,), generator=g)]
    prompted = pad_left([[BOS] + prompt + q for q in queries], 0)
    plain = pad_left([[BOS] + q for q in queries], 0)
    return prompted, plain, torch.tensor([len(q) for q in queries])


def logits(model, batch):
    with torch.no_grad():
        return model(**batch).logits


def fingerprint(model):
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("name", FAMILIES)
def test_extraction_shapes(name):
    model = build(name)
    prompted, plain, n_q = batches()
    d, layers = model.config.hidden_size, model.config.num_hidden_layers
    for s in (
        task_vectors(model, prompted),
        attention_shift(model, prompted, plain, n_q),
        thought_vector(model, prompted, plain, n_q, skip=1),
    ):
        assert sorted(s.vectors) == list(range(layers)) and all(v.shape == (d,) for v in s.vectors.values())
    heads = mean_heads(model, prompted)
    n_heads = model.config.num_attention_heads
    assert heads.shape == (layers, n_heads, d // n_heads)
    fv = function_vectors(model, prompted, prompted, torch.full((6,), 5), n_top=3)
    assert len(fv.meta["heads"]) == 3 and torch.tensor(fv.meta["aie"]).shape == (layers, n_heads)
    assert fv.only(1).vectors[1].shape == (d,) and list(fv.only(1).vectors) == [1]


@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize("position", ["last", "all"])
def test_zero_vector_changes_no_logit_and_the_model_is_restored(name, position):
    model = build(name)
    prompted, plain, _ = batches()
    before, params = logits(model, plain), fingerprint(model)
    for site in ("residual", "attention"):
        zero = Steering(
            site, {i: torch.zeros(model.config.hidden_size, dtype=torch.float64) for i in range(3)}, "add", position
        )
        with steer(model, zero, where=plain["attention_mask"] > 0 if position == "all" else None):
            assert torch.equal(logits(model, plain), before)
        real = Steering(site, {1: torch.ones(model.config.hidden_size, dtype=torch.float64)}, "add", position)
        with pytest.raises(RuntimeError, match="inside"):
            with steer(model, real):
                assert not torch.equal(logits(model, plain), before)  # it does steer
                raise RuntimeError("inside")
        assert torch.equal(logits(model, plain), before) and hooks_left(model) == 0
    assert all(torch.equal(a, b) for a, b in zip(params, fingerprint(model)))  # no weight was ever written


# per design, layer 1's module whose output carries the site's contribution, read off the model code:
# OPT's MLP output is fc2's (run on [B * T, d]); Bloom's attention and MLP modules add the residual
# themselves, which adding a vector to their output leaves the same
STEERED = {
    "llama": {"attention": "self_attn", "mlp": "mlp"},
    "opt": {"attention": "self_attn", "mlp": "fc2"},
    "bloom": {"attention": "self_attention", "mlp": "mlp"},
}


@pytest.mark.parametrize("name", list(STEERED))
@pytest.mark.parametrize("position", ["last", "all"])
@pytest.mark.parametrize("site", ["attention", "mlp"])
def test_steering_adds_the_vector_to_the_sublayer_output(name, position, site):
    """The "attention" and "mlp" sites add the vector to what the sublayer adds to the stream, also
    where the MLP runs on the flattened tokens (OPT) or the modules add the residual (Bloom)."""
    model = build(name)
    plain = {"input_ids": ids(2, 7)}  # no padding: Bloom's eager attention gives NaN on it
    v = torch.randn(model.config.hidden_size, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    module = adapter_for(model).layers(model)[1].get_submodule(STEERED[name][site])

    def by_hand(module, args, o):
        t = o[0] if isinstance(o, tuple) else o
        t = t.view(*plain["input_ids"].shape, -1).clone()
        t[:, -1 if position == "last" else slice(None)] += v
        t = t.view((o[0] if isinstance(o, tuple) else o).shape)
        return (t, *o[1:]) if isinstance(o, tuple) else t

    with steer(model, Steering(site, {1: v}, "add", position)):
        got, states = logits(model, plain), _states(model, plain, site, last=False)
    handle = module.register_forward_hook(by_hand)
    try:
        want = logits(model, plain)
    finally:
        handle.remove()
    # Bloom: (a + v) + residual against (a + residual) + v, the same sum rounded in another order
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    assert float((got - logits(model, plain)).abs().max()) > 1e-3
    assert states[1].shape == (*plain["input_ids"].shape, model.config.hidden_size)
    if (site, position) != ("mlp", "all"):
        return  # once per design: the contributions add up to the stream (layer 1's output = its input + both)
    stream, attention, mlp = (_states(model, plain, s, last=False) for s in ("residual", "attention", "mlp"))
    torch.testing.assert_close(stream[1], stream[0] + attention[1] + mlp[1], rtol=0, atol=1e-12)


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_replacing_a_state_with_itself_and_a_head_with_its_own_output_change_nothing(name):
    model = build(name)
    _, plain, _ = batches()
    before = logits(model, plain)
    one = {k: v[:1] for k, v in plain.items()}
    own = _states(model, one, "residual", last=True)  # L x [1, d]: the row's own states
    alone = logits(model, one)
    with steer(model, Steering("residual", {1: own[1][0]}, "replace", "last")):
        assert torch.equal(logits(model, one), alone)
    with recording_heads(model) as rec:
        logits(model, plain)
    with heads_set(model, {(2, 1): rec[2][:, 1]}):  # each row's own head output, written back
        assert torch.equal(logits(model, plain), before)
    with pytest.raises(ValueError, match="boom"), heads_set(model, {(2, 1): torch.zeros(16, dtype=torch.float64)}):
        raise ValueError("boom")
    assert torch.equal(logits(model, plain), before) and hooks_left(model) == 0


@pytest.mark.parametrize("name", ["llama", "gpt2", "gpt_neox"])
def test_head_contributions_sum_to_the_attention_output(name):
    """``o_proj(z) = sum_h W_O[:, h] z_h + b``: the function vector's per-head terms are exact."""
    model = build(name)
    from tokenpatch.baselines.steering import o_proj_modules

    o = o_proj_modules(model)[1]
    z = torch.randn(model.config.hidden_size, dtype=torch.float64)
    heads = model.config.num_attention_heads
    dh = z.shape[0] // heads
    total = sum(head_contribution(model, 1, h, z[h * dh : (h + 1) * dh]) for h in range(heads))
    with torch.no_grad():
        want = o(z[None])[0] - o(torch.zeros_like(z)[None])[0]
    assert float((total - want).abs().max()) <= 1e-12


@pytest.mark.parametrize("name", ["llama", "gpt2", "gpt_neox", "gemma3", "opt"])
def test_head_effects_with_the_cache_equal_full_forwards(name, float64_gemma_norms):
    """The AIE runs only the last token on a KV cache, the layers below the head's replayed; a full
    forward per head gives the same."""
    model = build(name)
    prompted, _, _ = batches(seed=3)
    answers = torch.tensor([5, 7, 9, 11, 13, 17])
    means = mean_heads(model, prompted)
    effects = head_effects(model, prompted, answers, means)
    p = lambda: logits(model, prompted)[:, -1].softmax(-1).gather(1, answers[:, None])[:, 0]  # noqa: E731
    base = p()
    for layer, h in [(0, 0), (1, 2), (2, 3), (len(means) - 1, 1)]:
        with heads_set(model, {(layer, h): means[layer, h]}):
            assert float(effects[layer, h]) == pytest.approx(float((p() - base).mean()), abs=1e-12)
    assert float(effects.abs().max()) > 0
    assert type(adapter_for(model).layers(model)[0]).__name__.endswith(("Layer", "Block"))  # every layer put back


@pytest.mark.parametrize("name", ["llama", "gemma3"])
def test_thought_vector_matches_the_prompted_mean_at_every_layer(name):
    """Its defining property: with ``v_1 .. v_l`` in place, the mean over the query positions of the
    residual stream after layer ``l`` equals the prompted one."""
    model = build(name)
    prompted, plain, n_q = batches(seed=5)
    tv = thought_vector(model, prompted, plain, n_q, skip=1)
    want = _states(model, prompted, "residual", last=False)
    where = (plain["position_ids"] >= 1) & (plain["attention_mask"] > 0)
    with steer(model, tv, where=where):
        got = _states(model, plain, "residual", last=False)
    width = int(n_q.max())
    mask = torch.arange(width)[None] >= (width - n_q)[:, None]
    for w, g in zip(want, got):
        assert float(((w[:, -width:] - g[:, -width:])[mask].mean(0)).abs().max()) <= 1e-10
    assert float((want[-1][:, -1] - _states(model, plain, "residual", last=True)[-1]).abs().max()) > 1e-3


def test_attention_shift_moves_the_first_layer_mean_exactly():
    """Layer 0's input does not depend on the shift: its attention output's query mean becomes the prompted one."""
    model = build("llama")
    prompted, plain, n_q = batches(seed=6)
    shift = attention_shift(model, prompted, plain, n_q)
    with steer(model, shift):
        got = _states(model, plain, "attention", last=False)[0]
    want = _states(model, prompted, "attention", last=False)[0]
    width = int(n_q.max())
    mask = torch.arange(width)[None] >= (width - n_q)[:, None]
    assert float((want[:, -width:][mask].mean(0) - got[:, -width:][mask].mean(0)).abs().max()) <= 1e-12


def test_steering_rejects_bad_input():
    model = build("llama")
    with pytest.raises(tp.InputError, match="site"):
        Steering("ffn", {0: torch.zeros(64)})
    with pytest.raises(tp.InputError, match="'all' for 'rotate'"):
        Steering("mlp", {0: torch.zeros(64)}, "rotate", "last")
    with pytest.raises(tp.InputError, match="layers"):
        with steer(model, Steering("residual", {7: torch.zeros(64)})):
            pass
    with pytest.raises(tp.InputError, match="head"):
        with heads_set(model, {(0, 9): torch.zeros(16)}):
            pass
    with pytest.raises(tp.UnsupportedModelError):
        site_modules(tp.load_model(), "residual")


# --------------------------------------------------------------------------- tasks and the runner
def test_word_pair_tasks_are_large_and_clean():
    assert set(MAIN_TASKS) | set(RESERVE_TASKS) <= set(task_names())
    for name in task_names():
        task = load_task(name)
        xs = [x for x, _ in task.pairs]
        assert len(xs) >= 170 and len(set(xs)) == len(xs), name
        split = task.split(seed=0)
        seen = [x for part in split.values() for x, _ in part]
        assert len(seen) == len(set(seen)) == len(xs) and len(split["test"]) >= 80


def test_whole_word_match():
    assert is_correct(" Paris\n\nQ: Spain", ("Paris",))
    assert is_correct(" paris is the capital", ("Paris",))
    assert is_correct(" more beautiful.", ("more beautiful",))
    assert not is_correct(" Parisian", ("Paris",))
    assert not is_correct("\nParis", ("Paris",))
    assert is_correct(" Kiev", ("Kyiv", "Kiev"))
    with pytest.raises(tp.InputError, match="{x}"):
        Format(query="Q:")
    with pytest.raises(tp.InputError, match="unknown"):
        load_task("capitals")


def test_wilson_interval():
    iv = wilson(22, 25)
    assert (iv["mean"], round(iv["lo"], 3), round(iv["hi"], 3)) == (0.88, 0.700, 0.958)  # computed by hand
    assert wilson(0, 10)["lo"] == 0.0 and wilson(10, 10)["hi"] == 1.0


class CharTokenizer:
    """A character-level tokenizer with a BOS, enough for ``compare`` on a tiny model."""

    bos_token_id, eos_token_id, pad_token_id = 1, 2, 0

    def __init__(self):
        self.chars = sorted(set("abcdefghijklmnopqrstuvwxyzQA: \n->"))

    def __call__(self, text: str, add_special_tokens: bool = True):
        return {"input_ids": ([1] if add_special_tokens else []) + [3 + self.chars.index(c) for c in text]}

    def decode(self, row):
        return self.batch_decode([row])[0]

    def batch_decode(self, rows):
        return [
            "".join(self.chars[int(t) - 3] if 3 <= int(t) < 3 + len(self.chars) else "?" for t in row) for row in rows
        ]


def test_compare_runs_every_method_on_a_tiny_model(tmp_path):
    model = build("llama")
    words = [chr(97 + i % 26) + chr(97 + i // 26) + chr(97 + 3 * i % 26) for i in range(40)]  # distinct
    task = WordPairs("rev", "word -> reversed", tuple((w, (w[::-1],)) for w in words))
    res = compare(
        model,
        CharTokenizer(),
        task,
        shots=2,
        test=12,
        calibration=6,
        dev=8,
        rank=2,
        ridge=(0.01, 0.1),
        n_heads=2,
        sampled=(3,),
        bake_times=(1, 3),
        hybrid=1,
    )
    rows = res["methods"]
    assert set(rows) == {
        "zero_shot",
        "icl",
        "thought_patch",
        "thought_patch_rank",
        "thought_patch_gcv",
        "thought_patch_sampled_3",
        "prompt_baking_1x",
        "prompt_baking_3x",
        "thought_patch_baked",
        "thought_vector",
        "attention_shift",
        "task_vector",
        "function_vector",
        "in_context_vector",
    }
    assert rows["thought_patch_rank"]["name"] == "thought patch (rank 2)"
    assert res["lead"] == [1] and res["closed_form_choice"] in {
        "thought_patch",
        "thought_patch_rank",
        "thought_patch_gcv",
        "thought_patch_sampled_3",
    }
    assert all(f["input_ridge"] > 0 for f in rows["thought_patch_gcv"]["fits"])  # chosen per layer by GCV
    assert rows["thought_patch_sampled_3"]["fits"][0]["n"] == 3 * 32  # every position of 3 continuations
    assert rows["prompt_baking_3x"]["steps"] >= rows["prompt_baking_1x"]["steps"]  # snapshots of one run
    icv = rows["in_context_vector"]
    assert icv["strength"] in ICV_STRENGTHS and icv["pairing"] in ICV_PAIRINGS
    assert len(icv["dev_scores"]) == len(ICV_STRENGTHS) * len(ICV_PAIRINGS)  # every pairing at every strength
    assert rows["icl"]["kl"] == 0 and all(r["kl"] >= 0 and r["n"] == 12 for r in rows.values())
    assert all(r["accuracy_interval"]["lo"] <= r["accuracy"] <= r["accuracy_interval"]["hi"] for r in rows.values())
    assert rows["thought_patch"]["ridge"] in (0.01, 0.1) and [
        r for r, _ in rows["thought_patch"]["dev_kl_by_ridge"]
    ] == [0.01, 0.1]
    assert 0 <= rows["task_vector"]["layer"] < 3 and len(rows["function_vector"]["heads"]) == 2
    assert rows["icl"]["bytes"] == 2 * 3 * 2 * 16 * res["prompt_tokens"] * 8  # the prompt's float64 KV cache
    assert rows["thought_patch"]["kl"] < rows["zero_shot"]["kl"]  # the fit keeps some of the prompt's effect
    # every method acts; prompt baking only if its wall-time budget (a few tiny fits' worth) allowed a step
    acting = [k for k in rows if k != "zero_shot" and not (k.startswith("prompt_baking") and rows[k]["steps"] == 0)]
    assert all(rows[k]["kl"] != rows["zero_shot"]["kl"] for k in acting)
    assert all(rows[k]["kl"] == rows["zero_shot"]["kl"] for k in set(rows) - set(acting))  # no step: zero-shot
    assert {"thought_patch", "thought_patch_rank", "prompt_baking_1x"} <= set(res["patches"])
    json.dumps({k: v for k, v in res.items() if k != "patches"}, allow_nan=False)  # valid JSON, no inf
    assert non_snake_keys({k: v for k, v in res.items() if k != "patches"}) == []
    from tokenpatch.workbench.report.compress import goal
    from tokenpatch.workbench.report.compress_page import figure, markdown

    tasks = {"rev": {k: v for k, v in res.items() if k != "patches"}}
    run = {"model": "tiny", "shots": 2, "seed": 0, "seconds": 1.0, "threads": 1, "tasks": tasks, "goal": goal(tasks)}
    text = markdown(run)
    assert "| rev" in text and "thought patch (rank 2)" in text and "| input side |" in text
    fixed = {"chosen": {"lead": [1], "lead_text": "<s>", "format": "qa"}, "candidates": []}
    assert "Prompt given (not chosen in this run): first token '<s>'" in markdown({**run, "prompting": fixed})
    tried = {**fixed, "candidates": [{"lead_text": "<s>", "format": "qa", "hits": 3, "n": 8}]}
    assert "the candidates: '<s>' + qa: 3/8." in markdown({**run, "prompting": tried})
    assert figure(run, tmp_path / "c.png").stat().st_size > 10_000
    with pytest.raises(tp.InputError, match="shots >= 2"):
        compare(model, CharTokenizer(), task, shots=1)
    with pytest.raises(tp.InputError, match="at least 1"):
        compare(model, CharTokenizer(), task, test=0)
    with pytest.raises(tp.InputError, match="timing_rows must be at least 1"):
        compare(model, CharTokenizer(), task, timing_rows=0)
    with pytest.raises(tp.InputError, match="effect_prompts must be at least 1"):
        compare(model, CharTokenizer(), task, shots=2, test=12, calibration=6, dev=8, effect_prompts=0)


def test_nan_from_eager_attention_on_padding_is_refused_not_ranked():
    """Gemma 2's eager attention turns a left-padded row into NaN: the head search and the comparison
    say so in one line instead of ranking NaN effects or scoring NaN logits."""
    from tokenpatch.testing import tiny_hf_model

    model = tiny_hf_model("gemma2")
    assert model.config._attn_implementation == "eager"
    prompted, _, _ = batches(seed=3)  # rows of different lengths: left padding
    with pytest.raises(tp.InputError, match="head_effects: .*non-finite.*use 'sdpa'"):
        head_effects(model, prompted, torch.tensor([5, 7, 9, 11, 13, 17]), torch.zeros(3, 4, 16, dtype=torch.float64))
    words = [chr(97 + i % 26) * (1 + i % 3) + chr(97 + i // 26) for i in range(40)]  # 2 to 4 letters: padding
    task = WordPairs("rev", "word -> reversed", tuple((w, (w[::-1],)) for w in words))
    with pytest.raises(tp.InputError, match="compare: .*non-finite.*use 'sdpa'"):
        compare(model, CharTokenizer(), task, shots=2, test=4, calibration=4, dev=6, methods=("zero_shot", "icl"))


@pytest.mark.filterwarnings("ignore::tokenpatch.ThoughtWarning")
def test_the_through_the_norm_row_is_fitted_only_where_a_norm_follows_the_mlp(float64_gemma_norms):
    """``norm_steps``: Gemma 3 gets the row (its step count chosen on dev; its fit records the steps),
    Llama, with nothing after its MLP, does not."""
    words = [chr(97 + i % 26) + chr(97 + i // 26) + chr(97 + 3 * i % 26) for i in range(40)]
    task = WordPairs("rev", "word -> reversed", tuple((w, (w[::-1],)) for w in words))
    kw = dict(shots=2, test=4, calibration=6, dev=4, ridge=0.01, norm_steps=(1, 2))
    keep = ("thought_patch", "thought_patch_norm")
    rows = compare(build("gemma3"), CharTokenizer(), task, methods=keep, **kw)["methods"]
    assert set(rows) == {"zero_shot", "icl", *keep}
    norm = rows["thought_patch_norm"]
    assert [k for k, _ in norm["dev_kl_by_norm_steps"]] == [1, 2] and norm["norm_steps"] in (1, 2)
    assert norm["dev_kl"] == min(v for _, v in norm["dev_kl_by_norm_steps"])  # the steps chosen on dev
    assert all(f["norm_steps"] >= 1 for f in norm["fits"])
    assert all(f["norm_steps"] is None for f in rows["thought_patch"]["fits"])
    assert rows["thought_patch_norm"]["kl"] != rows["thought_patch"]["kl"]
    assert "thought_patch_norm" not in compare(build("llama"), CharTokenizer(), task, methods=keep, **kw)["methods"]


def test_the_first_token_and_the_format_are_chosen_on_dev_by_icl():
    """Every (lead, format) candidate scored by ICL's dev answers, the best chosen; the choice reaches
    every method of ``compare`` (``lead``, ``fmt``)."""
    from tokenpatch.workbench.report.compress import FORMATS, choose_prompting

    model = build("llama")
    words = [chr(97 + i % 26) + chr(97 + i // 26) + chr(97 + 3 * i % 26) for i in range(40)]
    task = WordPairs("rev", "word -> reversed", tuple((w, (w[::-1],)) for w in words))
    got = choose_prompting(model, CharTokenizer(), [task], shots=2, calibration=6, dev=8)
    assert [(c["lead"], c["format"]) for c in got["candidates"]] == [
        ([1], "qa"),
        ([1], "arrow"),
        ([2], "qa"),
        ([2], "arrow"),
    ]
    best = max(got["candidates"], key=lambda c: (c["hits"], c["logp"]))
    assert got["chosen"] == {k: best[k] for k in ("lead", "lead_text", "format")}
    assert all(c["n"] == 8 for c in got["candidates"]) and len({c["logp"] for c in got["candidates"]}) == 4
    fixed = choose_prompting(model, CharTokenizer(), [task], {"lead": [2], "format": "arrow"})
    assert fixed["chosen"]["lead"] == [2] and fixed["candidates"] == []
    res = compare(
        model, CharTokenizer(), task, shots=2, test=4, calibration=6, dev=8, lead=[2], fmt=FORMATS["arrow"], methods=()
    )
    assert res["lead"] == [2] and res["format"]["query"] == "{x} ->"
    with pytest.raises(tp.InputError, match="prompting format"):
        choose_prompting(model, CharTokenizer(), [task], {"lead": [2], "format": "xml"})


def test_the_in_context_vector_pairs_a_query_with_its_answer_or_a_word_with_its_answer():
    """The two pairings the in-context vector is chosen among: the query read alone against it with its
    answer, and (the authors' pairing) the input word alone against the answer alone, both after the
    leading token and written as an answer is."""
    from tokenpatch.workbench.methods import Encoded

    tok = CharTokenizer()
    task = WordPairs("rev", "word -> reversed", (("ab", ("ba",)), ("cd", ("dc",)), ("ef", ("fe",)), ("gh", ("hg",))))
    enc = Encoded(tok, task.split(0, demos=2, calibration=1, dev=0, test=None), 2, Format(), [1])
    text = lambda batch: [tok.decode(r[m > 0]) for r, m in zip(batch["input_ids"], batch["attention_mask"])]  # noqa: E731
    xs = [x for x, _ in enc.demo_pairs]
    ys = [y[0] for _, y in enc.demo_pairs]
    assert text(enc.word_batch(False)) == ["?" + " " + x for x in xs]  # "?": the lead, id 1
    assert text(enc.word_batch(True)) == ["?" + " " + y for y in ys]
    assert text(enc.demo_batch(False)) == [f"?Q: {x}\nA:" for x in xs]
    assert text(enc.demo_batch(True)) == [f"?Q: {x}\nA: {y}" for x, y in zip(xs, ys)]
    assert all(enc.word_batch(False)["input_ids"][:, -1] != tok.pad_token_id)  # padded on the left


def test_the_lead_candidates_include_an_end_of_text_token_of_any_role():
    """SmolLM2's ``<|endoftext|>`` is its unknown token, not its BOS or EOS, and it is the token its
    pretraining documents were joined by: it must be a candidate first token."""
    from tokenpatch.workbench.report.compress import document_markers

    class SmolLike(CharTokenizer):
        bos_token_id, eos_token_id = 1, 2
        all_special_tokens = ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<pad>"]
        all_special_ids = [1, 2, 0, 7]

    assert document_markers(SmolLike()) == [1, 2, 0]
    assert document_markers(CharTokenizer()) == [1, 2]


def test_greedy_on_the_cache_equals_argmax_without_it():
    """The KV-cache decoding of every kind of method (none, a patch, every-position and
    last-position steering) equals re-running the whole sequence for each new token."""
    model = build("llama")
    _, plain, n_q = batches(seed=8)
    prompted, _, _ = batches(seed=8)
    every = Method(
        "every",
        prefill=lambda b: steer(
            model, attention_shift(model, prompted, plain, n_q), (b["position_ids"] >= 1) & (b["attention_mask"] > 0)
        ),
        decode=lambda: steer(model, attention_shift(model, prompted, plain, n_q)),
    )
    last = Method("last", prefill=lambda b: steer(model, task_vectors(model, prompted).only(1)))
    with pytest.warns(tp.ThoughtWarning):
        patch = tp.thought_patch(model, prompted["input_ids"][0, -6:], plain["input_ids"][:, -2:]).patch
    patched = Method("patch", prefill=lambda b: tp.apply(model, patch), decode=lambda: tp.apply(model, patch))
    for method in (Method("plain"), every, last, patched):
        tokens, _ = greedy(model, plain, method, 4)
        seq = dict(plain)
        for step in range(4):
            with torch.no_grad():
                if method is every:  # every position but the BOS and the padding, generated tokens included
                    ctx = steer(
                        model,
                        attention_shift(model, prompted, plain, n_q),
                        (seq["position_ids"] >= 1) & (seq["attention_mask"] > 0),
                    )
                elif method is last:  # the last position of the prompt only: re-applied at its index
                    ctx = _at(model, task_vectors(model, prompted).only(1), plain["input_ids"].shape[1] - 1)
                else:
                    ctx = method.prefill(seq)
                with ctx:
                    nxt = model(**seq).logits[:, -1].argmax(-1)
            assert torch.equal(nxt, tokens[:, step]), (method.name, step)
            seq = {
                "input_ids": torch.cat([seq["input_ids"], nxt[:, None]], 1),
                "attention_mask": torch.cat([seq["attention_mask"], torch.ones_like(nxt)[:, None]], 1),
                "position_ids": torch.cat([seq["position_ids"], seq["position_ids"][:, -1:] + 1], 1),
            }


def _at(model, s: Steering, index: int):
    """``s`` (a last-position replacement) written at a fixed index of a longer sequence."""
    from tokenpatch.arch.hf import registered_hooks

    def hook(module, args, out):
        t = out.clone()
        t[:, index] = s.vectors[next(iter(s.vectors))]
        return t

    return registered_hooks([(site_modules(model, s.site)[next(iter(s.vectors))].register_forward_hook, hook)])


def test_steering_leaves_the_bos_and_padding_alone():
    model = build("llama")
    prompted, plain, n_q = batches(seed=9)
    shift = attention_shift(model, prompted, plain, n_q)
    where = (plain["position_ids"] >= 1) & (plain["attention_mask"] > 0)
    before = _states(model, plain, "residual", last=False)
    with steer(model, shift, where):
        after = _states(model, plain, "residual", last=False)
    untouched = ~where  # the BOS and the left padding of every row: causal attention, nothing reaches them
    assert all(torch.equal(a[untouched], b[untouched]) for a, b in zip(after, before))
    assert all(not torch.equal(a[where], b[where]) for a, b in zip(after, before))


def test_head_terms_through_gemmas_post_attention_norm_add_up(float64_gemma_norms):
    """With a norm after ``o_proj`` (Gemma), a head's term is ``g / rms(a) W_O[:, h] z_h``: on one
    prompt the terms add up to the norm's output exactly."""
    from tokenpatch.baselines.steering import o_proj_modules
    from tokenpatch.baselines.vectors import _norm_gain

    model = build("gemma3")
    prompted, _, _ = batches(seed=10, n=1)
    with recording_heads(model) as rec:
        logits(model, prompted)
    layer, z = 1, rec[1]  # [1, H, dh]
    gain = _norm_gain(model, layer, z)
    total = sum(head_contribution(model, layer, h, z[0, h]) * gain for h in range(model.config.num_attention_heads))
    with torch.no_grad():
        want = site_modules(model, "attention")[layer](o_proj_modules(model)[layer](z.flatten(1)))[0]
    assert float((total - want).abs().max()) <= 1e-12


def test_in_context_vector_is_the_principal_direction_plus_the_mean_and_rotates_keeping_norms():
    """Liu et al.'s ICV written out: the flattened per-layer differences, their top principal direction
    (sign with the mean) plus their mean, per layer scaled to the strength; the injection turns each
    MLP output towards it and keeps its norm."""
    from tokenpatch.baselines import in_context_vectors

    model = build("llama")
    sources, targets = (
        pad_left([[BOS, 5, 6], [BOS, 7], [BOS, 9, 4, 3]], 0),
        pad_left([[BOS, 5, 6, 8], [BOS, 7, 2], [BOS, 9, 4, 3, 11]], 0),
    )
    icv = in_context_vectors(model, sources, targets, strength=0.3)
    src, tgt = _states(model, sources, "residual", True), _states(model, targets, "residual", True)
    d = torch.cat([t - s for s, t in zip(src, tgt)], -1)  # [3, L d]
    mean = d.mean(0)
    pc = torch.linalg.svd(d - mean).Vh[0]
    pc = pc if float(pc @ mean) >= 0 else -pc
    want = (pc + mean).view(len(src), -1)
    for i, v in icv.vectors.items():
        assert abs(float(v.norm()) - 0.3) <= 1e-12
        assert float((v / v.norm() - want[i] / want[i].norm()).abs().max()) <= 1e-10
    mlp = site_modules(model, "mlp")[1]
    seen = {}
    hook = mlp.register_forward_hook(lambda m, a, out: seen.setdefault("out", out.detach()))
    with torch.no_grad():
        model(torch.tensor([[BOS, 5, 6, 8]]))
        hook.remove()
        plain = seen.pop("out")
        with steer(model, icv.only(1)):  # layer 1 alone: its MLP reads what it read unsteered
            hook = mlp.register_forward_hook(lambda m, a, out: seen.setdefault("out", out.detach()))
            model(torch.tensor([[BOS, 5, 6, 8]]))
            hook.remove()
    v = icv.vectors[1]
    boost = 1 + torch.nn.functional.cosine_similarity(plain, -v.expand_as(plain), dim=-1).clamp_min(0)[..., None]
    unit = torch.nn.functional.normalize
    rotated = unit(unit(plain, dim=-1) + boost * v, dim=-1) * plain.norm(dim=-1, keepdim=True)
    assert float((seen["out"] - rotated).abs().max()) <= 1e-12
    assert float((seen["out"].norm(dim=-1) - plain.norm(dim=-1)).abs().max()) <= 1e-12  # the norm is kept
    assert float((seen["out"] - plain).abs().max()) > 1e-3  # and the direction turned
