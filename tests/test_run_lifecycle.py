"""Issue 40, "a run is never lost": the trained model is saved, a killed run resumes where its checkpoint left it,
Ctrl-C stops cleanly, a folder holds one run (and one live process), archives name their run and env, and every path
a run reads or writes is checked before any model loads.

The real runs are ``agentcredit train`` subprocesses on the tiny model (2 layers, a few steps); they wait for a file
to appear (generous timeouts, never a wall-clock threshold) and then signal.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("trl")

from agentcredit import cli, lifecycle  # noqa: E402
from agentcredit.recipe import RecipeError, load_recipe  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TINY_DEMO = str(ROOT / "recipes" / "trl" / "minigrid_demo.yaml")

# 6 steps, a checkpoint every 2, MVPO (a stateful estimator), an archive
RECIPE = """\
output_dir: {out}
model_name_or_path: tiny-qwen2
lr_scheduler_type: constant
learning_rate: 1.0e-3
max_steps: 6
per_device_train_batch_size: 12
use_cpu: true
bf16: false
logging_steps: 1
save_strategy: steps
save_steps: 2
seed: 0
report_to: none
loss_type: dapo
beta: 0.0
temperature: 1.0
agentcredit:
  env: minigrid
  env_options: {{size: 5, shaping: 1.0}}
  bridge: rollout_func
  max_turns: 6
  groups_per_step: 2
  episodes_per_group: 2
  credit: mvpo
  rollout_options: {{archive: {out}/rollouts.jsonl}}
"""


def _recipe(tmp_path: Path, name: str = "recipe.yaml", out: Path | None = None) -> str:
    p = tmp_path / name
    p.write_text(RECIPE.format(out=out or tmp_path / "out"))
    return str(p)


def _env() -> dict[str, str]:
    # one thread: the same arithmetic in every process (and polite on a shared machine)
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "TRL_EXPERIMENTAL_SILENCE": "1"}


def _train(*args: str, **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "agentcredit.cli", "train", *args], cwd=ROOT, env=_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **kw)


def _wait_for(predicate, proc: subprocess.Popen, timeout: float = 900.0) -> None:
    """Poll until ``predicate()`` holds; fail if the process ends first or the (generous) timeout passes."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if proc.poll() is not None:
            pytest.fail(f"the run ended (rc {proc.returncode}) before the awaited file appeared:\n"
                        f"{proc.stdout.read()[-3000:]}")
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail("the awaited file never appeared")
        time.sleep(0.2)


def _metrics(out: Path) -> list[dict]:
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]


def _weights(folder: Path):
    from safetensors.torch import load_file

    return load_file(str(folder / "model.safetensors"))


