"""The one place that knows which verl internals agentcredit relies on (verl>=0.9.1,<0.10).

Every verl hook of :mod:`agentcredit.verl` goes through these helpers:

* :func:`check_signature`: a verl function or method still exists and takes the parameters the wrap passes on;
  otherwise :class:`VerlInternalsChanged` with the supported version range.
* :func:`wraps_once`: a decorator for a wrapper factory. It checks the wrapped function's signature, wraps it at
  most once per ``tag`` (the advantage hook and the distillation hook both wrap ``PPOTrainer._save_checkpoint``;
  each does so exactly once, whatever the order and however often the hooks are installed) and marks the result.
* :func:`install_post_import_hooks`: run a patch when (or, if already imported, as soon as) a verl module loads
  (``wrapt``), logging a failure loudly since verl hides plugin errors at DEBUG level.
* :func:`agent_loop_registry`: verl's agent-loop registry, which :mod:`agentcredit.verl.loops` fills.
* :func:`algorithm_entry` / :func:`algorithm_mapping`: one ``algorithm.agentcredit_*`` entry of verl's algorithm
  config (a DictConfig, a dataclass or a dict) as plain Python, a mapping's keys checked.
* :func:`save_folder` / :func:`load_folder`: the ``global_step_N`` folder verl just saved to, or resumed from;
  :func:`checkpoint_wraps`: the ``PPOTrainer._save_checkpoint`` / ``_load_checkpoint`` wraps that keep a piece of
  agentcredit state (the estimators', the distillation scheduler's) in that folder, read back with
  :func:`load_state` (``torch.load(weights_only=True)``: plain data only, never code).
"""

from __future__ import annotations

import functools
import inspect
import logging
import os
from collections.abc import Callable, Mapping
from types import ModuleType
from typing import Any

from ..state import load_state  # noqa: F401  (re-exported: the verl checkpoint hooks use it)

logger = logging.getLogger("agentcredit")

SUPPORTED = "verl>=0.9.1,<0.10"
_MARK = "__agentcredit_wraps__"


class VerlInternalsChanged(RuntimeError):
    """verl no longer has the internal function or signature the bridge wraps."""


def check_signature(obj: Any, what: str, params: tuple[str, ...]) -> None:
    """Raise :class:`VerlInternalsChanged` unless ``obj`` exists and its first parameters are ``params``."""
    if obj is None:
        raise VerlInternalsChanged(f"agentcredit: verl has no {what}; this bridge supports {SUPPORTED}")
    names = list(inspect.signature(obj).parameters)
    if names[: len(params)] != list(params):
        raise VerlInternalsChanged(f"agentcredit: verl's {what} takes {names}, expected the first to be "
                                   f"{list(params)}; this bridge supports {SUPPORTED}")


def is_wrapped(fn: Any, tag: str) -> bool:
    """Whether ``fn`` already carries agentcredit's wrap ``tag``."""
    return tag in getattr(fn, _MARK, frozenset())


def wraps_once(tag: str, what: str, params: tuple[str, ...]):
    """Decorator for a wrapper factory ``build(orig) -> wrapper``: check ``orig``'s signature, wrap it once per
    ``tag`` (a function already wrapped with ``tag`` is returned as it is), and mark the result with every tag of
    the wraps below it."""

    def decorate(build: Callable[[Callable], Callable]) -> Callable[[Callable], Callable]:
        @functools.wraps(build)
        def wrap(orig):
            if orig is not None and is_wrapped(orig, tag):
                return orig
            check_signature(orig, what, params)
            wrapped = functools.wraps(orig)(build(orig))
            setattr(wrapped, _MARK, getattr(orig, _MARK, frozenset()) | {tag})
            return wrapped

        return wrap

    return decorate


def install_post_import_hooks(targets: Mapping[str, Callable[[ModuleType], None]], consequence: str) -> None:
    """Register ``targets`` (module name -> patch) with ``wrapt``; a failing patch is logged with ``consequence``
    (what the user loses) and re-raised."""
    import wrapt

    for module_name, patch in targets.items():
        wrapt.register_post_import_hook(_loud(patch, consequence), module_name)


def _loud(patch, consequence: str):
    @functools.wraps(patch)
    def run(module):
        try:
            patch(module)
        except Exception:
            logger.exception("agentcredit: could not hook %s; %s", module.__name__, consequence)
            raise

    return run


def agent_loop_registry(module: ModuleType) -> dict[str, dict[str, str]]:
    """verl's agent-loop registry (``name -> {"_target_": "<module>.<class>"}``, what its ``register`` decorator
    writes) in ``module`` (``verl.experimental.agent_loop.agent_loop``)."""
    registry = getattr(module, "_agent_loop_registry", None)
    if not isinstance(registry, dict) or getattr(module, "register", None) is None:
        raise VerlInternalsChanged(f"agentcredit: verl's {module.__name__} has no agent-loop registry "
                                   f"(_agent_loop_registry, register); this bridge supports {SUPPORTED}")
    return registry


