"""A run is never lost: the checks and bookkeeping around ``agentcredit train`` / ``sft`` / ``ross`` (standard library
only, so every check runs before any model loads).

* :func:`check_read_path` / :func:`check_model_path`: a path the run will read exists (a model folder holds a
  ``config.json`` or an ``adapter_config.json``); the error names the key and the path.
* :func:`check_out_dir` / :func:`check_out_file`: a path the run will write is a folder (a file) that can be
  created and written; the error names the key, the path and the operating system's reason.
* :class:`RunLock`: an ``fcntl.flock`` on ``<output_dir>/.agentcredit.lock``, held for the run's life; a second live
  run on the same folder is refused with the holder's pid. The kernel drops the lock when its process dies, so a
  crashed or killed run never blocks the next one.
* :func:`previous_run` / :func:`clear_previous_run`: what of an earlier run a folder holds (``run.json``,
  ``metrics.jsonl``, ``summary.json``, ``checkpoint-N``, ``final``); a new run there is refused unless it resumes or
  overwrites. The warm start (``warm_start/``) is a cache, not a run: it is kept.
* :func:`latest_checkpoint`: the ``checkpoint-N`` with the largest ``N`` that holds a ``trainer_state.json``.
* :class:`GracefulStop`: SIGINT / SIGTERM set a flag (the trainer finishes its step, checkpoints and stops); a second
  signal raises ``KeyboardInterrupt`` at once.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from .recipe import RecipeError

__all__ = ["RUN_FILE", "LOCK_FILE", "RunLock", "GracefulStop", "check_read_path", "check_model_path", "check_out_dir",
           "check_out_file", "previous_run", "clear_previous_run", "latest_checkpoint", "new_run_id", "read_run",
           "write_run", "looks_local"]

RUN_FILE = "run.json"
LOCK_FILE = ".agentcredit.lock"
_CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")
#: what a finished or interrupted ``agentcredit train`` leaves in its output_dir (besides checkpoint-N folders)
RUN_OUTPUTS = (RUN_FILE, "metrics.jsonl", "summary.json", "eval_episodes.jsonl", "learning_curve.png", "final")


def new_run_id() -> str:
    """``YYYYmmdd-HHMMSS-xxxxxx``: sortable, unique enough for a folder's runs."""
    return time.strftime("%Y%m%d-%H%M%S") + "-" + uuid.uuid4().hex[:6]


# ---- paths a run reads -----------------------------------------------------------------------------------------------
def looks_local(value: str) -> bool:
    """True when ``value`` is meant as a local path rather than a hub id (``org/name``): it exists, is absolute or
    starts with ``.`` or ``~``, has more than one ``/``, or its first component is an existing folder here."""
    v = str(value)
    if os.path.exists(os.path.expanduser(v)) or v.startswith((".", "~", os.sep)) or v.count("/") > 1:
        return True
    head = v.split("/", 1)[0]
    return "/" in v and os.path.isdir(head)


def check_read_path(key: str, path: str | os.PathLike, what: str = "file", fix: str = "") -> Path:
    """``path`` exists (a ``RecipeError`` naming ``key`` otherwise)."""
    p = Path(os.path.expanduser(str(path)))
    if not p.exists():
        raise RecipeError(f"{key}={str(path)!r}: no such {what} ({p.resolve()}){'; ' + fix if fix else ''}")
    return p


def check_model_path(key: str, value: str | None, fix: str = "") -> None:
    """A model a run will load: a built-in name or a hub id passes; a local path must be a model folder."""
    from .models import BUILTIN_MODELS

    if value is None or str(value).strip().lower() in BUILTIN_MODELS or not looks_local(str(value)):
        return
    p = check_read_path(key, value, "folder", fix)
    if not p.is_dir() or not ((p / "config.json").exists() or (p / "adapter_config.json").exists()):
        raise RecipeError(f"{key}={str(value)!r} is not a model folder (no config.json in {p.resolve()})"
                          f"{'; ' + fix if fix else ''}")


# ---- paths a run writes ----------------------------------------------------------------------------------------------
def check_out_dir(key: str, path: str | os.PathLike) -> Path:
    """Create the folder ``path`` (and its parents) and write a probe file into it."""
    p = Path(os.path.expanduser(str(path)))
    if p.exists() and not p.is_dir():
        raise RecipeError(f"{key}={str(path)!r} is a file, not a folder; give a folder path")
    try:
        p.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".agentcredit-probe-", dir=p)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise RecipeError(f"{key}={str(path)!r} cannot be written ({e.strerror or e}); give a writable folder") \
            from None
    return p


