"""Property tests of the continuous-batching scheduler: invariants of every step, and whole
simulated workloads."""

import collections
import itertools
import random
import pytest
from hypothesis import given, settings, strategies as st, HealthCheck
from hetero_infer.core.config import EngineConfig
from hetero_infer.core.sampling_params import SamplingParams
from hetero_infer.core.sequence import Sequence, SequenceStatus
from hetero_infer.scheduler.scheduler import Scheduler
from hetero_infer.scheduler.output import ScheduledSeq, SchedulerOutput
from hetero_infer.kv_cache.block_manager import BlockManager

RUNNING, WAITING = SequenceStatus.RUNNING, SequenceStatus.WAITING


def make_sched(num_blocks=64, block_size=4, caching=True, **kw):
    cfg = EngineConfig(
        block_size=block_size, num_blocks=num_blocks, enable_prefix_caching=caching, **kw
    )
    return Scheduler(cfg, BlockManager(num_blocks, block_size, caching))


def check_step(sch: Scheduler, out: SchedulerOutput, live: list):
    """Invariants of one step: each live sequence is in exactly one place, budgets hold, decodes
    come first."""
    cfg, bm = sch.config, sch.block_manager
    ids_w, ids_r = [s.seq_id for s in sch.waiting], [s.seq_id for s in sch.running]
    assert (
        len(set(ids_w)) == len(ids_w)
        and len(set(ids_r)) == len(ids_r)
        and not set(ids_w) & set(ids_r)
    )
    assert sorted(ids_w + ids_r) == sorted(s.seq_id for s in live if not s.finished)
    assert all(
        s.status is WAITING and not s.block_table and s.num_computed_tokens == 0
        for s in sch.waiting
    )
    assert all(s.status is RUNNING and s.block_table for s in sch.running)
    n = [x.num_tokens for x in out.scheduled]
    assert (
        len(n) <= cfg.max_num_seqs
        and sum(n) == out.num_batched_tokens <= cfg.max_num_batched_tokens
    )
    assert all(k >= 1 for k in n) and n == sorted(n, key=lambda k: k > 1)  # decodes (1 token) first
    assert out.num_decodes == sum(k == 1 for k in n)
    assert len({x.seq.seq_id for x in out.scheduled}) == len(n)  # a sequence at most once
    for x in out.scheduled:
        s = x.seq
        assert s.status is RUNNING and s.num_computed_tokens + x.num_tokens <= len(s)
        assert len(x.slot_mapping) == x.num_tokens
        bs = bm.block_size
        assert x.slot_mapping == [
            s.block_table[p // bs] * bs + p % bs
            for p in range(s.num_computed_tokens, s.num_computed_tokens + x.num_tokens)
        ]
    if not cfg.enable_chunked_prefill:
        assert all(x.samples for x in out.scheduled)  # whole prompts only
    where = {}
    for q, name in ((sch.waiting, "w"), (sch.running, "r")):
        for s in q:
            assert where.setdefault(s.request_id, name) == name  # a request's forks stay together
    assert 0 <= bm.usage() <= 1
    members = collections.Counter(
        s.request_id for s in itertools.chain(sch.waiting, sch.running)
    )  # admitted, counted afresh
    assert sch.num_admitted() == sum(
        s.params.n if members[s.request_id] == 1 and s.num_output_tokens == 0 else 1
        for s in itertools.chain(sch.waiting, sch.running)
    )


def prefix_keys(seq):
    "key[p] names token p *and its whole prefix*: what the K/V at position p depends on."
    keys, h = [], 0
    for t in seq.token_ids:
        h = hash((h, t))
        keys.append(h)
    return keys


def run_forward(sch, out, kv, fail=False, copy=True):
    """What the runner does with one step, on a simulated cache `kv` (slot -> key): the block
    copies, every KV write, then each sequence attends its context, which must read back its own
    prefix (prefix hits, forks, siblings included). `fail`: the forward pass raises midway:
    copies done or not (`copy`), the slots left with garbage, nothing read."""
    bs = sch.block_manager.block_size
    for src, dst in out.block_copies if copy or not fail else ():
        for k in range(bs):
            kv[dst * bs + k] = kv.get(src * bs + k)
    for x in out.scheduled:
        keys = prefix_keys(x.seq)
        for p, slot in zip(
            range(x.seq.num_computed_tokens, x.seq.num_computed_tokens + x.num_tokens),
            x.slot_mapping,
        ):
            kv[slot] = "garbage" if fail else keys[p]
    if fail:
        return
    for x in out.scheduled:
        s, keys = x.seq, prefix_keys(x.seq)
        got = [
            kv.get(s.block_table[p // bs] * bs + p % bs)
            for p in range(s.num_computed_tokens + x.num_tokens)
        ]
        assert got == keys[: len(got)], f"sequence {s.seq_id} reads KV that is not its own prefix"


def play(sch: Scheduler, reqs, max_steps=3_000, abort_every=0, rng=None, fail_every=0):
    """Play the engine: schedule -> forward (simulated KV) -> update -> append a token to every
    sampling sequence -> finish at max_tokens. `reqs` is a list of (prompt_len, max_tokens, n,
    priority, arrival_step); `fail_every`: every so many steps the forward pass raises (no
    update; the next schedule retries). Returns (finished, steps, aborted ids, all seqs)."""
    rng = rng or random.Random(0)
    ids, kv = itertools.count(), {}
    live, done, aborted, pending = [], [], set(), sorted(enumerate(reqs), key=lambda r: r[1][4])
    step = 0
    while pending or sch.has_unfinished():
        while pending and pending[0][1][4] <= step:
            i, (plen, mt, n, prio, _) = pending.pop(0)
            seq = Sequence(
                next(ids),
                f"r{i}",
                [rng.randrange(5) for _ in range(plen)],
                plen,
                SamplingParams(n=n, max_tokens=mt),
                priority=prio,
                arrival_time=float(step),
            )
            sch.add(seq)
            live.append(seq)
        waiting_before, had_running = {s.seq_id for s in sch.waiting}, bool(sch.running)
        out = sch.schedule()
        check_step(sch, out, live)
        k = len(out.preempted)
        assert {s.seq_id for s in list(sch.waiting)[:k]} == {
            s.seq_id for s in out.preempted
        }  # preempted go to the front
        admitted = [s for s in sch.running if s.seq_id in waiting_before]
        if admitted:
            assert not out.preempted  # no admission in a step that preempted
        if admitted and had_running:  # the memory threshold holds admission
            bm = sch.block_manager
            assert (
                bm.num_blocks - bm.num_free_blocks() <= sch.config.memory_threshold * bm.num_blocks
            )
        sampling = [x.seq for x in out.scheduled if x.samples]
        if fail_every and step % fail_every == fail_every - 1 and out.scheduled:
            run_forward(sch, out, kv, fail=True, copy=rng.random() < 0.5)
            step += 1
            continue
        run_forward(sch, out, kv)
        sch.update(out)
        for s in sampling:
            if (
                s.num_output_tokens == 0 and s.params.n > 1 and s.index == 0
            ):  # n > 1: fork at the first token
                for k in range(1, s.params.n):
                    c = s.fork(next(ids), k)
                    sch.fork(s, c)
                    live.append(c)
                    c.append_token(rng.randrange(5))
                    if c.num_output_tokens == c.params.max_tokens:
                        sch.finish(c, SequenceStatus.FINISHED_LENGTH)
                        done.append(c)
            s.append_token(rng.randrange(5))
            if s.num_output_tokens == s.params.max_tokens:
                sch.finish(s, SequenceStatus.FINISHED_LENGTH)
                done.append(s)
        if abort_every and step % abort_every == abort_every - 1 and live:
            victim = rng.choice(live)
            if not victim.finished:
                aborted.add(victim.request_id)
                sch.abort(victim.request_id)
        step += 1
        assert step < max_steps, f"no progress: {sch}"
    return done, step, aborted, live


def max_blocks(prompt, max_tokens, n, bs):
    """The most blocks a request holds: the prompt's full blocks once (shared by its forks) plus
    each fork's own."""
    shared = prompt // bs if n > 1 else 0
    return shared + n * (-(-(prompt + max_tokens - 1) // bs) - shared)


req = st.tuples(
    st.integers(1, 40),
    st.integers(1, 12),
    st.sampled_from([1, 1, 1, 2, 3]),
    st.integers(0, 2),
    st.integers(0, 30),
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    reqs=st.lists(req, min_size=1, max_size=12),
    num_blocks=st.integers(10, 80),
    block_size=st.sampled_from([1, 2, 4, 8]),
    max_num_seqs=st.integers(1, 8),
    max_tokens=st.integers(1, 64),
    chunked=st.booleans(),
    caching=st.booleans(),
    threshold=st.sampled_from([0.5, 0.9, 1.0]),
    fail_every=st.sampled_from([0, 0, 3, 7]),
)
def test_workload_finishes_with_exact_lengths(
    reqs, num_blocks, block_size, max_num_seqs, max_tokens, chunked, caching, threshold, fail_every
):
    """Every request ends with exactly max_tokens outputs per completion, whatever the limits and
    however many forward passes fail; each step keeps the invariants and every sequence reads
    only its own prefix's KV (no poisoned prefix-cache hit)."""
    if not chunked:
        max_tokens = max(
            max_tokens, 64
        )  # without chunking a whole (recomputed) sequence must fit one step
    sch = make_sched(
        num_blocks,
        block_size,
        caching,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_tokens,
        enable_chunked_prefill=chunked,
        memory_threshold=threshold,
    )
    ok = [
        r
        for r in reqs
        if max_blocks(r[0], r[1], r[2], block_size) <= num_blocks and r[2] <= max_num_seqs
    ]
    done, steps, _, live = play(sch, ok, fail_every=fail_every)
    assert len(done) == sum(r[2] for r in ok) == len(live)
    for s in done:
        mt = s.params.max_tokens
        assert s.num_output_tokens == mt and s.status is SequenceStatus.FINISHED_LENGTH
    assert sch.block_manager.usage() == 0 and not sch.has_unfinished()


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000), n_req=st.integers(6, 14), caching=st.booleans())
def test_tiny_cache_preempts_repeatedly_and_still_finishes(seed, n_req, caching):
    """A cache that holds about two requests at a time: preemption (recompute) happens again and
    again, nothing is lost."""
    rng = random.Random(seed)
    reqs = [(rng.randint(8, 24), rng.randint(10, 30), 1, 0, 0) for _ in range(n_req)]
    sch = make_sched(
        num_blocks=16,
        block_size=4,
        caching=caching,
        max_num_seqs=8,
        max_num_batched_tokens=32,
        memory_threshold=1.0,
    )
    done, steps, _, _ = play(sch, reqs, rng=rng)
    assert sorted(s.num_output_tokens for s in done) == sorted(r[1] for r in reqs)
    assert (
        sch.stats.preemptions >= 2 and sum(s.num_preemptions for s in done) == sch.stats.preemptions
    )
    assert sch.block_manager.usage() == 0


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000))
def test_aborts_free_everything(seed):
    """Aborting requests at random points (waiting, mid-prefill, decoding) frees their blocks; the
    rest finish intact."""
    rng = random.Random(seed)
    reqs = [
        (
            rng.randint(1, 30),
            rng.randint(1, 20),
            rng.choice([1, 2]),
            rng.randint(0, 1),
            rng.randint(0, 10),
        )
        for _ in range(10)
    ]
    sch = make_sched(num_blocks=40, block_size=4, max_num_seqs=6, max_num_batched_tokens=24)
    done, steps, aborted, live = play(sch, reqs, abort_every=3, rng=rng)
    assert all(
        s.status is SequenceStatus.FINISHED_ABORTED
        for s in live
        if s.request_id in aborted and s not in done
    )
    for s in done:
        assert s.num_output_tokens == s.params.max_tokens
    assert {s.request_id for s in live} == {s.request_id for s in done} | aborted
    assert sch.block_manager.usage() == 0 and not sch.has_unfinished()


def test_priority_admits_lower_value_first():
    sch = make_sched(max_num_seqs=1, max_num_batched_tokens=64)
    a, b, c = (
        Sequence(i, f"r{i}", [1, 2, 3], 3, priority=p, arrival_time=float(i))
        for i, p in enumerate([1, 1, 0])
    )
    for s in (a, b, c):
        sch.add(s)
    assert [s.seq_id for s in sch.waiting] == [2, 0, 1]
    assert [x.seq.seq_id for x in sch.schedule().scheduled] == [2]


def test_victim_is_lowest_priority_then_latest():
    """Under memory pressure the request with the highest priority value goes first, even if it
    arrived earlier."""
    sch = make_sched(num_blocks=6, block_size=4, memory_threshold=1.0, max_num_batched_tokens=64)
    old_low = Sequence(
        0, "old", [1] * 8, 8, SamplingParams(max_tokens=8), priority=1, arrival_time=0.0
    )
    new_hi = Sequence(
        1, "new", [2] * 8, 8, SamplingParams(max_tokens=8), priority=0, arrival_time=1.0
    )
    mid = Sequence(2, "mid", [3] * 8, 8, SamplingParams(max_tokens=8), priority=0, arrival_time=0.5)
    for s in (old_low, mid, new_hi):
        sch.add(s)  # in arrival order
    out = sch.schedule()
    assert [x.seq.request_id for x in out.scheduled] == [
        "mid",
        "new",
        "old",
    ]  # 6 blocks: all three prompts fit
    sch.update(out)
    for s in (old_low, new_hi, mid):
        s.append_token(0)
    out = sch.schedule()  # each needs a third block
    assert [s.request_id for s in out.preempted][0] == "old" and old_low.num_preemptions == 1
    assert list(sch.waiting)[0] is old_low


def test_rejects_what_can_never_fit():
    sch = make_sched(num_blocks=4, block_size=4, max_model_len=20)
    with pytest.raises(ValueError, match="max_model_len"):
        sch.add(Sequence(0, "a", list(range(21)), 21))
    with pytest.raises(ValueError, match="num_blocks"):
        sch.add(Sequence(1, "b", list(range(10)), 10, SamplingParams(max_tokens=10)))
    with pytest.raises(ValueError, match="num_blocks"):
        sch.add(Sequence(2, "c", list(range(4)), 4, SamplingParams(n=4, max_tokens=4)))
    sch.add(
        Sequence(3, "d", list(range(10)), 10, SamplingParams(max_tokens=7))
    )  # 16 KV positions: exactly 4 blocks
    with pytest.raises(ValueError, match="max_num_seqs"):
        make_sched(max_num_seqs=2).add(Sequence(4, "e", [1], 1, SamplingParams(n=3)))
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        make_sched(enable_chunked_prefill=False, max_num_batched_tokens=8).add(
            Sequence(5, "f", [1] * 4, 4, SamplingParams(max_tokens=6))
        )
    assert sch.stats.rejected == 3 and len(sch.waiting) == 1


# --- issue 10 item 1: a block becomes a prefix-cache hit only after the step that writes its KV has
# completed ---


def test_failed_forward_then_abort_gives_no_cache_hit():
    """Schedule a prompt, the forward pass raises (no update), abort it, add the same prompt: no
    cache hit on unwritten KV."""
    sch = make_sched(num_blocks=16, block_size=4)
    prompt = list(range(10))
    sch.add(Sequence(0, "a", prompt, 10))
    sch.schedule()  # the step fails: update is never called
    sch.abort("a")
    again = Sequence(1, "b", prompt, 10)
    sch.add(again)
    out = sch.schedule()
    assert (
        again.num_cached_tokens == again.num_computed_tokens == 0
        and sch.block_manager.stats.cache_hits == 0
    )
    assert out.scheduled[0].num_tokens == 10  # the whole prompt is computed again
    sch.update(out)
    third = Sequence(2, "c", prompt, 10)
    sch.add(third)
    sch.schedule()
    assert third.num_cached_tokens == 8  # once a step completed, its full blocks are hits


def test_rescheduling_after_failed_step_is_idempotent():
    """The same sequences get the same slots and copies; no block is taken twice, ref counts do not
    change, nothing is published."""
    sch = make_sched(num_blocks=16, block_size=4, max_num_batched_tokens=16)
    p = Sequence(0, "p", [1, 2, 3, 4, 5, 6], 6, SamplingParams(n=2, max_tokens=5))
    sch.add(p)
    sch.add(Sequence(1, "q", list(range(20, 29)), 9))
    out = sch.schedule()
    sch.update(out)
    c = p.fork(2, 1)
    sch.fork(p, c)
    for s in (p, c):
        s.append_token(7)
    bm = sch.block_manager
    first = sch.schedule()  # decodes with a copy-on-write + q's prefill chunk; fails
    state = (
        bm.num_free_blocks(),
        [b.ref_count for b in bm.blocks],
        dict(bm.cache.cached),
        [list(s.block_table) for s in sch.running],
    )
    assert first.block_copies
    for _ in range(3):
        again = sch.schedule()
        assert [(x.seq.seq_id, x.num_tokens, x.slot_mapping) for x in again.scheduled] == [
            (x.seq.seq_id, x.num_tokens, x.slot_mapping) for x in first.scheduled
        ]
        assert (
            again.block_copies == first.block_copies
        )  # the copy may never have run: it is handed out again
        assert (
            bm.num_free_blocks(),
            [b.ref_count for b in bm.blocks],
            dict(bm.cache.cached),
            [list(s.block_table) for s in sch.running],
        ) == state
    sch.update(again)
    assert (
        not bm.pins and not bm.cow_pending and p.num_computed_tokens == c.num_computed_tokens == 7
    )


def test_failed_step_then_abort_frees_everything():
    sch = make_sched(num_blocks=16, block_size=4)
    p = Sequence(0, "p", list(range(6)), 6, SamplingParams(n=2))
    sch.add(p)
    out = sch.schedule()
    sch.update(out)
    c = p.fork(1, 1)
    sch.fork(p, c)
    for s in (p, c):
        s.append_token(9)
    sch.schedule()  # copy-on-write handed out, the step fails
    assert sch.block_manager.pins
    sch.abort("p")
    bm = sch.block_manager
    assert (
        bm.num_free_blocks() == bm.num_blocks and not bm.pins and not bm.cow_pending and not bm.seqs
    )


def test_update_takes_only_the_latest_output_once():
    sch = make_sched()
    sch.add(Sequence(0, "a", [1, 2, 3], 3))
    old = sch.schedule()
    new = sch.schedule()
    with pytest.raises(ValueError, match="latest schedule"):
        sch.update(old)
    sch.update(new)
    with pytest.raises(ValueError, match="once"):
        sch.update(new)


# --- issue 10 item 9: n > 1 admission counts the shared prompt blocks once ---


def run_all(sch, max_steps=2_000):
    """play() for requests already added; returns the finished sequences and the most blocks held at
    once."""
    ids, done, peak, kv, bm = itertools.count(1000), [], 0, {}, sch.block_manager
    for _ in range(max_steps):
        if not sch.has_unfinished():
            return done, peak
        out = sch.schedule()
        samp = [x.seq for x in out.scheduled if x.samples]
        run_forward(sch, out, kv)
        sch.update(out)
        peak = max(peak, bm.num_blocks - bm.num_free_blocks())
        for s in samp:
            kids = (
                [s.fork(next(ids), k) for k in range(1, s.params.n)]
                if s.num_output_tokens == 0 and s.index == 0
                else []
            )
            for k in kids:
                sch.fork(s, k)
            for x in [s] + kids:
                x.append_token(x.index)
                if x.num_output_tokens == x.params.max_tokens:
                    sch.finish(x, SequenceStatus.FINISHED_LENGTH)
                    done.append(x)
    raise AssertionError(f"no progress: {sch}")


@pytest.mark.parametrize("max_tokens", [1, 2, 8, 10, 11])
def test_n4_shares_prompt_blocks_and_runs_to_completion(max_tokens):
    """The issue's example: n=4, a 30-token prompt, 20 blocks of 4. 7 shared prompt blocks + 4 x 3
    own = 19 <= 20: admitted and run."""
    sch = make_sched(num_blocks=20, block_size=4)
    sch.add(Sequence(0, "r", list(range(30)), 30, SamplingParams(n=4, max_tokens=max_tokens)))
    done, peak = run_all(sch)
    assert sorted(s.index for s in done) == [0, 1, 2, 3] and all(
        s.num_output_tokens == max_tokens for s in done
    )
    assert (
        peak <= 20
        and sch.block_manager.num_free_blocks() == 20
        and sch.block_manager.usage() == 0
        and not sch.has_unfinished()
    )


def test_n4_truly_too_big_is_refused_naming_num_blocks():
    sch = make_sched(num_blocks=20, block_size=4)
    with pytest.raises(
        ValueError, match=r"num_blocks.*23 KV blocks"
    ):  # 7 shared + 4 x 4 own (max_tokens=12) > 20
        sch.add(Sequence(0, "r", list(range(30)), 30, SamplingParams(n=4, max_tokens=12)))
    assert not sch.waiting and sch.stats.rejected == 1


@pytest.mark.parametrize("caching", [False, True])
def test_preempted_fork_group_recomputes_sharing_its_prompt(caching):
    """Four forks pushed out by an older request come back sharing the prompt (4 independent copies
    would need > 20 blocks)."""
    sch = make_sched(num_blocks=20, block_size=4, caching=caching, memory_threshold=1.0)
    sch.add(Sequence(0, "old", [7] * 8, 8, SamplingParams(max_tokens=40)))
    sch.add(Sequence(1, "r", list(range(30)), 30, SamplingParams(n=4, max_tokens=10)))
    done, peak = run_all(sch)
    forks = [s for s in done if s.request_id == "r"]
    assert sorted(s.index for s in forks) == [0, 1, 2, 3] and all(
        s.num_preemptions >= 1 for s in forks
    )
    assert (
        peak <= 20
        and sch.block_manager.usage() == 0
        and not sch.siblings.parked
        and not sch.block_manager.lent
    )


# --- contracts: QueueFullError past max_admitted_seqs ---


def test_queue_full_past_max_admitted_seqs_changes_nothing():
    from hetero_infer.core.sequence import QueueFullError

    sch = make_sched(max_admitted_seqs=4)
    sch.add(
        Sequence(0, "a", [1, 2], 2, SamplingParams(n=3))
    )  # a request not yet forked counts its n
    assert sch.num_admitted() == 3
    with pytest.raises(
        QueueFullError, match=r"would make 5 admitted sequences, more than max_admitted_seqs=4"
    ):
        sch.add(Sequence(1, "b", [1, 2], 2, SamplingParams(n=2)))
    assert [s.request_id for s in sch.waiting] == ["a"] and sch.stats.rejected == 0
    sch.add(Sequence(2, "c", [1, 2], 2))  # exactly 4: accepted
    with pytest.raises(QueueFullError):
        sch.add(Sequence(3, "d", [1], 1))
    sch.abort("a")
    sch.add(Sequence(3, "d", [1], 1))
    assert sch.num_admitted() == 2
    with pytest.raises(ValueError, match="max_admitted_seqs"):
        sch.add(Sequence(4, "e", [1], 1, SamplingParams(n=5)))


def test_admitted_count_follows_forks_and_finishes():
    sch = make_sched(max_admitted_seqs=8)
    p = Sequence(0, "p", [1, 2, 3], 3, SamplingParams(n=3, max_tokens=4))
    sch.add(p)
    out = sch.schedule()
    sch.update(out)
    kids = [p.fork(i, i) for i in (1, 2)]
    for k in kids:
        sch.fork(p, k)
    for s in [p] + kids:
        s.append_token(1)
    assert sch.num_admitted() == 3
    sch.finish(kids[0], SequenceStatus.FINISHED_STOPPED)
    assert sch.num_admitted() == 2


def readmitted_group(caching=False):
    """A request's two forks waiting together (as after a preemption), then admitted: the sibling
    parks behind the leader."""
    sch = make_sched(num_blocks=20, block_size=4, caching=caching, memory_threshold=1.0)
    lead, sib = (
        Sequence(i, "r", list(range(30)) + [i], 30, SamplingParams(n=2, max_tokens=5), index=i)
        for i in range(2)
    )
    sch.add(lead)
    sch.add(sib)
    out = sch.schedule()
    return sch, lead, sib, out


def test_readmitted_sibling_waits_for_its_leader_then_shares_its_prompt():
    sch, lead, sib, out = readmitted_group()
    bm = sch.block_manager
    assert (
        [x.seq for x in out.scheduled] == [lead]
        and sib.seq_id in sch.siblings.parked
        and sib.status is RUNNING
    )
    assert sib.block_table[:7] == lead.block_table[:7] and bm.lent[sib.seq_id] == 7
    assert (
        bm.num_blocks - bm.num_free_blocks() == 8 + 1
    )  # the leader's 8 blocks + the sibling's own last one
    sch.update(out)
    assert (
        not sch.siblings.parked
        and sib.num_computed_tokens == 28
        and all(bm.blocks[b].ref_count == 2 for b in lead.block_table[:7])
    )
    lead.append_token(1)
    out = sch.schedule()
    assert [(x.seq, x.num_tokens) for x in out.scheduled] == [(lead, 1), (sib, 3)]


def test_readmitted_sibling_joins_at_once_when_the_prompt_is_cached():
    sch = make_sched(num_blocks=20, block_size=4, memory_threshold=1.0)
    first = Sequence(9, "warm", list(range(30)), 30)
    sch.add(first)
    out = sch.schedule()
    sch.update(out)
    sch.finish(first, SequenceStatus.FINISHED_STOPPED)  # its 7 full blocks stay cached
    lead, sib = (
        Sequence(i, "r", list(range(30)) + [i], 30, SamplingParams(n=2, max_tokens=5), index=i)
        for i in range(2)
    )
    sch.add(lead)
    sch.add(sib)
    out = sch.schedule()
    assert not sch.siblings.parked and [(x.seq, x.num_tokens) for x in out.scheduled] == [
        (lead, 3),
        (sib, 3),
    ]


def test_finishing_a_leader_sends_its_parked_sibling_back_to_wait():
    sch, lead, sib, out = readmitted_group()
    sch.finish(lead, SequenceStatus.FINISHED_STOPPED)
    bm = sch.block_manager
    assert (
        list(sch.waiting) == [sib]
        and sib.status is WAITING
        and not sib.block_table
        and not sch.siblings.parked
        and not bm.lent
    )
    assert bm.usage() == 0
    done, _ = run_all(sch)
    assert done == [sib] and bm.usage() == 0


@pytest.mark.parametrize("caching", [False, True])
def test_aborting_a_group_with_a_parked_sibling_frees_everything(caching):
    sch, lead, sib, out = readmitted_group(caching)
    sch.abort("r")
    bm = sch.block_manager
    assert (
        bm.num_free_blocks() == bm.num_blocks
        and not bm.lent
        and not bm.seqs
        and not sch.siblings.parked
        and not sch.has_unfinished()
    )


# --- found by mutation testing (make mutation): `add`'s boundaries and its num_blocks message


def _req(rid, n_prompt, n=1, max_tokens=1):
    return Sequence(
        hash(rid) & 0xFFFF,
        rid,
        list(range(n_prompt)),
        n_prompt,
        SamplingParams(n=n, max_tokens=max_tokens),
    )


def test_add_accepts_exactly_max_model_len_and_max_admitted_seqs():
    sch = make_sched(num_blocks=8, block_size=4, max_model_len=8, max_admitted_seqs=2)
    sch.add(_req("full", 8))  # exactly max_model_len tokens
    with pytest.raises(ValueError, match="max_model_len"):
        sch.add(_req("long", 9))
    sch2 = make_sched(num_blocks=8, block_size=4, max_num_seqs=2, max_admitted_seqs=2)
    sch2.add(_req("pair", 4, n=2))  # n == max_admitted_seqs
    with pytest.raises(ValueError, match="max_admitted_seqs"):
        make_sched(max_num_seqs=4, max_admitted_seqs=2).add(_req("trio", 4, n=3))


def test_num_blocks_refusal_counts_the_shared_prompt_blocks():
    sch = make_sched(num_blocks=3, block_size=4)
    with pytest.raises(
        ValueError,
        match=r"may need 4 KV blocks \(15 tokens of KV for each of n=1 completions, "
        r"sharing 0 full prompt blocks\)",
    ):
        sch.add(_req("one", 8, n=1, max_tokens=8))
    with pytest.raises(
        ValueError,
        match=r"may need 4 KV blocks \(10 tokens of KV for each of n=2 completions, "
        r"sharing 2 full prompt blocks\)",
    ):
        sch.add(_req("two", 8, n=2, max_tokens=3))


# Behaviours a mutation run of the scheduler (make mutation MUTATION_MODULES=scheduler) found
# unpinned.
def _seq(sid, rid, n_prompt=4, n=1):
    return Sequence(sid, rid, list(range(n_prompt)), n_prompt, SamplingParams(n=n, max_tokens=4))


def test_finish_counts_stops_and_aborts_and_refuses_twice():
    sch = make_sched()
    a, b, c, d = _seq(1, "a"), _seq(2, "b"), _seq(3, "c"), _seq(4, "d")
    for s in (a, b, c, d):
        sch.add(s)
    sch.update(sch.schedule())  # all four running
    sch.finish(a)
    sch.finish(b, SequenceStatus.FINISHED_ABORTED)
    assert (sch.stats.finished, sch.stats.aborted) == (1, 1)
    sch.finish(c, SequenceStatus.FINISHED_LENGTH)
    sch.finish(d, SequenceStatus.FINISHED_ABORTED)
    assert (sch.stats.finished, sch.stats.aborted) == (2, 2) and not sch.running
    with pytest.raises(ValueError, match="sequence 1 is already finished"):
        sch.finish(a)
    with pytest.raises(ValueError, match="status must be a finished status"):
        sch.finish(_seq(5, "e"), SequenceStatus.RUNNING)


def test_finishing_a_waiting_sequence_removes_only_it():
    sch = make_sched()
    a, b = _seq(1, "a"), _seq(2, "b")
    sch.add(a)
    sch.add(b)  # both still waiting
    sch.finish(b, SequenceStatus.FINISHED_ABORTED)
    assert (
        list(sch.waiting) == [a]
        and b.status is SequenceStatus.FINISHED_ABORTED
        and sch.num_admitted() == 1
    )


def test_abort_adds_every_sequence_of_the_request_to_the_count():
    sch = make_sched()
    sch.add(_seq(1, "a"))
    sch.add(_seq(2, "b"))
    assert [s.seq_id for s in sch.abort("a")] == [1] and sch.stats.aborted == 1
    assert [s.seq_id for s in sch.abort("b")] == [2] and sch.stats.aborted == 2
    assert sch.abort("b") == [] and sch.stats.aborted == 2


def test_fork_of_a_waiting_parent_joins_right_behind_its_request():
    sch = make_sched()
    p, x = _seq(1, "p", n=3), _seq(2, "x")
    sch.add(p)
    sch.add(x)
    c1, c2 = p.fork(10, 1), p.fork(11, 2)
    sch.fork(p, c1)
    sch.fork(p, c2)
    assert [s.seq_id for s in sch.waiting] == [1, 10, 11, 2] and c1.status is WAITING
    assert sch.num_admitted() == 4  # the request's three seats and x
    for s in (c1, c2, p):
        sch.finish(s)
    assert (
        sch.num_admitted() == 1 and "p" not in sch.admission.members
    )  # the request's bookkeeping goes with its last sequence


def test_fork_of_a_finished_parent_is_refused():
    sch = make_sched()
    p = _seq(1, "p", n=2)
    sch.add(p)
    sch.finish(p)
    with pytest.raises(ValueError, match="cannot fork finished sequence 1"):
        sch.fork(p, p.fork(2, 1))


# --- from the full scheduler mutation run (issue 18): counters, seats, budgets, preemption and
# parked siblings


def _group(num_blocks=20, budget=2048, first=None, **kw):
    """The readmitted two-fork group of `readmitted_group` (31 tokens each; the sibling shares 7
    blocks), with a token budget."""
    sch = make_sched(
        num_blocks=num_blocks,
        block_size=4,
        caching=False,
        memory_threshold=1.0,
        max_num_batched_tokens=budget,
        **kw,
    )
    toks = lambda i: (
        (first if first is not None and i else [])
        + list(range(30 - (len(first) if first is not None and i else 0)))
        + [i]
    )
    lead, sib = (
        Sequence(i, "r", toks(i), 30, SamplingParams(n=2, max_tokens=2), index=i) for i in range(2)
    )
    return sch, lead, sib


def test_stats_count_steps_tokens_and_admissions():
    sch = make_sched()
    sch.add(Sequence(0, "a", [1] * 5, 5, SamplingParams(max_tokens=3)))
    sch.add(Sequence(1, "b", [2] * 3, 3, SamplingParams(max_tokens=3)))
    run_all(sch)
    assert sch.schedule().is_empty  # an empty step is not counted
    st = sch.stats  # one prefill step of 8 tokens, two steps of 2 decodes
    assert (st.steps, st.prefill_tokens, st.decode_tokens, st.admitted, st.finished) == (
        3,
        8,
        4,
        2,
        2,
    )


def test_update_refuses_a_stale_output_with_its_message():
    sch = make_sched()
    sch.add(Sequence(0, "a", [1, 2, 3], 3))
    with pytest.raises(ValueError) as e:
        sch.update(SchedulerOutput())
    assert str(e.value) == "update(out) takes the output of the latest schedule() call, once"


def test_finish_counts_each_stop_or_abort_as_it_happens():
    sch = make_sched()
    a, b = _seq(1, "a"), _seq(2, "b")
    sch.add(a)
    sch.add(b)
    sch.finish(a, SequenceStatus.FINISHED_STOPPED)
    assert (sch.stats.finished, sch.stats.aborted) == (1, 0)
    sch.finish(b, SequenceStatus.FINISHED_ABORTED)
    assert (sch.stats.finished, sch.stats.aborted) == (1, 1)


def test_max_tokens_none_is_sized_by_max_model_len():
    """A request with no max_tokens may grow to max_model_len: 64 tokens need 16 blocks of 4, more
    than 10."""
    sch = make_sched(num_blocks=10, block_size=4, max_model_len=64)
    with pytest.raises(ValueError, match=r"may need 16 KV blocks \(63 tokens of KV"):
        sch.add(Sequence(0, "a", list(range(8)), 8, SamplingParams(max_tokens=None)))
    sch = make_sched(num_blocks=16, block_size=4, max_model_len=64)
    sch.add(Sequence(0, "a", list(range(8)), 8, SamplingParams(max_tokens=None)))  # exactly fits
    assert len(sch.waiting) == 1


def test_readded_group_bookkeeping_goes_with_its_last_sequence():
    sch, lead, sib = _group()
    sch.add(lead)
    sch.add(sib)
    sch.finish(lead)
    assert "r" in sch.admission.members
    sch.finish(sib)
    assert "r" not in sch.admission.members and sch.num_admitted() == 0


def test_two_preemptions_in_one_step_are_both_reported():
    """Three running requests each need a new block and none is free: the latest is preempted, then
    the middle one itself."""
    sch = make_sched(num_blocks=3, block_size=4, memory_threshold=1.0)
    a, b, c = (
        Sequence(i, r, [i] * 4, 4, SamplingParams(max_tokens=2), arrival_time=float(i))
        for i, r in enumerate("abc")
    )
    for s in (a, b, c):
        sch.add(s)
    sch.update(sch.schedule())
    for s in (a, b, c):
        s.append_token(1)
    out = sch.schedule()
    assert (
        out.preempted == [c, b]
        and [x.seq for x in out.scheduled] == [a]
        and sch.stats.preemptions == 2
    )
    assert list(sch.waiting) == [b, c]
    assert all(
        (s.status, s.num_computed_tokens, s.num_cached_tokens, s.num_preemptions)
        == (WAITING, 0, 0, 1)
        for s in (b, c)
    )


def test_a_request_with_nothing_left_to_preempt_waits_without_spending_budget():
    """y and r's first fork take the last free blocks; r's second fork finds no victim (both
    requests are in the step): it waits."""
    sch = make_sched(num_blocks=3, block_size=4, memory_threshold=1.0)
    y = Sequence(0, "y", [9, 9, 9], 3, SamplingParams(max_tokens=2), arrival_time=0.0)
    lead = Sequence(1, "r", [1, 2, 3, 4], 4, SamplingParams(n=2, max_tokens=2), arrival_time=1.0)
    sch.add(y)
    sch.add(lead)
    sch.update(sch.schedule())
    kid = lead.fork(2, 1)
    sch.fork(lead, kid)
    for s in (y, lead, kid):
        s.append_token(5)
    out = sch.schedule()
    assert [(x.seq, x.num_tokens) for x in out.scheduled] == [
        (y, 1),
        (lead, 1),
    ] and out.num_batched_tokens == 2
    assert not out.preempted and kid.status is RUNNING


def test_admission_reserves_seats_for_forks_only_before_the_first_token():
    sch = make_sched(max_num_seqs=3)
    a = _seq(0, "a")
    sch.add(a)
    sch.update(sch.schedule())
    a.append_token(1)
    sch.add(_seq(1, "b", n=3))  # 1 running + 3 seats > 3: waits
    out = sch.schedule()
    assert [s.request_id for s in sch.waiting] == ["b"] and [
        x.seq.seq_id for x in out.scheduled
    ] == [0]
    sch = make_sched(max_num_seqs=2)
    sch.add(_seq(0, "a"))
    sch.update(sch.schedule())
    late = Sequence(
        1, "b", [1, 2, 3, 4, 5], 4, SamplingParams(n=2, max_tokens=4)
    )  # forked already (one output token)
    sch.add(late)
    assert sch.num_admitted() == 2  # no seat for a fork it already made
    sch.schedule()
    assert late.status is RUNNING  # 1 running + 1 seat
    sch, lead, sib = _group(max_num_seqs=2)
    sch.add(lead)
    sch.add(sib)
    sch.schedule()
    assert lead.status is RUNNING and sib.status is RUNNING  # a group of 2 takes 2 seats


def test_admission_stops_when_the_budget_is_spent_and_uses_a_last_single_token():
    sch = make_sched(max_num_batched_tokens=8)
    a, b = Sequence(0, "a", [1] * 8, 8), Sequence(1, "b", [2] * 4, 4)
    sch.add(a)
    sch.add(b)
    out = sch.schedule()
    assert (
        [(x.seq, x.num_tokens) for x in out.scheduled] == [(a, 8)]
        and list(sch.waiting) == [b]
        and b.status is WAITING
    )
    sch = make_sched(max_num_batched_tokens=9)
    a, b = Sequence(0, "a", [1] * 8, 8), Sequence(1, "b", [2] * 4, 4)
    sch.add(a)
    sch.add(b)
    out = sch.schedule()
    assert [(x.seq, x.num_tokens) for x in out.scheduled] == [
        (b, 1),
        (a, 8),
    ]  # the 1-token chunk runs first, as a decode


def test_group_admission_counts_the_siblings_own_blocks():
    """x holds 12 of 20 blocks (and needs no new one): the group needs 8 + 1 more, so it waits;
    nothing is half-admitted."""
    sch, lead, sib = _group()
    x = Sequence(9, "x", [7] * 47, 47, SamplingParams(max_tokens=2), priority=-1)
    sch.add(x)
    sch.update(sch.schedule())
    sch.add(lead)
    sch.add(sib)
    x.append_token(1)
    out = sch.schedule()
    assert (
        [x_.seq for x_ in out.scheduled] == [x]
        and list(sch.waiting) == [lead, sib]
        and not sch.siblings.parked
    )


def test_sibling_sharing_no_block_gets_no_empty_chunk():
    """A readmitted sibling whose first block differs shares nothing: it is allocated its own blocks
    and runs when budget is left."""
    sch, lead, sib = _group(budget=8, first=[99])
    sch.add(lead)
    sch.add(sib)
    out = sch.schedule()
    assert (
        [(x.seq, x.num_tokens) for x in out.scheduled] == [(lead, 8)]
        and not sch.siblings.parked
        and sib.status is RUNNING
    )


def test_parked_sibling_waits_for_the_leaders_chunks_and_joins_on_the_exact_block():
    sch, lead, sib = _group(budget=8)
    sch.add(lead)
    sch.add(sib)
    for step in range(3):  # the leader computes 8, 16, 24 of 28 shared tokens
        out = sch.schedule()
        assert [(x.seq, x.num_tokens) for x in out.scheduled] == [
            (lead, 8)
        ] and sib.seq_id in sch.siblings.parked
        sch.update(out)
    assert sib.seq_id in sch.siblings.parked
    sch, lead, sib = _group(budget=28)
    sch.add(lead)
    sch.add(sib)
    sch.update(sch.schedule())  # exactly the 7 shared blocks computed
    assert not sch.siblings.parked and sib.num_computed_tokens == 28
    sch, lead, sib = _group(budget=24)
    sch.add(lead)
    sch.add(sib)
    sch.update(sch.schedule())  # 24 of 28: still parked
    out = sch.schedule()  # the leader's last 7 leave budget; the parked sibling takes none
    assert [(x.seq, x.num_tokens) for x in out.scheduled] == [
        (lead, 7)
    ] and sib.seq_id in sch.siblings.parked


@pytest.mark.parametrize("length,shared", [(32, 7), (33, 8)])
def test_identical_forks_share_every_full_block_but_the_last_tokens(length, shared):
    """Greedy forks can be identical: readmitted, the sibling borrows each full block except the one
    holding its last token."""
    sch = make_sched(num_blocks=40, block_size=4, caching=False, memory_threshold=1.0)
    lead, sib = (
        Sequence(
            i, "r", list(range(length)), length - 1, SamplingParams(n=2, max_tokens=4), index=i
        )
        for i in range(2)
    )
    sch.add(lead)
    sch.add(sib)
    sch.schedule()
    assert sch.block_manager.lent[sib.seq_id] == shared and sib.seq_id in sch.siblings.parked


def test_partly_cached_prompt_still_parks_the_sibling():
    sch = make_sched(num_blocks=20, block_size=4, memory_threshold=1.0)
    warm = Sequence(9, "warm", list(range(8)) + [50, 51], 10)
    sch.add(warm)
    sch.update(sch.schedule())
    sch.finish(warm)  # 2 of the 7 shared blocks are cached
    lead, sib = (
        Sequence(i, "r", list(range(30)) + [i], 30, SamplingParams(n=2, max_tokens=2), index=i)
        for i in range(2)
    )
    sch.add(lead)
    sch.add(sib)
    out = sch.schedule()
    assert (
        lead.num_cached_tokens == 8
        and sib.seq_id in sch.siblings.parked
        and [x.seq for x in out.scheduled] == [lead]
    )


def test_preempting_a_group_with_a_parked_sibling_unparks_it():
    """y (higher priority) needs a block while r's sibling is parked: r is preempted whole and
    nothing stays parked."""
    sch = make_sched(
        num_blocks=11, block_size=4, caching=False, memory_threshold=1.0, max_num_batched_tokens=4
    )
    y = Sequence(5, "y", [9] * 4, 4, SamplingParams(max_tokens=10), priority=0)
    sch.add(y)
    sch.update(sch.schedule())
    y.append_token(1)
    lead, sib = (
        Sequence(
            i,
            "r",
            list(range(30)) + [i],
            30,
            SamplingParams(n=2, max_tokens=2),
            index=i,
            priority=1,
        )
        for i in range(2)
    )
    sch.add(lead)
    sch.add(sib)
    for _ in range(20):
        out = sch.schedule()
        if out.preempted:
            break
        assert sib.seq_id in sch.siblings.parked
        sch.update(out)
        if any(x.seq is y for x in out.scheduled):
            y.append_token(1)
    assert out.preempted == [lead, sib] and not sch.siblings.parked and not sch.block_manager.lent
    assert all(
        (s.status, s.num_computed_tokens, s.num_cached_tokens) == (WAITING, 0, 0)
        for s in (lead, sib)
    )
    assert [x.seq for x in out.scheduled] == [y]


def test_unparked_sibling_is_reset_and_a_finished_parked_sibling_is_forgotten():
    sch, lead, sib, out = readmitted_group()
    sch.finish(lead, SequenceStatus.FINISHED_STOPPED)
    assert (sib.num_computed_tokens, sib.num_cached_tokens) == (0, 0)
    sch, lead, sib, out = readmitted_group()
    sch.finish(sib, SequenceStatus.FINISHED_ABORTED)  # the parked one itself leaves
    assert not sch.siblings.parked and lead.status is RUNNING


def test_num_logits_is_one_row_for_a_chunk_that_reaches_the_end():
    s = Sequence(0, "a", [5, 6, 7], 3)
    assert [ScheduledSeq(s, n, list(range(n))).num_logits for n in (1, 2, 3)] == [0, 0, 1]
    s.num_computed_tokens = 2
    assert ScheduledSeq(s, 1, [2]).num_logits == 1  # the last token: the step samples
    assert ScheduledSeq(s, 1, [2], num_logits=4).num_logits == 4  # a plugin's rows are kept
    assert ScheduledSeq(s, 1, [2], num_logits=0).num_logits == 0


def test_a_single_completion_holds_no_seats_for_forks():
    sch = make_sched(max_admitted_seqs=3)
    one, two = (
        Sequence(0, "one", [1, 2, 3], 3, SamplingParams(max_tokens=4)),
        Sequence(1, "two", [1, 2, 3], 3, SamplingParams(n=2, max_tokens=4)),
    )
    sch.add(one)
    assert (dict(sch.admission.members), sch.admission.forks_due) == ({"one": 1}, {})
    sch.add(two)
    assert sch.admission.forks_due == {"two": 1} and sch.num_admitted() == 3


def test_a_scheduled_entry_asks_one_logits_row_only_when_it_reaches_the_end():
    "num_logits defaults to 1 for a chunk that ends the sequence (it samples), else 0."
    from hetero_infer.scheduler.output import ScheduledSeq

    s = Sequence(0, "r", [1, 2, 3, 4, 5], 5)
    assert [ScheduledSeq(s, n, list(range(n))).num_logits for n in (5, 4, 1)] == [1, 0, 0]
    s.num_computed_tokens = 4
    assert ScheduledSeq(s, 1, [9]).num_logits == 1 and ScheduledSeq(s, 1, [9], 3).num_logits == 3
