"""Paged KV-cache bookkeeping: blocks, the free queue, prefix hashes, per-request tables."""

from octavo.kv_cache.block_pool import BlockPool, KVCacheBlock
from octavo.kv_cache.hashing import BlockHash, block_hasher, hash_block_tokens
from octavo.kv_cache.manager import KVCacheManager, PrefixCacheStats

__all__ = [
    "BlockHash",
    "BlockPool",
    "KVCacheBlock",
    "KVCacheManager",
    "PrefixCacheStats",
    "block_hasher",
    "hash_block_tokens",
]
