"""RL only vs fixed-mix OPD+RL vs OPW vs TIDE vs TIDE's baselines (ATOD, RetireOPD, Guided-OPD) on the CPU demo
task, after the same number of steps.

    agentcredit sft recipes/trl/minigrid_gigpo.yaml --out runs/teacher/minigrid --steps 80 --learning-rate 3e-4 --episodes 512
    python -m benchmarks.opd_schedules --teacher runs/teacher/minigrid [--steps 8] [key=value ...]

Every method runs ``agentcredit train`` on ``recipes/trl/minigrid_gigpo.yaml`` (GiGPO credit; ``--recipe`` picks
another, e.g. the tiny-model geometry of ``recipes/trl/minigrid_credit_learning.yaml``) with the same seeds, steps
and held-out evaluation; only the ``agentcredit.schedule`` differs. The teacher's own held-out success (from
its ``sft_summary.json``) is the ceiling. Prints the table and writes ``opd_schedules.json`` and
``opd_schedules.png`` (success of the training rollouts per step, one line per method) to ``--out``; each method's
rollouts are archived in ``--out/<method>/rollouts.jsonl`` (``agentcredit ross`` input).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

METHODS = {
    "rl": [],
    "fixed": ["agentcredit.schedule=fixed", "agentcredit.schedule_params.w_opd=1.0"],
    "opw": ["agentcredit.schedule=opw", "agentcredit.schedule_params.warmup_steps={warmup}"],
    "tide": ["agentcredit.schedule=tide", "agentcredit.schedule_params.window={window}"],
    "atod": ["agentcredit.schedule=atod", "agentcredit.schedule_params.total_steps={steps}"],
    "retire": ["agentcredit.schedule=retire", "agentcredit.schedule_params.window={window}",
               "agentcredit.schedule_params.teacher_success={teacher_success}"],
    "guided": ["agentcredit.schedule=guided", "agentcredit.schedule_params.decay_steps={steps}"],
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--teacher", required=True, help="teacher checkpoint (agentcredit sft --out)")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--recipe", default="recipes/trl/minigrid_gigpo.yaml", help="the recipe every method runs "
                        "(relative to the repository root, or a path)")
    parser.add_argument("--out", default="runs/bench/opd_schedules")
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--no-before", action="store_true", help="skip the before-training evaluation (another "
                        "invocation with the same seeds did it)")
    parser.add_argument("overrides", nargs="*", help="recipe overrides for every method (key=value)")
    args = parser.parse_args(argv)
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    from agentcredit import train
    from agentcredit.recipe import load_recipe

    root = Path(__file__).resolve().parents[1]
    recipe_path = str(args.recipe if Path(args.recipe).is_absolute() else root / args.recipe)
    out = Path(args.out)
    results, curves = {}, {}
    summary = Path(args.teacher) / "sft_summary.json"
    teacher_eval = (json.loads(summary.read_text()).get("eval") or {}) if summary.exists() else {}
    for i, name in enumerate(args.methods.split(",")):
        extra = [o.format(warmup=max(args.steps // 2, 1), window=max(args.steps // 2, 2), steps=args.steps,
                          teacher_success=teacher_eval.get("success_rate", 1.0)) for o in METHODS[name]]
        if name != "rl":
            extra.append(f"agentcredit.teacher={args.teacher}")
        archive = out / name / "rollouts.jsonl"          # the run's own rollouts, for `agentcredit ross`
        archive.unlink(missing_ok=True)
        over = [*args.overrides, *extra, f"output_dir={out / name}", f"agentcredit.eval.before={str(i == 0 and not args.no_before).lower()}",
                f"agentcredit.rollout_options.archive={archive}"]
        # overwrite: each method's folder holds the last benchmark run's result, replaced on purpose
        res = train.run(load_recipe(recipe_path, over), max_steps=args.steps, overwrite=True)
        if res.before is not None:
            results["before"] = {"success": res.before.success_rate, "ci": list(res.before.success_ci),
                                 "valid": res.before.valid_rate}
        results[name] = {"success": res.after.success_rate, "ci": list(res.after.success_ci),
                         "valid": res.after.valid_rate, "train_seconds": round(res.train_seconds, 1)}
        rows = [json.loads(x) for x in Path(res.metrics_path).read_text().splitlines() if x.strip()]
        curves[name] = [r.get("agentcredit/success") for r in rows]
        (out / "opd_schedules.json").write_text(json.dumps({"steps": args.steps, "results": results,
                                                           "curves": curves, "partial": True}, indent=2) + "\n")
    ev = teacher_eval
    if ev:
        results["teacher"] = {"success": ev["success_rate"], "ci": list(ev["success_ci"]),
                              "valid": ev["valid_rate"]}
    print(f"\n{'method':<10}{'success':>9}{'95% interval':>20}{'valid':>8}{'train s':>9}")
    for name, r in results.items():
        interval = f"[{r['ci'][0]:.1%}, {r['ci'][1]:.1%}]"
        print(f"{name:<10}{r['success']:>9.1%}{interval:>20}{r['valid']:>8.1%}"
              f"{r.get('train_seconds', float('nan')):>9.0f}")
    (out / "opd_schedules.json").write_text(json.dumps({"steps": args.steps, "results": results, "curves": curves},
                                                       indent=2) + "\n")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for name, ys in curves.items():
        ax.plot(range(1, len(ys) + 1), ys, marker="o", label=f"{name} (held-out {results[name]['success']:.0%})")
    if "teacher" in results:
        ax.axhline(results["teacher"]["success"], ls="--", c="k", label="teacher (held-out)")
    ax.set_xlabel("step")
    ax.set_ylabel("training-rollout success")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "opd_schedules.png", dpi=100)
    print(out / "opd_schedules.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
