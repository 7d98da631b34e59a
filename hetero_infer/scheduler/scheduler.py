"""Continuous batching: which sequences run each step, and how many tokens each."""

from __future__ import annotations
import bisect
from collections import deque
from ..core.config import EngineConfig
from ..core.sequence import Sequence, SequenceStatus
from ..kv_cache.block_manager import BlockManager, NoFreeBlocksError
from .admission import AdmissionControl
from .output import ScheduledSeq, SchedulerOutput, SchedulerStats

_WAITING, _RUNNING = SequenceStatus.WAITING, SequenceStatus.RUNNING


def insert_in_order(queue: list[Sequence], group: list[Sequence]):
    "Put `group` (one request) into `queue`, kept in (priority, arrival_time) order."
    key = (group[0].priority, group[0].arrival_time)
    i = bisect.bisect_right(queue, key, key=lambda s: (s.priority, s.arrival_time))
    queue[i:i] = group


def head_group(waiting: deque[Sequence]) -> list[Sequence]:
    "The waiting sequences of the first request in line (forks of one request wait side by side)."
    rid, group = waiting[0].request_id, [waiting[0]]
    for i in range(1, len(waiting)):
        if waiting[i].request_id != rid:
            break
        group.append(waiting[i])
    return group


def common_blocks(leader: Sequence, seq: Sequence, block_size: int) -> int:
    """Leading full blocks `seq` can share with `leader` (equal tokens; never `seq`'s block holding
    its last token)."""
    bs, a, b = block_size, leader.token_ids, seq.token_ids
    m, k = min(len(a) // bs, (len(b) - 1) // bs), 0
    while k < m and a[k * bs : (k + 1) * bs] == b[k * bs : (k + 1) * bs]:
        k += 1
    return k


class ParkedSiblings:
    """Forks of a readmitted request that share their leader's first blocks and wait (parked) until
    the leader has computed them."""

    def __init__(self, block_manager: BlockManager):
        self.block_manager = block_manager
        self.parked: dict[int, tuple[Sequence, Sequence]] = {}  # seq_id -> (sibling, leader)

    def allocate(self, seq: Sequence, leader: Sequence, k: int) -> bool:
        """Blocks for `seq`: its own (`k` = 0), or `leader`'s first `k` and fresh ones after; True
        when it waits for the leader to compute those `k`."""
        bm = self.block_manager
        if not k:
            bm.allocate(seq)  # prefix-cache hits set num_computed_tokens
            return False
        bm.allocate_sibling(seq, leader, k)
        if leader.num_computed_tokens >= k * bm.block_size:
            bm.join_sibling(seq)
            return False
        self.parked[seq.seq_id] = (seq, leader)
        return True

    def join_ready(self):
        "Siblings whose leader has now computed their common blocks share them and start computing."
        bm = self.block_manager
        for sid, (s, leader) in list(self.parked.items()):
            if leader.num_computed_tokens >= bm.lent[sid] * bm.block_size:
                bm.join_sibling(s)
                del self.parked[sid]

    def forget(self, seq: Sequence) -> list[Sequence]:
        """`seq` leaves: forget it if parked; the siblings parked behind it (it never computed their
        blocks) are unparked, their blocks freed, and returned (to wait again)."""
        self.parked.pop(seq.seq_id, None)
        orphans = [s for s, leader in self.parked.values() if leader is seq]
        for s in orphans:
            del self.parked[s.seq_id]
            self.block_manager.free(s)
            s.status, s.num_computed_tokens, s.num_cached_tokens = _WAITING, 0, 0
        return orphans


class StepBuilder:
    """One step being filled: its output, the token budget left, and the requests already in it.
    Running decodes first, then running prefill chunks, preempting while blocks are short."""

    def __init__(self, scheduler: Scheduler):
        self.scheduler, self.out = scheduler, SchedulerOutput()
        self.budget = scheduler.config.max_num_batched_tokens  # tokens the step can still take
        self.requests: set[str] = set()  # ids of requests with a sequence in the step

    def put(self, seq: Sequence, n: int, slots: list[int], copies: list[tuple[int, int]]):
        "Add `n` tokens of `seq` to the step: their cache slots, and the block copies to do first."
        self.out.scheduled.append(ScheduledSeq(seq, n, slots))
        self.out.block_copies += copies
        self.requests.add(seq.request_id)
        self.budget -= n

    def start(self, seq: Sequence):
        """The first chunk of `seq`, just admitted or resumed, if the budget allows: all of the
        rest of its tokens, or with chunked prefill as many as fit."""
        left = len(seq.token_ids) - seq.num_computed_tokens
        n = min(left, self.budget)
        if n > 0 and (n == left or self.scheduler.config.enable_chunked_prefill):
            self.put(seq, n, *self.scheduler.block_manager.append_slots(seq, n))

    def victim(self) -> Sequence | None:
        """The running sequence to preempt: the last in (priority, arrival) order whose request has
        nothing in this step."""
        for s in reversed(self.scheduler.running):
            if s.request_id not in self.requests:
                return s
        return None

    def reserve(self, seq: Sequence, n: int) -> bool:
        "Slots for `n` tokens of running `seq`; while blocks are short, preempt others (or `seq`)."
        while True:
            try:
                self.put(seq, n, *self.scheduler.block_manager.append_slots(seq, n))
                return True
            except NoFreeBlocksError:
                victim = self.victim()
                if victim is None:  # only requests already in this step hold blocks: `seq` waits
                    return False
                self.scheduler.preempt(victim, self.out)
                if seq.status is not _RUNNING:
                    return False

    def decodes_at_once(self) -> bool:
        """Fast path: one `append_decode_slots` call reserves a slot for every running decode;
        False (nothing done) when they do not all fit."""
        sch = self.scheduler
        seqs = [s for s in sch.running if len(s.token_ids) - s.num_computed_tokens == 1]
        if len(seqs) > min(self.budget, sch.config.max_num_seqs - len(self.out.scheduled)):
            return False
        try:
            slots, copies = sch.block_manager.append_decode_slots(seqs)
        except NoFreeBlocksError:
            return False  # the slow path preempts as needed
        self.out.scheduled += [ScheduledSeq(s, 1, [sl]) for s, sl in zip(seqs, slots)]
        self.out.block_copies += copies
        self.requests.update(s.request_id for s in seqs)
        self.budget -= len(seqs)
        return True

    def running(self, decodes: bool):
        "Schedule the running sequences that decode (`decodes`) or continue a prefill."
        sch = self.scheduler
        if decodes and self.decodes_at_once():
            return
        for seq in list(sch.running):
            if self.budget == 0 or len(self.out.scheduled) >= sch.config.max_num_seqs:
                break
            if seq.status is not _RUNNING or seq.seq_id in sch.siblings.parked:
                continue  # preempted in this pass, or parked
            left = len(seq.token_ids) - seq.num_computed_tokens
            if left < 1 or (left == 1) is not decodes:
                continue
            n = min(left, self.budget)
            if n == left or sch.config.enable_chunked_prefill:
                self.reserve(seq, n)


class RequestQueues:
    """The waiting and running queues, and a sequence's way through them: `add` at the door,
    `finish` or `abort` out, `fork` beside its parent."""

    def __init__(
        self,
        config: EngineConfig,  # limits: max_num_seqs, max_num_batched_tokens, memory_threshold, ...
        block_manager: BlockManager,  # where the KV blocks come from
    ):
        self.config, self.block_manager = config, block_manager
        self.waiting: deque[Sequence] = deque()  # holding no blocks; the front is served first
        self.running: list[Sequence] = []  # holding blocks; in (priority, arrival_time) order
        self.stats = SchedulerStats()
        self.admission = AdmissionControl(config, block_manager)  # refusals, seats, members
        self.siblings = ParkedSiblings(block_manager)  # readmitted forks waiting for their leader

    def __repr__(self):
        n, m, u = len(self.waiting), len(self.running), self.block_manager.usage()
        return f"{type(self).__name__}(waiting={n}, running={m}, kv usage={u:.0%})"

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def num_admitted(self) -> int:
        "Sequences admitted now (running + waiting); a request not forked yet counts its n."
        return len(self.waiting) + len(self.running) + self.admission.seats_held()

    def add(self, seq: Sequence):
        """Queue a new sequence behind those of equal or lower `priority` value; refuse at once one
        that could never fit."""
        err = self.admission.refusal(seq)
        if err:
            self.stats.rejected += 1
            raise ValueError(err)
        self.admission.enter(seq, self.num_admitted())
        seq.status, w = _WAITING, self.waiting
        i = len(w)
        while i and w[i - 1].priority > seq.priority:
            i -= 1
        w.insert(i, seq)

    def finish(self, seq: Sequence, status: SequenceStatus = SequenceStatus.FINISHED_STOPPED):
        "Take a finished sequence out of the batch at once and free its blocks."
        if not status.finished:
            raise ValueError(f"status must be a finished status, got {status}")
        self._dequeue(seq)
        seq.status = status
        self.admission.leave(seq)
        orphans = self.siblings.forget(seq)
        for s in orphans:
            self.running.remove(s)
        self.waiting.extendleft(reversed(orphans))
        if status is SequenceStatus.FINISHED_ABORTED:
            self.stats.aborted += 1
        else:
            self.stats.finished += 1

    def _dequeue(self, seq: Sequence):
        "Take `seq` out of its queue, freeing its blocks."
        if seq.status is _RUNNING:
            self.running.remove(seq)
            self.block_manager.free(seq)
        elif seq.status is _WAITING:
            self.waiting.remove(seq)
        else:
            raise ValueError(f"sequence {seq.seq_id} is already finished ({seq.status.value})")

    def abort(self, request_id: str) -> list[Sequence]:
        "Drop every sequence of `request_id`, freeing its blocks at once; returns them."
        gone = [s for q in (self.running, self.waiting) for s in q if s.request_id == request_id]
        for s in gone:
            self.finish(s, SequenceStatus.FINISHED_ABORTED)
        return gone

    def fork(self, parent: Sequence, child: Sequence):
        """`child` (from `parent.fork`) shares the parent's blocks and joins its queue right behind
        the parent's request."""
        q = self.running if parent.status is _RUNNING else self.waiting
        if parent.status is _RUNNING:
            self.block_manager.fork(parent, child)
        elif parent.status is not _WAITING:
            raise ValueError(f"cannot fork finished sequence {parent.seq_id}")
        child.status, child.num_computed_tokens = parent.status, parent.num_computed_tokens
        i = q.index(parent) + 1
        while i < len(q) and q[i].request_id == parent.request_id:
            i += 1
        q.insert(i, child)
        self.admission.forked(parent.request_id)


class Scheduler(RequestQueues):
    """Continuous batching: which sequences run each step and how many tokens each, under the token
    and memory budgets; `update` commits a step that ran."""

    _last_out: SchedulerOutput | None = None  # the latest schedule() result, until update()

    def preempt(self, victim: Sequence, out: SchedulerOutput):
        """Preempt `victim`'s whole request by recompute: free its blocks, forget its KV, put it at
        the front of the waiting queue (recorded in `out.preempted`)."""
        group = [s for s in self.running if s.request_id == victim.request_id]
        self.running = [s for s in self.running if s.request_id != victim.request_id]
        for s in group:
            self.block_manager.free(s)
            self.siblings.parked.pop(s.seq_id, None)
            s.status, s.num_computed_tokens, s.num_cached_tokens = _WAITING, 0, 0
            s.num_preemptions += 1
        self.waiting.extendleft(reversed(group))
        out.preempted += group
        self.stats.preemptions += len(group)

    def schedule(self) -> SchedulerOutput:
        """Build one step: running decodes, then running prefill chunks, then new requests from the
        waiting queue (none in a step that had to preempt)."""
        step = StepBuilder(self)
        step.running(decodes=True)
        out, nd = step.out, len(step.out.scheduled)
        step.running(decodes=False)
        if not out.preempted:
            self._admit(step)
        rest = out.scheduled[nd:]
        if any(x.num_tokens == 1 for x in rest):  # a 1-token prefill chunk runs as a decode
            ones = [x for x in rest if x.num_tokens == 1]
            out.scheduled[nd:] = ones + [x for x in rest if x.num_tokens > 1]
        out.num_batched_tokens = self.config.max_num_batched_tokens - step.budget
        st, nd = self.stats, out.num_decodes
        st.decode_tokens += nd
        st.prefill_tokens += out.num_batched_tokens - nd
        st.steps += bool(out.scheduled)
        self._last_out = out
        return out

    def _admit(self, step: StepBuilder):
        """Move whole requests from the front of the waiting queue to running while seats, tokens,
        blocks and the memory threshold allow, and start their first chunks."""
        cfg, bm = self.config, self.block_manager
        while self.waiting and step.budget > 0:
            group = head_group(self.waiting)
            head = group[0]
            if not self._seats_for(group, step.out):
                break
            if not cfg.enable_chunked_prefill and len(head.token_ids) > step.budget:
                break
            shares = [0] + [common_blocks(head, s, bm.block_size) for s in group[1:]]
            need = bm.blocks_needed(head) + sum(
                -(-len(s.token_ids) // bm.block_size) - k if k else bm.blocks_needed(s)
                for s, k in zip(group[1:], shares[1:])
            )
            if not self._blocks_for(need):
                break
            for s, k in zip(group, shares):
                self.waiting.popleft()
                s.status = _RUNNING
                if not self.siblings.allocate(s, head, k):
                    step.start(s)
            insert_in_order(self.running, group)
            self.stats.admitted += len(group)

    def _seats_for(self, group: list[Sequence], out: SchedulerOutput) -> bool:
        "Whether `group` (one request, its forks to come counted) fits the seats and the step."
        head, cfg = group[0], self.config
        forks = head.params.n - 1 if len(group) == 1 and head.num_output_tokens == 0 else 0
        return (
            len(self.running) + len(group) + forks <= cfg.max_num_seqs
            and len(out.scheduled) + len(group) <= cfg.max_num_seqs
        )

    def _blocks_for(self, need: int) -> bool:
        "Whether `need` more blocks are free and keep usage under the memory threshold."
        bm, free = self.block_manager, self.block_manager.num_free_blocks()
        limit = self.config.memory_threshold * bm.num_blocks
        return need <= free and not (self.running and bm.num_blocks - free + need > limit)

    def update(self, out: SchedulerOutput):
        """After the forward pass succeeded: commit every scheduled chunk (advance
        `num_computed_tokens`, publish full blocks)."""
        if out is not self._last_out:
            raise ValueError("update(out) takes the output of the latest schedule() call, once")
        self._last_out, bm, nd = None, self.block_manager, out.num_decodes
        bm.commit_decodes([x.seq for x in out.scheduled[:nd] if x.seq.status is _RUNNING])
        for x in out.scheduled[nd:]:
            if x.seq.status is _RUNNING:  # not aborted meanwhile
                bm.commit(x.seq, x.num_tokens)
        if self.siblings.parked:
            self.siblings.join_ready()
