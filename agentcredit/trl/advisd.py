"""AdviSD inside TRL's ``GRPOTrainer``: the policy is an advisor of a frozen executor, trained by outcome RL plus
selective self-distillation toward its feedback-conditioned copy (:mod:`distill_plugins.advisd`).

    Trainer = make_trainer(GRPOTrainer, credit="grpo", terms={"advisd": {"weight": 0.1, "fraction": 0.25}})

or the recipe block ``agentcredit.terms: {advisd: {...}}``. Needs the one-row-per-turn rollout
(:class:`agentcredit.trl.rollouts.TurnRollout`, ``prompt: compact``); the mixin turns its turns into advisor turns.

Each turn of each episode (:class:`AdvisorContext`, :class:`AdviceGenerator`, inside the rollout's own
:func:`agentcredit.trl.episodes.play_episodes`):

1. the advisor (the trained policy) reads the turn's user message (task, observation, legal actions) plus the
   ``ask`` text and samples at most ``advice_tokens`` tokens of advice: the row TRL trains on (prompt: the advisor
   prompt; completion: the advice; reward: the env's step reward, credit as configured);
2. the frozen executor (a copy of the weights the trainer was built with, or the ``executor`` model) reads the
   user message plus ``advice_format`` with the advice and answers ``<action>...</action>``, which the env plays.

After the round (``_generate_and_score_completions``) the advisor scores each recorded executor response under the
executor prompt with and without the advice (two no-grad forwards, :func:`score_completions`), the influence
selects ``ceil(fraction * n)`` of the process's decisions (random mode: a draw seeded by ``seed + global_step``), and
the selected decisions are dealt to the round's ``steps_per_generation`` micro-batches. ``_compute_loss`` of a
micro-batch adds ``weight * L_SD / gradient_accumulation_steps``: the reverse KL of the advisor (with gradient) at
its advice tokens toward the same advisor (no gradient) whose prompt also holds the episode's outcome feedback.

Held-out: :func:`evaluate_advisor` plays episodes in the same advisor + executor format.

Logged: ``agentcredit_advisd/{decisions,selected_frac,influence,selected_influence,loss,weight}``. Stateless across
checkpoints: the executor is rebuilt from the starting weights (a resumed run builds its trainer from the same model
path before loading the checkpoint) and the random draw of step k depends on ``seed + k`` only.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from distill_plugins.advisd import (advice_influence, advice_text, advisd_loss, feedback_text, flatten_parts,
                                    select_across)
from distill_plugins.terms.advisd import SPEC

from .episodes import TranscriptContext, TurnRecord
from .generation import HFGenerator, TurnSampling
from .prompts import chat_text, compact_prompt

__all__ = ["TermMixin", "AdviSDMixin", "AdvisedTurn", "AdvisorContext", "AdviceGenerator", "advisor_text",
           "padded_batch", "score_completions", "evaluate_advisor"]


@dataclass
class AdvisedTurn(TurnRecord):
    """A :class:`TurnRecord` whose ``completion_ids`` are the advisor's advice and whose ``response`` is the
    executor's answer; plus what the term reads: the turn's user message, the advice text and the executor's
    prompts with / without the advice and its response ids."""

    user: str = ""
    advice: str = ""
    exec_with_ids: list[int] = field(default_factory=list)
    exec_without_ids: list[int] = field(default_factory=list)
    exec_response_ids: list[int] = field(default_factory=list)


def advisor_text(tokenizer, user: str, system: str | None) -> str:
    """The advisor's prompt text: the chat template over ``system`` and ``user``, open for the assistant's reply
    (no forced ``<action>``: the advisor writes free text)."""
    messages = ([{"role": "system", "content": system}] if system is not None else []) + \
        [{"role": "user", "content": user}]
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


class _Loop:
    """What the advisor context and the advice generator of one trainer share during a rollout: the turns waiting
    for advice (in the order their prompts were built) and the executor's results per episode."""

    def __init__(self, tokenizer, executor, params, advice_budget: int):
        self.tok, self.executor, self.params, self.advice_budget = tokenizer, executor, params, int(advice_budget)
        self.pending: list[tuple[int, list[int], str, str | None]] = []
        self.done: dict[int, dict[str, Any]] = {}

    def ids(self, text: str) -> list[int]:
        return self.tok(text, add_special_tokens=False)["input_ids"]


