"""``agentcredit ross``: relearn from a run's own rollouts through selective supervision (ROSS, spec distill §10.1).

    agentcredit train recipes/trl/minigrid_gigpo.yaml agentcredit.rollout_options.archive=runs/x/rollouts.jsonl
    agentcredit ross recipes/trl/minigrid_gigpo.yaml --archive runs/x/rollouts.jsonl --out runs/x/ross [--model PATH]

Reads the archive the TRL turn rollout wrote during training (:mod:`distill_plugins.ross` format), keeps the
continuations the selector picks (default: the loop-erased path of every successful trajectory, invalid actions
dropped; ``--selector all`` = every turn of successful trajectories, ``--selector pkg.module:callable`` = your own,
e.g. an LLM judge), and fine-tunes ``--model`` (e.g. the run's ``OUTPUT_DIR/final``; default: the recipe's warm
start when it has one, else its ``model_name_or_path``; the choice is printed) with TRL's ``SFTTrainer``,
teacher-forced on the archived token ids with the loss only on the selected tokens. No new sampling. The recipe's
held-out evaluation runs before and after; the model goes to ``--out`` with ``ross_summary.json`` and ``recipe.yaml``.

Before any model loads: the archive, ``--model`` and ``--out`` are checked, and the archive's provenance (each
record names its run and env, :func:`distill_plugins.ross.archive_provenance`): an archive of another env than the
recipe's is refused, and so is one that mixes several runs unless ``run`` (``--run-id``) picks one.
"""

from __future__ import annotations

import importlib
import json
import time
from pathlib import Path
from typing import Any

from . import lifecycle, policy
from .evaluation import as_dict, check_trained_evaluation, evaluate
from .recipe import Recipe, RecipeError, resolved_yaml

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


def _one_run(trajectories: list, archive: str, run: str | None, provenance) -> list:
    """The trajectories of one run: ``run`` when given, else all of them when they come from one run; an archive
    mixing runs is a ``RecipeError`` listing them (ross would train on the mixture)."""
    runs = provenance(trajectories)["runs"]
    named = ", ".join(f"{r or '(no run id)'}: {n} records" for r, n in sorted(runs.items()))
    if run is not None:
        picked = [t for t in trajectories if t.run == run]
        if not picked:
            raise RecipeError(f"--run-id {run!r}: the archive {archive} has no rollouts of that run; it holds {named}")
        return picked
    if len(runs) > 1:
        raise RecipeError(f"--archive {archive} mixes the rollouts of {len(runs)} runs ({named}); ross would train "
                          f"on their mixture: pick one with --run-id RUN (agentcredit train prints its run id, "
                          f"OUTPUT_DIR/run.json keeps it)")
    return trajectories


def run_ross(recipe: Recipe, archive: str, out: str, *, model_path: str | None = None, steps: int = 40,
             learning_rate: float = 1e-5, batch_size: int = 8, context: str = "trajectory",
             selector: str = "loop_erased", eval: bool = True, eval_before: bool = True,
             seed: int = 0, run: str | None = None) -> dict[str, Any]:
    """Select, fine-tune, evaluate; returns the summary (also ``out/ross_summary.json``). ``eval_before=False`` skips
    the before evaluation only (e.g. when the training run already measured the same model on the same seeds)."""
    import torch

    from distill_plugins.ross import archive_provenance, build_examples, read_archive, selection_stats

    from .train import warm_start
    from .trl.ross import fine_tune

    t0 = time.time()
    ac = recipe.agentcredit
    lifecycle.check_read_path("--archive", archive, "archive file",
                              fix="train with agentcredit.rollout_options.archive=PATH to write one")
    if model_path is not None:
        lifecycle.check_model_path("--model", model_path, fix="give the trained model's folder (OUTPUT_DIR/final)")
    lifecycle.check_out_dir("--out", out)
    if eval and ac.eval is not None:
        check_trained_evaluation(recipe)  # an advisd advisor is evaluated advising its named executor
    try:
        trajectories = list(read_archive(archive))
    except ValueError as e:
        raise RecipeError(str(e)) from e
    trajectories = _one_run(trajectories, archive, run, archive_provenance)
    envs = archive_provenance(trajectories)["envs"]
    other = {e: n for e, n in envs.items() if e and e != ac.env}
    if other:
        raise RecipeError(f"--archive {archive} holds rollouts of env {', '.join(map(repr, other))} ("
                          f"{sum(other.values())} records), but the recipe plays agentcredit.env={ac.env!r}; give the "
                          f"recipe the archive was trained with")
    if "" in envs:
        print(f"agentcredit ross: warning: {envs['']} records of {archive} name no env (an older archive); assuming "
              f"they are {ac.env!r}", flush=True)
    sel = resolve_selector(selector)
    examples = build_examples(trajectories, sel, context=context)
    stats = selection_stats(trajectories, sel)
    tokens = sum(sum(e.completion_mask) for e in examples)
    print(f"agentcredit ross: {archive}: {stats['trajectories']} trajectories ({stats['successful']} successful), "
          f"{stats['selected_turns']} of {stats['turns']} turns selected ({selector}), {len(examples)} examples, "
          f"{tokens} supervised tokens", flush=True)
    start, source = model_path, "--model"
    if start is None and ac.warm_start is not None:
        start = warm_start(recipe, Path(recipe.trl_args.get("output_dir") or out))
        source = "the recipe's warm start (agentcredit.warm_start); --model OUTPUT_DIR/final for the trained policy"
    elif start is None:
        source = "the recipe's model_name_or_path; pass --model OUTPUT_DIR/final for the trained policy"
    path, tokenizer, model = policy.load_model(recipe, start)
    print(f"agentcredit ross: fine-tuning {path} ({source})", flush=True)
    model, trainable, total = policy.adapt_model(model, recipe)
    before = after = None
    if eval and eval_before and ac.eval is not None:
        before = evaluate(model, tokenizer, recipe)
        print(f"before ROSS: {before.format()}", flush=True)
    torch.manual_seed(seed)
    trainer = fine_tune(model, tokenizer, examples, Path(out) / "sft", max_steps=steps, learning_rate=learning_rate,
                        batch_size=batch_size, seed=seed)
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    model = trainer.model
    if eval and ac.eval is not None:
        after = evaluate(model, tokenizer, recipe)
        print(f"after ROSS:  {after.format()}", flush=True)
    target = Path(out)
    target.mkdir(parents=True, exist_ok=True)
    if callable(getattr(model, "merge_and_unload", None)):  # LoRA: a plain checkpoint, loadable without peft
        model = model.merge_and_unload()
    model.save_pretrained(target)
    tokenizer.save_pretrained(target)
    (target / "recipe.yaml").write_text(resolved_yaml(recipe))
    runs = sorted({t.run for t in trajectories})
    summary = {"recipe": recipe.path, "archive": str(archive), "runs": runs, "model": path,
               "model_source": source.split(";")[0], "selector": selector,
               "context": context, **stats, "examples": len(examples), "supervised_tokens": tokens,
               "steps": steps, "learning_rate": learning_rate, "batch_size": batch_size,
               "trainable_parameters": trainable, "total_parameters": total,
               "loss_first": losses[0] if losses else None, "loss_last": losses[-1] if losses else None,
               "before": as_dict(before), "after": as_dict(after),
               "seconds": round(time.time() - t0, 1)}
    (target / "ross_summary.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")
    print(str(target), flush=True)
    return summary
