"""``agentcredit compare``: its checks (nothing spawned on bad input), its folders (different comparisons never share
one), resume (finished runs skipped, unfinished ones resumed or restarted), the report's statistics on a fake
``agentcredit train``, and one real two-method, two-seed comparison on the tiny model."""

import json
from pathlib import Path

import pytest

pytest.importorskip("trl")

from agentcredit import cli, compare  # noqa: E402
from tests.helpers.compare_fakes import Done, FakeTrain, kv as _kv  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "recipes" / "trl" / "minigrid_credit_learning.yaml"
WARM = ROOT / "recipes" / "trl" / "minigrid_demo.yaml"  # has agentcredit.warm_start
#: the tiny budget of benchmarks/credit_learning.py --quick: one group of 2 episodes of at most 4 turns, 4 eval seeds
TINY = ["agentcredit.groups_per_step=1", "agentcredit.episodes_per_group=2", "agentcredit.max_turns=4",
        "per_device_train_batch_size=8", "agentcredit.eval.seeds=[20000,20004]"]


def _plan(tmp_path, credit="grpo,gigpo", seeds=2, **kw):
    kw.setdefault("overrides", TINY)
    return compare.plan(RECIPE, credit, seeds, steps=kw.pop("steps", 3), out=tmp_path / "cmp", **kw)


# ---- bad input: a clear error, nothing spawned ----------------------------------------------------------------------
@pytest.mark.parametrize("args, words", [
    (["--credit", "grpo,nope", "--seeds", "2"], ["'nope' is not a registered estimator", "gigpo"]),
    (["--credit", "grpo", "--seeds", "0"], ["--seeds"]),
    (["--credit", "grpo", "--seeds", "2", "--jobs", "0"], ["--jobs"]),
    (["--credit", "grpo", "--seeds", "2", "--threshold", "1.5"], ["--threshold"]),
    (["--credit", "grpo,gigpo", "--seeds", "2", "--set", "crbc.gamma=0.9"], ["not one of the compared methods"]),
    (["--credit", "grpo,gigpo", "--seeds", "2", "--set", "gigpo.nope=1"], ["no parameter 'nope'", "step_weight"]),
    (["--credit", "grpo,gigpo", "--seeds", "2", "--set", "gigpo.gamma=7"], ["gamma=7", "[0.0, 1.0]"]),
    (["--credit", "grpo,gigpo", "--seeds", "2", "--set", "gigpo=1"], ["METHOD.PARAM=VALUE"]),
    (["--credit", "grpo,grpo", "--seeds", "2"], ["more than once"]),
    (["--credit", "grpo", "--seeds", "2", "agentcredit.eval=null"], ["no held-out evaluation", "eval"]),
    (["--credit", "grpo", "--seeds", "2", "agentcredit.eval.after=false"], ["after: false"]),
    (["--credit", "grpo", "--seeds", "2", "seed=3"], ["seed=3", "--seeds"]),
    (["--credit", "grpo", "--seeds", "2", "agentcredit.credit_params.eps=1"], ["--set"]),
    (["--credit", "grpo", "--seeds", "2", "output_dir=x"], ["--out"]),
    (["--credit", "grpo", "--seeds", "2", "learnin_rate=1"], ["learning_rate"]),
    (["--credit", "grpo", "--seeds", "2", "notakeyvalue"], ["key=value"]),
    (["--credit", "grpo,sipo", "--seeds", "2"], ["sipo", "rollout: tree"]),
    (["--credit", "grpo", "--seeds", "2", "--steps", "100000"], ["--steps 100000", "train_seeds"]),
    (["--credit", "grpo", "--seeds", "2", "--init", "/no/such/model"], ["--init", "/no/such/model"]),
])
def test_bad_input_is_one_error_line_and_nothing_runs(capsys, monkeypatch, tmp_path, args, words):
    fake = FakeTrain()
    monkeypatch.setattr(compare, "launch", fake)
    rc = cli.main(["compare", str(RECIPE), *args, "--out", str(tmp_path / "cmp")])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and err[0].startswith("agentcredit compare: error: "), err
    for w in words:
        assert w in err[0], (w, err[0])
    assert fake.calls == [] and not (tmp_path / "cmp").exists()


