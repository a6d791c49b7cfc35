"""``agentcredit train``: run a TRL recipe (:mod:`agentcredit.recipe`) with TRL's own ``GRPOTrainer``.

Nothing here is a trainer: :func:`run` loads the model (:func:`agentcredit.policy.load_model`), builds the
environment bridge from the recipe's ``agentcredit:`` block (the turn rollout of :mod:`agentcredit.trl.rollouts` or
TRL's tool loop, :mod:`agentcredit.trl.env_factory`; resolved at run time like a plugin path), composes
``agentcredit.trl.make_trainer(GRPOTrainer, credit=...)`` and calls ``trainer.train()``. Around it: a held-out
evaluation before and after (:mod:`agentcredit.evaluation`: success with its 95 % interval and the valid-action
rate), ``metrics.jsonl``, ``summary.json`` and ``learning_curve.png`` in the run's ``output_dir``.

With ``agentcredit.warm_start`` the model is first fine-tuned on the env's scripted expert
(:func:`agentcredit.sft.run_sft`, the rollout's own turn format) into ``<output_dir>/warm_start``, and RL starts from
there; the ``before`` evaluation is the warm start's. A rerun with the same model and warm-start settings reuses
that checkpoint.

A run is never lost (:mod:`agentcredit.lifecycle`): :func:`preflight` checks every path before any model loads and
takes the folder's lock; a folder that holds an earlier run is refused unless ``resume_from_checkpoint`` (true: the
latest ``checkpoint-N``, or a path) resumes it, with the trainer's, the estimator's and the scheduler's state, the
data order and RNG, the metrics log and the archive continued, or ``overwrite`` (``--overwrite``) clears it. The
trained policy goes to ``output_dir/final`` (:func:`save_final`). SIGINT / SIGTERM stop after the current step with a
checkpoint, the summary and the curve (``RunResult.interrupted``: the exit code).
"""

from __future__ import annotations

import json
import os
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import lifecycle, models, policy
from .evaluation import as_dict, evaluate, format_eval_table, paired_before_after, write_eval_episodes
from .recipe import Recipe, RecipeError, check_seed_budget, grpo_config_error, resolved_yaml, training_processes

__all__ = ["run", "RunResult", "train_seeds", "preflight", "save_final", "load_command", "warm_start",
           "training_processes"]


@dataclass
class RunResult:
    """What :func:`run` produced. ``before``/``after`` are the bridge's ``EvalResult`` (``None`` when skipped)."""

    output_dir: str
    steps: int
    wall_seconds: float
    train_seconds: float
    before: Any = None
    after: Any = None
    metrics_path: str = ""
    summary_path: str = ""
    png_path: str = ""
    summary: dict[str, Any] = field(default_factory=dict)
    final_model: str | None = None  #: output_dir/final (None when the run was interrupted)
    interrupted: int = 0  #: 128 + the signal that stopped the run cleanly; 0 when it ran to the end
    run_id: str = ""


def train_seeds(recipe: Recipe, max_steps: int, seed: int) -> list[int]:
    """``max_steps * groups_per_step`` distinct seeds from ``train_seeds``, never an eval seed; deterministic."""
    ac = recipe.agentcredit
    check_seed_budget(ac, max_steps)
    lo, hi = ac.train_seeds
    e_lo, e_hi = ac.eval.seeds if ac.eval is not None else (0, 0)
    need = max_steps * ac.groups_per_step
    rng = random.Random(seed)
    if hi - lo <= 1_000_000:
        pool = [s for s in range(lo, hi) if not e_lo <= s < e_hi]
        return rng.sample(pool, need)
    out: list[int] = []
    seen: set[int] = set()
    while len(out) < need:  # a huge range: rejection sampling (the budget check guarantees termination)
        s = rng.randrange(lo, hi)
        if s not in seen and not e_lo <= s < e_hi:
            seen.add(s)
            out.append(s)
    return out


