"""verl agent loop that plays an ``env_adapters`` environment and emits one row per env step (verl 0.9.1, v1 trainer).

:class:`EnvAgentLoop` is known to verl's agent-loop registry as ``agentcredit_env`` once :mod:`agentcredit.verl.loops`
(the one module that registers agentcredit's agent loops) is imported; importing this module registers nothing.
``import env_adapters`` does not import it (nor verl).

Selecting it in verl (v1 trainer, ``trainer.use_v1=True``, verl's default)
-------------------------------------------------------------------------
Either through an agent-loop config file (no import needed: verl's ``AgentLoopWorker`` puts each entry in the
registry and hydra imports the ``_target_``; the extra keys become the constructor options below)::

    actor_rollout_ref.rollout.agent.agent_loop_config_path=agentcredit_env.yaml
    actor_rollout_ref.rollout.agent.default_agent_loop=agentcredit_env       # or a dataset column agent_name
    # agentcredit_env.yaml:
    # - name: agentcredit_env
    #   _target_: agentcredit.verl.agent_loop.EnvAgentLoop
    #   env_name: minigrid
    #   env_options: {size: 5}
    #   max_steps: 8
    #   history_length: 2
    #   context: transcript                # or memory (CCM, below)

or by name with the default options: the ``verl.plugins`` entry point :mod:`agentcredit.verl` imports
:mod:`agentcredit.verl.loops` as soon as verl's agent-loop module is imported (``VERL_USE_EXTERNAL_MODULES=agentcredit.verl.loops``
does the same where entry points are not installed, e.g. Ray ``py_modules``)::

    actor_rollout_ref.rollout.agent.default_agent_loop=agentcredit_env

The legacy trainer (``trainer.use_v1=False``) is not supported: its ``AgentLoopWorker`` takes one output per
trajectory, and this loop returns a list.

Per-sample dataset fields (top-level columns; each may also sit in the ``extra_info`` dict, verl's RLHFDataset
convention; a top-level column wins). All ``rollout.n`` sessions of a prompt get the same fields, so they start
from the same state (one GiGPO group):

==================  ==========  =============================================================================
field               type        meaning (default)
==================  ==========  =============================================================================
``env_name``        str         registered environment, ``env_adapters.make(env_name, **env_options)``
                                (the loop's ``env_name`` option, default ``"minigrid"``)
``env_options``     dict        options of the environment factory, merged over the loop's ``env_options``
``seed``            int         reset seed of the episode (None: the env's own default)
``max_steps``       int         step limit of this episode (the loop's ``max_steps``, default 8)
``raw_prompt``      list        verl's chat messages; only its ``system`` messages are used (prepended to every
                                turn); verl's post-processing requires the field anyway
==================  ==========  =============================================================================

What one episode returns
------------------------
``run`` returns ``list[AgentLoopOutput]``, **one per env step** t = 0..T-1. Output t has the prompt of turn t
(``build_prompt`` of the current observation with the last ``history_length`` steps, tokenized with the tokenizer's
chat template through verl's Continuous Token builder, exactly as ``SingleTurnAgentLoop`` does), the model's
response tokens with ``response_mask`` 1 (at most ``rollout.response_length``), and
``extra_fields`` with the :mod:`agentcredit.verl.contract` keys::

    step_idx     t
    anchor_key   env.state_key() before the action
    action_key   env.action_key(parsed action) (None: no parseable / admissible action)
    step_reward  r_t of env.step (success reward, invalid-action penalty, optional shaping)
    success      the episode ended in success (same on every row of the episode)
    truncated    the episode hit max_steps without a terminal state (same on every row)
    valid        the action was admissible (bool)
    by_teacher   Guided-OPD's teacher wrote this turn (bool; its response_mask is all 0; agentcredit.verl.guided)
    teacher_tokens  the tokens the teacher generated for that turn (0 on the policy's turns)
    signature    MVPO's viability signature: ``anchor_key|d<3 * (t // 3)>`` (the state and its depth bin)
    env_error / env_error_detail / env_fault_row   the env fault of the episode (see below; "" / "" / False)
    min_global_steps / max_global_steps   the rollout server's weight versions (None when it reports none)
    reward_extra_info   {"success": 0/1, "episode_return": sum r_t, "episode_steps": T}
    evoke_groups  only with algorithm.agentcredit_evoke: the turn's goal-ranking groups (agentcredit.verl.evoke)

Env work and faults
-------------------
The loop never calls the env on verl's event loop (all the worker's sessions share it): every env call goes through
:attr:`EnvAgentLoop.envs`, the worker process's :class:`env_adapters.executor.EnvExecutor` for the loop options
``env_backend`` (``thread`` | ``process`` | ``ray``), ``env_workers`` (pool threads, 128), ``env_timeout_s`` (per call,
120), ``env_start_timeout_s`` (per build, 600), ``env_reuse`` (reset a released env for the next session of the same
env and options, default true) and ``env_backend_options``. A turn costs two env round trips around its generation:
the view (state key, legal actions, task), and one call that computes the action key and the decision-state extras,
then steps (:mod:`env_adapters.turns`). An :class:`~env_adapters.executor.EnvFault` (the env raised, hung past its
timeout, or its process / actor died) ends the episode: its rows so far are kept with their rewards, every row gets
``truncated`` true, ``success`` false, ``env_error`` (the kind) and ``env_error_detail`` (env, seed, call and
traceback); the turn whose env call faulted is not recorded. An episode whose env failed before its first turn
returns one placeholder row (``env_fault_row`` true, response_mask 0) so the session is never silently missing; the
credit bridge drops it like padding. Configuration errors (an unknown env or option) are not faults: they raise.

Every row carries the same keys (verl's batch balancing copies the first row's ``extra_fields`` into its padding
rows, and the credit bridge requires a contract key on all rows or none). ``reward_score`` of the final output is
the **episode return** ``sum_t r_t`` (so an outcome estimator such as verl's ``grpo``, which reads the final row's
score, and a step-level one, which reads ``step_reward``, see the same total); verl's ``AgentLoopWorkerTQ`` copies
it to the earlier outputs. Rows are stored under ``{uid}_{session_id}_{t}``.

CCM's memory context (``context: memory``; spec distill §9, :mod:`env_adapters.memory_context`): each prompt holds
only the task, the retained memory and the newest observation (``MemoryTrack.student_prompt``, never the transcript;
``history_length`` is not used), and the assistant reply is pre-filled with ``<memory>`` (those tokens end the prompt,
so they are not trained); the model writes ``notes</memory><action>a</action>``. A malformed memory block keeps the
previous memory and adds the invalid penalty (-0.1) to ``step_reward``; the action is still played. As in the TRL
memory rollout (:mod:`agentcredit.trl.ccm`). Each row then also carries ``memory_malformed`` (bool), ``prompt_tokens``
(its prompt's length) and ``full_prompt_tokens`` (the length the full-history prompt of the same turn would have,
counted with the tokenizer's chat template and never capped), from which the credit bridge logs
``agentcredit/ccm_input_saving`` (``1 - sum prompt_tokens / sum full_prompt_tokens``), and what CCM's privileged
distillation reads (:mod:`agentcredit.verl.ccm`): ``ccm_teacher_prompt_ids`` (the full-history prompt of the turn,
observations and actions and never memories, ending with ``<action>``) and ``ccm_action_start`` (the index of the
first action token in the response; -1 when the turn is not eligible: malformed memory or no admissible action).

Not supported: multimodal observations, rollout tracing (``rollout_trace_op``). (verl 0.9.1 computes distillation
teacher log-probs for a loop's final output only; :mod:`agentcredit.verl.distill` scores every row.)
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from typing import Any
from uuid import uuid4

from verl.experimental.agent_loop.agent_loop import AgentLoopBase, AgentLoopMetrics, AgentLoopOutput
from verl.utils.profiler import simple_timer

from credit_plugins import registry
from credit_plugins.estimators.mvpo import default_signature
from credit_plugins.hashing import stable_hash
from env_adapters import turns
from env_adapters.executor import EnvFault, shared_executor
from env_adapters.memory_context import ACTION_OPEN, MEMORY_OPEN, MemoryTrack, action_start
from env_adapters.prompting import build_prompt, parse_action

from .contract import ENV_ERROR, ENV_ERROR_DETAIL, FAULT_ROW
from .evoke import FIELD as EVOKE_FIELD
from .evoke import evoke_params, goal_error, goal_seed, rank_goals, turn_groups
from .guided import WORKER, teacher_sampling_params, turn_guide
from .loop_common import SERVER_KEYS, plain, sample_field

__all__ = ["EnvAgentLoop", "AGENT_NAME", "SAMPLE_FIELDS"]

logger = logging.getLogger("agentcredit")

AGENT_NAME = "agentcredit_env"
#: dataset fields the loop reads (top level, or inside ``extra_info``)
SAMPLE_FIELDS = ("env_name", "env_options", "seed", "max_steps")

def step_signature(anchor: str, t: int, width: int = 3) -> str:
    """MVPO's per-step ``signature`` (App. A.3) when the env has no coarser parser: the canonical state and the
    depth bin ``width * (t // width)``, e.g. ``"<state>|d3"`` (:func:`credit_plugins.estimators.mvpo.default_signature`,
    shared with the TRL bridge)."""
    return default_signature(anchor, t, width)


def _policy_versions(steps: list[dict[str, Any]], kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """The weight versions (``min/max_global_steps``) of a Guided-OPD teacher turn or an env-fault placeholder: no
    policy server reported them, and verl's step metrics need one on every row. The policy turns' of the episode
    (min and max over them); with none, ``global_steps - 1`` (what a synchronous policy server reports while rolling out step ``global_steps``:
    the trainer pushes version k at the end of step k)."""
    own = [s["server_extra"] for s in steps if not s["extra"].get("by_teacher")]
    lo = [int(x["min_global_steps"]) for x in own if x.get("min_global_steps") is not None]
    hi = [int(x["max_global_steps"]) for x in own if x.get("max_global_steps") is not None]
    step = max(int(kwargs.get("global_steps", 1) or 1) - 1, 0)  # the weights of step k - 1 roll out step k
    return {"min_global_steps": min(lo) if lo else step, "max_global_steps": max(hi) if hi else step}


def fault_fields(fault: EnvFault | None) -> dict[str, str]:
    """The ``env_error`` / ``env_error_detail`` fields of a row: the fault's kind and its summary and traceback ("" and
    "" without a fault)."""
    if fault is None:
        return {ENV_ERROR: "", ENV_ERROR_DETAIL: ""}
    return {ENV_ERROR: fault.kind, ENV_ERROR_DETAIL: f"{fault.summary()}\n{fault.detail}"}


class EnvAgentLoop(AgentLoopBase):
    """Plays one ``env_adapters`` episode per rollout; one ``AgentLoopOutput`` per step.

    Args (besides verl's ``AgentLoopBase`` ones; set them in the agent-loop config file):
        env_name: environment used when a sample has no ``env_name`` field.
        env_options: factory options merged under a sample's ``env_options``.
        max_steps: step limit when a sample has no ``max_steps`` field.
        history_length: past (observation, action) steps shown in each prompt.
        descriptors: attach the ``descriptor`` extra field of every step (TJPO; :mod:`env_adapters.descriptors`).
        context: ``"transcript"`` (the last ``history_length`` steps in each prompt) or ``"memory"`` (CCM: task,
            retained memory and newest observation; see the module docstring).
        env_backend, env_workers, env_timeout_s, env_start_timeout_s, env_reuse, env_backend_options: the env
            executor (see the module docstring).
    """

    CONTEXTS = ("transcript", "memory")

    def __init__(self, *args, env_name: str = "minigrid", env_options: Mapping[str, Any] | None = None,
                 max_steps: int = 8, history_length: int = 2, descriptors: bool = False, context: str = "transcript",
                 env_backend: str = "thread", env_workers: int = 128, env_timeout_s: float | None = 120.0,
                 env_start_timeout_s: float | None = 600.0, env_reuse: bool = True,
                 env_backend_options: Mapping[str, Any] | None = None, **kwargs):
        if context not in self.CONTEXTS:
            raise ValueError(f"context={context!r}; use one of {list(self.CONTEXTS)} (memory: CCM's short memory "
                             f"instead of the transcript)")
        kwargs.pop("tools", None)  # verl passes its tool list to every loop; an env loop has no tools
        kwargs.pop("name", None)   # the 'name' key of an agent_loop_config_path entry
        super().__init__(*args, **kwargs)
        self.env_name = env_name
        self.env_options = dict(env_options or {})
        self.max_steps = int(max_steps)
        self.history_length = int(history_length)
        self.descriptors = bool(descriptors)  # TJPO's per-step ``descriptor`` extra field (env_adapters.descriptors)
        if self.max_steps < 1:
            raise ValueError(f"max_steps={self.max_steps}; an episode needs at least one step")
        self.context = context
        self.response_length = self.rollout_config.response_length
        # EVOKE (agentcredit.verl.evoke): each training turn also carries the env solver's goal rankings
        self.evoke = evoke_params(self.config.get("algorithm", None)) if hasattr(self.config, "get") else None
        if self.evoke is not None and context != "transcript":
            raise ValueError("algorithm.agentcredit_evoke ranks <action>...</action> answers after the turn's prompt; "
                             "it needs the loop's transcript context, not context: memory")
        if env_backend == "ray":
            from . import env_actors  # noqa: F401  (registers the ray backend)
        self.envs = shared_executor(backend=str(env_backend), workers=int(env_workers), timeout_s=env_timeout_s,
                                    start_timeout_s=env_start_timeout_s, reuse=bool(env_reuse),
                                    backend_options=dict(env_backend_options or {}))

    def env_spec(self, kwargs: Mapping[str, Any]) -> tuple[str, dict[str, Any]]:
        """The environment of one sample: ``(env_name, {**loop options, **env_options})``."""
        name = str(plain(sample_field(kwargs, "env_name", self.env_name)))
        options = dict(self.env_options)
        sample_options = sample_field(kwargs, "env_options", None)
        if sample_options is not None:
            if not isinstance(sample_options, Mapping):
                raise TypeError(f"dataset field env_options must be a dict, got {type(sample_options).__name__}")
            options.update({k: plain(v) for k, v in sample_options.items() if v is not None})
        # a configuration error fails the session loudly here; only what the env does later is a contained fault
        registry.get(name, kind="envs").check(options)
        return name, options

    async def _generate(self, prompt_ids: list[int], sampling_params: dict[str, Any], request_id: str,
                        priority: int = 0, server=None):
        """One model turn, called as ``SingleTurnAgentLoop`` calls verl's ``LLMServerClient.generate`` (``server``:
        another client of the same kind, e.g. Guided-OPD's teacher; default the policy's)."""
        return await (server or self.server_manager).generate(
            request_id=request_id,
            prompt_ids=prompt_ids,
            sampling_params=sampling_params,
            image_data=None,
            audio_data=None,
            video_data=None,
            mm_processor_output=None,
            mm_processor_kwargs=self._get_mm_processor_kwargs(None),
            priority=priority,
        )

    def step_extras(self) -> tuple[Callable, tuple] | None:
        """``(fn, args)``: extra ``extra_fields`` of each step, ``fn(env, action_text, *args)``, computed where the env
        lives at the decision state before it acts (None here; ``agentcredit.verl.search_loops.CounterfactualAgentLoop``
        adds ASCT's decision table). ``fn`` must be picklable (module level) for the process and ray backends."""
        return None

    def _filler_token(self) -> int:
        for tid in (self.tokenizer.eos_token_id, self.tokenizer.pad_token_id):
            if isinstance(tid, int):
                return tid
        return 0

    def session_request(self, sampling_params: dict[str, Any], priority: int,
                        kwargs: Mapping[str, Any]) -> tuple[str, dict[str, Any]]:
        """The request id of one session's turns and its sampling params. One id per episode, as ``ToolAgentLoop``
        does (a sticky server: the turns share the task prefix). With ``full_determinism`` the id and a per-request
        ``seed`` come from the dataset row, the session and the step (verl's server otherwise gives every request of
        a replica the same seed, so a group's sessions would come out identical), so a rerun samples alike."""
        if not getattr(self.rollout_config, "full_determinism", False):
            return uuid4().hex, sampling_params
        row = sample_field(kwargs, "index", kwargs.get("uid"))
        session = f"{plain(row)}|{kwargs.get('session_id')}|{kwargs.get('global_steps')}|{int(priority)}"
        seed = stable_hash(f"agentcredit-session|{session}") % (2**31 - 1)
        return f"det-{seed}", dict(sampling_params, seed=seed)

    async def _fault_row(self, system: list[dict], name: str, fault: EnvFault, logprobs: bool) -> dict[str, Any]:
        """The one row of an episode whose env failed before its first turn: a masked-out placeholder (no token is
        trained; the credit bridge drops it like padding), so the session still returns an output and the fault
        reaches the step metrics instead of silently shrinking the group."""
        prompt_ids = await self.ct_build_initial_tokens(system + [{"role": "user", "content": (
            f"(the {name} environment failed before the first turn: {fault.kind})")}])
        anchor = f"env_error|{name}"
        return dict(prompt_ids=prompt_ids, response_ids=[self._filler_token()], response_mask=[0],
                    response_logprobs=[0.0] if logprobs else None, metrics={}, server_extra={},
                    extra={"step_idx": 0, "anchor_key": anchor, "action_key": None, "step_reward": 0.0,
                           "valid": False, "by_teacher": False, "teacher_tokens": 0,
                           "signature": step_signature(anchor, 0),
                           FAULT_ROW: True})

    async def run(self, sampling_params: dict[str, Any], priority: int = 0, **kwargs) -> list[AgentLoopOutput]:
        name, options = self.env_spec(kwargs)
        seed = plain(sample_field(kwargs, "seed", None))
        seed = None if seed is None else int(seed)
        max_steps = int(plain(sample_field(kwargs, "max_steps", self.max_steps)))
        system = [dict(m) for m in (kwargs.get("raw_prompt") or []) if isinstance(m, Mapping)
                  and m.get("role") == "system"]
        request_id, sampling_params = self.session_request(sampling_params, priority, kwargs)
        extras = self.step_extras()
        steps: list[dict[str, Any]] = []
        done = success = False
        fault: EnvFault | None = None
        guide = turn_guide(self.config, kwargs)  # Guided-OPD (agentcredit.verl.guided), else None
        handle = None
        goal_task: asyncio.Future | None = None
        try:
            # every env call runs on the env executor (thread pool / process / actor), never on this event loop
            handle = await self.envs.acquire(name, options)
            observation, task = await handle.apply(turns.start, seed)
            history: list[tuple[str, str | None]] = []
            track = MemoryTrack(task=task) if self.context == "memory" else None
            for t in range(max_steps):
                view = await handle.apply(turns.observe)
                anchor, actions = view.state_key, view.legal
                ccm: dict[str, Any] = {}
                if track is None:
                    user = build_prompt(task, history, observation, actions, self.history_length)
                    prompt_ids = await self.ct_build_initial_tokens(system + [{"role": "user", "content": user}])
                else:  # CCM: task + memory + newest observation, the reply pre-filled with "<memory>"
                    prefill = self.tokenizer.encode(MEMORY_OPEN, add_special_tokens=False)
                    prompt_ids = self._cap_text_prompt_length(await self.ct_build_initial_tokens(
                        system + [{"role": "user", "content": track.student_prompt(observation, actions)}]) + prefill)
                    full = self.tokenizer.apply_chat_template(  # never sent to the rollout (and never capped)
                        system + [{"role": "user", "content": track.teacher_prompt(observation, actions)}],
                        add_generation_prompt=True, tokenize=False, **dict(self.apply_chat_template_kwargs or {}))
                    teacher_ids = self.tokenizer.encode(full + ACTION_OPEN, add_special_tokens=False)
                    ccm = {"prompt_tokens": len(prompt_ids),
                           "full_prompt_tokens": len(self.tokenizer.encode(full, add_special_tokens=False))
                           + len(prefill), "ccm_teacher_prompt_ids": teacher_ids}
                # EVOKE: the env ranks the goals while the policy generates (the env waits for the action anyway)
                goal_task = (asyncio.ensure_future(self._goal_groups(handle, prompt_ids, kwargs, t))
                             if self.evoke is not None else None)
                metrics: dict[str, Any] = {}
                by_teacher = guide is not None and guide.teacher_turn()  # Guided-OPD: the teacher writes this turn
                with simple_timer("generate_sequences", metrics):
                    if by_teacher:  # the policy's turn budget (the teacher's server alone allows one token)
                        params = teacher_sampling_params(sampling_params, self.rollout_config, len(prompt_ids))
                        out = await self._generate(prompt_ids, params, uuid4().hex, int(priority), server=guide.client)
                    else:
                        out = await self._generate(prompt_ids, sampling_params, request_id, int(priority))
                metrics["num_preempted"] = out.num_preempted if out.num_preempted is not None else -1
                merge, response_mask, response_logprobs = await self.ct_merge_assistant_token(
                    prompt_ids, out.token_ids, [], [] if out.log_probs else None,
                    assistant_logprobs=out.log_probs if out.log_probs else None)
                if by_teacher:  # guidance, not a training target: none of its tokens is trained
                    response_mask = [0] * len(response_mask)
                response_ids = merge.token_ids[-len(response_mask):] if response_mask else []
                prompt_ids = merge.token_ids[: len(merge.token_ids) - len(response_mask)]
                if not response_ids:  # an empty generation: one masked-out token, so verl's rm_scores[-1] exists
                    response_ids, response_mask = [self._filler_token()], [0]
                    response_logprobs = [0.0] if response_logprobs is not None else None
                # the action is parsed from what is trained on: the first response_length generated tokens
                text = self.tokenizer.decode(out.token_ids[: self.response_length], skip_special_tokens=True)
                if track is not None:
                    text = MEMORY_OPEN + text

                action_text = parse_action(text)
                if goal_task is not None:  # the rankings of this decision state, before the env acts
                    await goal_task
                # one round trip: the canonical action, the decision-state extras, then the step
                turn = await handle.apply(turns.act, action_text, *(extras or (None, ())),
                                          descriptors=self.descriptors)
                action_key, more, result = turn.action_key, dict(turn.extras), turn.result
                if goal_task is not None:
                    more[EVOKE_FIELD] = goal_task.result()
                penalty = 0.0
                if track is not None:  # the memory is updated from the observation it was given
                    mem = track.step(observation, text, action_key)
                    penalty = mem.penalty
                    start = (action_start(self.tokenizer, response_ids[: self.response_length])
                             if action_key is not None and not mem.malformed else -1)
                    more.update(ccm, memory_malformed=mem.malformed, ccm_action_start=start)
                steps.append(dict(
                    prompt_ids=prompt_ids, response_ids=response_ids[: self.response_length],
                    response_mask=response_mask[: self.response_length],
                    response_logprobs=response_logprobs[: self.response_length] if response_logprobs else None,
                    metrics=metrics, server_extra=dict(out.extra_fields or {}),
                    extra={"step_idx": t, "anchor_key": anchor, "action_key": action_key,
                           "step_reward": float(result.reward) + penalty, "valid": action_key is not None,
                           "by_teacher": by_teacher, "teacher_tokens": len(out.token_ids) if by_teacher else 0,
                           "signature": step_signature(anchor, t), FAULT_ROW: False,
                           **more}))
                history.append((observation, action_key))
                observation = result.observation
                if result.done:
                    done, success = True, bool(result.success)
                    break
        except EnvFault as exc:  # contained: the episode ends truncated and failed, with the turns it played
            fault, exc.seed = exc, seed
            if not steps:
                steps.append(await self._fault_row(system, name, fault, bool(sampling_params.get("logprobs"))))
        finally:
            if goal_task is not None:
                if not goal_task.done():  # the episode ended mid-turn: the env call ends (within the executor's
                    await asyncio.wait({goal_task})  # timeout) before the env can go to another session
                if not goal_task.cancelled():
                    goal_task.exception()  # retrieved: an error that another one preempted is not logged as lost
            if handle is not None:
                self.envs.release(handle)
        return self._outputs(steps, done, success, fault, kwargs)

    async def _goal_groups(self, handle, prompt_ids: list[int], kwargs: Mapping[str, Any], t: int) -> list:
        """EVOKE's groups of one training turn (:func:`agentcredit.verl.evoke.turn_groups`; ``[]`` when validating):
        the rankings on the env executor, the tokenization off the event loop."""
        if (WORKER.get() or {}).get("validate", False):
            return []
        seed = goal_seed(self.evoke.seed, plain(sample_field(kwargs, "index", kwargs.get("uid"))),
                         kwargs.get("session_id"), kwargs.get("global_steps"), t)
        rankings, why = await handle.apply(rank_goals, self.evoke.goals, seed)
        if why is not None:
            raise goal_error(why)
        if not rankings:
            return []
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(None, turn_groups, self.tokenizer, list(prompt_ids), rankings)

    def _outputs(self, steps: list[dict[str, Any]], done: bool, success: bool, fault: EnvFault | None,
                 kwargs: Mapping[str, Any]) -> list[AgentLoopOutput]:
        """One ``AgentLoopOutput`` per step, with the episode-level fields on every row (see the module doc)."""
        episode_return = float(sum(s["extra"]["step_reward"] for s in steps))
        reward_extra_info = {"success": float(success), "episode_return": episode_return,
                             "episode_steps": len(steps)}
        error = fault_fields(fault)
        outputs = []
        versions = _policy_versions(steps, kwargs)
        for i, s in enumerate(steps):
            extra = dict(s["extra"], success=success, truncated=not done,
                         reward_extra_info=dict(reward_extra_info), **error)
            if self.evoke is not None:  # every row carries the key (fault rows too): verl's balancing needs it
                extra.setdefault(EVOKE_FIELD, [])
            # a teacher turn and a fault placeholder have no policy server's versions: the episode's
            extra.update(versions if s["extra"].get("by_teacher") or s["extra"].get(FAULT_ROW) else
                         {k: s["server_extra"].get(k) for k in SERVER_KEYS})
            last = i == len(steps) - 1
            outputs.append(AgentLoopOutput(
                prompt_ids=s["prompt_ids"], response_ids=s["response_ids"], response_mask=s["response_mask"],
                response_logprobs=s["response_logprobs"], reward_score=episode_return if last else None,
                num_turns=2, metrics=AgentLoopMetrics(**s["metrics"]), extra_fields=extra))
        return outputs

