"""``agentcredit sft``: a distillation teacher from a recipe, by supervised fine-tuning on scripted-expert turns.

    agentcredit sft recipes/trl/minigrid_gigpo.yaml --out runs/teacher/minigrid [--steps 60] [key=value ...]
    agentcredit sft recipes/trl/synthetic_keydoor_compare.yaml --out runs/format --player random

With ``--player random`` the episodes are played by uniformly random legal actions instead: the checkpoint learns
the answer format and nothing about the task (a start for comparing credit estimators from a uniform-like policy);
its summary's ``format`` block says how close it is to that: the probability mass it puts on legal actions and its
entropy over them against ``log |legal actions|`` (:func:`format_report`).

The teacher must score the student's tokens, so it is the recipe's own model (same tokenizer) fine-tuned on the
recipe's own turn format: for ``--episodes`` training seeds (drawn from ``agentcredit.train_seeds`` past the ones a
run uses first, never an eval seed) the env's scripted expert (``env.expert_actions()``: the moves that start a
shortest path; one drawn at random when several tie) plays an episode; every turn becomes one example, prompt = the
rollout's Markovian prompt with the forced ``<action>`` (:mod:`agentcredit.trl.prompts`: exactly what
:class:`agentcredit.trl.rollouts.TurnRollout` feeds the model), target = ``"{action}</action>"``. Cross-entropy on the
target tokens only, AdamW, the recipe's ``freeze_layers`` / dtype (a LoRA run is saved merged, as a plain checkpoint).
The checkpoint (weights, tokenizer, ``sft_summary.json``) goes to ``--out``; the held-out evaluation of the recipe
(:mod:`agentcredit.evaluation`: same seeds, temperature) runs on it, so its success is the ceiling that the
distillation benchmark reports.
"""

from __future__ import annotations

import json
import random
import time
from pathlib import Path
from typing import Any

from . import lifecycle, policy
from .evaluation import as_dict, evaluate
from .recipe import Recipe, RecipeError, resolved_yaml

__all__ = ["expert_turns", "fingerprint", "run_sft", "player_setting", "format_report", "PLAYERS"]

#: who plays the episodes the warm start learns from
PLAYERS = ("expert", "random")


def player_setting(player: str) -> dict[str, Any]:
    """The fingerprint entry of ``player``: none for the expert (checkpoints made before the option stay valid)."""
    return {} if player == "expert" else {"player": player}


def fingerprint(recipe: Recipe, **settings: Any) -> dict[str, Any]:
    """What an SFT checkpoint depends on: the model (and how it is loaded), the precision, the turn format, the seeds,
    the SFT settings and agentcredit's version (the expert and the prompts are its code); JSON-safe."""
    from . import __version__

    ac, margs = recipe.agentcredit, recipe.model_args
    raw = {"model": margs["model_name_or_path"], "model_revision": margs.get("model_revision"),
           "dtype": margs.get("dtype"), "attn_implementation": margs.get("attn_implementation"),
           "bf16": recipe.trl_args.get("bf16"), "agentcredit": __version__,
           "env": ac.env, "env_options": dict(ac.env_options),
           "max_turns": ac.max_turns, "prompt": ac.prompt, "history_length": ac.history_length, "system": ac.system,
           "freeze_layers": ac.freeze_layers, "lora": ac.lora, "train_seeds": list(ac.train_seeds),
           "eval_seeds": list(ac.eval.seeds) if ac.eval is not None else None, **settings}
    return json.loads(json.dumps(raw, default=str))


