"""EVOKE on verl 0.9.1: the goal-ranking term (:mod:`distill_plugins.evoke`) added to the actor's RL loss,
configured by ``+algorithm.agentcredit_evoke={weight: 0.1, goals: 2, states: 4}`` (the term's parameters,
``agentcredit describe evoke``). Needs the env loop ``agentcredit_env`` on an env with ``goal_rankings(k, rng)``
(synthetic; minigrid task ``goal``).

Three places, each where the data lives:

* **agent loop** (:mod:`agentcredit.verl.agent_loop`): at every training turn the env's solver ranks the legal actions
  under ``goals`` alternative goals (``env.goal_rankings``, one env round trip on the env executor, goals drawn from a
  stream seeded by the term's ``seed``, the dataset row, the session, the step and the turn, so a rerun or a resumed
  run draws the same); each ranking becomes the turn's prompt rewritten under that goal plus one candidate answer
  ``<action>a</action>`` per legal action, in the row's ``extra_fields`` as :data:`FIELD` (``[]`` on validation
  turns and on turns with no ranking; every row carries the key, as verl's batch balancing needs);
* **driver**, ``PPOTrainer._update_actor``: :func:`round_groups` samples ``states`` of the step's ranked rows (padding
  rows, which copy the first row's fields, never count) from ``seed`` and the global step (stateless: nothing to
  checkpoint), keeps the groups whose actions do not all tie, and hands them with ``w_k`` (:func:`weight_at` at
  optimizer step ``global_steps - 1``) and the loss form to the actor through ``batch.extra_info`` (verl gives it to
  every mini- and micro-batch as non-tensor data);
* **worker**, ``FSDPEngineWithLMHead``: every training mini-batch (one optimizer step) adds, on its first
  micro-batch, ``w_k * L_EVOKE`` over all the round's groups, each data-parallel rank scoring its share
  (``groups[rank::dp]``) with one extra forward of the FSDP module (with gradient; left-padded prompt, answer
  tokens' log-probs at the rollout temperature) scaled by ``dp * share / groups`` so that verl's gradient average
  over ranks gives the mean over groups (verl scales its own loss by ``dp`` for the same reason). Every rank runs
  that forward, a rank without a share on a copy of the first group with weight 0, so the sharded forward never
  waits for a rank that skipped it. The ranking metrics are computed over all ranks' scores (gathered).

Logged: ``agentcredit_evoke/{states,groups,weight}`` (driver) and ``actor/agentcredit_evoke/{loss,rank_acc,
top1_acc}`` (worker, mean over the step's mini-batches). Not supported, refused: Ulysses sequence parallelism and
the legacy trainer (when the driver starts), other actor engines than FSDP (Megatron, ...: at the first step, when
the actor reports no term).
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Mapping, Sequence
from typing import Any

from credit_plugins.hashing import stable_hash
from distill_plugins.evoke import candidate_batch, evoke_loss, group_scores, ranking_accuracy, weight_at

from ._compat import install_post_import_hooks, term_params, wraps_once

__all__ = ["CONFIG_KEY", "FIELD", "evoke_params", "check_config", "goal_seed", "rank_goals", "turn_groups",
           "round_groups", "share_of", "share_scale", "evoke_term", "install"]

#: ``algorithm.agentcredit_evoke``: the term's parameters (a mapping; absent or null: the term is off)
CONFIG_KEY = "agentcredit_evoke"
#: the per-row extra field the agent loop writes: the turn's (state, goal) groups
FIELD = "evoke_groups"
GROUPS_KEY, WEIGHT_KEY, FORM_KEY = "agentcredit_evoke_groups", "agentcredit_evoke_weight", "agentcredit_evoke_loss"
#: the answer format of the env loop's prompts (env_adapters.prompting)
ANSWER = "<action>{}</action>"


def evoke_params(algorithm: Any):
    """The term's parameters from ``algorithm.agentcredit_evoke`` (None when absent); a ``ValueError`` names the key."""
    return term_params(algorithm, CONFIG_KEY, "evoke", "{weight: 0.1, goals: 2}")


