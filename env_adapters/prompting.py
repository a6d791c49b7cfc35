"""The prompt/parse layer every adapter shares (verl-agent's ``<think>``/``<action>`` format).

A response is ``<think>reasoning</think><action>one action</action>``. :func:`parse_action` takes the text of the
**last** ``<action>`` block; a response without one is invalid. An invalid step costs :data:`INVALID_PENALTY`
(verl-agent's 0.1 coefficient), leaves the game state unchanged, still counts as a step, and is recorded with
``action = -1`` (the StepTable's "unknown" key). It never raises.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

__all__ = ["INVALID_PENALTY", "parse_action", "format_action", "build_prompt", "rewrite_goal", "HistoryItem"]

#: Reward of a step whose response has no parseable or admissible action (verl-agent: invalid-action penalty 0.1).
INVALID_PENALTY = -0.1

_TAG = re.compile(r"</?action>", re.IGNORECASE)
_CJK = re.compile(r"[\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uac00-\ud7af]")

#: one past step shown in the prompt: (observation the action was taken in, action text or None if invalid)
HistoryItem = tuple[str, "str | None"]


def parse_action(response: str | None) -> str | None:
    """The stripped text of the last ``<action>…</action>`` block of ``response``; ``None`` when there is none, it is
    empty, or it contains CJK characters (verl-agent's ``alfworld_projection`` rejects those too).

    >>> parse_action("<think>box is above</think><action> up </action>")
    'up'
    >>> parse_action("I will go up") is None
    True
    """
    if not isinstance(response, str):
        return None
    block = _last_block(response)
    if block is None:
        return None
    action = " ".join(block.split())
    if not action or _CJK.search(action) or "<" in action:
        return None
    return action


def _last_block(text: str) -> str | None:
    """The last match of ``<action>(.*?)</action>`` (case-insensitive, across lines), found in one linear pass over
    the tags: the regex itself retries from every unclosed opening tag, which is quadratic in their number."""
    opens, closes = [], []
    for m in _TAG.finditer(text):
        (closes if m.group()[1] == "/" else opens).append(m.start())
    last, resume, j = None, 0, 0
    for start in opens:
        if start < resume:  # inside the previous block
            continue
        while j < len(closes) and closes[j] < start + len("<action>"):
            j += 1
        if j == len(closes):
            break
        last = text[start + len("<action>"):closes[j]]
        resume = closes[j] + len("</action>")
        j += 1
    return last


def format_action(action: str, think: str = "") -> str:
    """A well-formed response for ``action`` (scripted policies and tests)."""
    return f"<think>{think}</think><action>{action}</action>"


def build_prompt(task: str, history: Sequence[HistoryItem], observation: str,
                 legal_actions: Sequence[str] | None = None, history_length: int = 2) -> str:
    """The user prompt of one turn, in verl-agent's template.

    Args:
        task: the game's rules and goal (an adapter's ``task`` attribute).
        history: every past step of the rollout as ``(observation, action)``; ``action`` None marks an invalid step.
        observation: the current observation text.
        legal_actions: the admissible actions now, listed when given.
        history_length: how many of the most recent steps are shown (0 shows none).
    """
    if history_length < 0:
        raise ValueError(f"history_length={history_length}; it must be >= 0")
    step = len(history)
    lines = [task.strip()] if task else []
    shown = list(history)[-history_length:] if history_length else []
    if shown:
        lines.append(f"Prior to this step, you have already taken {step} step(s). Below are the most recent "
                     f"{len(shown)} observation(s) and the corresponding action(s) you took:")
        first = step - len(shown)
        for i, (obs, act) in enumerate(shown):
            lines.append(f"[Observation {first + i + 1}:\n{obs}\nAction {first + i + 1}: "
                         f"{act if act is not None else '(invalid)'}]")
    lines.append(f"You are now at step {step + 1} and your current observation is:\n{observation}")
    if legal_actions is not None:
        lines.append("Your admissible actions of the current situation are: ["
                     + ", ".join(f'"{a}"' for a in legal_actions) + "].")
    lines.append("Now it's your turn to take an action.\nYou should first reason step-by-step about the current "
                 "situation. This reasoning process MUST be enclosed within <think> </think> tags.\nOnce you've "
                 "finished your reasoning, you should choose an admissible action for current step and present it "
                 "within <action> </action> tags.")
    return "\n".join(lines)


def rewrite_goal(prompt: str, edits: Sequence[tuple[str, str]]) -> str:
    """``prompt`` with each ``(text, replacement)`` of ``edits`` applied at the **last** occurrence of ``text`` (the
    task sentence occurs once; the current observation comes after the history's, which stay as they are): the same
    prompt under another goal (:class:`env_adapters.base.GoalRanking`). A ``text`` the prompt lacks is a
    ``ValueError``: the prompt does not show the goal where the env says it does."""
    for old, new in edits:
        at = prompt.rfind(old) if old else -1
        if at < 0:
            raise ValueError(f"rewrite_goal: the prompt does not contain {old[:80]!r}; build it from the env's task "
                             f"and current observation (compact or verl-agent prompt)")
        prompt = prompt[:at] + new + prompt[at + len(old):]
    return prompt
