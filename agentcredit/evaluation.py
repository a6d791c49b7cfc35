"""The held-out evaluation of a recipe (its ``agentcredit.eval`` block), shared by ``agentcredit train``, ``sft`` and
``ross``: play it (:func:`evaluate`), compare a before and an after seed by seed (:func:`paired_before_after`), and
report it (:func:`format_eval_table`, :func:`as_dict` for a JSON summary, :func:`write_eval_episodes`).

The episodes are played by :func:`agentcredit.trl.episodes.evaluate` (success with its Wilson interval); the
statistics are :mod:`agentcredit.stats`'.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from .recipe import Recipe, rollout_class
from .stats import PairedDifference, paired_difference

__all__ = ["evaluate", "check_trained_evaluation", "recipe_executor", "as_dict", "paired_before_after",
           "write_eval_episodes", "format_eval_table"]


def evaluate(model, tokenizer, recipe: Recipe, executor: Any = None, start: bool = False):
    """The recipe's held-out evaluation of ``model`` (an :class:`agentcredit.trl.episodes.EvalResult`): its eval
    seeds, temperature or greedy decoding and sampling seed, in the turn format and context the policy is trained in
    (CCM's memory prompt for ``rollout: memory``; the transcript otherwise). Runs without gradients in eval mode;
    the model's mode is restored.

    With the ``advisd`` term the policy is an advisor: ``model`` advises ``executor``, which acts
    (:func:`agentcredit.trl.advisd.evaluate_advisor`, the training turn format). ``executor`` None: the term's
    ``executor`` path; without one, ``model`` itself when it is the run's ``start`` (the trainer's executor is a
    frozen copy of exactly those weights), else a ``RecipeError`` (a trained advisor's executor is the model its run
    started from, which this function cannot know; ``agentcredit train`` passes it)."""
    import torch

    from .trl.episodes import evaluate as play_evaluation

    ac, ev = recipe.agentcredit, recipe.agentcredit.eval
    if "advisd" in ac.terms:
        return _evaluate_advisor(model, tokenizer, recipe, executor, start)
    context = getattr(rollout_class(ac.rollout), "context", None) if ac.bridge == "rollout_func" else None
    kwargs = dict(max_turns=ac.max_turns, temperature=ev.temperature, greedy=ev.greedy, prompt=ac.prompt,
                  max_new_tokens=ac.max_new_tokens, batch_size=ev.batch_size, system=ac.system,
                  history_length=ac.history_length, sampling_seed=ev.sampling_seed)
    if context is not None:
        kwargs["context"] = context
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            return play_evaluation(model, tokenizer, ac.env, dict(ac.env_options), ev.seed_list, **kwargs)
    finally:
        model.train(was_training)


def check_trained_evaluation(recipe: Recipe) -> None:
    """A ``RecipeError`` when the recipe's evaluation of a *trained* policy needs something the recipe does not name
    (an advisd advisor's executor), so a command refuses before it loads a model."""
    from .recipe import RecipeError

    terms = recipe.agentcredit.terms
    if "advisd" in terms and (terms["advisd"] or {}).get("executor") is None:
        raise RecipeError("the held-out evaluation of an advisor (agentcredit.terms.advisd) needs its frozen "
                          "executor: set agentcredit.terms.advisd.executor=PATH (the warm start or base model "
                          "the advisor's run started from)")


def recipe_executor(recipe: Recipe, tokenizer, device: Any = "cpu"):
    """The frozen executor the recipe names (``agentcredit.terms.advisd.executor``) on ``device``, for evaluating
    a trained advisor several times with one load; None for a recipe without the ``advisd`` term; a
    ``RecipeError`` when the term names none (:func:`check_trained_evaluation`)."""
    if "advisd" not in recipe.agentcredit.terms:
        return None
    check_trained_evaluation(recipe)
    from .trl.advisd import load_executor

    return load_executor(recipe.agentcredit.terms["advisd"]["executor"], tokenizer).to(device)


def _evaluate_advisor(model, tokenizer, recipe: Recipe, executor: Any, start: bool):
    import torch

    from .trl.advisd import evaluate_advisor

    ac, ev = recipe.agentcredit, recipe.agentcredit.eval
    params = dict(ac.terms["advisd"] or {})
    if executor is None and params.get("executor") is None and start:
        executor = model
    elif executor is None:
        executor = recipe_executor(recipe, tokenizer, model.device)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            return evaluate_advisor(model, executor, tokenizer, ac.env, dict(ac.env_options), ev.seed_list,
                                    params=params, max_turns=ac.max_turns, max_new_tokens=ac.max_new_tokens,
                                    temperature=ev.temperature, greedy=ev.greedy, system=ac.system,
                                    batch_size=ev.batch_size, sampling_seed=ev.sampling_seed)
    finally:
        model.train(was_training)


def as_dict(result: Any) -> dict[str, Any] | None:
    """An evaluation result (a dataclass, a dict or an object) as a JSON-ready dict without its per-episode
    records (tuples become lists); ``None`` stays ``None``."""
    if result is None:
        return None
    if dataclasses.is_dataclass(result):
        d = {f.name: getattr(result, f.name) for f in dataclasses.fields(result) if f.name != "episodes"}
    elif isinstance(result, dict):
        d = dict(result)
    else:
        d = {k: v for k, v in vars(result).items() if not k.startswith("_")}
    d.pop("episodes", None)  # the bridge's per-episode records: too big for a summary
    return {k: (list(v) if isinstance(v, tuple) else v) for k, v in d.items()}


def paired_before_after(before: Any, after: Any) -> PairedDifference | None:
    """The seed-by-seed before/after difference (:func:`agentcredit.stats.paired_difference`), or ``None`` when
    either evaluation is missing or they did not play the same seeds."""
    eps_b, eps_a = getattr(before, "episodes", None), getattr(after, "episodes", None)
    if not eps_b or not eps_a or [e.seed for e in eps_b] != [e.seed for e in eps_a]:
        return None
    return paired_difference([e.success for e in eps_b], [e.success for e in eps_a])


def write_eval_episodes(path: Path, before: Any, after: Any) -> str:
    """One JSON line per held-out episode (``phase``, ``seed``, ``success``, ``turns``, ``valid``, ``return``), so the
    paired statistic and any other can be recomputed after the run."""
    with path.open("w") as f:
        for phase, result in (("before", before), ("after", after)):
            for e in getattr(result, "episodes", None) or []:
                valid = sum(t.valid for t in e.turns)
                f.write(json.dumps({"phase": phase, "seed": e.seed, "success": bool(e.success), "turns": len(e.turns),
                                    "valid": valid, "return": round(e.total_reward, 6)}) + "\n")
    return str(path)


def _ci(result: Any) -> tuple[float, float]:
    ci = getattr(result, "success_ci", None)
    if isinstance(ci, (list, tuple)) and len(ci) == 2:
        return float(ci[0]), float(ci[1])
    rate = float(getattr(result, "success_rate", 0.0))
    return rate, rate


def format_eval_table(before: Any, after: Any, header: str = "") -> str:
    """The before/after table of held-out success (95 % interval), valid-action rate, return and turns."""
    lines = [header] if header else []
    lines.append(f"{'':<8}{'episodes':>9}{'success':>10}{'95% interval':>20}{'valid':>9}{'return':>9}{'turns':>7}")
    for label, r in (("before", before), ("after", after)):
        if r is None:
            continue
        lo, hi = _ci(r)
        interval = f"[{lo:6.1%}, {hi:6.1%}]"
        lines.append(f"{label:<8}{getattr(r, 'n_episodes', 0):>9}{getattr(r, 'success_rate', 0.0):>10.1%}"
                     f"{interval:>20}{getattr(r, 'valid_rate', 0.0):>9.1%}{getattr(r, 'mean_return', 0.0):>9.3f}"
                     f"{getattr(r, 'mean_turns', 0.0):>7.2f}")
    return "\n".join(lines)
