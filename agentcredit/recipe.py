"""TRL recipes: one YAML file with TRL's own keys plus an ``agentcredit:`` block, loaded and validated up front.

The top-level keys are exactly what ``trl grpo --config`` takes for the trainer and the model: flat
``trl.GRPOConfig`` and ``trl.ModelConfig`` field names (``learning_rate``, ``loss_type``, ``model_name_or_path``,
...). The ``agentcredit:`` block says what to play and how to assign credit::

    agentcredit:
      env: minigrid
      env_options: {size: 6, shaping: 1.0}
      bridge: rollout_func            # or environment_factory
      max_turns: 6
      groups_per_step: 4              # distinct seeds per optimizer step
      episodes_per_group: 8           # rollouts per seed
      credit: gigpo
      credit_params: {gamma: 0.9}
      terms: {sprpo: {sigma: 0.05}}   # auxiliary training terms (agentcredit list terms), optional

:func:`load_recipe` merges ``key=value`` overrides (``agentcredit.credit=graphhca``, ``learning_rate=1e-4``), checks
every key and name (a ``ValueError`` naming the key, listing the valid values and suggesting close matches), builds
the environment once (a missing game package is an ``ImportError`` naming ``agentcredit.env``) and derives TRL's
batch geometry from the block, so that one generation round is one optimizer step:

* ``rollout_func`` (one row per turn): ``num_generations = episodes_per_group * max_turns``,
  ``max_completion_length = max_new_tokens`` unless given;
* ``environment_factory`` (one row per episode): ``num_generations = episodes_per_group``,
  ``max_tool_calling_iterations = max_turns`` unless given;
* both: ``generation_batch_size = groups_per_step * num_generations`` and
  ``gradient_accumulation_steps = generation_batch_size // (per_device_train_batch_size * world_size)``.

Loading needs TRL (the key sets are its dataclasses' fields) but no model; nothing is imported at module level
beyond the standard library.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib.util
import math
import os
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

__all__ = ["Recipe", "AgentCreditConfig", "EvalConfig", "WarmStartConfig", "SFT_POLICIES", "RecipeError", "load_recipe", "is_verl_recipe",
           "BRIDGES", "PROMPT_STYLES", "parse_overrides", "apply_overrides", "check_seed_budget", "check_terms"]

BRIDGES = ("rollout_func", "environment_factory")
#: ``agentcredit.rollout``: what the rollout_func bridge plays (agentcredit.trl.rollouts / agentcredit.trl.search_rollouts)
ROLLOUTS = {"turns": "TurnRollout", "counterfactual": "CounterfactualRollout", "tree": "TreeRollout",
            "memory": "MemoryTurnRollout"}
PROMPT_STYLES = ("compact", "verl-agent")
_LORA_KEYS = {"r": "r", "alpha": "lora_alpha", "dropout": "lora_dropout", "target_modules": "target_modules",
              "bias": "bias", "modules_to_save": "modules_to_save", "use_rslora": "use_rslora", "use_dora": "use_dora"}


class RecipeError(ValueError):
    """A recipe that cannot run: the message names the key and what would be valid."""


@dataclass
class EvalConfig:
    """Held-out evaluation before/after training (``agentcredit.eval``)."""

    seeds: list[int] = field(default_factory=lambda: [20000, 20064])  # half-open range [lo, hi)
    temperature: float = 0.7
    greedy: bool = False
    before: bool = True
    after: bool = True
    batch_size: int = 64
    #: seed of the sampling stream: the same seeds and stream before and after training, and on every rerun
    sampling_seed: int = 0

    @property
    def seed_list(self) -> list[int]:
        return list(range(int(self.seeds[0]), int(self.seeds[1])))


#: who plays the supervised warm start's episodes (``agentcredit sft --policy``, ``agentcredit.warm_start.policy``)
SFT_POLICIES = ("expert", "random")


@dataclass
class WarmStartConfig:
    """A supervised warm start before RL (``agentcredit.warm_start``): :func:`agentcredit.sft.run_sft` on the env's
    scripted expert (``policy: expert``) or on uniformly random legal actions (``policy: random``: teaches the answer
    format and nothing about the task) in the rollout's own turn format, made once per ``output_dir``
    (``<output_dir>/warm_start``)."""

    steps: int = 400
    batch_size: int = 32
    learning_rate: float = 1e-3
    episodes: int = 1024
    policy: str = "expert"


@dataclass
class AgentCreditConfig:
    """The ``agentcredit:`` block of a recipe (see ``recipes/trl/README.md``)."""

    env: str = "minigrid"
    env_options: dict[str, Any] = field(default_factory=dict)
    bridge: str = "rollout_func"
    rollout: str = "turns"     # turns | counterfactual (ASCT) | tree (SIPO, AT²PO, TreeRL)
    rollout_options: dict[str, Any] = field(default_factory=dict)  # the rollout class's keyword arguments
    max_turns: int = 6
    groups_per_step: int = 4
    episodes_per_group: int = 8
    prompt: str = "compact"
    history_length: int = 0
    max_new_tokens: int = 8
    system: str | None = None
    credit: str = "grpo"
    credit_params: dict[str, Any] = field(default_factory=dict)
    #: none | batch_rms | batch_std (credit_plugins.scaling); null: credit_plugins.scaling.DEFAULT_ADV_SCALE
    adv_scale: str | None = None
    schedule: str | None = None
    schedule_params: dict[str, Any] = field(default_factory=dict)
    teacher: str | None = None  # a model path / hub id / built-in name, or "ema" (an EMA of the student, LSD)
    #: auxiliary training terms (``agentcredit list terms``): ``{name: {param: value}}``, each run by its TRL mixin
    terms: dict[str, dict[str, Any]] = field(default_factory=dict)
    freeze_layers: int = 0
    lora: dict[str, Any] | None = None
    train_seeds: list[int] = field(default_factory=lambda: [0, 100000])  # half-open range [lo, hi)
    eval: EvalConfig | None = field(default_factory=EvalConfig)
    warm_start: WarmStartConfig | None = None

    def lora_kwargs(self) -> dict[str, Any] | None:
        """``peft.LoraConfig`` keyword arguments for :attr:`lora` (``None`` without LoRA)."""
        if self.lora is None:
            return None
        out = {_LORA_KEYS[k]: v for k, v in self.lora.items()}
        out.setdefault("task_type", "CAUSAL_LM")
        return out


@dataclass
class Recipe:
    """A validated TRL recipe.

    Attributes:
        trl_args: ``trl.GRPOConfig`` keyword arguments, batch geometry derived from the agentcredit block included.
        model_args: ``trl.ModelConfig`` keyword arguments (``model_name_or_path``, ``dtype``, ...).
        agentcredit: the ``agentcredit:`` block with defaults filled in.
        path: the YAML file it came from.
        overrides: the ``key=value`` overrides applied on top of the file.
        precision: why ``trl_args["bf16"]`` is what it is (:func:`agentcredit.precision.resolve_bf16`: a recipe's
            ``bf16: auto``, or no ``bf16`` key, means bf16 autocast only where the hardware has native bf16).
    """

    trl_args: dict[str, Any]
    model_args: dict[str, Any]
    agentcredit: AgentCreditConfig
    path: str
    overrides: list[str] = field(default_factory=list)
    precision: str = ""

    def grpo_config(self, **changes: Any):
        """A ``trl.GRPOConfig`` from :attr:`trl_args` (``changes`` win, e.g. ``max_steps=2``)."""
        from agentcredit.trl import grpo_config

        return grpo_config()(**{**self.trl_args, **changes})

    @property
    def name(self) -> str:
        return Path(self.path).stem


# ---- key sets ------------------------------------------------------------------------------------------------------
@lru_cache(maxsize=1)
def _trl_fields() -> tuple[frozenset[str], frozenset[str]]:
    """Field names of ``trl.GRPOConfig`` and ``trl.ModelConfig``."""
    from agentcredit.trl import grpo_config, model_config

    return (frozenset(f.name for f in dataclasses.fields(grpo_config())),
            frozenset(f.name for f in dataclasses.fields(model_config())))


@lru_cache(maxsize=1)
def _trl_defaults() -> dict[str, Any]:
    """``trl.GRPOConfig``'s field defaults."""
    from agentcredit.trl import grpo_config

    return {f.name: f.default for f in dataclasses.fields(grpo_config())}


