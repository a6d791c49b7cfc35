"""EVOKE on verl 0.9.1: the goal-ranking term (:mod:`distill_plugins.evoke`) added to the actor's RL loss,
configured by ``+algorithm.agentcredit_evoke={weight: 0.1, goals: 2, states: 4}`` (the term's parameters,
``agentcredit describe evoke``). Needs the env loop ``agentcredit_env`` on an env with ``goal_rankings(k, rng)``
(synthetic; minigrid task ``goal``).

Three places, each where the data lives (docs/methods/terms/evoke.md, "verl", has the details and the choices):

* **agent loop** (:mod:`agentcredit.verl.agent_loop`): at every training turn, while the policy generates, the env's
  solver ranks the legal actions under ``goals`` alternative goals (:func:`rank_goals` on the env executor; goals
  drawn from a stream seeded by the term's ``seed``, the dataset row, the session, the step and the turn, so a rerun
  draws the same); each ranking becomes the turn's prompt rewritten under that goal plus one candidate answer
  ``<action>a</action>`` per legal action (:func:`turn_groups`), in the row's ``extra_fields`` as :data:`FIELD`
  (``[]`` on validation turns and turns without a ranking; every row carries the key, as verl's batch balancing
  needs);
* **driver**, ``PPOTrainer._update_actor``: :func:`round_groups` checks the groups and samples ``states`` of the
  step's ranked rows (never a padding row; in an order that does not depend on the rows' order) from ``seed`` and
  the global step (stateless: nothing to checkpoint), and hands them with ``w_k`` (:func:`weight_at` at trainer step
  ``global_steps - 1``) and the loss form to the actor through ``batch.extra_info``;
* **worker**, ``FSDPEngineWithLMHead``: before verl's step on the first micro-batch of every training mini-batch (one
  optimizer step), each data-parallel rank runs :func:`apply_evoke_term` on its share of the groups
  (``groups[rank::dp]``, in chunks of at most verl's micro-batch size, :func:`plan_chunks`): a forward and a
  backward of ``w_k * dp * |chunk| / |groups| * L_EVOKE(chunk)`` each, so that verl's gradient average over ranks
  adds ``w_k * grad L_EVOKE`` over all groups. Every rank runs as many chunks as the longest plan (empty ones with
  factor 0), so the sharded model never waits for a rank that skipped a forward.

Logged: ``agentcredit_evoke/{states,groups,weight}`` (driver) and ``actor/agentcredit_evoke/{loss,rank_acc,
top1_acc}`` (worker, mean over the step's mini-batches). Refused when the driver starts: the legacy trainer, fused
kernels, Ulysses sequence parallelism; other actor engines than FSDP (Megatron, ...) at the first step, when the
actor reports no term.
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

__all__ = ["CONFIG_KEY", "FIELD", "evoke_params", "check_config", "goal_seed", "rank_goals", "goal_error",
           "turn_groups", "check_group", "round_groups", "share_of", "share_scale", "group_tokens", "plan_chunks",
           "token_budget", "chunk_scores", "apply_evoke_term", "install"]

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
    """Preflight (the driver, before Ray): the block's parameters, the v1 trainer, no fused kernels (the term needs
    the logits) and no Ulysses sequence parallelism (the extra forward runs whole sequences on each rank)."""
    algorithm = config.get("algorithm", None) if hasattr(config, "get") else None
    if evoke_params(algorithm) is None:
        return
    actor = ((config.get("actor_rollout_ref", None) or {}).get("actor", None) or {})
    sp = max(int(actor.get("ulysses_sequence_parallel_size", 1) or 1),
             int((actor.get("fsdp_config", None) or {}).get("ulysses_sequence_parallel_size", 1) or 1))
    if not bool((config.get("trainer", None) or {}).get("use_v1", True)):
        raise ValueError(f"algorithm.{CONFIG_KEY}: the evoke term is wired into verl's v1 trainer; set "
                         f"trainer.use_v1=true or drop algorithm.{CONFIG_KEY}")
    model = ((config.get("actor_rollout_ref", None) or {}).get("model", None) or {})
    if bool(model.get("use_fused_kernels", False)):
        raise ValueError(f"algorithm.{CONFIG_KEY}: the evoke term scores candidates from the actor's logits, which "
                         f"verl's fused kernels do not return; set actor_rollout_ref.model.use_fused_kernels=false or "
                         f"drop algorithm.{CONFIG_KEY}")
    if sp > 1:
        raise ValueError(f"algorithm.{CONFIG_KEY}: the evoke term scores whole candidate sequences on each rank and "
                         f"does not support Ulysses sequence parallelism (ulysses_sequence_parallel_size={sp}); set "
                         f"it to 1 or drop algorithm.{CONFIG_KEY}")


# ---- agent loop -----------------------------------------------------------------------------------------------------
def goal_seed(seed: int, row: Any, session: Any, step: Any, turn: int) -> int:
    """The goal-draw seed of one turn: stable across processes and reruns (never Python's salted ``hash``)."""
    return stable_hash(f"agentcredit-evoke|{int(seed)}|{row}|{session}|{step}|{int(turn)}") % (2**31 - 1)


def rank_goals(env, goals: int, seed: int) -> tuple[list, str | None]:
    """At the env's current state (runs where the env lives): ``(env.goal_rankings(goals, random.Random(seed)),
    None)``, or ``([], why)`` when the env cannot rank (no ``goal_rankings``, or it refuses, e.g. MiniGrid's DoorKey).
    It returns instead of raising: an exception inside the env executor would count as an env fault and break the
    episode's env, while this is a configuration error that the loop raises (:func:`goal_error`)."""
    if not callable(getattr(env, "goal_rankings", None)):
        return [], (f"the env {type(env).__name__} has no goal_rankings(k, rng) (built in: synthetic, minigrid with "
                    f"task 'goal')")
    try:
        return list(env.goal_rankings(int(goals), random.Random(int(seed)))), None
    except ValueError as e:
        return [], f"{type(env).__name__}.goal_rankings refused: {e}"


def goal_error(why: str) -> ValueError:
    """The configuration error of an env that cannot rank goals under ``algorithm.agentcredit_evoke``."""
    return ValueError(f"algorithm.{CONFIG_KEY}: {why}; EVOKE needs an env that ranks the legal actions under "
                      f"alternative goals, or drop algorithm.{CONFIG_KEY}")


def turn_groups(tokenizer, prompt_ids: Sequence[int], rankings: Sequence[Any]) -> list[dict[str, Any]]:
    """One group per ranking: the turn's prompt rewritten under its goal (``GoalRanking.rewrite`` of the decoded
    prompt, re-encoded), one candidate answer ``<action>a</action>`` per legal action, and the solver's values."""
    text = tokenizer.decode(list(prompt_ids), skip_special_tokens=False)
    return [{"prompt": tokenizer.encode(r.rewrite(text), add_special_tokens=False),
             "answers": [tokenizer.encode(ANSWER.format(a), add_special_tokens=False) for a in r.actions],
             "values": [float(v) for v in r.values]} for r in rankings]


# ---- driver ---------------------------------------------------------------------------------------------------------
def check_group(group: Any, where: str) -> dict[str, Any]:
    """One group as plain lists, checked on the driver (where every rank would see the same error, instead of one
    rank failing inside the sharded forward while the others wait): a non-empty prompt, at least two non-empty
    answers, one finite value per answer."""
    try:
        prompt = [int(x) for x in group["prompt"]]
        answers = [[int(x) for x in a] for a in group["answers"]]
        values = [float(v) for v in group["values"]]
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{where}: a group must be {{'prompt': ids, 'answers': [ids, ...], 'values': [...]}} "
                         f"(agentcredit.verl.evoke.turn_groups writes it); got {str(group)[:120]!r} ({e})") from e
    if not prompt or len(answers) < 2 or not all(answers) or len(values) != len(answers):
        raise ValueError(f"{where}: a group needs a non-empty prompt, >= 2 non-empty answers and one value per "
                         f"answer; got {len(prompt)} prompt tokens, answers of lengths {[len(a) for a in answers]} "
                         f"and {len(values)} values")
    if not all(math.isfinite(v) for v in values):
        raise ValueError(f"{where}: the solver's values {values} hold NaN/inf; goal_rankings must return finite "
                         f"Q* values")
    return {"prompt": prompt, "answers": answers, "values": values}


