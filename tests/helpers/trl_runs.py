"""Short real GRPOTrainer runs on the tiny model, shared by tests/trl/test_trl_bridge.py and its two-process check.

Run as a script under ``torchrun --nproc_per_node 2 tests/helpers/trl_runs.py OUT.json`` it trains stock GRPO and the
mixin with ``credit="grpo"`` on the same data and writes each run's ``(loss, grad_norm)`` per step from rank 0.
"""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")


def length_reward(completions, **kwargs):
    """A reward with spread inside every group: the completion's length mod 5 (plain-text completions)."""
    return [float(len(c) % 5) for c in completions]


def train_plain(trainer_cls, output_dir: str, steps: int = 3, batch: int = 8, num_generations: int = 4,
                loss_type: str = "grpo", resume: str | None = None, trainer_kwargs: dict | None = None, **config):
    """Train ``trainer_cls`` on the tiny model for ``steps`` steps of a plain-text prompt dataset; return the
    trainer (its ``state.log_history`` holds loss and grad_norm per step). ``trainer_kwargs`` go to the trainer."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig

    from agentcredit.models import resolve_model

    path = resolve_model("tiny-qwen2")
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path)
    words = ["left", "right", "up", "down", "goal", "key", "door", "wall"]
    ds = Dataset.from_dict({"prompt": [f"move {w} {v}" for w in words for v in words]})
    config.setdefault("save_strategy", "no")
    args = GRPOConfig(output_dir=output_dir, max_steps=steps, num_generations=num_generations,
                      per_device_train_batch_size=batch, max_completion_length=10, report_to="none",
                      logging_steps=1, use_cpu=True, seed=0, learning_rate=1e-3,
                      loss_type=loss_type, disable_tqdm=True, **config)
    trainer = trainer_cls(model=model, reward_funcs=[length_reward], args=args, train_dataset=ds,
                          processing_class=tok, **(trainer_kwargs or {}))
    trainer.train(resume_from_checkpoint=os.path.join(output_dir, resume) if resume else None)
    return trainer


def train_turn_rollout_step(credit: str, params: dict, output_dir: str, **rollout_options) -> list:
    """One real GRPOTrainer step of ``make_trainer(GRPOTrainer, credit=credit, **params)`` on the tiny model with a
    5x5 MiniGrid ``TurnRollout`` (``rollout_options`` over ``max_new_tokens=4``); asserts the step logged one finite
    loss and returns the StepTables the bridge built (one per ``_agentcredit_table`` call)."""
    import math

    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from agentcredit.models import resolve_model
    from agentcredit.trl import make_trainer
    from agentcredit.trl.rollouts import TurnRollout

    path = resolve_model("tiny-qwen2")
    tok, model = AutoTokenizer.from_pretrained(path), AutoModelForCausalLM.from_pretrained(path)
    rollout = TurnRollout("minigrid", {"size": 5, "moves": "absolute", "view": "coords"},
                          **{"max_new_tokens": 4, **rollout_options})
    seen = []

    class Spy(make_trainer(GRPOTrainer, credit=credit, **params)):
        def _agentcredit_table(self, *args, **kwargs):
            steps = super()._agentcredit_table(*args, **kwargs)
            seen.append(steps)
            return steps

    args = GRPOConfig(output_dir=output_dir, max_steps=1, num_generations=12, per_device_train_batch_size=12,
                      max_completion_length=4, report_to="none", logging_steps=1, use_cpu=True, bf16=False,
                      save_strategy="no", temperature=1.0)
    trainer = Spy(model=model, processing_class=tok, reward_funcs=[rollout.reward_func], rollout_func=rollout,
                  train_dataset=TurnRollout.dataset(range(4)), args=args)
    trainer.train()
    step_losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(step_losses) == 1 and math.isfinite(step_losses[0])
    return seen


def turn_rollout_trainer(trainer_cls, output_dir: str, env: str = "minigrid", env_options: dict | None = None,
                         seeds=range(4), rollout_options: dict | None = None, **config):
    """An (untrained) ``trainer_cls`` on the tiny model with a ``TurnRollout`` of ``env`` (default: the 5x5 MiniGrid
    room of :func:`train_turn_rollout_step`), one group of 12 rows per step; ``config`` overrides ``GRPOConfig``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig

    from agentcredit.models import resolve_model
    from agentcredit.trl.rollouts import TurnRollout

    path = resolve_model("tiny-qwen2")
    tok, model = AutoTokenizer.from_pretrained(path), AutoModelForCausalLM.from_pretrained(path)
    options = {"size": 5, "moves": "absolute", "view": "coords"} if env_options is None else env_options
    rollout = TurnRollout(env, options, **{"max_new_tokens": 4, **(rollout_options or {})})
    config = {"max_steps": 1, "num_generations": 12, "per_device_train_batch_size": 12, "max_completion_length": 4,
              "report_to": "none", "logging_steps": 1, "use_cpu": True, "bf16": False, "save_strategy": "no",
              "temperature": 1.0, "seed": 0, **config}
    return trainer_cls(model=model, processing_class=tok, reward_funcs=[rollout.reward_func], rollout_func=rollout,
                       train_dataset=TurnRollout.dataset(seeds), args=GRPOConfig(output_dir=output_dir, **config))