def _trl_default(name: str) -> Any:
    return _trl_defaults()[name]


def _suggest(key: str, valid) -> str:
    close = difflib.get_close_matches(str(key), sorted(valid), n=3, cutoff=0.6)
    return f" (did you mean {' or '.join(repr(c) for c in close)}?)" if close else ""


def _unknown_key(where: str, key: str, valid, list_valid: bool = True) -> RecipeError:
    msg = f"unknown key {key!r} in {where}{_suggest(key, valid)}"
    if list_valid:
        msg += f"; valid keys: {', '.join(sorted(valid))}"
    return RecipeError(msg)


# ---- loading ---------------------------------------------------------------------------------------------------------
def _override_value(item: str) -> tuple[list[str], Any]:
    """``"a.b=[1, 2]"`` -> ``(["a", "b"], [1, 2])``; the value is parsed as YAML (OmegaConf's dotlist grammar)."""
    from omegaconf import OmegaConf

    key = item.split("=", 1)[0].strip() if "=" in item else ""
    if not key or any(not part for part in key.split(".")):
        raise RecipeError(f"override {item!r} is not key=value (e.g. learning_rate=1e-4, "
                          f"agentcredit.credit=graphhca, agentcredit.env_options.size=5)")
    try:
        node: Any = OmegaConf.to_container(OmegaConf.from_dotlist([item]), resolve=True)
    except Exception as e:  # omegaconf grammar errors
        raise RecipeError(f"cannot parse override {item!r}: {e}") from e
    path = key.split(".")
    for part in path:
        node = node[part]
    return path, node