class AdvisorContext(TranscriptContext):
    """The advisor's turn context: the prompt :func:`play_episodes` generates from is the advisor's (user message +
    ``ask``); the recorded turn is an :class:`AdvisedTurn`. Bound to one trainer's loop by :meth:`bind`."""

    loop: _Loop | None = None

    @classmethod
    def bind(cls, loop: _Loop) -> type[AdvisorContext]:
        return type("AdvisorContext", (cls,), {"loop": loop})

    def prompt_ids(self, i, view, observation) -> list[int]:
        user = compact_prompt(view.task, observation, view.legal)
        ids = self.loop.ids(advisor_text(self.tokenizer, user + self.loop.params.ask, self.system))
        self.loop.pending.append((i, ids, user, self.system))
        return ids

    def record(self, i, observation, turn, env_reward) -> AdvisedTurn:
        self.history[i].append((observation, turn["action_key"]))
        return AdvisedTurn(**turn, reward=float(env_reward), **self.loop.done.pop(i))


class AdviceGenerator:
    """The generator :func:`play_episodes` calls each turn: the advisor (``advisor``, the rollout's own generator)
    samples the advice for the waiting turns, the frozen executor (an :class:`HFGenerator`) answers each executor
    prompt; returns ``(advice ids, executor text, advice log-probs)`` per prompt, so the row trains the advice and
    the env plays the executor's action."""

    def __init__(self, advisor, executor: HFGenerator, loop: _Loop):
        self.advisor, self.executor, self.loop = advisor, executor, loop
        self.eos = advisor.eos if hasattr(advisor, "eos") else executor.eos
        self.sampling_logprobs = bool(getattr(advisor, "sampling_logprobs", False))

    def generate(self, prompts: Sequence[Sequence[int]], params: TurnSampling):
        loop = self.loop
        waiting, loop.pending = loop.pending[:len(prompts)], loop.pending[len(prompts):]
        if len(waiting) != len(prompts) or any(list(w[1]) != list(p) for w, p in zip(waiting, prompts)):
            raise RuntimeError("advisd: the advisor prompts generated are not the ones the context built (a "
                               "Guided-OPD teacher or another generator in between?)")
        advice_params = dataclasses.replace(params, max_new_tokens=loop.advice_budget)
        advice = self.advisor.generate(prompts, advice_params)
        fmt, tok = loop.params.advice_format, loop.tok
        with_ids, without_ids = [], []
        for (_, _, user, system), (_, text, _) in zip(waiting, advice):
            with_ids.append(loop.ids(chat_text(tok, user + advice_text(fmt, text.strip()), system)))
            without_ids.append(loop.ids(chat_text(tok, user, system)))
        answers = self.executor.generate(with_ids, params)
        out = []
        for (i, _, user, _), (a_ids, a_text, a_lps), w, wo, (r_ids, r_text, _) in zip(waiting, advice, with_ids,
                                                                                     without_ids, answers):
            loop.done[i] = dict(user=user, advice=a_text.strip(), exec_with_ids=w, exec_without_ids=wo,
                                exec_response_ids=list(r_ids))
            out.append((list(a_ids), r_text, a_lps))
        return out


def padded_batch(rows: Sequence[tuple[Sequence[int], Sequence[int]]], pad: int
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(prompt, completion)`` rows in TRL's completion layout: ``ids`` / ``att`` ``[N, P + L]`` (prompt left-padded
    to P, completion right-padded to L) and the completion mask ``[N, L]``."""
    p_len = max(len(p) for p, _ in rows)
    c_len = max(max(len(c) for _, c in rows), 1)
    ids = torch.full((len(rows), p_len + c_len), pad, dtype=torch.long)
    att = torch.zeros_like(ids)
    cmask = torch.zeros(len(rows), c_len)
    for i, (p, c) in enumerate(rows):
        ids[i, p_len - len(p):p_len] = torch.tensor(list(p), dtype=torch.long)
        if len(c):
            ids[i, p_len:p_len + len(c)] = torch.tensor(list(c), dtype=torch.long)
        att[i, p_len - len(p):p_len + len(c)] = 1
        cmask[i, :len(c)] = 1
    return ids, att, cmask


def completion_logits(model, ids: torch.Tensor, att: torch.Tensor, n: int, temperature: float = 1.0) -> torch.Tensor:
    """``[N, n, V]`` float logits (divided by ``temperature``) that predict the last ``n`` positions of ``ids``."""
    logits = model(input_ids=ids, attention_mask=att, logits_to_keep=n + 1).logits[:, :-1]
    return logits.float() / float(temperature)


@torch.no_grad()
def score_completions(model, rows: Sequence[tuple[Sequence[int], Sequence[int]]], pad: int,
                      temperature: float = 1.0, batch_size: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """The log-probs ``[N, L]`` of each row's completion given its prompt under ``model`` (no gradient, in the
    model's current mode) and the completion mask ``[N, L]``."""
    ids, att, cmask = padded_batch(rows, pad)
    device = next(model.parameters()).device
    parts = []
    for lo in range(0, ids.size(0), batch_size):
        i, a = ids[lo:lo + batch_size].to(device), att[lo:lo + batch_size].to(device)
        logits = completion_logits(model, i, a, cmask.size(1), temperature)
        parts.append(torch.log_softmax(logits, -1).gather(-1, i[:, -cmask.size(1):, None]).squeeze(-1).cpu())
    return torch.cat(parts), cmask