# ---- real runs -------------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_sigkill_after_a_checkpoint_then_resume_continues_the_run_exactly(tmp_path):
    """A run killed (SIGKILL: no handler runs) after ``checkpoint-2`` resumes with ``resume_from_checkpoint=true``:
    the step count, MVPO's estimator state, the metrics log and the rollout archive continue, and the final model
    equals that of an uninterrupted run of the same steps (training is deterministic on the CPU with one thread:
    the trainer restores the RNG states, the data order and the optimizer from the checkpoint)."""
    import torch

    whole, cut = tmp_path / "whole", tmp_path / "cut"
    r_whole, r_cut = _recipe(tmp_path, "whole.yaml", whole), _recipe(tmp_path, "cut.yaml", cut)
    proc = _train(r_cut, "--no-eval")
    ckpt = cut / "checkpoint-2"
    _wait_for(lambda: (ckpt / "trainer_state.json").exists() and (ckpt / "agentcredit_estimator.pt").exists(), proc)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=120)
    assert proc.returncode == -signal.SIGKILL
    assert not (cut / "summary.json").exists() and not (cut / "final").exists()  # it really died mid-run
    assert lifecycle.read_run(cut)["status"] == "running"  # a crash leaves it so; its lock died with it

    again = subprocess.run([sys.executable, "-m", "agentcredit.cli", "train", r_cut, "--no-eval"], cwd=ROOT,
                           env=_env(), capture_output=True, text=True, timeout=600)
    assert again.returncode == 2 and "already holds a run" in again.stderr and "resume_from_checkpoint=true" in \
        again.stderr and "--overwrite" in again.stderr  # a plain rerun would overwrite: refused, the ways out named
    run_id = lifecycle.read_run(cut)["run_id"]

    resumed = subprocess.run([sys.executable, "-m", "agentcredit.cli", "train", r_cut, "--no-eval",
                              "resume_from_checkpoint=true"], cwd=ROOT, env=_env(), capture_output=True, text=True,
                             timeout=900)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert f"resuming run {run_id} from {cut / 'checkpoint-'}" in resumed.stdout
    full = subprocess.run([sys.executable, "-m", "agentcredit.cli", "train", r_whole, "--no-eval"], cwd=ROOT,
                          env=_env(), capture_output=True, text=True, timeout=900)
    assert full.returncode == 0, full.stdout[-3000:] + full.stderr[-3000:]

    summary = json.loads((cut / "summary.json").read_text())
    assert summary["steps"] == 6 and summary["status"] == "finished" and summary["run_id"] == run_id
    rows, ref = _metrics(cut), _metrics(whole)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]  # continued, nothing replayed twice, nothing lost
    for a, b in zip(rows, ref):  # the same losses and rollout outcomes step by step
        assert (a["loss"], a["agentcredit/success"], a["agentcredit/return"]) == \
            (b["loss"], b["agentcredit/success"], b["agentcredit/return"])
    # the estimator state continued: MVPO's batch count and success EMA equal the uninterrupted run's
    st_cut = torch.load(cut / "checkpoint-6" / "agentcredit_estimator.pt", weights_only=False)["state"]
    st_ref = torch.load(whole / "checkpoint-6" / "agentcredit_estimator.pt", weights_only=False)["state"]
    assert st_cut["batches"] == st_ref["batches"] == 6
    assert st_cut["success_ema"] == st_ref["success_ema"]
    # the final model equals the uninterrupted run's
    w_cut, w_ref = _weights(cut / "final"), _weights(whole / "final")
    assert w_cut.keys() == w_ref.keys() and all(torch.equal(w_cut[k], w_ref[k]) for k in w_ref)
    # the archive: every record names this run and env, each step's rollouts exactly once
    recs = [json.loads(x) for x in (cut / "rollouts.jsonl").read_text().splitlines()]
    assert {r["run"] for r in recs} == {run_id} and {r["env"] for r in recs} == {"minigrid"}
    assert sorted({r["step"] for r in recs}) == list(range(6)) and len(recs) == 6 * 2 * 2

    # the saved policy loads by model_name_or_path= and ross --model, with its tokenizer and recipe
    final = cut / "final"
    assert (final / "recipe.yaml").exists() and (final / "tokenizer_config.json").exists()
    assert load_recipe(r_cut, [f"model_name_or_path={final}"]).model_args["model_name_or_path"] == str(final)
    assert f"trained model: {final}" == resumed.stdout.strip().splitlines()[-1]
    archive = tmp_path / "one_success.jsonl"  # the run's own archive may hold no success to learn from
    _archive(archive, [(run_id, "minigrid")])
    assert cli.main(["ross", r_cut, "--archive", str(archive), "--out", str(tmp_path / "ross"), "--model", str(final),
                     "--steps", "1", "--batch-size", "1", "--no-eval"]) == 0
    ross_summary = json.loads((tmp_path / "ross" / "ross_summary.json").read_text())
    assert ross_summary["model"] == str(final) and ross_summary["runs"] == [run_id]


@pytest.mark.slow
def test_sigint_stops_cleanly_and_a_second_live_run_on_the_folder_is_refused(tmp_path):
    """SIGINT finishes the current step, writes a checkpoint (even with save_strategy=no), the summary and the
    curve, prints where they are and how to resume, and exits 130; meanwhile a second run on the same folder is
    refused by the lock (its rows never mix into the first run's metrics)."""
    out = tmp_path / "out"
    recipe = _recipe(tmp_path)
    proc = _train(recipe, "--no-eval", "save_strategy='no'", "max_steps=40")
    _wait_for(lambda: (out / "metrics.jsonl").exists() and len(_metrics(out)) >= 1, proc)

    second = subprocess.run([sys.executable, "-m", "agentcredit.cli", "train", recipe, "--no-eval",
                             "save_strategy='no'", "max_steps=40", "--overwrite"], cwd=ROOT, env=_env(),
                            capture_output=True, text=True, timeout=600)
    assert proc.poll() is None, "the first run ended before the second one was refused"
    assert second.returncode == 2
    assert f"in use by another live run (pid {proc.pid})" in second.stderr

    proc.send_signal(signal.SIGINT)
    printed, _ = proc.communicate(timeout=900)
    assert proc.returncode == 130, printed[-3000:]
    assert "Traceback" not in printed and "KeyboardInterrupt" not in printed
    summary = json.loads((out / "summary.json").read_text())
    done = summary["steps"]
    assert summary["status"] == "interrupted" and 1 <= done < 40 and summary["final_model"] is None
    ckpt = out / f"checkpoint-{done}"
    assert (ckpt / "trainer_state.json").exists() and (ckpt / "model.safetensors").exists()
    assert (out / "learning_curve.png").stat().st_size > 1000
    assert [r["step"] for r in _metrics(out)] == list(range(1, done + 1))
    assert f"stopped by SIGINT after step {done} of 40: checkpoint {ckpt}" in printed
    assert "resume: agentcredit train" in printed and "resume_from_checkpoint=true" in printed
    assert lifecycle.read_run(out)["status"] == "interrupted"