def apply_overrides(data: dict[str, Any], overrides) -> dict[str, Any]:
    """Set each ``key=value`` of ``overrides`` into the nested mapping ``data`` (in place; returns it).

    A dotted key sets one entry (``agentcredit.env_options.size=5``); a mapping value replaces the whole entry
    (``agentcredit.credit_params={}`` clears the parameters), except for the env's options (:data:`MERGED`):
    ``agentcredit.env_options={size: 7}`` changes ``size`` and keeps the other options; there a ``null`` value
    (``agentcredit.env_options.shaping=null``, ``{shaping: null}``) or a ``~key`` (``{~shaping: 0}``) deletes the
    option (back to the env's default). ``~a.b`` (Hydra's syntax, no ``=``) deletes the key ``a.b`` anywhere.
    """
    for item in overrides or ():
        if isinstance(item, str) and item.startswith("~"):
            _delete(data, item)
            continue
        path, value = _override_value(item)
        node = data
        for i, part in enumerate(path[:-1]):
            if node.get(part) is None:
                node[part] = {}
            if not isinstance(node[part], dict):
                raise RecipeError(f"override {item!r}: {'.'.join(path[:i + 1])} is {node[part]!r}, not a mapping")
            node = node[part]
        if tuple(path) in MERGED and isinstance(value, dict):
            if not isinstance(node.get(path[-1]), dict):
                node[path[-1]] = {}
            for key, v in value.items():
                key = str(key)
                if key.startswith("~") or v is None:
                    node[path[-1]].pop(key.lstrip("~"), None)
                else:
                    node[path[-1]][key] = v
        elif tuple(path[:-1]) in MERGED and value is None:
            node.pop(path[-1], None)
        else:
            node[path[-1]] = value
    return data


#: mappings that ``key={...}`` overrides merge into key by key (``null`` / ``~key`` delete), not replace
MERGED = {("agentcredit", "env_options")}


def _delete(data: dict[str, Any], item: str) -> None:
    """``~a.b.c``: remove ``c`` from ``data["a"]["b"]`` (a ``RecipeError`` naming the key when it is not there)."""
    key = item[1:].split("=", 1)[0].strip()
    path = key.split(".") if key else []
    node: Any = data
    for part in path[:-1]:
        node = node.get(part) if isinstance(node, dict) else None
    if not path or any(not p for p in path) or not isinstance(node, dict) or path[-1] not in node:
        raise RecipeError(f"override {item!r}: there is no key {key!r} to delete (~key removes a key the recipe "
                          f"sets, e.g. ~agentcredit.env_options.shaping)")
    del node[path[-1]]


def parse_overrides(overrides) -> dict[str, Any]:
    """``["a.b=1", "c=[1,2]"]`` -> ``{"a": {"b": 1}, "c": [1, 2]}``."""
    return apply_overrides({}, overrides)


def _read(path: str | os.PathLike, overrides) -> dict[str, Any]:
    from omegaconf import OmegaConf

    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"recipe {str(p)!r} does not exist")
    try:
        data = OmegaConf.to_container(OmegaConf.load(p), resolve=True)
    except Exception as e:
        raise RecipeError(f"cannot read recipe {str(p)!r}: {e}") from e
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise RecipeError(f"recipe {str(p)!r} must be a mapping of keys, got {type(data).__name__}")
    return apply_overrides(data, overrides)


def resolved_yaml(recipe: Recipe) -> str:
    """The recipe file with its overrides applied (but ``resume_from_checkpoint``), as YAML under a comment naming
    the command: what made a model, saved next to it as ``recipe.yaml``."""
    import yaml

    data = _read(recipe.path, [o for o in recipe.overrides if not o.split("=", 1)[0].startswith("resume_from")])
    head = f"# made by agentcredit train {recipe.path}" + (f" {' '.join(recipe.overrides)}" if recipe.overrides else "")
    return head + "\n" + yaml.safe_dump(data, sort_keys=False)


def is_verl_recipe(path: str | os.PathLike) -> bool:
    """True for a Hydra/verl recipe: it has ``defaults:`` or verl's ``algorithm:`` / ``actor_rollout_ref:`` keys."""
    import yaml

    try:
        with open(path, encoding="utf-8") as fh:
            data = yaml.safe_load(fh)
    except (OSError, yaml.YAMLError):
        return False
    return isinstance(data, dict) and bool({"defaults", "algorithm", "actor_rollout_ref"} & set(data))


