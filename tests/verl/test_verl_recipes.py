"""The verl recipes in recipes/verl compose against verl 0.9.1's real config and point at things that exist.

For every ``recipes/verl/*.yaml``: Hydra composes it (compose API, same search path as ``main_ppo --config-path``),
every key the recipe sets exists in verl's ``ppo_trainer`` (+ agentcredit_ppo's estimator blocks), nothing is left
``???`` but verl's own unused reward-model rollout name, the estimator is registered in verl and accepts its
parameters, the agent-loop config file names ``agentcredit_env`` with a known env and accepted options, and
``make_env_dataset.py`` writes the columns the recipe's data config and the loop read. One real
``python -m verl.trainer.main_ppo --config-path ... --cfg job`` per recipe checks the CLI route (the search-path
plugin appends verl's config folder so ``ppo_trainer`` is still found).
"""

from __future__ import annotations

import importlib
import inspect
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("verl")
hydra = pytest.importorskip("hydra")
from omegaconf import OmegaConf  # noqa: E402

from agentcredit.verl.preflight import BLOCKS  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
RECIPES = ROOT / "recipes" / "verl"
RECIPE_FILES = sorted(RECIPES.glob("*.yaml"))
NAMES = [p.stem for p in RECIPE_FILES]
DATASET_SCRIPT = RECIPES / "make_env_dataset.py"
#: verl's own default ``???``: the reward model's rollout engine, read only when reward.reward_model.enable is true
ALLOWED_MISSING = {"reward.reward_model.rollout.name"}
#: keys of the recipe files that are Hydra's, not the config's
HYDRA_KEYS = {"defaults", "hydra"}


def test_there_are_recipes():
    assert {"sokoban_gigpo", "sokoban_graphhca", "alfworld_gigpo", "alfworld_graphhca", "sokoban_asct",
            "sokoban_sipo"} <= set(NAMES)


def _compose(name: str, config_dir: Path = RECIPES):
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(config_dir), version_base=None):
        return compose(config_name=name)


@pytest.fixture(scope="module")
def base():
    """agentcredit_ppo alone (verl's ppo_trainer + the estimator blocks): the keys a recipe may set."""
    return _compose("agentcredit_ppo", ROOT / "agentcredit" / "verl" / "config")


@pytest.fixture(scope="module")
def composed():
    return {name: _compose(name) for name in NAMES}


def _leaves(node, prefix=""):
    if isinstance(node, dict):
        for key, value in node.items():
            path = f"{prefix}.{key}" if prefix else str(key)
            if isinstance(value, dict) and value:
                yield from _leaves(value, path)
            else:
                yield path, value
    else:
        yield prefix, node


#: the agent loop (name, class, rollout.n) of the recipes whose estimator needs a search rollout
SEARCH_LOOPS = {"asct": ("agentcredit_counterfactual", "agentcredit.verl.search_loops.CounterfactualAgentLoop", 8),
                "sipo": ("agentcredit_tree", "agentcredit.verl.search_loops.TreeAgentLoop", 1)}
DEFAULT_LOOP = ("agentcredit_env", "agentcredit.verl.agent_loop.EnvAgentLoop", 8)


def _loop_of(name: str) -> tuple[str, str, int]:
    return SEARCH_LOOPS.get(_expected_estimator(name), DEFAULT_LOOP)


#: distillation recipes: the schedule their name ends with, and the estimator of their RL term
DISTILL_RECIPES = {"opw": "gigpo"}
#: recipes named by a method that is not their estimator: the distillation ones, CCM's memory context (GRPO) and
#: the loss terms (EVOKE next to GiGPO)
ESTIMATOR_OF = {**DISTILL_RECIPES, "ccm": "gigpo", "evoke": "gigpo"}
#: agentcredit's distillation block: a raw extra key of ``algorithm`` (verl never turns it into a dataclass)
DISTILL_BLOCK = "algorithm.agentcredit_distill"
#: every raw ``algorithm`` block of agentcredit's (distillation, CCM's term, the ROSS archive, the terms, ...): the
#: preflight's list, which refuses any other ``algorithm.agentcredit_*`` key
AGENTCREDIT_BLOCKS = tuple(f"algorithm.{b}" for b in BLOCKS)


