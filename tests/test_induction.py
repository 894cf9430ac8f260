"""Induction-head scores (both definitions, against hand-made patterns and TransformerLens'
detector re-implemented here as loops), head selection, and head ablation that restores the model."""

from __future__ import annotations

import pytest
import torch

import tokenpatch as tp
from tokenpatch.interp.ablation import ablate_heads, select_heads
from tokenpatch.interp.induction import detection_pattern, detector_score, diagonal_score, rank_heads, repeated_tokens

L = 5


def perfect_induction(tokens: torch.Tensor) -> torch.Tensor:
    """Each query attends to the token after the previous occurrence of itself, or to BOS without one."""
    s, t = tokens.shape
    a = torch.zeros(s, 1, t, t, dtype=torch.float64)
    for b in range(s):
        for q in range(t):
            prior = [j for j in range(1, q) if tokens[b, j - 1] == tokens[b, q] and j - 1 < q]
            a[b, 0, q, prior[-1] if prior else 0] = 1.0
    return a


def previous_token(t: int, s: int = 1) -> torch.Tensor:
    a = torch.zeros(s, 1, t, t, dtype=torch.float64)
    a[:, 0, 0, 0] = 1
    a[:, 0, torch.arange(1, t), torch.arange(t - 1)] = 1
    return a


def test_repeated_tokens():
    tok = repeated_tokens(100, L, 4, seed=3, bos=0)
    assert tok.shape == (4, 1 + 2 * L) and (tok[:, 0] == 0).all()
    assert torch.equal(tok[:, 1 : L + 1], tok[:, L + 1 :])
    assert all(len(set(row[1 : L + 1].tolist())) == L for row in tok)  # distinct when the pool allows
    assert torch.equal(tok, repeated_tokens(100, L, 4, seed=3, bos=0))


def test_perfect_induction_scores_one_and_previous_token_zero():
    tok = repeated_tokens(50, L, 3, seed=1, bos=999)
    a = perfect_induction(tok)
    assert diagonal_score(a, L).item() == 1.0
    assert detector_score(a, tok, exclude_bos=True).item() == 1.0
    # TransformerLens' default keeps BOS in the denominator: only the L second-copy rows of 2L + 1 count
    assert detector_score(a, tok).item() == pytest.approx(L / (2 * L + 1), abs=1e-15)
    p = previous_token(2 * L + 1, 3)
    assert diagonal_score(p, L).item() == 0.0
    assert detector_score(p, tok, exclude_bos=True).item() == 0.0
    assert detector_score(p, tok, "previous_token").item() == pytest.approx(2 * L / (2 * L + 1), abs=1e-15)


def test_detector_matches_transformerlens_definition_on_a_hand_made_pattern():
    tokens = torch.tensor([7, 1, 2, 1, 2, 3])
    # TransformerLens: duplicate D[i, j] = [tok_i == tok_j, j < i]; induction = D shifted one column right
    dup = torch.zeros(6, 6)
    dup[3, 1] = dup[4, 2] = 1
    ind = torch.zeros(6, 6)
    ind[3, 2] = ind[4, 3] = 1
    assert torch.equal(detection_pattern(tokens, "duplicate_token"), dup)
    assert torch.equal(detection_pattern(tokens, "induction"), ind)
    g = torch.Generator().manual_seed(0)
    a = torch.rand(2, 6, 6, generator=g, dtype=torch.float64).tril()
    a = a / a.sum(-1, keepdim=True)  # two heads, causal rows summing to 1
    for h in range(2):
        expect = (a[h] * ind.double()).sum() / a[h].sum()
        assert detector_score(a[h][None, None], tokens[None]).item() == pytest.approx(expect.item(), abs=1e-15)
        no_bos = a[h].clone()
        no_bos[:, 0] = 0
        expect = (no_bos * ind.double()).sum() / no_bos.sum()
        assert detector_score(a[h][None, None], tokens[None], exclude_bos=True).item() == pytest.approx(
            expect.item(), abs=1e-15
        )
        no_cur = a[h].clone()
        no_cur.fill_diagonal_(0)
        expect = (no_cur * dup.double()).sum() / no_cur.sum()
        got = detector_score(a[h][None, None], tokens[None], "duplicate_token", exclude_current_token=True)
        assert got.item() == pytest.approx(expect.item(), abs=1e-15)
    before = a.clone()
    detector_score(a[None], tokens[None], exclude_bos=True, exclude_current_token=True)
    assert torch.equal(a, before)  # unlike TransformerLens, the patterns are left as they were


