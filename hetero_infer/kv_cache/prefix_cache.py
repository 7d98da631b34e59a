"""The prefix cache: full KV blocks named by the chained hash of their tokens, reused LRU."""

from __future__ import annotations
import hashlib
from array import array
from collections import OrderedDict
from ..core.sequence import Sequence


def hash_block(
    parent: bytes,  # the previous block's hash, b"" for a sequence's first block
    token_ids,  # the block's token ids
) -> bytes:
    "Chained sha256 of one full block: it names the whole prefix up to and including this block."
    return hashlib.sha256(parent + array("q", token_ids).tobytes()).digest()


class PrefixCache:
    """Full blocks named by the chained hash of their tokens; those no table holds wait, least
    recently used first, to be found again or evicted."""

    def __init__(
        self,
        blocks: list,  # the pool's `Block`s: their `hash` and `token_ids` are written here
        block_size: int,  # tokens per block
        enabled: bool = True,  # False: nothing is named, so nothing is found
    ):
        self.blocks, self.block_size, self.enabled = blocks, block_size, enabled
        self.cached: dict[bytes, int] = {}  # hash -> block id
        # cached blocks no table holds, least recently used first
        self.evictable: OrderedDict[int, None] = OrderedDict()

    def hashes(self, seq: Sequence, n_full: int) -> list[bytes]:
        "`seq.block_hashes`, extended to its first `n_full` full blocks (a function of the tokens)."
        hashes, bs, toks = seq.block_hashes, self.block_size, seq.token_ids
        del hashes[len(toks) // bs :]  # in case tokens were dropped since
        for i in range(len(hashes), n_full):
            hashes.append(hash_block(hashes[-1] if hashes else b"", toks[i * bs : (i + 1) * bs]))
        return hashes

    def hits(self, seq: Sequence) -> list[int]:
        "Blocks of `seq`'s longest cached prefix of full blocks, never the block of its last token."
        if not self.enabled:
            return []
        bs, toks, ids = self.block_size, seq.token_ids, []
        n = (len(toks) - 1) // bs
        hashes = self.hashes(seq, n)
        for i in range(n):
            b = self.cached.get(hashes[i])
            if b is None or self.blocks[b].token_ids != tuple(toks[i * bs : (i + 1) * bs]):
                break
            ids.append(b)
        return ids

    def publish(self, seq: Sequence, first: int, end: int):
        "Name full blocks `first..end-1` of `seq`, just computed; the first hash committed wins."
        hashes, bs = self.hashes(seq, end), self.block_size
        for i in range(first, end):
            blk = self.blocks[seq.block_table[i]]
            if hashes[i] not in self.cached and blk.hash is None:
                blk.hash, blk.token_ids = hashes[i], tuple(seq.token_ids[i * bs : (i + 1) * bs])
                self.cached[blk.hash] = blk.block_id

    def evict(self) -> int:
        "The least recently used block no table holds, its name forgotten."
        b, _ = self.evictable.popitem(last=False)
        blk = self.blocks[b]
        del self.cached[blk.hash]
        blk.hash, blk.token_ids = None, ()
        return b
