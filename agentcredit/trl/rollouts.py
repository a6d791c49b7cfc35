"""TRL bridges for the text games of :mod:`env_adapters`: a per-turn ``rollout_func``, an evaluator and an
``environment_factory`` adapter.

* :class:`TurnRollout`: a TRL ``rollout_func`` with **one training row per turn** and a Markovian prompt (the task,
  the current observation and the legal actions; no dialogue history unless ``history_length`` > 0). Each block of
  ``G = num_generations`` consecutive prompts is one group: ``E = G // max_turns`` episodes of one seed fill its
  ``G`` rows (episode 0's turns first, then episode 1's, ...; then padding rows). Every row carries the step-level
  metadata the credit mixin reads as extra fields (``agentcredit_traj``, ``agentcredit_t``, ``agentcredit_state``,
  ``agentcredit_action``, ``agentcredit_reward``, ``agentcredit_success``, ``agentcredit_truncated``,
  ``agentcredit_valid``)::

      rollout = TurnRollout("minigrid", dict(size=6, moves="absolute"), max_turns=6)
      trainer = GRPOTrainer(model=..., reward_funcs=[rollout.reward_func], rollout_func=rollout,
                            train_dataset=TurnRollout.dataset(range(64)),
                            args=GRPOConfig(num_generations=12, per_device_train_batch_size=12, ...))

* :func:`evaluate`: one episode per seed with the same engine (:func:`play_episodes`), success rate with a Wilson
  95 % interval.
* :func:`environment_factory`: a class for ``GRPOTrainer(environment_factory=...)`` (TRL's own tool loop, one row
  per episode): one tool per action of a fixed action set, or ``act(command)`` for free-text games.

The assistant turn is pre-filled with ``<action>`` (part of the prompt, never trained on): small instruct models do
not write the tag on their own. Decoding runs in fp32 with autocast off (bf16 decode is ~3x slower on CPU).
Rollouts generate through :func:`agentcredit.trl.generation.rollout_generator`: HF ``generate``, or TRL's vLLM engine
with ``use_vllm=true`` (then the rows carry its sampling log-probs); :func:`evaluate` always uses HF ``generate``.
``import env_adapters`` does not import this module.
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from credit_plugins.hashing import stable_hash

from env_adapters import turns
from env_adapters.executor import EnvExecutor, EnvFault, shared_executor
from env_adapters.prompting import build_prompt, parse_action
from env_adapters.turns import View

from .generation import ACTION_STOP, HFGenerator, TurnSampling, rollout_generator, sampling_logprobs

__all__ = ["TurnRollout", "TranscriptContext", "play_episodes", "evaluate", "EvalResult", "Episode", "TurnRecord",
           "environment_factory", "compact_prompt", "wilson_interval", "paired_difference",
           "PairedDifference", "ACTION_PREFIX", "EPISODE_PROMPT", "actions_over_budget"]

#: the forced start of every assistant turn (an env token: part of the prompt ids)
ACTION_PREFIX = "<action>"
#: dataset prompts of :meth:`TurnRollout.dataset`
EPISODE_PROMPT = "agentcredit-episode seed={seed}"
_EPISODE_RE = re.compile(r"^agentcredit-episode seed=(-?\d+|None)$")
_FACTORY_PROMPT = "Play the game. Call one tool per turn."


# ---- prompts --------------------------------------------------------------------------------------------------------
def legal_actions(env) -> list[str] | None:
    """``env.legal_actions()`` as a list, or None for an env without that method."""
    fn = getattr(env, "legal_actions", None)
    return list(fn()) if callable(fn) else None


def actions_over_budget(tokenizer, actions: Iterable[str], max_new_tokens: int) -> list[tuple[str, int]]:
    """The actions whose reply ``action</action>`` (what the model writes after the forced ``<action>``) takes more
    than ``max_new_tokens`` tokens of ``tokenizer``, with their token counts, longest first. Generation stops at the
    budget, so such a reply is cut before its closing tag and parsed as invalid, whatever the policy learned."""
    over = []
    for action in dict.fromkeys(actions):
        n = len(tokenizer(f"{action}{ACTION_STOP}", add_special_tokens=False)["input_ids"])
        if n > max_new_tokens:
            over.append((action, n))
    return sorted(over, key=lambda pair: -pair[1])


def compact_prompt(task: str, observation: str, legal: Sequence[str] | None) -> str:
    """The short user message of one turn: task, observation, legal actions and the answer format."""
    lines = [task.strip()] if task else []
    lines.append(observation)
    if legal:
        lines.append("Actions: " + ", ".join(legal))
    lines.append("Answer with <action>one action</action>.")
    return "\n".join(lines)


def chat_text(tokenizer, user: str, system: str | None) -> str:
    """One turn's prompt text: the chat template over ``system`` and ``user``, ending in ``<action>``."""
    messages = ([{"role": "system", "content": system}] if system is not None else []) + \
        [{"role": "user", "content": user}]
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False) + ACTION_PREFIX


# ---- the engine -----------------------------------------------------------------------------------------------------
@dataclass
class TurnRecord:
    """One decision: its token ids, the parsed action and the StepTable fields of its row."""

    t: int
    prompt_ids: list[int]
    completion_ids: list[int]
    response: str             # "<action>" + the decoded completion
    action_text: str | None
    action_key: str | None
    state: int                # stable_hash(env.state_key()) before the action
    action: int               # stable_hash(action_key), -1 when invalid
    reward: float
    valid: bool
    extras: dict[str, Any] = field(default_factory=dict)  # per-row StepTable extras (``agentcredit_extras``)
    by_teacher: bool = False  # generated by the guide model (Guided-OPD), not by the policy
    logprobs: list[float] | None = None  # the sampler's log-probs of completion_ids (vLLM back-end), else None


