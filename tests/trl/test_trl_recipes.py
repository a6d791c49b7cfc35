"""TRL recipes: ``agentcredit.recipe`` (loading, overrides, validation, derived batch geometry), the shipped
``recipes/trl/*.yaml``, ``agentcredit train`` end to end on the tiny model, and the verl-recipe command."""

from __future__ import annotations

import glob
import json
import math
import os
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("trl")

from agentcredit import cli  # noqa: E402
from agentcredit.recipe import RecipeError, is_verl_recipe, load_recipe  # noqa: E402
from agentcredit.train import train_seeds  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
TRL_RECIPES = sorted(glob.glob(str(ROOT / "recipes" / "trl" / "*.yaml")))
DEMO = str(ROOT / "recipes" / "trl" / "minigrid_gigpo.yaml")
TINY_DEMO = str(ROOT / "recipes" / "trl" / "minigrid_demo.yaml")
SYNTHETIC = str(ROOT / "recipes" / "trl" / "synthetic_keydoor_compare.yaml")

BASE = """\
model_name_or_path: tiny-qwen2
output_dir: {out}
max_steps: 3
learning_rate: 3.0e-5
per_device_train_batch_size: 12
use_cpu: true
logging_steps: 1
report_to: none
agentcredit:
  env: minigrid
  env_options: {{size: 5}}
  bridge: rollout_func
  max_turns: 6
  groups_per_step: 2
  episodes_per_group: 2
  credit: gigpo
  credit_params: {{gamma: 0.9}}
"""


def _write(tmp_path, text: str | None = None, **replace) -> str:
    text = (text or BASE).format(out=tmp_path / "out")
    for old, new in replace.items():
        text = text.replace(old, new)
    p = tmp_path / "recipe.yaml"
    p.write_text(text)
    return str(p)


def _cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:  # pragma: no cover
        return False


# ---- the shipped recipes -------------------------------------------------------------------------------------------
def test_there_are_shipped_recipes():
    names = {Path(p).stem for p in TRL_RECIPES}
    assert {"minigrid_gigpo", "sokoban_gigpo_env_factory"} <= names