def check_config(config: Any) -> None:
    """Preflight (the driver, before Ray): the block's parameters, and no Ulysses sequence parallelism (the extra
    forward runs whole sequences on each rank)."""
    algorithm = config.get("algorithm", None) if hasattr(config, "get") else None
    if evoke_params(algorithm) is None:
        return
    actor = ((config.get("actor_rollout_ref", None) or {}).get("actor", None) or {})
    sp = max(int(actor.get("ulysses_sequence_parallel_size", 1) or 1),
             int((actor.get("fsdp_config", None) or {}).get("ulysses_sequence_parallel_size", 1) or 1))
    if not bool((config.get("trainer", None) or {}).get("use_v1", True)):
        raise ValueError(f"algorithm.{CONFIG_KEY}: the evoke term is wired into verl's v1 trainer; set "
                         f"trainer.use_v1=true or drop algorithm.{CONFIG_KEY}")
    if sp > 1:
        raise ValueError(f"algorithm.{CONFIG_KEY}: the evoke term scores whole candidate sequences on each rank and "
                         f"does not support Ulysses sequence parallelism (ulysses_sequence_parallel_size={sp}); set "
                         f"it to 1 or drop algorithm.{CONFIG_KEY}")


# ---- agent loop -----------------------------------------------------------------------------------------------------
def goal_seed(seed: int, row: Any, session: Any, step: Any, turn: int) -> int:
    """The goal-draw seed of one turn: stable across processes and reruns (never Python's salted ``hash``)."""
    return stable_hash(f"agentcredit-evoke|{int(seed)}|{row}|{session}|{step}|{int(turn)}") % (2**31 - 1)


def rank_goals(env, goals: int, seed: int) -> list:
    """At the env's current state: ``env.goal_rankings(goals, random.Random(seed))`` (runs where the env lives); an
    env without the capability is a ``ValueError`` naming the ones that have it."""
    if not callable(getattr(env, "goal_rankings", None)):
        raise ValueError(f"algorithm.{CONFIG_KEY}: the env {type(env).__name__} has no goal_rankings(k, rng); EVOKE "
                         f"needs one (built in: synthetic, minigrid with task 'goal')")
    return list(env.goal_rankings(int(goals), random.Random(int(seed))))


def turn_groups(tokenizer, prompt_ids: Sequence[int], rankings: Sequence[Any]) -> list[dict[str, Any]]:
    """One group per ranking: the turn's prompt rewritten under its goal (``GoalRanking.rewrite`` of the decoded
    prompt, re-encoded), one candidate answer ``<action>a</action>`` per legal action, and the solver's values."""
    text = tokenizer.decode(list(prompt_ids), skip_special_tokens=False)
    return [{"prompt": tokenizer.encode(r.rewrite(text), add_special_tokens=False),
             "answers": [tokenizer.encode(ANSWER.format(a), add_special_tokens=False) for a in r.actions],
             "values": [float(v) for v in r.values]} for r in rankings]


# ---- driver ---------------------------------------------------------------------------------------------------------
def round_groups(rows: Sequence[Mapping[str, Any] | None], padding: Sequence[bool], states: int, seed: int, step: int
                 ) -> tuple[list[dict[str, Any]], int]:
    """``(groups, sampled states)`` of one training step: ``states`` rows drawn without replacement (a
    ``random.Random`` of ``seed`` and ``step``) among the non-padding rows whose :data:`FIELD` holds groups, their
    groups in row order, those whose values all tie left out. Rows without the field at all are a ``ValueError``:
    the run's agent loop does not write it."""
    if rows and not all(r is not None and FIELD in r for r in rows):
        raise ValueError(f"algorithm.{CONFIG_KEY}: the rows carry no extra_fields {FIELD!r}; the evoke term needs the "
                         f"env loop agentcredit_env (actor_rollout_ref.rollout.agent.default_agent_loop="
                         f"agentcredit_env), which writes it when algorithm.{CONFIG_KEY} is set")
    ranked = [i for i, r in enumerate(rows) if not padding[i] and r[FIELD]]
    chosen = sorted(random.Random(int(seed) * 1_000_003 + int(step)).sample(ranked, min(int(states), len(ranked))))
    groups = [{"prompt": [int(x) for x in g["prompt"]], "answers": [[int(x) for x in a] for a in g["answers"]],
               "values": [float(v) for v in g["values"]]} for i in chosen for g in rows[i][FIELD]]
    return [g for g in groups if len(set(g["values"])) > 1], len(chosen)


