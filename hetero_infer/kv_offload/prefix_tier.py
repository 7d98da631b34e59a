"""The host tier of the prefix cache: evicted blocks go to the host first and come back by copy."""

from __future__ import annotations
from collections import OrderedDict
from dataclasses import dataclass
from .host_pool import HostBlockPool


@dataclass
class HostTierStats:
    "Counters of one `HostPrefixCache`."

    offloaded: int = 0  # device blocks evicted and copied to the host tier
    hits: int = 0  # host blocks found by a lookup (a reload each)
    evictions: int = 0  # host blocks evicted (LRU) for a newer offload
    dropped: int = 0  # evicted device blocks not kept: every host block was pinned


class HostPrefixCache:
    "The host tier of the prefix cache: chained block hash -> host block, least recent first."

    def __init__(self, pool: HostBlockPool):
        self.pool = pool
        self.entries: OrderedDict[bytes, int] = OrderedDict()  # hash -> host block, LRU first
        self.tokens: dict[int, tuple] = {}  # host block -> the tokens whose KV it holds
        self.pins: dict[int, int] = {}  # host block -> copies of this step that use it
        self.stats = HostTierStats()

    def __repr__(self):
        n = self.pool.num_blocks
        return f"HostPrefixCache({len(self.entries)} of {n} blocks, {self.stats})"

    def lookup(self, h: bytes, tokens: tuple) -> int | None:
        "The host block holding hash `h` (tokens checked), now most recently used, or None."
        b = self.entries.get(h)
        if b is None or self.tokens[b] != tokens:
            return None
        self.entries.move_to_end(h)
        self.stats.hits += 1
        return b

    def pin(self, b: int):
        self.pins[b] = self.pins.get(b, 0) + 1

    def unpin(self, b: int):
        self.pins[b] -= 1
        if not self.pins[b]:
            del self.pins[b]

    def put(self, h: bytes, tokens: tuple) -> int | None:
        """A pinned host block for evicted block `h` (to copy into this step), or None: already
        here, or every host block pinned."""
        if h in self.entries:
            self.entries.move_to_end(h)
            return None
        if self.pool.num_free():
            b = self.pool.alloc(1)[0]
        else:
            old = next((k for k, b in self.entries.items() if b not in self.pins), None)
            if old is None:
                self.stats.dropped += 1
                return None
            b = self.entries.pop(old)
            self.stats.evictions += 1
        self.entries[h], self.tokens[b] = b, tokens
        self.pin(b)
        self.stats.offloaded += 1
        return b

    def drop(self, ids):
        "Forget host blocks `ids` (their copy failed): unpinned and back to the free list."
        ids = set(ids)
        for h in [h for h, b in self.entries.items() if b in ids]:
            del self.tokens[self.entries.pop(h)]
        for b in ids:
            self.pins.pop(b, None)
        self.pool.free(sorted(ids))
