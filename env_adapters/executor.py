"""Env work off the caller's thread: an ``AgentEnv`` behind a handle whose calls run on a private pool, with a
per-call timeout, and whose faults come back as one exception type.

An agent loop that serves many sessions on one event loop (verl's agent-loop worker) must never run env code on
that loop: one env step of E seconds would stall every session of the worker. :class:`EnvExecutor` runs each call
``fn(env, *args)`` elsewhere and the loop awaits it:

* ``thread`` (default): the env lives in the caller's process; its calls run on the executor's own thread pool
  (``workers`` threads; never the loop's default executor, which verl uses for tokenisation). Right for envs whose
  steps release the GIL (a JVM game, a search backend, a subprocess) and for cheap Python envs. An adapter that sets
  ``thread_safe = False`` (ALFWorld, TextWorld: TextWorld's grammar parser is one module-level object that two
  threads corrupt) has its calls run one at a time; the ``process`` backend runs such envs in parallel.
* ``process``: each env instance lives in a worker process of its own (``python -m env_adapters.env_worker``), fed
  over a pipe. GIL-bound Python envs then scale with cores, and an env that segfaults, leaks or hangs is killed and
  replaced without touching the caller.
* further backends register with :func:`register_backend` (``ray``: :mod:`agentcredit.verl.env_actors`, env
  instances as Ray actors spread over a cluster's CPU nodes).

Every call has a timeout (``timeout_s``; building an env has its own, ``start_timeout_s``: ALFWorld or ScienceWorld
start in seconds). A call that raises, times out or loses its worker raises :class:`EnvFault` (``kind`` ``error``,
``timeout`` or ``dead``, the env, the call and the traceback) and marks the handle broken: it is never reused, and a
process or actor behind it is killed. With ``reuse`` (default) a released healthy handle goes back to an idle pool
keyed by (env name, options) and the next session of the same env resets it to its own seed instead of building a
new env (the ``AgentEnv`` protocol: the same seed gives the same initial state, whatever was played before).

What runs remotely is a picklable function of the env (a module-level function; :func:`call_method` calls a method
by name), so one round trip can do several env queries (the loops batch a turn's queries into one call).
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import contextlib
import json
import logging
import os
import pickle
import subprocess
import sys
import threading
import traceback
from collections.abc import Callable, Mapping, Sequence
from multiprocessing.connection import Connection
from typing import Any

import cloudpickle

__all__ = ["EnvExecutor", "EnvHandle", "EnvFault", "FAULT_KINDS", "BACKENDS", "register_backend", "call_method",
           "call_name", "build_env", "shared_executor", "thread_safe"]

logger = logging.getLogger("agentcredit")

#: what can go wrong with an env call: it raised, it ran past its timeout, its worker process / actor died
FAULT_KINDS = ("error", "timeout", "dead")


class EnvFault(RuntimeError):
    """An env call that did not return a result: ``kind`` (one of :data:`FAULT_KINDS`), ``env`` (its name), ``call``
    (the function or method), ``detail`` (the traceback text, or what happened) and ``seed`` (set by the caller)."""

    def __init__(self, kind: str, env: str, call: str, detail: str, seed: Any = None):
        if kind not in FAULT_KINDS:
            raise ValueError(f"EnvFault kind={kind!r}; use one of {list(FAULT_KINDS)}")
        self.kind, self.env, self.call, self.detail, self.seed = kind, env, call, detail, seed
        super().__init__(self.summary())

    def summary(self) -> str:
        seed = "" if self.seed is None else f" seed={self.seed}"
        last = self.detail.strip().splitlines()[-1] if self.detail.strip() else ""
        return f"env {self.env!r}{seed}: {self.call} -> {self.kind}: {last}"


def call_method(env, method: str, *args, **kwargs):
    """``env.<method>(*args, **kwargs)``: a picklable way to call one method remotely."""
    return getattr(env, method)(*args, **kwargs)


def call_name(fn: Callable, args: tuple) -> str:
    """How a fault names the call ``fn(env, *args)``: the method's name for :func:`call_method`, else ``fn``'s."""
    if fn is call_method and args:
        return str(args[0])
    return getattr(fn, "__name__", repr(fn))


class EnvHandle:
    """One env instance behind a backend. ``await handle.apply(fn, *args)`` runs ``fn(env, *args)`` there and returns
    its result; :meth:`apply_sync` does the same from synchronous code. Subclasses implement :meth:`_start`,
    :meth:`_run` (blocking; called on a pool thread) and :meth:`_abort` (kill what runs the env)."""

    def __init__(self, executor: EnvExecutor, name: str, options: Mapping[str, Any]):
        self.executor, self.name, self.options = executor, name, dict(options)
        self.broken = False
        self.calls = 0
        self._lock = threading.Lock()  # one call at a time per env instance

    # -- backend hooks --------------------------------------------------------------------------------------------
    def _start(self) -> None:  # pragma: no cover - each backend builds its env
        raise NotImplementedError

    def _run(self, fn: Callable, args: tuple, kwargs: dict, timeout: float | None) -> Any:  # pragma: no cover
        raise NotImplementedError

    def _abort(self) -> None:
        """Stop what runs the env after a timeout (a thread cannot be killed: it is abandoned)."""

    def close(self) -> None:
        """Release what the env holds (its process or actor; ``env.close()`` where it has one)."""

    # -- calls ----------------------------------------------------------------------------------------------------
    def _guarded(self, fn: Callable, args: tuple, kwargs: dict, timeout: float | None) -> Any:
        with self._lock:
            if self.broken:
                raise EnvFault("dead", self.name, call_name(fn, args), "the env handle is broken by an earlier fault")
            self.calls += 1
            return self._run(fn, args, kwargs, timeout)

    def _fault(self, exc: BaseException, call: str, timeout: float | None) -> EnvFault:
        self.broken = True
        if isinstance(exc, EnvFault):
            fault = exc
        elif isinstance(exc, (TimeoutError, asyncio.TimeoutError, cf.TimeoutError)):
            self._abort()
            fault = EnvFault("timeout", self.name, call, f"no result within env_timeout_s={timeout}")
        else:
            fault = EnvFault("error", self.name, call, "".join(traceback.format_exception(exc)))
        self.executor._count(fault)
        return fault

    async def apply(self, fn: Callable, *args, timeout: float | None = None, **kwargs) -> Any:
        """``fn(env, *args, **kwargs)`` on the executor's pool, awaited with the executor's ``timeout_s`` (or
        ``timeout``); an :class:`EnvFault` when it raises, times out or its worker died."""
        timeout = self.executor.timeout_s if timeout is None else timeout
        future = self.executor._pool.submit(self._guarded, fn, args, kwargs, timeout)
        try:
            return await asyncio.wait_for(asyncio.wrap_future(future), timeout)
        except Exception as exc:
            raise self._fault(exc, call_name(fn, args), timeout) from None

    def apply_sync(self, fn: Callable, *args, timeout: float | None = None, **kwargs) -> Any:
        """:meth:`apply` for synchronous callers (the TRL rollouts): blocks this thread, not the env's."""
        timeout = self.executor.timeout_s if timeout is None else timeout
        future = self.executor._pool.submit(self._guarded, fn, args, kwargs, timeout)
        try:
            return future.result(timeout)
        except Exception as exc:
            raise self._fault(exc, call_name(fn, args), timeout) from None

    async def call(self, method: str, *args, **kwargs) -> Any:
        """``await handle.call("step", text)``: one method of the env, off the loop."""
        return await self.apply(call_method, method, *args, **kwargs)


