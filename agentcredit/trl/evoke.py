"""EVOKE's goal-diversity ranking term inside TRL's ``GRPOTrainer`` (:mod:`distill_plugins.evoke`).

    Trainer = make_trainer(GRPOTrainer, credit="gigpo", terms={"evoke": {"weight": 0.1, "goals": 2}})

or the recipe block ``agentcredit.terms: {evoke: {...}}``. Needs the one-row-per-turn rollout
(:class:`agentcredit.trl.rollouts.TurnRollout`) on an env with ``goal_rankings(k, rng)``
(:class:`env_adapters.base.GoalRanking`); both are checked when the trainer is built.

Each training generation round:

1. While the rollout plays, its per-turn hook (``TurnRollout._before_step``, wrapped on the instance) keeps a uniform
   reservoir sample of ``states`` decision states; for each kept state it stores the turn's prompt ids and
   ``env.goal_rankings(goals, rng)`` (the env's solver at that state; the history stays the one recorded).
2. After the round, each (state, goal) becomes the turn's prompt rewritten under the goal
   (:meth:`GoalRanking.rewrite`: the task sentence / the observation) plus one candidate answer ``a</action>`` per
   legal action; the states are dealt to the round's ``steps_per_generation`` micro-batches.
3. ``_compute_loss`` of a micro-batch scores its candidates with the policy (with gradient, left-padded prompt and
   right-padded answer as TRL scores completions, at the sampling temperature) and adds
   ``w_k * L_EVOKE / gradient_accumulation_steps`` to TRL's loss (``w_k``: :func:`distill_plugins.evoke.weight_at`).

Logged: ``agentcredit_evoke/{loss,rank_acc,top1_acc,states,groups,weight}``. Checkpoints hold the sampling stream
(``agentcredit_evoke.pt``), so a resumed run draws the same states and goals as the uninterrupted one.
"""

from __future__ import annotations

import math
import os
import random
from typing import Any

import torch

from distill_plugins.evoke import candidate_batch, evoke_loss, group_scores, ranking_accuracy, weight_at
from distill_plugins.terms.evoke import SPEC

from ..state import load_state
from ._compat import checkpoint_folder
from .prompts import ACTION_STOP

__all__ = ["TermMixin", "EVOKEMixin", "STATE_FILE", "score_groups", "goal_swap_groups"]

STATE_FILE = "agentcredit_evoke.pt"


def _rng_state(rng: random.Random) -> list:
    version, internal, gauss = rng.getstate()
    return [version, list(internal), gauss]