def test_help_of_agentcredit_and_of_compare(capsys):
    for argv in (["--help"], ["compare", "--help"]):
        with pytest.raises(SystemExit) as e:
            cli.main(argv)
        assert e.value.code == 0
    out = capsys.readouterr().out
    assert "compare credit estimators" in out and "--report-only" in out


def test_verl_recipe_and_missing_recipe(capsys, tmp_path):
    for recipe, word in ((ROOT / "recipes" / "verl" / "sokoban_gigpo.yaml", "TRL recipes"), (tmp_path / "x.yaml",
                                                                                            "does not exist")):
        assert cli.main(["compare", str(recipe), "--credit", "grpo", "--seeds", "1"]) == 2
        assert word in capsys.readouterr().err


# ---- folders ---------------------------------------------------------------------------------------------------------
def test_same_config_same_folder_different_configs_never_share_one(tmp_path):
    a = _plan(tmp_path)
    assert _plan(tmp_path).dir == a.dir and a.dir.parent == tmp_path / "cmp"
    assert a.dir.name.startswith("minigrid_credit_learning-")
    others = [_plan(tmp_path, steps=4), _plan(tmp_path, overrides=TINY + ["learning_rate=0.002"]),
              _plan(tmp_path, overrides=TINY[::-1][:-1] + ["agentcredit.eval.seeds=[20000,20008]"])]
    changed = tmp_path / "minigrid_credit_learning.yaml"
    changed.write_text(RECIPE.read_text().replace("learning_rate: 1.0e-3", "learning_rate: 2.0e-3"))
    others.append(compare.plan(changed, "grpo,gigpo", 2, steps=3, out=tmp_path / "cmp", overrides=TINY))
    assert len({a.dir} | {o.dir for o in others}) == 1 + len(others)
    # seeds and the method list choose runs inside the folder; a method's parameters choose its run folders
    assert _plan(tmp_path, credit="gigpo", seeds=5).dir == a.dir
    tuned = _plan(tmp_path, sets=["gigpo.gamma=0.9"])
    assert tuned.dir == a.dir and tuned.run_key("gigpo") != a.run_key("gigpo") == "gigpo"
    assert tuned.run_key("grpo") == "grpo" and tuned.params["gigpo"] == {"gamma": 0.9}
    runs = {j.dir for j in compare.jobs(a)} | {j.dir for j in compare.jobs(tuned)}
    assert len(runs) == 1 + 4 + 2  # the start, 4 runs of a, tuned's 2 gigpo runs (its grpo runs are a's)


def test_run_command_sets_method_params_seed_steps_and_folder(tmp_path):
    from agentcredit.recipe import load_recipe

    p = _plan(tmp_path, sets=["gigpo.gamma=0.9", "gigpo.step_weight=0.5"])
    job = next(j for j in compare.jobs(p) if j.method == "gigpo" and j.seed == 1)
    argv = compare.job_argv(p, job)
    assert argv[:3] == ["agentcredit.cli", "train", str(RECIPE)]
    r = load_recipe(argv[2], [a for a in argv[3:] if "=" in a])  # the run's own recipe, as train loads it
    assert (r.agentcredit.credit, r.agentcredit.credit_params) == ("gigpo", {"gamma": 0.9, "step_weight": 0.5})
    assert (r.trl_args["seed"], r.trl_args["max_steps"], r.trl_args["output_dir"]) == (1, 3, str(job.dir))
    assert r.agentcredit.eval.before is False and r.agentcredit.groups_per_step == 1
    # the recipe's own credit keeps its credit_params; another credit does not inherit them
    own = tmp_path / "own.yaml"  # the recipe's credit is gigpo
    own.write_text(RECIPE.read_text().replace("credit_params: {}", "credit_params: {gamma: 0.9}"))
    other = compare.plan(own, "grpo,gigpo", 1, steps=2, out=tmp_path / "w", sets=["gigpo.step_weight=0.5"])
    assert other.params == {"grpo": {}, "gigpo": {"gamma": 0.9, "step_weight": 0.5}}


