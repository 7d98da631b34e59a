"""The per-step token budget (`max_num_batched_tokens`): when running decodes alone exceed it (n > 1
forks), and at the exact boundary where a prompt is as long as the budget, with chunked prefill
on and off."""

import itertools
import pytest
from hetero_infer.core.config import EngineConfig
from hetero_infer.core.sampling_params import SamplingParams
from hetero_infer.core.sequence import Sequence, SequenceStatus
from hetero_infer.scheduler.scheduler import Scheduler
from hetero_infer.kv_cache.block_manager import BlockManager

_ids = itertools.count(1000)


def make_sched(budget, chunked=True, num_blocks=64, block_size=4, **kw):
    cfg = EngineConfig(
        block_size=block_size,
        num_blocks=num_blocks,
        max_num_batched_tokens=budget,
        enable_chunked_prefill=chunked,
        **kw,
    )
    return Scheduler(cfg, BlockManager(num_blocks, block_size, True))


def new_seq(n_tokens, rid=None, **params):
    "A sequence whose prompt shares no block with another's (no prefix-cache hits)."
    i = next(_ids)
    return Sequence(
        i,
        rid or f"r{i}",
        [i * 100 + t for t in range(n_tokens)],
        n_tokens,
        SamplingParams(**params),
    )


def step(sch, max_tokens=None):
    """schedule -> update -> append a token to every sequence that sampled; finish those at
    max_tokens. Returns the output."""
    out = sch.schedule()
    sampled = [x.seq for x in out.scheduled if x.samples]
    sch.update(out)
    for s in sampled:
        s.append_token(7)
        if s.num_output_tokens >= s.params.max_tokens:
            sch.finish(s, SequenceStatus.FINISHED_LENGTH)
    return out


def forked(sch, n, prompt_len=3, max_tokens=5):
    """A request with n completions, prefilled, then forked as the engine does after its first step:
    n running decodes."""
    parent = new_seq(prompt_len, rid=f"fork{next(_ids)}", n=n, max_tokens=max_tokens)
    sch.add(parent)
    out = sch.schedule()
    assert [x.num_tokens for x in out.scheduled] == [prompt_len]
    sch.update(out)
    forks = [parent] + [parent.fork(next(_ids), index=k) for k in range(1, n)]
    for child in forks[1:]:
        sch.fork(parent, child)
    for s in forks:
        s.append_token(1)
    assert len(sch.running) == n and all(len(s) - s.num_computed_tokens == 1 for s in forks)
    return forks


def test_forked_decodes_beyond_the_budget_share_it():
    """n = 6 forks with a budget of 4 tokens: each step runs at most 4 decodes, uses all 4 while
    they wait, and all finish."""
    sch = make_sched(budget=4, max_num_seqs=8)
    forks = forked(sch, 6)
    per_step = []
    while sch.has_unfinished():
        out = step(sch)
        assert out.num_batched_tokens == sum(x.num_tokens for x in out.scheduled) <= 4
        assert all(x.num_tokens == 1 for x in out.scheduled)
        per_step.append(out.num_batched_tokens)
        assert len(per_step) < 50, "the forks must all finish"
    assert per_step[0] == 4
    assert sum(per_step) == 6 * 4  # every fork decoded its 4 remaining tokens, none twice
    assert all(
        s.num_output_tokens == 5 and s.status is SequenceStatus.FINISHED_LENGTH for s in forks
    )


def test_decodes_beyond_the_budget_leave_no_room_for_a_prefill():
    """3 forked decodes with a budget of 2: a waiting prompt is not admitted into a step the decodes
    fill; it runs later."""
    sch = make_sched(budget=2, max_num_seqs=8)
    forks = forked(sch, 3, prompt_len=2, max_tokens=3)
    late = new_seq(2, max_tokens=1)
    sch.add(late)
    out = step(sch)
    assert out.num_batched_tokens == 2 and [x.seq for x in out.scheduled] == forks[:2]
    while sch.has_unfinished():
        step(sch)
    assert late.num_output_tokens == 1 and all(s.num_output_tokens == 3 for s in forks)


@pytest.mark.parametrize("chunked", [False, True])
def test_prompt_exactly_the_budget_runs_in_one_step(chunked):
    "A 16-token prompt with a 16-token budget is admitted and computed whole in its first step."
    sch = make_sched(budget=16, chunked=chunked)
    s = new_seq(16, max_tokens=1)
    sch.add(s)
    out = sch.schedule()
    assert [(x.seq, x.num_tokens) for x in out.scheduled] == [
        (s, 16)
    ] and out.num_batched_tokens == 16
    assert out.scheduled[0].samples


def test_prompt_one_over_the_budget():
    """Chunked prefill off: a 17-token prompt can never run in a 16-token step and is refused at
    add, naming the budget."""
    sch = make_sched(budget=16, chunked=False)
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        sch.add(new_seq(17, max_tokens=1))
    assert not sch.has_unfinished()
    sch = make_sched(budget=16, chunked=True)  # chunked: it runs as 16 + 1
    s = new_seq(17, max_tokens=1)
    sch.add(s)
    assert [x.num_tokens for x in step(sch).scheduled] == [16]
    assert [x.num_tokens for x in step(sch).scheduled] == [1]


def test_whole_prompt_waits_for_room_when_chunking_is_off():
    """Chunked prefill off: a prompt of exactly the budget waits while a decode takes a token, and
    then runs whole."""
    sch = make_sched(budget=16, chunked=False)
    a = new_seq(4, max_tokens=3)
    sch.add(a)
    step(sch)  # a's prefill
    b = new_seq(16, max_tokens=1)
    sch.add(b)
    sizes = []
    while sch.has_unfinished():
        out = step(sch)
        sizes.append(sorted(x.num_tokens for x in out.scheduled))
        assert len(sizes) < 10
    assert sizes == [[1], [1], [16]]  # a's two decodes, then b whole (never a 15-token chunk)
