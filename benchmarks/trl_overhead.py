"""Seconds per TRL training step with agentcredit's credit mixin against stock ``GRPOTrainer``, in the same run.

    python benchmarks/trl_overhead.py                 # tiny Qwen2, minigrid, one row per turn, 8 steps per trainer
    python benchmarks/trl_overhead.py --steps 20 --credits gigpo graphhca crbc

Every trainer gets the same tiny model (``tiny-qwen2``), the same ``agentcredit.trl.rollouts.TurnRollout`` on a seeded
MiniGrid room and the same GRPOConfig; only the trainer class differs (stock ``trl.GRPOTrainer`` or
``make_trainer(GRPOTrainer, credit=...)``). The runs alternate (stock, credit 1, credit 2, ..., repeated
``--repeats`` times) so that drift on the machine hits all of them; the first step of each run (warm-up) is left out
and the median step time of the rest is kept, then the best repeat. The ratio is credit / stock (target < 1.05).
The mixin's own time per step (building the StepTable and running the estimator) is printed as well; it is what
the ratio measures, the rest of a step being identical.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")


def step_times(trainer_cls, steps: int, workdir: str, env_options: dict, episodes: int, max_turns: int):
    """Median seconds per optimizer step (first step excluded) and the mixin's mean estimator seconds."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from transformers.trainer_callback import PrinterCallback
    from trl import GRPOConfig

    from agentcredit.models import resolve_model
    from agentcredit.trl.rollouts import TurnRollout

    class Clock(TrainerCallback):
        def __init__(self):
            self.marks = []

        def on_step_end(self, args, state, control, **kwargs):
            self.marks.append(time.perf_counter())

    path = resolve_model("tiny-qwen2")
    rollout = TurnRollout("minigrid", env_options, max_turns=max_turns, max_new_tokens=8)
    g = episodes * max_turns
    args = GRPOConfig(output_dir=workdir, max_steps=steps, num_generations=g, per_device_train_batch_size=2 * g,
                      max_completion_length=8, report_to="none", logging_steps=1, use_cpu=True, save_strategy="no",
                      seed=0, disable_tqdm=True, loss_type="dapo", beta=0.0)
    clock = Clock()
    trainer = trainer_cls(model=AutoModelForCausalLM.from_pretrained(path), args=args,
                          processing_class=AutoTokenizer.from_pretrained(path), reward_funcs=[rollout.reward_func],
                          rollout_func=rollout, train_dataset=TurnRollout.dataset(range(4 * steps)),
                          callbacks=[clock])
    start = time.perf_counter()
    trainer.remove_callback(PrinterCallback)  # the per-step log dicts; log_history still has them
    trainer.train()
    marks = [start] + clock.marks
    per_step = [b - a for a, b in zip(marks, marks[1:])][1:]
    est = [h["agentcredit/estimator_seconds"] for h in trainer.state.log_history
           if "agentcredit/estimator_seconds" in h]
    return statistics.median(per_step), (statistics.mean(est) if est else 0.0)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--credits", nargs="+", default=["gigpo", "graphhca"])
    ap.add_argument("--episodes", type=int, default=4, help="episodes per group (2 groups per step)")
    ap.add_argument("--max-turns", type=int, default=6)
    args = ap.parse_args(argv)

    import torch
    from trl import GRPOTrainer

    from agentcredit.trl import make_trainer

    torch.set_num_threads(os.cpu_count() or 1)
    env_options = {"size": 6, "moves": "absolute", "shaping": 1.0}
    trainers = {"stock": GRPOTrainer, **{c: make_trainer(GRPOTrainer, credit=c) for c in args.credits}}
    best = {name: (float("inf"), 0.0) for name in trainers}
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(args.repeats):
            for name, cls in trainers.items():
                sec, est = step_times(cls, args.steps, os.path.join(tmp, name), env_options, args.episodes,
                                      args.max_turns)
                if sec < best[name][0]:
                    best[name] = (sec, est)
    rows = 2 * args.episodes * args.max_turns
    print(f"TRL GRPOTrainer, tiny-qwen2, minigrid 4x4, {rows} turn rows per step, {args.steps} steps "
          f"(median, first step left out), best of {args.repeats}")
    print(f"{'trainer':<10} {'s/step':>8} {'ratio':>7} {'estimator s':>12}")
    base = best["stock"][0]
    for name, (sec, est) in best.items():
        print(f"{name:<10} {sec:8.3f} {sec / base:7.3f} {est:12.4f}")


if __name__ == "__main__":
    main()