def warm_start(recipe: Recipe, out_dir: Path) -> str:
    """The checkpoint of ``agentcredit.warm_start`` in ``out_dir/warm_start``: reused when its ``sft_summary.json``
    records the same fingerprint (:func:`agentcredit.sft.fingerprint`), else made now (:func:`agentcredit.sft.run_sft`)
    in a sibling folder and renamed into place, so an interrupted run never leaves weights a rerun would reuse."""
    from . import sft

    ws = recipe.agentcredit.warm_start
    if training_processes() > 1:
        raise RecipeError("agentcredit.warm_start runs in one process: make it first with `agentcredit sft RECIPE "
                          "--out DIR`, then launch the multi-process run with model_name_or_path=DIR "
                          "agentcredit.warm_start=null")
    target = out_dir / "warm_start"
    want = sft.fingerprint(recipe, episodes=ws.episodes, steps=ws.steps, batch_size=ws.batch_size,
                           learning_rate=ws.learning_rate, **sft.player_setting(ws.policy))
    done = target / "sft_summary.json"
    if done.exists() and (target / "config.json").exists():
        try:
            have = json.loads(done.read_text()).get("fingerprint")
        except (OSError, ValueError):
            have = None
        if have == want:
            print(f"agentcredit train: warm start reused from {target}", flush=True)
            return str(target)
    who = "the scripted expert" if ws.policy == "expert" else "uniformly random legal actions"
    print(f"agentcredit train: warm start: {ws.steps} supervised steps on {who} -> {target}", flush=True)
    models.build_atomically(target, lambda tmp: sft.run_sft(
        recipe, str(tmp), episodes=ws.episodes, steps=ws.steps, batch_size=ws.batch_size,
        learning_rate=ws.learning_rate, eval=False, final_out=str(target), player=ws.policy), replace=True)
    return str(target)


def _resume_target(value: Any, out_dir: Path) -> Path | None:
    """``resume_from_checkpoint``: unset/false -> None; true/"latest" -> the latest ``checkpoint-N``; a path -> it."""
    if value is None or value is False or (isinstance(value, str) and value.strip().lower() in ("", "false", "no")):
        return None
    if value is True or (isinstance(value, str) and value.strip().lower() in ("true", "yes", "latest")):
        found = lifecycle.latest_checkpoint(out_dir)
        if found is None:
            raise RecipeError(f"resume_from_checkpoint=true, but output_dir={str(out_dir)!r} holds no checkpoint-N "
                              f"folder to resume (a run writes them with save_strategy=steps save_steps=N, and on a "
                              f"clean stop); start anew with --overwrite, or give the checkpoint's path")
        return found
    path = lifecycle.check_read_path("resume_from_checkpoint", value, "checkpoint folder")
    if not (path / "trainer_state.json").exists():
        raise RecipeError(f"resume_from_checkpoint={str(value)!r} is not a trainer checkpoint (no trainer_state.json "
                          f"in it); give a checkpoint-N folder of an agentcredit train output_dir")
    return path


def _keep_archive_until(path: Path, run_id: str, step: int) -> int:
    """On resume: keep the archive records of run ``run_id`` played before the checkpoint's ``step`` (the resumed run
    plays the later ones again); a record of another run is an error. Returns the records kept."""
    kept, other = [], set()
    for line in path.read_text(encoding="utf-8").splitlines():
        if not line.strip():
            continue
        rec = json.loads(line)
        if rec.get("run", "") != run_id:
            other.add(rec.get("run", "") or "(no run id)")
        elif int(rec.get("step", 0)) < step:
            kept.append(line)
    if other:
        raise RecipeError(f"agentcredit.rollout_options.archive={str(path)!r} holds rollouts of other runs "
                          f"({', '.join(sorted(other))}) than the one resumed ({run_id}); give the resumed run "
                          f"another archive path")
    path.write_text("".join(ln + "\n" for ln in kept), encoding="utf-8")
    return len(kept)