def test_rank_and_select_heads():
    scores = {"diagonal": torch.tensor([[0.1, 0.9], [0.5, 0.2]]), "detector": torch.zeros(2, 2)}
    ranked = rank_heads(scores)
    assert [(r["layer"], r["head"]) for r in ranked] == [(0, 1), (1, 0), (1, 1), (0, 0)]
    assert select_heads(ranked, 2) == [(0, 1), (1, 0)]
    assert select_heads(ranked, 1, layers=range(1, 2)) == [(1, 0)]
    rand = select_heads(ranked, 2, how="random", exclude_top=2, seed=0)
    assert sorted(rand) == [(0, 0), (1, 1)]
    with pytest.raises(tp.InputError, match="asked for 3 heads, only 2 are eligible"):
        select_heads(ranked, 3, how="random", exclude_top=2)


@pytest.fixture
def model():
    torch.manual_seed(0)
    return tp.ICLTransformer(tp.ICLConfig(d_in=6, d_out=3, d_model=8, n_layers=2, n_heads=2)).double().eval()


def test_head_ablation_modes_and_exact_restore(model):
    x = torch.randn(3, 7, 6, dtype=torch.float64)
    clean = model(x)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    with ablate_heads(model, [(0, 1)]):
        zero = model(x)
    edited = tp.ICLTransformer(model.config).double().eval()
    edited.load_state_dict(model.state_dict())
    with torch.no_grad():
        edited.blocks[0].mixer.out.weight[:, 4:] = 0
    assert torch.allclose(zero, edited(x), atol=1e-14) and not torch.allclose(zero, clean)
    with ablate_heads(model, [(0, 1)], "resample", reference=x[:1]):  # one reference row: x[0] itself
        same = model(x[:1])
    assert torch.allclose(same, clean[:1], atol=1e-14)
    with ablate_heads(model, [(1, 0), (1, 1)], "mean", reference=x):
        mean = model(x)
    assert not torch.allclose(mean, clean)
    with pytest.raises(RuntimeError, match="boom"), ablate_heads(model, [(0, 0)], "mean", reference=x):
        raise RuntimeError("boom")
    assert torch.equal(model(x), clean) and all(torch.equal(v, model.state_dict()[k]) for k, v in state.items())
    assert not any(m._forward_pre_hooks or m._forward_hooks for m in model.modules())
    with pytest.raises(tp.InputError, match="needs reference inputs"):
        with ablate_heads(model, [(0, 0)], "resample"):
            pass
    with pytest.raises(tp.InputError, match="mode='shuffle'"):
        with ablate_heads(model, [(0, 0)], "shuffle"):
            pass
    with pytest.raises(tp.InputError, match="resample: reference sequences have 3 positions, the run 7"):
        with ablate_heads(model, [(0, 0)], "resample", reference=x[:, :3]):
            model(x)


@pytest.mark.parametrize("name", ["llama", "gemma3", "gpt2"])
def test_hugging_face_patterns_scores_and_ablation(name):
    pytest.importorskip("transformers", reason="the Hugging Face extra is not installed")
    from test_hf import VOCAB, build

    from tokenpatch.interp.induction import attention_patterns, head_scores, kv_group

    model = build(name)
    before = model.config._attn_implementation
    ids = repeated_tokens(range(1, VOCAB), 6, 2, seed=0, bos=0)
    pats = attention_patterns(model, ids)
    assert model.config._attn_implementation == before  # eager only inside
    assert len(pats) == 3 and pats[0].shape == (2, 4, 13, 13)
    assert torch.allclose(pats[1].sum(-1), torch.ones(2, 4, 13, dtype=pats[1].dtype), atol=1e-12)
    assert (pats[1].triu(1) == 0).all()
    rows = head_scores(model, length=6, sequences=2, bos=0, pool=range(1, VOCAB))
    assert len(rows) == 12 and [r["diagonal"] for r in rows] == sorted((r["diagonal"] for r in rows), reverse=True)
    groups = {"llama": [0, 0, 1, 1], "gemma3": [0, 0, 0, 0], "gpt2": [0, 1, 2, 3]}[name]
    assert [kv_group(model, h) for h in range(4)] == groups
    clean = model(ids).logits
    with ablate_heads(model, [(1, 2)]):
        zero = model(ids).logits
    o_proj = model.transformer.h[1].attn.c_proj if name == "gpt2" else model.model.layers[1].self_attn.o_proj
    saved = o_proj.weight.detach().clone()
    with torch.no_grad():  # the same head removed from the weights (GPT-2's Conv1D stores [in, out])
        if name == "gpt2":
            o_proj.weight[32:48] = 0
        else:
            o_proj.weight[:, 32:48] = 0
        edited = model(ids).logits
        o_proj.weight.copy_(saved)
    assert torch.allclose(zero, edited, atol=1e-12) and not torch.allclose(zero, clean)
    assert torch.equal(model(ids).logits, clean)


