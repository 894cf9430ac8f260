"""The compared methods of the prompt-compression comparison (``docs/prompt-compression.md`` §2), one
``Compared`` entry each in ``REGISTRY``, in the order they are extracted, scored and shown: the key of
its row in the results, the name shown, how it is extracted (a function of ``extract.py``), the
settings of ``extract`` it reads (those it chooses on the dev split say so, nothing is chosen on
test), whether it is closed form, how its rows answer (``methods.py``) and its part in the goal's
checks and the figure. ``extract`` runs the entries, ``compare`` scores their rows and picks the
closed-form choice, the report (``report/compress.py``, ``compress_page.py``) and the figure read
their parts here: a new compression baseline is one entry (and its extraction function).

A parametric entry gives one row per value of a setting: its rows are keyed ``key_<row>``
(``thought_patch_sampled_16``, ``prompt_baking_10x``), and ``extract(methods=...)`` names them all by
``key``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tokenpatch.errors import InputError
from tokenpatch.workbench import extract as ex
from tokenpatch.workbench.methods import Method, patched, prompted, steered, unprompted

__all__ = ["Compared", "REGISTRY", "entry_of", "closed_form", "names", "wanted", "extract"]


@dataclass(frozen=True)
class Compared:
    """One compared method.

    ``key``: its row's key in the results (snake_case; with ``row``, the prefix of its rows' keys);
    ``name``: the name shown, a template of the row's fields (``"thought patch (rank {rank})"``);
    ``extract``: ``extract.py``'s function ``(Extraction, Compared) -> {row key: Method}``, rows built
    with ``row``; ``answers``: how its rows run the queries (``methods.py``'s ``unprompted``,
    ``prompted``, ``steered``, ``patched``); ``settings``: the options of ``extract`` it reads;
    ``chosen_on_dev``: what it chooses on the dev split (the keys its rows report);
    ``closed_form``: a thought patch without gradient steps (the goal's candidates, ``compare``'s
    ``closed_form_choice``); ``row``: the template of a parametric entry's row suffix (``"{k:g}x"``).

    Parts in the report and figure: ``required`` (every run has the row: the floor and the reference),
    ``reference`` (the KL is to it; not drawn on the KL axis), ``ours`` (a thought patch or its variant:
    left out of the rivals it must beat in KL), ``baseline`` (the goal's accuracy check),
    ``equal_time`` (the gradient rival compared at equal wall time), ``published`` (its position in
    Hendel et al.'s zero-shot / task vector / ICL triple; ``None``: not published there).
    ``min_shots`` and ``why_shots``: the demonstrations the method needs, and why."""

    key: str
    name: str
    extract: Callable[..., dict[str, Method]]
    answers: Callable[..., Method]
    settings: tuple[str, ...] = ()
    chosen_on_dev: tuple[str, ...] = ()
    closed_form: bool = False
    row: str | None = None
    required: bool = False
    reference: bool = False
    ours: bool = False
    baseline: bool = False
    equal_time: bool = False
    published: int | None = None
    min_shots: int = 1
    why_shots: str = ""

    def key_of(self, **fields: Any) -> str:
        """The key of the row with ``fields`` (a parametric entry's ``key_<row>``)."""
        return self.key if self.row is None else f"{self.key}_{self.row.format(**fields)}"

    def owns(self, key: str) -> bool:
        """Whether the row ``key`` is one of this entry's."""
        return key == self.key if self.row is None else key.startswith(self.key + "_")

    def method(self, model, what=None, seconds: float = 0.0, info=None, skip: int = 0, **fields: Any) -> Method:
        """The row with ``fields``, answering as ``answers`` says, under its name."""
        return self.answers(model, self.name.format(**fields), what, seconds, info, skip)


REGISTRY: tuple[Compared, ...] = (
    Compared("zero_shot", "zero-shot", ex.extract_unchanged, unprompted, required=True, published=0),
    Compared("icl", "ICL", ex.extract_unchanged, prompted, required=True, reference=True, published=2),
    Compared(
        "thought_patch",
        "thought patch",
        ex.extract_thought_patch,
        patched,
        settings=("ridge", "layers"),
        chosen_on_dev=("ridge",),
        closed_form=True,
        ours=True,
    ),
    Compared(
        "thought_patch_rank",
        "thought patch (rank {rank})",
        ex.extract_thought_patch_rank,
        patched,
        settings=("rank", "ridge", "layers"),
        chosen_on_dev=("ridge",),
        closed_form=True,
        ours=True,
    ),
    Compared(
        "thought_patch_gcv",
        "thought patch (GCV ridge)",
        ex.extract_thought_patch_gcv,
        patched,
        settings=("layers",),
        closed_form=True,
        ours=True,
    ),
    Compared(
        "thought_patch_norm",
        "thought patch (Gauss-Newton through the norm)",
        ex.extract_thought_patch_norm,
        patched,
        settings=("norm_steps", "ridge", "layers"),
        chosen_on_dev=("norm_steps", "ridge"),
        closed_form=True,
        ours=True,
    ),
    Compared(
        "thought_patch_sampled",
        "thought patch (self-written: {n} continuations, their demonstrations)",
        ex.extract_thought_patch_sampled,
        patched,
        settings=("sampled", "ridge", "layers", "seed"),
        chosen_on_dev=("ridge",),
        closed_form=True,
        row="{n}",
        ours=True,
    ),
    Compared(
        "prompt_baking",
        "prompt baking (LoRA rank {rank}, {k:g}x time)",
        ex.extract_prompt_baking,
        patched,
        settings=("bake_times", "rank", "seed"),
        row="{k:g}x",
        equal_time=True,
    ),
    Compared(
        "thought_patch_baked",
        "thought patch + baking ({hybrid:g}x time)",
        ex.extract_thought_patch_baked,
        patched,
        settings=("hybrid", "rank", "seed"),
        ours=True,
    ),
    Compared("thought_vector", "thought vector", ex.extract_thought_vector, steered),
    Compared("attention_shift", "attention shift", ex.extract_attention_shift, steered, baseline=True),
    Compared(
        "task_vector",
        "task vector",
        ex.extract_task_vector,
        steered,
        chosen_on_dev=("layer",),
        baseline=True,
        published=1,
    ),
    Compared(
        "function_vector",
        "function vector",
        ex.extract_function_vector,
        steered,
        settings=("n_heads", "effect_prompts", "seed"),
        chosen_on_dev=("layer",),
        baseline=True,
        min_shots=2,
        why_shots="the function vector's corrupted prompts shuffle the answers of the demonstrations",
    ),
    Compared(
        "in_context_vector",
        "in-context vector",
        ex.extract_in_context_vector,
        steered,
        chosen_on_dev=("pairing", "strength"),
    ),
)


def entry_of(key: str, registry: tuple[Compared, ...] = REGISTRY) -> Compared | None:
    """The entry the row ``key`` belongs to (None: no entry's)."""
    return next((e for e in registry if e.owns(key)), None)


def closed_form(key: str, registry: tuple[Compared, ...] = REGISTRY) -> bool:
    """Whether the row ``key`` is a thought patch without gradient steps (the goal's candidates)."""
    entry = entry_of(key, registry)
    return entry is not None and entry.closed_form


def names(registry: tuple[Compared, ...] = REGISTRY) -> dict[str, str]:
    """Entry key -> the name shown (a template of the row's fields for those that have some)."""
    return {e.key: e.name for e in registry}


def wanted(methods: tuple[str, ...] | None, registry: tuple[Compared, ...] = REGISTRY) -> list[Compared]:
    """The entries ``methods`` names (None: all) and those every run has, in the registry's order."""
    return [e for e in registry if e.required or methods is None or e.key in methods]


def extract(
    model,
    enc,
    *,
    rank: int = 4,
    ridge: Any = 0.0,
    layers: Any = None,
    n_heads: int = 10,
    effect_prompts: int | None = None,
    seed: int = 0,
    sampled: tuple[int, ...] = (),
    bake_times: tuple[float, ...] = (),
    hybrid: float | None = None,
    norm_steps: tuple[int, ...] = (),
    methods: tuple[str, ...] | None = None,
    progress: bool | None = None,
    registry: tuple[Compared, ...] = REGISTRY,
) -> dict[str, Method]:
    """Every method of ``registry`` (``methods``: only those keys, a parametric entry's key naming
    its rows; zero-shot and ICL always), extracted from the prompt and the calibration split and
    placed on the dev split, in the registry's order. ``sampled``: numbers of self-written
    continuations; ``bake_times``: prompt-baking budgets as multiples of the thought patch's fit time;
    ``hybrid``: the hybrid's budget (the same unit); ``norm_steps``: the Gauss-Newton step counts the
    row that refines the fit through a post-MLP norm chooses from on dev (at the ridge chosen on dev;
    only on a model with such a norm). ``effect_prompts``: the function vector's head effects on that
    many of the calibration prompts (None: all)."""
    if effect_prompts is not None and effect_prompts < 1:
        raise InputError(f"effect_prompts must be at least 1 prompt (or None: all), got {effect_prompts}")
    settings = {
        "rank": rank,
        "ridge": ridge,
        "layers": layers,
        "n_heads": n_heads,
        "effect_prompts": effect_prompts,
        "seed": seed,
        "sampled": sampled,
        "bake_times": bake_times,
        "hybrid": hybrid,
        "norm_steps": norm_steps,
        "progress": progress,
    }
    x = ex.Extraction(model, enc, settings)
    for entry in wanted(methods, registry):
        x.rows.update(entry.extract(x, entry))
    return x.rows
