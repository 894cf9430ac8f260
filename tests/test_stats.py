"""``tokenpatch.stats``: the one place intervals are computed, and the one shape they are reported in."""

from __future__ import annotations

import ast
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from scipy import stats as scipy_stats

from tokenpatch import stats
from tokenpatch.stats import half_width, interval, mean_interval, wilson

SHAPE = {"mean", "lo", "hi"}


def test_t_interval_is_scipys():
    x = [0.31, 0.12, 0.55, 0.4, 0.27]
    lo, hi = scipy_stats.t.interval(0.95, len(x) - 1, loc=np.mean(x), scale=scipy_stats.sem(x))
    iv = mean_interval(x)
    assert set(iv) == SHAPE and iv["mean"] == pytest.approx(np.mean(x), abs=1e-15)
    assert (iv["lo"], iv["hi"]) == (pytest.approx(lo, abs=1e-12), pytest.approx(hi, abs=1e-12))
    assert mean_interval(torch.tensor(x)) == pytest.approx(iv, abs=1e-7)  # a tensor: the same interval (float64)
    assert half_width(iv) == pytest.approx((hi - lo) / 2, abs=1e-12)
    assert mean_interval(x, z=1.96)["hi"] == pytest.approx(np.mean(x) + 1.96 * scipy_stats.sem(x), abs=1e-12)


def test_vectors_give_lists_under_the_same_keys():
    x = np.random.default_rng(0).random((6, 3))  # 6 items, 3 quantities (a lag curve: one per lag)
    iv = mean_interval(x)
    assert set(iv) == SHAPE and all(isinstance(iv[k], list) and len(iv[k]) == 3 for k in SHAPE)
    for j in range(3):
        assert {k: iv[k][j] for k in SHAPE} == pytest.approx(mean_interval(x[:, j]), abs=1e-15)
    t = mean_interval(torch.from_numpy(x))
    assert set(t) == SHAPE and all(t[k] == pytest.approx(iv[k], abs=1e-15) for k in SHAPE)


def test_one_item_is_a_point_and_none_is_an_error():
    assert mean_interval([0.25]) == {"mean": 0.25, "lo": 0.25, "hi": 0.25}
    assert mean_interval(torch.tensor([[0.5, 1.0]])) == {"mean": [0.5, 1.0], "lo": [0.5, 1.0], "hi": [0.5, 1.0]}
    with pytest.raises(ValueError):
        mean_interval([])


def test_wilson_is_its_formula():
    z = 1.96
    for k, n in ((0, 10), (3, 10), (22, 25), (10, 10), (1, 1)):
        p = k / n
        centre = (p + z * z / (2 * n)) / (1 + z * z / n)
        half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
        iv = wilson(k, n)
        assert set(iv) == SHAPE and iv["mean"] == p
        assert iv == {
            "mean": p,
            "lo": pytest.approx(max(0.0, centre - half)),
            "hi": pytest.approx(min(1.0, centre + half)),
        }
        assert 0 <= iv["lo"] <= p <= iv["hi"] <= 1
    with pytest.raises(ValueError):
        wilson(0, 0)


def test_interval_from_a_half_width():
    assert interval(2.0, 0.5) == {"mean": 2.0, "lo": 1.5, "hi": 2.5}
    assert interval(np.array([1.0, 2.0]), np.array([0.5, 0.25])) == {
        "mean": [1.0, 2.0],
        "lo": [0.5, 1.75],
        "hi": [1.5, 2.25],
    }


def _old_keys(obj, path="") -> list[str]:
    """Paths of every ``ci95``-like key (the old interval shape) in a JSON-able object."""
    found = []
    if isinstance(obj, dict):
        for k, v in obj.items():
            if "ci95" in str(k):
                found.append(f"{path}.{k}")
            found += _old_keys(v, f"{path}.{k}")
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            found += _old_keys(v, f"{path}[{i}]")
    return found


def _intervals(obj) -> list[dict]:
    """Every dict holding a ``"lo"`` key."""
    if isinstance(obj, dict):
        return ([obj] if "lo" in obj else []) + [iv for v in obj.values() for iv in _intervals(v)]
    if isinstance(obj, (list, tuple)):
        return [iv for v in obj for iv in _intervals(v)]
    return []


def test_the_walker_finds_an_old_key():
    assert _old_keys({"a": [{"mean": 1, "ci95": 0.1}], "accuracy_ci95": 0.2}) == [".a[0].ci95", ".accuracy_ci95"]


def test_report_sections_use_the_one_shape(tmp_path):
    """The section cheap enough here (the small LM's induction section, a few training steps) puts
    intervals in its data only as ``{"mean", "lo", "hi"}`` (the lag curve: beside its ``"lags"``)."""
    from tokenpatch.tasks.repeats import LMData
    from tokenpatch.workbench.report import induction
    from tokenpatch.workbench.train.lm import LMTrain

    ind = induction.induction_section(
        tmp_path,
        data=LMData(vocab=12, length=24),
        cfg=LMTrain(steps=2, batch_size=2),
        shape={"d_model": 8, "n_layers": 2, "n_heads": 2},
        options={"n_words": 5, "prompts": 4, "draws": 2},
        progress=False,
    )
    assert _old_keys(ind.data) == []
    ivs = _intervals(ind.data)
    assert len(ivs) > 4 and all(set(iv) - {"lags"} == SHAPE for iv in ivs)
    assert set(ind.data["lag"]) == {"lags", *SHAPE} and set(ind.data["dose_lag_plus_one"]["top"][0]) == SHAPE


PACKAGE = Path(__file__).resolve().parent.parent / "tokenpatch"


def test_no_source_file_names_the_old_key():
    named = set()
    for path in PACKAGE.rglob("*.py"):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        if any(isinstance(n, ast.Constant) and isinstance(n.value, str) and "ci95" in n.value for n in ast.walk(tree)):
            named.add(path.relative_to(PACKAGE).as_posix())
    assert named == set(), named


def test_auroc_is_the_mann_whitney_statistic_with_a_bootstrap_interval():
    from scipy.stats import mannwhitneyu

    rng = np.random.default_rng(1)
    scores = np.round(rng.normal(size=300), 1)  # rounded: ties count one half
    labels = rng.random(300) < 0.3
    scores[labels] += 0.5
    got = stats.auroc(scores, labels)
    pos, neg = scores[labels], scores[~labels]
    assert got["mean"] == pytest.approx(mannwhitneyu(pos, neg).statistic / (len(pos) * len(neg)), abs=1e-12)
    assert got["lo"] < got["mean"] < got["hi"] and got["hi"] - got["lo"] < 0.2
    assert set(got) == SHAPE
    assert stats.auroc(-scores, labels)["mean"] == pytest.approx(1 - got["mean"], abs=1e-12)
    assert stats.auroc(labels.astype(float), labels)["mean"] == 1.0
    with pytest.raises(ValueError, match="both classes"):
        stats.auroc(scores, np.ones(300, dtype=bool))
    with pytest.raises(ValueError, match="one length"):
        stats.auroc(scores[:5], labels)