# ---- resume ----------------------------------------------------------------------------------------------------------
def test_interrupted_compare_redoes_only_the_rest(tmp_path):
    p = _plan(tmp_path)
    first = FakeTrain(interrupt_at=4)  # the start and 2 runs finish, Ctrl-C while the third starts
    with pytest.raises(compare.Interrupted, match="rerun the same command"):
        compare.execute(p, launcher=first, progress=False)
    done = [j for j in compare.jobs(p) if compare.read_result(j.dir) is not None]
    assert [j.name for j in done] == ["start", "grpo seed 0", "gigpo seed 0"]
    second = FakeTrain()
    out = compare.execute(p, launcher=second, progress=False)
    assert second.runs() == [("grpo", 1), ("gigpo", 1)] and out["skipped"] == 3 and not out["failed"]
    third = FakeTrain()
    assert compare.execute(p, launcher=third, progress=False)["skipped"] == 5 and third.calls == []


class Running:
    """A child that runs until signalled (then exits 130), or, ``stubborn``, until killed."""

    def __init__(self, stubborn=False):
        self.signals, self.killed, self.stubborn, self.rc = [], False, stubborn, None

    def poll(self):
        return self.rc

    def send_signal(self, sig):
        self.signals.append(sig)
        if not self.stubborn:
            self.rc = 130

    def kill(self):
        self.killed, self.rc = True, -9

    def wait(self):
        return self.rc


@pytest.mark.parametrize("stubborn", [False, True])
def test_sigterm_stops_the_running_children_and_writes_no_record(monkeypatch, tmp_path, stubborn):
    import os
    import signal

    monkeypatch.setattr(compare, "GRACE_SECONDS", 0.3)
    p = _plan(tmp_path, credit="grpo", seeds=2)
    p.jobs = 3
    child, fake = Running(stubborn), FakeTrain()

    def launcher(argv, env, log):
        if argv[1] == "evaluate-start":
            return fake(argv, env, log)
        if _kv(argv)["seed"] == "0":
            return child
        os.kill(os.getpid(), signal.SIGTERM)  # as `kill PID` on compare while seed 0 runs
        return Running()

    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(compare.Interrupted, match="1 of 3 jobs finished"):
        compare.execute(p, launcher=launcher, progress=False)
    assert child.signals == [signal.SIGINT] and child.killed == stubborn
    assert [compare.read_result(j.dir) is not None for j in compare.jobs(p)] == [True, False, False]
    assert signal.getsignal(signal.SIGTERM) is before  # compare's handler is removed again


def test_unfinished_runs_resume_from_a_checkpoint_or_restart_clean(tmp_path):
    p = _plan(tmp_path, credit="grpo", seeds=3)
    compare.execute(p, launcher=FakeTrain(), progress=False)
    j0, j1, j2 = [j for j in compare.jobs(p) if j.kind == "run"]
    # seed 0: killed after a checkpoint; seed 1: killed before any, leaving partial outputs; seed 2: train finished
    # but compare died before writing the record
    for j in (j0, j1, j2):
        (j.dir / compare.RESULT_FILE).unlink()
    (j0.dir / "summary.json").write_text(json.dumps({"status": "interrupted", "steps": 2}))
    (j0.dir / "checkpoint-2").mkdir()
    (j0.dir / "checkpoint-2" / "trainer_state.json").write_text("{}")
    (j1.dir / "summary.json").unlink()
    (j1.dir / "stale.txt").write_text("partial")
    again = FakeTrain()
    out = compare.execute(p, launcher=again, progress=False)
    assert again.runs() == [("grpo", 0), ("grpo", 1)] and not out["failed"]
    assert out["skipped"] == 2 and out["ran"] == ["grpo seed 0", "grpo seed 1"]  # the start and seed 2 (collected)
    assert _kv(again.calls[0])["resume_from_checkpoint"] == str(j0.dir / "checkpoint-2")
    assert "resume_from_checkpoint" not in _kv(again.calls[1]) and not (j1.dir / "stale.txt").exists()
    assert all(compare.read_result(j.dir)["steps"] == 3 for j in (j0, j1, j2))