def preflight(recipe: Recipe, config: Any, overwrite: bool = False) -> dict[str, Any]:
    """Everything a run can get wrong before any model loads: ``output_dir`` is a writable folder, no other live run
    holds it (:class:`agentcredit.lifecycle.RunLock`, kept in the result's ``lock``), an earlier run in it is resumed
    or explicitly overwritten (never silently mixed), every path it reads exists (model, teacher, checkpoint) and
    every file it writes (the rollout archive) is writable. Returns ``out_dir``, ``lock``, ``resume`` (a checkpoint
    folder or None), ``run_id`` and ``archive``."""
    from .trl.generation import check_vllm_settings

    ac = recipe.agentcredit
    try:  # before TRL starts a vLLM engine the multi-turn rollouts could not drive
        check_vllm_settings(config, training_processes())
    except ValueError as e:
        raise RecipeError(str(e)) from None
    out_dir = lifecycle.check_out_dir("output_dir", config.output_dir)
    lifecycle.check_model_path("model_name_or_path", recipe.model_args.get("model_name_or_path"),
                               fix="give an existing model folder, a hub id or a built-in name")
    if ac.teacher is not None and ac.teacher != "ema":
        lifecycle.check_model_path("agentcredit.teacher", ac.teacher,
                                   fix="make one with `agentcredit sft RECIPE --out DIR` and pass that DIR")
    archive = ac.rollout_options.get("archive")
    if archive is not None:
        archive = lifecycle.check_out_file("agentcredit.rollout_options.archive", archive)
    lock = lifecycle.RunLock(out_dir).acquire()
    try:
        resume = _resume_target(getattr(config, "resume_from_checkpoint", None), out_dir)
        if resume is not None and overwrite:
            raise RecipeError("--overwrite and resume_from_checkpoint exclude each other: resume the run, or start "
                              "it anew")
        earlier = lifecycle.previous_run(out_dir)
        if resume is None and earlier:
            if not overwrite:
                raise RecipeError(f"output_dir={str(out_dir)!r} already holds a run ({', '.join(earlier[:6])}); "
                                  f"continue it with resume_from_checkpoint=true, or start a new one in another "
                                  f"folder (output_dir=...) or over this one with --overwrite (deletes those outputs; "
                                  f"a warm_start is kept)")
            lifecycle.clear_previous_run(out_dir, [archive] if archive is not None else [])
        elif resume is None and archive is not None and archive.exists() and archive.stat().st_size:
            if not overwrite:
                raise RecipeError(f"agentcredit.rollout_options.archive={str(archive)!r} already holds another "
                                  f"run's rollouts; a new run would silently extend it (and ross would train on the "
                                  f"mixture): give a new archive path, or --overwrite to start it afresh")
            archive.unlink()
        info = lifecycle.read_run(out_dir) if resume is not None else {}
        run_id = info.get("run_id") or lifecycle.new_run_id()
        if resume is not None and archive is not None and archive.exists():
            step = json.loads((resume / "trainer_state.json").read_text()).get("global_step", 0)
            _keep_archive_until(archive, run_id, int(step))
    except BaseException:
        lock.release()
        raise
    return {"out_dir": out_dir, "lock": lock, "resume": resume, "run_id": run_id, "archive": archive,
            "previous_max_steps": info.get("max_steps")}


def save_final(trainer, tokenizer, recipe: Recipe, target: Path, info: dict[str, Any]) -> str:
    """The trained policy in ``target``: a plain checkpoint (a LoRA run's adapter merged in, the adapter itself in
    ``target/adapter``), its tokenizer, ``recipe.yaml`` (the recipe with its overrides) and ``agentcredit_run.json``;
    written aside and renamed into place. Loadable by ``model_name_or_path=`` and ``agentcredit ross --model``."""
    model = trainer.accelerator.unwrap_model(trainer.model)

    def build(tmp: Path) -> None:
        m = model
        if callable(getattr(m, "merge_and_unload", None)):  # LoRA: the adapter, then a merged plain checkpoint
            m.save_pretrained(tmp / "adapter")
            m = m.merge_and_unload()
        m.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / "recipe.yaml").write_text(resolved_yaml(recipe))
        (tmp / "agentcredit_run.json").write_text(json.dumps(info, indent=2, default=str) + "\n")

    models.build_atomically(target, build, replace=True)
    return str(target)