def _expected_estimator(name: str) -> str:
    suffix = name.rsplit("_", 1)[1]
    return ESTIMATOR_OF.get(suffix, suffix)


def test_the_base_files_compose_verls_ppo_trainer_through_agentcredit_ppo():
    bases = sorted((RECIPES / "base").glob("*.yaml"))
    assert {p.stem for p in bases} >= {"common", "sokoban", "alfworld"}
    for p in bases:
        assert p.read_text().startswith("# @package _global_\n"), p  # merged at the top level, not under base:
        defaults = OmegaConf.load(p).defaults
        assert defaults[0] == ("/agentcredit_ppo" if p.stem == "common" else "common"), p
    for name in NAMES:  # each recipe lists only what differs from its base (the base files hold the rest)
        assert len((RECIPES / f"{name}.yaml").read_text().splitlines()) < 60, name


def _env_of(name: str) -> str:
    return name.rsplit("_", 1)[0]  # the env name may hold "_" (textworld_express_gigpo)


def _agent_loop_file(cfg) -> Path:
    path = Path(cfg.actor_rollout_ref.rollout.agent.agent_loop_config_path)
    return path if path.is_absolute() else ROOT / path  # resolved against the launch dir: the repo root


@pytest.mark.parametrize("name", NAMES)
def test_recipe_keys_exist_in_verl(name, base):
    from agentcredit.verl.smoke import recipe_view

    own = OmegaConf.to_container(OmegaConf.load(RECIPES / f"{name}.yaml"))
    assert own["defaults"][0].startswith("base/"), "a recipe builds on its environment's base file (recipes/verl/base)"
    raw = recipe_view(RECIPES / f"{name}.yaml")  # the recipe's keys and its base files'
    known = OmegaConf.to_container(base, resolve=False)  # '???' values stay as strings: present keys

    def exists(path):
        node = known
        for key in path.split("."):
            if not isinstance(node, dict) or key not in node:
                return False
            node = node[key]
        return True

    unknown = [path for top, value in raw.items() if top not in HYDRA_KEYS
               for path, _ in _leaves(value, top)
               if not exists(path) and not any(path == b or path.startswith(b + ".") for b in AGENTCREDIT_BLOCKS)]
    assert not unknown, f"{name}: keys not in verl 0.9.1's ppo_trainer / agentcredit_ppo: {unknown}"


def test_ccm_recipe_block_is_valid(composed):
    from agentcredit.verl.ccm import ccm_params

    assert ccm_params(composed["alfworld_ccm"].algorithm) == (0.01, 5.0)


@pytest.mark.parametrize("name", NAMES)
def test_recipe_composes_and_resolves(name, composed):
    cfg = composed[name]
    missing = set(OmegaConf.missing_keys(cfg))
    assert missing <= ALLOWED_MISSING, f"{name}: mandatory values left unset: {sorted(missing - ALLOWED_MISSING)}"
    if missing:
        assert cfg.reward.reward_model.enable is False
    container = OmegaConf.to_container(cfg, resolve=True, throw_on_missing=False)  # every interpolation resolves
    rollout = container["actor_rollout_ref"]["rollout"]
    loop, _, n = _loop_of(name)
    assert rollout["name"] == "vllm" and rollout["n"] == n
    assert rollout["agent"]["default_agent_loop"] == loop
    assert rollout["prompt_length"] == 2048 and rollout["response_length"] == 512
    assert rollout["val_kwargs"]["temperature"] == 0.4 and rollout["temperature"] == 1.0
    actor = container["actor_rollout_ref"]["actor"]
    assert actor["optim"]["lr"] == 1e-6 and actor["use_kl_loss"] and actor["kl_loss_coef"] == 0.01
    assert actor["kl_loss_type"] == "low_var_kl" and actor["ppo_mini_batch_size"] == 256
    # verl's ActorConfig.validate: train_batch_size >= ppo_mini_batch_size unless use_dynamic_bsz
    assert actor["use_dynamic_bsz"] or container["data"]["train_batch_size"] >= actor["ppo_mini_batch_size"]
    trainer = container["trainer"]
    assert trainer["use_v1"] is True, "the agentcredit_env loop needs verl's v1 trainer"
    assert trainer["test_freq"] == 5 and trainer["total_training_steps"] == 150
    env = _env_of(name)
    for key in ("train_files", "val_files"):
        assert f"agentcredit/{env}" in container["data"][key]
    assert container["actor_rollout_ref"]["model"]["path"]


