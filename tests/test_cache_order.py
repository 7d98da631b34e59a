"""Which cached blocks the prefix cache evicts first: the least recently used, and of one finished
sequence its tail before its head (so a shared prefix survives longest). Driven through the
scheduler (schedule -> update -> finish), so the tests hold whenever a block is published, and
observed through prefix hits (`num_cached_tokens`) at admission."""

import itertools
from hetero_infer.core.config import EngineConfig
from hetero_infer.core.sampling_params import SamplingParams
from hetero_infer.core.sequence import Sequence, SequenceStatus
from hetero_infer.scheduler.scheduler import Scheduler
from hetero_infer.kv_cache.block_manager import BlockManager

BS = 4
_ids = itertools.count()


def make_sched(num_blocks):
    cfg = EngineConfig(block_size=BS, num_blocks=num_blocks, max_num_batched_tokens=64)
    return Scheduler(cfg, BlockManager(num_blocks, BS, True))


def run(sch, tokens) -> int:
    """Admit a prompt, compute all of it, finish it (its blocks become evictable); returns its
    prefix-cache hit tokens."""
    seq = Sequence(
        next(_ids), f"r{next(_ids)}", list(tokens), len(tokens), SamplingParams(max_tokens=1)
    )
    sch.add(seq)
    while seq.num_computed_tokens < len(seq):
        out = sch.schedule()
        assert out.scheduled, "the prompt must be scheduled"
        sch.update(out)
    sch.finish(seq, SequenceStatus.FINISHED_LENGTH)
    assert not sch.has_unfinished()
    return seq.num_cached_tokens


def prompt(first, n=8):
    return [first] + [first % 7 + 1] * (n - 1)  # distinct first tokens: distinct chains


def test_lru_evicts_least_recently_used_first():
    "Two cached prompts fill the pool; a third evicts the older one; the newer one still hits."
    sch = make_sched(4)
    p1, p2, p3 = prompt(10), prompt(20), prompt(30)
    assert run(sch, p1) == 0 and run(sch, p2) == 0
    assert run(sch, p3) == 0  # needs 2 blocks: both come from evicting p1's
    assert sch.block_manager.stats.evictions == 2
    assert run(sch, p2) == BS  # p2's first block survived (its last block is recomputed, never hit)
    assert run(sch, p1) == 0


def test_a_hit_makes_a_block_recently_used():
    """Reusing p1's prefix after p2 was cached makes p1 the more recent: a new prompt then evicts
    p2, not p1."""
    sch = make_sched(4)
    p1, p2, p3 = prompt(11), prompt(21), prompt(31)
    run(sch, p1)
    run(sch, p2)
    assert run(sch, p1) == BS  # touch p1
    assert run(sch, p3) == 0  # evicts p2's blocks, the least recently used
    assert run(sch, p1) == BS
    assert run(sch, p2) == 0


def test_finished_sequence_releases_its_tail_first():
    """A 3-full-block prompt is freed tail first: a later request that needs one cached block takes
    the third, keeping the head."""
    sch = make_sched(4)
    long = [
        5,
        6,
        7,
        8,
        1,
        2,
        3,
        4,
        9,
        9,
        9,
        9,
        3,
    ]  # 13 tokens: 3 full blocks + 1, all 4 blocks of the pool
    assert run(sch, long) == 0
    assert (
        run(sch, prompt(40)) == 0
    )  # 2 blocks: the free one (the partial last block), then one eviction
    assert sch.block_manager.stats.evictions == 1
    assert run(sch, long) == 2 * BS  # head blocks 0 and 1 survived; block 2 (the tail) was evicted


def test_shared_prefix_survives_longest():
    """Of two prompts sharing a first block, the shared head outlives both tails when the pool comes
    under pressure."""
    sch = make_sched(5)
    shared = [1, 2, 3, 4]
    a, b = shared + [5, 5, 5, 5, 7], shared + [6, 6, 6, 6, 7]  # 9 tokens: 2 full blocks + 1
    run(sch, a)
    assert run(sch, b) == BS  # the shared head hits
    assert run(sch, prompt(50, 16)) == 0  # 4 new blocks: the 2 free ones, then both tails
    assert sch.block_manager.stats.evictions == 2
    assert run(sch, shared + [8, 8, 8, 8, 7]) == BS  # the shared head is still cached
