"""agentcredit.verl.preflight: a misspelt advantage estimator or agentcredit block fails when the verl driver starts
(inside verl's validate_config, before Ray and the models), with suggestions."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("verl")
from omegaconf import OmegaConf  # noqa: E402

from agentcredit.verl.preflight import check_config  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def _check(**algorithm):
    check_config(OmegaConf.create({"algorithm": algorithm, "trainer": {"total_training_steps": 10}}))


@pytest.mark.parametrize("algorithm, message", [
    ({"adv_estimator": "graphhcaa"}, r"adv_estimator='graphhcaa' is not a registered .*did you mean 'graphhca'"),
    ({"adv_estimator": "grpoo"}, r"did you mean 'grpo'"),
    ({"adv_estimator": "gigpo", "gigpo": {"step_weigth": 0.5}}, r"algorithm.gigpo: .*unknown parameter.*step_weigth"),
    ({"adv_estimator": "gigpo", "gigpoo": {"step_weight": 0.5}}, r"algorithm.gigpoo .*did you mean 'gigpo'"),
    ({"adv_estimator": "grpo", "agentcredit_distil": {}}, r"agentcredit_distil is not .*did you mean 'agentcredit_distill'"),
    ({"adv_estimator": "grpo", "agentcredit_distill": {"schedule": "opww"}}, r"schedule='opww' .*did you mean 'opw'"),
    ({"adv_estimator": "grpo", "agentcredit_distill": {"schedule": "opw", "params": {"warmup": 3}}}, r"warmup"),
    ({"adv_estimator": "grpo", "agentcredit_distill": {"shedule": "opw"}}, r"unknown key.*shedule"),
    ({"adv_estimator": "grpo", "agentcredit_distill": {"loss": {"betta": 0.5}}}, r"loss: unknown.*betta"),
    ({"adv_estimator": "grpo", "agentcredit_ccm": {"distill_lamda": 0.1}}, r"agentcredit_ccm.*distill_lamda"),
    ({"adv_estimator": "grpo", "agentcredit_hindsight": {"same_layout": "yes"}}, r"same_layout must be"),
    ({"adv_estimator": "grpo", "agentcredit_archive": ""}, r"agentcredit_archive"),
    ({"adv_estimator": "grpo", "agentcredit_max_env_error_rate": 2}, r"agentcredit_max_env_error_rate=2"),
    ({"adv_estimator": "grpo", "agentcredit_distill": {"schedule": "guided", "params": {"p0": 1.0}}}, r"p0=1.0"),
    ({"adv_estimator": "gigpo", "agentcredit_adv_scale": "rms"},
     r"algorithm.agentcredit_adv_scale='rms' is not an advantage scale; valid: none, batch_rms, batch_std"),
    ({"adv_estimator": "gigpo", "agentcredit_adv_scale": 1}, r"agentcredit_adv_scale=1 is not an advantage scale"),
    ({"adv_estimator": "grpo", "agentcredit_adv_scale": "batch_rms"},  # verl's own grpo: the scale would not run
     r"agentcredit_adv_scale='batch_rms' scales an agentcredit estimator's .*adv_estimator='grpo' is verl's own"),
    ({"adv_estimator": "gigpo", "adv_scale": "batch_rms"}, r"algorithm.adv_scale is not .*did you mean "
                                                           r"algorithm.agentcredit_adv_scale\?"),
    ({"adv_estimator": "gigpo", "agentcredit_adv_scal": "batch_rms"}, r"did you mean 'agentcredit_adv_scale'"),
])
def test_a_bad_setting_is_refused_with_a_suggestion(algorithm, message):
    with pytest.raises(ValueError, match=message):
        _check(**algorithm)


@pytest.mark.parametrize("algorithm", [
    {"adv_estimator": "gae", "gamma": 1.0, "lam": 1.0, "kl_ctrl": {"type": "fixed", "kl_coef": 0.001}},
    {"adv_estimator": "grpo", "grpo": {"eps": 1e-6}},
    {"adv_estimator": "gigpo", "gigpo": {"step_weight": 0.5}, "mvpo": {}, "agentcredit_max_env_error_rate": 0.5},
    {"adv_estimator": "graphhca", "agentcredit_ccm": {"distill_lambda": 0.01}, "agentcredit_archive": "/tmp/a.jsonl"},
    {"adv_estimator": "uniopsd", "agentcredit_hindsight": {"same_layout": True},
     "agentcredit_distill": {"schedule": "opw", "params": {"warmup_steps": 4}, "loss": {"beta": 0.5}}},
    {"adv_estimator": "crbc", "agentcredit_adv_scale": "batch_std"},
    {"adv_estimator": "grpo", "agentcredit_adv_scale": "none"},
    {"adv_estimator": "grpo", "agentcredit_adv_scale": None},
])
def test_a_good_setting_passes(algorithm):
    _check(**algorithm)


def test_a_config_without_an_algorithm_is_left_alone():
    check_config(OmegaConf.create({"trainer": {}}))


def test_every_recipe_and_the_shipped_config_pass():
    from hydra import compose, initialize_config_dir

    recipes = ROOT / "recipes" / "verl"
    names = sorted(p.stem for p in recipes.glob("*.yaml"))
    assert names
    for config_dir, configs in ((recipes, names), (ROOT / "agentcredit" / "verl" / "config", ["agentcredit_ppo"])):
        with initialize_config_dir(config_dir=str(config_dir), version_base=None):
            for name in configs:
                cfg = compose(config_name=name)
                if "algorithm" in cfg:  # a base file of the recipes may hold no algorithm
                    check_config(cfg)


def test_main_ppo_with_a_misspelt_estimator_fails_before_ray_starts(tmp_path):
    start = time.monotonic()  # run in tmp_path: Hydra writes its outputs/ folder into the working directory
    proc = subprocess.run([sys.executable, "-m", "verl.trainer.main_ppo", "algorithm.adv_estimator=graphhcaa"],
                          capture_output=True, text=True, timeout=300, cwd=str(tmp_path),
                          env=dict(os.environ, PYTHONWARNINGS="ignore"))
    elapsed = time.monotonic() - start
    assert proc.returncode != 0
    assert "did you mean 'graphhca'" in proc.stderr, proc.stderr[-2000:]
    assert "ray init kwargs" not in proc.stdout  # run_ppo never started Ray
    print(f"main_ppo refused the typo after {elapsed:.1f} s")


def _compose(name, overrides=()):
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(ROOT / "recipes" / "verl"), version_base=None):
        return compose(config_name=name, overrides=list(overrides))


def test_distillation_without_a_teacher_pool_is_refused_at_start():
    cfg = _compose("sokoban_gigpo", ["distillation.enabled=true"])
    with pytest.raises(ValueError, match=r"teacher.s resource pool: set distillation.nnodes > 0"):
        check_config(cfg)


def test_the_documented_verl_distillation_command_composes_and_passes():
    """docs/distillation.md's main_ppo command for alfworld_gigpo (its overrides, <teacher> filled in)."""
    import shlex

    text = (ROOT / "docs" / "distillation.md").read_text()
    start = text.index("python -m verl.trainer.main_ppo --config-path \"$(pwd)/recipes/verl\" --config-name alfworld_gigpo")
    command = text[start:text.index("```", start)].replace("\\\n", " ").replace("<teacher>", "Qwen/Qwen2.5-7B-Instruct")
    args = shlex.split(command.replace('"$(pwd)/recipes/verl"', "recipes/verl"))
    overrides = [a for a in args if "=" in a]
    assert "distillation.enabled=true" in overrides
    cfg = _compose("alfworld_gigpo", overrides)
    check_config(cfg)
    assert cfg.distillation.n_gpus_per_node > 0 and cfg.distillation.nnodes > 0
