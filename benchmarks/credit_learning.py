"""Which step credit helps a real (tiny) LM learn, through TRL's real ``GRPOTrainer`` path?

    python benchmarks/credit_learning.py            # the measured configuration (see the defaults below)
    python benchmarks/credit_learning.py --quick    # a seconds-long smoke run (tests/trl/test_credit_learning.py)

Method:

1. **Warm start, once.** ``agentcredit sft`` (:func:`agentcredit.sft.run_sft`) fine-tunes ``tiny-qwen2`` (2 layers,
   hidden 64, 107k parameters, built locally) on MiniGrid's scripted expert (``expert_actions()``: a move that starts
   a shortest path) in the recipe's own turn format, stopped early (``--sft-steps``) so that its held-out success
   sits in the 10-30 % band. The checkpoint is saved once and every run starts from it. ``--sft-steps 0`` saves
   the recipe's model as it is: a pretrained LM with no warm start
   (``--recipe recipes/trl/minigrid_credit_learning_smollm2.yaml``, SmolLM2-135M-Instruct; its header has the
   command).
2. **RL, same budget for every method.** ``agentcredit compare recipes/trl/minigrid_credit_learning.yaml --credit
   <names> --seeds N --steps S --init <warm start>``: for each estimator and seed ``agentcredit train`` (TRL's
   ``GRPOTrainer`` + agentcredit's credit mixin) in a subprocess. The task is a 6x6
   MiniGrid room **without progress shaping** (+10 at the goal only, -0.1 per invalid action), up to 10 turns; the
   groups share a seed, so states recur across the group's episodes (what GiGPO's anchor groups, GraphHCA's graph
   and CRBC need). ``seed`` draws the training env seeds and TRL's sampling; it is the same list for every method.
3. **Held-out evaluation** (the recipe's ``eval`` block): 128 env seeds never trained on, one episode each, sampled at
   T = 1.0 with a fixed sampling seed; the harness's success rate and 95 % Wilson interval. The warm start is
   evaluated once (compare's start); each run is evaluated after training.

``mvpo`` reads a progress ``signature`` per step row; MiniGrid has no progress parser, so the TRL bridge gives it
App. A.3's fallback, the state and its depth bin (:func:`credit_plugins.estimators.mvpo.default_signature`).

The runs, their statistics and the report are ``agentcredit compare`` (:mod:`agentcredit.compare`) with ``--init``
set to the warm start; this script adds only the warm start. Output: the comparison's table (mean final held-out
success over seeds with its 95 % t-interval, pooled Wilson interval, paired difference to the first method, steps to
a training success of 0.5), its PNG and JSON, copied to ``benchmarks/results/credit_learning.{json,png}`` (``--out``).
A rerun reuses the warm start and every finished run; ``agentcredit compare ... --report-only`` redraws the report.
Nothing is tuned to a claim: a tie is reported as one.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

from agentcredit import compare

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "trl" / "minigrid_credit_learning.yaml"
RESULTS = ROOT / "benchmarks" / "results"

DEFAULTS = dict(methods="grpo,gigpo,graphhca,crbc,mvpo", seeds=5, steps=10, sft_steps=100, sft_lr=3e-3,
                sft_batch=32, sft_episodes=256, jobs=2, eval_seeds=128)
QUICK = dict(methods="grpo,gigpo", seeds=1, steps=1, sft_steps=2, sft_lr=3e-3, sft_batch=4, sft_episodes=8,
             jobs=1, eval_seeds=4)
#: --quick also shrinks the batch: one group of 2 episodes of at most 4 turns per step (8 rows)
QUICK_OVERRIDES = ["agentcredit.groups_per_step=1", "agentcredit.episodes_per_group=2", "agentcredit.max_turns=4",
                   "per_device_train_batch_size=8"]


def warm_start(cfg: argparse.Namespace, common: list[str], work: Path) -> Path:
    """The SFT checkpoint every run starts from, made once by ``agentcredit sft`` (reused while its summary records
    the same settings); compare evaluates it once as the runs' start."""
    out = work / "warm_start"
    want = {"steps": cfg.sft_steps, "batch_size": cfg.sft_batch, "learning_rate": cfg.sft_lr,
            "episodes": cfg.sft_episodes}
    try:
        have = json.loads((out / "sft_summary.json").read_text())
    except (OSError, ValueError):
        have = {}
    if any(have.get(k) != v for k, v in want.items()):
        if out.exists():
            shutil.rmtree(out)
        t0 = time.time()
        proc = compare.launch(["agentcredit.cli", "sft", str(cfg.recipe), *common, "--out", str(out), "--no-eval",
                               "--steps", str(cfg.sft_steps), "--batch-size", str(cfg.sft_batch), "--learning-rate",
                               str(cfg.sft_lr), "--episodes", str(cfg.sft_episodes)],
                              dict(os.environ, TRL_EXPERIMENTAL_SILENCE="1"), work / "warm_start.log")
        rc = proc.wait()
        if rc != 0:
            raise SystemExit(f"agentcredit sft failed (rc {rc}); log: {work / 'warm_start.log'}")
        print(f"warm start made in {time.time() - t0:.0f} s", flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="seconds-long smoke run (tiny batch, 1 step, 2 methods)")
    p.add_argument("--recipe", default=str(RECIPE))
    p.add_argument("--methods")
    p.add_argument("--seeds", type=int, help="seeds per method (0..N-1)")
    p.add_argument("--steps", type=int)
    p.add_argument("--sft-steps", type=int)
    p.add_argument("--sft-lr", type=float)
    p.add_argument("--sft-batch", type=int)
    p.add_argument("--sft-episodes", type=int)
    p.add_argument("--eval-seeds", type=int, help="held-out episodes (seeds 20000..)")
    p.add_argument("--jobs", type=int, help="runs in parallel (the cores are split between them)")
    p.add_argument("--workdir", help="warm start and comparison folders (default runs/credit_learning[_quick])")
    p.add_argument("--out", help="result JSON; the PNG goes next to it (default benchmarks/results/credit_learning.json; "
                   "--quick: in the workdir)")
    cfg = p.parse_args(argv)
    base = QUICK if cfg.quick else DEFAULTS
    for k, v in base.items():
        if getattr(cfg, k) is None:
            setattr(cfg, k, v)
    suffix = "_quick" if cfg.quick else ""
    work = Path(cfg.workdir or ROOT / "runs" / f"credit_learning{suffix}").resolve()
    work.mkdir(parents=True, exist_ok=True)
    out = Path(cfg.out or (work / "credit_learning_quick.json" if cfg.quick else RESULTS / "credit_learning.json"))
    out.parent.mkdir(parents=True, exist_ok=True)
    common = [f"agentcredit.eval.seeds=[20000,{20000 + cfg.eval_seeds}]"] + (QUICK_OVERRIDES if cfg.quick else [])
    t0 = time.time()
    try:  # every check before the warm start is made
        compare.plan(cfg.recipe, cfg.methods, cfg.seeds, steps=cfg.steps, jobs=cfg.jobs, out=work, overrides=common)
    except compare.CompareError as e:
        raise SystemExit(f"credit_learning: {e}") from None
    ckpt = warm_start(cfg, common, work)
    plan = compare.plan(cfg.recipe, cfg.methods, cfg.seeds, steps=cfg.steps, jobs=cfg.jobs, out=work,
                        overrides=common, init=str(ckpt))
    try:
        failed = compare.execute(plan)["failed"]
    except compare.Interrupted as e:
        print(f"credit_learning: {e}", file=sys.stderr)
        return 130
    result = compare.write_report(plan)
    shutil.copyfile(result["json"], out)
    png = None
    if result["png"]:
        png = shutil.copyfile(result["png"], out.with_suffix(".png"))
    print(compare.format_table(result))
    print(f"total {time.time() - t0:.0f} s; {out}" + (f"; {png}" if png else ""), flush=True)
    return 1 if failed or any(r["missing_seeds"] for r in result["table"]) else 0


if __name__ == "__main__":
    sys.exit(main())