def expert_turns(recipe: Recipe, tokenizer, seeds: list[int], rng: random.Random, player: str = "expert"
                 ) -> list[tuple[list[int], list[int]]]:
    """``(prompt_ids, target_ids)`` of every turn of one episode per seed, in the rollout's format, played by the
    env's scripted expert (``player="expert"``) or by uniformly random legal actions (``"random"``)."""
    import env_adapters
    from env_adapters.prompting import build_prompt

    from .trl.prompts import ACTION_STOP, actions_over_budget, chat_text, compact_prompt, legal_actions

    ac = recipe.agentcredit
    env = env_adapters.make(ac.env, **dict(ac.env_options))
    if player not in PLAYERS:
        raise RecipeError(f"sft player={player!r}; choose one of {list(PLAYERS)}")
    if player == "random" and not callable(getattr(env, "legal_actions", None)):
        raise RecipeError(f"agentcredit.env={ac.env!r} lists no legal actions (legal_actions()); the random player "
                          f"needs them")
    if player == "expert" and not callable(getattr(env, "expert_actions", None)):
        raise RecipeError(f"agentcredit.env={ac.env!r} has no scripted expert (expert_actions()); agentcredit sft "
                          f"needs one (MiniGrid with moves=absolute has it)")
    rows, actions = [], []
    for seed in seeds:
        obs = env.reset(seed)
        history: list[tuple[str, str | None]] = []
        for _ in range(ac.max_turns):
            moves = env.expert_actions() if player == "expert" else legal_actions(env)
            if not moves:
                break
            action = rng.choice(moves)
            task, legal = getattr(env, "task", ""), legal_actions(env)
            user = (compact_prompt(task, obs, legal) if ac.prompt == "compact"
                    else build_prompt(task, history, obs, legal, ac.history_length))
            prompt = tokenizer(chat_text(tokenizer, user, ac.system), add_special_tokens=False)["input_ids"]
            target = tokenizer(f"{action}{ACTION_STOP}", add_special_tokens=False)["input_ids"]
            rows.append((prompt, target))
            actions.append(action)
            history.append((obs, action))
            res = env.step(action)
            obs = res.observation
            if res.done:
                break
    # generation stops after max_new_tokens, so a longer answer is cut before its </action> and parsed as invalid:
    # the warm start would teach a move the rollout can never make (the random player: a legal action never taken)
    over = actions_over_budget(tokenizer, actions, ac.max_new_tokens)
    if over:
        action, n = over[0]
        raise RecipeError(f"the expert's answer {action + ACTION_STOP!r} is {n} tokens, but agentcredit.max_new_tokens="
                          f"{ac.max_new_tokens} cuts every reply before that, so the rollout would parse it as "
                          f"invalid: set agentcredit.max_new_tokens >= {n}")
    return rows


def _batches(rows, batch_size: int, steps: int, rng: random.Random, pad: int):
    import torch

    order: list[int] = []
    for _ in range(steps):
        if len(order) < batch_size:
            fresh = list(range(len(rows)))
            rng.shuffle(fresh)
            order += fresh
        idx, order = order[:batch_size], order[batch_size:]
        width = max(len(rows[i][0]) + len(rows[i][1]) for i in idx)
        ids = torch.full((len(idx), width), pad)
        att = torch.zeros((len(idx), width), dtype=torch.long)
        labels = torch.full((len(idx), width), -100)
        for r, i in enumerate(idx):
            p, c = rows[i]
            ids[r, :len(p) + len(c)] = torch.tensor(p + c)
            att[r, :len(p) + len(c)] = 1
            labels[r, len(p):len(p) + len(c)] = torch.tensor(c)
        yield ids, att, labels


#: what :func:`run_sft` uses for an argument left None when the recipe has no ``agentcredit.warm_start`` block
DEFAULTS: dict[str, Any] = {"episodes": 256, "steps": 60, "batch_size": 32, "player": "expert", "learning_rate": 5e-5}


def _settings(recipe: Recipe, given: dict[str, Any]) -> dict[str, Any]:
    """``given`` with every None taken from the recipe's ``agentcredit.warm_start`` (what ``agentcredit train`` would
    run; its ``policy`` is the player), else from :data:`DEFAULTS`; prints what was taken and from where."""
    ws = recipe.agentcredit.warm_start
    out = {k: v if v is not None else (getattr(ws, "policy" if k == "player" else k) if ws is not None
                                       else DEFAULTS[k]) for k, v in given.items()}
    source = "the recipe's agentcredit.warm_start" if ws is not None else "the defaults"
    taken = [k for k, v in given.items() if v is None and k != "learning_rate"]
    if taken:
        print(f"agentcredit sft: {', '.join(f'{k}={out[k]}' for k in taken)} ({source})", flush=True)
    if given["learning_rate"] is None:
        lr_source = "the recipe's agentcredit.warm_start.learning_rate" if ws is not None else "default"
        print(f"agentcredit sft: learning rate {out['learning_rate']:g} ({lr_source})", flush=True)
    return out