# ---- the lock, the folder, the paths: refused before any model loads -------------------------------------------------
@pytest.fixture
def no_model_load(monkeypatch):
    """Fail the test if a run gets as far as loading a model (or making a warm start)."""
    from agentcredit import policy, train

    def boom(*a, **k):
        raise AssertionError("a model was loaded before the bad input was found")

    monkeypatch.setattr(policy, "load_model", boom)
    monkeypatch.setattr(train, "warm_start", boom)


def _fails(capsys, argv: list[str], *needles: str, command: str = "train") -> str:
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"agentcredit {command}: error: "), err
    for n in needles:
        assert n in err, err
    return err


def test_bad_paths_are_found_before_any_model_loads(tmp_path, capsys, no_model_load):
    recipe = _recipe(tmp_path)
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    _fails(capsys, ["train", recipe, f"output_dir={a_file}"], f"output_dir='{a_file}' is a file")
    _fails(capsys, ["train", recipe, f"output_dir={a_file}/sub"], f"output_dir='{a_file}/sub' cannot be written")
    missing = tmp_path / "runs" / "nope" / "final"
    _fails(capsys, ["train", recipe, f"model_name_or_path={missing}"], "model_name_or_path=", "no such folder",
           str(missing))
    (tmp_path / "empty").mkdir()
    _fails(capsys, ["train", recipe, f"model_name_or_path={tmp_path / 'empty'}"], "is not a model folder")
    _fails(capsys, ["train", recipe, "agentcredit.schedule=tide", f"agentcredit.teacher={tmp_path}/teacher"],
           "agentcredit.teacher=", "no such folder", "agentcredit sft")
    _fails(capsys, ["train", recipe, f"agentcredit.rollout_options.archive={a_file}/rollouts.jsonl"],
           "agentcredit.rollout_options.archive (its folder)", "is a file, not a folder")
    _fails(capsys, ["train", recipe, f"agentcredit.rollout_options.archive={a_file}/sub/rollouts.jsonl"],
           "agentcredit.rollout_options.archive (its folder)", "cannot be written")
    _fails(capsys, ["train", recipe, f"output_dir={tmp_path / 'fresh'}", "resume_from_checkpoint=true"],
           "holds no checkpoint-N folder")
    _fails(capsys, ["train", recipe, f"resume_from_checkpoint={tmp_path / 'x' / 'checkpoint-4'}"],
           "resume_from_checkpoint=", "no such checkpoint folder")


def test_a_vllm_setup_the_rollouts_cannot_drive_is_refused_before_any_model_loads(tmp_path, capsys, no_model_load,
                                                                                    monkeypatch):
    """use_vllm with server mode on two processes: refused by the preflight, before TRL would start the engine."""
    from agentcredit import train

    monkeypatch.setattr(train, "training_processes", lambda: 2)  # as WORLD_SIZE=2 under torchrun
    _fails(capsys, ["train", _recipe(tmp_path), "use_vllm=true", "vllm_mode=server"], "vllm_mode='server'",
           "on 2 training processes")