@dataclass
class Episode:
    seed: int | None
    turns: list[TurnRecord] = field(default_factory=list)
    success: bool = False
    truncated: bool = False
    env_error: str = ""         # the env fault that ended the episode ("" none; "error", "timeout", "dead")
    env_error_detail: str = ""  # its summary and traceback

    @property
    def total_reward(self) -> float:
        return float(sum(t.reward for t in self.turns))


class TranscriptContext:
    """What :func:`play_episodes` shows each turn and how it records the answer: the transcript context. The user
    message is ``compact`` (task, observation, legal actions) or ``verl-agent`` (plus the last ``history_length``
    steps), the reply is pre-filled with ``<action>``; a turn becomes a :class:`TurnRecord`. A subclass changes the
    context (CCM's memory context: :class:`agentcredit.trl.ccm.MemoryContext`)."""

    #: the text the reply is pre-filled with (it ends the prompt and starts the recorded response)
    prefill = ACTION_PREFIX

    def __init__(self, tokenizer, n_episodes: int, *, prompt: str = "compact", history_length: int = 0,
                 system: str | None = None):
        if prompt not in ("compact", "verl-agent"):
            raise ValueError(f"prompt={prompt!r}; choose 'compact' or 'verl-agent'")
        self.tokenizer, self.prompt, self.history_length, self.system = tokenizer, prompt, history_length, system
        self.history: list[list[tuple[str, str | None]]] = [[] for _ in range(n_episodes)]

    def prompt_ids(self, i: int, view: View, observation: str) -> list[int]:
        """Episode ``i``'s prompt token ids at ``observation`` (``view``: the env's task and legal actions there)."""
        task, legal = view.task, view.legal
        user = (compact_prompt(task, observation, legal) if self.prompt == "compact"
                else build_prompt(task, self.history[i], observation, legal, self.history_length))
        return self.tokenizer(chat_text(self.tokenizer, user, self.system), add_special_tokens=False)["input_ids"]

    def record(self, i: int, observation: str, turn: dict[str, Any], env_reward: float) -> TurnRecord:
        """The record of episode ``i``'s turn (``turn``: the :class:`TurnRecord` fields but the reward), after the
        env stepped with ``env_reward``."""
        self.history[i].append((observation, turn["action_key"]))
        return TurnRecord(**turn, reward=float(env_reward))