def build_env(name: str, options: Mapping[str, Any]):
    """``env_adapters.make(name, **options)`` (what every backend runs where its env lives)."""
    import env_adapters

    return env_adapters.make(name, **dict(options))


#: held around every call of an env that is not thread-safe on the thread backend (one lock for all of them: ALFWorld
#: and TextWorld share TextWorld's module-level grammar parser)
_NOT_THREAD_SAFE = threading.RLock()


def thread_safe(obj) -> bool:
    """Whether an env (or its factory) may be called from several threads at once: its ``thread_safe`` attribute,
    True when it has none."""
    return bool(getattr(obj, "thread_safe", True))


class ThreadHandle(EnvHandle):
    """The env in this process; its calls on the executor's thread pool (one at a time across all envs that are not
    :func:`thread_safe`). A call past its timeout is abandoned (its thread runs on until the env returns) and the env
    is never used again."""

    env: Any = None

    def _start(self) -> None:
        from credit_plugins import registry

        factory = registry.get(self.name, kind="envs").factory
        with contextlib.nullcontext() if thread_safe(factory) else _NOT_THREAD_SAFE:
            self.env = build_env(self.name, self.options)

    def _run(self, fn, args, kwargs, timeout):
        with contextlib.nullcontext() if thread_safe(self.env) else _NOT_THREAD_SAFE:
            return fn(self.env, *args, **kwargs)

    def close(self) -> None:
        closer = getattr(self.env, "close", None)
        if callable(closer) and not self.broken:
            try:
                closer()
            except Exception:  # noqa: BLE001 - closing is best effort
                logger.debug("agentcredit: closing env %r failed", self.name, exc_info=True)
        self.env = None