def round_groups(rows: Sequence[Mapping[str, Any] | None], padding: Sequence[bool], states: int, seed: int, step: int
                 ) -> tuple[list[dict[str, Any]], int]:
    """``(groups, sampled states)`` of one training step: ``states`` rows drawn without replacement (a
    ``random.Random`` of ``seed`` and ``step``) among the non-padding rows whose :data:`FIELD` holds groups, taken
    in the order of their groups' content (a stable hash; the rows' own order follows the rollouts' completion and
    verl's batch balancing), their groups checked (:func:`check_group`), those whose values all tie left out.
    Rows without the field at all are a ``ValueError``: the run's agent loop does not write it."""
    if rows and not all(r is not None and FIELD in r for r in rows):
        raise ValueError(f"algorithm.{CONFIG_KEY}: the rows carry no extra_fields {FIELD!r}; the evoke term needs the "
                         f"env loop agentcredit_env (actor_rollout_ref.rollout.agent.default_agent_loop="
                         f"agentcredit_env), which writes it when algorithm.{CONFIG_KEY} is set")
    checked = {i: [check_group(g, f"algorithm.{CONFIG_KEY}: row {i}'s {FIELD}") for g in rows[i][FIELD]]
               for i, r in enumerate(rows) if not padding[i] and r[FIELD]}
    order = sorted(checked, key=lambda i: (stable_hash(json.dumps(checked[i], sort_keys=True)), i))
    chosen = random.Random(int(seed) * 1_000_003 + int(step)).sample(order, min(int(states), len(order)))
    groups = [g for i in chosen for g in checked[i]]
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
    """The factor on a rank's mean loss over ``share`` groups so that the average over ``world`` ranks' gradients
    (verl's data-parallel reduction) is ``weight`` times the mean over all ``total`` groups: ``weight * world *
    share / total`` (0 for an empty share or no groups)."""
    return float(weight) * world * share / total if share and total else 0.0