def _command(recipe: Recipe, eval: bool, extra: str = "") -> str:  # noqa: A002
    import shlex

    words = ["agentcredit", "train", recipe.path, *[o for o in recipe.overrides
                                                   if not o.split("=", 1)[0].startswith("resume_from_checkpoint")]]
    if not eval:
        words.append("--no-eval")
    return shlex.join(words) + (f" {extra}" if extra else "")


def load_command(recipe: Recipe, final: str) -> str:
    """How to continue from the trained model (a new RL run starting from it)."""
    import shlex

    extra = [f"model_name_or_path={final}", "output_dir=" + str(Path(final).parent) + "-continued"]
    if recipe.agentcredit.warm_start is not None:
        extra.append("agentcredit.warm_start=null")
    return shlex.join(["agentcredit", "train", recipe.path, *extra])


def run(recipe: Recipe, max_steps: int | None = None, eval: bool = True,  # noqa: A002 - the CLI's word
        overwrite: bool = False) -> RunResult:
    """Train ``recipe`` with TRL's GRPOTrainer and the recipe's credit estimator; see the module docstring.

    ``max_steps`` overrides the recipe's (smoke runs); ``eval=False`` skips the held-out evaluations; ``overwrite``
    replaces an earlier run in ``output_dir`` (otherwise refused unless ``resume_from_checkpoint`` resumes it).
    The trained model goes to ``output_dir/final`` (:func:`save_final`). SIGINT / SIGTERM stop cleanly after the
    current step (checkpoint, summary, curve; ``RunResult.interrupted`` is the exit code); a second one stops at once.
    """
    t_start = time.time()
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

    ac = recipe.agentcredit
    changes = {}
    if max_steps is not None:
        if max_steps < 1:
            raise RecipeError(f"--max-steps must be a positive integer, got {max_steps}")
        changes["max_steps"] = int(max_steps)
    try:
        config = recipe.grpo_config(**changes)
    except (ValueError, TypeError) as e:
        raise RecipeError(grpo_config_error(e)) from e
    steps = int(config.max_steps)
    plan = preflight(recipe, config, overwrite=overwrite)
    try:
        return _run(recipe, config, plan, steps, eval, t_start)
    finally:
        plan["lock"].release()