@wraps_once("evoke", "PPOTrainer._update_actor(self, batch, metrics)", ("self", "batch", "metrics"))
def wrap_update_actor(orig):
    def _update_actor(self, batch, metrics):
        p = evoke_params(self.config.get("algorithm", None))
        if p is None:
            return orig(self, batch, metrics)
        import transfer_queue as tq

        data = tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id, select_fields=["extra_fields"])
        rows = data["extra_fields"]
        rows = rows.tolist() if hasattr(rows, "tolist") else list(rows)
        padding = [bool(t.get("is_padding", False)) for t in batch.tags] if batch.tags else [False] * len(rows)
        step = int(self.global_steps)
        groups, states = round_groups(rows, padding, p.states, p.seed, step)
        w = weight_at(p, step - 1)
        batch.extra_info.update({GROUPS_KEY: json.dumps(groups), WEIGHT_KEY: float(w), FORM_KEY: p.loss})
        try:
            out = orig(self, batch, metrics)
        finally:
            for key in (GROUPS_KEY, WEIGHT_KEY, FORM_KEY):
                batch.extra_info.pop(key, None)
        if groups and not any(k.endswith("agentcredit_evoke/loss") for k in metrics):
            raise RuntimeError(f"algorithm.{CONFIG_KEY}: the actor returned no agentcredit_evoke metrics, so it did "
                               f"not add the term; the evoke term runs in verl's FSDP engine workers only (actor "
                               f"strategy fsdp/fsdp2, not megatron)")
        metrics.update({"agentcredit_evoke/states": float(states), "agentcredit_evoke/groups": float(len(groups)),
                        "agentcredit_evoke/weight": float(w)})
        return out

    return _update_actor


def _patch_trainer(module) -> None:
    cls = module.PPOTrainer
    cls._update_actor = wrap_update_actor(cls._update_actor)


# ---- worker ---------------------------------------------------------------------------------------------------------
def _nt(data, key: str, default: Any = None) -> Any:
    from verl.utils import tensordict_utils as tu

    return tu.get_non_tensor_data(data=data, key=key, default=default)


def share_of(groups: Sequence[Any], rank: int, world: int) -> list[Any]:
    """Rank ``rank``'s share of ``groups`` among ``world`` data-parallel ranks: every ``world``-th from ``rank``."""
    return list(groups[rank::world])


def share_scale(weight: float, world: int, share: int, total: int) -> float:
    """The factor on a rank's mean loss over its ``share`` groups so that the average over ``world`` ranks' gradients
    (verl's data-parallel reduction) is ``weight`` times the mean over all ``total`` groups: ``weight * world *
    share / total`` (0 for an empty share or no groups)."""
    return float(weight) * world * share / total if share and total else 0.0


def _stack(parts: Sequence[tuple[list, list, list]]):
    """The gathered ranks' ``(scores, values, mask)`` (as lists) stacked into ``[G, A]`` tensors, widths padded
    (None when no rank had a group)."""
    import torch

    rows = [(s, v, m) for part in parts for s, v, m in zip(*part)]
    if not rows:
        return None
    width = max(len(s) for s, _, _ in rows)
    scores = torch.zeros(len(rows), width, dtype=torch.float64)
    values = torch.zeros(len(rows), width, dtype=torch.float64)
    mask = torch.zeros(len(rows), width, dtype=torch.bool)
    for j, (s, v, m) in enumerate(rows):
        scores[j, :len(s)], values[j, :len(v)], mask[j, :len(m)] = (torch.tensor(s, dtype=torch.float64),
                                                                    torch.tensor(v, dtype=torch.float64),
                                                                    torch.tensor(m, dtype=torch.bool))
    return scores, values, mask


