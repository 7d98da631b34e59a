"""The paged KV-cache block manager: block pool, block tables, copy-on-write, prefix caching."""

from __future__ import annotations
from collections import deque
from dataclasses import dataclass
from ..core.sequence import Sequence
from .prefix_cache import PrefixCache


class NoFreeBlocksError(RuntimeError):
    "The pool has too few free blocks for the request; nothing was changed."


@dataclass
class Block:
    "One physical KV-cache block."

    block_id: int
    ref_count: int = 0  # block tables holding it
    hash: bytes | None = None  # its chained hash while it is in the prefix cache
    token_ids: tuple = ()  # the tokens whose KV it holds, kept while cached


@dataclass
class BlockStats:
    "Counters of one `BlockManager`."

    allocations: int = 0  # successful allocate() calls
    blocks_allocated: int = 0  # blocks taken from the pool (free list or eviction)
    cache_queries: int = 0  # full blocks looked up in the prefix cache at allocate()
    cache_hits: int = 0  # of those, found
    cached_tokens: int = 0  # tokens served from the prefix cache
    evictions: int = 0  # cached blocks evicted (LRU) to make room
    cow_copies: int = 0  # blocks copied on write

    @property
    def hit_rate(self) -> float:
        return self.cache_hits / max(self.cache_queries, 1)


class BlockPool:
    """Physical blocks and their reference counts: a free list, the prefix cache's blocks no table
    holds, and sources of copies not yet committed, kept from reuse."""

    def __init__(
        self,
        num_blocks: int,  # physical blocks in the pool
        block_size: int,  # tokens per block
        enable_prefix_caching: bool = True,  # share full blocks of identical prefixes
    ):
        if not (isinstance(num_blocks, int) and num_blocks >= 1):
            raise ValueError(f"num_blocks must be an integer >= 1, got {num_blocks!r}")
        if not (isinstance(block_size, int) and block_size >= 1):
            raise ValueError(f"block_size must be an integer >= 1, got {block_size!r}")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_ids: deque[int] = deque(range(num_blocks))  # ref 0 and not cached
        self.cache = PrefixCache(self.blocks, block_size, enable_prefix_caching)
        # seq_id -> its (src, dst) copies not yet committed
        self.cow_pending: dict[int, list[tuple[int, int]]] = {}
        self.pins: dict[int, int] = {}  # block -> uncommitted copies reading it
        self.stats = BlockStats()

    def num_free_blocks(self) -> int:
        "Blocks that can be handed out: free ones plus cached ones no table holds."
        return len(self.free_ids) + len(self.cache.evictable)

    def usage(self) -> float:
        "Share of the pool held by sequences."
        return 1 - self.num_free_blocks() / self.num_blocks

    def take(self) -> int:
        "A block with ref count 1: from the free list, else the least recently used cached one."
        if self.free_ids:
            b = self.free_ids.popleft()
        else:
            b = self.cache.evict()
            self.stats.evictions += 1
        self.blocks[b].ref_count = 1
        self.stats.blocks_allocated += 1
        return b

    def hold(self, b: int):
        "One more table holds block `b` (a cached block no table held leaves the LRU order)."
        if not self.blocks[b].ref_count:
            del self.cache.evictable[b]
        self.blocks[b].ref_count += 1

    def release(self, b: int):
        "One table fewer holds block `b`; held by none and not pinned, it goes back to the pool."
        blk = self.blocks[b]
        blk.ref_count -= 1
        if not blk.ref_count and b not in self.pins:
            self._to_pool(b)

    def _to_pool(self, b: int):
        "Block `b`, held by no one: evictable if cached, else free."
        if self.blocks[b].hash is None:
            self.free_ids.append(b)
        else:
            self.cache.evictable[b] = None

    def copy_on_write(self, seq_id: int, src: int) -> int:
        "A fresh block for `seq_id` to copy shared `src` into; `src` stays pinned until it commits."
        dst = self.take()
        self.pins[src] = self.pins.get(src, 0) + 1
        self.release(src)
        self.cow_pending.setdefault(seq_id, []).append((src, dst))
        self.stats.cow_copies += 1
        return dst

    def drop_copies(self, seq_id: int):
        "Forget `seq_id`'s uncommitted copies; a source no one holds goes back to the pool."
        for src, _ in self.cow_pending.pop(seq_id, ()):
            self.pins[src] -= 1
            if self.pins[src]:
                continue
            del self.pins[src]
            if not self.blocks[src].ref_count:
                self._to_pool(src)


