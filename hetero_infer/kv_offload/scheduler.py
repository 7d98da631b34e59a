"""The scheduler over a host tier: swap preemption, a swapped queue, and each step's host copies."""

from __future__ import annotations
from dataclasses import dataclass, field
from ..core.config import EngineConfig
from ..core.sequence import Sequence, SequenceStatus
from ..scheduler.output import SchedulerOutput, SchedulerStats
from ..scheduler.scheduler import Scheduler, StepBuilder, insert_in_order
from .block_manager import TieredBlockManager
from .swap import SwapSpace

_WAITING, _RUNNING = SequenceStatus.WAITING, SequenceStatus.RUNNING
_SWAPPED = SequenceStatus.SWAPPED


@dataclass
class HostCopies:
    "The copies between the tiers one step needs, and the sequences whose KV they move."

    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device, host): swapped KV
    swap_in: list[tuple[int, int]] = field(default_factory=list)  # (host, device): coming back
    offload: list[tuple[int, int]] = field(default_factory=list)  # (device, host): evicted blocks
    reload: list[tuple[int, int]] = field(default_factory=list)  # (host, device): host prefix hits
    swapped: list[Sequence] = field(default_factory=list)  # swapped out this step
    resumed: list[Sequence] = field(default_factory=list)  # whose KV comes from the host


@dataclass
class TierSchedulerStats(SchedulerStats):
    "Counters of one `TieredScheduler`: the scheduler's, and its swaps."

    swapped_out: int = 0  # preempted sequences swapped to host memory
    swapped_in: int = 0  # swapped-out sequences resumed with their KV copied back
    recompute_fallbacks: int = 0  # preemptions that asked for swap but recomputed (no room)


class TieredScheduler(Scheduler):
    """A `Scheduler` over a host tier: a preempted request is swapped out to host memory when there
    is room (a third queue, `swapped`, resumed before `waiting`); each step's copies between the
    tiers wait in `copies` for the engine to run them."""

    def __init__(
        self,
        config: EngineConfig,
        block_manager: TieredBlockManager,
        swap: SwapSpace | None = None,  # where preemption_mode="swap" moves a victim's KV
    ):
        super().__init__(config, block_manager)
        self.swap = swap
        self.swapped: list[Sequence] = []  # swapped out, in (priority, arrival_time) order
        self.stats = TierSchedulerStats()
        self.copies = HostCopies()  # the copies asked for since the last `take_copies`

    def has_unfinished(self) -> bool:
        return super().has_unfinished() or bool(self.swapped)

    def num_admitted(self) -> int:
        return super().num_admitted() + len(self.swapped)

    def preempt(self, victim: Sequence, out: SchedulerOutput):
        "Swap `victim`'s whole request out to host memory when there is room, else recompute it."
        group = [s for s in self.running if s.request_id == victim.request_id]
        if self.swap is None or not self.swap.can_swap_out(group):
            if self.config.preemption_mode == "swap":
                self.stats.recompute_fallbacks += len(group)
            return super().preempt(victim, out)
        self.running = [s for s in self.running if s.request_id != victim.request_id]
        self.copies.swap_out += self.swap.swap_out(group)  # device blocks freed, copied out first
        for s in group:
            s.status = _SWAPPED
            s.num_preemptions += 1
        insert_in_order(self.swapped, group)
        self.copies.swapped += group
        self.stats.preemptions += len(group)
        self.stats.swapped_out += len(group)

    def _admit(self, step: StepBuilder):
        "Swapped requests resume first; new ones join once none is left (none in a swapping step)."
        if self.copies.swapped:
            return
        if self.swapped:
            self._swap_in(step)
        if not self.swapped:
            super()._admit(step)

    def _swap_in(self, step: StepBuilder):
        """Resume swapped requests, front first, while seats, blocks and the memory threshold allow:
        their KV is copied back before the step, and they go on where they stopped."""
        while self.swapped and step.budget > 0:
            group = [s for s in self.swapped if s.request_id == self.swapped[0].request_id]
            if not self._seats_for(group, step.out):
                break
            if not self._blocks_for(self.swap.blocks_needed(group)):
                break
            del self.swapped[: len(group)]
            self.copies.swap_in += self.swap.swap_in(group)
            self.copies.resumed += group
            self.stats.swapped_in += len(group)
            for s in group:
                s.status = _RUNNING
                step.start(s)
            insert_in_order(self.running, group)

    def _dequeue(self, seq: Sequence):
        if seq.status is _SWAPPED:
            self.swapped.remove(seq)
            self.swap.forget(seq)
        else:
            super()._dequeue(seq)

    def abort(self, request_id: str) -> list[Sequence]:
        gone = [s for s in self.swapped if s.request_id == request_id]
        for s in gone:
            self.finish(s, SequenceStatus.FINISHED_ABORTED)
        return super().abort(request_id) + gone

    def take_copies(self) -> HostCopies:
        "The copies asked for so far, the block manager's offloads and reloads included."
        copies, self.copies = self.copies, HostCopies()
        copies.offload, copies.reload, reloaded = self.block_manager.take_transfers()
        copies.resumed += reloaded
        return copies

    def copies_done(self, copies: HostCopies):
        "The copies ran: prefix blocks reloaded by them become device prefix-cache hits."
        self.block_manager.transfers_done(copies.offload, copies.reload)

    def copies_failed(self, copies: HostCopies, out: SchedulerOutput):
        """The copies raised: every sequence they touched recomputes and leaves `out`, the prefix
        blocks they offloaded are dropped; no stale KV is ever read."""
        self.block_manager.transfers_done(copies.offload, copies.reload, ok=False)
        lost = [s for s in copies.swapped if s.status is _SWAPPED]  # their host copy is incomplete
        for s in lost:
            self.swapped.remove(s)
            self.swap.forget(s)
            s.status, s.num_computed_tokens, s.num_cached_tokens = _WAITING, 0, 0
        self.waiting.extendleft(reversed(lost))
        gone = {s.request_id for s in copies.resumed if s.status is _RUNNING}
        for rid in gone:
            super().preempt(next(s for s in self.running if s.request_id == rid), out)
        out.scheduled = [x for x in out.scheduled if x.seq.request_id not in gone]
        out.num_batched_tokens = sum(x.num_tokens for x in out.scheduled)