class EVOKEMixin:
    """Put before the credit mixin: ``class T(EVOKEMixin, CreditMixin, GRPOTrainer)``; parameters from the class
    attribute ``terms["evoke"]`` (:class:`distill_plugins.evoke.EVOKEParams`)."""

    terms: dict[str, dict[str, Any]] = {}

    def __init__(self, *args, **kwargs):
        self._evoke_params = SPEC.make_params(**dict(self.terms.get("evoke") or {}))
        rollout = kwargs.get("rollout_func")
        if rollout is None or not callable(getattr(rollout, "_before_step", None)) or not hasattr(rollout, "_pool"):
            raise ValueError("term 'evoke' needs rollout_func=agentcredit.trl.rollouts.TurnRollout (the one-row-per-"
                             "turn rollout; recipes: agentcredit.rollout: turns): it records the env's goal rankings "
                             "at the rollout's decision states")
        env = rollout._pool[0]
        if not callable(getattr(env, "goal_rankings", None)):
            raise ValueError(f"term 'evoke' needs an env with goal_rankings(k, rng); {rollout.env_name!r} has none "
                             f"(built in: synthetic, minigrid with task 'goal')")
        env.reset(0)
        env.goal_rankings(1, random.Random(0))  # e.g. minigrid DoorKey refuses here, before the model loads
        self._evoke_rng = random.Random(self._evoke_params.seed)
        self._evoke_pool: list[tuple[list[int], list]] = []
        self._evoke_seen = 0
        self._evoke_chunks: list[list[dict[str, Any]]] = []
        super().__init__(*args, **kwargs)
        inner = rollout._before_step

        def before_step(model, tokenizer, trainer):
            hook = inner(model, tokenizer, trainer)
            return self._evoke_hook(hook) if trainer is self and model.training else hook

        rollout._before_step = before_step

    # -- 1. the rollout's decision states: a reservoir sample with the env's rankings ----------------------------
    def _evoke_hook(self, inner):
        p, rng = self._evoke_params, self._evoke_rng

        def hook(envs, prompt_ids, action_texts):
            extras = inner(envs, prompt_ids, action_texts) if inner is not None else [{} for _ in envs]
            for env, ids in zip(envs, prompt_ids):
                self._evoke_seen += 1
                slot = len(self._evoke_pool) if len(self._evoke_pool) < p.states else rng.randrange(self._evoke_seen)
                if slot >= p.states:
                    continue
                rankings = env.goal_rankings(p.goals, rng)
                if not rankings:
                    continue
                if slot == len(self._evoke_pool):
                    self._evoke_pool.append((list(ids), rankings))
                else:
                    self._evoke_pool[slot] = (list(ids), rankings)
            return extras

        return hook

    # -- 2. the round's (state, goal) groups, dealt to its micro-batches -----------------------------------------
    def _generate_and_score_completions(self, inputs):
        self._evoke_pool, self._evoke_seen = [], 0
        output = super()._generate_and_score_completions(inputs)
        if self.model.training:
            pool, self._evoke_pool = self._evoke_pool, []
            n = max(int(self.args.steps_per_generation), 1)
            groups = [self._evoke_groups(ids, rankings) for ids, rankings in pool]
            self._evoke_chunks = [[g for state in groups[j::n] for g in state] for j in range(n)]
            self._metrics["train"]["agentcredit_evoke/states"].append(float(len(pool)))
        return output

    def _evoke_groups(self, prompt_ids: list[int], rankings) -> list[dict[str, Any]]:
        tok = self.processing_class
        text = tok.decode(prompt_ids, skip_special_tokens=False)
        out = []
        for r in rankings:
            prompt = tok(r.rewrite(text), add_special_tokens=False)["input_ids"]
            answers = [tok(f"{a}{ACTION_STOP}", add_special_tokens=False)["input_ids"] for a in r.actions]
            out.append({"prompt": prompt, "answers": answers, "values": list(r.values)})
        return out

    # -- 3. the term on each micro-batch ---------------------------------------------------------------------------
    def _compute_loss(self, model, inputs):
        loss = super()._compute_loss(model, inputs)
        if not self.model.training or not self._evoke_chunks:
            return loss
        chunk = self._evoke_chunks[self._step % len(self._evoke_chunks)]
        w = weight_at(self._evoke_params, int(self.state.global_step))
        if not chunk:
            return loss
        with torch.set_grad_enabled(w != 0.0 and torch.is_grad_enabled()):  # weight 0: the metrics only
            scores, values, mask = self._evoke_scores(model, chunk)
            term = evoke_loss(scores, values, mask, form=self._evoke_params.loss)
        acc = ranking_accuracy(scores, values, mask)
        m = self._metrics["train"]
        m["agentcredit_evoke/loss"].append(float(term.detach()))
        m["agentcredit_evoke/weight"].append(w)
        m["agentcredit_evoke/groups"].append(acc["groups"])
        for k in ("rank_acc", "top1_acc"):
            if not math.isnan(acc[k]):
                m[f"agentcredit_evoke/{k}"].append(acc[k])
        if w == 0.0:
            return loss
        return loss + w * term / self.current_gradient_accumulation_steps

    def _evoke_scores(self, model, groups: list[dict[str, Any]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``[G, A]`` candidate scores (summed answer-token log-probs, with gradient), values and candidate mask."""
        ids, att, amask = candidate_batch(groups, _pad_id(self.processing_class))
        device = self.accelerator.device
        with self.accelerator.autocast():
            logps, _, _ = self._get_per_token_logps_and_entropies(model, ids.to(device), att.to(device),
                                                                  amask.size(1))
        return group_scores(logps, amask, groups)

    # -- checkpoint and resume -----------------------------------------------------------------------------------
    def _save_checkpoint(self, model, trial):
        super()._save_checkpoint(model, trial)
        if self.args.should_save:
            torch.save({"term": "evoke", "rng": _rng_state(self._evoke_rng)},
                       os.path.join(checkpoint_folder(self, trial), STATE_FILE))

    def _load_from_checkpoint(self, resume_from_checkpoint, model=None):
        super()._load_from_checkpoint(resume_from_checkpoint, model)
        path = os.path.join(resume_from_checkpoint, STATE_FILE)
        if not os.path.exists(path):
            raise ValueError(f"{resume_from_checkpoint} has no {STATE_FILE}: it was not written by a trainer with "
                             f"the 'evoke' term; resuming would restart its sampling stream")
        version, internal, gauss = load_state(path)["rng"]
        self._evoke_rng.setstate((int(version), tuple(int(x) for x in internal), gauss))


#: the name :func:`agentcredit.trl.credit.term_mixin` looks up
TermMixin = EVOKEMixin


def _pad_id(tokenizer) -> int:
    return int(tokenizer.eos_token_id if tokenizer.pad_token_id is None else tokenizer.pad_token_id)


@torch.no_grad()
def goal_swap_groups(model, tokenizer, env_name: str, env_options: dict | None, seeds, goals: int = 2,
                     walk: int = 3, system: str | None = None, temperature: float = 1.0, rng_seed: int = 0
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Held-out goal-swap ranking: per seed, reset, take ``0..walk`` uniformly random legal moves (a
    ``random.Random(rng_seed)`` stream), draw ``goals`` alternative goals there and score the legal actions under
    each in the compact turn prompt (:mod:`agentcredit.trl.prompts`); returns :func:`group_scores`' ``[G, A]``
    scores, values and mask for :func:`distill_plugins.evoke.ranking_accuracy`."""
    import env_adapters

    from .prompts import chat_text, compact_prompt

    rng = random.Random(rng_seed)
    env = env_adapters.make(env_name, **dict(env_options or {}))
    groups = []
    for seed in seeds:
        env.reset(int(seed))
        for _ in range(rng.randrange(walk + 1)):
            if env.step(rng.choice(env.legal_actions())).done:
                env.reset(int(seed))
        text = chat_text(tokenizer, compact_prompt(env.task, env.render(), env.legal_actions()), system)
        for r in env.goal_rankings(goals, rng):
            groups.append({"prompt": tokenizer(r.rewrite(text), add_special_tokens=False)["input_ids"],
                           "answers": [tokenizer(f"{a}{ACTION_STOP}", add_special_tokens=False)["input_ids"]
                                       for a in r.actions], "values": list(r.values)})
    return score_groups(model, groups, _pad_id(tokenizer), temperature)


@torch.no_grad()
def score_groups(model, groups: list[dict[str, Any]], pad: int, temperature: float = 1.0, batch_size: int = 256
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`group_scores` of ``groups`` under ``model`` (a plain HF forward in eval mode, no gradient, rows in
    batches of ``batch_size``): what the mixin computes with gradient, for evaluation."""
    ids, att, amask = candidate_batch(groups, pad)
    was = model.training
    model.eval()
    n_ans, parts = amask.size(1), []
    try:
        for lo in range(0, ids.size(0), batch_size):
            hi = lo + batch_size
            logits = model(input_ids=ids[lo:hi], attention_mask=att[lo:hi],
                           logits_to_keep=n_ans + 1).logits[:, :-1].float() / temperature
            parts.append(torch.log_softmax(logits, -1).gather(-1, ids[lo:hi, -n_ans:, None]).squeeze(-1))
    finally:
        model.train(was)
    return group_scores(torch.cat(parts), amask, groups)
