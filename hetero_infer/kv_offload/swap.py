"""Swap preemption: a preempted request's computed KV blocks move to a host pool and back."""

from __future__ import annotations
from ..core.sequence import Sequence
from .block_manager import TieredBlockManager
from .host_pool import HostBlockPool


class SwapSpace:
    "Swapped-out sequences' KV in a host pool: per sequence, the host blocks of its computed KV."

    def __init__(
        self,
        pool: HostBlockPool,  # the host blocks (swap_space GiB)
        block_manager: TieredBlockManager,  # the device pool
    ):
        self.pool, self.block_manager = pool, block_manager
        self.tables: dict[int, list[int]] = {}  # seq_id -> host blocks of its computed tokens
        self.refs: dict[int, int] = {}  # host block -> swapped sequences holding it

    def __repr__(self):
        return f"SwapSpace({len(self.tables)} sequences, {self.pool})"

    def _kept(self, seq: Sequence) -> list[int]:
        "The device blocks holding `seq`'s computed tokens."
        return seq.block_table[: -(-seq.num_computed_tokens // self.block_manager.block_size)]

    def can_swap_out(self, group: list[Sequence]) -> bool:
        "Whether `group` can go to the host: some KV computed and committed, nothing lent, room."
        bm = self.block_manager
        if any(s.seq_id in bm.cow_pending or s.seq_id in bm.lent for s in group):
            return False
        n = len({b for s in group for b in self._kept(s)})
        return 0 < n <= self.pool.num_free()

    def swap_out(self, group: list[Sequence]) -> list[tuple[int, int]]:
        """Host blocks for `group`'s computed KV (a shared block once), device blocks freed: the
        (device, host) copies to run before the device blocks are written again."""
        kept = list(dict.fromkeys(b for s in group for b in self._kept(s)))
        to_host = dict(zip(kept, self.pool.alloc(len(kept))))
        for s in group:
            t = self.tables[s.seq_id] = [to_host[b] for b in self._kept(s)]
            for h in t:
                self.refs[h] = self.refs.get(h, 0) + 1
            self.block_manager.free(s)
        return list(to_host.items())

    def blocks_needed(self, group: list[Sequence]) -> int:
        "Device blocks `swap_in(group)` takes."
        tables = [self.tables[s.seq_id] for s in group]
        return self.block_manager.restore_needed(group, tables)

    def swap_in(self, group: list[Sequence]) -> list[tuple[int, int]]:
        """Device blocks for `group` again (shared where they were): the (host, device) copies to
        run before the step; the host blocks are free for the next step."""
        pairs = self.block_manager.restore(group, [self.tables[s.seq_id] for s in group])
        for s in group:
            self.forget(s)
        return pairs

    def forget(self, seq: Sequence):
        "Drop `seq`'s host copy (swapped in, aborted, or its copy failed); free unshared blocks."
        for h in self.tables.pop(seq.seq_id):
            self.refs[h] -= 1
            if not self.refs[h]:
                del self.refs[h]
                self.pool.free([h])