def test_lag_crp_by_hand():
    from tokenpatch.tasks.recall import lag_crp

    r = lag_crp([[0, 1, 2, 3], [3, 2, 1, 0], [0, 2, 1, 3]], 4)
    # e.g. lag +1: available 3 + 0 + 2 (after 0, after 2 in [0, 2, 1, 3]); taken 3 times
    assert r["available"] == [1, 2, 4, 0, 5, 4, 2] and r["actual"] == [0, 0, 4, 0, 3, 2, 0]
    assert r["crp"] == [0.0, 0.0, 1.0, None, 0.6, 0.5, 0.0]
    r = lag_crp([[0, 1, None, 2], [2, 2, 1]], 3)  # an intrusion or a repeat breaks the chain
    assert r["actual"] == [0, 0, 0, 1, 0] and r["available"] == [0, 0, 0, 1, 1]


def test_lag_prompts_and_probabilities():
    from tokenpatch.tasks.recall import lag_probabilities, lag_prompts

    p = lag_prompts(range(100, 200), 7, 5, seed=2)
    assert p.shape == (5, 8) and (p[:, -1] == p[:, 3]).all()
    assert all(sorted(row[:7].tolist()) == sorted(p[0, :7].tolist()) for row in p)  # one set, permuted
    probs = torch.zeros(5, 300)
    probs[torch.arange(5), p[:, 4]] = 0.9  # all mass on the successor of the repeated token
    out = lag_probabilities(probs, p)
    assert out["lags"] == [-3, -2, -1, 0, 1, 2, 3]
    assert (
        out["mean"] == pytest.approx([0, 0, 0, 0, 0.9, 0, 0])
        and max(h - lo for lo, h in zip(out["lo"], out["hi"])) < 1e-12
    )


def test_recall_prompt_and_scoring():
    from tokenpatch.tasks.recall import nouns, recall_lists, recall_prompt, score_recall

    assert len(nouns()) == 6782 and "aardvark" in nouns()
    lists = recall_lists(["a", "b", "c", "d", "e"], 3, 2, seed=0)
    assert all(len(set(x)) == 3 for x in lists)
    text = recall_prompt([["cat", "dog"]], ["sun", "tree"])
    assert text == "List: cat dog\nRecall: cat dog\n\nList: sun tree\nRecall:"
    s = score_recall(["sun", "moon"], ["sun", "tree"])
    assert s == {"per_position": [1, 0], "exact": 0, "positions": [0, None]}


def test_cli_scores_on_a_small_lm(tmp_path, capsys):
    import json

    from tokenpatch.tasks.repeats import LMData
    from tokenpatch.workbench.cli.main import main
    from tokenpatch.workbench.train.lm import LMTrain, train_lm

    path = tmp_path / "lm.safetensors"
    train_lm(
        path,
        LMData(vocab=20, length=16),
        LMTrain(steps=2, batch_size=2),
        d_model=8,
        n_layers=2,
        n_heads=2,
        progress=False,
    )
    assert (
        main(["induction", "scores", "--model", str(path), "--length", "5", "--sequences", "3", "--json", "--quiet"])
        == 0
    )
    rows = json.loads(capsys.readouterr().out)
    assert len(rows) == 4 and list(rows[0]) == [
        "layer",
        "head",
        "diagonal",
        "detector",
        "previous_token",
        "duplicate_token",
        "kv_group",
    ]
    assert main(["induction", "scores", "--model", str(path), "--length", "5", "--quiet"]) == 0
    assert "layer | head" in capsys.readouterr().out


