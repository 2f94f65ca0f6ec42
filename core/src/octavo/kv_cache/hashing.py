"""Chained hashes of full KV blocks: the keys of automatic prefix caching.

The hash of block ``i`` covers the hash of block ``i-1``, the block's token ids and extra keys
(the request's LoRA adapter id: the same tokens give other K/V under another adapter), so two requests share block ``i`` only if their whole prefixes up to
and including it are identical. SHA-256 over a fixed binary encoding: no pickle, no Python
``hash()`` (which is salted per process).
"""

from __future__ import annotations

import functools
import hashlib
import struct
from collections.abc import Sequence

from octavo.messages.request import BlockHash, BlockHasher

_NO_PARENT = b"\x00" * 32


def hash_block_tokens(
    parent: BlockHash | None, token_ids: Sequence[int], extra_keys: bytes = b""
) -> BlockHash:
    """Hash of one full block given its parent's hash (``None`` for the first block)."""
    digest = hashlib.sha256()
    digest.update(parent if parent is not None else _NO_PARENT)
    digest.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    digest.update(extra_keys)
    return BlockHash(digest.digest())


def extend_block_hashes(
    block_hashes: list[BlockHash], token_ids: Sequence[int], block_size: int,
    extra_keys: bytes = b"",
) -> int:
    """Append the hashes of every block of ``token_ids`` that became full (in place); returns
    the number of tokens at which the next block becomes full (``Request`` calls it again only
    then)."""
    num_full = len(token_ids) // block_size
    for i in range(len(block_hashes), num_full):
        parent = block_hashes[i - 1] if i > 0 else None
        block_hashes.append(hash_block_tokens(
            parent, token_ids[i * block_size : (i + 1) * block_size], extra_keys))
    return (len(block_hashes) + 1) * block_size


def lora_extra_keys(lora_int_id: int) -> bytes:
    """The extra hash key of a request run with LoRA adapter ``lora_int_id`` (0: none)."""
    return b"" if not lora_int_id else b"lora" + struct.pack("<q", lora_int_id)


def block_hasher(block_size: int, lora_int_id: int = 0) -> BlockHasher:
    """The ``Request.block_hasher`` for blocks of ``block_size`` tokens of a request run with
    LoRA adapter ``lora_int_id`` (0: the base model)."""
    return functools.partial(extend_block_hashes, block_size=block_size,
                             extra_keys=lora_extra_keys(lora_int_id))