def group_tokens(group: Mapping[str, Any]) -> int:
    """The tokens one group puts through the forward: its candidates, each the prompt and the longest answer."""
    return len(group["answers"]) * (len(group["prompt"]) + max(len(a) for a in group["answers"]))


def plan_chunks(groups: Sequence[Mapping[str, Any]], world: int, budget: int) -> list[list[list[int]]]:
    """Per rank, its share of ``groups`` (indices, :func:`share_of`) cut into consecutive chunks of at most
    ``budget`` tokens (:func:`group_tokens`; a group over the budget is a chunk alone), every rank's list padded with
    empty chunks to the longest: each rank then runs the same number of forwards and backwards, as the sharded
    model needs. Every rank computes the same plan from the same groups, without communication."""
    plans = []
    for rank in range(world):
        chunks: list[list[int]] = []
        used = 0
        for i in range(rank, len(groups), world):
            cost = group_tokens(groups[i])
            if not chunks or used + cost > budget:
                chunks.append([])
                used = 0
            chunks[-1].append(i)
            used += cost
        plans.append(chunks)
    n = max((len(c) for c in plans), default=0)
    return [c + [[] for _ in range(n - len(c))] for c in plans]


#: the token budget of one extra forward when verl gives none (fixed micro-batch sizes and no length to copy)
DEFAULT_TOKEN_BUDGET = 8192


def token_budget(micro_batch, groups: Sequence[Mapping[str, Any]]) -> int:
    """The most tokens one extra forward may take: verl's own ``max_token_len_per_gpu`` under dynamic batch sizes,
    else ``micro_batch_size_per_gpu`` candidates of the longest group's length (never more rows than verl's own
    micro-batch), else :data:`DEFAULT_TOKEN_BUDGET`."""
    if _nt(micro_batch, "use_dynamic_bsz", False) and _nt(micro_batch, "max_token_len_per_gpu") is not None:
        return int(_nt(micro_batch, "max_token_len_per_gpu"))
    rows = _nt(micro_batch, "micro_batch_size_per_gpu")
    if rows and groups:
        return int(rows) * max(len(g["prompt"]) + max(len(a) for a in g["answers"]) for g in groups)
    return DEFAULT_TOKEN_BUDGET


def chunk_scores(engine, groups: list[dict[str, Any]], device, temperature: float):
    """``[G, A]`` candidate scores (with gradient), values and mask of ``groups`` under the engine's module: one
    forward of their candidates (prompt left-padded, position ids from the attention mask, the engine's autocast
    dtype), logits kept for the answer positions only, divided by the rollout temperature."""
    import contextlib

    import torch

    ids, att, amask = candidate_batch(groups, 0)
    ids, att = ids.to(device), att.to(device)
    pos = (att.cumsum(1) - 1).clamp_min(0)
    dtype = getattr(engine, "_autocast_dtype", torch.bfloat16)
    autocast = (contextlib.nullcontext() if dtype == torch.float32
                else torch.autocast(device_type=device.type, dtype=dtype))
    n = amask.size(1)
    with autocast:
        out = engine.module(input_ids=ids, attention_mask=att, position_ids=pos, use_cache=False,
                            logits_to_keep=n + 1)
    logits = out.logits[:, :-1].float() / temperature
    logps = torch.log_softmax(logits, -1).gather(-1, ids[:, -n:, None].to(logits.device)).squeeze(-1)
    return group_scores(logps, amask, groups)