@pytest.mark.parametrize("path", TRL_RECIPES, ids=lambda p: Path(p).stem)
def test_shipped_recipes_checkpoint_long_runs(path):
    """Every recipe checkpoints a few times per run (resume_from_checkpoint=true), keeping the last two."""
    t = load_recipe(path, [] if _cuda() or "use_cpu" in Path(path).read_text() else ["use_cpu=true"]).trl_args
    assert t["save_strategy"] == "steps" and 1 <= t["save_steps"] <= max(t["max_steps"] // 3, 1)
    assert t["save_total_limit"] == 2


@pytest.mark.parametrize("path", TRL_RECIPES, ids=lambda p: Path(p).stem)
def test_shipped_recipe_loads_and_builds_grpo_config(path):
    overrides = [] if _cuda() or "use_cpu" in Path(path).read_text() else ["use_cpu=true"]  # GPU recipes on CPU
    r = load_recipe(path, overrides)
    ac = r.agentcredit
    cfg = r.grpo_config()
    E, T, P = ac.episodes_per_group, ac.max_turns, ac.groups_per_step
    G = E * T if ac.bridge == "rollout_func" else E
    assert cfg.num_generations == G
    assert cfg.generation_batch_size == P * G
    # one generation round is one optimizer step
    assert cfg.steps_per_generation == cfg.gradient_accumulation_steps
    assert cfg.gradient_accumulation_steps * cfg.per_device_train_batch_size == P * G
    assert cfg.max_steps > 0 and r.model_args["model_name_or_path"]
    if ac.bridge == "rollout_func":
        assert cfg.max_completion_length == ac.max_new_tokens
    else:
        assert cfg.max_tool_calling_iterations == T
    assert not is_verl_recipe(path)


def test_demo_recipe_settings():
    r = load_recipe(DEMO)
    t, ac = r.trl_args, r.agentcredit
    assert r.model_args["model_name_or_path"] == "smollm2-135m-instruct"
    assert (t["loss_type"], t["beta"], t["num_iterations"], t["temperature"]) == ("dapo", 0.0, 1, 0.7)
    from agentcredit.precision import native_bf16

    assert t["bf16"] is native_bf16("cpu") and r.precision  # bf16: auto, resolved by this machine's CPU
    assert t["lr_scheduler_type"] == "constant" and 3e-5 <= t["learning_rate"] <= 1e-4
    assert t["use_cpu"] is True and t["logging_steps"] == 1 and t["save_strategy"] == "steps"
    assert (ac.env, ac.bridge, ac.credit, ac.freeze_layers) == ("minigrid", "rollout_func", "gigpo", 20)
    assert ac.env_options == {"size": 6, "moves": "absolute", "view": "coords", "shaping": 1.0}
    assert ac.system == "Grid game."
    # the held-out protocol the README's before/after numbers were measured with
    assert ac.eval.seed_list == list(range(20000, 20064)) and ac.eval.temperature == 0.7 and not ac.eval.greedy


def test_tiny_demo_recipe_settings():
    """The README's first command: the protocol its before/after numbers were measured with."""
    r = load_recipe(TINY_DEMO)
    t, ac = r.trl_args, r.agentcredit
    assert r.model_args["model_name_or_path"] == "tiny-qwen2-4x256"
    assert t["bf16"] is False and t["use_cpu"] is True and t["temperature"] == 1.0
    assert (t["max_steps"], t["learning_rate"], t["loss_type"], t["beta"]) == (200, 1e-4, "dapo", 0.0)
    assert (ac.env, ac.credit, ac.max_turns, ac.groups_per_step, ac.episodes_per_group, ac.max_new_tokens) == \
        ("minigrid", "gigpo", 10, 2, 8, 6)
    assert ac.env_options == {"size": 6, "moves": "absolute", "view": "coords", "shaping": 1.0, "invalid_penalty": -1.0}
    ws = ac.warm_start
    assert (ws.steps, ws.batch_size, ws.learning_rate, ws.episodes) == (200, 32, 1e-3, 1024)
    # held-out seeds never used to choose the settings (those were compared on 20000..20511)
    assert ac.eval.seed_list == list(range(30000, 30512)) and ac.eval.temperature == 1.0
    assert ac.eval.sampling_seed == 0 and not ac.eval.greedy
    assert not set(train_seeds(r, 200, 0)) & set(ac.eval.seed_list)


def test_the_demo_model_is_a_larger_tiny_qwen2_with_the_same_tokenizer(tmp_path, monkeypatch):
    from transformers import AutoConfig, AutoTokenizer

    from agentcredit import models

    monkeypatch.setenv("AGENTCREDIT_CACHE", str(tmp_path))  # built here, not taken from the user's cache
    big, small = models.resolve_model("tiny-qwen2-4x256"), models.resolve_model("tiny-qwen2")
    assert big == str(tmp_path / "models" / "tiny-qwen2-4x256")
    cb, cs = AutoConfig.from_pretrained(big), AutoConfig.from_pretrained(small)
    assert (cb.num_hidden_layers, cb.hidden_size, cs.num_hidden_layers, cs.hidden_size) == (4, 256, 2, 64)
    tb, ts = AutoTokenizer.from_pretrained(big), AutoTokenizer.from_pretrained(small)
    assert tb.get_vocab() == ts.get_vocab() and tb.chat_template == ts.chat_template
    assert models.resolve_model("TINY-QWEN2-4X256") == big  # names are case-insensitive; built once


def test_warm_start_block_is_validated():
    from agentcredit.recipe import WarmStartConfig

    assert load_recipe(DEMO).agentcredit.warm_start is None  # no warm start unless asked for
    assert load_recipe(DEMO, ["agentcredit.warm_start={}"]).agentcredit.warm_start == WarmStartConfig()
    r = load_recipe(TINY_DEMO, ["agentcredit.warm_start.steps=7"])
    assert r.agentcredit.warm_start.steps == 7 and r.agentcredit.warm_start.episodes == 1024
    assert load_recipe(TINY_DEMO, ["agentcredit.warm_start=null"]).agentcredit.warm_start is None
    for override, match in [("agentcredit.warm_start.stpes=3", r"'stpes' in agentcredit.warm_start.*steps"),
                            ("agentcredit.warm_start.steps=0", r"agentcredit.warm_start.steps must be an integer >= 1"),
                            ("agentcredit.warm_start.episodes=2.5", r"agentcredit.warm_start.episodes must be"),
                            ("agentcredit.warm_start.learning_rate=.nan", r"warm_start.learning_rate must be a finite"),
                            ("agentcredit.warm_start.learning_rate=fast", r"warm_start.learning_rate must be a finite"),
                            ("agentcredit.warm_start=[1]", r"agentcredit.warm_start must be a mapping"),
                            ("agentcredit.warm_start.policy=best", r"warm_start.policy='best'; choose one of "
                                                                   r"\['expert', 'random'\]"),
                            ("agentcredit.rollout=memory", r"warm_start trains on the Markovian turn prompts.*"
                                                           r"rollout: memory"),
                            # env_options overrides merge: null drops the demo's view: coords
                            ("agentcredit.env_options={moves: relative, view: null}", r"warm_start needs a "
                                                                                      r"scripted expert")]:
        with pytest.raises(RecipeError, match=match):
            load_recipe(TINY_DEMO, [override])
    # the random player needs no scripted expert
    r = load_recipe(TINY_DEMO, ["agentcredit.env_options={moves: relative, view: null}",
                                "agentcredit.warm_start.policy=random"])
    assert r.agentcredit.warm_start.policy == "random"


def test_warm_start_is_built_aside_so_an_interrupted_one_is_never_reused(tmp_path, monkeypatch):
    """A warm start that dies halfway leaves the previous checkpoint (and its summary) untouched and no debris; a
    rerun then makes it again. Multi-process launches and too few training seeds are refused by name."""
    from agentcredit import sft, train

    recipe = load_recipe(TINY_DEMO, ["agentcredit.warm_start={steps: 3, episodes: 4}"])
    target = tmp_path / "warm_start"
    target.mkdir()
    (target / "config.json").write_text("{}")
    old = {"fingerprint": {"an": "older warm start"}}
    (target / "sft_summary.json").write_text(json.dumps(old))

    def dies_halfway(recipe, out, **kw):
        Path(out, "model.safetensors").write_text("half")
        raise KeyboardInterrupt

    monkeypatch.setattr(sft, "run_sft", dies_halfway)
    with pytest.raises(KeyboardInterrupt):
        train.warm_start(recipe, tmp_path)
    assert json.loads((target / "sft_summary.json").read_text()) == old
    assert not (target / "model.safetensors").exists() and sorted(p.name for p in tmp_path.iterdir()) == ["warm_start"]

    made = []

    def completes(recipe, out, **kw):
        made.append(kw)
        Path(out, "config.json").write_text("{}")
        Path(out, "sft_summary.json").write_text(json.dumps({"out": kw["final_out"], "fingerprint": sft.fingerprint(recipe, **{
            k: kw[k] for k in ("episodes", "steps", "batch_size", "learning_rate")})}))

    monkeypatch.setattr(sft, "run_sft", completes)
    assert train.warm_start(recipe, tmp_path) == str(target)
    assert json.loads((target / "sft_summary.json").read_text())["out"] == str(target)
    assert train.warm_start(recipe, tmp_path) == str(target) and len(made) == 1  # the second call reuses it
    assert made[0]["steps"] == 3 and made[0]["episodes"] == 4 and made[0]["eval"] is False
    assert made[0]["final_out"] == str(target)  # the summary names the folder it was renamed to, not the temporary one

    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(RecipeError, match=r"warm_start runs in one process.*agentcredit sft"):
        train.warm_start(recipe, tmp_path)
    monkeypatch.delenv("WORLD_SIZE")
    monkeypatch.undo()
    few = load_recipe(TINY_DEMO, ["agentcredit.train_seeds=[0,10]", "max_steps=2"])
    with pytest.raises(RecipeError, match=r"1024 expert episodes need as many training seeds.*holds 10"):
        sft.run_sft(few, str(tmp_path / "x"), episodes=1024, steps=1)


def test_sft_with_zero_steps_saves_and_evaluates_the_model_as_it_is(tmp_path):
    """``--steps 0`` is the start of a run with no warm start (a pretrained LM in benchmarks/credit_learning.py):
    the saved weights are the recipe's model's own, evaluated, with no loss to report; a negative count is refused."""
    import torch

    from agentcredit import policy, sft

    recipe = load_recipe(TINY_DEMO, ["agentcredit.eval.seeds=[20000,20004]", "agentcredit.max_turns=4",
                                     "per_device_train_batch_size=16"])
    summary = sft.run_sft(recipe, str(tmp_path / "start"), episodes=4, steps=0)
    assert summary["steps"] == 0 and summary["loss_first"] is None and summary["loss_last"] is None
    assert summary["eval"]["n_episodes"] == 4
    _, _, base = policy.load_model(recipe)
    _, _, saved = policy.load_model(load_recipe(TINY_DEMO, [f"model_name_or_path={tmp_path / 'start'}"]))
    want = base.state_dict()
    assert all(torch.equal(v, want[k]) for k, v in saved.state_dict().items())
    with pytest.raises(RecipeError, match=r"sft steps=-1: give a whole number >= 0"):
        sft.run_sft(recipe, str(tmp_path / "x"), episodes=4, steps=-1)


def test_the_warm_start_fingerprint_follows_what_changes_the_checkpoint():
    from agentcredit import sft

    base = sft.fingerprint(load_recipe(TINY_DEMO), steps=400)
    for override in ("model_revision=abc", "bf16=true", "agentcredit.env_options.size=5", "agentcredit.max_turns=5",
                     "agentcredit.system=Play.", "agentcredit.eval.seeds=[40000,40064]"):
        assert sft.fingerprint(load_recipe(TINY_DEMO, [override], validate_trl=False), steps=400) != base, override
    assert sft.fingerprint(load_recipe(TINY_DEMO, ["learning_rate=3e-4"]), steps=400) == base  # the RL lr: no
    assert sft.fingerprint(load_recipe(TINY_DEMO), steps=401) != base
    # the player changes the checkpoint; the expert's adds nothing, so warm starts made before the option stay valid
    assert sft.fingerprint(load_recipe(TINY_DEMO), steps=400, **sft.player_setting("expert")) == base
    assert sft.fingerprint(load_recipe(TINY_DEMO), steps=400, **sft.player_setting("random")) != base


def test_random_player_warm_start_teaches_legal_actions_only(tmp_path):
    """``player="random"``: every target is a legal action of the state its prompt shows, the actions of one state
    are all taken (uniform, not the expert's choice), and the summary reports the format: legal-action mass in
    [0, 1] and the entropy over the legal actions, never above log |legal actions|."""
    import random

    from agentcredit import policy, sft
    from env_adapters.synthetic_solver import make_task

    recipe = load_recipe(SYNTHETIC, ["agentcredit.eval.seeds=[20000,20002]", "agentcredit.max_turns=6"])
    _, tok, _ = policy.load_model(recipe)
    rows = sft.expert_turns(recipe, tok, list(range(40)), random.Random(0), player="random")
    task = make_task("keydoor", 0)
    decoded = [(tok.decode(p), tok.decode(t).removesuffix("</action>")) for p, t in rows]
    assert {a for _, a in decoded} <= {a for acts in task.actions for a in acts}
    at_start = [a for p, a in decoded if task.observations[task.start] in p]
    assert len(at_start) >= 40 and set(at_start) <= set(task.actions[task.start])
    assert len(set(at_start)) >= 3  # 40 uniform draws over the start's actions, not one expert move
    with pytest.raises(RecipeError, match=r"player='best'"):
        sft.expert_turns(recipe, tok, [0], random.Random(0), player="best")
    summary = sft.run_sft(recipe, str(tmp_path / "fmt"), episodes=4, steps=2, batch_size=4, player="random")
    fmt = summary["format"]
    assert summary["player"] == "random" and fmt["states"] > 0
    assert 0.0 <= fmt["legal_mass"] <= 1.0 + 1e-9 and 0.0 <= fmt["entropy"] <= fmt["log_legal"] + 1e-9


def test_tensorboard_added_unless_report_to_is_set(tmp_path):
    import importlib.util

    r = load_recipe(_write(tmp_path, **{"report_to: none\n": ""}))
    expected = ["tensorboard"] if importlib.util.find_spec("tensorboard") else "none"
    assert r.trl_args["report_to"] == expected
    assert load_recipe(_write(tmp_path)).trl_args["report_to"] == "none"


# ---- overrides -------------------------------------------------------------------------------------------------------
def test_overrides(tmp_path):
    p = _write(tmp_path)
    r = load_recipe(p, ["agentcredit.credit=graphhca", "agentcredit.credit_params={}", "learning_rate=1e-4",
                        "agentcredit.env_options.size=6", "agentcredit.env_options.shaping=1.0",
                        "agentcredit.eval.seeds=[20000,20004]", "max_steps=5"])
    assert r.agentcredit.credit == "graphhca" and r.agentcredit.credit_params == {}
    assert r.trl_args["learning_rate"] == pytest.approx(1e-4) and r.grpo_config().learning_rate == pytest.approx(1e-4)
    assert r.agentcredit.env_options == {"size": 6, "shaping": 1.0}  # dotted keys set one entry of the mapping
    assert r.agentcredit.eval.seed_list == [20000, 20001, 20002, 20003]
    assert r.trl_args["max_steps"] == 5
    r = load_recipe(p, ["agentcredit.env_options={size: 6}"])  # merged into the mapping (which holds only size)
    assert r.agentcredit.env_options == {"size": 6}
    # geometry follows overridden sizes
    r = load_recipe(p, ["agentcredit.episodes_per_group=4", "per_device_train_batch_size=24"])
    assert (r.trl_args["num_generations"], r.trl_args["generation_batch_size"],
            r.trl_args["gradient_accumulation_steps"]) == (24, 48, 2)


def test_malformed_override(tmp_path):
    with pytest.raises(ValueError, match="key=value"):
        load_recipe(_write(tmp_path), ["learning_rate"])


# ---- errors ----------------------------------------------------------------------------------------------------------
def test_unknown_top_level_key_names_it_and_suggests(tmp_path):
    with pytest.raises(ValueError) as e:
        load_recipe(_write(tmp_path, **{"learning_rate:": "learnng_rate:"}))
    assert "'learnng_rate'" in str(e.value) and "did you mean 'learning_rate'" in str(e.value)
    with pytest.raises(ValueError, match="'learning_rat'.*did you mean 'learning_rate'"):
        load_recipe(_write(tmp_path), ["learning_rat=1e-4"])


def test_unknown_agentcredit_key_lists_valid(tmp_path):
    with pytest.raises(ValueError) as e:
        load_recipe(_write(tmp_path), ["agentcredit.episodes_per_grp=4"])
    msg = str(e.value)
    assert "'episodes_per_grp'" in msg and "did you mean 'episodes_per_group'" in msg
    assert "groups_per_step" in msg and "credit_params" in msg  # the valid keys are listed
    with pytest.raises(ValueError, match="'seed'.*agentcredit.eval.*seeds"):
        load_recipe(_write(tmp_path), ["agentcredit.eval.seed=[1,2]"])


def test_unknown_env(tmp_path):
    with pytest.raises(ValueError, match="'minigird'.*did you mean 'minigrid'.*available: .*sokoban"):
        load_recipe(_write(tmp_path), ["agentcredit.env=minigird"])
    with pytest.raises(ValueError, match="env_options.*'sise'"):
        load_recipe(_write(tmp_path), ["agentcredit.env_options.sise=5"])


def test_missing_env_package_names_the_key(tmp_path, monkeypatch):
    from credit_plugins import registry

    real = registry.get

    def broken(name, kind="estimators"):
        if kind == "envs":
            def factory(**_):
                raise ImportError("the 'minigrid' environment needs the 'minigrid' package")
            return factory
        return real(name, kind)

    monkeypatch.setattr(registry, "get", broken)
    with pytest.raises(ImportError, match="agentcredit.env='minigrid'.*needs the 'minigrid' package"):
        load_recipe(_write(tmp_path))


def test_unknown_estimator_lists_valid(tmp_path):
    with pytest.raises(ValueError) as e:
        load_recipe(_write(tmp_path), ["agentcredit.credit=gigpoo"])
    msg = str(e.value)
    assert "'gigpoo'" in msg and "did you mean 'gigpo'" in msg
    assert all(name in msg for name in ("grpo", "gigpo", "graphhca"))


def test_unknown_scheduler(tmp_path):
    with pytest.raises(ValueError, match="agentcredit.schedule='no_such_schedule'.*scheduler"):
        load_recipe(_write(tmp_path), ["agentcredit.schedule=no_such_schedule"])


def test_adv_scale_is_validated_and_null_means_the_default(tmp_path):
    from credit_plugins.scaling import DEFAULT_ADV_SCALE

    assert load_recipe(_write(tmp_path)).agentcredit.adv_scale == DEFAULT_ADV_SCALE
    assert load_recipe(_write(tmp_path), ["agentcredit.adv_scale=null"]).agentcredit.adv_scale == DEFAULT_ADV_SCALE
    assert load_recipe(_write(tmp_path), ["agentcredit.adv_scale=batch_rms"]).agentcredit.adv_scale == "batch_rms"
    for bad in ("rms", "[batch_rms]", "1", "None"):
        with pytest.raises(RecipeError, match=r"agentcredit.adv_scale=.* is not an advantage scale; valid: none, "
                                              r"batch_rms, batch_std"):
            load_recipe(_write(tmp_path), [f"agentcredit.adv_scale={bad}"])


def test_bad_credit_param_names_it(tmp_path):
    with pytest.raises(ValueError, match="credit_params.*'gama'.*gamma"):
        load_recipe(_write(tmp_path), ["agentcredit.credit_params.gama=0.9"])


def test_bad_bridge_and_sizes(tmp_path):
    with pytest.raises(ValueError, match="bridge.*rollout_func.*environment_factory"):
        load_recipe(_write(tmp_path), ["agentcredit.bridge=rollout"])
    for key, value in (("max_turns", 0), ("groups_per_step", -1), ("max_new_tokens", 0), ("episodes_per_group", 1)):
        with pytest.raises(ValueError, match=f"agentcredit.{key}"):
            load_recipe(_write(tmp_path), [f"agentcredit.{key}={value}"])
    with pytest.raises(ValueError, match="agentcredit.train_seeds"):
        load_recipe(_write(tmp_path), ["agentcredit.train_seeds=[10,5]"])
    with pytest.raises(ValueError, match="max_steps"):
        load_recipe(_write(tmp_path, **{"max_steps: 3\n": ""}))


def test_lora_and_freeze_layers_together(tmp_path):
    with pytest.raises(ValueError, match="lora.*freeze_layers"):
        load_recipe(_write(tmp_path), ["agentcredit.freeze_layers=1", "agentcredit.lora={r: 8, alpha: 16}"])
    r = load_recipe(_write(tmp_path), ["agentcredit.lora={r: 8, alpha: 16, target_modules: [q_proj]}"])
    assert r.agentcredit.lora_kwargs() == {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj"],
                                            "task_type": "CAUSAL_LM"}
    with pytest.raises(ValueError, match="'rank'.*agentcredit.lora"):
        load_recipe(_write(tmp_path), ["agentcredit.lora={rank: 8}"])


def test_batch_geometry_that_does_not_divide(tmp_path):
    # rollout_func: 2 groups x 2 episodes x 6 turns = 24 rows; 5 does not divide them
    with pytest.raises(ValueError) as e:
        load_recipe(_write(tmp_path), ["per_device_train_batch_size=5"])
    assert "per_device_train_batch_size=5" in str(e.value) and "24" in str(e.value)


def test_multi_process_turn_rollout_needs_whole_groups_per_process(tmp_path, monkeypatch):
    """TRL hands each process a contiguous slice of the generation batch and the turn rollout plays whole groups per
    call, so groups_per_step must be a multiple of the process count, not only the batch of per-device micro-batches;
    refused when the recipe loads (before any model), naming the key and a value that works."""
    monkeypatch.setenv("WORLD_SIZE", "2")  # as torchrun / accelerate launch set it (no GRPOConfig: no process group)
    # 3 groups x 12 rows = 36 = 3 micro-batches of 6 x 2 processes: the global condition holds, the slices do not
    with pytest.raises(RecipeError, match=r"agentcredit\.groups_per_step=3 is not a multiple of the 2 training "
                                          r"processes.*multiple of 2 \(e\.g\. 4: then 24 rows per process"):
        load_recipe(_write(tmp_path), ["agentcredit.groups_per_step=3", "per_device_train_batch_size=6"],
                    validate_trl=False)
    r = load_recipe(_write(tmp_path), ["agentcredit.groups_per_step=4", "per_device_train_batch_size=6"],
                    validate_trl=False)
    assert (r.trl_args["generation_batch_size"], r.trl_args["gradient_accumulation_steps"]) == (48, 4)
    # TRL's own tool loop: the credit mixin gathers every rank's rows, so a group may span processes
    r = load_recipe(_write(tmp_path), ["agentcredit.bridge=environment_factory", "agentcredit.groups_per_step=3",
                                       "agentcredit.episodes_per_group=4", "per_device_train_batch_size=2"],
                    validate_trl=False)
    assert r.trl_args["generation_batch_size"] == 12


def test_conflicting_derived_keys(tmp_path):
    with pytest.raises(ValueError, match="num_generations=4 conflicts.*= 12"):
        load_recipe(_write(tmp_path), ["num_generations=4"])
    with pytest.raises(ValueError, match="gradient_accumulation_steps=3 conflicts"):
        load_recipe(_write(tmp_path), ["gradient_accumulation_steps=3"])
    # the derived value itself is fine
    r = load_recipe(_write(tmp_path), ["num_generations=12", "gradient_accumulation_steps=2"])
    assert r.grpo_config().steps_per_generation == 2


def test_environment_factory_geometry(tmp_path):
    r = load_recipe(_write(tmp_path), ["agentcredit.bridge=environment_factory", "agentcredit.episodes_per_group=4",
                                       "per_device_train_batch_size=4"])
    assert (r.trl_args["num_generations"], r.trl_args["generation_batch_size"],
            r.trl_args["gradient_accumulation_steps"], r.trl_args["max_tool_calling_iterations"]) == (4, 8, 2, 6)


def test_train_seeds_exclude_eval_and_are_deterministic(tmp_path):
    from agentcredit.train import train_seeds

    r = load_recipe(_write(tmp_path), ["agentcredit.train_seeds=[0,30]", "agentcredit.eval.seeds=[10,20]"])
    a, b = train_seeds(r, 10, seed=0), train_seeds(r, 10, seed=0)
    assert a == b and len(set(a)) == 20 and not any(10 <= s < 20 for s in a)
    with pytest.raises(ValueError, match="train_seeds"):
        train_seeds(r, 11, seed=0)


def test_verl_recipe_detection(tmp_path):
    verl = sorted(glob.glob(str(ROOT / "recipes" / "verl" / "*.yaml")))
    assert verl and all(is_verl_recipe(p) for p in verl)
    with pytest.raises(ValueError, match="verl"):
        load_recipe(verl[0])


# ---- the CLI ---------------------------------------------------------------------------------------------------------
def test_cli_verl_recipe_prints_main_ppo_command(capsys):
    path = ROOT / "recipes" / "verl" / "sokoban_gigpo.yaml"
    assert cli.main(["train", str(path), "trainer.n_gpus_per_node=1"]) == 0
    out = capsys.readouterr().out.strip().splitlines()[-1]
    assert out.startswith("python -m verl.trainer.main_ppo --config-path ")
    assert f"--config-path {path.parent}" in out and "--config-name sokoban_gigpo" in out
    assert out.endswith("trainer.n_gpus_per_node=1")


def test_cli_errors_are_one_clean_line(tmp_path, capsys):
    code = cli.main(["train", _write(tmp_path), "agentcredit.credit=gigpoo"])
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith("agentcredit train: error: ") and "gigpoo" in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert cli.main(["train", str(tmp_path / "missing.yaml")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert cli.main(["train", _write(tmp_path), "--bogus"]) == 2


def test_learning_curve_plot_from_metrics(tmp_path):
    from agentcredit.trl.callbacks import plot_learning_curve

    m = tmp_path / "metrics.jsonl"
    m.write_text("\n".join(json.dumps({"step": s, "loss": 0.1 * s, "agentcredit/success": 0.1 * s,
                                       "agentcredit/return": s, "agentcredit/valid": 0.5,
                                       "agentcredit/adv_mean": 0.0, "agentcredit/adv_std": 1.0})
                           for s in (1, 2, 3)) + "\n")
    png = plot_learning_curve(m, {"success_rate": 0.1, "success_ci": [0.02, 0.3]},
                              {"success_rate": 0.4, "success_ci": [0.2, 0.6]}, tmp_path / "lc.png")
    assert Path(png).stat().st_size > 1000


# ---- end to end ------------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_cli_train_end_to_end_on_the_tiny_model(tmp_path, capsys):
    out = tmp_path / "run"
    code = cli.main(["train", DEMO, "model_name_or_path=tiny-qwen2", "agentcredit.groups_per_step=1",
                     "agentcredit.episodes_per_group=2", "per_device_train_batch_size=12",
                     "agentcredit.freeze_layers=1",  # the tiny model has 2 layers (the demo freezes 20 of 30)
                     "agentcredit.adv_scale=batch_std",  # reaches the trainer: its factor is logged every step
                     "agentcredit.eval.seeds=[20000,20004]", f"output_dir={out}", "--max-steps", "2"])
    printed = capsys.readouterr().out
    assert code == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert len(rows) == 2 and [r["step"] for r in rows] == [1, 2]
    assert all(math.isfinite(r["loss"]) for r in rows)
    assert all("agentcredit/success" in r for r in rows)
    assert all(0 < r["agentcredit/adv_scale_factor"] < 1e6 for r in rows)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["adv_scale"] == "batch_std"
    assert summary["before"]["n_episodes"] == 4 and summary["after"]["n_episodes"] == 4
    assert 0.0 <= summary["after"]["success_rate"] <= 1.0 and summary["steps"] == 2
    assert summary["credit"] == "gigpo" and summary["recipe"].endswith("minigrid_gigpo.yaml")
    episodes = [json.loads(line) for line in (out / "eval_episodes.jsonl").read_text().splitlines()]
    assert [(e["phase"], e["seed"]) for e in episodes] == [(p, s) for p in ("before", "after") for s in range(20000, 20004)]
    for phase in ("before", "after"):  # the per-seed records add up to the summary's rate
        wins = sum(e["success"] for e in episodes if e["phase"] == phase)
        assert wins / 4 == summary[phase]["success_rate"]
    paired = summary["paired"]
    assert paired["n"] == 4 and paired["difference"] == summary["after"]["success_rate"] - summary["before"]["success_rate"]
    assert paired["ci"][0] <= paired["difference"] <= paired["ci"][1] and 0 < paired["mcnemar_p"] <= 1
    assert "paired by seed" in printed
    png = out / "learning_curve.png"
    assert png.exists() and png.stat().st_size > 1000
    assert str(png) in printed.strip().splitlines()
    # the trained model is saved (merged, with its tokenizer and recipe) and its folder printed last
    assert printed.strip().splitlines()[-1] == f"trained model: {out / 'final'}"
    assert summary["final_model"] == str(out / "final") and summary["status"] == "finished"
    assert {"config.json", "model.safetensors", "tokenizer_config.json", "recipe.yaml"} <= \
        {p.name for p in (out / "final").iterdir()}
    assert "95% interval" in printed and "before" in printed and "after" in printed


@pytest.mark.slow
def test_warm_start_then_rl_and_a_rerun_reuses_it(tmp_path, capsys):
    """``agentcredit.warm_start``: SFT into output_dir/warm_start, RL starts from it (the before eval is the warm
    start's), a rerun with the same settings reuses the checkpoint, a changed setting makes a new one."""
    import torch
    from transformers import AutoModelForCausalLM

    from agentcredit.models import resolve_model

    out = tmp_path / "run"
    args = ["train", TINY_DEMO, "model_name_or_path=tiny-qwen2", "agentcredit.groups_per_step=1",
            "agentcredit.episodes_per_group=2", "agentcredit.max_turns=4", "per_device_train_batch_size=8",
            "agentcredit.warm_start={steps: 3, batch_size: 4, episodes: 4}", "agentcredit.eval.seeds=[20000,20004]",
            f"output_dir={out}", "--max-steps", "1"]
    assert cli.main(args) == 0
    printed = capsys.readouterr().out
    warm = out / "warm_start"
    sft = json.loads((warm / "sft_summary.json").read_text())
    assert sft["out"] == str(warm) and sft["steps"] == 3 and sft["batch_size"] == 4 and sft["episodes"] == 4 and sft["learning_rate"] == 1e-3
    assert sft["fingerprint"]["model"] == "tiny-qwen2" and sft["fingerprint"]["max_turns"] == 4
    assert "warm start: 3 supervised steps" in printed
    summary = json.loads((out / "summary.json").read_text())
    assert summary["warm_start"] == str(warm) and summary["before"]["n_episodes"] == 4
    # the warm start moved the weights away from the random tiny model
    base = AutoModelForCausalLM.from_pretrained(resolve_model("tiny-qwen2"), dtype=torch.float32).state_dict()
    made = AutoModelForCausalLM.from_pretrained(warm, dtype=torch.float32).state_dict()
    assert any(not torch.equal(base[k], made[k]) for k in base)
    stamp = (warm / "model.safetensors").stat().st_mtime_ns

    assert cli.main(args + ["--no-eval"]) == 2  # the folder holds a run: refused before any work
    assert "already holds a run" in capsys.readouterr().err
    assert cli.main(args + ["--no-eval", "--overwrite"]) == 0  # the same settings: reused, not remade
    assert "warm start reused" in capsys.readouterr().out
    assert (warm / "model.safetensors").stat().st_mtime_ns == stamp

    args[args.index("agentcredit.warm_start={steps: 3, batch_size: 4, episodes: 4}")] = \
        "agentcredit.warm_start={steps: 2, batch_size: 4, episodes: 4}"
    assert cli.main(args + ["--no-eval", "--overwrite"]) == 0  # changed settings: made again
    assert "warm start: 2 supervised steps" in capsys.readouterr().out
    assert json.loads((warm / "sft_summary.json").read_text())["steps"] == 2


# ---- distillation keys and the teacher command -------------------------------------------------------------------
def test_schedule_needs_a_teacher_and_valid_params(tmp_path):
    with pytest.raises(ValueError, match="agentcredit.teacher"):
        load_recipe(_write(tmp_path), ["agentcredit.schedule=tide"])
    with pytest.raises(ValueError, match="schedule_params.*windw"):
        load_recipe(_write(tmp_path), ["agentcredit.schedule=tide", "agentcredit.teacher=x",
                                       "agentcredit.schedule_params.windw=3"])
    with pytest.raises(ValueError, match="schedule is null"):
        load_recipe(_write(tmp_path), ["agentcredit.teacher=x"])
    r = load_recipe(_write(tmp_path), ["agentcredit.schedule=opw", "agentcredit.teacher=ema",
                                       "agentcredit.schedule_params.warmup_steps=2"])
    assert (r.agentcredit.schedule, r.agentcredit.teacher, r.agentcredit.schedule_params) == \
        ("opw", "ema", {"warmup_steps": 2})


def test_expert_turns_follow_shortest_paths_in_the_rollout_format(tmp_path):
    import random

    from transformers import AutoTokenizer

    import env_adapters
    from agentcredit.models import resolve_model
    from agentcredit.sft import expert_turns

    recipe = load_recipe(DEMO)
    tok = AutoTokenizer.from_pretrained(resolve_model("tiny-qwen2"))
    rows = expert_turns(recipe, tok, [3, 4, 5], random.Random(0))
    assert rows and all(tok.decode(c).endswith("</action>") for _, c in rows)
    assert all(tok.decode(p).endswith("<action>") for p, _ in rows)
    env = env_adapters.make("minigrid", **recipe.agentcredit.env_options)
    for seed in range(20):  # the expert solves every room within the turn budget
        env.reset(seed)
        for _ in range(recipe.agentcredit.max_turns):
            res = env.step(env.expert_actions()[0])
            if res.done:
                break
        assert res.success and env.expert_actions() == []


def test_expert_answers_that_the_token_budget_would_cut_are_refused():
    """``down</action>`` is 5 tokens of the tiny models' tokenizer: with ``max_new_tokens=4`` every generated "down"
    stops at ``</action`` and parses as invalid, so a warm start on it would teach a move the rollout cannot make."""
    import random

    from transformers import AutoTokenizer

    from agentcredit.models import resolve_model
    from agentcredit.sft import expert_turns

    tok = AutoTokenizer.from_pretrained(resolve_model("tiny-qwen2"))
    assert len(tok("down</action>", add_special_tokens=False)["input_ids"]) == 5
    seeds = list(range(20))
    with pytest.raises(RecipeError, match=r"'down</action>' is 5 tokens.*max_new_tokens=4.*max_new_tokens >= 5"):
        expert_turns(load_recipe(TINY_DEMO, ["agentcredit.max_new_tokens=4"]), tok, seeds, random.Random(0))
    rows = expert_turns(load_recipe(TINY_DEMO, ["agentcredit.max_new_tokens=5"]), tok, seeds, random.Random(0))
    assert max(len(c) for _, c in rows) == 5 and any(tok.decode(c) == "down</action>" for _, c in rows)


def test_rollout_warns_when_a_legal_action_cannot_fit_the_token_budget(capsys):
    from transformers import AutoTokenizer

    from agentcredit.models import resolve_model
    from agentcredit.trl.rollouts import TurnRollout

    tok = AutoTokenizer.from_pretrained(resolve_model("tiny-qwen2"))
    ac = load_recipe(TINY_DEMO).agentcredit
    cut = TurnRollout(ac.env, dict(ac.env_options), max_turns=2, max_new_tokens=4)
    assert cut.check_answer_budget(tok, 0) == [("down", 5)]
    printed = capsys.readouterr().out
    assert "WARNING" in printed and "'down'" in printed and "agentcredit.max_new_tokens >= 5" in printed
    assert cut.check_answer_budget(tok, 0, max_new_tokens=6) == []  # the recipe's 6 tokens fit every move
    assert "WARNING" not in capsys.readouterr().out


@pytest.mark.slow
def test_sft_then_a_distillation_recipe_end_to_end_on_the_tiny_model(tmp_path, capsys):
    teacher = tmp_path / "teacher"
    tiny = ["model_name_or_path=tiny-qwen2", "agentcredit.groups_per_step=1", "agentcredit.episodes_per_group=2",
            "per_device_train_batch_size=12", "agentcredit.freeze_layers=1", "agentcredit.eval.seeds=[20000,20004]"]
    assert cli.main(["sft", DEMO, *tiny, "--out", str(teacher), "--steps", "2", "--episodes", "4"]) == 0
    summary = json.loads((teacher / "sft_summary.json").read_text())
    assert summary["turns"] > 0 and summary["eval"]["n_episodes"] == 4
    out = tmp_path / "run"
    tide = str(ROOT / "recipes" / "trl" / "minigrid_tide.yaml")
    assert cli.main(["train", tide, *tiny, f"agentcredit.teacher={teacher}", f"output_dir={out}", "--max-steps",
                     "2", "--no-eval"]) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert len(rows) == 2 and all("agentcredit/tide/lambda" in r for r in rows)
    assert json.loads((out / "summary.json").read_text())["schedule"] == "tide"


# ---- precision chosen by the hardware -------------------------------------------------------------------------------
@pytest.mark.parametrize("caps,want", [({"avx2": True, "avx512_bf16": False, "amx_bf16": False}, False),
                                       ({"avx512_f": True, "avx512_bf16": True}, True),
                                       ({"amx_bf16": True}, True), ({"bf16": True}, True), ({}, False)])
def test_bf16_auto_follows_native_bf16(caps, want):
    from agentcredit.precision import native_bf16, resolve_bf16

    assert native_bf16("cpu", caps) is want
    got, reason = resolve_bf16("auto", "cpu", caps)
    assert got is want and ("native bf16" in reason) and (("no native" in reason) is not want)
    assert resolve_bf16(True, "cpu", caps)[0] is True and resolve_bf16(False, "cpu", caps)[0] is False  # forced
    with pytest.raises(ValueError, match="bf16 must be true, false or 'auto'"):
        resolve_bf16("sometimes", "cpu", caps)


def test_recipe_bf16_auto_resolves_and_an_override_forces_it():
    from agentcredit.precision import native_bf16

    assert load_recipe(DEMO).trl_args["bf16"] is native_bf16("cpu")
    forced = load_recipe(DEMO, ["bf16=false"])
    assert forced.trl_args["bf16"] is False and "set by the recipe" in forced.precision
    with pytest.raises(RecipeError, match="bf16 must be true, false or 'auto'"):
        load_recipe(DEMO, ["bf16=maybe"], validate_trl=False)
    assert load_recipe(DEMO).agentcredit.eval.sampling_seed == 0
    with pytest.raises(RecipeError, match="sampling_seed must be an integer"):
        load_recipe(DEMO, ["agentcredit.eval.sampling_seed=x"], validate_trl=False)



@pytest.mark.parametrize("override,match", [
    ("agentcredit.rollout=[1]", r"agentcredit.rollout must be a string"),
    ("agentcredit.credit=7", r"agentcredit.credit must be a string"),
    ("agentcredit.eval.temperature=.nan", r"agentcredit.eval.temperature must be a finite number > 0, got nan"),
    ("learning_rate=fast", r"learning_rate must be a float .* got 'fast'"),
    ("learning_rate=.nan", r"learning_rate must be finite"),
    ("agentcredit.credit_params.step_weight='0.5'", r"credit_params: .*step_weight='0.5': must be a number"),
    ("agentcredit.credit_params.step_weight=.nan", r"credit_params: .*step_weight=nan: must be a finite number"),
    ("agentcredit.env_options.size=100000000", r"agentcredit.env_options .* too large"),
])
def test_hostile_recipe_values_are_recipe_errors_naming_the_key(override, match):
    with pytest.raises(RecipeError, match=match):
        load_recipe(DEMO, [override])


def test_a_huge_batch_that_does_not_divide_lists_the_fitting_sizes():
    """The divisors come from a search up to sqrt(rows) (it was every integer below the batch: ~30 minutes here)."""
    from agentcredit.recipe import _micro_batches_that_fit

    with pytest.raises(RecipeError, match=r"Values that fit: \[1, 2, 4, 5, 8"):
        load_recipe(DEMO, ["agentcredit.max_turns=1000000000", "per_device_train_batch_size=7"], build_env=False)
    assert _micro_batches_that_fit(96, 1) == [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 96]
    assert _micro_batches_that_fit(96, 2) == [1, 2, 3, 4, 6, 8, 12, 16, 24, 48] and _micro_batches_that_fit(9, 2) == []
    assert _micro_batches_that_fit(2 * 3**20, 1, most=4) == [1, 2, 3, 6]