def test_a_folder_with_a_run_or_a_live_lock_is_refused_and_overwrite_clears_it(tmp_path, capsys, no_model_load):
    recipe = _recipe(tmp_path)
    out = tmp_path / "out"
    (out / "checkpoint-2").mkdir(parents=True)
    (out / "metrics.jsonl").write_text('{"step": 1}\n')
    (out / "warm_start").mkdir()
    (out / "rollouts.jsonl").write_text('{"run": "old"}\n')
    _fails(capsys, ["train", recipe], "already holds a run", "metrics.jsonl", "checkpoint-2",
           "resume_from_checkpoint=true", "--overwrite")
    with lifecycle.RunLock(out):  # a live run holds the folder
        _fails(capsys, ["train", recipe, "--overwrite"], f"in use by another live run (pid {os.getpid()})")
    # a stale lock file (its process gone: no flock) does not block; --overwrite clears the old run, keeps the
    # warm start, and gets as far as the model (the fixture stops it there)
    assert (out / lifecycle.LOCK_FILE).exists()
    with pytest.raises(AssertionError, match="a model was loaded"):
        cli.main(["train", recipe, "--overwrite"])
    assert not (out / "checkpoint-2").exists() and not (out / "metrics.jsonl").exists()
    assert not (out / "rollouts.jsonl").exists() and (out / "warm_start").is_dir()
    assert lifecycle.read_run(out)["status"] == "running"


def test_a_rerun_does_not_extend_another_runs_archive(tmp_path, capsys, no_model_load):
    recipe = _recipe(tmp_path)
    shared = tmp_path / "shared.jsonl"
    shared.write_text('{"run": "20260101-000000-abcdef", "env": "minigrid"}\n')
    _fails(capsys, ["train", recipe, f"agentcredit.rollout_options.archive={shared}"],
           f"agentcredit.rollout_options.archive='{shared}' already holds another run's rollouts", "--overwrite")


def test_resume_keeps_the_archive_records_before_the_checkpoint(tmp_path):
    from agentcredit.train import _keep_archive_until

    path = tmp_path / "a.jsonl"
    path.write_text("".join(json.dumps({"run": "r1", "step": s}) + "\n" for s in (0, 0, 1, 2, 3)))
    assert _keep_archive_until(path, "r1", 2) == 3
    assert [json.loads(x)["step"] for x in path.read_text().splitlines()] == [0, 0, 1]
    path.write_text(json.dumps({"run": "r0", "step": 0}) + "\n")
    with pytest.raises(RecipeError, match="other runs \\(r0\\)"):
        _keep_archive_until(path, "r1", 2)


# ---- the clean-stop machinery --------------------------------------------------------------------------------------
def test_first_signal_sets_the_flag_and_the_second_stops_at_once(capsys):
    stop = lifecycle.GracefulStop("got {signal}")
    before = signal.getsignal(signal.SIGINT)
    with stop:
        os.kill(os.getpid(), signal.SIGINT)
        assert stop.signal == signal.SIGINT and stop.exit_code == 130
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGTERM)
    assert "got SIGINT" in capsys.readouterr().out
    assert signal.getsignal(signal.SIGINT) is before  # restored


def test_stop_callback_saves_and_stops_and_checkpoints_the_last_step():
    from types import SimpleNamespace

    from transformers import TrainerControl

    from agentcredit.trl.callbacks import StopCallback

    stop = SimpleNamespace(signal=None)
    cb = StopCallback(stop)
    args = SimpleNamespace(save_strategy="steps")
    c = cb.on_step_end(args, SimpleNamespace(global_step=3, max_steps=10), TrainerControl())
    assert not c.should_save and not c.should_training_stop
    c = cb.on_step_end(args, SimpleNamespace(global_step=10, max_steps=10), TrainerControl())
    assert c.should_save and not c.should_training_stop  # the last step is resumable with a larger max_steps
    c = cb.on_step_end(SimpleNamespace(save_strategy="no"), SimpleNamespace(global_step=10, max_steps=10),
                       TrainerControl())
    assert not c.should_save
    stop.signal = signal.SIGINT
    c = cb.on_step_end(SimpleNamespace(save_strategy="no"), SimpleNamespace(global_step=4, max_steps=10),
                       TrainerControl())
    assert c.should_save and c.should_training_stop and cb.stopped_at == 4