def _pad_id(tokenizer) -> int:
    return int(tokenizer.eos_token_id if tokenizer.pad_token_id is None else tokenizer.pad_token_id)


class AdviSDMixin:
    """Put before the credit mixin: ``class T(AdviSDMixin, CreditMixin, GRPOTrainer)``; parameters from the class
    attribute ``terms["advisd"]`` (:class:`distill_plugins.advisd.AdviSDParams`)."""

    terms: dict[str, dict[str, Any]] = {}

    def __init__(self, *args, **kwargs):
        from .rollouts import TurnRollout

        self._advisd_params = p = SPEC.make_params(**dict(self.terms.get("advisd") or {}))
        rollout = kwargs.get("rollout_func")
        if not isinstance(rollout, TurnRollout) or type(rollout)._play is not TurnRollout._play:
            raise ValueError("term 'advisd' needs rollout_func=agentcredit.trl.rollouts.TurnRollout (recipes: "
                             "agentcredit.rollout: turns): it turns the rollout's turns into advisor + executor turns")
        if rollout.context is not TranscriptContext or rollout.prompt != "compact":
            raise ValueError(f"term 'advisd' needs the compact transcript prompt (agentcredit.prompt: compact, "
                             f"rollout: turns); got prompt={rollout.prompt!r}, context {rollout.context.__name__}")
        super().__init__(*args, **kwargs)
        ds = getattr(self.accelerator.state, "deepspeed_plugin", None)
        sharded = bool(getattr(self, "is_fsdp_enabled", False)) or int(getattr(ds, "zero_stage", 0) or 0) == 3
        if sharded and int(self.accelerator.num_processes) > 1:
            raise ValueError("term 'advisd' cannot run with sharded weights (FSDP or DeepSpeed ZeRO-3) on several "
                             "processes: its scoring and distillation forwards run only on the processes that hold "
                             "decisions, and a sharded forward needs every process; use DDP or ZeRO-1/2")
        self._advisd_rollout = rollout
        self._advisd_chunks: list[list[dict[str, Any]]] = []
        tok = self.processing_class
        self._advisd_executor = self._advisd_build_executor(p.executor)
        budget = min(p.advice_tokens, int(getattr(self.args, "max_completion_length", None) or p.advice_tokens))
        self._advisd_loop = _Loop(tok, self._advisd_executor, p, budget)
        rollout.context = AdvisorContext.bind(self._advisd_loop)
        inner_play = rollout._play

        def play(model, tokenizer, specs, **kw):
            if kw.get("guide") is not None:
                raise ValueError("term 'advisd' cannot mix Guided-OPD teacher turns into the advisor's rollout "
                                 "(schedule: guided); drop one of them")
            self._advisd_loop.pending, self._advisd_loop.done = [], {}
            executor = HFGenerator(self._advisd_executor, tokenizer, batch_size=rollout.batch_size)
            kw["generator"] = AdviceGenerator(kw["generator"], executor, self._advisd_loop)
            return inner_play(model, tokenizer, specs, **kw)

        rollout._play = play

    def _advisd_build_executor(self, path: str | None):
        """The frozen executor: a copy of the policy as built (None) or the model at ``path``; eval mode, no grad."""
        if path is None:
            executor = copy.deepcopy(self.accelerator.unwrap_model(self.model))
            executor.requires_grad_(False)
            executor.eval()
        else:
            executor = load_executor(path, self.processing_class)
        return executor.to(self.accelerator.device)

    # -- after the round: influence, selection, the teacher prompts ----------------------------------------------
    def _generate_and_score_completions(self, inputs):
        output = super()._generate_and_score_completions(inputs)
        if not self.model.training:
            return output
        p = self._advisd_params
        decisions = []
        for ep in self._advisd_rollout.last_episodes:
            for tr in ep.turns:
                if isinstance(tr, AdvisedTurn):
                    decisions.append(self._advisd_decision(ep, tr))
        m = self._metrics["train"]
        m["agentcredit_advisd/decisions"].append(float(len(decisions)))
        n = max(int(self.args.steps_per_generation), 1)
        self._advisd_chunks = [[] for _ in range(n)]
        influence = torch.zeros(0)
        if decisions:
            model = self.accelerator.unwrap_model(self.model)
            pad, temp = _pad_id(self.processing_class), float(self.args.temperature or 1.0)
            was = model.training
            model.eval()
            try:
                resp = [d["exec_response_ids"] for d in decisions]
                lw, mask = score_completions(model, [(d["exec_with_ids"], r) for d, r in zip(decisions, resp)], pad,
                                             temp)
                lo, _ = score_completions(model, [(d["exec_without_ids"], r) for d, r in zip(decisions, resp)], pad,
                                          temp)
            finally:
                model.train(was)
            influence = advice_influence(lw, lo, mask, reduce=p.reduce)
        valid = torch.tensor([len(d["advice"]) > 0 for d in decisions], dtype=torch.bool)
        # every process joins the selection, with or without decisions; the metrics are the whole round's
        selected, (r_inf, r_valid, r_sel) = self._advisd_select(influence.double(), valid)
        if bool(r_valid.any()):
            m["agentcredit_advisd/selected_frac"].append(float(r_sel.sum()) / len(r_valid))
            m["agentcredit_advisd/influence"].append(float(r_inf[r_valid].mean()))
            m["agentcredit_advisd/selected_influence"].append(float(r_inf[r_sel].mean()))
        if not bool(valid.any()):
            return output
        chosen = [dict(d, influence=float(x)) for d, x, s in zip(decisions, influence.tolist(), selected.tolist()) if s]
        self._advisd_chunks = [chosen[j::n] for j in range(n)]
        return output

    def _advisd_select(self, influence: torch.Tensor, valid: torch.Tensor):
        """This process's selected decisions and the whole round's ``(influence, valid, selected)``: ``k = ceil(
        fraction * n)`` over every process's decisions when there are several (an all-gather of the influences;
        the random draw is seeded by ``seed + global_step``, the same on every process)."""
        p = self._advisd_params
        parts = [(influence.tolist(), valid.tolist())]
        if int(self.accelerator.num_processes) > 1:
            from accelerate.utils import gather_object

            parts = gather_object(parts)
        gen = torch.Generator().manual_seed(p.seed + int(self.state.global_step))
        shares = select_across(parts, p.fraction, mode=p.mode, generator=gen)
        r_inf, r_valid, _ = flatten_parts(parts)
        rank = int(self.accelerator.process_index) if len(parts) > 1 else 0
        return shares[rank], (r_inf, r_valid, torch.cat(shares))

    def _advisd_decision(self, ep, tr: AdvisedTurn) -> dict[str, Any]:
        p, tok = self._advisd_params, self.processing_class
        fb = feedback_text(p.feedback, success=ep.success, ret=ep.total_reward, turns=len(ep.turns), t=tr.t,
                           action=tr.action_text, reward=tr.reward)
        system = self._advisd_rollout.system
        teacher = tok(advisor_text(tok, tr.user + p.ask + fb, system), add_special_tokens=False)["input_ids"]
        return {"prompt": list(tr.prompt_ids), "advice": list(tr.completion_ids), "teacher_prompt": teacher,
                "exec_with_ids": tr.exec_with_ids, "exec_without_ids": tr.exec_without_ids,
                "exec_response_ids": tr.exec_response_ids}

    # -- the term on each micro-batch ---------------------------------------------------------------------------
    def _compute_loss(self, model, inputs):
        loss = super()._compute_loss(model, inputs)
        if not self.model.training or not self._advisd_chunks:
            return loss
        chunk = self._advisd_chunks[self._step % len(self._advisd_chunks)]
        if not chunk:
            return loss
        w = float(self._advisd_params.weight)
        with torch.set_grad_enabled(w != 0.0 and torch.is_grad_enabled()):  # weight 0: the metrics only
            term = self._advisd_term(model, chunk)
        m = self._metrics["train"]
        m["agentcredit_advisd/loss"].append(float(term.detach()))
        m["agentcredit_advisd/weight"].append(w)
        if w == 0.0:
            return loss
        return loss + w * term / self.current_gradient_accumulation_steps

    def _advisd_term(self, model, chunk: list[dict[str, Any]]) -> torch.Tensor:
        """``L_SD`` of the chunk's decisions: the student (``model``, with gradient) on the advisor prompt and the
        teacher (``model``, no gradient) on the feedback prompt, both at the advice tokens."""
        pad, temp = _pad_id(self.processing_class), float(self.args.temperature or 1.0)
        device = self.accelerator.device
        s_ids, s_att, amask = padded_batch([(d["prompt"], d["advice"]) for d in chunk], pad)
        t_ids, t_att, _ = padded_batch([(d["teacher_prompt"], d["advice"]) for d in chunk], pad)
        n = amask.size(1)
        with self.accelerator.autocast():
            student = completion_logits(model, s_ids.to(device), s_att.to(device), n, temp)
            with torch.no_grad():
                teacher = completion_logits(model, t_ids.to(device), t_att.to(device), n, temp)
        selected = torch.ones(len(chunk), dtype=torch.bool, device=device)
        return advisd_loss(student, teacher, amask.to(device), selected)