def algorithm_entry(algorithm: Any, key: str) -> Any:
    """``algorithm.<key>`` of verl's algorithm config as plain Python (OmegaConf nodes converted); None when unset."""
    if algorithm is None:
        return None
    value = algorithm.get(key, None) if hasattr(algorithm, "get") else getattr(algorithm, key, None)
    if value is not None and hasattr(value, "_get_node"):
        from omegaconf import OmegaConf

        value = OmegaConf.to_container(value, resolve=True)
    return value


def algorithm_mapping(algorithm: Any, key: str, valid) -> dict[str, Any] | None:
    """The mapping ``algorithm.<key>`` (None when unset); a ``ValueError`` naming the entry for anything else, or
    for a key outside ``valid``."""
    value = algorithm_entry(algorithm, key)
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise ValueError(f"algorithm.{key} must be a mapping with keys {sorted(valid)}, got {value!r}")
    unknown = sorted(set(value) - set(valid))
    if unknown:
        raise ValueError(f"algorithm.{key}: unknown key(s) {unknown}; valid keys are {sorted(valid)}")
    return dict(value)


def term_params(algorithm: Any, key: str, term: str, example: str):
    """The loss term ``term``'s parameters from the mapping ``algorithm.<key>`` (None when unset), checked by the
    term's own rules; a ``ValueError`` names the entry (``example``: a valid override, shown when it is no mapping)."""
    from credit_plugins import registry

    block = algorithm_entry(algorithm, key)
    if block is None:
        return None
    if not isinstance(block, dict):
        raise ValueError(f"algorithm.{key} must be a mapping of the {term} term's parameters (agentcredit describe "
                         f"{term}), e.g. +algorithm.{key}={example}; got {block!r}")
    try:
        return registry.get(term, kind="terms").make_params(**block)
    except (TypeError, ValueError) as e:
        raise ValueError(f"algorithm.{key}: {e}") from e


def save_folder(trainer) -> str | None:
    """The ``global_step_N`` folder verl's ``_save_checkpoint`` just wrote: always under
    ``trainer.default_local_dir`` (also after ``resume_mode=resume_path``: verl saves new checkpoints there, never
    into the folder it resumed from)."""
    if getattr(trainer, "global_steps", 0) <= 0:
        return None
    return os.path.join(trainer.config.trainer.default_local_dir, f"global_step_{trainer.global_steps}")


def load_folder(trainer) -> str | None:
    """The folder verl's ``_load_checkpoint`` resumed from: ``resume_from_path`` under ``resume_mode=resume_path``,
    else ``default_local_dir/global_step_N`` (N = the step verl restored); None when it started fresh."""
    cfg = trainer.config.trainer
    if getattr(trainer, "global_steps", 0) <= 0:
        return None
    resume_path = cfg.get("resume_from_path", None)
    if cfg.get("resume_mode", "auto") == "resume_path" and resume_path:
        return str(resume_path)
    return os.path.join(cfg.default_local_dir, f"global_step_{trainer.global_steps}")


def checkpoint_wraps(tag: str, filename: str, state: Callable[[], Any], restore: Callable[[Any, str], None]):
    """``(wrap_save_checkpoint, wrap_load_checkpoint)`` for ``PPOTrainer``: after verl saves, ``state()`` (skipped when
    None or empty) goes to ``save_folder/filename``; after verl resumes, ``restore(saved, path)`` gets what
    ``load_folder/filename`` holds, if that file exists."""
    import torch

    @wraps_once(tag, "PPOTrainer._save_checkpoint(self)", ("self",))
    def wrap_save_checkpoint(orig):
        def _save_checkpoint(self, *args, **kwargs):
            out = orig(self, *args, **kwargs)
            saved, folder = state(), save_folder(self)
            if saved and folder is not None and os.path.isdir(folder):
                torch.save(saved, os.path.join(folder, filename))
            return out

        return _save_checkpoint

    @wraps_once(tag, "PPOTrainer._load_checkpoint(self)", ("self",))
    def wrap_load_checkpoint(orig):
        def _load_checkpoint(self, *args, **kwargs):
            out = orig(self, *args, **kwargs)
            folder = load_folder(self)
            path = None if folder is None else os.path.join(folder, filename)
            if path is not None and os.path.exists(path):
                restore(load_state(path), path)
            return out

        return _load_checkpoint

    return wrap_save_checkpoint, wrap_load_checkpoint
