"""Stable 64-bit keys for anchor states and actions.

Python's ``hash()`` is salted per process, so two Ray workers would disagree on it. Keys here are the first
8 bytes of BLAKE2b over the UTF-8 text, read as a signed little-endian int64: the same text gives the same key
in every process, on every machine, in every release.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

import numpy as np
import torch

__all__ = ["stable_hash", "stable_hash_many", "RESERVED_KEYS", "mix64", "signed64", "MASK64", "GOLDEN64"]

#: Keys reserved for absorbing boundary nodes (success z+, failure z-). User keys may not take them.
SUCCESS_KEY = np.int64(-(2**63))
FAILURE_KEY = np.int64(-(2**63) + 1)
RESERVED_KEYS = (int(SUCCESS_KEY), int(FAILURE_KEY))


def stable_hash(text: str | bytes) -> int:
    """Stable signed 64-bit key of ``text`` (``str`` is encoded as UTF-8).

    >>> stable_hash("You are in the middle of a room.") == stable_hash("You are in the middle of a room.")
    True
    """
    # surrogatepass: a lone surrogate (e.g. from a bad decode) gets a key instead of a UnicodeEncodeError
    data = text.encode("utf-8", "surrogatepass") if isinstance(text, str) else bytes(text)
    key = int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little", signed=True)
    if key in RESERVED_KEYS:  # 2 values in 2^64; fold them away so boundaries stay unique
        key += 2
    return key


def canonical_bytes(value: object) -> bytes:
    """Bytes that identify ``value``: UTF-8 of a string, raw bytes, a numpy scalar as the Python value it holds, an
    array's dtype, shape and buffer, a dict's items in key order (verl-agent's ``to_hashable``), or the ``repr`` of
    anything else (ints, floats, tuples, ...)."""
    if isinstance(value, str):
        return value.encode("utf-8", "surrogatepass")
    if isinstance(value, np.generic):  # np.float64(5.0) is the key 5.0, np.str_ the string
        return canonical_bytes(value.item())
    if isinstance(value, (bytes, bytearray)):
        return bytes(value)
    if isinstance(value, np.ndarray):
        return f"ndarray:{value.dtype.str}:{value.shape}:".encode() + np.ascontiguousarray(value).tobytes()
    if isinstance(value, dict):
        return b"dict:" + b"|".join(canonical_bytes(k) + b"=" + canonical_bytes(value[k]) for k in sorted(value, key=str))
    return repr(value).encode("utf-8")


def stable_hash_many(values: Iterable[object]) -> np.ndarray:
    """``stable_hash`` of each value as an ``int64`` array. Integers pass through unchanged; ``None`` maps to -1.

    Each distinct string is hashed once, so a batch with heavy anchor revisits costs one hash per unique state.
    """
    values = list(values)
    cache: dict[object, int] = {}
    out = np.empty(len(values), dtype=np.int64)
    for i, v in enumerate(values):
        if v is None:
            out[i] = -1
        elif isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_)):
            out[i] = int(v)
        elif isinstance(v, (str, bytes)):
            k = cache.get(v)
            if k is None:
                k = cache[v] = stable_hash(v)
            out[i] = k
        else:
            out[i] = stable_hash(canonical_bytes(v))
    return out


# ---- vectorised 64-bit mixing (splitmix64's finaliser) on int64 tensors ----------------------------------------
MASK64 = (1 << 64) - 1
GOLDEN64 = 0x9E3779B97F4A7C15
_MIX1, _MIX2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB


def signed64(c: int) -> int:
    """The unsigned 64-bit constant ``c`` as the signed int64 with the same bit pattern."""
    c &= MASK64
    return c - (1 << 64) if c >= 1 << 63 else c


def mix64(z: torch.Tensor) -> torch.Tensor:
    """splitmix64 finaliser on int64 bit patterns (wrapping arithmetic), on a copy of ``z``: every output bit
    depends on every input bit, so nearby keys land far apart."""
    z = z.clone()
    tmp = torch.empty_like(z)
    for shift, mult in ((30, signed64(_MIX1)), (27, signed64(_MIX2)), (31, None)):
        torch.bitwise_right_shift(z, shift, out=tmp)
        tmp.bitwise_and_((1 << (64 - shift)) - 1)  # logical shift of the bit pattern
        z.bitwise_xor_(tmp)
        if mult is not None:
            z.mul_(mult)
    return z
