"""The ``ray`` backend of :mod:`env_adapters.executor`: each env instance a Ray actor.

Importing this module registers the backend; the agent loops import it when their ``env_backend`` is ``ray``::

    # agent-loop config file entry
    env_backend: ray
    env_backend_options: {num_cpus: 1}        # any ray.remote option: resources, scheduling_strategy, ...

verl already runs on Ray, so env work then spreads over the cluster's CPU nodes instead of the agent-loop worker's
host. A call that raises comes back as an ``error`` fault with the actor's traceback; a call past ``env_timeout_s``
kills the actor (``timeout``); an actor that dies (its process crashed, its node went away) is a ``dead`` fault. A
faulted actor is never reused: the next session gets a new one.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import ray

from env_adapters.executor import EnvExecutor, EnvFault, EnvHandle, build_env, call_name, register_backend

__all__ = ["RayHandle"]


@ray.remote
class _EnvActor:
    """One env, built in the actor process."""

    def __init__(self, name: str, options: dict[str, Any]):
        self.env = build_env(name, options)

    def ready(self) -> bool:
        return True

    def apply(self, fn, args: tuple, kwargs: dict):
        return fn(self.env, *args, **kwargs)


class RayHandle(EnvHandle):
    """An env as a Ray actor (options: any ``ray.remote`` option; ``num_cpus`` defaults to 1)."""

    def __init__(self, executor: EnvExecutor, name: str, options: Mapping[str, Any], **actor_options: Any):
        super().__init__(executor, name, options)
        self.actor_options = {"num_cpus": 1, **actor_options}
        self.actor = None

    def _get(self, ref, timeout: float | None, call: str):
        try:
            return ray.get(ref, timeout=timeout)
        except ray.exceptions.GetTimeoutError:
            raise TimeoutError(f"no result within {timeout} s") from None
        except ray.exceptions.RayActorError as exc:
            raise EnvFault("dead", self.name, call, f"the env actor died: {exc}") from None
        except ray.exceptions.RayTaskError as exc:
            raise EnvFault("error", self.name, call, str(exc)) from None

    def _start(self) -> None:
        self.actor = _EnvActor.options(**self.actor_options).remote(self.name, dict(self.options))
        try:
            self._get(self.actor.ready.remote(), self.executor.start_timeout_s, "make")
        except TimeoutError:
            self._abort()
            raise EnvFault("timeout", self.name, "make", f"the env actor did not start within "
                                                         f"{self.executor.start_timeout_s} s") from None

    def _run(self, fn, args, kwargs, timeout):
        return self._get(self.actor.apply.remote(fn, args, kwargs), timeout, call_name(fn, args))

    def _abort(self) -> None:
        if self.actor is not None:
            ray.kill(self.actor, no_restart=True)

    def close(self) -> None:
        self._abort()
        self.actor = None


register_backend("ray", RayHandle)
