"""Router-side block hashing: the chained 64-bit hash both the index and incoming requests use.

Engine block hashes differ per engine, release and configuration, so the router never reproduces
them. It hashes the token ids that every ``BlockStored`` carries with its own function, and hashes
requests with the same function, so both sides agree by construction (docs/architecture.md §3).

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
from typing import Any

import msgspec

__all__ = [
    "HASH_VERSION",
    "chain_hashes",
    "chain_hashes_extra",
    "chain_hashes_json",
    "extra_seed",
    "namespace_keys",
    "namespace_seed",
    "py_chain_hashes",
    "request_seed",
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
    from indexer._chash import chain_hashes_json
except ImportError:  # pragma: no cover - exercised only where no compiler was available
    _c_chain_hashes = None
    #: ``chain_hashes_json(json_array_bytes, block_size, parent) -> (hashes, n_tokens) | None``:
    #: hashes a JSON token array without one Python int per token; None where not built.
    chain_hashes_json = None

#: ``chain_hashes(token_ids, block_size, parent) -> list[int]``, C when built, else Python.
chain_hashes = _c_chain_hashes if _c_chain_hashes is not None else py_chain_hashes
HAVE_C_HASH = _c_chain_hashes is not None


@lru_cache(maxsize=4096)
def namespace_seed(model: str = "", lora_name: str | None = None) -> int:
    """Root seed ``h_{-1}`` for a namespace: blocks of different models or adapters never match."""
    key = f"{model}\x00{lora_name or ''}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little")


# ---------------------------------------------------------------- extra keys (salts, mm, LoRA)
#
# An engine hashes a block with *extra keys* besides its tokens: the LoRA adapter, multimodal
# input hashes, and (vLLM) the request's ``cache_salt`` — the salt on the first block only, later
# blocks inherit it through the chain. The router mirrors that: a block whose extra keys are not
# empty starts from ``extra_seed(parent, keys)`` instead of ``parent``, so its router hash and all
# its descendants' live in another namespace. The LoRA key is dropped first (the namespace seed
# already carries the adapter). A request reproduces the salt (``request_seed``); it cannot
# reproduce multimodal hashes, so such blocks never match a text request, which is the truth.

_ENC = msgspec.msgpack.Encoder()


def extra_seed(parent: int, keys: Sequence[Any]) -> int:
    """The chain state a block with extra hash ``keys`` continues from, instead of ``parent``."""
    digest = hashlib.blake2b(_ENC.encode(list(keys)), digest_size=8).digest()
    return _fmix64((parent ^ int.from_bytes(digest, "little")) & _M)


def namespace_keys(
    keys: Any, lora_name: str | None = None, lora_id: int | None = None
) -> list[Any] | None:
    """One block's extra keys as they separate namespaces: without the leading LoRA key (the
    namespace seed has it); None when nothing is left."""
    if not keys:
        return None
    if not isinstance(keys, (list, tuple)):
        keys = [keys]
    out = list(keys)
    if out and (lora_name is not None or lora_id is not None) and out[0] in (lora_name, lora_id):
        out = out[1:]
    return out or None


def chain_hashes_extra(
    token_ids: Sequence[int], block_size: int, parent: int, extras: Sequence[Any]
) -> list[int]:
    """``chain_hashes`` where block ``i`` with namespace keys ``extras[i]`` (see
    ``namespace_keys``) continues from ``extra_seed(h_{i-1}, extras[i])``."""
    out: list[int] = []
    h = parent
    for i in range(len(token_ids) // block_size):
        k = extras[i] if i < len(extras) else None
        if k:
            h = extra_seed(h, k)
        h = chain_hashes(token_ids[i * block_size : (i + 1) * block_size], block_size, h)[0]
        out.append(h)
    return out


@lru_cache(maxsize=4096)
def request_seed(
    model: str = "", lora_name: str | None = None, cache_salt: str | None = None
) -> int:
    """The chain state a request's first block hashes from: its namespace, salted as vLLM
    salts the first block when the request carries a non-empty ``cache_salt``."""
    seed = namespace_seed(model, lora_name)
    return extra_seed(seed, [cache_salt]) if cache_salt else seed