def test_warm_start_is_made_once_before_every_run(tmp_path):
    p = compare.plan(WARM, "grpo,gigpo", 2, steps=2, out=tmp_path / "cmp")
    assert p.start == "sft"
    fake = FakeTrain()
    p.jobs = 3
    compare.execute(p, launcher=fake, progress=False)
    assert fake.calls[0][1] == "sft" and len(fake.calls) == 5
    for argv in fake.calls[1:]:
        kv = _kv(argv)
        assert kv["model_name_or_path"] == str(p.dir / "start" / "model") and kv["agentcredit.warm_start"] == "null"
    assert compare.read_result(p.dir / "start")["eval"]["success_rate"] == 0.5
    # --init: every run starts from the checkpoint; the start is its evaluation
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text("{}")
    q = compare.plan(WARM, "grpo", 1, steps=2, out=tmp_path / "cmp", init=str(ckpt))
    assert q.start == "eval" and q.dir != p.dir
    assert f"model_name_or_path={ckpt}" in q.overrides and "agentcredit.warm_start=null" in q.overrides


def test_failed_warm_start_starts_no_run(tmp_path):
    p = compare.plan(WARM, "grpo", 2, steps=2, out=tmp_path / "cmp")

    def broken(argv, env, log):
        calls.append(argv)
        return Done(1)

    calls = []
    out = compare.execute(p, launcher=broken, progress=False)
    assert len(calls) == 1 and calls[0][1] == "sft" and [n for n, _ in out["failed"]] == ["start", "runs"]
    assert out["skipped"] == 0 and out["ran"] == []


# ---- the report ------------------------------------------------------------------------------------------------------
def test_report_statistics_on_known_runs(tmp_path):
    p = _plan(tmp_path, credit="grpo,gigpo,crbc", seeds=3, steps=4, threshold=0.5)
    wins = {("grpo", 0): 2, ("grpo", 1): 4, ("grpo", 2): 6, ("gigpo", 0): 4, ("gigpo", 1): 5, ("gigpo", 2): 8,
            ("crbc", 0): 1}
    curve = {("grpo", 0): [0.1, 0.6, 0.2, 0.7], ("grpo", 1): [0.5, 0.1, 0.1, 0.1], ("grpo", 2): [0.0] * 4}
    out = compare.execute(p, launcher=FakeTrain(wins, curve, fail={("crbc", 1), ("crbc", 2)}), progress=False)
    assert sorted(n for n, _ in out["failed"]) == ["crbc seed 1", "crbc seed 2"]
    res = compare.write_report(p)
    assert json.loads(Path(res["json"]).read_text())["table"] == json.loads(json.dumps(res["table"]))
    grpo, gigpo, crbc = res["table"]
    assert grpo["per_seed"] == {0: 0.25, 1: 0.5, 2: 0.75} and grpo["mean"] == pytest.approx(0.5)
    assert grpo["t95"] == [0.0, 1.0]  # 0.5 -+ t_{0.975,2} * 0.25 / sqrt(3) = [-0.12, 1.12], clipped to a rate
    assert (grpo["successes"], grpo["episodes"], grpo["pooled"]) == (12, 24, 0.5)
    assert grpo["pooled_wilson95"] == pytest.approx(list(compare.wilson_interval(12, 24)))
    assert "diff_vs_first" not in grpo
    d = gigpo["diff_vs_first"]  # gigpo - grpo per seed: 2/8, 1/8, 2/8
    assert d["seeds"] == [0, 1, 2] and d["differences"] == pytest.approx([0.25, 0.125, 0.25])
    assert d["mean"] == pytest.approx(5 / 24) and d["baseline"] == "grpo"
    h = 4.302652729749462 * (0.125 / 3 ** 0.5) / 3 ** 0.5  # sd of (2, 1, 2) / 8 is 0.125 / sqrt(3)
    assert d["t95"] == pytest.approx([5 / 24 - h, 5 / 24 + h])
    assert crbc["seeds"] == 1 and crbc["missing_seeds"] == [1, 2] and crbc["t95"] is None
    assert crbc["diff_vs_first"]["seeds"] == [0] and crbc["diff_vs_first"]["mean"] == pytest.approx(-1 / 8)
    s = grpo["steps_to_threshold"]  # seed 0 reaches 0.5 at step 2, seed 1 at step 1, seed 2 never (censored at 4)
    assert s["per_seed"] == {0: 2, 1: 1, 2: None} and (s["reached"], s["runs"]) == (2, 3)
    assert s["mean_reached"] == 1.5 and s["restricted_mean"] == pytest.approx(7 / 3)
    assert gigpo["steps_to_threshold"]["reached"] == 0 and gigpo["steps_to_threshold"]["restricted_mean"] == 4
    assert res["start"]["eval"]["success_rate"] == 0.25
    text = Path(res["txt"]).read_text()
    assert "gigpo" in text and "+20.8" in text and "missing seeds [1, 2]" in text
    assert Path(res["png"]).stat().st_size > 10_000