def check_out_file(key: str, path: str | os.PathLike) -> Path:
    """The file ``path`` can be appended to (its folder is created; the file itself is not)."""
    p = Path(os.path.expanduser(str(path)))
    if p.is_dir():
        raise RecipeError(f"{key}={str(path)!r} is a folder; give a file path (e.g. {p / 'rollouts.jsonl'})")
    check_out_dir(f"{key} (its folder)", p.parent)
    if p.exists():
        try:
            with open(p, "a", encoding="utf-8"):
                pass
        except OSError as e:
            raise RecipeError(f"{key}={str(path)!r} cannot be written ({e.strerror or e})") from None
    return p


# ---- one live run per folder -----------------------------------------------------------------------------------------
class RunLock:
    """An exclusive, non-blocking ``flock`` on ``<folder>/.agentcredit.lock`` (the holder's pid written into it)."""

    def __init__(self, folder: str | os.PathLike, key: str = "output_dir"):
        self.path = Path(folder) / LOCK_FILE
        self.key = key
        self._fd: int | None = None

    def acquire(self) -> RunLock:
        import fcntl

        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = os.read(fd, 64).decode(errors="replace").strip() or "?"
            os.close(fd)
            raise RecipeError(f"{self.key}={str(self.path.parent)!r} is in use by another live run (pid {holder}); "
                              f"wait for it, stop it, or give this run another output_dir") from None
        os.ftruncate(fd, 0)
        os.write(fd, str(os.getpid()).encode())
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the descriptor drops the flock
            self._fd = None

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


# ---- the runs a folder holds -----------------------------------------------------------------------------------------
def _checkpoints(folder: Path) -> list[tuple[int, Path]]:
    if not folder.is_dir():
        return []
    out = []
    for child in folder.iterdir():
        m = _CHECKPOINT.match(child.name)
        if m and child.is_dir():
            out.append((int(m.group(1)), child))
    return sorted(out)


def latest_checkpoint(folder: str | os.PathLike) -> Path | None:
    """The ``checkpoint-N`` of ``folder`` with the largest ``N`` that holds a ``trainer_state.json``."""
    done = [p for _, p in _checkpoints(Path(folder)) if (p / "trainer_state.json").exists()]
    return done[-1] if done else None


def previous_run(folder: str | os.PathLike) -> list[str]:
    """The names of an earlier run's outputs in ``folder`` (empty: no run there)."""
    f = Path(folder)
    return [n for n in RUN_OUTPUTS if (f / n).exists()] + [p.name for _, p in _checkpoints(f)]


def clear_previous_run(folder: str | os.PathLike, extra: list[str | os.PathLike] = ()) -> list[str]:
    """Delete an earlier run's outputs (:func:`previous_run`) and the files in ``extra``; keep ``warm_start``."""
    f = Path(folder)
    gone = []
    for name in previous_run(f):
        p = f / name
        shutil.rmtree(p) if p.is_dir() else p.unlink()
        gone.append(name)
    for path in extra:
        p = Path(path)
        if p.is_file():
            p.unlink()
            gone.append(str(p))
    return gone


def read_run(folder: str | os.PathLike) -> dict[str, Any]:
    p = Path(folder) / RUN_FILE
    try:
        return json.loads(p.read_text())
    except (OSError, ValueError):
        return {}


def write_run(folder: str | os.PathLike, info: dict[str, Any]) -> None:
    """``run.json``, written aside and renamed (never half written)."""
    p = Path(folder) / RUN_FILE
    tmp = p.with_name(p.name + f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(info, indent=2, default=str) + "\n")
    tmp.replace(p)


# ---- a clean stop ----------------------------------------------------------------------------------------------------
class GracefulStop:
    """While active, the first SIGINT / SIGTERM sets :attr:`signal` (and prints ``message``); the second raises
    ``KeyboardInterrupt``. The previous handlers come back on exit. A no-op outside the main thread."""

    def __init__(self, message: str = ""):
        self.signal: int | None = None
        self.message = message
        self._old: dict[int, Any] = {}

    def _handle(self, signum, frame) -> None:
        if self.signal is not None:
            raise KeyboardInterrupt(f"second {signal.Signals(signum).name}")
        self.signal = signum
        if self.message:
            print(self.message.format(signal=signal.Signals(signum).name), flush=True)

    def __enter__(self) -> GracefulStop:
        import threading

        if threading.current_thread() is threading.main_thread():
            for s in (signal.SIGINT, signal.SIGTERM):
                self._old[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for s, old in self._old.items():
            signal.signal(s, old)
        self._old.clear()

    @property
    def exit_code(self) -> int:
        return 128 + int(self.signal) if self.signal is not None else 0