class BlockAllocator(BlockPool):
    """Block tables: a sequence's blocks at admission (its longest cached prefix reused), shared
    with a fork, lent to a sibling, given back when it leaves."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        super().__init__(num_blocks, block_size, enable_prefix_caching)
        self.seqs: dict[int, Sequence] = {}  # seq_id -> sequence holding blocks
        self.lent: dict[int, int] = {}  # seq_id -> leading blocks lent by a sibling, not joined

    def blocks_needed(self, seq: Sequence) -> int:
        "How far `allocate(seq)` lowers `num_free_blocks()`: new blocks plus revived cached ones."
        ids = self.cache.hits(seq)
        n_new = -(-len(seq.token_ids) // self.block_size) - len(ids)
        return n_new + sum(self.blocks[b].ref_count == 0 for b in ids)

    def can_allocate(self, seq: Sequence) -> bool:
        "Whether `allocate(seq)` would find the blocks it needs."
        return self.blocks_needed(seq) <= self.num_free_blocks()

    def allocate(self, seq: Sequence):
        "Blocks for all of `seq`'s tokens, reusing its longest cached prefix (as computed tokens)."
        self._check_empty(seq)
        ids = self.cache.hits(seq)
        n_new = -(-len(seq.token_ids) // self.block_size) - len(ids)
        need = n_new + sum(self.blocks[b].ref_count == 0 for b in ids)
        if need > self.num_free_blocks():
            raise NoFreeBlocksError(
                f"sequence {seq.seq_id} needs {need} blocks ({n_new} new), "
                f"{self.num_free_blocks()} free"
            )
        for b in ids:
            self.hold(b)
        seq.block_table = ids + [self.take() for _ in range(n_new)]
        seq.num_computed_tokens = seq.num_cached_tokens = len(ids) * self.block_size
        self.seqs[seq.seq_id] = seq
        s = self.stats
        s.allocations += 1
        s.cache_hits += len(ids)
        s.cached_tokens += seq.num_cached_tokens
        s.cache_queries += (len(seq.token_ids) - 1) // self.block_size if self.cache.enabled else 0

    def _check_empty(self, seq: Sequence):
        if seq.block_table or seq.seq_id in self.seqs:
            raise ValueError(f"sequence {seq.seq_id} already holds blocks")

    def free(self, seq: Sequence):
        "Release `seq`'s blocks, last first, so LRU eviction takes prefix tails before heads."
        if self.seqs.pop(seq.seq_id, None) is None:
            raise KeyError(f"sequence {seq.seq_id} holds no blocks (unknown or already freed)")
        self.drop_copies(seq.seq_id)
        k = self.lent.pop(seq.seq_id, 0)  # lent blocks are not its to release
        for b in reversed(seq.block_table[k:]):
            self.release(b)
        seq.block_table = []

    def fork(self, parent: Sequence, child: Sequence):
        "`child` shares all of `parent`'s blocks (ref counts + 1); a writer copies a shared one."
        if parent.seq_id not in self.seqs:
            raise KeyError(f"sequence {parent.seq_id} holds no blocks; cannot fork it")
        if parent.seq_id in self.cow_pending:
            msg = "has copies not yet committed; commit its step before forking it"
            raise ValueError(f"sequence {parent.seq_id} {msg}")
        self._check_empty(child)
        for b in parent.block_table:
            self.hold(b)
        child.block_table, child.block_hashes = list(parent.block_table), list(parent.block_hashes)
        self.seqs[child.seq_id] = child

    def allocate_sibling(
        self,
        seq: Sequence,  # a sequence with an empty block table
        leader: Sequence,  # an allocated sequence with the same first `k` blocks of tokens
        k: int,  # leading blocks to share, once the leader has computed them
    ):
        "Fresh blocks for `seq` after its first `k`, `leader`'s until `join_sibling`."
        self._check_empty(seq)
        bs = self.block_size
        fits = 0 <= k <= min(len(leader.block_table), (len(seq.token_ids) - 1) // bs)
        if not fits or seq.token_ids[: k * bs] != leader.token_ids[: k * bs]:
            raise ValueError(
                f"k must count leading full blocks sequences {seq.seq_id} and {leader.seq_id} "
                f"share, got {k}"
            )
        n_new = -(-len(seq.token_ids) // bs) - k
        if n_new > self.num_free_blocks():
            raise NoFreeBlocksError(
                f"sequence {seq.seq_id} needs {n_new} blocks, {self.num_free_blocks()} free"
            )
        seq.block_table = leader.block_table[:k] + [self.take() for _ in range(n_new)]
        seq.num_computed_tokens = seq.num_cached_tokens = 0
        self.seqs[seq.seq_id], self.lent[seq.seq_id] = seq, k
        self.stats.allocations += 1

    def join_sibling(self, seq: Sequence):
        "The leader has computed the lent blocks: `seq` takes references to them and goes on after."
        k = self.lent.pop(seq.seq_id)
        for b in seq.block_table[:k]:
            self.hold(b)
        seq.num_computed_tokens = k * self.block_size


class BlockManager(BlockAllocator):
    """Where each step's tokens go: cache slots (copy-on-write when a block is shared), and the
    commit that advances a sequence and publishes its full blocks once the step ran."""

    def _blocks_to_take(self, seq: Sequence, n: int) -> int:
        "Blocks `append_slots(seq, n)` takes from the pool: new tail blocks plus copy-on-write."
        c, t, bs = seq.num_computed_tokens, seq.block_table, self.block_size
        if n < 1 or c + n > len(seq.token_ids):
            raise ValueError(
                f"n must be in [1, {len(seq.token_ids) - c}] for sequence {seq.seq_id}, got {n}"
            )
        last = (c + n - 1) // bs
        need = max(last + 1 - len(t), 0)
        for i in range(c // bs, min(last + 1, len(t))):  # a shared block we write is copied first
            need += self.blocks[t[i]].ref_count > 1
        return need

    def can_append(self, seq: Sequence, n: int = 1) -> bool:
        "Whether `append_slots(seq, n)` would find the blocks it needs."
        return self._blocks_to_take(seq, n) <= self.num_free_blocks()

    def append_slots(self, seq: Sequence, n: int = 1) -> tuple[list[int], list[tuple[int, int]]]:
        "Slots of positions [computed, computed + n) and the (src, dst) copies to do first."
        if seq.seq_id not in self.seqs:
            raise KeyError(f"sequence {seq.seq_id} holds no blocks; allocate it first")
        need = self._blocks_to_take(seq, n)
        bs, c, t = self.block_size, seq.num_computed_tokens, seq.block_table
        if need > self.num_free_blocks():
            raise NoFreeBlocksError(
                f"sequence {seq.seq_id} needs {need} blocks to append {n} tokens, "
                f"{self.num_free_blocks()} free"
            )
        last = (c + n - 1) // bs
        for i in range(c // bs, min(last + 1, len(t))):
            if self.blocks[t[i]].ref_count > 1:  # shared: write into a private copy
                t[i] = self.copy_on_write(seq.seq_id, t[i])
        while len(t) <= last:
            t.append(self.take())
        copies = list(self.cow_pending.get(seq.seq_id, ()))  # a retried step copies again
        if n == 1:
            return [t[c // bs] * bs + c % bs], copies
        return [t[p // bs] * bs + p % bs for p in range(c, c + n)], copies

    def commit(self, seq: Sequence, n: int):
        "The step computing [computed, computed + n) of `seq` is done: advance, publish blocks."
        c, bs = seq.num_computed_tokens, self.block_size
        if seq.seq_id not in self.seqs:
            raise KeyError(f"sequence {seq.seq_id} holds no blocks (unknown or already freed)")
        if n < 1 or c + n > len(seq.token_ids) or (c + n - 1) // bs >= len(seq.block_table):
            raise ValueError(
                f"n must be in [1, {len(seq.token_ids) - c}] and have slots (append_slots) "
                f"for sequence {seq.seq_id}, got {n}"
            )
        seq.num_computed_tokens = c + n
        self.drop_copies(seq.seq_id)  # its copies are done: their sources may be reused
        if self.cache.enabled and (c + n) // bs > c // bs:
            self.cache.publish(seq, c // bs, (c + n) // bs)

    def append_decode_slots(self, seqs: list[Sequence]) -> tuple[list[int], list[tuple[int, int]]]:
        "`append_slots(seq, 1)` for each sequence, all or none: slots in `seqs` order, copies."
        bs, blocks, pending, slots, slow = self.block_size, self.blocks, self.cow_pending, [], []
        for j, s in enumerate(seqs):  # fast path: the next slot is in a block it owns alone
            c, t = s.num_computed_tokens, s.block_table
            i = c // bs
            if i < len(t) and c < len(s.token_ids) and blocks[t[i]].ref_count == 1:
                if not (pending and s.seq_id in pending):
                    slots.append(t[i] * bs + c % bs)
                    continue
            slots.append(-1)
            slow.append(j)
        copies = []
        if slow:  # a new block or a copy-on-write: check the whole batch first
            for j in slow:
                if seqs[j].seq_id not in self.seqs:
                    raise KeyError(f"sequence {seqs[j].seq_id} holds no blocks; allocate it first")
            need = sum(self._blocks_to_take(seqs[j], 1) for j in slow)
            if need > self.num_free_blocks():
                raise NoFreeBlocksError(
                    f"{len(slow)} decodes need {need} blocks, {self.num_free_blocks()} free"
                )
        for j in slow:
            s = seqs[j]
            if s.num_computed_tokens // bs == len(s.block_table) and bs > 1:  # a new block
                s.block_table.append(self.take())
                slots[j] = s.block_table[-1] * bs
            else:
                sl, cp = self.append_slots(s, 1)
                slots[j], copies = sl[0], copies + cp
        return slots, copies

    def commit_decodes(self, seqs: list[Sequence]):
        "`commit(seq, 1)` for each sequence of a decode batch (no argument checks: a fast path)."
        bs, pending, caching = self.block_size, self.cow_pending, self.cache.enabled
        for s in seqs:
            c = s.num_computed_tokens = s.num_computed_tokens + 1
            if pending and s.seq_id in pending:
                self.drop_copies(s.seq_id)
            if caching and c % bs == 0:
                self.cache.publish(s, c // bs - 1, c // bs)