def losses(trainer) -> list[tuple[float, float]]:
    return [(h["loss"], h["grad_norm"]) for h in trainer.state.log_history if "loss" in h and "grad_norm" in h]


def main(out: str) -> None:
    from trl import GRPOTrainer

    from agentcredit.trl import make_trainer

    rank = int(os.environ.get("RANK", "0"))
    result = {}
    # per_device 4 x 2 ranks = 8 rollouts per step, num_generations 8: every group spans both ranks
    for name, cls in (("stock", GRPOTrainer), ("grpo", make_trainer(GRPOTrainer, credit="grpo", eps=1e-4))):
        trainer = train_plain(cls, os.path.join(os.path.dirname(out), name), batch=4, num_generations=8)
        result[name] = losses(trainer)
        result["world"] = trainer.accelerator.num_processes
    if rank == 0:
        with open(out, "w") as f:
            json.dump(result, f)




def main_multiturn(out: str, credit: str = "gigpo", steps: int = 2) -> None:
    """Under torchrun: ``steps`` real steps of a multi-turn ``TurnRollout`` (MiniGrid, 2 turns, 4 episodes per group
    on each rank) with ``credit``; every rank writes ``out.rank<R>.json``: per step, the StepTable the mixin built
    over the gathered rows, the rows' (rank, row, turn), this rank's advantages and completion mask."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from agentcredit.trl import make_trainer
    from agentcredit.trl.rollouts import TurnRollout
    from agentcredit.verl.smoke import primed_tiny_model

    rank = int(os.environ.get("RANK", "0"))
    path = primed_tiny_model()  # answers in the action format, some invalid: returns differ, advantages do not vanish
    tok, model = AutoTokenizer.from_pretrained(path), AutoModelForCausalLM.from_pretrained(path)
    rollout = TurnRollout("minigrid", {"size": 5, "moves": "absolute", "view": "coords"}, max_turns=2,
                          max_new_tokens=6)
    records = []

    class Spy(make_trainer(GRPOTrainer, credit=credit)):
        def _agentcredit_table(self, output, rows, *args, **kwargs):
            table = super()._agentcredit_table(output, rows, *args, **kwargs)
            records.append({"table": {k: getattr(table, k).tolist() for k in
                                      ("group", "traj", "t", "state", "action", "reward", "success", "truncated")},
                            "rows": [(r.rank, r.row, r.turn) for r in rows]})
            return table

        def _generate_and_score_completions(self, inputs):
            output = super()._generate_and_score_completions(inputs)
            records[-1] |= {"advantages": output["advantages"].tolist(),
                            "mask": output["completion_mask"].tolist()}
            return output

    args = GRPOConfig(output_dir=os.path.join(os.path.dirname(out), f"multiturn-{credit}"), max_steps=steps,
                      num_generations=8, per_device_train_batch_size=8, max_completion_length=6, report_to="none",
                      logging_steps=1, use_cpu=True, bf16=False, save_strategy="no", temperature=1.5, seed=0,
                      learning_rate=1e-3, disable_tqdm=True)
    trainer = Spy(model=model, processing_class=tok, reward_funcs=[rollout.reward_func], rollout_func=rollout,
                  train_dataset=TurnRollout.dataset(range(8)), args=args)
    trainer.train()
    with open(f"{out}.rank{rank}.json", "w") as f:
        json.dump({"world": trainer.accelerator.num_processes, "records": records,
                   "losses": losses(trainer), "torch_threads": torch.get_num_threads()}, f)


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[2] == "multiturn":
        main_multiturn(sys.argv[1])
    else:
        main(sys.argv[1])