def play_episodes(model, tokenizer, specs: Sequence[tuple[Any, int | None]], *, max_turns: int = 6,
                  max_new_tokens: int = 8, temperature: float = 0.7, top_p: float = 1.0, top_k: int = 0,
                  min_p: float | None = None, greedy: bool = False, prompt: str = "compact",
                  history_length: int = 0, system: str | None = None, batch_size: int = 64,
                  before_step=None, guide: tuple[Any, float] | None = None,
                  context: type[TranscriptContext] = TranscriptContext, generator=None,
                  envs: EnvExecutor | None = None) -> list[Episode]:
    """Play one episode per ``(env, seed)`` in ``specs`` (distinct env instances), all of them batched turn by turn.

    Each turn the prompts of all running episodes are generated together by ``generator``
    (:mod:`agentcredit.trl.generation`; default ``HFGenerator(model)``: ``model.generate``, left padding), stopping at
    ``</action>`` or EOS, in fp32 with autocast off and the model in eval mode (its mode is restored afterwards); a
    turn keeps the generator's log-probs (``TurnRecord.logprobs``, None on HF).
    An episode ends when the env says ``done`` or after ``max_turns`` steps (then it is ``truncated``).
    ``before_step(envs, prompt_ids, action_texts) -> list[dict]``, called once per turn with the running episodes'
    envs (at the decision state), prompts and parsed actions before they act, returns each turn's ``extras``.
    ``guide=(teacher_model, p)`` (Guided-OPD): each turn of each episode is generated by ``teacher_model`` instead
    with probability ``p`` (one Bernoulli draw per turn from torch's stream; HF generate whatever ``generator`` is);
    those turns have ``by_teacher=True`` and ``logprobs=None``.
    ``context``: what each prompt holds and how a turn is recorded (:class:`TranscriptContext`, built with
    ``prompt`` / ``history_length`` / ``system``; CCM's memory context: :class:`agentcredit.trl.ccm.MemoryContext`).
    ``envs``: the :class:`~env_adapters.executor.EnvExecutor` whose thread pool runs the episodes' env calls (reset,
    the per-turn queries and step) all at once, with its ``timeout_s`` (default: a shared pool, no timeout). An env
    call that raises, times out or dies ends that episode only: ``truncated``, not ``success``, with the turns it
    played, ``Episode.env_error`` set (the turn of the faulted call is not recorded). ``before_step`` runs on this
    thread with the env objects (ASCT's evaluator, descriptors), outside that guard.
    """
    if max_turns < 1 or max_new_tokens < 1 or batch_size < 1:
        raise ValueError("max_turns, max_new_tokens and batch_size must be >= 1")
    if len({id(env) for env, _ in specs}) != len(specs):
        raise ValueError("play_episodes needs one env instance per episode (they are played side by side)")
    ctx = context(tokenizer, len(specs), prompt=prompt, history_length=history_length, system=system)
    gen = generator if generator is not None else HFGenerator(model, tokenizer, batch_size=batch_size)
    params = TurnSampling(max_new_tokens=int(max_new_tokens), temperature=float(temperature), top_p=float(top_p),
                          top_k=int(top_k or 0), min_p=min_p, greedy=bool(greedy))
    teacher = HFGenerator(guide[0], tokenizer, batch_size=batch_size, eos=gen.eos) if guide is not None else None

    episodes = [Episode(seed=seed) for _, seed in specs]
    # every env call of the episodes runs at once on the env executor, each with its timeout; a fault ends that
    # episode only (truncated and failed, with the turns it played; Episode.env_error names it)
    ex = envs if envs is not None else shared_executor(backend="thread", workers=64, timeout_s=None)
    handles = [ex.adopt(env) for env, _ in specs]
    obs: list[Any] = [None] * len(specs)

    def each(idx: list[int], fn, args: list[tuple]) -> list[int]:
        """Run ``fn`` on the envs of episodes ``idx``; keep the results, end the faulted episodes; the ok ones."""
        ok = []
        for i, value in zip(idx, ex.run_all([(handles[i], fn, a) for i, a in zip(idx, args)])):
            if isinstance(value, EnvFault):
                value.seed = episodes[i].seed
                episodes[i].env_error, episodes[i].env_error_detail = value.kind, f"{value.summary()}\n{value.detail}"
                episodes[i].truncated = True
            else:
                results[i] = value
                ok.append(i)
        return ok

    results: list[Any] = [None] * len(specs)
    live = each(list(range(len(specs))), turns.start, [(seed,) for _, seed in specs])
    for i in live:
        obs[i] = results[i][0]
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad(), torch.autocast("cpu", enabled=False):
            for t in range(max_turns):
                live = each(live, turns.observe, [()] * len(live))
                if not live:
                    break
                views = {i: results[i] for i in live}
                prompt_ids = [ctx.prompt_ids(i, views[i], obs[i]) for i in live]
                by_teacher = [False] * len(live)
                if guide is not None and guide[1] > 0.0:
                    by_teacher = (torch.rand(len(live)) < float(guide[1])).tolist()
                outs = gen.generate([p for p, b in zip(prompt_ids, by_teacher) if not b], params)
                if any(by_teacher):
                    t_outs = iter(teacher.generate([p for p, b in zip(prompt_ids, by_teacher) if b], params))
                    s_outs = iter(outs)
                    outs = [next(t_outs) if b else next(s_outs) for b in by_teacher]
                turn_extras = [{} for _ in live]
                if before_step is not None:
                    turn_extras = before_step([specs[i][0] for i in live], prompt_ids,
                                              [parse_action(ctx.prefill + text) for _, text, _ in outs])
                responses = [ctx.prefill + text for _, text, _ in outs]
                acted = set(each(live, turns.act, [(parse_action(r),) for r in responses]))
                still = []
                for i, p_ids, (c_ids, _, lps), response, extras, b_t in zip(live, prompt_ids, outs, responses,
                                                                           turn_extras, by_teacher):
                    if i not in acted:  # the env faulted on this turn: the episode ends with the turns it played
                        continue
                    state = stable_hash(views[i].state_key)
                    action_text = parse_action(response)
                    key, res = results[i].action_key, results[i].result
                    episodes[i].turns.append(ctx.record(i, obs[i], dict(
                        t=t, prompt_ids=list(p_ids), completion_ids=list(c_ids), response=response,
                        action_text=action_text, action_key=key, state=state,
                        action=-1 if key is None else stable_hash(key), valid=key is not None, extras=dict(extras),
                        by_teacher=bool(b_t), logprobs=None if b_t or lps is None else list(lps)), res.reward))
                    obs[i] = res.observation
                    if res.done:
                        episodes[i].success = bool(res.success)
                    else:
                        still.append(i)
                live = still
    finally:
        model.train(was_training)
    for i in live:
        episodes[i].truncated = True
    return episodes


def env_fault_stats(episodes: Sequence[Episode]) -> dict[str, float]:
    """``env_errors`` (episodes whose env raised, hung or died), ``env_timeouts`` (those that hung) and
    ``env_error_rate`` (their share)."""
    faulted = [e for e in episodes if e.env_error]
    return {"env_errors": float(len(faulted)), "env_timeouts": float(sum(e.env_error == "timeout" for e in faulted)),
            "env_error_rate": len(faulted) / len(episodes) if episodes else 0.0}


def check_env_errors(episodes: Sequence[Episode], limit: float, env: str) -> None:
    """A ``RuntimeError`` naming the env, the seed and the first traceback when more than ``limit`` of the episodes
    had an env fault (the run stops instead of training on what is left)."""
    faulted = [e for e in episodes if e.env_error]
    if faulted and len(faulted) / len(episodes) > limit:
        raise RuntimeError(f"agentcredit: {len(faulted)} of {len(episodes)} episodes of this step had an env fault "
                           f"({env!r}), more than agentcredit.max_env_error_rate={limit}; stopping instead of "
                           f"training on the rest. The first one: {faulted[0].env_error_detail}")


def _stats(episodes: Sequence[Episode]) -> dict[str, float]:
    n = len(episodes)
    turns = [len(e.turns) for e in episodes]
    steps = sum(turns)
    return {
        "episodes": n,
        "success_rate": sum(e.success for e in episodes) / n if n else 0.0,
        "valid_rate": sum(t.valid for e in episodes for t in e.turns) / steps if steps else 0.0,
        "mean_return": sum(e.total_reward for e in episodes) / n if n else 0.0,
        "mean_turns": steps / n if n else 0.0,
    }


