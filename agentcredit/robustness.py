"""``agentcredit robustness``: held-out success of a saved policy under perturbations of its weights and hidden states.

The policy (an ``agentcredit train`` output folder: its ``final``, else its latest ``checkpoint-N``; or a model folder)
plays the recipe's ``eval`` block clean and then once per cell of a grid of perturbation types and scales
(:func:`distill_plugins.sprpo.perturbed`: ``noise`` adds ``scale * rms(h) * eps`` to every decoder layer's hidden
states, ``prune`` zeroes the ``scale`` fraction of smallest-magnitude weights of every decoder layer, ``quant``
rounds them to ``scale``-bit symmetric integers per output row). A noise cell pools ``draws`` noise streams (the
same eval seeds each time); pruning and quantisation are deterministic, one draw. Each row: success with its 95 %
Wilson interval, the valid-action rate and the change against the clean row; a table on stdout and a JSON file.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from .recipe import Recipe, RecipeError

__all__ = ["DEFAULT_SCALES", "RANGES", "Cell", "parse_grid", "resolve_policy", "run", "format_table"]

#: the scales a type gets when ``--scales`` does not name it
DEFAULT_SCALES: dict[str, tuple[float, ...]] = {"noise": (0.05, 0.1, 0.2), "prune": (0.1, 0.3, 0.5),
                                                "quant": (8, 4)}
#: the valid scales of each type, in words (checked by :func:`check_scale`)
RANGES = {"noise": "0 < scale <= 10 (relative to the token's hidden-state RMS)",
          "prune": "0 < scale < 1 (the fraction of weights zeroed)", "quant": "an integer bit width in [2, 16]"}


@dataclass
class Cell:
    """One row of the table: a perturbation (``clean`` for the baseline) at ``scale`` over ``draws`` streams."""

    kind: str
    scale: float | None
    draws: int
    episodes: int
    successes: int
    success_rate: float
    success_ci: tuple[float, float]
    valid_rate: float
    mean_return: float
    delta: float = 0.0  #: success_rate minus the clean row's
    seconds: float = 0.0


def check_scale(kind: str, scale: float) -> float:
    ok = {"noise": 0 < scale <= 10, "prune": 0 < scale < 1,
          "quant": float(scale).is_integer() and 2 <= scale <= 16}[kind]
    if not ok or not math.isfinite(scale):
        raise RecipeError(f"--scales: {kind} scale {scale:g} is out of range; {kind} takes {RANGES[kind]}")
    return int(scale) if kind == "quant" else float(scale)


def parse_grid(types: str, scales: list[str] | None = None) -> list[tuple[str, float]]:
    """``(type, scale)`` cells from ``--types noise,prune`` and ``--scales`` items (``0.1,0.2``: every type;
    ``noise=0.1,0.2``: one type); a ``RecipeError`` names an unknown type or a scale out of range."""
    kinds = [t.strip() for t in str(types).split(",") if t.strip()]
    unknown = [t for t in kinds if t not in DEFAULT_SCALES]
    if not kinds or unknown:
        raise RecipeError(f"--types: unknown perturbation type(s) {unknown or [types]}; give a comma-separated "
                          f"subset of {', '.join(DEFAULT_SCALES)}")
    given: dict[str, list[float]] = {}
    for item in scales or []:
        name, _, values = item.rpartition("=")
        targets = [name] if name else kinds
        if name and name not in kinds:
            raise RecipeError(f"--scales {item!r}: {name!r} is not one of the --types ({', '.join(kinds)})")
        try:
            numbers = [float(v) for v in values.split(",") if v.strip()]
        except ValueError:
            raise RecipeError(f"--scales {item!r}: not a comma-separated list of numbers (e.g. 0.1,0.2 or "
                              f"noise=0.1,0.2)") from None
        if not numbers:
            raise RecipeError(f"--scales {item!r}: no scale given")
        for t in targets:
            given[t] = numbers
    return [(t, check_scale(t, s)) for t in kinds for s in given.get(t, DEFAULT_SCALES[t])]


def resolve_policy(path: str) -> Path:
    """The model folder of ``--checkpoint``: ``DIR/final`` of a train output folder, else ``DIR`` itself when it is a
    model folder, else its latest ``checkpoint-N``; a ``RecipeError`` says what the folder lacks."""
    p = Path(path).expanduser()
    if not p.exists():
        raise RecipeError(f"--checkpoint {path!r}: no such folder; give an `agentcredit train` output_dir, its "
                          f"final/ or a checkpoint-N folder")
    for candidate in (p / "final", p):
        if (candidate / "config.json").is_file():
            return candidate
    from .lifecycle import latest_checkpoint

    last = latest_checkpoint(p) if p.is_dir() else None
    if last is not None and (last / "config.json").is_file():
        return last
    raise RecipeError(f"--checkpoint {path!r} holds no model (no config.json in it, in final/ or in a checkpoint-N); "
                      f"give an `agentcredit train` output_dir whose run finished, or a model folder")


def _cell(kind: str, scale: float | None, results: list[Any], seconds: float) -> Cell:
    from .stats import wilson_interval

    episodes = [e for r in results for e in r.episodes]
    n = len(episodes)
    wins = sum(bool(e.success) for e in episodes)
    valid = sum(r.valid_rate * r.n_episodes for r in results) / max(n, 1)
    ret = sum(r.mean_return * r.n_episodes for r in results) / max(n, 1)
    return Cell(kind, scale, len(results), n, wins, wins / max(n, 1), wilson_interval(wins, n), valid, ret,
                seconds=round(seconds, 2))


def run(recipe: Recipe, checkpoint: str, grid: list[tuple[str, float]], draws: int = 1, out: str | None = None,
        echo: bool = True) -> dict[str, Any]:
    """Evaluate the policy at ``checkpoint`` clean and under each ``(type, scale)`` of ``grid`` (noise over ``draws``
    streams); write the JSON (``out``, default ``<checkpoint>/robustness.json``) and return it."""
    from distill_plugins.sprpo import perturbed

    from . import policy
    from .evaluation import check_trained_evaluation, evaluate, recipe_executor

    if recipe.agentcredit.eval is None:
        raise RecipeError("the recipe has no agentcredit.eval block (agentcredit.eval=null); robustness plays its "
                          "held-out seeds: set agentcredit.eval={seeds: [20000, 20064]}")
    check_trained_evaluation(recipe)
    if isinstance(draws, bool) or not isinstance(draws, int) or draws < 1:
        raise RecipeError(f"--seeds must be a positive integer (noise draws per cell), got {draws!r}")
    model_dir = resolve_policy(checkpoint)
    target = Path(out) if out else Path(checkpoint) / "robustness.json"
    from .lifecycle import check_out_file

    target = check_out_file("--out", target)
    _, tokenizer, model = policy.load_model(recipe, str(model_dir))
    executor = recipe_executor(recipe, tokenizer, model.device)  # advisd: the advisor is played advising it

    def play(kind: str | None, scale: float | None, n: int) -> Cell:
        started, results = time.time(), []
        for draw in range(n):
            if kind is None:
                results.append(evaluate(model, tokenizer, recipe, executor=executor))
            else:
                with perturbed(model, kind, scale, seed=draw):
                    results.append(evaluate(model, tokenizer, recipe, executor=executor))
        cell = _cell(kind or "clean", scale, results, time.time() - started)
        if echo:
            print(f"agentcredit robustness: {cell.kind} {'' if scale is None else f'{scale:g} '}"
                  f"success {cell.success_rate:.1%} ({cell.episodes} episodes, {cell.seconds:.0f} s)", flush=True)
        return cell

    clean = play(None, None, 1)
    cells = [clean]
    for kind, scale in grid:
        cell = play(kind, scale, draws if kind == "noise" else 1)
        cell.delta = cell.success_rate - clean.success_rate
        cells.append(cell)
    ev = recipe.agentcredit.eval
    result = {"recipe": recipe.path, "overrides": list(recipe.overrides), "policy": str(model_dir),
              "eval": {"seeds": list(ev.seeds), "temperature": ev.temperature, "greedy": ev.greedy,
                       "sampling_seed": ev.sampling_seed},
              "draws": draws, "cells": [asdict(c) for c in cells]}
    target.write_text(json.dumps(result, indent=2) + "\n")
    result["json"] = str(target)
    return result


def format_table(result: dict[str, Any]) -> str:
    """The table of :func:`run`'s result: one row per cell."""
    lines = [f"policy {result['policy']}: held-out success under perturbation (95 % Wilson intervals)",
             f"{'perturbation':<13}{'scale':>7}{'draws':>6}{'episodes':>9}{'success':>9}{'95% interval':>18}"
             f"{'valid':>8}{'vs clean':>10}"]
    for c in result["cells"]:
        lo, hi = c["success_ci"]
        scale = "-" if c["scale"] is None else f"{c['scale']:g}"
        delta = "" if c["kind"] == "clean" else f"{100 * c['delta']:+.1f} pt"
        lines.append(f"{c['kind']:<13}{scale:>7}{c['draws']:>6}{c['episodes']:>9}{c['success_rate']:>9.1%}"
                     f"{f'[{lo:.1%}, {hi:.1%}]':>18}{c['valid_rate']:>8.1%}{delta:>10}")
    return "\n".join(lines)