@pytest.mark.parametrize("name", NAMES)
def test_estimator_registered_and_params_accepted(name, composed):
    import verl  # noqa: F401  (loads the verl.plugins entry points: agentcredit registers its estimators)
    from verl.trainer.ppo import core_algos

    import credit_plugins

    cfg = composed[name]
    est = _expected_estimator(name)
    assert cfg.algorithm.adv_estimator == est
    assert est in core_algos.ADV_ESTIMATOR_REGISTRY, f"{est} not registered in verl"
    params = OmegaConf.to_container(cfg.algorithm[est], resolve=True)
    credit_plugins.get(est).make_params(**params)


@pytest.mark.parametrize("name", NAMES)
def test_agent_loop_config(name, composed):
    import env_adapters

    cfg = composed[name]
    path = _agent_loop_file(cfg)
    assert path.is_file(), f"{name}: agent-loop config {path} missing"
    entries = OmegaConf.to_container(OmegaConf.load(path), resolve=True)
    assert isinstance(entries, list)
    loop, target, _ = _loop_of(name)
    (entry,) = [e for e in entries if e["name"] == loop]
    assert entry["_target_"] == target
    module, cls = target.rsplit(".", 1)
    loop_cls = getattr(importlib.import_module(module), cls)
    loop_params = {**inspect.signature(loop_cls.__init__).parameters,
                   **inspect.signature(loop_cls.__mro__[1].__init__).parameters}
    extra = set(entry) - {"name", "_target_"}
    assert extra <= set(loop_params), f"options EnvAgentLoop does not take: {extra - set(loop_params)}"
    assert entry["env_name"] == _env_of(name) and entry["env_name"] in env_adapters.available()
    options = entry.get("env_options") or {}
    if entry["env_name"] == "sokoban":  # cheap: build it and play a step
        env = env_adapters.make("sokoban", **options)
        env.reset(0)
        env.step("up")
    else:  # alfworld needs its data: check the option names against the factory's signature only
        from credit_plugins import registry

        factory = registry.get(entry["env_name"], kind="envs").factory
        accepted = set(inspect.signature(factory.__init__).parameters) - {"self"}
        assert set(options) <= accepted, f"options {set(options) - accepted} not accepted by {factory.__name__}"


def _read_parquet(path: Path):
    import pandas as pd

    return pd.read_parquet(path)


@pytest.mark.parametrize("env,extra", [("sokoban", ["--check", "size=6", "num_boxes=1"]),
                                       ("alfworld", ["--val-options", "split=valid_unseen"])])