def test_metrics_log_is_continued_on_resume_and_restarted_on_a_fresh_run(tmp_path):
    from types import SimpleNamespace

    from agentcredit.trl.callbacks import MetricsCallback

    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s, "time": float(s)}) + "\n" for s in (1, 2, 3)))
    cb = MetricsCallback(path)
    cb.on_train_begin(None, SimpleNamespace(global_step=2, is_world_process_zero=True), None)
    assert [json.loads(x)["step"] for x in path.read_text().splitlines()] == [1, 2] and cb.rows == 2
    cb.on_log(None, SimpleNamespace(global_step=3, epoch=1.0, is_world_process_zero=True), None, logs={"loss": 0.5})
    rows = [json.loads(x) for x in path.read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3] and rows[-1]["time"] >= 2.0  # the clock continues too
    MetricsCallback(path).on_train_begin(None, SimpleNamespace(global_step=0, is_world_process_zero=True), None)
    assert path.read_text() == ""


# ---- overrides -------------------------------------------------------------------------------------------------------
def test_env_options_overrides_merge_key_by_key_and_null_or_tilde_deletes():
    full = load_recipe(TINY_DEMO).agentcredit.env_options
    assert load_recipe(TINY_DEMO, ["agentcredit.env_options={size: 7}"]).agentcredit.env_options == {**full, "size": 7}
    opts = load_recipe(TINY_DEMO, ["agentcredit.env_options={view: null, ~shaping: 0}"]).agentcredit.env_options
    assert opts == {k: v for k, v in full.items() if k not in ("view", "shaping")}
    assert "shaping" not in load_recipe(TINY_DEMO, ["agentcredit.env_options.shaping=null"]).agentcredit.env_options
    assert "shaping" not in load_recipe(TINY_DEMO, ["~agentcredit.env_options.shaping"]).agentcredit.env_options
    with pytest.raises(RecipeError, match="no key 'agentcredit.env_options.nope' to delete"):
        load_recipe(TINY_DEMO, ["~agentcredit.env_options.nope"])
    # other mappings are still replaced whole (credit_params={} clears them)
    assert load_recipe(TINY_DEMO, ["agentcredit.credit_params={}"]).agentcredit.credit_params == {}


@pytest.mark.parametrize("override,message", [
    ("agentcredit.env_options={size: big}", "agentcredit.env_options.size must be an integer (env 'minigrid'"),
    ("agentcredit.env_options.shaping=lots", "agentcredit.env_options.shaping must be a number"),
    ("agentcredit.env_options.moves=3", "agentcredit.env_options.moves must be a string"),
])
def test_a_wrong_typed_env_option_names_the_option(override, message):
    with pytest.raises(RecipeError, match=message.replace("(", r"\(")):
        load_recipe(TINY_DEMO, [override])


def test_tilde_override_reaches_the_recipe_through_the_cli(tmp_path, capsys, no_model_load):
    recipe = _recipe(tmp_path)
    with pytest.raises(AssertionError, match="a model was loaded"):  # accepted, validated, up to the model
        cli.main(["train", recipe, "~agentcredit.env_options.shaping", "--no-eval"])


# ---- sft and ross ----------------------------------------------------------------------------------------------------
def test_sft_uses_the_recipe_warm_start_learning_rate(tmp_path, capsys):
    out = tmp_path / "sft"
    assert cli.main(["sft", TINY_DEMO, "model_name_or_path=tiny-qwen2", "--out", str(out), "--steps", "0",
                     "--episodes", "4", "--no-eval"]) == 0
    assert json.loads((out / "sft_summary.json").read_text())["learning_rate"] == 1e-3
    assert "learning rate 0.001 (the recipe's agentcredit.warm_start.learning_rate)" in capsys.readouterr().out
    assert (out / "recipe.yaml").exists() and (out / "config.json").exists()
    assert cli.main(["sft", TINY_DEMO, "model_name_or_path=tiny-qwen2", "--out", str(tmp_path / "s2"), "--steps",
                     "0", "--episodes", "4", "--no-eval", "--learning-rate", "5e-5"]) == 0
    assert json.loads((tmp_path / "s2" / "sft_summary.json").read_text())["learning_rate"] == 5e-5
    capsys.readouterr()
    _fails(capsys, ["sft", TINY_DEMO, f"model_name_or_path={tmp_path}/no/model", "--out", str(tmp_path / "s3")],
           "no such folder", command="sft")