def run_sft(recipe: Recipe, out: str, episodes: int | None = None, steps: int | None = None,
            batch_size: int | None = None, learning_rate: float | None = None, seed: int = 0,
            eval: bool = True,  # noqa: A002
            final_out: str | None = None, player: str | None = None) -> dict[str, Any]:
    """Fine-tune the recipe's model on the turns of ``player`` (:data:`PLAYERS`: the scripted expert, or uniformly
    random legal actions) and save it to ``out``; returns the summary (also written to
    ``out/sft_summary.json``). ``steps=0`` saves and evaluates the model as it is (a start with no warm start, e.g.
    a pretrained LM in ``benchmarks/credit_learning.py``); its losses are then ``None``. ``final_out`` is the folder
    the summary names as ``out`` when ``out`` is a temporary one renamed into place afterwards (the warm start's
    :func:`agentcredit.models.build_atomically`). ``episodes``, ``steps``, ``batch_size``, ``learning_rate`` or
    ``player`` None: the recipe's ``agentcredit.warm_start`` value (what its own warm start uses), else
    :data:`DEFAULTS`. The model path and ``out`` are checked before any model loads; ``out`` gets the recipe
    (``recipe.yaml``) next to the weights."""
    import torch

    kw = _settings(recipe, {"episodes": episodes, "steps": steps, "batch_size": batch_size,
                            "player": player, "learning_rate": learning_rate})
    episodes, steps, batch_size, player, learning_rate = (kw[k] for k in ("episodes", "steps", "batch_size",
                                                                          "player", "learning_rate"))
    if player not in PLAYERS:
        raise RecipeError(f"sft player={player!r}; choose one of {list(PLAYERS)}")
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
        raise RecipeError(f"sft steps={steps!r}: give a whole number >= 0 (0 saves and evaluates the model as is)")
    lifecycle.check_model_path("model_name_or_path", recipe.model_args.get("model_name_or_path"),
                               fix="give an existing model folder, a hub id or a built-in name")
    lifecycle.check_out_dir("--out", out)
    t0 = time.time()
    ac = recipe.agentcredit
    lo, hi = ac.train_seeds
    e_lo, e_hi = ac.eval.seeds if ac.eval is not None else (0, 0)
    rng = random.Random(seed)
    pool = [s for s in range(hi - 1, lo - 1, -1) if not e_lo <= s < e_hi][:max(episodes * 4, episodes)]
    if len(pool) < episodes:
        raise RecipeError(f"{episodes} expert episodes need as many training seeds; agentcredit.train_seeds="
                          f"{ac.train_seeds} holds {len(pool)} outside the eval seeds: widen it or use fewer episodes")
    seeds = rng.sample(pool, episodes)  # from the top of the range: train_seeds() samples the whole range
    model_path, tokenizer, model = policy.load_model(recipe)
    model, trainable, total = policy.adapt_model(model, recipe)
    rows = expert_turns(recipe, tokenizer, seeds, rng, player)
    if not rows:
        raise RecipeError(f"the {player} player produced no turns (are the seeds' episodes already solved?)")
    use_bf16 = bool(recipe.trl_args.get("bf16", False))
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=learning_rate)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    print(f"agentcredit sft: {len(rows)} {player} turns from {episodes} episodes | model {model_path} | "
          f"{trainable:,} of {total:,} parameters trainable | {steps} steps x {batch_size}", flush=True)
    model.train()
    log = []
    for step, (ids, att, labels) in enumerate(_batches(rows, batch_size, steps, rng, pad), start=1):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=use_bf16):
            loss = model(input_ids=ids, attention_mask=att, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        log.append(loss.item())
        if step == 1 or step % 10 == 0 or step == steps:
            print(f"  step {step:4d}  loss {log[-1]:.4f}  {time.time() - t0:6.0f} s", flush=True)
    model.eval()
    target = Path(out)
    target.mkdir(parents=True, exist_ok=True)
    if callable(getattr(model, "merge_and_unload", None)):  # LoRA: save a plain checkpoint, loadable without peft
        model = model.merge_and_unload()
    model.save_pretrained(target)
    tokenizer.save_pretrained(target)
    (target / "recipe.yaml").write_text(resolved_yaml(recipe))
    result, fmt = None, None
    if player == "random":  # what the warm start knows beyond the format; cheap, so also without eval
        held_out = ac.eval.seed_list[:4] if ac.eval is not None else seeds[:4]
        fmt = format_report(model, tokenizer, recipe, held_out, random.Random(seed + 1))
        print(f"format: legal-action mass {fmt['legal_mass']:.3f}, entropy over legal actions {fmt['entropy']:.3f} "
              f"(log |legal| {fmt['log_legal']:.3f}) on {fmt['states']} states of random episodes", flush=True)
    if eval and ac.eval is not None:
        result = evaluate(model, tokenizer, recipe, start=True)  # advisd recipes: it advises a copy of itself
        print(f"teacher held-out: success {result.success_rate:.1%} [{result.success_ci[0]:.1%}, "
              f"{result.success_ci[1]:.1%}] on {result.n_episodes} seeds, valid {result.valid_rate:.1%}", flush=True)
    summary = {"recipe": recipe.path, "overrides": list(recipe.overrides), "model": model_path,
               "out": str(final_out or target),
               "episodes": episodes, "turns": len(rows), "steps": steps, "batch_size": batch_size,
               "learning_rate": learning_rate, "loss_first": log[0] if log else None,
               "loss_last": log[-1] if log else None,
               "player": player, "seconds": round(time.time() - t0, 1), "eval": as_dict(result), "format": fmt,
               "fingerprint": fingerprint(recipe, episodes=episodes, steps=steps, batch_size=batch_size,
                                          learning_rate=learning_rate, **player_setting(player))}
    (target / "sft_summary.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")
    print(str(target), flush=True)
    return summary


def format_report(model, tokenizer, recipe: Recipe, seeds: list[int], rng: random.Random) -> dict[str, float]:
    """How much a warm start knows beyond the answer format, at the states of uniformly random episodes on ``seeds``:
    each legal action's reply ``action</action>`` is scored by the model (the sum of its token log-probabilities);
    ``legal_mass`` is the mean total probability of the legal replies (1: the format is learnt), ``entropy`` the mean
    entropy of the model's distribution renormalised over the legal actions, ``log_legal`` the mean
    ``log |legal actions|`` (equal entropy: a uniform policy over the legal actions, i.e. no task knowledge)."""
    import math

    import torch

    import env_adapters
    from env_adapters.prompting import build_prompt

    from .trl.prompts import ACTION_STOP, chat_text, compact_prompt, legal_actions

    ac = recipe.agentcredit
    env = env_adapters.make(ac.env, **dict(ac.env_options))
    mass, ent, log_legal = [], [], []
    model.eval()
    for seed in seeds:
        obs, history = env.reset(seed), []
        for _ in range(ac.max_turns):
            legal = legal_actions(env)
            if not legal:
                break
            task = getattr(env, "task", "")
            user = (compact_prompt(task, obs, legal) if ac.prompt == "compact"
                    else build_prompt(task, history, obs, legal, ac.history_length))
            prompt = tokenizer(chat_text(tokenizer, user, ac.system), add_special_tokens=False)["input_ids"]
            scores = []
            with torch.no_grad():
                for action in legal:
                    target = tokenizer(f"{action}{ACTION_STOP}", add_special_tokens=False)["input_ids"]
                    ids = torch.tensor([prompt + target])
                    logp = torch.log_softmax(model(input_ids=ids).logits[0, len(prompt) - 1:-1].float(), -1)
                    scores.append(float(logp.gather(-1, torch.tensor(target)[:, None]).sum()))
            s = torch.tensor(scores, dtype=torch.float64)
            p = torch.softmax(s, 0)
            mass.append(float(torch.logsumexp(s, 0).exp()))
            ent.append(float(-(p * p.clamp_min(1e-300).log()).sum()))
            log_legal.append(math.log(len(legal)))
            action = rng.choice(legal)
            history.append((obs, action))
            res = env.step(action)
            obs = res.observation
            if res.done:
                break
    n = max(len(mass), 1)
    return {"states": len(mass), "legal_mass": sum(mass) / n, "entropy": sum(ent) / n,
            "log_legal": sum(log_legal) / n}