def test_dataset_script(env, extra, tmp_path, composed):
    out = tmp_path / env
    subprocess.run([sys.executable, str(DATASET_SCRIPT), "--env", env, "--train", "4", "--val", "2",
                    "--out", str(out), *extra], check=True, cwd=ROOT, timeout=120)
    cfg = composed[f"{env}_gigpo"]
    train, val = _read_parquet(out / "train.parquet"), _read_parquet(out / "val.parquet")
    assert Path(cfg.data.train_files).name == "train.parquet" and Path(cfg.data.val_files).name == "val.parquet"
    for df, n in ((train, 4), (val, 2)):
        assert len(df) == n
        needed = {cfg.data.prompt_key, "data_source", "ability", "reward_model", "extra_info", "agent_name",
                  "env_name", "seed"}
        assert needed <= set(df.columns)
        assert (df.agent_name == cfg.actor_rollout_ref.rollout.agent.default_agent_loop).all()
        assert (df.env_name == env).all()
        assert df.seed.is_unique
        for prompt in df[cfg.data.prompt_key]:
            assert all({"role", "content"} <= set(m) for m in prompt)
    assert not set(train.seed) & set(val.seed)
    if env == "sokoban":
        assert train.env_options[0] == {"size": 6, "num_boxes": 1}
    else:
        assert "env_options" not in train.columns  # no shared options: the agent-loop file's apply
        assert all(o["split"] == "valid_unseen" for o in val.env_options)


@pytest.mark.parametrize("name", NAMES)
def test_main_ppo_cli_composes(name):
    """The documented launch, with --cfg job: main_ppo still finds ppo_trainer under --config-path."""
    cmd = [sys.executable, "-m", "verl.trainer.main_ppo", "--config-path", str(RECIPES), "--config-name", name,
           "--cfg", "job", "actor_rollout_ref.model.path=Qwen/Qwen2.5-1.5B-Instruct"]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    job = OmegaConf.create(proc.stdout[proc.stdout.index("actor_rollout_ref:"):])
    assert job.algorithm.adv_estimator == _expected_estimator(name)
    assert job.actor_rollout_ref.rollout.agent.agent_loop_config_path.startswith("recipes/verl/agent_loops/")


@pytest.mark.parametrize("name", NAMES)
def test_verl_validate_config(name, composed):
    """main_ppo's own pre-launch checks, and the actor's (ActorConfig.validate, run by the workers)."""
    import warnings

    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import omega_conf_to_dataclass, validate_config

    cfg = composed[name]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "Disabled critic as algorithm.adv_estimator != gae"
        validate_config(config=cfg, use_reference_policy=need_reference_policy(cfg), use_critic=need_critic(cfg))
        assert need_reference_policy(cfg) and not need_critic(cfg)
    actor = omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)
    actor.validate(n_gpus=cfg.trainer.n_gpus_per_node * cfg.trainer.nnodes, train_batch_size=cfg.data.train_batch_size)


@pytest.mark.parametrize("name", [n for n in NAMES if n.rsplit("_", 1)[1] in DISTILL_RECIPES])
def test_distillation_recipe_loss_teacher_and_schedule(name, composed):
    """A distillation recipe: verl's DistillationConfig accepts it, its loss mode is one of agentcredit's registered
    modes, and ``algorithm.agentcredit_distill`` builds the scheduler its name says."""
    import verl  # noqa: F401  (the entry point registers the loss modes)
    from verl.trainer.distillation.losses import DISTILLATION_LOSS_REGISTRY
    from verl.utils.config import omega_conf_to_dataclass

    import distill_plugins
    from agentcredit.verl import distill

    cfg = composed[name]
    dist = omega_conf_to_dataclass(cfg.distillation)
    assert dist.enabled and dist.distillation_loss.loss_mode in distill.LOSSES
    assert dist.distillation_loss.loss_mode in DISTILLATION_LOSS_REGISTRY
    (teacher,) = dist.teacher_models.values()
    assert teacher.model_path and teacher.num_replicas >= 1
    block = distill.distill_block(cfg)
    assert block["schedule"] == name.rsplit("_", 1)[1]
    distill.loss_params(block)
    sched = distill_plugins.create(block["schedule"], **block["params"])
    assert sched.on_batch(0, {}).w_opd > 0  # the warm-up distils
