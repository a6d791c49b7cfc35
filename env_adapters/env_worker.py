"""The worker process of :class:`env_adapters.executor.ProcessHandle`: one env instance, driven over two pipes.

``python -m env_adapters.env_worker READ_FD WRITE_FD``. Messages (cloudpickled bytes) in: ``("start", name,
options)`` once (builds the env), then ``("call", fn, args, kwargs)`` (runs ``fn(env, *args, **kwargs)``), ``None``
to exit. Each message gets one reply, ``("ok", value)`` or ``("error", traceback text)``. EOF on the read pipe (the
caller died) ends it.
"""

from __future__ import annotations

import pickle
import sys
import traceback
from multiprocessing.connection import Connection

import cloudpickle


def serve(read_fd: int, write_fd: int) -> None:
    inbox, outbox = Connection(read_fd, writable=False), Connection(write_fd, readable=False)
    env = None
    def send(reply) -> None:
        outbox.send_bytes(cloudpickle.dumps(reply))

    while True:
        try:
            message = pickle.loads(inbox.recv_bytes())
        except EOFError:
            return
        except Exception:  # noqa: BLE001 - a message that cannot be unpickled here (e.g. a module it lacks)
            send(("error", traceback.format_exc()))
            continue
        if message is None:
            break
        try:
            if message[0] == "start":
                import env_adapters

                env = env_adapters.make(message[1], **message[2])
                value = None
            else:
                _, fn, args, kwargs = message
                value = fn(env, *args, **kwargs)
            reply = ("ok", value)
        except Exception:  # noqa: BLE001 - every env failure goes back to the caller as text
            reply = ("error", traceback.format_exc())
        try:
            send(reply)
        except Exception:  # noqa: BLE001 - e.g. a result that cannot be pickled
            send(("error", traceback.format_exc()))
    closer = getattr(env, "close", None)
    if callable(closer):
        closer()


if __name__ == "__main__":
    serve(int(sys.argv[1]), int(sys.argv[2]))