def _run(recipe: Recipe, config: Any, plan: dict[str, Any], steps: int, eval: bool,  # noqa: A002
         t_start: float) -> RunResult:
    import torch

    if not os.environ.get("OMP_NUM_THREADS"):
        torch.set_num_threads(os.cpu_count() or 1)

    from .trl import grpo_trainer, make_trainer
    from .trl.callbacks import MetricsCallback, StopCallback, plot_learning_curve

    ac = recipe.agentcredit
    out_dir, resume, run_id = plan["out_dir"], plan["resume"], plan["run_id"]
    info = {"run_id": run_id, "recipe": str(recipe.path), "overrides": list(recipe.overrides), "status": "running",
            "pid": os.getpid(), "started": time.strftime("%Y-%m-%d %H:%M:%S"), "max_steps": steps,
            "resumed_from": str(resume) if resume is not None else None}
    lifecycle.write_run(out_dir, info)
    if resume is not None:
        before_steps = plan.get("previous_max_steps")
        note = (f"; max_steps {before_steps} -> {steps}: the train seeds past step "
                f"{json.loads((resume / 'trainer_state.json').read_text()).get('global_step', 0)} differ from those "
                f"the first run would have played" if before_steps not in (None, steps) else "")
        print(f"agentcredit train: resuming run {run_id} from {resume}{note}", flush=True)
    seeds = train_seeds(recipe, steps, int(config.seed))
    do_before = bool(eval and ac.eval is not None and ac.eval.before)
    do_after = bool(eval and ac.eval is not None and ac.eval.after)

    # model (after the supervised warm start, when the recipe asks for one)
    start = warm_start(recipe, out_dir) if ac.warm_start is not None else None
    model_path, tokenizer, model = policy.load_model(recipe, start)
    model, trainable, total = policy.adapt_model(model, recipe)
    print(f"agentcredit train: {recipe.path} | model {recipe.model_args['model_name_or_path']} ({model_path}) | "
          f"{trainable:,} of {total:,} parameters trainable | env {ac.env} {ac.env_options} | bridge {ac.bridge} | "
          f"credit {ac.credit} {ac.credit_params} adv_scale {ac.adv_scale} | {steps} steps x "
          f"{ac.groups_per_step} groups x {ac.episodes_per_group} episodes", flush=True)
    print(f"agentcredit train: precision {recipe.precision}", flush=True)

    # environment bridge
    if ac.bridge == "rollout_func":
        from .recipe import rollout_class

        from credit_plugins.estimators.mix import reads_extra

        # TJPO (or a mix with a tjpo part) reads the env's per-step descriptor: the rollout attaches it
        wants = {"descriptors": True} if reads_extra(ac.credit, ac.credit_params, "descriptor") else {}
        rollout = rollout_class(ac.rollout)(env=ac.env, env_options=dict(ac.env_options), max_turns=ac.max_turns,
                                            max_new_tokens=ac.max_new_tokens, prompt=ac.prompt,
                                            history_length=ac.history_length, system=ac.system,
                                            **wants, **dict(ac.rollout_options))
        if getattr(rollout, "archive", None) is not None:  # every archived record names its run and env
            rollout.archive.run, rollout.archive.env = run_id, ac.env
        dataset = rollout.dataset(seeds)
        bridge_kwargs: dict[str, Any] = {"rollout_func": rollout, "reward_funcs": [rollout.reward_func]}
    else:
        from .trl.env_factory import environment_factory

        env_cls = environment_factory(ac.env, **ac.env_options)
        dataset = env_cls.dataset(seeds)
        reward = getattr(env_cls, "reward_func", None)
        bridge_kwargs = {"environment_factory": env_cls, "reward_funcs": [reward] if reward is not None else None}

    before = after = None
    header = ""
    if ac.eval is not None:
        lo, hi = ac.eval.seeds
        mode = "greedy" if ac.eval.greedy else f"T={ac.eval.temperature}"
        header = f"held-out eval: {hi - lo} episodes (seeds {lo}..{hi - 1}), {mode}, env {ac.env}"
    if do_before:
        before = evaluate(model, tokenizer, recipe, start=True)
        print(format_eval_table(before, None, header="before training: " + header), flush=True)

    distill = {}
    if ac.schedule is not None:
        distill = {"schedule_params": dict(ac.schedule_params), "teacher": ac.teacher}
    trainer_cls = make_trainer(grpo_trainer(), credit=ac.credit, schedule=ac.schedule, **distill,
                               terms=dict(ac.terms) or None, adv_scale=ac.adv_scale, **ac.credit_params)
    ccm = getattr(bridge_kwargs.get("rollout_func"), "ccm_distill", None)
    if ccm is not None and ccm[0] > 0:  # rollout: memory (CCM): privileged full-history distillation
        from .trl.ccm import with_ccm

        trainer_cls = with_ccm(trainer_cls, *ccm)
    metrics_cb = MetricsCallback(out_dir / "metrics.jsonl")
    stop = lifecycle.GracefulStop("agentcredit train: {signal}: finishing this step, then a checkpoint, the summary "
                                  "and the curve (press Ctrl-C again to stop at once)")
    stop_cb = StopCallback(stop)
    trainer = trainer_cls(model=model, processing_class=tokenizer, args=config, train_dataset=dataset,
                          callbacks=[metrics_cb, stop_cb], **bridge_kwargs)
    t_train = time.time()
    try:
        with stop:
            trainer.train(resume_from_checkpoint=str(resume) if resume is not None else None)
    except KeyboardInterrupt:
        done = int(trainer.state.global_step)
        last = lifecycle.latest_checkpoint(out_dir)
        lifecycle.write_run(out_dir, {**info, "status": "killed", "steps": done})
        print(f"agentcredit train: stopped at once during step {done + 1} of {steps}; "
              + (f"last checkpoint {last}; resume: {_command(recipe, eval, 'resume_from_checkpoint=true')}"
                 if last is not None else "no checkpoint was written"), flush=True)
        raise
    train_seconds = time.time() - t_train
    trained = trainer.model
    done = int(trainer.state.global_step)
    interrupted = stop.exit_code

    if do_after and not interrupted:
        after = evaluate(trained, tokenizer, recipe, executor=getattr(trainer, "_advisd_executor", None))

    wall = time.time() - t_start
    png = plot_learning_curve(metrics_cb.path, before, after, out_dir / "learning_curve.png",
                              title=f"{recipe.name}: {ac.credit} on {ac.env} ({steps} steps)")
    status = "interrupted" if interrupted else "finished"
    final = None
    if not interrupted:
        final = save_final(trainer, tokenizer, recipe, out_dir / "final",
                           {**info, "status": status, "steps": done, "warm_start": start})
    summary = {
        "recipe": str(recipe.path), "overrides": list(recipe.overrides), "credit": ac.credit,
        "credit_params": dict(ac.credit_params), "adv_scale": ac.adv_scale, "schedule": ac.schedule,
        "schedule_params": dict(ac.schedule_params), "teacher": ac.teacher, "terms": dict(ac.terms), "env": ac.env, "env_options": dict(ac.env_options),
        "bridge": ac.bridge, "model": recipe.model_args["model_name_or_path"],
        "steps": done, "max_steps": steps, "wall_seconds": round(wall, 2),
        "train_seconds": round(train_seconds, 2), "trainable_parameters": trainable,
        "before": as_dict(before), "after": as_dict(after), "train": dict(metrics_cb.summary),
        "metrics": str(metrics_cb.path), "learning_curve": png, "precision": recipe.precision,
        "warm_start": start, "run_id": run_id, "status": status, "final_model": final,
        "resumed_from": str(resume) if resume is not None else None,
    }
    paired = paired_before_after(before, after)
    if paired is not None:
        summary["paired"] = as_dict(paired)
    if before is not None or after is not None:
        summary["eval_episodes"] = write_eval_episodes(out_dir / "eval_episodes.jsonl", before, after)
    summary_path = out_dir / "summary.json"
    summary_path.write_text(json.dumps(summary, indent=2, default=str) + "\n")
    lifecycle.write_run(out_dir, {**info, "status": status, "steps": done})
    if before is not None or after is not None:
        print(format_eval_table(before, after, header=header), flush=True)
    if paired is not None:
        print(paired.format(), flush=True)
    print(f"{done} steps in {train_seconds:.0f} s training, {wall:.0f} s total; "
          f"metrics {metrics_cb.path}; summary {summary_path}", flush=True)
    print(png, flush=True)
    if interrupted:
        last = lifecycle.latest_checkpoint(out_dir)
        print(f"agentcredit train: stopped by {signal_name(interrupted)} after step {done} of {steps}: checkpoint "
              f"{last}, summary {summary_path}, curve {png}\nresume: "
              f"{_command(recipe, eval, 'resume_from_checkpoint=true')}", flush=True)
    else:
        print(f"load it: {load_command(recipe, final)}  (or agentcredit ross ... --model {final})", flush=True)
        print(f"trained model: {final}", flush=True)
    return RunResult(output_dir=str(out_dir), steps=done, wall_seconds=wall,
                     train_seconds=train_seconds, before=before, after=after, metrics_path=str(metrics_cb.path),
                     summary_path=str(summary_path), png_path=png, summary=summary, final_model=final,
                     interrupted=interrupted, run_id=run_id)


def signal_name(exit_code: int) -> str:
    import signal

    try:
        return signal.Signals(exit_code - 128).name
    except ValueError:
        return f"signal {exit_code - 128}"
