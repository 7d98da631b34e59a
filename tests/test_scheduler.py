"Property tests of the continuous-batching scheduler: invariants of every step, and whole simulated workloads."
import itertools, random
import pytest
from hypothesis import given, settings, strategies as st, HealthCheck
from hetero_infer.core import EngineConfig, SamplingParams, Sequence, SequenceStatus
from hetero_infer.scheduler import Scheduler, SchedulerOutput
from hetero_infer.block_manager import BlockManager

RUNNING, WAITING = SequenceStatus.RUNNING, SequenceStatus.WAITING

def make_sched(num_blocks=64, block_size=4, caching=True, **kw):
    cfg = EngineConfig(block_size=block_size, num_blocks=num_blocks, enable_prefix_caching=caching, **kw)
    return Scheduler(cfg, BlockManager(num_blocks, block_size, caching))

def check_step(sch: Scheduler, out: SchedulerOutput, live: list):
    "Invariants of one step: each live sequence is in exactly one place, budgets hold, decodes come first."
    cfg, bm = sch.config, sch.block_manager
    ids_w, ids_r = [s.seq_id for s in sch.waiting], [s.seq_id for s in sch.running]
    assert len(set(ids_w)) == len(ids_w) and len(set(ids_r)) == len(ids_r) and not set(ids_w) & set(ids_r)
    assert sorted(ids_w + ids_r) == sorted(s.seq_id for s in live if not s.finished)
    assert all(s.status is WAITING and not s.block_table and s.num_computed_tokens == 0 for s in sch.waiting)
    assert all(s.status is RUNNING and s.block_table for s in sch.running)
    n = [x.num_tokens for x in out.scheduled]
    assert len(n) <= cfg.max_num_seqs and sum(n) == out.num_batched_tokens <= cfg.max_num_batched_tokens
    assert all(k >= 1 for k in n) and n == sorted(n, key=lambda k: k > 1)          # decodes (1 token) first
    assert out.num_decodes == sum(k == 1 for k in n)
    assert len({x.seq.seq_id for x in out.scheduled}) == len(n)                      # a sequence at most once
    for x in out.scheduled:
        s = x.seq
        assert s.status is RUNNING and s.num_computed_tokens + x.num_tokens <= len(s)
        assert len(x.slot_mapping) == x.num_tokens
        bs = bm.block_size
        assert x.slot_mapping == [s.block_table[p // bs] * bs + p % bs for p in range(s.num_computed_tokens, s.num_computed_tokens + x.num_tokens)]
    if not cfg.enable_chunked_prefill: assert all(x.samples for x in out.scheduled)   # whole prompts only
    where = {}
    for q, name in ((sch.waiting, "w"), (sch.running, "r")):
        for s in q: assert where.setdefault(s.request_id, name) == name                   # a request's forks stay together
    assert 0 <= bm.usage() <= 1

def play(sch: Scheduler, reqs, max_steps=3_000, abort_every=0, rng=None):
    """Play the engine: schedule -> update -> append a token to every sampling sequence -> finish at max_tokens.
    `reqs` is a list of (prompt_len, max_tokens, n, priority, arrival_step). Returns (finished seqs, steps, aborted ids)."""
    rng = rng or random.Random(0)
    ids = itertools.count()
    live, done, aborted, pending = [], [], set(), sorted(enumerate(reqs), key=lambda r: r[1][4])
    step = 0
    while pending or sch.has_unfinished():
        while pending and pending[0][1][4] <= step:
            i, (plen, mt, n, prio, _) = pending.pop(0)
            seq = Sequence(next(ids), f"r{i}", [rng.randrange(5) for _ in range(plen)], plen,
                           SamplingParams(n=n, max_tokens=mt), priority=prio, arrival_time=float(step))
            sch.add(seq); live.append(seq)
        waiting_before, had_running = {s.seq_id for s in sch.waiting}, bool(sch.running)
        out = sch.schedule()
        check_step(sch, out, live)
        k = len(out.preempted)
        assert {s.seq_id for s in list(sch.waiting)[:k]} == {s.seq_id for s in out.preempted}   # preempted go to the front
        admitted = [s for s in sch.running if s.seq_id in waiting_before]
        if admitted: assert not out.preempted                                                  # no admission in a step that preempted
        if admitted and had_running:                                                           # the memory threshold holds admission
            bm = sch.block_manager
            assert bm.num_blocks - bm.num_free_blocks() <= sch.config.memory_threshold * bm.num_blocks
        sampling = [x.seq for x in out.scheduled if x.samples]
        sch.update(out)
        for s in sampling:
            if s.num_output_tokens == 0 and s.params.n > 1 and s.index == 0:       # n > 1: fork at the first token
                for k in range(1, s.params.n):
                    c = s.fork(next(ids), k); sch.fork(s, c); live.append(c)
                    c.append_token(rng.randrange(5))
                    if c.num_output_tokens == c.params.max_tokens: sch.finish(c, SequenceStatus.FINISHED_LENGTH); done.append(c)
            s.append_token(rng.randrange(5))
            if s.num_output_tokens == s.params.max_tokens: sch.finish(s, SequenceStatus.FINISHED_LENGTH); done.append(s)
        if abort_every and step % abort_every == abort_every - 1 and live:
            victim = rng.choice(live)
            if not victim.finished: aborted.add(victim.request_id); sch.abort(victim.request_id)
        step += 1
        assert step < max_steps, f"no progress: {sch}"
    return done, step, aborted, live

req = st.tuples(st.integers(1, 40), st.integers(1, 12), st.sampled_from([1, 1, 1, 2, 3]), st.integers(0, 2), st.integers(0, 30))

@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(reqs=st.lists(req, min_size=1, max_size=12), num_blocks=st.integers(40, 80), block_size=st.sampled_from([1, 2, 4, 8]),
       max_num_seqs=st.integers(1, 8), max_tokens=st.integers(1, 64), chunked=st.booleans(), caching=st.booleans(),
       threshold=st.sampled_from([0.5, 0.9, 1.0]))
def test_workload_finishes_with_exact_lengths(reqs, num_blocks, block_size, max_num_seqs, max_tokens, chunked, caching, threshold):
    "Every request ends with exactly max_tokens outputs per completion, whatever the limits; each step keeps the invariants."
    if not chunked: max_tokens = max(max_tokens, 64)   # without chunking a whole (recomputed) sequence must fit one step
    sch = make_sched(num_blocks, block_size, caching, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_tokens,
                     enable_chunked_prefill=chunked, memory_threshold=threshold)
    ok = [r for r in reqs if r[2] * -(-(r[0] + r[1] - 1) // block_size) <= num_blocks and r[2] <= max_num_seqs]
    done, steps, _, live = play(sch, ok)
    assert len(done) == sum(r[2] for r in ok) == len(live)
    for s in done:
        mt = s.params.max_tokens
        assert s.num_output_tokens == mt and s.status is SequenceStatus.FINISHED_LENGTH
    assert sch.block_manager.usage() == 0 and not sch.has_unfinished()

@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000), n_req=st.integers(6, 14), caching=st.booleans())
def test_tiny_cache_preempts_repeatedly_and_still_finishes(seed, n_req, caching):
    "A cache that holds about two requests at a time: preemption (recompute) happens again and again, nothing is lost."
    rng = random.Random(seed)
    reqs = [(rng.randint(8, 24), rng.randint(10, 30), 1, 0, 0) for _ in range(n_req)]
    sch = make_sched(num_blocks=16, block_size=4, caching=caching, max_num_seqs=8, max_num_batched_tokens=32, memory_threshold=1.0)
    done, steps, _, _ = play(sch, reqs, rng=rng)
    assert sorted(s.num_output_tokens for s in done) == sorted(r[1] for r in reqs)
    assert sch.stats.preemptions >= 2 and sum(s.num_preemptions for s in done) == sch.stats.preemptions
    assert sch.block_manager.usage() == 0

@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000))
def test_aborts_free_everything(seed):
    "Aborting requests at random points (waiting, mid-prefill, decoding) frees their blocks; the rest finish intact."
    rng = random.Random(seed)
    reqs = [(rng.randint(1, 30), rng.randint(1, 20), rng.choice([1, 2]), rng.randint(0, 1), rng.randint(0, 10)) for _ in range(10)]
    sch = make_sched(num_blocks=40, block_size=4, max_num_seqs=6, max_num_batched_tokens=24)
    done, steps, aborted, live = play(sch, reqs, abort_every=3, rng=rng)
    assert all(s.status is SequenceStatus.FINISHED_ABORTED for s in live if s.request_id in aborted and s not in done)
    for s in done: assert s.num_output_tokens == s.params.max_tokens
    assert {s.request_id for s in live} == {s.request_id for s in done} | aborted
    assert sch.block_manager.usage() == 0 and not sch.has_unfinished()