def load_executor(path: str, tokenizer):
    """The frozen executor at ``path`` (a folder or a built-in model name; eval mode, no gradient); a
    ``ValueError`` when it cannot read every token of the advisor's ``tokenizer``."""
    from transformers import AutoModelForCausalLM

    from ..models import resolve_model

    executor = AutoModelForCausalLM.from_pretrained(resolve_model(path))
    vocab = executor.get_input_embeddings().num_embeddings
    if vocab < len(tokenizer):
        raise ValueError(f"term 'advisd': executor={path!r} has {vocab} token embeddings but the advisor's "
                         f"tokenizer has {len(tokenizer)}; the executor must share the advisor's tokenizer")
    executor.requires_grad_(False)
    executor.eval()
    return executor


#: the name :func:`agentcredit.trl.credit.term_mixin` looks up
TermMixin = AdviSDMixin


@torch.no_grad()
def evaluate_advisor(advisor, executor, tokenizer, env: str, env_options: dict | None, seeds, *,
                     params: dict[str, Any] | None = None, max_turns: int = 6, max_new_tokens: int = 8,
                     temperature: float = 1.0, greedy: bool = False, system: str | None = None,
                     batch_size: int = 64, sampling_seed: int | None = 0):
    """Held-out episodes of ``advisor`` advising ``executor`` (one per seed, the training turn format: the advisor
    context, ``advice_tokens`` of advice, the executor's ``max_new_tokens`` answer), summarised as
    :class:`agentcredit.trl.episodes.EvalResult`; ``params``: the term's parameters (``ask``, ``advice_format``,
    ``advice_tokens``). Reproducible as :func:`agentcredit.trl.episodes.evaluate`: the sampling stream
    ``torch.manual_seed(sampling_seed)`` is forked. Both models run in eval mode; their modes are restored."""
    import time

    import env_adapters

    from .episodes import eval_result, play_episodes

    p = SPEC.make_params(**dict(params or {}))
    t0 = time.perf_counter()
    loop = _Loop(tokenizer, executor, p, p.advice_tokens)
    gen = AdviceGenerator(HFGenerator(advisor, tokenizer, batch_size=batch_size),
                          HFGenerator(executor, tokenizer, batch_size=batch_size), loop)
    specs = [(env_adapters.make(env, **dict(env_options or {})), int(s)) for s in seeds]
    was = executor.training
    executor.eval()
    try:
        with torch.random.fork_rng(enabled=sampling_seed is not None):
            if sampling_seed is not None:
                torch.manual_seed(int(sampling_seed))
            episodes = play_episodes(advisor, tokenizer, specs, max_turns=max_turns, max_new_tokens=max_new_tokens,
                                     temperature=temperature, greedy=greedy, system=system, batch_size=batch_size,
                                     context=AdvisorContext.bind(loop), generator=gen)
    finally:
        executor.train(was)
    return eval_result(episodes, t0)