# ---- TRL rollout_func -----------------------------------------------------------------------------------------------
class TurnRollout:
    """A TRL ``rollout_func``: one training row per turn, Markovian prompts, step metadata as extra fields.

    Args:
        env: registered environment name (:func:`env_adapters.make`).
        env_options: its keyword options.
        max_turns: step limit of an episode; ``num_generations`` must be a multiple of it.
        max_new_tokens: tokens generated per turn (after the forced ``<action>``); also capped by
            ``trainer.args.max_completion_length``.
        prompt: ``"compact"`` (task + observation + actions + answer format) or ``"verl-agent"``
            (:func:`env_adapters.build_prompt` with ``history_length`` past steps).
        history_length: past steps shown by the ``"verl-agent"`` prompt.
        system: a system message (None: the chat template's default).
        batch_size: most prompts in one ``generate`` call.
        descriptors: attach each turn's ``descriptor`` extra (:mod:`env_adapters.descriptors`; TJPO reads it).
        archive: a JSONL file; every call appends its episodes to it (:mod:`distill_plugins.ross` format: prompt
            and completion ids, rewards, success, step keys), for ``agentcredit ross``. None: no archive.

    With a trainer whose loss scheduler has ``teacher_turn_prob`` (Guided-OPD, ``schedule: guided``), each turn is
    generated by the distillation teacher with that step's probability; those turns' tokens get ``env_mask`` 0 (no
    loss on them) and, with ``use_vllm``, NaN sampling log-probs (TRL treats them as unscorable: ratio 1).

    Generation: :func:`agentcredit.trl.generation.rollout_generator` (HF ``generate``; with ``use_vllm=true`` TRL's
    ``trainer.vllm_generation``, and ``"logprobs"`` holds vLLM's per-token log-probs, one list per row aligned with
    ``completion_ids``, NaN on padding rows; HF: ``"logprobs": None``).

    Layout of one call (``G = trainer.num_generations``, ``E = G // max_turns``): block ``b`` of ``G`` consecutive
    prompts (one seed) holds ``E`` episodes of that seed, ``agentcredit_traj = b * E + e``, their turn rows first and
    padding rows (``agentcredit_traj = -1``, ``env_mask = [0]``) in the unused slots.
    """

    #: what each prompt holds (:func:`play_episodes`' ``context``); the held-out eval of ``agentcredit train``
    #: plays the same one, so a memory-context policy is measured in the context it was trained in
    context: type[TranscriptContext] = TranscriptContext

    FIELDS = ("agentcredit_traj", "agentcredit_t", "agentcredit_state", "agentcredit_action", "agentcredit_reward",
              "agentcredit_success", "agentcredit_truncated", "agentcredit_valid")

    def __init__(self, env: str, env_options: dict | None = None, max_turns: int = 6, max_new_tokens: int = 8,
                 prompt: str = "compact", history_length: int = 0, system: str | None = None,
                 batch_size: int = 64, *, archive: str | None = None, descriptors: bool = False,
                 env_timeout_s: float | None = 120.0, env_workers: int = 64, max_env_error_rate: float = 0.25):
        if prompt not in ("compact", "verl-agent"):
            raise ValueError(f"prompt={prompt!r}; choose 'compact' or 'verl-agent'")
        if max_turns < 1 or max_new_tokens < 1:
            raise ValueError("max_turns and max_new_tokens must be >= 1")
        if not 0.0 <= float(max_env_error_rate) <= 1.0:
            raise ValueError(f"max_env_error_rate={max_env_error_rate}; use a share in [0, 1] (1: never stop)")
        import env_adapters

        #: runs the envs' calls at once with a timeout (env_adapters.executor); faults end single episodes
        self.envs = EnvExecutor("thread", workers=env_workers, timeout_s=env_timeout_s, reuse=False)
        self.max_env_error_rate = float(max_env_error_rate)

        self.env_name, self.env_options = env, dict(env_options or {})
        self.max_turns, self.max_new_tokens = int(max_turns), int(max_new_tokens)
        self.prompt, self.history_length, self.system = prompt, int(history_length), system
        self.batch_size = int(batch_size)
        self.descriptors = bool(descriptors)  # TJPO's per-step descriptor extra (env_adapters.descriptors)
        self.archive = None
        if archive is not None:
            from distill_plugins.ross import ArchiveWriter

            self.archive = ArchiveWriter(archive)
        self._make = lambda: env_adapters.make(self.env_name, **self.env_options)
        self._pool = [self._make()]  # built now: a bad env name or option fails at construction
        self._metrics: dict[str, float] = {}
        self._budget_checked = False
        self.last_episodes: list[Episode] = []
        self.__name__ = "TurnRollout"

    @staticmethod
    def dataset(seeds: Iterable[int]):
        """A ``datasets.Dataset`` whose ``prompt`` column names one episode seed per row."""
        from datasets import Dataset

        return Dataset.from_dict({"prompt": [EPISODE_PROMPT.format(seed=int(s)) for s in seeds]})

    @staticmethod
    def _seed(prompt) -> int | None:
        m = _EPISODE_RE.match(prompt.strip()) if isinstance(prompt, str) else None
        if m is None:
            raise ValueError(f"TurnRollout got the prompt {prompt!r}; build the train dataset with "
                             f"TurnRollout.dataset(seeds) (prompts 'agentcredit-episode seed=<int>')")
        return None if m.group(1) == "None" else int(m.group(1))

    def _envs(self, n: int) -> list:
        while len(self._pool) < n:
            self._pool.append(self._make())
        return self._pool[:n]

    def __call__(self, prompts: list[str], trainer) -> dict[str, Any]:
        t0 = time.perf_counter()
        model = trainer.accelerator.unwrap_model(trainer.model)
        G = getattr(trainer, "num_generations", None)
        if not model.training and getattr(trainer, "num_generations_eval", None):
            G = trainer.num_generations_eval
        G = int(G or 0)
        if G < 1 or G % self.max_turns or len(prompts) % G:
            raise ValueError(
                f"TurnRollout needs num_generations (got {G}) to be a multiple of agentcredit.max_turns "
                f"(max_turns={self.max_turns}) and the prompts of one call ({len(prompts)}, a multiple of "
                f"per_device_train_batch_size) to be whole groups of num_generations")
        E = G // self.max_turns
        blocks = len(prompts) // G
        seeds = []
        for b in range(blocks):
            block = [self._seed(p) for p in prompts[b * G:(b + 1) * G]]
            if len(set(block)) != 1:
                raise ValueError(f"a block of num_generations={G} consecutive prompts must repeat one seed; got "
                                 f"{sorted(set(block), key=str)}")
            seeds.append(block[0])
        envs = self._envs(blocks * E)
        specs = [(envs[b * E + e], seeds[b]) for b in range(blocks) for e in range(E)]
        tok = trainer.processing_class
        args = trainer.args
        max_new = self._answer_budget(tok, args, seeds[0])
        gen = rollout_generator(trainer, model, tok, batch_size=self.batch_size)  # HF, or TRL's vLLM (use_vllm)
        episodes = self._play(
            model, tok, specs, generator=gen, max_turns=self.max_turns, max_new_tokens=max_new,
            temperature=float(getattr(args, "temperature", 1.0) or 1.0), top_p=float(getattr(args, "top_p", 1.0)),
            top_k=int(getattr(args, "top_k", 0) or 0), min_p=getattr(args, "min_p", None), prompt=self.prompt,
            history_length=self.history_length, system=self.system, batch_size=self.batch_size,
            before_step=self._with_descriptors(self._before_step(model, tok, trainer)), guide=self._guide(model, trainer))
        if self.archive is not None and model.training:
            self._write_archive(episodes, trainer, E)
        eos = tok.eos_token_id
        out: dict[str, Any] = {"prompt_ids": [], "completion_ids": [], "env_mask": [],
                               "logprobs": [] if gen.sampling_logprobs else None}
        out.update({k: [] for k in self.FIELDS})

        with_extras = any(tr.extras for ep in episodes for tr in ep.turns)
        if with_extras:
            out["agentcredit_extras"] = []
        pad_extras = next((dict.fromkeys(tr.extras, 0) for ep in episodes for tr in ep.turns if tr.extras), {})

        def row(p, c, m, traj, t, state, action, reward, success, truncated, valid, extras=None, lps=None):
            if with_extras:
                out["agentcredit_extras"].append(extras if extras is not None else pad_extras)
            if out["logprobs"] is not None:
                out["logprobs"].append(sampling_logprobs(lps, len(c)))
            out["prompt_ids"].append(p)
            out["completion_ids"].append(c)
            out["env_mask"].append(m)
            for k, v in zip(self.FIELDS, (traj, t, state, action, reward, success, truncated, valid)):
                out[k].append(v)

        for b in range(blocks):
            n = 0
            for e in range(E):
                ep = episodes[b * E + e]
                for tr in ep.turns:
                    row(tr.prompt_ids, tr.completion_ids, [int(not tr.by_teacher)] * len(tr.completion_ids), b * E + e,
                        tr.t,
                        int(tr.state), int(tr.action), float(tr.reward), bool(ep.success), bool(ep.truncated),
                        bool(tr.valid), tr.extras, tr.logprobs)
                    n += 1
            for _ in range(G - n):
                row([eos], [eos], [0], -1, 0, 0, -1, 0.0, False, False, False)
        self.last_episodes = episodes
        self._metrics = {**_stats(episodes), **env_fault_stats(episodes), "rollout_seconds": time.perf_counter() - t0}
        return out

    def _answer_budget(self, tokenizer, args, seed: int | None) -> int:
        """Tokens generated per turn: ``max_new_tokens`` capped by ``args.max_completion_length``; on the first call
        also :meth:`check_answer_budget` against it (once per rollout, for every subclass's ``__call__``)."""
        budget = self.max_new_tokens
        if getattr(args, "max_completion_length", None):
            budget = min(budget, int(args.max_completion_length))
        if not self._budget_checked:
            self._budget_checked = True
            self.check_answer_budget(tokenizer, seed, budget)
        return budget

    def check_answer_budget(self, tokenizer, seed: int | None,
                            max_new_tokens: int | None = None) -> list[tuple[str, int]]:
        """Print a warning when a legal action of ``seed``'s first state cannot fit the token budget (the model could
        never take it: its reply is cut before ``</action>``); returns those actions with their token counts
        (:func:`actions_over_budget`). Called once, on the first rollout; envs without ``legal_actions()`` pass."""
        budget = self.max_new_tokens if max_new_tokens is None else int(max_new_tokens)
        env = self._pool[0]
        env.reset(seed)
        over = actions_over_budget(tokenizer, legal_actions(env) or [], budget)
        if over:
            action, n = over[0]
            print(f"TurnRollout: WARNING: {len(over)} legal action(s) cannot fit max_new_tokens={budget}: {action!r} + "
                  f"'{ACTION_STOP}' is {n} tokens, so the model can never answer it validly; set "
                  f"agentcredit.max_new_tokens >= {n} (and max_completion_length, if set)", flush=True)
        return over

    def _play(self, model, tokenizer, specs, **kwargs) -> list[Episode]:
        """The episode engine: :func:`play_episodes` in this rollout's :attr:`context` and env executor. The env of
        an episode that faulted is replaced in the pool (it may be mid-step in an abandoned thread); more than
        ``max_env_error_rate`` of faulted episodes stops the run."""
        episodes = play_episodes(model, tokenizer, specs, context=self.context, envs=self.envs, **kwargs)
        for k, ep in enumerate(episodes):
            if ep.env_error:
                self._pool[self._pool.index(specs[k][0])] = self._make()
        check_env_errors(episodes, self.max_env_error_rate, self.env_name)
        return episodes

    def _before_step(self, model, tokenizer, trainer):
        """The per-turn hook of :func:`play_episodes` (None here; subclasses add per-row extras)."""
        return None

    def _with_descriptors(self, before_step):
        """``before_step`` plus each turn's ``descriptor`` extra (at the decision state) when ``descriptors``."""
        if not self.descriptors:
            return before_step
        from env_adapters.descriptors import DESCRIPTOR, step_descriptor

        def hook(envs, prompt_ids, action_texts):
            extras = before_step(envs, prompt_ids, action_texts) if before_step is not None else [{} for _ in envs]
            keys = [env.action_key(a) if a is not None else None for env, a in zip(envs, action_texts)]
            return [{**x, DESCRIPTOR: step_descriptor(env, key)} for x, env, key in zip(extras, envs, keys)]

        return hook

    @staticmethod
    def _guide(model, trainer) -> tuple[Any, float] | None:
        """``(teacher, p)`` when the trainer's scheduler mixes teacher turns into rollouts (Guided-OPD), else None."""
        sched = getattr(trainer, "scheduler", None)
        prob = getattr(sched, "teacher_turn_prob", None)
        teacher = getattr(trainer, "_ac_teacher_raw", None)
        if not callable(prob) or teacher is None or not model.training:
            return None
        p = float(prob(int(trainer.state.global_step), int(trainer.args.max_steps)))
        return (teacher, p) if p > 0.0 else None

    def _write_archive(self, episodes: Sequence[Episode], trainer, per_group: int) -> None:
        from distill_plugins.ross import ArchivedTrajectory, ArchivedTurn

        step = int(getattr(getattr(trainer, "state", None), "global_step", 0) or 0)
        rank = int(getattr(getattr(trainer, "accelerator", None), "process_index", 0) or 0)
        self.archive.write(ArchivedTrajectory(
            turns=[ArchivedTurn(t=tr.t, prompt_ids=tr.prompt_ids, completion_ids=tr.completion_ids, state=tr.state,
                                action=tr.action, reward=tr.reward, valid=tr.valid, response=tr.response,
                                action_text=tr.action_text, action_key=tr.action_key, by_teacher=tr.by_teacher)
                   for tr in ep.turns],
            success=ep.success, truncated=ep.truncated, step=step, env=self.env_name, seed=ep.seed,
            group=i // per_group, traj=i, source="trl", extra={"rank": rank} if rank else {})
            for i, ep in enumerate(episodes))

    def env_reward(self, prompts=None, completions=None, completion_ids=None, agentcredit_reward=None,
                   **kwargs) -> list[float]:
        """TRL reward function: each row's step reward r_t (the ``agentcredit_reward`` extra field)."""
        if agentcredit_reward is None:
            raise ValueError("env_reward needs the agentcredit_reward column: use it with rollout_func=TurnRollout")
        return [float(r) for r in agentcredit_reward]

    #: ``reward_funcs=[rollout.reward_func]``; its ``__name__`` is ``"env_reward"``
    reward_func = env_reward

    def metrics(self) -> dict[str, float]:
        """Stats of the last call: episodes, success_rate, valid_rate, mean_return, mean_turns, rollout_seconds."""
        return dict(self._metrics)


# ---- evaluation -----------------------------------------------------------------------------------------------------
def wilson_interval(successes: int, n: int, z: float = 1.959964) -> tuple[float, float]:
    """Wilson score interval of a binomial rate (fractions in [0, 1])."""
    if n <= 0:
        return (0.0, 1.0)
    p = successes / n
    denom = 1 + z * z / n
    center = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return (max(0.0, center - half), min(1.0, center + half))


@dataclass(frozen=True)
class PairedDifference:
    """``after - before`` success on the same seeds (:func:`paired_difference`); rates are fractions."""

    n: int
    before_only: int          # seeds solved before and not after
    after_only: int           # seeds solved after and not before
    difference: float         # (after_only - before_only) / n
    ci: tuple[float, float]   # Newcombe's paired 95 % interval
    mcnemar_p: float          # exact two-sided McNemar p-value

    def format(self) -> str:
        lo, hi = self.ci
        return (f"after - before, paired by seed: {100 * self.difference:+.1f} points [{100 * lo:+.1f}, "
                f"{100 * hi:+.1f}] (95 %), {self.after_only} seeds gained, {self.before_only} lost, "
                f"exact McNemar p = {self.mcnemar_p:.2g}")


def paired_difference(before: Sequence[bool], after: Sequence[bool], z: float = 1.959964) -> PairedDifference:
    """Change in success rate between two evaluations of the same seeds, paired seed by seed.

    The interval is Newcombe's (1998) method 10: the Wilson intervals of the two marginal rates combined with the
    phi correlation of the 2x2 table (``phi = 0`` when a margin is empty). The p-value is the exact two-sided
    McNemar test: under no change the ``b + c`` discordant seeds split as Binomial(b + c, 1/2). Pairing removes the
    between-seed variance that two independent Wilson intervals carry, so it is the sharper test of one run's
    before/after. The caller pairs the same seeds in the same order; lists of different lengths are a
    ``ValueError``.
    """
    before, after = [bool(x) for x in before], [bool(x) for x in after]
    if len(before) != len(after):
        raise ValueError(f"paired_difference: before has {len(before)} episodes and after {len(after)}; pair the "
                         f"same seeds")
    n = len(before)
    if n == 0:
        raise ValueError("paired_difference: no episodes to pair")
    a = sum(x and y for x, y in zip(before, after))
    b = sum(x and not y for x, y in zip(before, after))
    c = sum(y and not x for x, y in zip(before, after))
    d = n - a - b - c
    p1, p2 = (a + b) / n, (a + c) / n
    l1, u1 = wilson_interval(a + b, n, z)
    l2, u2 = wilson_interval(a + c, n, z)
    margins = (a + b) * (c + d) * (a + c) * (b + d)
    phi = (a * d - b * c) / math.sqrt(margins) if margins else 0.0
    diff = p2 - p1
    lower = diff - math.sqrt(max(0.0, (p2 - l2) ** 2 - 2 * phi * (p2 - l2) * (u1 - p1) + (u1 - p1) ** 2))
    upper = diff + math.sqrt(max(0.0, (u2 - p2) ** 2 - 2 * phi * (u2 - p2) * (p1 - l1) + (p1 - l1) ** 2))
    k, m = min(b, c), b + c
    p_value = min(1.0, 2 * sum(math.comb(m, i) for i in range(k + 1)) / 2 ** m) if m else 1.0
    return PairedDifference(n=n, before_only=b, after_only=c, difference=diff,
                            ci=(max(-1.0, lower), min(1.0, upper)), mcnemar_p=p_value)


@dataclass
class EvalResult:
    n_episodes: int
    success_rate: float
    success_ci: tuple[float, float]
    valid_rate: float
    mean_return: float
    mean_turns: float
    seconds: float
    episodes: list[Episode] = field(default_factory=list, repr=False)

    def format(self) -> str:
        lo, hi = self.success_ci
        return (f"success {100 * self.success_rate:.1f}% [{100 * lo:.1f}, {100 * hi:.1f}] ({self.n_episodes} "
                f"episodes), valid actions {100 * self.valid_rate:.1f}%")


def evaluate(model, tokenizer, env: str, env_options: dict | None, seeds: Iterable[int], max_turns: int = 6,
             temperature: float = 0.7, greedy: bool = False, prompt: str = "compact", max_new_tokens: int = 8,
             batch_size: int = 64, system: str | None = None, history_length: int = 0,
             sampling_seed: int | None = 0, context: type[TranscriptContext] = TranscriptContext) -> EvalResult:
    """Play one episode per seed (sampled at ``temperature``, or greedy) and summarise it; ``context`` is
    :func:`play_episodes`' (CCM's memory context: :class:`agentcredit.trl.ccm.MemoryContext`).

    Reproducible: the episodes use the env seeds ``seeds`` and the sampling stream ``torch.manual_seed(sampling_seed)``
    (forked, so the caller's random state is left as it was), so the same model evaluated twice gives the same
    number, and a before/after comparison sees the same seeds and the same stream. ``sampling_seed=None`` samples
    from the caller's stream instead.
    """
    import env_adapters
    import torch

    t0 = time.perf_counter()
    seeds = [int(s) for s in seeds]
    specs = [(env_adapters.make(env, **dict(env_options or {})), s) for s in seeds]
    with torch.random.fork_rng(enabled=sampling_seed is not None):
        if sampling_seed is not None:
            torch.manual_seed(int(sampling_seed))
        episodes = play_episodes(model, tokenizer, specs, max_turns=max_turns, max_new_tokens=max_new_tokens,
                                 temperature=temperature, greedy=greedy, prompt=prompt, batch_size=batch_size,
                                 system=system, history_length=history_length, context=context)
    s = _stats(episodes)
    wins = sum(e.success for e in episodes)
    return EvalResult(n_episodes=len(episodes), success_rate=s["success_rate"],
                      success_ci=wilson_interval(wins, len(episodes)), valid_rate=s["valid_rate"],
                      mean_return=s["mean_return"], mean_turns=s["mean_turns"], seconds=time.perf_counter() - t0,
                      episodes=episodes)


# ---- TRL environment_factory ----------------------------------------------------------------------------------------
_TOOL_DOCS = {
    "up": "Move one cell up (row - 1).",
    "down": "Move one cell down (row + 1).",
    "left": "Move one cell left (column - 1).",
    "right": "Move one cell right (column + 1).",
    "turn left": "Turn 90 degrees to the left without moving.",
    "turn right": "Turn 90 degrees to the right without moving.",
    "move forward": "Move one cell in the direction you face.",
    "pick up": "Pick up the object in front of you.",
    "open door": "Open (toggle) the door in front of you.",
}
_RESERVED = {"reset", "get_reward", "dataset", "act"}


def _tool_name(action: str) -> str:
    name = re.sub(r"\W", "_", action.strip().lower().replace(" ", "_"))
    if not name or name[0].isdigit():
        name = "a_" + name
    return name


def environment_factory(env: str, **env_options) -> type:
    """A class for ``GRPOTrainer(environment_factory=cls)`` that plays ``env_adapters.make(env, **env_options)``.

    Tools: one method per action when the env has a fixed action set (a ``legal`` tuple, e.g. minigrid and
    sokoban: ``up``, ``move_forward``, ...; no arguments), else ``act(command: str)``. ``reset(**row)`` uses the
    row's ``seed`` and returns the task, the first observation and the actions (TRL appends it to the user message).

    Records (read by the credit mixin), on each instance: ``agentcredit_turns`` (one dict per tool call executed on
    the env: ``state`` = stable hash of ``state_key()`` before, ``action`` = stable hash of the action key or -1,
    ``reward``, ``valid``; a call after the episode ended is answered "episode is over" and not recorded),
    ``agentcredit_final_state``, ``agentcredit_success``, ``agentcredit_done``. ``get_reward()`` is the episode return.
    """
    import env_adapters

    probe = env_adapters.make(env, **env_options)
    legal = getattr(probe, "legal", None)
    fixed = (isinstance(legal, (tuple, list)) and len(legal) > 0 and all(isinstance(a, str) for a in legal))
    cls_name = "".join(p.capitalize() for p in re.split(r"\W+", env) if p) + "ToolEnv"

    def __init__(self):
        self._env = env_adapters.make(env, **env_options)
        self.agentcredit_turns = []
        self.agentcredit_final_state = 0
        self.agentcredit_success = False
        self.agentcredit_done = True
        self._return = 0.0

    def _describe(self, observation: str, first: bool = False) -> str:
        parts = [getattr(self._env, "task", "").strip()] if first else []
        parts.append(observation)
        acts = legal_actions(self._env)
        if acts:
            parts.append(("Tools: " + ", ".join(_tool_name(a) for a in acts)) if fixed
                         else ("Admissible commands: " + ", ".join(acts)))
        return "\n".join(p for p in parts if p)

    def reset(self, **row) -> str:
        seed = row.get("seed")
        obs = self._env.reset(None if seed is None else int(seed))
        self.agentcredit_turns = []
        self.agentcredit_final_state = stable_hash(self._env.state_key())
        self.agentcredit_success = False
        self.agentcredit_done = False
        self._return = 0.0
        return "\n\n" + self._describe(obs, first=True)

    def _act(self, action: str | None) -> str:
        if self.agentcredit_done:
            return "The episode is over. Reward 0."
        state = stable_hash(self._env.state_key())
        key = self._env.action_key(action)
        res = self._env.step(action)
        self.agentcredit_turns.append({"state": int(state), "action": -1 if key is None else int(stable_hash(key)),
                                       "reward": float(res.reward), "valid": key is not None})
        self._return += float(res.reward)
        self.agentcredit_final_state = stable_hash(self._env.state_key())
        self.agentcredit_done = bool(res.done)
        self.agentcredit_success = bool(res.success)
        if key is None:
            return "Invalid action.\n" + self._describe(res.observation)
        if res.done:
            return res.observation + ("\nYou solved the task. The episode is over." if res.success
                                      else "\nThe episode is over.")
        return self._describe(res.observation)

    def get_reward(self, **kwargs) -> float:
        return float(self._return)

    @classmethod
    def dataset(cls, seeds: Iterable[int]):
        from datasets import Dataset

        seeds = [int(s) for s in seeds]
        return Dataset.from_dict({"prompt": [[{"role": "user", "content": _FACTORY_PROMPT}] for _ in seeds],
                                  "seed": seeds})

    attrs: dict[str, Any] = {"__init__": __init__, "reset": reset, "get_reward": get_reward, "_act": _act,
                             "_describe": _describe, "dataset": dataset, "env_name": env,
                             "env_options": dict(env_options), "fixed_actions": tuple(legal) if fixed else None,
                             "__doc__": f"TRL environment for {env!r} ({env_options}); built by "
                                        f"agentcredit.trl.rollouts.environment_factory."}
    if fixed:
        for action in legal:
            name = _tool_name(action)
            if name in _RESERVED or name in attrs:
                raise ValueError(f"action {action!r} of env {env!r} gives the tool name {name!r}, which is taken")

            fn = _bind_action(action)  # f(self) -> str: TRL builds the schema from the signature
            fn.__name__ = name
            fn.__qualname__ = f"{cls_name}.{name}"
            fn.__doc__ = (f"{_TOOL_DOCS.get(action, f'Take the action {action!r} in the game.')}\n\n"
                          f"Returns:\n    The observation after the action.\n")
            attrs[name] = fn
    else:
        def act(self, command: str) -> str:
            """Send one text command to the game.

            Args:
                command: one of the admissible commands listed in the observation.

            Returns:
                The game's response.
            """
            return self._act(command)

        act.__qualname__ = f"{cls_name}.act"
        attrs["act"] = act
    for name in ("__init__", "reset", "get_reward", "_act", "_describe"):
        attrs[name].__qualname__ = f"{cls_name}.{name}"
    cls = type(cls_name, (), attrs)
    cls.__module__ = __name__
    return cls


def _bind_action(action: str):
    """A fresh function ``f(self) -> str`` that calls ``self._act(action)`` (no extra parameters in its signature)."""
    def f(self) -> str:
        return self._act(action)
    return f