def load_recipe(path: str | os.PathLike, overrides=(), validate_trl: bool = True,
                build_env: bool = True) -> Recipe:
    """Load, override and validate the TRL recipe at ``path``; see the module docstring.

    ``overrides`` are ``key=value`` strings, dotted for the block (``agentcredit.env_options.size=5``).
    ``validate_trl`` also builds the ``trl.GRPOConfig`` once, so TRL's own checks run before any model is loaded;
    ``build_env`` builds the environment once (a missing game package is an ``ImportError`` naming the key).
    """
    overrides = list(overrides or ())
    data = _read(path, overrides)
    if is_verl_recipe(path):
        raise RecipeError(f"{path} is a verl (Hydra) recipe, not a TRL recipe; run it with "
                          f"python -m verl.trainer.main_ppo (agentcredit train prints the command)")
    grpo_fields, model_fields = _trl_fields()
    block = data.pop("agentcredit", None)
    if block is None:
        raise RecipeError(f"recipe {str(path)!r} has no 'agentcredit:' block (env, bridge, credit, ...); see "
                          f"recipes/trl/README.md")
    trl_args: dict[str, Any] = {}
    model_args: dict[str, Any] = {}
    valid_top = grpo_fields | model_fields | {"agentcredit"}
    for key, value in data.items():
        if key in model_fields:
            model_args[key] = value
        elif key in grpo_fields:
            trl_args[key] = value
        else:
            raise RecipeError(f"unknown top-level key {key!r} in {path}{_suggest(key, valid_top)}; top-level keys "
                              f"are trl.GRPOConfig and trl.ModelConfig field names (as `trl grpo --config` takes "
                              f"them) plus the 'agentcredit' block")
    if not model_args.get("model_name_or_path"):
        raise RecipeError("model_name_or_path is missing: set a model (a local checkpoint folder, a hub id, or "
                          "one of the built-in names 'smollm2-135m-instruct', 'tiny-qwen2', 'tiny-qwen2-4x256')")
    ac = _agentcredit(block, model_args, build_env=build_env)
    _check_trl_types(trl_args)
    _derive_geometry(trl_args, ac)
    _check_steps(trl_args, ac)
    if "report_to" not in trl_args:
        trl_args["report_to"] = ["tensorboard"] if importlib.util.find_spec("tensorboard") else "none"
    precision = _resolve_precision(trl_args)
    recipe = Recipe(trl_args=trl_args, model_args=model_args, agentcredit=ac, path=str(path), overrides=overrides,
                    precision=precision)
    if validate_trl:
        try:
            recipe.grpo_config()
        except (ValueError, TypeError) as e:
            raise RecipeError(grpo_config_error(e)) from e
    return recipe


def _resolve_precision(trl_args: dict[str, Any]) -> str:
    """Resolve ``bf16: auto`` (or no ``bf16`` key: TRL would default to bf16) by the hardware; returns the reason."""
    from .precision import resolve_bf16

    value = trl_args.get("bf16", "auto")
    if trl_args.get("fp16") is True and "bf16" not in trl_args:
        return "fp16 set by the recipe"
    try:
        trl_args["bf16"], reason = resolve_bf16(value, device="cpu" if trl_args.get("use_cpu") else None)
    except ValueError as e:
        raise RecipeError(str(e)) from e
    return reason


def grpo_config_error(e: Exception) -> str:
    """The message for a ``trl.GRPOConfig`` that rejects the recipe's keys (with a hint for GPU recipes on CPU)."""
    msg = f"trl.GRPOConfig rejects the recipe: {e}"
    if "bf16/gpu" in str(e) or "use_cpu" in str(e):
        msg += " (a GPU recipe on a machine without a GPU: add the override use_cpu=true, or bf16=false)"
    return msg


