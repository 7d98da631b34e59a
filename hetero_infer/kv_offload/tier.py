"""An engine's host tier: its pools, each step's copies between the tiers, and an audit of both."""

from __future__ import annotations
import contextlib
import time
from dataclasses import dataclass
import torch
from ..core.config import EngineConfig
from .host_pool import HostBlockPool, copy_blocks, host_num_blocks
from .prefix_tier import HostPrefixCache
from .scheduler import HostCopies, TieredScheduler


@dataclass
class TransferStats:
    "Counters of one `KVTier`'s copies."

    steps: int = 0  # steps that copied blocks between the tiers
    blocks_out: int = 0  # blocks copied device -> host (swap-outs and prefix offloads)
    blocks_in: int = 0  # blocks copied host -> device (swap-ins and prefix reloads)
    bytes: int = 0  # bytes moved, both directions
    seconds: float = 0.0  # host time spent issuing (CPU: doing) the copies
    failures: int = 0  # steps whose copies raised (what they touched recomputes)


class KVTier:
    "An engine's host tier: a swap pool, a prefix tier, and each step's copies to and from them."

    def __init__(
        self,
        swap: HostBlockPool | None = None,  # swapped-out blocks (preemption_mode="swap")
        prefix: HostPrefixCache | None = None,  # evicted prefix blocks (kv_offloading_size)
    ):
        self.swap, self.prefix = swap, prefix
        self.stats = TransferStats()
        self.copy = copy_blocks  # (a test swaps in one that raises)
        self._stream = None  # the side stream, made on the first CUDA copy

    def __repr__(self):
        return f"KVTier(swap={self.swap}, prefix={self.prefix and self.prefix.pool})"

    def apply(self, copies: HostCopies, device_caches: list):
        "Run one step's copies: every device -> host copy, then every host -> device copy."
        pre = self.prefix.pool if self.prefix is not None else None
        outs = [(self.swap, copies.swap_out), (pre, copies.offload)]  # (device, host) pairs
        ins = [(self.swap, copies.swap_in), (pre, copies.reload)]  # (host, device) pairs
        if not any(p for _, p in outs + ins):
            return
        t0, moved, cuda = time.perf_counter(), 0, device_caches[0][0].is_cuda
        if cuda:
            self._stream = self._stream or torch.cuda.Stream(device_caches[0][0].device)
            self._stream.wait_stream(torch.cuda.current_stream())  # the last step's KV writes
        with torch.cuda.stream(self._stream) if cuda else contextlib.nullcontext():
            for pool, pairs in outs:
                if pairs:
                    d, h = zip(*pairs)
                    moved += self.copy(device_caches, pool.caches, list(d), list(h), cuda)
            for pool, pairs in ins:
                if pairs:
                    h, d = zip(*pairs)
                    moved += self.copy(pool.caches, device_caches, list(h), list(d), cuda)
        if cuda:
            torch.cuda.current_stream().wait_stream(self._stream)  # the forward pass waits
        s = self.stats
        s.steps += 1
        s.blocks_out += len(copies.swap_out) + len(copies.offload)
        s.blocks_in += len(copies.swap_in) + len(copies.reload)
        s.bytes += moved
        s.seconds += time.perf_counter() - t0


def build_kv_tier(config: EngineConfig, device_caches: list) -> KVTier:
    """The host pools `config` asks for (`preemption_mode`, `swap_space`, `kv_offloading_size`),
    sized in blocks of the runner's cache geometry."""
    per_block = sum(c[0].numel() * c.element_size() for kv in device_caches for c in kv)
    tier = KVTier()
    n = host_num_blocks(config.swap_space, per_block)
    if config.preemption_mode == "swap" and n:
        tier.swap = HostBlockPool(n).attach(device_caches)
    if n := host_num_blocks(config.kv_offloading_size, per_block):
        tier.prefix = HostPrefixCache(HostBlockPool(n).attach(device_caches))
    return tier


def kv_audit(scheduler) -> list[str]:
    "What is wrong with the device pool and the host tiers behind `scheduler` (nothing: `[]`)."
    bm, errs = scheduler.block_manager, []
    refs = [0] * bm.num_blocks
    for s in bm.seqs.values():
        for b in s.block_table[bm.lent.get(s.seq_id, 0) :]:
            refs[b] += 1
    free, evictable = list(bm.free_ids), set(bm.cache.evictable)
    if len(set(free)) != len(free) or set(free) & evictable:
        errs.append("device: a block is twice in the free lists")
    for blk in bm.blocks:
        b = blk.block_id
        where = (b in evictable) + (b in bm.free_ids)
        if blk.ref_count != refs[b]:
            errs.append(f"device: block {b} has ref_count {blk.ref_count}, {refs[b]} tables")
        elif blk.ref_count == 0 and b not in bm.pins and where != 1:
            errs.append(f"device: block {b} is held by no one and free {where} times (lost)")
        if blk.hash is not None and bm.cache.cached.get(blk.hash) != b:
            errs.append(f"device: block {b}'s hash is not cached under it")
    live = {s.seq_id for s in scheduler.running}
    if set(bm.seqs) != live:
        errs.append(f"device: blocks held by {sorted(set(bm.seqs) - live)} (not running)")
    if isinstance(scheduler, TieredScheduler):
        errs += _host_audit(scheduler)
    if not scheduler.has_unfinished() and bm.seqs:
        errs.append("device: an idle scheduler holds blocks")
    return errs


def _host_audit(scheduler: TieredScheduler) -> list[str]:
    "What is wrong with the swap pool and the host prefix tier (nothing: `[]`)."
    bm, swap, host, errs = scheduler.block_manager, scheduler.swap, scheduler.block_manager.host, []
    if swap is not None:
        held, pool = {h for t in swap.tables.values() for h in t}, swap.pool
        if held & set(pool.free_ids) or len(held) + pool.num_free() != pool.num_blocks:
            errs.append("swap: host blocks lost or held twice")
        if set(swap.tables) != {s.seq_id for s in scheduler.swapped}:
            errs.append("swap: host tables do not match the swapped queue")
    if host is not None:
        held, pool = set(host.entries.values()), host.pool
        if held & set(pool.free_ids) or len(held) + pool.num_free() != pool.num_blocks:
            errs.append("prefix tier: host blocks lost or held twice")
        if host.pins or bm.offloads or bm.reloads or bm.reload_names:
            errs.append("prefix tier: copies pinned or pending outside a step")
    c = scheduler.copies
    if c.swap_out or c.swap_in or c.swapped or c.resumed:
        errs.append("swap: copies pending outside a step")
    return errs