def test_dose_response_ablates_then_restores(model):
    from tokenpatch.interp.ablation import head_sites
    from tokenpatch.interp.temporal import dose_response

    ranked = rank_heads({"diagonal": torch.tensor([[0.9, 0.1], [0.5, 0.2]])})
    modules, _ = head_sites(model)
    x = torch.randn(2, 5, 6, dtype=torch.float64)
    clean = model(x)

    def measure():  # how many layers carry an ablation hook, and the output's distance from clean
        with torch.no_grad():
            return [sum(len(m._forward_pre_hooks) for m in modules), float((model(x) - clean).abs().max())]

    d = dose_response(model, ranked, measure, ns=(0, 1, 2), exclude_top=1, draws=2)
    assert d["n"] == [0, 1, 2] and d["top"][0] == [0, 0.0] and d["random"][0] == [[0, 0.0]]
    assert d["top"][1][0] == 1 and d["top"][1][1] > 0 and d["top"][2][0] == 2  # heads (0,0) then (1,0): two layers
    assert len(d["random"][1]) == 2 and all(r[1] > 0 for r in d["random"][1])
    assert not any(m._forward_pre_hooks for m in modules) and torch.equal(model(x), clean)


def test_lag_curve_and_serial_recall_on_a_tiny_hf_model():
    pytest.importorskip("transformers", reason="the Hugging Face extra is not installed")
    from test_hf import VOCAB, build

    from tokenpatch.interp.temporal import lag_curve, serial_recall
    from tokenpatch.tasks.recall import lag_prompts

    model = build("llama")
    prompts = lag_prompts(range(1, VOCAB), 9, 4, seed=0)
    lc = lag_curve(model, prompts, bos=0, batch_size=3)
    probs = torch.softmax(
        model(torch.cat([torch.zeros(4, 1, dtype=torch.long), prompts], 1)).logits[:, -1].double(), -1
    )
    assert lc["lags"] == list(range(-4, 5))
    assert lc["mean"] == pytest.approx(probs.gather(1, prompts[:, :9]).mean(0).tolist(), abs=1e-12)

    class Words:  # one token per word: ids 1..VOCAB-1 are "w1".."w100"
        pad_token_id = 0

        def __call__(self, text, return_tensors=None, add_special_tokens=True):
            ids = [int(w[1:]) if w.startswith("w") else 1 for w in text.replace("\n", " ").split()]
            return {"input_ids": torch.tensor([ids])}

        def decode(self, ids, skip_special_tokens=True):
            return " ".join(f"w{int(i)}" for i in ids)

    r = serial_recall(model, Words(), [f"w{i}" for i in range(2, 60)], length=5, shots=1, lists=3)
    assert len(r["per_position"]) == 5 and 0 <= r["accuracy"] <= 1 and len(r["crp"]["lags"]) == 9