def test_priority_admits_lower_value_first():
    sch = make_sched(max_num_seqs=1, max_num_batched_tokens=64)
    a, b, c = (Sequence(i, f"r{i}", [1, 2, 3], 3, priority=p, arrival_time=float(i)) for i, p in enumerate([1, 1, 0]))
    for s in (a, b, c): sch.add(s)
    assert [s.seq_id for s in sch.waiting] == [2, 0, 1]
    assert [x.seq.seq_id for x in sch.schedule().scheduled] == [2]

def test_victim_is_lowest_priority_then_latest():
    "Under memory pressure the request with the highest priority value goes first, even if it arrived earlier."
    sch = make_sched(num_blocks=6, block_size=4, memory_threshold=1.0, max_num_batched_tokens=64)
    old_low = Sequence(0, "old", [1] * 8, 8, SamplingParams(max_tokens=8), priority=1, arrival_time=0.0)
    new_hi = Sequence(1, "new", [2] * 8, 8, SamplingParams(max_tokens=8), priority=0, arrival_time=1.0)
    mid = Sequence(2, "mid", [3] * 8, 8, SamplingParams(max_tokens=8), priority=0, arrival_time=0.5)
    for s in (old_low, mid, new_hi): sch.add(s)                                   # in arrival order
    out = sch.schedule()
    assert [x.seq.request_id for x in out.scheduled] == ["mid", "new", "old"]   # 6 blocks: all three prompts fit
    sch.update(out)
    for s in (old_low, new_hi, mid): s.append_token(0)
    out = sch.schedule()                                                          # each needs a third block
    assert [s.request_id for s in out.preempted][0] == "old" and old_low.num_preemptions == 1
    assert list(sch.waiting)[0] is old_low

def test_rejects_what_can_never_fit():
    sch = make_sched(num_blocks=4, block_size=4, max_model_len=20)
    with pytest.raises(ValueError, match="max_model_len"): sch.add(Sequence(0, "a", list(range(21)), 21))
    with pytest.raises(ValueError, match="num_blocks"): sch.add(Sequence(1, "b", list(range(10)), 10, SamplingParams(max_tokens=10)))
    with pytest.raises(ValueError, match="num_blocks"): sch.add(Sequence(2, "c", list(range(4)), 4, SamplingParams(n=4, max_tokens=4)))
    sch.add(Sequence(3, "d", list(range(10)), 10, SamplingParams(max_tokens=7)))   # 16 KV positions: exactly 4 blocks
    with pytest.raises(ValueError, match="max_num_seqs"): make_sched(max_num_seqs=2).add(Sequence(4, "e", [1], 1, SamplingParams(n=3)))
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        make_sched(enable_chunked_prefill=False, max_num_batched_tokens=8).add(Sequence(5, "f", [1] * 4, 4, SamplingParams(max_tokens=6)))
    assert sch.stats.rejected == 3 and len(sch.waiting) == 1
