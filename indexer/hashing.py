"""Router-side block hashing: the chained 64-bit hash both the index and incoming requests use.

Engine block hashes differ per engine, release and configuration, so the router never reproduces
them. It hashes the token ids that every ``BlockStored`` carries with its own function, and hashes
requests with the same function, so both sides agree by construction (DESIGN §3).

``h_i = H(h_{i-1}, tokens of block i)`` with ``h_{-1} = namespace_seed(model, lora_name)``. ``H`` is a
murmur-style multiply/rotate over the 64-bit token values with an fmix64 finalizer. It is a routing
hash, not a cryptographic one: a collision costs a mis-scored request, never a wrong answer.
The C accelerator (``indexer._chash``) and the pure-Python fallback below compute the same values;
the Python one is only used where the extension could not be built.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from functools import lru_cache

__all__ = [
    "HASH_VERSION",
    "chain_hashes",
    "chain_hashes_json",
    "json_array_span",
    "namespace_seed",
    "py_chain_hashes",
]

#: Bumped whenever the function changes: snapshots written with another version are rejected.
HASH_VERSION = 1

_M = (1 << 64) - 1
_K1 = 0x9E3779B97F4A7C15
_K2 = 0xC2B2AE3D27D4EB4F
_K3 = 0x165667B19E3779F9


def _fmix64(x: int) -> int:
    x ^= x >> 33
    x = (x * 0xFF51AFD7ED558CCD) & _M
    x ^= x >> 33
    x = (x * 0xC4CEB9FE1A85EC53) & _M
    x ^= x >> 33
    return x


def py_chain_hashes(token_ids: Sequence[int], block_size: int, parent: int) -> list[int]:
    """Pure-Python reference: the chained hash of each *full* block of ``token_ids``."""
    if block_size <= 0:
        raise ValueError("block_size must be positive")
    out: list[int] = []
    h = parent & _M
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        x = h ^ _K3
        for t in token_ids[start : start + block_size]:
            if not isinstance(t, int):
                raise TypeError("token_ids must hold ints")
            x ^= ((t & _M) * _K2) & _M
            x = ((((x << 31) | (x >> 33)) & _M) * _K1) & _M
        h = _fmix64(x ^ block_size)
        out.append(h)
    return out


try:
    from indexer._chash import chain_hashes as _c_chain_hashes
    from indexer._chash import chain_hashes_json, json_array_span
except ImportError:  # pragma: no cover - exercised only where no compiler was available
    _c_chain_hashes = None
    #: ``chain_hashes_json(json_array_bytes, block_size, parent) -> (hashes, n_tokens) | None``:
    #: hashes a JSON token array without one Python int per token; None where not built.
    chain_hashes_json = None
    #: ``json_array_span(json_object_bytes, key) -> (start, end) | None``: where the top-level
    #: ``key``'s array sits in a JSON object, so it can be hashed in place; None where not built.
    json_array_span = None

#: ``chain_hashes(token_ids, block_size, parent) -> list[int]``, C when built, else Python.
chain_hashes = _c_chain_hashes if _c_chain_hashes is not None else py_chain_hashes
HAVE_C_HASH = _c_chain_hashes is not None


@lru_cache(maxsize=4096)
def namespace_seed(model: str = "", lora_name: str | None = None) -> int:
    """Root seed ``h_{-1}`` for a namespace: blocks of different models or adapters never match."""
    key = f"{model}\x00{lora_name or ''}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little")