def test_cli_trains_a_small_lm_and_reports_on_it(tmp_path, capsys):
    import json

    from tokenpatch.workbench.cli.main import main

    path = tmp_path / "lm.safetensors"
    args = [
        "induction",
        "train",
        "--out",
        str(path),
        "--vocab",
        "12",
        "--length",
        "24",
        "--steps",
        "3",
        "--d-model",
        "8",
        "--layers",
        "2",
        "--heads",
        "2",
        "--quiet",
    ]
    assert main(args) == 0 and "2-layer Pre-LN softmax-attention transformer: " in capsys.readouterr().out
    assert (
        main(
            [
                "induction",
                "report",
                "--model",
                str(path),
                "--out",
                str(tmp_path / "r"),
                "--words",
                "7",
                "--prompts",
                "4",
                "--draws",
                "3",
                "--exclude-top",
                "1",
                "--quiet",
            ]
        )
        == 0
    )
    result = json.loads((tmp_path / "r" / "induction-lm.json").read_text())
    assert result["heads"] == 4 and result["lag"]["lags"] == list(range(-3, 4)) and "per_prompt" not in result["lag"]
    dose = result["dose_lag_plus_one"]
    assert dose["n"] == [0, 1, 2] and all(set(c) == {"mean", "lo", "hi"} for c in dose["top"])
    assert dose["exact"] == [True, True, True] and len(dose["random_heads"][2]) == 1  # the one pair outside the top 2
    top2 = {(r["layer"], r["head"]) for r in result["top_heads"][:2]}
    assert not top2 & {tuple(h) for h in dose["random_heads"][2][0]}  # the control never shares a top head
    assert len(dose["random"][1]) == 3 and dose["top"][0] == dose["random"][0][0]  # nothing ablated: the same
    p = result["patches"]
    assert len(p["share"]) == 2 and len(p["share"][0]) == 2 and p["closure_max"] < 1e-5
    assert len(p["patch_norm"]["random"]) == 1 and p["top"] == [
        [r["layer"], r["head"]] for r in result["top_heads"][:2]
    ]
    md = (tmp_path / "r" / "induction-lm.md").read_text()
    assert "| heads ablated | lag +1, top | lag +1, random |" in md and "top heads' share" in md
    assert (tmp_path / "r" / "induction-lm.png").stat().st_size > 10_000
    one = tmp_path / "one.safetensors"  # one head per layer: 2 heads, a pool of 1 outside the top 1
    assert (
        main(
            [
                "induction",
                "train",
                "--out",
                str(one),
                "--vocab",
                "12",
                "--length",
                "24",
                "--steps",
                "2",
                "--d-model",
                "8",
                "--layers",
                "2",
                "--heads",
                "1",
                "--quiet",
            ]
        )
        == 0
    )
    assert (
        main(
            [
                "induction",
                "report",
                "--model",
                str(one),
                "--out",
                str(tmp_path / "r1"),
                "--words",
                "3",
                "--prompts",
                "4",
                "--quiet",
            ]
        )
        == 0
    )
    result = json.loads((tmp_path / "r1" / "induction-one.json").read_text())
    assert result["dose_lag_plus_one"]["n"] == [0, 1] and result["patches"]["n"] == 1
    assert "| lag | -1 | 0 | +1 |" in (tmp_path / "r1" / "induction-one.md").read_text()  # 3 items: 3 lags


def test_random_control_sets_and_pooled_intervals():
    from tokenpatch.interp.ablation import outside_top, random_sets
    from tokenpatch.interp.temporal import pooled
    from tokenpatch.stats import interval, mean_interval

    ranked = rank_heads({"diagonal": torch.tensor([[0.1], [0.9], [0.3], [0.2]])})  # 4 layers x 1 head
    assert outside_top(ranked, 1) == [(2, 0), (3, 0), (0, 0)]
    assert random_sets(ranked, 1, exclude_top=1, draws=3) == [[(2, 0)], [(3, 0)], [(0, 0)]]  # every subset once
    assert random_sets(ranked, 2, exclude_top=1, draws=3) == [[(3, 0), (0, 0)]]  # outside the top 2, not the top 1
    drawn = random_sets(ranked, 1, exclude_top=1, draws=2, seed=5)  # more subsets than draws: seeded draws
    assert len(drawn) == 2 and drawn == random_sets(ranked, 1, exclude_top=1, draws=2, seed=5)
    assert random_sets(ranked, 0, exclude_top=1, draws=3) == [[]]
    with pytest.raises(tp.InputError, match="only 1 lie outside the top 3"):
        random_sets(ranked, 3, exclude_top=1)
    big = rank_heads({"diagonal": torch.rand(6, 4, generator=torch.Generator().manual_seed(0))})
    sets = random_sets(big, 1, exclude_top=0, draws=12)  # 24 choices: drawn, and all distinct
    assert len(sets) == 12 and len({tuple(h) for h in sets}) == 12
    assert mean_interval([1.0, 3.0]) == {
        "mean": 2.0,
        "lo": pytest.approx(2 - 12.7062047),
        "hi": pytest.approx(2 + 12.7062047),
    }  # Student's t, 1 df: 12.71 sd/sqrt(2)
    assert mean_interval([1.0, 2.0, 3.0])["hi"] == pytest.approx(2 + 4.30265273 / 3**0.5)  # 3 head sets: 4.30, not 1.96
    assert pooled([interval(0.5, 0.1)]) == interval(0.5, 0.1)
    assert pooled([interval(1.0, 0.1), interval(3.0, 0.1)]) == mean_interval([1.0, 3.0])
    assert pooled([interval(1.0, 0.3), interval(3.0, 0.4)], exact=True) == {
        "mean": 2.0,
        "lo": pytest.approx(1.65),
        "hi": pytest.approx(2.35),
    }