def test_sft_takes_what_the_command_line_leaves_out_from_the_recipe_warm_start(tmp_path, capsys):
    """`agentcredit sft RECIPE --out D` makes the recipe's own warm start (as `train` would), not fixed defaults."""
    out = tmp_path / "ws"
    assert cli.main(["sft", TINY_DEMO, "model_name_or_path=tiny-qwen2", "--out", str(out), "--no-eval",
                     "agentcredit.warm_start={policy: random, steps: 1, episodes: 3, batch_size: 5}"]) == 0
    summary = json.loads((out / "sft_summary.json").read_text())
    assert (summary["player"], summary["steps"], summary["episodes"], summary["batch_size"]) == ("random", 1, 3, 5)
    assert "episodes=3, steps=1, batch_size=5, player=random (the recipe's agentcredit.warm_start)" in \
        capsys.readouterr().out
    out2 = tmp_path / "ws2"  # what is given wins; without a warm_start block the old defaults hold
    assert cli.main(["sft", TINY_DEMO, "model_name_or_path=tiny-qwen2", "--out", str(out2), "--no-eval",
                     "agentcredit.warm_start=null", "--steps", "0", "--episodes", "2"]) == 0
    summary = json.loads((out2 / "sft_summary.json").read_text())
    assert (summary["player"], summary["steps"], summary["episodes"], summary["batch_size"]) == ("expert", 0, 2, 32)
    assert "batch_size=32, player=expert (the defaults)" in capsys.readouterr().out


def _archive(path: Path, runs_envs) -> None:
    from distill_plugins.ross import ArchivedTrajectory, ArchivedTurn, ArchiveWriter

    for run, env in runs_envs:
        traj = ArchivedTrajectory(turns=[ArchivedTurn(t=0, prompt_ids=[1, 2], completion_ids=[3], state=1, action=1,
                                                      reward=1.0, valid=True)], success=True)
        ArchiveWriter(path, run=run, env=env).write([traj])


def test_archive_records_carry_their_run_and_env(tmp_path):
    from distill_plugins.ross import archive_provenance, read_archive

    path = tmp_path / "a.jsonl"
    _archive(path, [("r1", "minigrid"), ("r2", "sokoban")])
    back = list(read_archive(path))
    assert [(t.run, t.env) for t in back] == [("r1", "minigrid"), ("r2", "sokoban")]
    assert archive_provenance(back) == {"runs": {"r1": 1, "r2": 1}, "envs": {"minigrid": 1, "sokoban": 1}}


def test_ross_refuses_other_envs_mixed_runs_and_missing_paths_before_any_model_loads(tmp_path, capsys,
                                                                                    no_model_load):
    recipe = _recipe(tmp_path)
    out = str(tmp_path / "ross")
    other = tmp_path / "sokoban.jsonl"
    _archive(other, [("r1", "sokoban")])
    _fails(capsys, ["ross", recipe, "--archive", str(other), "--out", out],
           "env 'sokoban'", "agentcredit.env='minigrid'", command="ross")
    mixed = tmp_path / "mixed.jsonl"
    _archive(mixed, [("r1", "minigrid"), ("r2", "minigrid"), ("r2", "minigrid")])
    _fails(capsys, ["ross", recipe, "--archive", str(mixed), "--out", out],
           "mixes the rollouts of 2 runs", "r1: 1 records", "r2: 2 records", "--run-id", command="ross")
    _fails(capsys, ["ross", recipe, "--archive", str(mixed), "--out", out, "--run-id", "r3"],
           "--run-id 'r3'", command="ross")
    _fails(capsys, ["ross", recipe, "--archive", str(tmp_path / "none.jsonl"), "--out", out],
           "--archive=", "no such archive file", command="ross")
    _fails(capsys, ["ross", recipe, "--archive", str(mixed), "--out", out, "--run-id", "r1", "--model",
                    str(tmp_path / "runs" / "x" / "final")], "--model=", "no such folder", command="ross")
    _fails(capsys, ["ross", recipe, "--archive", str(mixed), "--out", out, "--run-id", "r2",
                    "agentcredit.terms={advisd: {}}"], "agentcredit.terms.advisd.executor=PATH", command="ross")
    with pytest.raises(AssertionError, match="a model was loaded"):  # one run picked: on to the model
        cli.main(["ross", recipe, "--archive", str(mixed), "--out", out, "--run-id", "r2"])