# ---- the agentcredit block -------------------------------------------------------------------------------------------
def _positive(name: str, value: Any, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise RecipeError(f"agentcredit.{name} must be an integer >= {minimum}, got {value!r}")
    return value


def _seed_range(name: str, value: Any) -> list[int]:
    if (not isinstance(value, (list, tuple)) or len(value) != 2
            or not all(isinstance(v, int) and not isinstance(v, bool) for v in value) or value[1] <= value[0]
            or value[0] < 0):
        raise RecipeError(f"agentcredit.{name} must be a half-open seed range [lo, hi) with 0 <= lo < hi, "
                          f"got {value!r}")
    return [int(value[0]), int(value[1])]


def _positive_number(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise RecipeError(f"agentcredit.{name} must be a finite number > 0, got {value!r}")
    return value


def _sub_block(name: str, block: Any, cls: type) -> Any:
    """``agentcredit.<name>``: null or false (off), true (the defaults) or a mapping of ``cls``'s keys."""
    if block is None or block is False:
        return None
    if block is True:
        block = {}
    names = [f.name for f in dataclasses.fields(cls)]
    if not isinstance(block, dict):
        raise RecipeError(f"agentcredit.{name} must be a mapping ({', '.join(names)}) or null, got {block!r}")
    for key in block:
        if key not in names:
            raise _unknown_key(f"agentcredit.{name}", key, names)
    return cls(**block)


def _warm_start(block: Any) -> WarmStartConfig | None:
    """``agentcredit.warm_start``: null (no warm start) or a mapping of :class:`WarmStartConfig`'s keys."""
    ws = _sub_block("warm_start", block, WarmStartConfig)
    if ws is not None:
        for key in ("steps", "batch_size", "episodes"):
            _positive(f"warm_start.{key}", getattr(ws, key))
        _positive_number("warm_start.learning_rate", ws.learning_rate)
        if ws.policy not in SFT_POLICIES:
            raise RecipeError(f"agentcredit.warm_start.policy={ws.policy!r}; choose one of {list(SFT_POLICIES)} "
                              f"(expert: the env's scripted expert; random: uniformly random legal actions)")
    return ws


def _eval(block: Any) -> EvalConfig | None:
    """``agentcredit.eval``: null (no held-out evaluation) or a mapping of :class:`EvalConfig`'s keys."""
    ev = _sub_block("eval", block, EvalConfig)
    if ev is not None:
        ev.seeds = _seed_range("eval.seeds", ev.seeds)
        _positive("eval.batch_size", ev.batch_size)
        if isinstance(ev.sampling_seed, bool) or not isinstance(ev.sampling_seed, int):
            raise RecipeError(f"agentcredit.eval.sampling_seed must be an integer, got {ev.sampling_seed!r}")
        _positive_number("eval.temperature", ev.temperature)
    return ev


def _agentcredit(block: Any, model_args: dict[str, Any], build_env: bool) -> AgentCreditConfig:
    from credit_plugins import registry

    if not isinstance(block, dict):
        raise RecipeError(f"agentcredit must be a mapping of keys, got {block!r}")
    names = [f.name for f in dataclasses.fields(AgentCreditConfig)]
    for key in block:
        if key not in names:
            raise _unknown_key("the agentcredit block", key, names)
    values = {k: v for k, v in block.items()}
    ev, warm = _eval(values.pop("eval", {})), _warm_start(values.pop("warm_start", None))
    ac = AgentCreditConfig(**values, eval=ev, warm_start=warm)
    for key in ("env_options", "credit_params", "rollout_options"):
        if getattr(ac, key) is None:
            setattr(ac, key, {})
        if not isinstance(getattr(ac, key), dict):
            raise RecipeError(f"agentcredit.{key} must be a mapping, got {getattr(ac, key)!r}")

    # sizes
    _positive("max_turns", ac.max_turns)
    _positive("groups_per_step", ac.groups_per_step)
    _positive("episodes_per_group", ac.episodes_per_group, minimum=2)  # a group compares at least two episodes
    _positive("max_new_tokens", ac.max_new_tokens)
    _positive("history_length", ac.history_length, minimum=0)
    _positive("freeze_layers", ac.freeze_layers, minimum=0)
    ac.train_seeds = _seed_range("train_seeds", ac.train_seeds)

    # choices
    for key in ("env", "bridge", "rollout", "prompt", "credit", "schedule", "teacher", "system"):
        value = getattr(ac, key)
        if not isinstance(value, str) and not (value is None and key in ("schedule", "teacher", "system")):
            raise RecipeError(f"agentcredit.{key} must be a string (a name), got {value!r}")
    if ac.bridge not in BRIDGES:
        raise RecipeError(f"agentcredit.bridge={ac.bridge!r} is not a bridge{_suggest(ac.bridge, BRIDGES)}; valid: "
                          f"{', '.join(BRIDGES)} (rollout_func: one row per turn, Markovian prompt; "
                          f"environment_factory: one row per episode, TRL's tool loop)")
    if ac.prompt not in PROMPT_STYLES:
        raise RecipeError(f"agentcredit.prompt={ac.prompt!r} is not a prompt style"
                          f"{_suggest(ac.prompt, PROMPT_STYLES)}; valid: {', '.join(PROMPT_STYLES)}")
    estimators = registry.available("estimators")
    if ac.credit not in estimators:
        raise RecipeError(f"agentcredit.credit={ac.credit!r} is not a registered estimator"
                          f"{_suggest(ac.credit, estimators)}; available: {', '.join(estimators)}")
    _check_rollout(ac, registry.get(ac.credit))
    try:
        registry.get(ac.credit).make_params(**ac.credit_params)
    except (ValueError, TypeError) as e:
        raise RecipeError(f"agentcredit.credit_params: {e}") from e
    try:
        from credit_plugins.scaling import check_adv_scale

        ac.adv_scale = check_adv_scale(ac.adv_scale, where="agentcredit.adv_scale")
    except ValueError as e:
        raise RecipeError(str(e)) from e
    if ac.schedule is not None:
        schedulers = registry.available("schedulers")
        if ac.schedule not in schedulers:
            raise RecipeError(f"agentcredit.schedule={ac.schedule!r} is not a registered scheduler"
                              f"{_suggest(ac.schedule, schedulers)}; available: "
                              f"{', '.join(schedulers) or '(none registered yet)'}")
        try:
            registry.get(ac.schedule, kind="schedulers").make_params(**(ac.schedule_params or {}))
        except (ValueError, TypeError) as e:
            raise RecipeError(f"agentcredit.schedule_params: {e}") from e
        if ac.teacher is None:
            raise RecipeError(f"agentcredit.schedule={ac.schedule!r} needs agentcredit.teacher: a model path or hub id "
                              f"with the student's tokenizer (`agentcredit sft RECIPE --out DIR` makes one from an env "
                              f"with a scripted expert, e.g. MiniGrid), or 'ema' (an EMA of the student, as LSD uses)")
    elif ac.schedule_params or ac.teacher is not None:
        raise RecipeError("agentcredit.schedule_params / agentcredit.teacher are set but agentcredit.schedule is null; "
                          "set a schedule (agentcredit list schedulers) or remove them")
    ac.terms = check_terms(ac.terms)

    # model adaptation: lora (or ModelConfig's use_peft) xor freeze_layers
    if ac.lora is None and model_args.get("use_peft"):
        ac.lora = {"r": model_args.get("lora_r", 16), "alpha": model_args.get("lora_alpha", 32),
                   "dropout": model_args.get("lora_dropout", 0.05)}
        if model_args.get("lora_target_modules"):
            ac.lora["target_modules"] = model_args["lora_target_modules"]
    if ac.lora is not None:
        if not isinstance(ac.lora, dict):
            raise RecipeError(f"agentcredit.lora must be a mapping ({', '.join(_LORA_KEYS)}) or null, got {ac.lora!r}")
        for key in ac.lora:
            if key not in _LORA_KEYS:
                raise _unknown_key("agentcredit.lora", key, _LORA_KEYS)
        if ac.freeze_layers:
            raise RecipeError(f"agentcredit.lora and agentcredit.freeze_layers={ac.freeze_layers} are both set; use "
                              f"one: LoRA trains adapters only, freeze_layers trains the upper layers in full")
        if importlib.util.find_spec("peft") is None:
            raise ImportError("agentcredit.lora needs the peft package: pip install peft (or agentcredit[trl])")

    if ac.warm_start is not None and (ac.bridge != "rollout_func" or ac.rollout != "turns"):
        raise RecipeError(f"agentcredit.warm_start trains on the Markovian turn prompts of bridge: rollout_func with "
                          f"rollout: turns; this recipe plays bridge: {ac.bridge}, rollout: {ac.rollout}, whose "
                          f"prompts differ. Make a checkpoint with `agentcredit sft` instead, or drop warm_start")

    # environment
    envs = registry.available("envs")
    if ac.env not in envs:
        raise RecipeError(f"agentcredit.env={ac.env!r} is not a registered environment{_suggest(ac.env, envs)}; "
                          f"available: {', '.join(envs)}")
    if build_env:
        _check_env_option_types(ac.env, ac.env_options, registry.get(ac.env, kind="envs"))
        try:
            env = registry.get(ac.env, kind="envs")(**ac.env_options)
        except ImportError as e:
            raise ImportError(f"agentcredit.env={ac.env!r}: {e}") from e
        except (ValueError, TypeError) as e:
            raise RecipeError(f"agentcredit.env_options for env {ac.env!r}: {e}") from e
        except (MemoryError, OverflowError) as e:
            raise RecipeError(f"agentcredit.env_options {ac.env_options} for env {ac.env!r} build a game too large "
                              f"for this machine ({type(e).__name__}); use smaller sizes") from None
        if ac.warm_start is not None and ac.warm_start.policy == "expert":
            try:
                env.reset(ac.train_seeds[0])
                env.expert_actions()
            except (AttributeError, NotImplementedError):
                raise RecipeError(f"agentcredit.warm_start needs a scripted expert (expert_actions()); env {ac.env!r} "
                                  f"with {ac.env_options} has none (MiniGrid with moves=absolute has one); "
                                  f"warm_start.policy=random needs none") from None
    return ac


def check_terms(block: Any, where: str = "agentcredit.terms", bridge: str = "trl") -> dict[str, dict[str, Any]]:
    """``agentcredit.terms``: null or a mapping ``{term name: its parameters (a mapping, or null for the defaults)}``;
    each name a registered term (``agentcredit list terms``) that ``bridge`` runs, each parameter checked by the term's
    ``TermSpec.make_params``. Returns the block with ``{}`` for null parameters; a ``RecipeError`` names the key."""
    from credit_plugins import registry

    if block is None:
        return {}
    if not isinstance(block, dict):
        raise RecipeError(f"{where} must be a mapping {{term name: {{param: value}}}} (e.g. {{sprpo: {{}}}}) or null, "
                          f"got {block!r}")
    known = registry.available("terms")
    out: dict[str, dict[str, Any]] = {}
    for name, params in block.items():
        if name not in known:
            raise RecipeError(f"{where}: {name!r} is not a registered term{_suggest(str(name), known)}; available: "
                              f"{', '.join(known) or '(none registered)'}")
        spec = registry.get(name, kind="terms")
        if bridge not in spec.bridges:
            raise RecipeError(f"{where}.{name}: term {name!r} runs on {', '.join(spec.bridges)}, not on {bridge}")
        if params is None:
            params = {}
        if not isinstance(params, dict):
            raise RecipeError(f"{where}.{name} must be a mapping of the term's parameters (agentcredit describe "
                              f"{name}) or null for the defaults, got {params!r}")
        try:
            spec.make_params(**params)
        except (ValueError, TypeError) as e:
            raise RecipeError(f"{where}.{name}: {e}") from e
        out[str(name)] = dict(params)
    return out


def _check_env_option_types(env: str, options: dict[str, Any], spec: Any) -> None:
    """An option whose default is a bool, a number or a string gets a value of that type (``size: big`` is an error
    naming ``size``, not a comparison failing deep in the env)."""
    defaults = spec.options() if callable(getattr(spec, "options", None)) else {}
    for key, value in options.items():
        default = defaults.get(key)
        if default is None or value is None:
            continue
        if isinstance(default, bool):
            ok, want = isinstance(value, bool), "true or false"
        elif isinstance(default, int):
            ok, want = isinstance(value, int) and not isinstance(value, bool), "an integer"
        elif isinstance(default, float):
            ok, want = isinstance(value, (int, float)) and not isinstance(value, bool), "a number"
        elif isinstance(default, str):
            ok, want = isinstance(value, str), "a string"
        else:
            continue
        if not ok:
            raise RecipeError(f"agentcredit.env_options.{key} must be {want} (env {env!r}, default {default!r}), got "
                              f"{value!r}")


def rollout_class(name: str) -> type:
    """The rollout_func class of ``agentcredit.rollout``."""
    import importlib

    module = {"turns": "agentcredit.trl.rollouts", "memory": "agentcredit.trl.ccm"}.get(
        name, "agentcredit.trl.search_rollouts")
    return getattr(importlib.import_module(module), ROLLOUTS[name])


def _rollout_defaults(name: str) -> dict[str, Any]:
    import inspect

    cls = rollout_class(name)
    own = {n: p.default for n, p in inspect.signature(cls.__init__).parameters.items() if p.kind == p.KEYWORD_ONLY}
    return own


def _check_rollout(ac: AgentCreditConfig, estimator) -> None:
    if ac.rollout not in ROLLOUTS:
        raise RecipeError(f"agentcredit.rollout={ac.rollout!r} is not a rollout{_suggest(ac.rollout, ROLLOUTS)}; "
                          f"valid: {', '.join(ROLLOUTS)} (turns: one row per turn; counterfactual: + ASCT's "
                          f"decision table; tree: SIPO/AT²PO/TreeRL search trees; memory: CCM's memory context "
                          f"with privileged full-history distillation)")
    if ac.rollout != "turns" and ac.bridge != "rollout_func":
        raise RecipeError(f"agentcredit.rollout={ac.rollout!r} needs agentcredit.bridge: rollout_func")
    valid = _rollout_defaults(ac.rollout)
    for key in ac.rollout_options:
        if key not in valid:
            raise _unknown_key(f"agentcredit.rollout_options (rollout {ac.rollout!r})", key, valid)
    need = estimator.sources() & {"counterfactual", "tree"}  # the search rollouts (Estimator.extras)
    if need and ac.rollout not in need:
        raise RecipeError(f"agentcredit.credit={ac.credit!r} reads the extras of the {sorted(need)[0]!r} rollout; set "
                          f"agentcredit.rollout: {sorted(need)[0]}")
    if not need and ac.rollout == "tree":
        raise RecipeError(f"agentcredit.rollout: tree makes one row per tree node, which only tree estimators (sipo, "
                          f"at2po, treerl) read; agentcredit.credit={ac.credit!r} needs rollout: turns")


def tree_rows(ac: AgentCreditConfig) -> int:
    """Rows of the largest tree of ``agentcredit.rollout: tree``: (initial + iterations*beam*branches) * max_turns."""
    o = {**_rollout_defaults("tree"), **ac.rollout_options}
    return (int(o["initial"]) + int(o["iterations"]) * int(o["beam"]) * int(o["branches"])) * ac.max_turns


# ---- TRL batch geometry ----------------------------------------------------------------------------------------------
def _derive_geometry(trl_args: dict[str, Any], ac: AgentCreditConfig) -> None:
    E, T, P = ac.episodes_per_group, ac.max_turns, ac.groups_per_step
    if ac.bridge == "rollout_func" and ac.rollout == "tree":
        G = tree_rows(ac)
        why = ("the tree rollout makes one row per node: num_generations = (initial + iterations * beam * branches) "
               f"* max_turns, the largest tree")
        trl_args.setdefault("max_completion_length", ac.max_new_tokens)
    elif ac.bridge == "rollout_func":
        G = E * T
        why = (f"the rollout_func bridge makes one row per turn: num_generations = episodes_per_group * max_turns "
               f"= {E} * {T}")
        trl_args.setdefault("max_completion_length", ac.max_new_tokens)
    else:
        G = E
        why = f"the environment_factory bridge makes one row per episode: num_generations = episodes_per_group = {E}"
        trl_args.setdefault("max_tool_calling_iterations", T)
    gbs = P * G
    derived = {"num_generations": (G, why),
               "generation_batch_size": (gbs, f"generation_batch_size = groups_per_step * num_generations = {P} * {G}")}
    for key, (value, reason) in derived.items():
        if trl_args.get(key) is not None and trl_args[key] != value:
            raise RecipeError(f"{key}={trl_args[key]!r} conflicts with the agentcredit block ({reason} = {value}); "
                              f"remove {key} from the recipe (it is derived) or change agentcredit.groups_per_step / "
                              f"episodes_per_group / max_turns")
        trl_args[key] = value
    world = training_processes()
    per_device = trl_args.get("per_device_train_batch_size", _trl_default("per_device_train_batch_size"))
    if isinstance(per_device, bool) or not isinstance(per_device, int) or per_device < 1:
        raise RecipeError(f"per_device_train_batch_size must be a positive integer, got {per_device!r}")
    if ac.bridge == "rollout_func" and P % world:
        # TRL hands each process a contiguous slice of the generation batch, and a rollout_func plays whole groups
        # (one seed's num_generations rows) per call: each process needs groups_per_step / world of them
        up = -(-P // world) * world
        raise RecipeError(f"agentcredit.groups_per_step={P} is not a multiple of the {world} training processes "
                          f"(WORLD_SIZE): TRL gives each process a contiguous slice of the {gbs}-row generation "
                          f"batch, and the rollout_func bridge needs whole groups of num_generations={G} rows in "
                          f"each slice. Set agentcredit.groups_per_step to a multiple of {world} (e.g. {up}: then "
                          f"{up // world * G} rows per process, which per_device_train_batch_size must divide)")
    if gbs % (per_device * world):
        fits = _micro_batches_that_fit(gbs, world)
        raise RecipeError(f"per_device_train_batch_size={per_device} (x world size {world}) does not divide the "
                          f"generation batch of {gbs} rows ({derived['generation_batch_size'][1]}); one generation "
                          f"round must be a whole number of micro-batches. Values that fit: {fits}")
    ga = gbs // (per_device * world)
    for key in ("gradient_accumulation_steps", "steps_per_generation"):
        if trl_args.get(key) is not None and trl_args[key] != ga:
            raise RecipeError(f"{key}={trl_args[key]!r} conflicts with the agentcredit block: one generation round "
                              f"({gbs} rows) is one optimizer step, so {key} = generation_batch_size // "
                              f"(per_device_train_batch_size * world_size) = {gbs} // ({per_device} * {world}) = {ga}; "
                              f"remove {key} from the recipe")
    trl_args.pop("steps_per_generation", None)  # TRL derives it from generation_batch_size (both set is an error)
    trl_args["gradient_accumulation_steps"] = ga


def training_processes() -> int:
    """How many training processes this run has (``WORLD_SIZE``, as torchrun / accelerate set it; 1 alone)."""
    return int(os.environ.get("WORLD_SIZE", "1") or 1)


def _micro_batches_that_fit(rows: int, world: int, most: int = 24) -> list[int]:
    """The per-device batch sizes ``d`` with ``rows % (d * world) == 0``: divisors found up to ``sqrt`` (so a huge
    batch costs milliseconds), the ``most`` smallest listed."""
    if rows % world:
        return []
    n = rows // world
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted(set(small) | {n // d for d in small})[:most]


def _check_trl_types(trl_args: dict[str, Any]) -> None:
    """Numeric ``GRPOConfig`` fields get numbers (finite ones): ``learning_rate=fast`` or ``.nan`` is an error here,
    not a crash (or a NaN run) later. The type is the field's default's (TRL's dataclass annotations are strings)."""
    defaults = _trl_defaults()
    for key, value in trl_args.items():
        default = defaults.get(key)
        if isinstance(default, bool) or not isinstance(default, (int, float)) or value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or \
                (isinstance(default, int) and not isinstance(default, bool) and isinstance(value, float)
                 and not value.is_integer()):
            raise RecipeError(f"{key} must be a {type(default).__name__} (default {default!r}), got {value!r}")
        if not math.isfinite(value):
            raise RecipeError(f"{key} must be finite, got {value!r}")


def _check_steps(trl_args: dict[str, Any], ac: AgentCreditConfig) -> None:
    steps = trl_args.get("max_steps")
    if steps is None or isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise RecipeError(f"max_steps must be set to a positive integer (optimizer steps; the seed dataset is sized "
                          f"from it), got {steps!r}")
    check_seed_budget(ac, steps)


def check_seed_budget(ac: AgentCreditConfig, max_steps: int) -> None:
    """``max_steps * groups_per_step`` distinct training seeds must fit in ``train_seeds`` minus the eval seeds."""
    need = max_steps * ac.groups_per_step
    lo, hi = ac.train_seeds
    held = 0
    if ac.eval is not None:
        e_lo, e_hi = ac.eval.seeds
        held = max(0, min(hi, e_hi) - max(lo, e_lo))
    if hi - lo - held < need:
        raise RecipeError(f"agentcredit.train_seeds={ac.train_seeds} holds {hi - lo - held} seeds outside the eval "
                          f"seeds, but max_steps * groups_per_step = {max_steps} * {ac.groups_per_step} = {need} "
                          f"distinct seeds are needed; widen agentcredit.train_seeds")