def apply_evoke_term(engine, micro_batch, groups: list[dict[str, Any]], weight: float, form: str, device
                     ) -> dict[str, float]:
    """Run the term of one mini-batch on this rank: for each chunk of :func:`plan_chunks` (the same count on every
    rank; an empty chunk scores a copy of the first group with factor 0), one forward and one backward of
    ``share_scale(weight, dp, |chunk|, |groups|) * L_EVOKE(chunk)`` (through the engine's grad scaler when it has
    one), so the gradients of all ranks' chunks average to ``weight * grad L_EVOKE`` over all groups. Returns the
    round's metrics from all ranks' detached scores (all-gathered)."""
    import torch
    import torch.distributed as dist

    world = int(engine.get_data_parallel_size())
    rank = int(engine.get_data_parallel_rank())
    temperature = float(_nt(micro_batch, "temperature", 1.0) or 1.0)
    scaler = getattr(engine, "scaler", None)
    mine: tuple[list, list, list] = ([], [], [])
    for chunk in plan_chunks(groups, world, token_budget(micro_batch, groups))[rank]:
        batch = [groups[i] for i in chunk] or groups[:1]
        with torch.set_grad_enabled(weight != 0.0):  # weight 0 (e.g. a warmup's first step): the metrics only
            scores, values, mask = chunk_scores(engine, batch, device, temperature)
            term = evoke_loss(scores, values, mask, form=form) * share_scale(weight, world, len(chunk), len(groups))
        if weight != 0.0:  # the same on every rank: each runs as many backwards as forwards
            (scaler.scale(term) if scaler is not None else term).backward()
        if chunk:
            for part, x in zip(mine, (scores.detach().double(), values, mask)):
                part.extend(x.cpu().tolist())
    parts = [mine]
    if world > 1 and dist.is_available() and dist.is_initialized():
        parts = [None] * world
        dist.all_gather_object(parts, mine, group=engine.get_data_parallel_group())
    gathered = _stack(parts)
    if gathered is None:  # only without a process group (a single process told it has several ranks)
        return {"loss": math.nan, "rank_acc": math.nan, "top1_acc": math.nan, "groups": 0.0}
    s, v, m = gathered
    return dict(ranking_accuracy(s, v, m), loss=float(evoke_loss(s, v, m, form=form)))


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


def engine_device():
    """The device verl's ``forward_step`` moves each micro-batch to (``get_device_id()`` of verl's platform; the
    inputs' device also when FSDP2 offloads the parameters to the CPU)."""
    import torch
    from verl.utils.device import get_device_id, get_device_name

    name = get_device_name()
    return torch.device("cpu") if name == "cpu" else torch.device(name, int(get_device_id()))


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
        if forward_only or not getattr(self, "_agentcredit_evoke_pending", False):
            return orig(self, micro_batch, loss_function, forward_only)
        self._agentcredit_evoke_pending = False  # the mini-batch's first micro-batch, on every rank
        groups = json.loads(_nt(micro_batch, GROUPS_KEY) or "[]")
        if not groups:
            return orig(self, micro_batch, loss_function, forward_only)
        # the term's own forwards and backwards first (its gradients accumulate with verl's), then verl's step
        stats = apply_evoke_term(self, micro_batch, groups, float(_nt(micro_batch, WEIGHT_KEY, 0.0) or 0.0),
                                 str(_nt(micro_batch, FORM_KEY, "listwise")), engine_device())
        loss, output = orig(self, micro_batch, loss_function, forward_only)
        if isinstance(output.get("metrics"), dict):
            from verl.utils.metric import AggregationType, Metric

            for key in ("loss", "rank_acc", "top1_acc"):
                if not math.isnan(stats[key]):
                    output["metrics"][f"agentcredit_evoke/{key}"] = Metric(value=stats[key],
                                                                           aggregation=AggregationType.MEAN)
        return loss, output

    return forward_step


def _patch_engine(module) -> None:
    module.FSDPEngine.forward_backward_batch = wrap_forward_backward_batch(module.FSDPEngine.forward_backward_batch)
    module.FSDPEngineWithLMHead.forward_step = wrap_forward_step(module.FSDPEngineWithLMHead.forward_step)


TARGETS = {"verl.trainer.ppo.v1.trainer_base": _patch_trainer,
           "verl.workers.engine.fsdp.transformer_impl": _patch_engine}


def install() -> None:
    """Register the post-import hooks (they run at once for modules already imported)."""
    install_post_import_hooks(TARGETS, "the evoke term is not applied on verl")