def test_head_lists_and_counts_are_checked():
    ranked = rank_heads({"diagonal": torch.tensor([[0.1, 0.5], [0.9, 0.3]])})
    model = tp.ICLTransformer(tp.ICLConfig(d_in=6, d_out=3, d_model=8, n_layers=2, n_heads=2)).double().eval()
    x = torch.randn(2, 5, 6, dtype=torch.float64)
    with ablate_heads(model, ranked[:1]):  # rank_heads rows are accepted as they are
        by_rows = model(x)
    with ablate_heads(model, [(1, 0)]):
        assert torch.equal(model(x), by_rows)
    for bad in [(1, 0), [(1,)], [("1", 0)], [(1.0, 0)], "10"]:
        with pytest.raises(tp.InputError, match=r"\(layer, head\) pairs"):
            with ablate_heads(model, bad):
                pass
    with pytest.raises(tp.InputError, match="must be an integer >= 0, got -1"):
        select_heads(ranked, -1)


def test_resample_draws_one_reference_row_per_sequence_for_every_layer():
    from tokenpatch.interp.ablation import head_sites

    model = tp.ICLTransformer(tp.ICLConfig(d_in=6, d_out=3, d_model=8, n_layers=3, n_heads=2)).double().eval()
    ref, x = torch.randn(16, 7, 6, dtype=torch.float64), torch.randn(4, 7, 6, dtype=torch.float64)
    modules, _ = head_sites(model)
    clean_ref: dict[int, torch.Tensor] = {}
    hs = [modules[l].register_forward_pre_hook(lambda m, a, l=l: clean_ref.__setitem__(l, a[0])) for l in (0, 2)]
    model(ref)
    for h in hs:
        h.remove()
    for seed in range(3):
        seen: dict[int, torch.Tensor] = {}
        with ablate_heads(model, [(0, 1), (2, 0)], "resample", reference=ref, seed=seed):
            hs = [modules[l].register_forward_pre_hook(lambda m, a, l=l: seen.__setitem__(l, a[0])) for l in (0, 2)]
            model(x)  # registered after the ablation's hooks: they see the resampled input
            for h in hs:
                h.remove()
        donors = []
        for layer, head in ((0, 1), (2, 0)):
            sl = slice(4 * head, 4 * head + 4)
            match = (seen[layer][:, None, :, sl] == clean_ref[layer][None, :, :, sl]).all(-1).all(-1)  # [B, R]
            assert match.sum(1).tolist() == [1, 1, 1, 1]  # each sequence reads exactly one reference sequence
            donors.append(match.float().argmax(1))
        assert torch.equal(donors[0], donors[1])  # the same one in every layer


def test_resample_refuses_cached_decoding_and_head_patches():
    pytest.importorskip("transformers", reason="the Hugging Face extra is not installed")
    from test_hf import build

    from tokenpatch.interp.head_patches import head_patches

    model = build("llama")
    ids = torch.randint(1, 50, (2, 6))
    with ablate_heads(model, [(0, 0)], "resample", reference=torch.randint(1, 50, (4, 12))):
        with pytest.raises(tp.InputError, match="cached decoding"):
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=3, do_sample=False, pad_token_id=0)
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=3, do_sample=False, pad_token_id=0, use_cache=False
        )
        assert out.shape == (2, 9)
        with pytest.raises(tp.InputError, match="resample ablation"):
            head_patches(model, ids, -1)
    assert not any(m._forward_pre_hooks for m in model.modules())


def test_detector_scores_a_head_resting_on_bos_zero():
    tokens = repeated_tokens(10, L, 1, seed=0, bos=0)
    assert 0 not in tokens[0, 1:].tolist()  # BOS is never drawn as a token
    t = tokens.shape[1]
    on_bos = torch.zeros(1, 1, t, t, dtype=torch.float64)
    on_bos[..., 0] = 1
    score = detector_score(on_bos, tokens, exclude_bos=True)
    assert torch.equal(score, torch.zeros(1, dtype=torch.float64))