def evoke_term(engine, micro_batch, groups: list[dict[str, Any]], weight: float, form: str):
    """``(loss to add, metrics)`` of this rank on the mini-batch's first micro-batch (module docstring)."""
    import contextlib

    import torch
    import torch.distributed as dist

    pg = engine.get_data_parallel_group()
    world = int(engine.get_data_parallel_size())
    rank = int(engine.get_data_parallel_rank())
    share = share_of(groups, rank, world)
    batch = share or groups[:1]  # no share: the first group, weight 0, so that every rank runs the forward
    ids, att, amask = candidate_batch(batch, 0)
    device = next(engine.module.parameters()).device  # the engine's device (cpu in the CPU runs)
    ids, att = ids.to(device), att.to(device)
    pos = (att.cumsum(1) - 1).clamp_min(0)
    dtype = getattr(engine, "_autocast_dtype", torch.bfloat16)
    autocast = (contextlib.nullcontext() if dtype == torch.float32
                else torch.autocast(device_type=device.type, dtype=dtype))
    n = amask.size(1)
    temperature = float(_nt(micro_batch, "temperature", 1.0) or 1.0)
    with autocast:
        logits = engine.module(input_ids=ids, attention_mask=att, position_ids=pos, use_cache=False).logits
    logits = logits[:, -n - 1:-1].float() / temperature
    logps = torch.log_softmax(logits, -1).gather(-1, ids[:, -n:, None]).squeeze(-1)
    scores, values, mask = group_scores(logps, amask, batch)
    term = evoke_loss(scores, values, mask, form=form)
    scale = share_scale(weight, world, len(share), len(groups))
    mine = ([], [], []) if not share else (scores.detach().double().cpu().tolist(), values.cpu().tolist(),
                                           mask.cpu().tolist())
    parts = [mine]
    if world > 1 and dist.is_available() and dist.is_initialized():
        parts = [None] * world
        dist.all_gather_object(parts, mine, group=pg)
    gathered = _stack(parts)
    if gathered is None:  # only without a process group (a single process told it has several ranks)
        return term * scale, {"loss": math.nan, "rank_acc": math.nan, "top1_acc": math.nan, "groups": 0.0}
    s, v, m = gathered
    metrics = dict(ranking_accuracy(s, v, m), loss=float(evoke_loss(s, v, m, form=form)))
    return term * scale, metrics


@wraps_once("evoke", "FSDPEngine.forward_backward_batch(self, data, loss_function, forward_only)",
            ("self", "data", "loss_function", "forward_only"))
def wrap_forward_backward_batch(orig):
    def forward_backward_batch(self, data, loss_function, forward_only=False):
        self._agentcredit_evoke_pending = not forward_only and _nt(data, GROUPS_KEY) is not None
        try:
            return orig(self, data, loss_function, forward_only)
        finally:
            self._agentcredit_evoke_pending = False

    return forward_backward_batch


@wraps_once("evoke", "FSDPEngineWithLMHead.forward_step(self, micro_batch, loss_function, forward_only)",
            ("self", "micro_batch", "loss_function", "forward_only"))
def wrap_forward_step(orig):
    def forward_step(self, micro_batch, loss_function, forward_only):
        loss, output = orig(self, micro_batch, loss_function, forward_only)
        if forward_only or not getattr(self, "_agentcredit_evoke_pending", False):
            return loss, output
        self._agentcredit_evoke_pending = False  # the mini-batch's first micro-batch, on every rank
        groups = json.loads(_nt(micro_batch, GROUPS_KEY) or "[]")
        if not groups:
            return loss, output
        from verl.utils.metric import AggregationType, Metric

        extra, stats = evoke_term(self, micro_batch, groups, float(_nt(micro_batch, WEIGHT_KEY, 0.0) or 0.0),
                                  str(_nt(micro_batch, FORM_KEY, "listwise")))
        if isinstance(output.get("metrics"), dict):
            for key in ("loss", "rank_acc", "top1_acc"):
                if not math.isnan(stats[key]):
                    output["metrics"][f"agentcredit_evoke/{key}"] = Metric(value=stats[key],
                                                                           aggregation=AggregationType.MEAN)
        return loss + extra.to(loss.device, loss.dtype), output

    return forward_step


def _patch_engine(module) -> None:
    module.FSDPEngine.forward_backward_batch = wrap_forward_backward_batch(module.FSDPEngine.forward_backward_batch)
    module.FSDPEngineWithLMHead.forward_step = wrap_forward_step(module.FSDPEngineWithLMHead.forward_step)


TARGETS = {"verl.trainer.ppo.v1.trainer_base": _patch_trainer,
           "verl.workers.engine.fsdp.transformer_impl": _patch_engine}


def install() -> None:
    """Register the post-import hooks (they run at once for modules already imported)."""
    install_post_import_hooks(TARGETS, "the evoke term is not applied on verl")
