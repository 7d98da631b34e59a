"""The block manager over a host tier: offload on eviction, reload on a host hit, restore a swap."""

from __future__ import annotations
from ..core.sequence import Sequence
from ..kv_cache.block_manager import BlockManager, NoFreeBlocksError
from .prefix_tier import HostPrefixCache


class TieredBlockManager(BlockManager):
    """A `BlockManager` over a host tier: a cached block it evicts is offloaded to the host first; a
    prefix that misses on the device but hits on the host is reloaded by copy instead of computed;
    swapped-out sequences get device blocks again (`restore`)."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        host: HostPrefixCache | None = None,  # the host prefix tier; None: offload nothing
    ):
        super().__init__(num_blocks, block_size, enable_prefix_caching)
        self.host = host
        self.offloads: list[tuple[int, int]] = []  # (device, host): evicted blocks to copy out
        self.reloads: list[tuple[int, int]] = []  # (host, device): prefix blocks to copy back
        self.reloaded: list[Sequence] = []  # sequences whose prefix those reloads bring back
        self.reload_names: dict[int, tuple] = {}  # reloading device block -> (hash, tokens)

    def take(self) -> int:
        "A block as `BlockManager.take` gives it; a cached block it evicts goes to the host first."
        if not self.free_ids and self.host is not None:
            b = next(iter(self.cache.evictable))
            h = self.host.put(self.blocks[b].hash, self.blocks[b].token_ids)
            if h is not None:
                self.offloads.append((b, h))
        return super().take()

    def allocate(self, seq: Sequence):
        """Blocks as `BlockManager.allocate` gives them; full blocks after the device hits that hit
        on the host are reloaded by copy before the step (their tokens count as computed)."""
        k, bs = len(self.cache.hits(seq)), self.block_size
        fits = not (seq.block_table or seq.seq_id in self.seqs) and self.can_allocate(seq)
        host = self._host_hits(seq, k) if fits and self.host is not None else []
        super().allocate(seq)  # (refuses, naming why, what does not fit)
        for i, h in enumerate(host, k):
            b = seq.block_table[i]
            self.reloads.append((h, b))
            self.reload_names[b] = (
                seq.block_hashes[i],
                tuple(seq.token_ids[i * bs : (i + 1) * bs]),
            )
        if host:
            self.reloaded.append(seq)
            seq.num_computed_tokens = seq.num_cached_tokens = (k + len(host)) * bs
            self.stats.cached_tokens += len(host) * bs

    def _host_hits(self, seq: Sequence, first: int) -> list[int]:
        "Host blocks that continue `seq`'s device hits `first..`, pinned until the step's copies."
        bs, toks, hits = self.block_size, seq.token_ids, []
        for i in range(first, (len(toks) - 1) // bs):
            b = self.host.lookup(seq.block_hashes[i], tuple(toks[i * bs : (i + 1) * bs]))
            if b is None:
                break
            self.host.pin(b)
            hits.append(b)
        return hits

    def take_transfers(self) -> tuple[list, list, list]:
        "The (device, host) offloads, (host, device) reloads and reloading sequences so far."
        out = self.offloads, self.reloads, self.reloaded
        self.offloads, self.reloads, self.reloaded = [], [], []
        return out

    def transfers_done(self, offloads: list, reloads: list, ok: bool = True):
        """The step's host copies ran (`ok`): reloaded blocks become device prefix-cache hits; or
        they failed: the offloaded host blocks are dropped (the reloading sequences recompute)."""
        if self.host is None:
            return
        if ok:
            for _, h in offloads:
                self.host.unpin(h)
        else:
            self.host.drop([h for _, h in offloads])
        for h, b in reloads:
            if h in self.host.pins:  # (a dropped block is unpinned already)
                self.host.unpin(h)
            hash_, toks = self.reload_names.pop(b)
            blk = self.blocks[b]
            if ok and blk.ref_count and blk.hash is None and hash_ not in self.cache.cached:
                blk.hash, blk.token_ids, self.cache.cached[hash_] = hash_, toks, b

    def restore_needed(self, seqs: list[Sequence], tables: list[list[int]]) -> int:
        "Device blocks `restore` takes: one per distinct host block, plus each sequence's rest."
        bs = self.block_size
        rest = sum(-(-len(s.token_ids) // bs) - len(t) for s, t in zip(seqs, tables))
        return len({h for t in tables for h in t}) + rest

    def restore(self, seqs: list[Sequence], tables: list[list[int]]) -> list[tuple[int, int]]:
        """Device blocks for swapped-out `seqs` whose computed KV is in host blocks `tables`
        (shared where they shared): the (host, device) copies to do, each host block once."""
        need = self.restore_needed(seqs, tables)
        if need > self.num_free_blocks():
            raise NoFreeBlocksError(
                f"{need} blocks needed to swap in, {self.num_free_blocks()} free"
            )
        dev = {h: self.take() for h in dict.fromkeys(h for t in tables for h in t)}
        for b in dev.values():
            self.blocks[b].ref_count = 0
        for s, t in zip(seqs, tables):
            for h in t:
                self.blocks[dev[h]].ref_count += 1
            n = -(-len(s.token_ids) // self.block_size) - len(t)
            s.block_table = [dev[h] for h in t] + [self.take() for _ in range(n)]
            self.seqs[s.seq_id] = s
        return list(dev.items())