def test_ross_starts_from_the_recipe_warm_start_and_says_so(tmp_path, capsys):
    archive = tmp_path / "a.jsonl"
    _archive(archive, [("r1", "minigrid")])
    run = tmp_path / "run"
    over = ["model_name_or_path=tiny-qwen2", f"output_dir={run}", "agentcredit.max_turns=4",
            "per_device_train_batch_size=8",
            "agentcredit.warm_start={steps: 1, batch_size: 2, episodes: 2}"]
    assert cli.main(["ross", TINY_DEMO, *over, "--archive", str(archive), "--out", str(tmp_path / "ross"),
                     "--steps", "1", "--batch-size", "1", "--no-eval"]) == 0
    printed = capsys.readouterr().out
    assert f"fine-tuning {run / 'warm_start'} (the recipe's warm start" in printed
    summary = json.loads((tmp_path / "ross" / "ross_summary.json").read_text())
    assert summary["model"] == str(run / "warm_start") and summary["runs"] == ["r1"]


# ---- verl smoke ------------------------------------------------------------------------------------------------------
def test_verl_smoke_failure_prints_the_cause_line(tmp_path, capsys, monkeypatch):
    from agentcredit.verl import smoke

    log = ("[   1.0s] starting\n[   2.0s] Could not override 'algorithm.gama'.\n"
           "[   2.0s] To append to your config use +algorithm.gama=0.9\n[   2.0s] Key 'gama' is not in struct\n"
           "[   2.0s]     full_key: algorithm.gama\n"
           "[   2.1s] Set the environment variable HYDRA_FULL_ERROR=1 for a complete stack trace.\n")

    def fake_run(run, timeout=None, echo=False):
        (tmp_path / "run.log").write_text(log)
        return 1, log, {}

    monkeypatch.setattr(smoke, "prepare", lambda *a, **k: object())
    monkeypatch.setattr(smoke, "run", fake_run)
    recipe = tmp_path / "v.yaml"
    recipe.write_text("algorithm: {}\n")
    assert cli.main(["verl", str(recipe), "--cpu-smoke", "--workdir", str(tmp_path), "algorithm.gama=0.9"]) == 1
    err = capsys.readouterr().err
    assert "the run failed (exit 1): Key 'gama' is not in struct; see" in err
    (tmp_path / "t.log").write_text("[ 1.0s] (TaskRunner pid=7) ok\n[ 1.1s] (TaskRunner pid=7) ValueError: bad x\n"
                                    "[ 1.2s]   at the end\n")
    assert smoke.cause_line(tmp_path / "t.log") == "ValueError: bad x"
    assert smoke.cause_line(tmp_path / "missing.log") == ""


def test_verl_archive_records_name_their_run():
    from types import SimpleNamespace

    from agentcredit.verl.archive import run_name

    cfg = SimpleNamespace(trainer=SimpleNamespace(project_name="p", experiment_name="sokoban"))
    assert run_name(cfg).startswith("p/sokoban@") and run_name(cfg).endswith(f"-{os.getpid()}")
    assert run_name(None).startswith("verl@")


def test_a_lora_run_saves_the_merged_model_and_its_adapter(tmp_path):
    """``save_final`` on a LoRA model: ``final/`` is a plain checkpoint with the adapter merged in (loadable without
    peft, equal to the merged weights), ``final/adapter`` the adapter itself, plus tokenizer and recipe."""
    from types import SimpleNamespace

    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from agentcredit.models import resolve_model
    from agentcredit.train import save_final

    path = resolve_model("tiny-qwen2")
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32),
                           LoraConfig(r=2, lora_alpha=4, task_type="CAUSAL_LM", init_lora_weights=False))
    trainer = SimpleNamespace(model=model, accelerator=SimpleNamespace(unwrap_model=lambda m: m))
    recipe = load_recipe(_recipe(tmp_path), ["agentcredit.lora={r: 2, alpha: 4}"])
    final = Path(save_final(trainer, AutoTokenizer.from_pretrained(path), recipe, tmp_path / "final", {"run_id": "r"}))
    assert (final / "adapter" / "adapter_config.json").exists() and not (final / "adapter_config.json").exists()
    assert (final / "recipe.yaml").exists() and (final / "tokenizer_config.json").exists()
    assert "lora" in (final / "recipe.yaml").read_text()
    merged = model.merge_and_unload().state_dict()
    loaded = AutoModelForCausalLM.from_pretrained(final, dtype=torch.float32).state_dict()
    base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).state_dict()
    assert all(torch.equal(loaded[k], merged[k]) for k in base)
    assert any(not torch.equal(loaded[k], base[k]) for k in base)  # the adapter is in the weights