def test_report_only_starts_nothing(capsys, monkeypatch, tmp_path):
    fake = FakeTrain()
    monkeypatch.setattr(compare, "launch", fake)
    argv = ["compare", str(RECIPE), "--credit", "grpo,gigpo", "--seeds", "2", "--steps", "3", "--out",
            str(tmp_path / "cmp"), *TINY]
    assert cli.main(argv + ["--report-only"]) == 1  # nothing ran yet
    assert fake.calls == [] and "no runs of this comparison yet" in capsys.readouterr().err
    assert not (tmp_path / "cmp").exists()
    assert cli.main(argv + ["--credit", "grpo", "--seeds", "1"]) == 0 and fake.runs() == [("grpo", 0)]
    assert cli.main(argv + ["--report-only"]) == 1  # 3 of the 4 runs are missing
    assert fake.runs() == [("grpo", 0)] and "no result yet for grpo seeds [1]; gigpo seeds [0, 1]" in \
        capsys.readouterr().err
    assert cli.main(argv) == 0 and len(fake.runs()) == 4
    n = len(fake.calls)
    assert cli.main(argv + ["--report-only"]) == 0 and len(fake.calls) == n
    assert "gigpo" in capsys.readouterr().out


# ---- one real comparison ---------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_real_two_methods_two_seeds(capsys, monkeypatch, tmp_path):
    argv = ["compare", str(RECIPE), "--credit", "grpo,gigpo", "--seeds", "2", "--steps", "1", "--jobs", "2",
            "--out", str(tmp_path / "cmp"), *TINY]
    assert cli.main(argv) == 0, capsys.readouterr()
    folder = next((tmp_path / "cmp").iterdir())
    res = json.loads((folder / "report.json").read_text())
    assert (folder / "report.png").stat().st_size > 10_000 and (folder / "report.txt").exists()
    assert [r["method"] for r in res["table"]] == ["grpo", "gigpo"]
    for row in res["table"]:
        assert row["seeds"] == 2 and row["episodes"] == 8 and 0 <= row["mean"] <= 1
        assert sorted(row["per_seed"]) == ["0", "1"]
        lo, hi = row["pooled_wilson95"]
        assert lo <= row["pooled"] <= hi
    diff = res["table"][1]["diff_vs_first"]
    assert diff["seeds"] == [0, 1] and diff["differences"] == pytest.approx(
        [res["table"][1]["per_seed"][s] - res["table"][0]["per_seed"][s] for s in ("0", "1")])
    for run in res["runs"]:
        assert run["steps"] == 1 and len(run["curve"]) == 1 and run["episodes"] == 4
    assert res["start"]["eval"]["n_episodes"] == 4
    capsys.readouterr()

    def no_training(*a, **k):
        raise AssertionError("a finished comparison was run again")

    monkeypatch.setattr(compare, "launch", no_training)
    assert cli.main(argv) == 0
    out = capsys.readouterr()
    assert "5 of 5 jobs already finished" in out.out + out.err