class ProcessHandle(EnvHandle):
    """The env in a worker process of its own (``python -m env_adapters.env_worker``), driven over two pipes. Messages
    go both ways with cloudpickle (as Ray ships them), so a snapshot that holds a local class (MiniGrid's) or a
    function of ``__main__`` travels. A timeout kills the process; a process that dies (segfault, ``os._exit``, OOM
    kill) is a ``dead`` fault."""

    proc: subprocess.Popen | None = None

    def _start(self) -> None:
        down_r, down_w = os.pipe()  # caller -> worker
        up_r, up_w = os.pipe()      # worker -> caller
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        self.proc = subprocess.Popen([sys.executable, "-m", "env_adapters.env_worker", str(down_r), str(up_w)],
                                     pass_fds=(down_r, up_w), env=env, stdin=subprocess.DEVNULL)
        os.close(down_r)
        os.close(up_w)
        self._send = Connection(down_w, readable=False)
        self._recv = Connection(up_r, writable=False)
        self._roundtrip(("start", self.name, dict(self.options)), self.executor.start_timeout_s, "make")

    def _roundtrip(self, message: tuple, timeout: float | None, call: str) -> Any:
        try:
            self._send.send_bytes(cloudpickle.dumps(message))
            if not self._recv.poll(timeout):
                self._abort()
                raise EnvFault("timeout", self.name, call, f"no result within {timeout} s; the worker was killed")
            status, value = pickle.loads(self._recv.recv_bytes())
        except (EOFError, OSError, BrokenPipeError) as exc:
            code = self.proc.poll() if self.proc is not None else None
            raise EnvFault("dead", self.name, call, f"the env worker process died (exit code {code}): {exc!r}") \
                from None
        if status == "error":
            raise EnvFault("error", self.name, call, value)
        return value

    def _run(self, fn, args, kwargs, timeout):
        return self._roundtrip(("call", fn, args, kwargs), timeout, call_name(fn, args))

    def _abort(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()

    def close(self) -> None:
        if self.proc is None:
            return
        try:
            if self.proc.poll() is None and not self.broken:
                self._send.send_bytes(cloudpickle.dumps(None))  # ask the worker to exit
                self.proc.wait(timeout=5)
        except Exception:  # noqa: BLE001 - the kill below ends it anyway
            pass
        self._abort()
        for conn in (self._send, self._recv):
            conn.close()
        self.proc.wait()
        self.proc = None


#: backend name -> handle class
BACKENDS: dict[str, type[EnvHandle]] = {"thread": ThreadHandle, "process": ProcessHandle}


def register_backend(name: str, handle_cls: type[EnvHandle]) -> None:
    """Make ``EnvExecutor(backend=name)`` build its envs as ``handle_cls`` (an :class:`EnvHandle` subclass)."""
    if not (isinstance(handle_cls, type) and issubclass(handle_cls, EnvHandle)):
        raise TypeError(f"register_backend({name!r}, ...) takes an EnvHandle subclass, got {handle_cls!r}")
    BACKENDS[name] = handle_cls


def _key(name: str, options: Mapping[str, Any]) -> str:
    return json.dumps([name, dict(options)], sort_keys=True, default=repr)


class EnvExecutor:
    """Builds, lends and reuses env handles of one backend; counts faults.

    Args:
        backend: ``thread``, ``process`` or a registered one (:func:`register_backend`; ``ray``).
        workers: threads of the executor's pool: the most env calls (or round trips to env processes / actors)
            in flight at once. Size it to the sessions a worker runs concurrently.
        timeout_s: the limit of one env call (None: no limit).
        start_timeout_s: the limit of building one env.
        reuse: keep released healthy envs for the next session of the same env name and options.
        backend_options: keyword options of the backend's handles (``ray``: ``num_cpus``, ...).
    """

    def __init__(self, backend: str = "thread", workers: int = 64, timeout_s: float | None = 120.0,
                 start_timeout_s: float | None = 600.0, reuse: bool = True,
                 backend_options: Mapping[str, Any] | None = None):
        if backend not in BACKENDS:
            hint = " (import agentcredit.verl.env_actors to register 'ray')" if backend == "ray" else ""
            raise ValueError(f"env_backend={backend!r}; use one of {sorted(BACKENDS)}{hint}")
        if int(workers) < 1:
            raise ValueError(f"env_workers={workers}; the env pool needs at least one thread")
        for field, value in (("env_timeout_s", timeout_s), ("env_start_timeout_s", start_timeout_s)):
            if value is not None and not float(value) > 0:
                raise ValueError(f"{field}={value}; use a positive number of seconds (or null for no limit)")
        self.backend, self.workers = backend, int(workers)
        self.timeout_s = None if timeout_s is None else float(timeout_s)
        self.start_timeout_s = None if start_timeout_s is None else float(start_timeout_s)
        self.reuse = bool(reuse)
        self.backend_options = dict(backend_options or {})
        self._pool = cf.ThreadPoolExecutor(self.workers, thread_name_prefix=f"agentcredit-env-{backend}")
        self._idle: dict[str, list[EnvHandle]] = {}
        self._idle_lock = threading.Lock()
        self.counts = {"built": 0, "reused": 0, **{kind: 0 for kind in FAULT_KINDS}}
        self._logged: set[str] = set()
        self.closed = False

    def _count(self, fault: EnvFault) -> None:
        self.counts[fault.kind] += 1
        if fault.kind not in self._logged:  # the first traceback of each kind, once per executor
            self._logged.add(fault.kind)
            logger.error("agentcredit: env fault (%s; later ones of this kind are only counted): %s\n%s",
                         fault.kind, fault.summary(), fault.detail)

    def _reused(self, name: str, options: Mapping[str, Any]) -> EnvHandle | None:
        """An idle handle of ``name`` with ``options`` (counted), or None (none idle, or no reuse)."""
        if not self.reuse:
            return None
        with self._idle_lock:
            idle = self._idle.get(_key(name, options))
            handle = idle.pop() if idle else None
        if handle is not None:
            self.counts["reused"] += 1
        return handle

    def _new(self, name: str, options: Mapping[str, Any]) -> EnvHandle:
        handle = BACKENDS[self.backend](self, name, options, **self.backend_options)
        self.counts["built"] += 1
        return handle

    def _start(self, handle: EnvHandle) -> EnvHandle:
        try:
            handle._start()
        except EnvFault:
            handle.broken = True
            handle.close()
            raise
        except Exception as exc:  # noqa: BLE001 - any failure to build is the env's fault
            handle.broken = True
            handle.close()
            raise EnvFault("error", handle.name, "make", "".join(traceback.format_exception(exc))) from None
        return handle

    async def acquire(self, name: str, options: Mapping[str, Any] | None = None) -> EnvHandle:
        """An idle handle of ``name`` with ``options`` (reuse), else a new one built off the loop."""
        options = dict(options or {})
        handle = self._reused(name, options)
        if handle is not None:
            return handle
        handle = self._new(name, options)
        future = self._pool.submit(self._start, handle)
        try:
            return await asyncio.wait_for(asyncio.wrap_future(future), self.start_timeout_s)
        except Exception as exc:
            raise handle._fault(exc, "make", self.start_timeout_s) from None

    def acquire_sync(self, name: str, options: Mapping[str, Any] | None = None) -> EnvHandle:
        """:meth:`acquire` for synchronous callers."""
        options = dict(options or {})
        handle = self._reused(name, options)
        if handle is not None:
            return handle
        handle = self._new(name, options)
        try:
            return self._pool.submit(self._start, handle).result(self.start_timeout_s)
        except Exception as exc:
            raise handle._fault(exc, "make", self.start_timeout_s) from None

    def adopt(self, env, name: str = "") -> EnvHandle:
        """A ``thread`` handle around an env built by the caller (never pooled for reuse)."""
        handle = ThreadHandle(self, name or type(env).__name__, {})
        handle.env = env
        return handle

    def run_all(self, calls: Sequence[tuple[EnvHandle, Callable, tuple]]) -> list[Any]:
        """Run ``fn(env, *args)`` for each ``(handle, fn, args)`` at once on the pool (synchronous callers: the TRL
        rollouts step all their episodes' envs together); each result, or the :class:`EnvFault` of that call."""
        futures = [(h, fn, args, self._pool.submit(h._guarded, fn, args, {}, self.timeout_s)) for h, fn, args in calls]
        out: list[Any] = []
        for h, fn, args, future in futures:
            try:
                out.append(future.result(self.timeout_s))
            except Exception as exc:  # noqa: BLE001 - every failure of an env call is that env's fault
                out.append(h._fault(exc, call_name(fn, args), self.timeout_s))
        return out

    def release(self, handle: EnvHandle) -> None:
        """Give a handle back: kept for reuse when healthy (and ``reuse``), else closed (off the caller's thread)."""
        if self.reuse and not handle.broken:
            with self._idle_lock:
                self._idle.setdefault(_key(handle.name, handle.options), []).append(handle)
            return
        self._pool.submit(handle.close)

    def close(self) -> None:
        """Close every idle env and stop the pool (calls still running are abandoned)."""
        with self._idle_lock:
            idle = [h for hs in self._idle.values() for h in hs]
            self._idle.clear()
        for handle in idle:
            handle.close()
        self._pool.shutdown(wait=False, cancel_futures=True)
        self.closed = True


_SHARED: dict[str, EnvExecutor] = {}
_SHARED_LOCK = threading.Lock()


def shared_executor(**settings: Any) -> EnvExecutor:
    """The process's executor for these settings (built on first use): verl builds one agent-loop object per
    session, and all of a worker's sessions must share one pool and one set of idle envs."""
    key = json.dumps(settings, sort_keys=True, default=repr)
    with _SHARED_LOCK:
        executor = _SHARED.get(key)
        if executor is None or executor.closed:
            executor = _SHARED[key] = EnvExecutor(**settings)
        return executor
