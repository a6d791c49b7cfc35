"""``agentcredit compare``: several credit estimators on one TRL recipe, with the same seeds and budget for each.

    agentcredit compare RECIPE --credit grpo,gigpo --seeds 5 [--steps N] [--jobs J] [--set gigpo.gamma=0.9] [k=v ...]

Every run ``(method, seed)`` is ``agentcredit train RECIPE seed=<s> agentcredit.credit=<method>`` (the method's
``--set`` parameters, the common overrides, ``max_steps`` = ``--steps``) in its own subprocess and its own folder;
at the end :func:`report` writes a table, a learning-curve PNG and a JSON of held-out success per method (mean over
seeds with a 95 % t-interval, the pooled Wilson interval), the paired differences to the first method and the steps
to a success threshold. :func:`plan` checks everything before any run starts; :func:`execute` skips finished runs,
resumes or restarts unfinished ones and stops cleanly on Ctrl-C. The full description (outputs, statistics, resume
semantics) is the docs page ``integrations/compare.md``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .stats import censored_steps, paired_by_seed, steps_to_threshold, t_interval, wilson_interval

__all__ = ["CompareError", "Interrupted", "Plan", "Job", "plan", "jobs", "execute", "report", "format_table", "plot",
           "RESULT_FILE"]

#: a run's (or the start's) record: written aside and renamed once the run finished, so it is never half written
RESULT_FILE = "result.json"
#: seconds between two polls of the running subprocesses
POLL_SECONDS = 0.5
#: seconds an interrupted run gets to finish its step and checkpoint before it is killed
GRACE_SECONDS = 60.0
#: keys compare sets itself for every run, and the option that sets each
RESERVED = {"seed": "--seeds N", "max_steps": "--steps N", "agentcredit.credit": "--credit a,b,c",
            "agentcredit.credit_params": "--set METHOD.PARAM=VALUE", "output_dir": "--out DIR",
            "resume_from_checkpoint": "nothing: compare resumes an unfinished run itself"}


class CompareError(ValueError):
    """A comparison that cannot start (or a run whose outputs cannot be read): the message names the option."""


class Interrupted(Exception):
    """Ctrl-C (SIGINT) or SIGTERM stopped the comparison; the running children were stopped and nothing half written
    was left."""


@dataclass
class Plan:
    """Everything that defines a comparison (:func:`plan`). ``dir`` is ``<out>/<recipe name>-<hash>``; ``start`` is
    ``"sft"`` (the recipe's ``warm_start`` made once for every run), ``"eval"`` (the start model evaluated once) or
    ``None`` (``agentcredit.eval.before: false``)."""

    recipe: str
    methods: list[str]
    params: dict[str, dict[str, Any]]
    seeds: list[int]
    steps: int
    overrides: list[str]
    dir: Path
    start: str | None = None
    warm_start: dict[str, Any] | None = None
    init: str | None = None
    jobs: int = 1
    threshold: float = 0.5

    def run_key(self, method: str) -> str:
        """The folder name of ``method``'s runs: the name, plus a hash of its parameters when it has any."""
        p = self.params.get(method) or {}
        return method if not p else f"{method}-{_digest(p)[:8]}"

    def describe(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        d["dir"] = str(self.dir)
        d["run_keys"] = {m: self.run_key(m) for m in self.methods}
        return d


@dataclass(frozen=True)
class Job:
    """One subprocess: the start (``kind="start"``) or one ``(method, seed)`` run."""

    kind: str
    dir: Path
    method: str | None = None
    seed: int | None = None

    @property
    def name(self) -> str:
        return "start" if self.kind == "start" else f"{self.method} seed {self.seed}"


def _digest(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()


# ---- checks: everything before any run ------------------------------------------------------------------------------
def _parse_sets(sets: Sequence[str], methods: list[str]) -> dict[str, dict[str, Any]]:
    """``["gigpo.gamma=0.9"]`` -> ``{"gigpo": {"gamma": 0.9}}``: each method in ``methods``, each parameter one the
    estimator declares (the value is parsed as YAML and checked later with the recipe)."""
    import yaml

    from credit_plugins import registry

    out: dict[str, dict[str, Any]] = {m: {} for m in methods}
    for item in sets or ():
        key, eq, raw = str(item).partition("=")
        method, dot, name = key.strip().partition(".")
        if not eq or not dot or not method or not name:
            raise CompareError(f"--set {item!r} is not METHOD.PARAM=VALUE (e.g. --set gigpo.gamma=0.9)")
        if method not in methods:
            raise CompareError(f"--set {item!r}: {method!r} is not one of the compared methods (--credit "
                               f"{','.join(methods)}); add it to --credit or drop the --set")
        valid = [f.name for f in dataclasses.fields(registry.get(method).params)]
        if name not in valid:
            raise CompareError(f"--set {item!r}: estimator {method!r} has no parameter {name!r}; its parameters: "
                               f"{', '.join(valid) or '(none)'} (agentcredit describe {method})")
        try:
            out[method][name] = yaml.safe_load(raw) if raw.strip() else None
        except yaml.YAMLError as e:
            raise CompareError(f"--set {item!r}: cannot parse the value {raw!r} ({e})") from None
    return out


def _check_overrides(overrides: Sequence[str]) -> list[str]:
    out = []
    for o in overrides or ():
        o = str(o)
        if o.startswith("-") or ("=" not in o and not o.startswith("~")):
            raise CompareError(f"unrecognised argument {o!r}; overrides are key=value (learning_rate=1e-4, "
                               f"agentcredit.max_turns=8) and apply to every run")
        key = o.split("=", 1)[0].lstrip("~").strip()
        hit = next((k for k in RESERVED if key == k or key.startswith(k + ".")), None)
        if hit is not None:
            raise CompareError(f"override {o!r}: compare sets {hit} for every run; use {RESERVED[hit]}")
        out.append(o)
    return out


def credit_override(params: dict[str, Any]) -> str:
    """``agentcredit.credit_params={...}`` replacing the recipe's parameters (YAML flow style, one argument)."""
    import yaml

    return "agentcredit.credit_params=" + yaml.safe_dump(params, default_flow_style=True, width=1 << 30).strip()


def plan(recipe: str | os.PathLike, credit: str | Sequence[str], seeds: int, steps: int | None = None, jobs: int = 1,
         out: str | os.PathLike = "runs/compare", sets: Sequence[str] = (), overrides: Sequence[str] = (),
         init: str | None = None, threshold: float = 0.5) -> Plan:
    """Check a comparison and fix its runs; a :class:`CompareError` names the bad option before anything runs.

    Each method's parameters are the recipe's ``credit_params`` when it is the recipe's own ``credit`` (else none),
    then its ``--set`` values. ``init`` (a checkpoint folder) starts every run from it (``model_name_or_path``, no
    ``warm_start``). Every method's recipe is loaded once here, so a bad parameter value, an estimator the recipe's
    rollout cannot feed or a seed budget too small for ``steps`` stop the comparison before its first run.
    """
    from credit_plugins import registry

    from .recipe import RecipeError, check_seed_budget, is_verl_recipe, load_recipe

    if isinstance(seeds, bool) or not isinstance(seeds, int) or seeds < 1:
        raise CompareError(f"--seeds must be an integer >= 1 (runs per method, seeds 0..N-1), got {seeds!r}")
    if isinstance(jobs, bool) or not isinstance(jobs, int) or jobs < 1:
        raise CompareError(f"--jobs must be an integer >= 1 (runs at once), got {jobs!r}")
    if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int) or steps < 1):
        raise CompareError(f"--steps must be an integer >= 1 (optimizer steps per run), got {steps!r}")
    if not isinstance(threshold, (int, float)) or not 0.0 <= float(threshold) <= 1.0:
        raise CompareError(f"--threshold must be a success rate in [0, 1], got {threshold!r}")
    path = Path(recipe)
    if not path.is_file():
        raise CompareError(f"recipe {str(recipe)!r} does not exist")
    if is_verl_recipe(path):
        raise CompareError(f"{str(recipe)!r} is a verl (Hydra) recipe; agentcredit compare runs TRL recipes. On verl, "
                           f"run its `python -m verl.trainer.main_ppo` command (`agentcredit train {recipe}` prints it) "
                           f"once per estimator (algorithm.adv_estimator=NAME) and seed, and compare their validation "
                           f"metrics")
    methods = [m.strip() for m in (credit.split(",") if isinstance(credit, str) else credit) if m and m.strip()]
    if not methods:
        raise CompareError("--credit names no estimator; give a comma-separated list, e.g. --credit grpo,gigpo")
    known = registry.available("estimators")
    for m in methods:
        if m not in known:
            raise CompareError(f"--credit: {m!r} is not a registered estimator; known: {', '.join(known)}")
    dup = sorted({m for m in methods if methods.count(m) > 1})
    if dup:
        raise CompareError(f"--credit names {', '.join(dup)} more than once; compare one method once (two settings "
                           f"of one estimator are two comparisons)")
    sets_by = _parse_sets(sets, methods)
    common = _check_overrides(overrides)
    if init is not None:
        from . import lifecycle

        try:
            lifecycle.check_model_path("--init", init, fix="give a checkpoint folder (agentcredit sft --out DIR)")
        except RecipeError as e:
            raise CompareError(str(e)) from None
        init = str(Path(init).expanduser().resolve()) if lifecycle.looks_local(init) else str(init)
        common += [f"model_name_or_path={init}", "agentcredit.warm_start=null"]
    try:
        base = load_recipe(path, common)
    except (RecipeError, FileNotFoundError, ImportError) as e:
        raise CompareError(str(e)) from None
    ev = base.agentcredit.eval
    if ev is None or not ev.after:
        raise CompareError(f"recipe {str(recipe)!r} has no held-out evaluation after training (agentcredit.eval "
                           f"{'is null' if ev is None else 'has after: false'}); compare ranks methods by it: give "
                           f"the recipe an eval block with after: true (e.g. agentcredit.eval.after=true)")
    steps = int(steps if steps is not None else base.trl_args["max_steps"])
    try:
        check_seed_budget(base.agentcredit, steps)
    except RecipeError as e:
        raise CompareError(f"--steps {steps}: {e}") from None
    params: dict[str, dict[str, Any]] = {}
    for m in methods:
        own = dict(base.agentcredit.credit_params) if m == base.agentcredit.credit else {}
        params[m] = {**own, **sets_by[m]}
        try:
            load_recipe(path, common + run_overrides(m, params[m], 0, steps), validate_trl=False)
        except (RecipeError, ImportError) as e:
            raise CompareError(f"--credit {m}{' with --set ' + str(sets_by[m]) if sets_by[m] else ''}: {e}") from None
    if init is not None:
        start = "eval" if ev.before else None
    elif base.agentcredit.warm_start is not None:
        start = "sft"
    else:
        start = "eval" if ev.before else None
    ws = {**dataclasses.asdict(base.agentcredit.warm_start), "eval": ev.before} if start == "sft" else None
    text = path.read_text(encoding="utf-8")
    key = _digest({"recipe": text, "overrides": common, "steps": steps})[:12]
    return Plan(recipe=str(path.resolve()), methods=methods, params=params, seeds=list(range(seeds)), steps=steps,
                overrides=common, dir=Path(out).expanduser().resolve() / f"{path.stem}-{key}", start=start,
                warm_start=ws, init=init, jobs=jobs, threshold=float(threshold))


def run_overrides(method: str, params: dict[str, Any], seed: int, steps: int) -> list[str]:
    return [f"max_steps={steps}", f"seed={seed}", f"agentcredit.credit={method}", credit_override(params)]


# ---- the runs -------------------------------------------------------------------------------------------------------
def jobs(p: Plan) -> list[Job]:
    """The start (when there is one), then the runs seed by seed, each seed's methods side by side."""
    out = [Job("start", p.dir / "start")] if p.start else []
    return out + [Job("run", p.dir / "runs" / f"{p.run_key(m)}_s{s}", m, s) for s in p.seeds for m in p.methods]


def read_result(folder: Path) -> dict[str, Any] | None:
    """A job's record, or ``None`` when it has not finished (no result file, or one that does not parse)."""
    try:
        return json.loads((Path(folder) / RESULT_FILE).read_text())
    except (OSError, ValueError):
        return None


def write_json(path: Path, obj: Any) -> None:
    """``path`` written aside and renamed into place (a reader never sees half of it)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(obj, indent=2, default=str) + "\n")
    tmp.replace(path)


def _start_model(p: Plan) -> Path:
    return p.dir / "start" / "model"


def job_argv(p: Plan, job: Job, extra: Sequence[str] = ()) -> list[str]:
    """The ``agentcredit`` (or ``python -m agentcredit.compare``) arguments of ``job``."""
    if job.kind == "start" and p.start == "sft":
        ws = p.warm_start or {}
        return ["agentcredit.cli", "sft", p.recipe, *p.overrides, "--out", str(_start_model(p)), "--steps",
                str(ws["steps"]), "--batch-size", str(ws["batch_size"]), "--learning-rate", str(ws["learning_rate"]),
                "--episodes", str(ws["episodes"]), *([] if ws.get("eval", True) else ["--no-eval"])]
    if job.kind == "start":
        return ["agentcredit.compare", "evaluate-start", str(job.dir), p.recipe, *p.overrides]
    start = [f"model_name_or_path={_start_model(p)}", "agentcredit.warm_start=null"] if p.start == "sft" else []
    return ["agentcredit.cli", "train", p.recipe, *p.overrides, *start,
            *run_overrides(job.method, p.params[job.method], job.seed, p.steps), f"output_dir={job.dir}",
            "agentcredit.eval.before=false", *extra]


def collect_run(p: Plan, job: Job) -> dict[str, Any]:
    """A finished train run's record from its ``summary.json``, ``eval_episodes.jsonl`` and ``metrics.jsonl``."""
    from .trl.callbacks import read_metrics  # any JSON-lines file; TRL is loaded already (the recipe checks)

    try:
        s = json.loads((job.dir / "summary.json").read_text())
    except (OSError, ValueError) as e:
        raise CompareError(f"{job.name}: no readable summary.json in {job.dir} ({e})") from None
    if s.get("status") != "finished" or int(s.get("steps", -1)) != p.steps or not s.get("after"):
        raise CompareError(f"{job.name}: the run in {job.dir} did not finish {p.steps} steps with a held-out "
                           f"evaluation (status {s.get('status')!r}, {s.get('steps')} steps)")
    after = [e for e in read_metrics(job.dir / "eval_episodes.jsonl") if e.get("phase") == "after"]
    curve = [[int(r["step"]), float(r["agentcredit/success"])] for r in read_metrics(job.dir / "metrics.jsonl")
             if r.get("agentcredit/success") is not None]
    ev = s["after"]
    n = len(after) or int(ev.get("n_episodes", 0))
    k = sum(bool(e["success"]) for e in after) if after else round(float(ev.get("success_rate", 0.0)) * n)
    return {"method": job.method, "seed": job.seed, "params": p.params[job.method], "dir": str(job.dir),
            "success": k / n if n else None, "successes": k, "episodes": n, "valid": ev.get("valid_rate"),
            "mean_return": ev.get("mean_return"), "eval": ev, "curve": curve, "steps": int(s["steps"]),
            "wall_seconds": s.get("wall_seconds"), "train_seconds": s.get("train_seconds"),
            "resumed_from": s.get("resumed_from")}


def collect_start(p: Plan, job: Job) -> dict[str, Any]:
    """The start's record: the warm start's ``sft_summary.json`` (``evaluate-start`` writes its own)."""
    try:
        s = json.loads((_start_model(p) / "sft_summary.json").read_text())
    except (OSError, ValueError) as e:
        raise CompareError(f"start: no readable sft_summary.json in {_start_model(p)} ({e})") from None
    return {"kind": "sft", "model": str(_start_model(p)), "eval": s.get("eval")}


def _finished_train(p: Plan, job: Job) -> bool:
    try:
        s = json.loads((job.dir / "summary.json").read_text())
    except (OSError, ValueError):
        return False
    return s.get("status") == "finished" and s.get("steps") == p.steps and bool(s.get("after"))


def prepare(p: Plan, job: Job) -> list[str] | None:
    """Before launching an unfinished ``job``: ``None`` when its train run finished but its record was not written
    (written now), else the extra arguments: ``resume_from_checkpoint=<latest checkpoint-N>`` when the folder holds
    one, else ``[]`` after the folder was emptied (a partial run is never mixed into a new one)."""
    from .lifecycle import latest_checkpoint

    if job.kind == "run" and _finished_train(p, job):
        write_json(job.dir / RESULT_FILE, collect_run(p, job))
        return None
    if job.kind == "run":
        last = latest_checkpoint(job.dir)
        if last is not None:
            return [f"resume_from_checkpoint={last}"]
    if job.dir.exists():
        shutil.rmtree(job.dir)
    return []


def cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def launch(argv: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    """``python -m ARGV`` in its own session (a Ctrl-C in the terminal reaches compare, which stops it)."""
    with open(log, "a") as fh:
        return subprocess.Popen([sys.executable, "-m", *argv], stdout=fh, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)


def _stop(running: dict[Job, Any], say: Callable[[str], None]) -> None:
    """SIGINT to every child (each finishes its step and checkpoints), up to :data:`GRACE_SECONDS`; a second
    Ctrl-C, or the time running out, kills them."""
    if not running:
        return
    say(f"agentcredit compare: stopping {len(running)} running run(s): each finishes its step and checkpoints "
        f"(Ctrl-C again to kill them now)")
    for proc, *_ in running.values():
        try:
            proc.send_signal(signal.SIGINT)
        except ProcessLookupError:
            pass
    deadline = time.time() + GRACE_SECONDS
    try:
        for proc, *_ in running.values():
            while proc.poll() is None and time.time() < deadline:
                time.sleep(0.2)
    except KeyboardInterrupt:
        pass
    for proc, *_ in running.values():
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _finish(p: Plan, job: Job, rc: int) -> str:
    """Write the record of a job that exited with ``rc``; returns why it failed ("" when it did not)."""
    if rc:
        return f"exit {rc}"
    try:
        if job.kind == "run":
            write_json(job.dir / RESULT_FILE, collect_run(p, job))
        elif p.start == "sft":
            write_json(job.dir / RESULT_FILE, collect_start(p, job))
        elif read_result(job.dir) is None:
            return "no result written"
    except CompareError as e:
        return str(e)
    return ""


def execute(p: Plan, launcher: Callable[[list[str], dict[str, str], Path], Any] | None = None,
            progress: bool = True) -> dict[str, Any]:
    """Run the plan's unfinished jobs, ``p.jobs`` at once with ``max(1, cores // jobs)`` threads each, through
    ``launcher(argv, env, log)`` (default :func:`launch`; it returns a ``Popen``-like object); finished ones (a record
    in their folder) are skipped. Returns ``skipped`` (a count), ``ran`` (job names) and ``failed`` (``(job name,
reason)``).
    A SIGINT or SIGTERM stops the children (:func:`_stop`) and raises :class:`Interrupted`."""
    from tqdm.auto import tqdm

    launcher = launcher or launch
    p.dir.mkdir(parents=True, exist_ok=True)
    write_json(p.dir / "compare.json", p.describe())
    (p.dir / "logs").mkdir(exist_ok=True)
    every = jobs(p)
    todo = [j for j in every if read_result(j.dir) is None]
    threads = max(1, cores() // p.jobs)
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), TRL_EXPERIMENTAL_SILENCE="1", TOKENIZERS_PARALLELISM="false")
    bar = tqdm(total=len(every), initial=len(every) - len(todo), unit="run", desc="compare", disable=not progress,
               dynamic_ncols=True)
    say = bar.write if progress else print
    if len(every) > len(todo):
        say(f"agentcredit compare: {len(every) - len(todo)} of {len(every)} jobs already finished in {p.dir} "
            f"(skipped)")
    running: dict[Job, tuple[Any, float, Path]] = {}
    ran, failed, skipped = [], [], len(every) - len(todo)
    old = signal.getsignal(signal.SIGTERM)

    def on_term(signum, frame):
        raise KeyboardInterrupt

    try:
        signal.signal(signal.SIGTERM, on_term)
    except ValueError:  # not the main thread
        old = None
    try:
        while todo or running:
            start_busy = any(j.kind == "start" for j in todo + list(running)) and p.start == "sft"
            while todo and len(running) < p.jobs and not (start_busy and todo[0].kind == "run"):
                job = todo.pop(0)
                extra = prepare(p, job)
                if extra is None:  # finished before, its record written now
                    skipped += 1
                    bar.update(1)
                    continue
                job.dir.mkdir(parents=True, exist_ok=True)
                log = p.dir / "logs" / f"{job.dir.name}.log"
                if extra:
                    say(f"  {job.name}: resuming from {extra[0].split('=', 1)[1]}")
                running[job] = (launcher(job_argv(p, job, extra), env, log), time.time(), log)
                bar.set_postfix_str("running: " + ", ".join(j.name for j in running))
            done_any = False
            for job, (proc, t0, log) in list(running.items()):
                rc = proc.poll()
                if rc is None:
                    continue
                done_any = True
                del running[job]
                reason = _finish(p, job, rc)
                bar.update(1)
                rec = read_result(job.dir) if not reason else None
                if reason:
                    failed.append((job.name, f"{reason}; log {log}"))
                    say(f"  {job.name}: failed ({reason}); log {log}")
                else:
                    ran.append(job.name)
                    ev = rec.get("eval") or {}
                    rate = rec.get("success", ev.get("success_rate"))
                    say(f"  {job.name}: done in {time.time() - t0:.0f} s"
                        + (f", held-out success {rate:.1%}" if isinstance(rate, (int, float)) else ""))
                if job.kind == "start" and reason and p.start == "sft":
                    todo = [j for j in todo if j.kind != "run"]  # every run starts from the warm start
                    failed.append(("runs", "not started: the warm start failed"))
                bar.set_postfix_str("running: " + (", ".join(j.name for j in running) or "none"))
            if running and not done_any:
                time.sleep(POLL_SECONDS)
    except KeyboardInterrupt:
        _stop(running, say)
        bar.close()
        left = sum(read_result(j.dir) is None for j in every)
        raise Interrupted(f"interrupted: {len(every) - left} of {len(every)} jobs finished; rerun the same command to "
                          f"continue (finished runs are skipped, unfinished ones resume from their last checkpoint "
                          f"or restart)") from None
    finally:
        if old is not None:
            signal.signal(signal.SIGTERM, old)
    bar.close()
    return {"skipped": skipped, "ran": ran, "failed": failed}


# ---- the start model, evaluated once --------------------------------------------------------------------------------
def evaluate_start(out: str, recipe_path: str, overrides: Sequence[str]) -> None:
    """The recipe's held-out evaluation of its model before training, written to ``out/result.json``."""
    from . import policy
    from .evaluation import as_dict, evaluate
    from .recipe import load_recipe

    recipe = load_recipe(recipe_path, list(overrides))
    _, tokenizer, model = policy.load_model(recipe, None)
    result = evaluate(model, tokenizer, recipe, start=True)
    Path(out).mkdir(parents=True, exist_ok=True)
    write_json(Path(out) / RESULT_FILE, {"kind": "eval", "model": recipe.model_args["model_name_or_path"],
                                         "eval": as_dict(result)})


# ---- the report -----------------------------------------------------------------------------------------------------
def _interval(x, lo: float = -math.inf, hi: float = math.inf) -> list[float] | None:
    """An interval as a JSON list, clipped to ``[lo, hi]`` (a success rate's t-interval to [0, 1])."""
    return [max(lo, float(x[0])), min(hi, float(x[1]))] if x is not None else None


def report(p: Plan) -> dict[str, Any]:
    """The statistics of the finished runs (see the docs page for their definitions); missing runs are listed."""
    runs = {(j.method, j.seed): r for j in jobs(p) if j.kind == "run" and (r := read_result(j.dir)) is not None}
    start = read_result(p.dir / "start") if p.start else None
    first = p.methods[0]
    base = {s: r["success"] for (m, s), r in runs.items() if m == first}
    table = []
    for m in p.methods:
        recs = [runs[(m, s)] for s in p.seeds if (m, s) in runs]
        per_seed = {r["seed"]: r["success"] for r in recs}
        k, n = sum(r["successes"] for r in recs), sum(r["episodes"] for r in recs)
        reach = {r["seed"]: steps_to_threshold(r["curve"], p.threshold) for r in recs}
        row = {"method": m, "params": p.params[m], "seeds": len(recs),
               "missing_seeds": [s for s in p.seeds if (m, s) not in runs], "per_seed": per_seed,
               "mean": sum(per_seed.values()) / len(recs) if recs else None,
               "t95": _interval(t_interval(list(per_seed.values())), 0.0, 1.0),
               "pooled": k / n if n else None, "successes": k, "episodes": n,
               "pooled_wilson95": list(wilson_interval(k, n)) if n else None,
               "mean_valid": (sum(r["valid"] or 0.0 for r in recs) / len(recs)) if recs else None,
               "mean_wall_seconds": (sum(r["wall_seconds"] or 0.0 for r in recs) / len(recs)) if recs else None,
               "steps_to_threshold": {**censored_steps(list(reach.values()), p.steps), "per_seed": reach}}
        row["steps_to_threshold"]["t95_reached"] = _interval(row["steps_to_threshold"]["t95_reached"])
        row["steps_to_threshold"]["t95_restricted"] = _interval(row["steps_to_threshold"]["t95_restricted"])
        if m != first:
            d = paired_by_seed(per_seed, base)
            row["diff_vs_first"] = {**d, "t95": _interval(d["t95"], -1.0, 1.0), "baseline": first}
        table.append(row)
    return {"config": p.describe(), "start": start, "threshold": p.threshold, "baseline": first, "table": table,
            "runs": [runs[k] for k in sorted(runs, key=lambda ms: (p.methods.index(ms[0]), ms[1]))]}


def _pct(x: float | None) -> str:
    return "–" if x is None else f"{100 * x:.1f}"


def _ci(ci: list[float] | None, pct: bool = True, sign: str = "") -> str:
    if ci is None:
        return "[n/a]"
    f = (lambda v: f"{100 * v:{sign}.1f}") if pct else (lambda v: f"{v:{sign}.1f}")
    return f"[{f(ci[0])}, {f(ci[1])}]"


def format_table(result: dict[str, Any]) -> str:
    """The report as text: held-out success (%) per method, its paired difference to the first method (points) and
    the steps to the threshold."""
    thr, first = result["threshold"], result["baseline"]
    lines = []
    ev = (result.get("start") or {}).get("eval")
    if ev:
        lines.append(f"start ({result['start']['kind']}): held-out success {_pct(ev.get('success_rate'))} % "
                     f"{_ci(ev.get('success_ci'))} Wilson, {ev.get('n_episodes')} episodes")
    lines.append(f"{'method':<12}{'seeds':>6}{'mean %':>8}{'95% t':>16}{'pooled %':>10}{'95% Wilson':>16}"
                 f"{'diff vs ' + first:>16}{'95% t':>18}   steps to {thr:g}: reached, mean [95% t], restricted mean")
    for r in result["table"]:
        d = r.get("diff_vs_first")
        st = r["steps_to_threshold"]
        diff = (f"{100 * d['mean']:+.1f} ({len(d['seeds'])})" if d and d["mean"] is not None else "–")
        dci = _ci(d["t95"], sign="+") if d else ""
        steps = (f"{st['reached']}/{st['runs']}, "
                 + (f"{st['mean_reached']:.1f} {_ci(st['t95_reached'], pct=False)}" if st["reached"] else "–")
                 + (f", {st['restricted_mean']:.1f}" if st["runs"] else ""))
        lines.append(f"{r['method']:<12}{r['seeds']:>6}{_pct(r['mean']):>8}{_ci(r['t95']):>16}{_pct(r['pooled']):>10}"
                     f"{_ci(r['pooled_wilson95']):>16}{diff:>16}{dci:>18}   {steps}"
                     + (f"   missing seeds {r['missing_seeds']}" if r["missing_seeds"] else ""))
    return "\n".join(lines)


def plot(result: dict[str, Any], path: str | os.PathLike) -> str | None:
    """Training success per step (mean over seeds, 95 % t-band) per method, with the held-out points: the start at
    step 0 (Wilson) and each method after its budget (t-interval over seeds; Wilson with one seed). ``None`` without
    matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(8, 4.5))
    steps = result["config"]["steps"]
    ev = (result.get("start") or {}).get("eval")
    if ev and ev.get("success_ci"):
        lo, hi = ev["success_ci"]
        ax.errorbar([0], [ev["success_rate"]], yerr=[[ev["success_rate"] - lo], [hi - ev["success_rate"]]], fmt="s",
                    color="black", capsize=4, label="start (held-out)")
    for i, row in enumerate(result["table"]):
        curves = [dict((int(s), v) for s, v in r["curve"]) for r in result["runs"] if r["method"] == row["method"]]
        xs = sorted({s for c in curves for s in c})
        color = f"C{i % 10}"
        if xs:
            mu, lo, hi = [], [], []
            for s in xs:
                vals = [c[s] for c in curves if s in c]
                m = sum(vals) / len(vals)
                ci = t_interval(vals) or (m, m)
                mu.append(m)
                lo.append(max(0.0, ci[0]))
                hi.append(min(1.0, ci[1]))
            ax.plot(xs, mu, color=color, label=f"{row['method']} training (n={len(curves)})")
            ax.fill_between(xs, lo, hi, color=color, alpha=0.2)
        if row["mean"] is not None:
            ci = row["t95"] if row["t95"] is not None else row["pooled_wilson95"]
            x = steps + 0.15 * (i + 1)
            ax.errorbar([x], [row["mean"]], yerr=[[row["mean"] - ci[0]], [ci[1] - row["mean"]]], fmt="o",
                        color=color, capsize=4, label=f"{row['method']} held-out")
    ax.axhline(result["threshold"], color="grey", lw=0.8, ls=":")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("success (mean, 95 % interval)")
    ax.set_ylim(-0.02, 1.02)
    ax.set_title(f"{Path(result['config']['recipe']).stem}: {len(result['config']['seeds'])} seeds x {steps} steps",
                 fontsize=10)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    tmp = Path(path).with_name(f".{Path(path).name}.{os.getpid()}.tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    tmp.replace(path)
    return str(path)


def write_report(p: Plan) -> dict[str, Any]:
    """``report.json``, ``report.png`` and ``report.txt`` in the compare folder; returns the result with their
    paths (``json``, ``png``, ``txt``)."""
    result = report(p)
    result["png"] = plot(result, p.dir / "report.png")
    text = format_table(result)
    (p.dir / "report.txt").write_text(text + "\n")
    result["txt"] = str(p.dir / "report.txt")
    result["json"] = str(p.dir / "report.json")
    write_json(p.dir / "report.json", result)
    return result


def main(argv: list[str]) -> int:
    """``python -m agentcredit.compare evaluate-start OUT RECIPE [overrides]``: the start job's subprocess."""
    if len(argv) < 3 or argv[0] != "evaluate-start":
        print("usage: python -m agentcredit.compare evaluate-start OUT RECIPE [key=value ...]", file=sys.stderr)
        return 2
    evaluate_start(argv[1], argv[2], argv[3:])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
