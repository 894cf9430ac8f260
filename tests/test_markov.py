"""Markov-chain ICL: the sampler, the four ideal predictors (hand-computed cases, the reference
table, log space), phase labels, the mixture fit, training and resumption, sweeps' estimators,
circuit probes and ablation, phi patching, the bridge, and the CLI."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from conftest import non_snake_keys

import tokenpatch as tp
from tokenpatch.interp import circuits
from tokenpatch.interp.phases import cross_entropy, kl_to, mixture_fit, phase_label, predictors
from tokenpatch.models.markov import MarkovModel, log_probs, markov_model, model_inputs
from tokenpatch.tasks.markov import MarkovTask, encode, random_chains, sample_sequences, stationary
from tokenpatch.workbench.train.markov import MarkovTrain, load_run, train_markov
from tokenpatch.workbench.train.sweep import fit_tau, k_star, transition_step

TWO = torch.tensor([[[0.9, 0.1], [0.2, 0.8]], [[0.3, 0.7], [0.6, 0.4]]], dtype=torch.float64)  # K=2, C=2


# ----------------------------------------------------------------------------- chains and sampling


def test_stationary_is_the_left_eigenvector():
    m = random_chains(5, 6, 0.5, np.random.default_rng(0))
    pi = stationary(m)
    assert torch.allclose(torch.einsum("kc,kcd->kd", pi, m), pi, atol=1e-14, rtol=0)
    assert torch.allclose(pi.sum(-1), torch.ones(5, dtype=torch.float64), atol=1e-14)
    assert torch.allclose(stationary(TWO[:1])[0], torch.tensor([2 / 3, 1 / 3], dtype=torch.float64), atol=1e-15)


def test_sampler_follows_the_chain_and_starts_stationary():
    rng = np.random.default_rng(1)
    x = sample_sequences(TWO, torch.zeros(4000, dtype=torch.long), 50, rng)  # chain 0 only
    prev, nxt = x[:, :-1].reshape(-1), x[:, 1:].reshape(-1)
    freq = torch.stack([torch.bincount(nxt[prev == i], minlength=2) / (prev == i).sum() for i in range(2)]).double()
    assert torch.allclose(freq, TWO[0], atol=0.01)  # ~2e5 transitions: 4 standard errors ~ 0.004
    assert abs((x[:, 0] == 0).double().mean().item() - 2 / 3) < 0.03  # x_1 ~ pi = (2/3, 1/3)


def test_task_is_seeded_and_fresh_chains_differ():
    a, b = MarkovTask(chains=3, seed=4), MarkovTask(chains=3, seed=4)
    assert torch.equal(a.train_chains, b.train_chains)
    assert not torch.equal(a.train_chains, MarkovTask(chains=3, seed=5).train_chains)
    s1, s2 = a.sample(8, np.random.default_rng(0)), a.sample(8, np.random.default_rng(0))
    assert torch.equal(s1.states, s2.states)
    fresh = a.sample(8, np.random.default_rng(0), "fresh")
    assert fresh.matrices.shape == (8, 10, 10) and not any(torch.equal(fresh.matrices[0], m) for m in a.train_chains)
    with pytest.raises(tp.InputError, match="alpha must be > 0"):
        MarkovTask(alpha=0)
    with pytest.raises(tp.InputError, match="which='test'"):
        a.sample(2, np.random.default_rng(0), "test")


def test_encode_blocks():
    x = torch.tensor([[2, 0, 1]])
    e = encode(x, 3, 5)
    assert e.shape == (1, 3, 8)
    assert e[0, :, :3].argmax(-1).tolist() == [2, 0, 1] and e[0, :, 3:].argmax(-1).tolist() == [0, 1, 2]
    p = encode(x, 3, 5, previous=True)
    assert p.shape == (1, 3, 11) and p[0, 0, 3:6].sum() == 0 and p[0, 1:, 3:6].argmax(-1).tolist() == [2, 0]
    with pytest.raises(tp.InputError, match="exceed the model's 2 positions"):
        encode(x, 3, 2)
    with pytest.raises(tp.InputError, match="states must lie in 0..1"):
        encode(x, 2, 5)


# ----------------------------------------------------------------------------- predictors


def _loop_predictors(x: list[int], chains: torch.Tensor, alpha: float) -> dict[str, list[list[float]]]:
    """The formulas of docs/markov.md written as plain loops over one sequence (probabilities)."""
    k, c = chains.shape[0], chains.shape[-1]
    pi = stationary(chains)
    out = {n: [] for n in ("1-gen", "2-gen", "1-mem", "2-mem", "1-mem-stat")}
    for t in range(len(x)):
        i = x[t]
        n_j = [sum(1 for s in range(t + 1) if x[s] == j) for j in range(c)]
        n_ij = [sum(1 for s in range(t) if x[s] == i and x[s + 1] == j) for j in range(c)]
        out["1-gen"].append([(n_j[j] + alpha) / (t + 1 + c * alpha) for j in range(c)])
        out["2-gen"].append([(n_ij[j] + alpha) / (sum(n_ij) + c * alpha) for j in range(c)])
        w2 = [pi[m, x[0]].item() * math.prod(chains[m, x[s], x[s + 1]].item() for s in range(t)) for m in range(k)]
        w1 = [math.prod(pi[m, x[s]].item() for s in range(t + 1)) for m in range(k)]
        w2, w1 = [w / sum(w2) for w in w2], [w / sum(w1) for w in w1]
        out["2-mem"].append([sum(w2[m] * chains[m, i, j].item() for m in range(k)) for j in range(c)])
        out["1-mem"].append([sum(w1[m] * chains[m, i, j].item() for m in range(k)) for j in range(c)])
        out["1-mem-stat"].append([sum(w1[m] * pi[m, j].item() for m in range(k)) for j in range(c)])
    return out


def test_two_gen_and_one_gen_by_hand():
    x = torch.tensor([[0, 1, 0, 0]])
    lp = predictors(x, TWO, 1.0)
    # t = 2 (x_t = 0): n_0. = 1 (0->1), so 2-gen = ((0+1)/3, (1+1)/3); t = 3: n_00 = 1, n_01 = 1 -> (2/4, 2/4)
    assert torch.allclose(lp["2-gen"][0, 2].exp(), torch.tensor([1 / 3, 2 / 3], dtype=torch.float64), atol=1e-15)
    assert torch.allclose(lp["2-gen"][0, 3].exp(), torch.tensor([0.5, 0.5], dtype=torch.float64), atol=1e-15)
    # 1-gen at t = 1: counts (1, 1) -> (2/4, 2/4); at t = 3: counts (3, 1) -> (4/6, 2/6)
    assert torch.allclose(lp["1-gen"][0, 1].exp(), torch.tensor([0.5, 0.5], dtype=torch.float64), atol=1e-15)
    assert torch.allclose(lp["1-gen"][0, 3].exp(), torch.tensor([4 / 6, 2 / 6], dtype=torch.float64), atol=1e-15)
    # 2-mem at t = 0: w ∝ pi^k(x_0): pi^0 = (2/3, 1/3), pi^1 = (6/13, 7/13)
    w = torch.tensor([2 / 3, 6 / 13], dtype=torch.float64)
    w = w / w.sum()
    assert torch.allclose(lp["2-mem"][0, 0].exp(), w[0] * TWO[0, 0] + w[1] * TWO[1, 0], atol=1e-15)


@pytest.mark.parametrize("alpha", [1.0, 0.3])
def test_predictors_match_the_formulas_written_as_loops(alpha):
    chains = random_chains(3, 4, 0.7, np.random.default_rng(2))
    x = sample_sequences(chains, torch.tensor([0, 2]), 9, np.random.default_rng(3))
    lp = predictors(x, chains, alpha)
    stat = predictors(x, chains, alpha, rule="stationary")["1-mem"]
    for b in range(2):
        ref = _loop_predictors(x[b].tolist(), chains, alpha)
        for name in ("1-gen", "2-gen", "1-mem", "2-mem"):
            assert torch.allclose(lp[name][b].exp(), torch.tensor(ref[name], dtype=torch.float64), atol=1e-13), name
        assert torch.allclose(stat[b].exp(), torch.tensor(ref["1-mem-stat"], dtype=torch.float64), atol=1e-13)
    for v in lp.values():
        assert torch.allclose(v.exp().sum(-1), torch.ones(2, 9, dtype=torch.float64), atol=1e-13)


def test_log_space_survives_long_sequences():
    x = sample_sequences(TWO, torch.tensor([1]), 20000, np.random.default_rng(4))
    lp = predictors(x, TWO, 1.0, chain=torch.tensor([1]))
    assert all(torch.isfinite(v).all() for v in lp.values())
    assert torch.allclose(lp["2-mem"][0, -1], lp["true"][0, -1], atol=1e-12)  # the posterior is certain


def test_bigram_stationary_unigram_variant():
    x = torch.tensor([[0, 1, 1, 0, 1]])
    lp = predictors(x, TWO, 1.0, unigram="bigram-stationary")
    est = torch.tensor([[1, 3], [2, 2]], dtype=torch.float64)  # n_ij + 1 at t = 4: 0->1 twice, 1->1, 1->0
    est = est / est.sum(-1, keepdim=True)
    assert torch.allclose(lp["1-gen"][0, 4].exp(), stationary(est[None])[0], atol=1e-14)


REFERENCE = [
    (1.0, 128, 2.323, 2.181, 1.931),
    (1.0, 256, 2.305, 2.127, 1.930),
    (0.5, 256, 2.268, 1.914, 1.668),
    (0.25, 256, 2.173, 1.575, 1.309),
]  # docs/markov.md: 1-gen, 2-gen, true on fresh chains (C = 10)


@pytest.mark.parametrize("alpha,n,one,two,true", REFERENCE)
def test_reference_table_within_002_nats(alpha, n, one, two, true):
    task = MarkovTask(states=10, alpha=alpha, length=n, chains=16, seed=0)
    batch = task.sample(2000, np.random.default_rng(1), "fresh")  # Monte-Carlo error ~0.005 nats
    lp = predictors(batch.states, task.train_chains, alpha, true_chains=batch.matrices, chain=batch.chain)
    ce = {k: cross_entropy(v, batch.states).mean().item() for k, v in lp.items()}
    assert ce["uniform"] == pytest.approx(math.log(10), abs=1e-12)
    for name, ref in (("1-gen", one), ("2-gen", two), ("true", true)):
        assert abs(ce[name] - ref) < 0.02, (name, ce[name], ref)


def test_bad_predictor_inputs():
    with pytest.raises(tp.InputError, match="LongTensor"):
        predictors(torch.zeros(2, 3), TWO, 1.0)
    with pytest.raises(tp.InputError, match="rule='rows'"):
        predictors(torch.zeros(2, 3, dtype=torch.long), TWO, 1.0, rule="rows")
    with pytest.raises(tp.InputError, match="prior must be a probability vector"):
        predictors(torch.zeros(2, 3, dtype=torch.long), TWO, 1.0, prior=torch.tensor([0.5, 0.6]))


# ----------------------------------------------------------------------------- labels and mixture


def test_phase_label_argmin_and_mixed():
    kl = {"uniform": 0.5, "1-gen": 0.3, "2-gen": 0.05, "1-mem": 0.2, "2-mem": 0.3}
    assert phase_label(kl) == "G2"
    assert phase_label({**kl, "2-mem": 0.055}) == "G2/M2"
    assert phase_label({**kl, "2-mem": 0.055}, margin=0.001) == "G2"
    assert phase_label({**kl, "uniform": 0.0}) == "U"


def test_mixture_fit_recovers_the_weights():
    task = MarkovTask(chains=4, length=32)
    b = task.sample(64, np.random.default_rng(0))
    refs = {
        k: v
        for k, v in predictors(b.states, task.train_chains, task.alpha).items()
        if k in ("1-gen", "2-gen", "1-mem", "2-mem")
    }
    model = torch.log(0.3 * refs["2-gen"].exp() + 0.7 * refs["2-mem"].exp())
    w, kl = mixture_fit(model, refs, iters=5000, tol=0)
    assert w["2-gen"] == pytest.approx(0.3, abs=2e-3) and w["2-mem"] == pytest.approx(0.7, abs=2e-3)
    assert kl < 1e-5 and sum(w.values()) == pytest.approx(1.0, abs=1e-12)
    assert kl_to(refs["2-gen"], refs["2-gen"]).abs().max() < 1e-12


# ----------------------------------------------------------------------------- the model and training


def test_the_markov_model_is_exact_under_token_patches():
    task = MarkovTask(length=12, chains=2)
    model = markov_model(task, MarkovModel(d_model=16, n_heads=2)).double()
    x = model_inputs(model, task, task.sample(3, np.random.default_rng(0)).states)
    assert tp.verify(model, tp.token_patch(model, x), x).max_abs < 1e-10
    minimal = markov_model(task, MarkovModel(d_model=16, minimal=True)).double()
    assert len(minimal.blocks) == 1 and minimal.config.d_in == 2 * 10 + 12
    y = model_inputs(minimal, task, task.sample(3, np.random.default_rng(0)).states)
    assert tp.verify(minimal, tp.token_patch(minimal, y), y).max_abs < 1e-10


def test_training_records_and_refuses_another_recipe(tmp_path):
    task = MarkovTask(length=10, chains=3)
    shape = MarkovModel(d_model=8)
    cfg = MarkovTrain(steps=12, evals=4, eval_sequences=8, checkpoint_every=6)
    model, hist = train_markov(tmp_path / "a", task, shape, cfg, progress=False)
    assert [h["step"] for h in hist] == [0, 1, 2, 5, 12]  # 0 and geomspace(1, 12, 4) rounded
    assert set(hist[-1]["train"]) == {"loss", "kl", "label", "mixture", "mixture_kl"}
    again, hist2 = train_markov(tmp_path / "a", task, shape, cfg, progress=False)  # finished: read back
    assert hist2 == hist and all(torch.equal(p, q) for p, q in zip(model.parameters(), again.parameters()))
    with pytest.raises(tp.FileFormatError, match="another training recipe"):
        train_markov(tmp_path / "a", task, MarkovModel(d_model=4), cfg, progress=False)
    loaded, t, meta = load_run(tmp_path / "a")
    assert t == task and meta["step"] == 12 and set(meta["references"]) == {"train", "fresh"}
    assert torch.equal(
        log_probs(loaded, task, torch.zeros(1, 10, dtype=torch.long)),
        log_probs(model, task, torch.zeros(1, 10, dtype=torch.long)),
    )
    assert sorted(p.name for p in (tmp_path / "a").glob("step-*")) == [
        f"step-{s:07d}.safetensors" for s in (0, 1, 2, 5, 12)
    ]
    with pytest.raises(tp.InputError, match="holds no Markov run"):
        load_run(tmp_path)


def test_interrupted_training_resumes_to_the_same_weights(tmp_path, monkeypatch):
    task = MarkovTask(length=10, chains=3)
    shape = MarkovModel(d_model=8)
    cfg = MarkovTrain(steps=10, evals=5, eval_sequences=8, checkpoint_every=4)  # evaluations 0 1 2 3 6 10
    full, hist = train_markov(tmp_path / "full", task, shape, cfg, progress=False)
    assert [h["step"] for h in hist] == [0, 1, 2, 3, 6, 10]
    import tokenpatch.workbench.train.markov as mk

    calls = {"n": 0}
    real = mk.MarkovTask.sample

    def failing(self, *a, **k):
        calls["n"] += 1
        if calls["n"] == 2 + 7:  # two for the evaluation set, then one per step: dies in step 7,
            raise RuntimeError("power cut")  # after the evaluation at step 6 and the checkpoint of step 4
        return real(self, *a, **k)

    monkeypatch.setattr(mk.MarkovTask, "sample", failing)
    with pytest.raises(RuntimeError, match="power cut"):
        train_markov(tmp_path / "cut", task, shape, cfg, progress=False)
    from tokenpatch.models.icl import read_checkpoint

    assert read_checkpoint(tmp_path / "cut" / "model.safetensors")[1]["meta"]["step"] == 4  # resumes, not restarts
    monkeypatch.setattr(mk.MarkovTask, "sample", real)
    resumed, hist2 = train_markov(tmp_path / "cut", task, shape, cfg, progress=False)  # from step 4: step 6 again
    assert all(torch.equal(p, q) for p, q in zip(full.state_dict().values(), resumed.state_dict().values()))
    assert json.dumps(hist) == json.dumps(hist2)
    for step in (6, 10):  # the snapshot written twice (before the cut and after) is the same
        a = load_run_snapshot(tmp_path / "full" / f"step-{step:07d}.safetensors")
        b = load_run_snapshot(tmp_path / "cut" / f"step-{step:07d}.safetensors")
        assert all(torch.equal(p, q) for p, q in zip(a, b))
    train_markov(
        tmp_path / "cut", task, shape, MarkovTrain(**{**cfg.to_dict(), "steps": 3}), resume=False, progress=False
    )
    assert sorted(p.name for p in (tmp_path / "cut").glob("step-*")) == [
        f"step-{s:07d}.safetensors" for s in (0, 1, 2, 3)
    ]


def load_run_snapshot(path):
    from tokenpatch.models.icl import read_checkpoint

    return list(read_checkpoint(path)[0].state_dict().values())


def test_bad_training_settings():
    with pytest.raises(tp.InputError, match="MarkovTrain.warmup must be an integer >= 1"):
        MarkovTrain(warmup=0)
    with pytest.raises(tp.InputError, match="MarkovTrain.seed must be an integer >= 0"):
        MarkovTrain(seed=-1)
    with pytest.raises(tp.InputError, match="MarkovTask.seed must be an integer >= 0"):
        MarkovTask(seed=-2)
    with pytest.raises(tp.InputError, match="MarkovTask.chains must be an integer >= 1"):
        MarkovTask(chains=True)


def test_tiny_alpha_chains_still_have_a_stationary_distribution():
    m = random_chains(16, 10, 1e-6, np.random.default_rng(0))
    pi = stationary(m)
    assert torch.isfinite(pi).all() and torch.allclose(pi.sum(-1), torch.ones(16, dtype=torch.float64))
    assert torch.allclose(torch.einsum("kc,kcd->kd", pi, m), pi, atol=1e-8)


def test_chunked_predictors_equal_one_batch(monkeypatch):
    import tokenpatch.interp.phases as ph

    task = MarkovTask(length=16, chains=5)
    b = task.sample(7, np.random.default_rng(0))
    whole = predictors(b.states, task.train_chains, 0.5, chain=b.chain)
    monkeypatch.setattr(ph, "CHUNK", 2 * 16 * 100)  # two sequences per chunk
    parts = predictors(b.states, task.train_chains, 0.5, chain=b.chain)
    assert all(torch.equal(whole[k], parts[k]) for k in whole)


# ----------------------------------------------------------------------------- sweep estimators


def _hist(kls: list[tuple[int, float, float]]) -> list[dict]:
    return [{"step": s, "fresh": {"kl": {"1-gen": a, "2-gen": b}}} for s, a, b in kls]


def test_transition_step_interpolates_in_log_step():
    h = _hist([(0, 0.5, 0.4), (10, 0.1, 0.3), (100, 0.2, 0.1), (1000, 0.3, 0.05)])
    # gap (2-gen - 1-gen) goes 0.2 at step 10 -> -0.1 at step 100: crossing 2/3 of the way in log-step
    assert transition_step(h) == pytest.approx(10 ** (1 + 2 / 3))
    assert transition_step(_hist([(0, 0.5, 0.4), (10, 0.1, 0.3)])) is None  # never crosses
    assert transition_step(_hist([(0, 0.5, 0.6), (10, 0.3, 0.1), (100, 0.3, 0.1)])) is None  # below from the start
    bounce = _hist([(0, 0.5, 0.4), (10, 0.3, 0.1), (100, 0.1, 0.3), (1000, 0.3, 0.0)])  # the last crossing counts
    assert transition_step(bounce) == pytest.approx(10 ** (2 + 0.2 / 0.5))


def test_fit_tau_recovers_a_power_law_and_n_over_log_n():
    n = [16, 32, 64, 128]
    fit = fit_tau(n, [3.0 * x**0.8 for x in n])
    assert fit["power"]["a"] == pytest.approx(0.8, abs=1e-10) and fit["power"]["c"] == pytest.approx(3.0, rel=1e-10)
    assert fit["power"]["rms_log"] < 1e-10
    fit = fit_tau(n, [5.0 * x / math.log(x) for x in n])
    assert fit["n_over_log_n"]["c"] == pytest.approx(5.0, rel=1e-10) and fit["n_over_log_n"]["rms_log"] < 1e-10


def test_k_star_from_final_evaluations():
    def run(k, seed, gen, mem):
        return {
            "chains": k,
            "seed": seed,
            "history": [
                {
                    "fresh": {"kl": {"2-gen": 0.1 if gen else 0.5, "2-mem": 0.3}},
                    "train": {"kl": {"2-mem": 0.01 if mem else 0.4, "2-gen": 0.2, "1-gen": 0.5, "1-mem": 0.3}},
                }
            ],
        }

    summary = {
        "runs": [
            run(1, 0, False, True),
            run(4, 0, False, True),
            run(16, 0, True, True),
            run(64, 0, True, False),
            run(1, 1, False, True),
            run(4, 1, True, False),
            run(16, 1, True, False),
            run(64, 1, True, False),
        ]
    }
    s = k_star(summary)
    assert s["per_seed"][0]["k1"] == 16 and s["per_seed"][0]["k1_bracket"] == [4, 16]
    assert s["per_seed"][0]["k2"] == 16 and s["per_seed"][0]["k2_bracket"] == [16, 64]
    assert s["per_seed"][1]["k1"] == 4 and s["per_seed"][1]["k2"] == 1
    assert s["k1"]["geomean"] == pytest.approx(8.0) and (s["k1"]["min"], s["k1"]["max"]) == (4, 16)
    assert k_star(summary, tol=0.005)["k2"] is None and k_star(summary, tol=0.05)["per_seed"][0]["k2"] == 16
    one = run(1, 2, False, True)
    one["history"][-1]["train"]["kl"]["1-mem"] = one["history"][-1]["train"]["kl"]["2-mem"]  # K = 1: a tie
    assert k_star({"runs": [one]})["per_seed"][2]["k2"] == 1


# ----------------------------------------------------------------------------- circuits


def test_scores_on_synthetic_patterns():
    t = 6
    prev = torch.zeros(1, 1, t, t)
    prev[0, 0, 0, 0] = 1
    prev[0, 0, torch.arange(1, t), torch.arange(t - 1)] = 1
    assert circuits.previous_token_score(prev).item() == 1.0
    assert circuits.previous_token_score(torch.eye(t)[None, None]).item() == 0.0
    x = torch.tensor([[0, 1, 0, 2, 0, 1]])
    # a head at query t spreads its mass evenly over keys s with x_{s-1} = x_t (or sits on t without any)
    ind = torch.zeros(1, 1, t, t)
    for q in range(t):
        keys = [s for s in range(1, q + 1) if x[0, s - 1] == x[0, q]]
        for s in keys or [q]:
            ind[0, 0, q, s] = 1 / len(keys or [q])
    score, base = circuits.statistical_induction_score(ind, x)
    has = [any(x[0, s - 1] == x[0, q] for s in range(1, q + 1)) for q in range(1, t)]
    assert score.item() == pytest.approx(sum(has) / (t - 1))
    counts = [sum(1 for s in range(1, q + 1) if x[0, s - 1] == x[0, q]) for q in range(1, t)]
    assert base == pytest.approx(sum(c / (q + 1) for q, c in zip(range(1, t), counts)) / (t - 1), abs=1e-15)


@pytest.fixture(scope="module")
def tiny():
    task = MarkovTask(length=12, chains=3)
    model = markov_model(task, MarkovModel(d_model=16, n_heads=2)).double()
    torch.manual_seed(0)
    x = model_inputs(model, task, task.sample(5, np.random.default_rng(0)).states)
    return task, model, x


def test_zero_ablation_equals_zeroed_weights_and_restores(tiny):
    task, model, x = tiny
    before = {k: v.clone() for k, v in model.state_dict().items()}
    clean = model(x)
    with circuits.ablated(model, heads=[(1, 1)], mlps=[0]):
        ablated = model(x)
    edited = markov_model(task, MarkovModel(d_model=16, n_heads=2)).double()
    edited.load_state_dict(model.state_dict())
    with torch.no_grad():
        edited.blocks[1].mixer.out.weight[:, 8:] = 0  # head 1 of 2 (dh = 8) reads nothing
        edited.blocks[0].mlp.fc_out.weight.zero_()
        edited.blocks[0].mlp.fc_out.bias.zero_()
    assert torch.allclose(ablated, edited(x), atol=1e-13) and not torch.allclose(ablated, clean)
    assert torch.equal(model(x), clean) and all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
    with pytest.raises(ValueError, match="boom"), circuits.ablated(model, heads=[(0, 0)]):
        raise ValueError("boom")
    assert torch.equal(model(x), clean)
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())


def test_mean_ablation_uses_the_reference_mean(tiny):
    task, model, x = tiny
    seen = {}
    h = model.blocks[0].mixer.out.register_forward_pre_hook(lambda m, a: seen.__setitem__("z", a[0]))
    model(x)
    h.remove()
    mean = seen["z"][..., :8].mean((0, 1))
    with circuits.ablated(model, heads=[(0, 0)], mode="mean", reference=x):
        h = model.blocks[0].mixer.out.register_forward_pre_hook(lambda m, a: seen.__setitem__("z2", a[0]))
        model(x)
        h.remove()
    assert torch.allclose(seen["z2"][..., :8], mean.expand_as(seen["z2"][..., :8]), atol=1e-15)
    assert torch.equal(seen["z2"][..., 8:], seen["z"][..., 8:])
    with pytest.raises(tp.InputError, match=r"head \(0, 2\) is not in the model \(2 layers x 2 heads\)"):
        with circuits.ablated(model, heads=[(0, 2)]):
            pass
    with pytest.raises(tp.InputError, match="needs reference inputs"):
        with circuits.ablated(model, heads=[(0, 0)], mode="mean"):
            pass


def test_phi_patching_with_itself_changes_nothing(tiny):
    task, model, x = tiny
    f = circuits.phi(model, x)
    with circuits.replaced_mixer(model, -1, f):
        same = model(x)
    assert torch.equal(same, model(x))
    with circuits.replaced_mixer(model, -1, torch.zeros_like(f)):
        moved = model(x)
    assert torch.equal(moved[:, :-1], model(x)[:, :-1]) and not torch.allclose(moved[:, -1], model(x)[:, -1])
    out = circuits.phi_patching(model, task, pairs=16)
    assert set(out) == {"clean", "donor", "same_chain", "mean", "random"} and not non_snake_keys(out)
    cells = [c for row in out.values() for c in row.values()]
    assert len(cells) == 10 and all(set(c) == {"mean", "lo", "hi"} and c["lo"] <= c["mean"] <= c["hi"] for c in cells)


def test_chain_probe_separates_separable_features():
    labels = torch.arange(40) % 4
    feats = torch.nn.functional.one_hot(labels, 4).double() * 3 + 0.01 * torch.randn(40, 4, dtype=torch.float64)
    r = circuits.chain_probe(feats, labels)
    assert r["accuracy"] == 1.0 and r["chance"] < 0.5
    r = circuits.chain_probe(torch.randn(40, 4, dtype=torch.float64), labels)
    assert r["accuracy"] < 0.7


def test_bridge_numbers(tiny):
    from tokenpatch.interp.bridge import phase_bridge

    task, model, _ = tiny
    b = phase_bridge(model, task, sequences=4)
    assert len(b["update_norm"]) == 2 and all(v > 0 for v in b["update_norm"])
    assert all(-1 <= v <= 1 for v in b["phi_cosine"].values())
    f32 = markov_model(task, MarkovModel(d_model=16, n_heads=2))
    phase_bridge(f32, task, sequences=2)
    assert next(f32.parameters()).dtype == torch.float32  # computed on a float64 copy


# ----------------------------------------------------------------------------- CLI


def test_cli_predictors_json(capsys):
    from tokenpatch.workbench.cli.main import main

    argv = [
        "markov",
        "predictors",
        "--states",
        "10",
        "--alpha",
        "1",
        "--length",
        "128",
        "--chains",
        "4",
        "--sequences",
        "50",
        "--seed",
        "3",
        "--json",
    ]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert list(out) == ["fresh", "train"]
    assert list(out["fresh"]) == ["uniform", "1-gen", "2-gen", "1-mem", "2-mem", "true"]
    assert out["train"]["2-mem"] < out["train"]["2-gen"] < out["train"]["uniform"]
    assert out["fresh"]["2-gen"] < out["fresh"]["2-mem"]
    assert main(argv) == 0 and json.loads(capsys.readouterr().out) == out  # seeded


def test_cli_train_and_probe_on_a_one_layer_minimal_run(tmp_path, capsys):
    from tokenpatch.workbench.cli.main import main

    out = tmp_path / "run"
    argv = [
        "markov",
        "train",
        "--out",
        str(out),
        "--chains",
        "3",
        "--length",
        "12",
        "--steps",
        "6",
        "--minimal",
        "--heads",
        "2",
        "--d-model",
        "8",
        "--quiet",
    ]
    assert main(argv) == 0
    assert "phases" in capsys.readouterr().out and (out / "curves.png").stat().st_size > 10_000
    assert main(["markov", "probe", "--run", str(out), "--quiet"]) == 0
    probe = json.loads(capsys.readouterr().out)
    assert probe["layers"] == 1 and len(probe["previous_token_score"]) == 2 and "induction_score" not in probe
    assert set(probe["ablation_loss"]) == {"clean", "layer 1 head 0", "layer 1 head 1", "layer 1 MLP"}
    assert set(probe["phi_patching"]) == {"clean", "donor", "same_chain", "mean", "random"}
