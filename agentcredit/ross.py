"""``agentcredit ross``: relearn from a run's own rollouts through selective supervision (ROSS, DISTILL §10.1).

    agentcredit train recipes/trl/minigrid_gigpo.yaml agentcredit.rollout_options.archive=runs/x/rollouts.jsonl
    agentcredit ross recipes/trl/minigrid_gigpo.yaml --archive runs/x/rollouts.jsonl --out runs/x/ross [--model PATH]

Reads the archive the TRL turn rollout wrote during training (:mod:`distill_plugins.ross` format), keeps the
continuations the selector picks (default: the loop-erased path of every successful trajectory, invalid actions
dropped; ``--selector all`` = every turn of successful trajectories, ``--selector pkg.module:callable`` = your own,
e.g. an LLM judge), and fine-tunes the recipe's model (or ``--model``) with TRL's ``SFTTrainer``, teacher-forced on
the archived token ids with the loss only on the selected tokens. No new sampling. The recipe's held-out evaluation
runs before and after; the model goes to ``--out`` with ``ross_summary.json``.
"""

from __future__ import annotations

import importlib
import json
import time
from pathlib import Path
from typing import Any

from .recipe import Recipe, RecipeError

__all__ = ["SELECTORS", "resolve_selector", "run_ross"]

SELECTORS = ("loop_erased", "all")


def resolve_selector(name: str):
    """``"loop_erased"`` (default), ``"all"``, or ``"pkg.module:attr"`` (a selector, or a class/factory taking no
    arguments that returns one)."""
    from distill_plugins import ross

    if name == "loop_erased":
        return ross.LoopErasedSelector()
    if name == "all":
        return ross.AllTurnsSelector()
    if ":" not in name:
        raise RecipeError(f"--selector {name!r}: use one of {list(SELECTORS)} or 'pkg.module:callable'")
    mod, _, attr = name.partition(":")
    try:
        obj = getattr(importlib.import_module(mod), attr)
    except (ImportError, AttributeError) as e:
        raise RecipeError(f"--selector {name!r}: cannot import it ({e})") from e
    return obj() if isinstance(obj, type) else obj


def run_ross(recipe: Recipe, archive: str, out: str, *, model_path: str | None = None, steps: int = 40,
             learning_rate: float = 1e-5, batch_size: int = 8, context: str = "trajectory",
             selector: str = "loop_erased", eval: bool = True, eval_before: bool = True,
             seed: int = 0) -> dict[str, Any]:
    """Select, fine-tune, evaluate; returns the summary (also ``out/ross_summary.json``). ``eval_before=False`` skips
    the before evaluation only (e.g. when the training run already measured the same model on the same seeds)."""
    import torch

    from distill_plugins.ross import build_examples, read_archive, selection_stats

    from . import train
    from .trl import rollouts
    from .trl.ross import fine_tune

    t0 = time.time()
    try:
        trajectories = list(read_archive(archive))
    except ValueError as e:
        raise RecipeError(str(e)) from e
    sel = resolve_selector(selector)
    examples = build_examples(trajectories, sel, context=context)
    stats = selection_stats(trajectories, sel)
    tokens = sum(sum(e.completion_mask) for e in examples)
    print(f"agentcredit ross: {archive}: {stats['trajectories']} trajectories ({stats['successful']} successful), "
          f"{stats['selected_turns']} of {stats['turns']} turns selected ({selector}), {len(examples)} examples, "
          f"{tokens} supervised tokens", flush=True)
    if model_path is not None:
        recipe.model_args["model_name_or_path"] = model_path
    path, tokenizer, model = train._load_model(recipe)
    model, trainable, total = train._adapt_model(model, recipe)
    ac = recipe.agentcredit
    before = after = None
    if eval and eval_before and ac.eval is not None:
        before = train._evaluate(rollouts, model, tokenizer, recipe)
        print(f"before ROSS: {before.format()}", flush=True)
    torch.manual_seed(seed)
    trainer = fine_tune(model, tokenizer, examples, Path(out) / "sft", max_steps=steps, learning_rate=learning_rate,
                        batch_size=batch_size, seed=seed)
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    model = trainer.model
    if eval and ac.eval is not None:
        after = train._evaluate(rollouts, model, tokenizer, recipe)
        print(f"after ROSS:  {after.format()}", flush=True)
    target = Path(out)
    target.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(target)
    tokenizer.save_pretrained(target)
    summary = {"recipe": recipe.path, "archive": str(archive), "model": path, "selector": selector,
               "context": context, **stats, "examples": len(examples), "supervised_tokens": tokens,
               "steps": steps, "learning_rate": learning_rate, "batch_size": batch_size,
               "trainable_parameters": trainable, "total_parameters": total,
               "loss_first": losses[0] if losses else None, "loss_last": losses[-1] if losses else None,
               "before": train._as_dict(before), "after": train._as_dict(after),
               "seconds": round(time.time() - t0, 1)}
    (target / "ross_summary.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")
    print(str(target), flush=True)
    return summary
