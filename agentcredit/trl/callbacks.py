"""Metrics for TRL runs: a JSONL callback and the learning-curve PNG.

:class:`MetricsCallback` is a ``transformers.TrainerCallback``: every logging step it appends one JSON line to
``<output_dir>/metrics.jsonl`` (``step``, ``epoch``, ``time`` = seconds since training began, and every numeric value
TRL logged, the ``agentcredit/*`` metrics of the credit bridge included). The end-of-training summary TRL logs
(``train_runtime``, ``train_loss``, ...) is not a step and is kept on the callback as :attr:`summary` instead.

:func:`plot_learning_curve` draws the file (matplotlib, Agg backend): train success per step, mean return,
valid-action rate, advantage mean/std, and the held-out success before/after training as points with their 95 %
intervals. TensorBoard, where installed, is TRL's own ``report_to: tensorboard`` (the recipe loader adds it).
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Any

from transformers import TrainerCallback

__all__ = ["MetricsCallback", "StopCallback", "plot_learning_curve", "read_metrics"]

_SUMMARY_KEYS = ("train_runtime", "train_samples_per_second", "train_steps_per_second", "train_loss")


def _number(value: Any) -> float | int | None:
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, (int, float)):
        return value
    item = getattr(value, "item", None)  # 0-d tensors / numpy scalars
    if callable(item):
        try:
            out = item()
        except (TypeError, ValueError, RuntimeError):
            return None
        return out if isinstance(out, (int, float)) else None
    return None


class MetricsCallback(TrainerCallback):
    """Append one JSON line per logging step to ``<output_dir>/metrics.jsonl`` (rank 0 only).

    When training begins the file is truncated, or, when the trainer resumes from a checkpoint (``global_step > 0``
    at ``on_train_begin``), cut back to the rows of steps up to the checkpoint's and continued: the rows a killed run
    logged after its last checkpoint are replayed by the resumed run, not kept twice.
    """

    def __init__(self, path: str | os.PathLike | None = None):
        self.path = Path(path) if path is not None else None
        self.summary: dict[str, float] = {}
        self.rows = 0
        self._t0: float | None = None

    def _target(self, args) -> Path:
        if self.path is None:
            self.path = Path(args.output_dir or ".") / "metrics.jsonl"
        return self.path

    def on_train_begin(self, args, state, control, **kwargs):
        self._t0 = time.time()
        if state.is_world_process_zero:
            target = self._target(args)
            target.parent.mkdir(parents=True, exist_ok=True)
            resumed_at = int(state.global_step or 0)
            keep = [r for r in read_metrics(target) if int(r.get("step", 0)) <= resumed_at] if resumed_at else []
            target.write_text("".join(json.dumps(r) + "\n" for r in keep))
            self.rows = len(keep)
            if keep and isinstance(keep[-1].get("time"), (int, float)):  # the clock continues too
                self._t0 -= float(keep[-1]["time"])

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not state.is_world_process_zero or not logs:
            return
        numeric = {k: v for k, v in ((k, _number(v)) for k, v in logs.items()) if v is not None}
        if any(k in numeric for k in _SUMMARY_KEYS[:3]):
            self.summary.update(numeric)
            return
        if self._t0 is None:
            self._t0 = time.time()
        row = {"step": int(state.global_step), "epoch": state.epoch, "time": round(time.time() - self._t0, 3)}
        row.update({k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in numeric.items()
                    if k not in row})
        target = self._target(args)
        target.parent.mkdir(parents=True, exist_ok=True)
        with target.open("a", encoding="utf-8") as fh:
            fh.write(json.dumps(row) + "\n")
        self.rows += 1


class StopCallback(TrainerCallback):
    """A clean stop: once ``stop.signal`` is set (:class:`agentcredit.lifecycle.GracefulStop`), the step that is
    running finishes, a checkpoint is written (``control.should_save``) and training stops
    (``control.should_training_stop``). With a ``save_strategy`` other than ``"no"`` the last step is checkpointed
    too, so a finished run can be continued with a larger ``max_steps``."""

    def __init__(self, stop):
        self.stop = stop
        self.stopped_at: int | None = None

    def on_step_end(self, args, state, control, **kwargs):
        if getattr(self.stop, "signal", None) is not None:
            control.should_save = True
            control.should_training_stop = True
            self.stopped_at = int(state.global_step)
        elif state.max_steps and state.global_step >= state.max_steps and str(getattr(
                args.save_strategy, "value", args.save_strategy)) != "no":
            control.should_save = True
        return control


def read_metrics(path: str | os.PathLike) -> list[dict[str, Any]]:
    """The rows of a ``metrics.jsonl`` file (empty when it does not exist)."""
    p = Path(path)
    if not p.exists():
        return []
    return [json.loads(line) for line in p.read_text(encoding="utf-8").splitlines() if line.strip()]


def _eval_point(result: Any) -> tuple[float, float, float] | None:
    """``(rate, lower, upper)`` of a held-out eval result (an ``EvalResult`` or its dict), or ``None``."""
    if result is None:
        return None
    get = (lambda k: result.get(k)) if isinstance(result, dict) else (lambda k: getattr(result, k, None))
    rate = get("success_rate")
    if rate is None:
        return None
    ci = get("success_ci")
    if isinstance(ci, (list, tuple)) and len(ci) == 2:
        lo, hi = float(ci[0]), float(ci[1])
    elif isinstance(ci, (int, float)):  # a half-width
        lo, hi = rate - ci, rate + ci
    else:
        lo = hi = float(rate)
    return float(rate), lo, hi


def plot_learning_curve(metrics_jsonl: str | os.PathLike, eval_before: Any = None, eval_after: Any = None,
                        out_png: str | os.PathLike | None = None, title: str | None = None) -> str:
    """Draw the learning curve of ``metrics_jsonl`` to ``out_png`` (default: next to it); returns the PNG path."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    rows = read_metrics(metrics_jsonl)
    out = Path(out_png) if out_png is not None else Path(metrics_jsonl).with_name("learning_curve.png")
    steps = [r.get("step", i + 1) for i, r in enumerate(rows)]
    last_step = max(steps) if steps else 1

    def series(key):
        pts = [(s, r[key]) for s, r in zip(steps, rows) if isinstance(r.get(key), (int, float))]
        return [p[0] for p in pts], [p[1] for p in pts]

    fig, axes = plt.subplots(2, 2, figsize=(11, 7.5))
    ax = axes[0, 0]
    x, y = series("agentcredit/success")
    if x:
        ax.plot(x, y, marker="o", ms=3, label="train rollouts")
    for label, result, at, color in (("held-out before", eval_before, 0, "tab:gray"),
                                     ("held-out after", eval_after, last_step, "tab:red")):
        pt = _eval_point(result)
        if pt is not None:
            rate, lo, hi = pt
            ax.errorbar([at], [rate], yerr=[[max(rate - lo, 0.0)], [max(hi - rate, 0.0)]], fmt="s", ms=7,
                        capsize=5, color=color, label=f"{label}: {rate:.1%} [{lo:.1%}, {hi:.1%}]")
    ax.set_title("success rate (held-out: 95% interval)")
    ax.set_ylim(-0.02, 1.02)
    ax.legend(fontsize=8, loc="best")

    for ax, key, name in ((axes[0, 1], "agentcredit/return", "mean return"),
                          (axes[1, 0], "agentcredit/valid", "valid-action rate")):
        x, y = series(key)
        if x:
            ax.plot(x, y, marker="o", ms=3)
        else:
            ax.text(0.5, 0.5, f"no {key} logged", ha="center", va="center", transform=ax.transAxes)
        ax.set_title(name)
    axes[1, 0].set_ylim(-0.02, 1.02)

    ax = axes[1, 1]
    plotted = False
    for key, name in (("agentcredit/adv_mean", "advantage mean"), ("agentcredit/adv_std", "advantage std")):
        x, y = series(key)
        if x:
            ax.plot(x, y, marker="o", ms=3, label=name)
            plotted = True
    if plotted:
        ax.legend(fontsize=8)
    else:
        ax.text(0.5, 0.5, "no advantage stats logged", ha="center", va="center", transform=ax.transAxes)
    ax.set_title("advantages")
    from matplotlib.ticker import MaxNLocator

    for ax in axes.flat:
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel("optimizer step")
        ax.grid(alpha=0.3)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return str(out)
