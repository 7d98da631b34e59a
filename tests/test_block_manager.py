"""Property tests of the paged KV-cache block manager (hypothesis)."""

import copy
import hashlib
from array import array
import pytest
from hypothesis import given, settings, strategies as st, HealthCheck
from hypothesis.stateful import RuleBasedStateMachine, rule, invariant, initialize, precondition

from hetero_infer.core.sequence import Sequence
from hetero_infer.kv_cache.block_manager import BlockManager, BlockPool, NoFreeBlocksError
from hetero_infer.kv_cache.prefix_cache import hash_block

EXAMPLES = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
tokens = st.lists(
    st.integers(0, 3), min_size=1, max_size=24
)  # a small alphabet, so prefixes repeat and the cache hits


def mkseq(i, toks):
    return Sequence(i, f"r{i}", list(toks), len(toks))


def manager_state(bm):
    "Everything the manager owns, to compare before and after a refused call."
    return (
        list(bm.free_ids),
        list(bm.cache.evictable),
        dict(bm.cache.cached),
        [(b.ref_count, b.hash, b.token_ids) for b in bm.blocks],
        {k: list(s.block_table) for k, s in bm.seqs.items()},
        copy.copy(bm.stats),
    )


class BlockManagerMachine(RuleBasedStateMachine):
    """Random admissions, prefill chunks, decodes (one by one and batched), forks and frees against
    one manager. `kv` simulates the physical cache: every slot the manager hands out is written with
    what a real K/V vector depends on, the token *and its whole prefix*; every copy is performed.
    A wrong slot, a missed copy-on-write or a bad prefix-cache hit (even one with equal block
    tokens after a different prefix) shows up as wrong cache content."""

    @initialize(
        num_blocks=st.integers(2, 24),
        block_size=st.sampled_from([1, 2, 4, 8]),
        caching=st.booleans(),
    )
    def setup(self, num_blocks, block_size, caching):
        self.bm, self.bs = BlockManager(num_blocks, block_size, caching), block_size
        self.kv, self.live, self.freed, self.next_id = {}, {}, [], 0

    def _pick(self, i, want=lambda s: True):
        cands = [s for _, s in sorted(self.live.items()) if want(s)]
        return cands[i % len(cands)] if cands else None

    def _write(self, seq, n, slots, copies, commit=True):
        """Perform the step the scheduler and runner would: copies, then KV writes, then commit
        (advance, publish)."""
        bs, bm = self.bs, self.bm
        for src, dst in copies:
            assert src != dst and bm.blocks[dst].ref_count == 1
            for k in range(bs):
                self.kv[dst * bs + k] = self.kv.get(src * bs + k)
        c = seq.num_computed_tokens
        assert len(slots) == n == len(set(slots))
        for p, slot in zip(range(c, c + n), slots):
            b = slot // bs
            assert slot == seq.block_table[p // bs] * bs + p % bs
            # copy-on-write: the block written is in exactly one table, this one: no one else reads
            # or writes the slot
            assert bm.blocks[b].ref_count == 1
            assert [o.seq_id for o in self.live.values() if b in o.block_table] == [seq.seq_id]
            self.kv[slot] = tuple(seq.token_ids[: p + 1])
        if commit:
            self.bm.commit(seq, n)

    @rule(toks=tokens)
    def add(self, toks):
        s, before = mkseq(self.next_id, toks), manager_state(self.bm)
        self.next_id += 1
        if self.bm.can_allocate(s):
            self.bm.allocate(s)
            self.live[s.seq_id] = s
            c = s.num_computed_tokens
            assert c == s.num_cached_tokens and c % self.bs == 0 and c < len(s)
            assert self.bm.cache.enabled or c == 0
            assert len(s.block_table) == -(-len(s) // self.bs)
            for i in range(c // self.bs):  # a prefix-cache hit holds exactly the prompt's tokens
                assert self.bm.blocks[s.block_table[i]].token_ids == tuple(
                    toks[i * self.bs : (i + 1) * self.bs]
                )
            assert [
                self.kv.get(s.block_table[p // self.bs] * self.bs + p % self.bs) for p in range(c)
            ] == [tuple(toks[: p + 1]) for p in range(c)]
        else:
            with pytest.raises(NoFreeBlocksError):
                self.bm.allocate(s)
            assert manager_state(self.bm) == before and s.block_table == []

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 99), frac=st.floats(0, 1))
    def compute(self, i, frac):
        s = self._pick(i, lambda s: s.num_uncomputed_tokens > 0)
        if s is None:
            return
        n = max(1, round(frac * s.num_uncomputed_tokens))
        before = manager_state(self.bm)
        if self.bm.can_append(s, n):
            self._write(s, n, *self.bm.append_slots(s, n))
        else:
            with pytest.raises(NoFreeBlocksError):
                self.bm.append_slots(s, n)
            assert manager_state(self.bm) == before

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 99), tok=st.integers(0, 3))
    def sample(self, i, tok):
        s = self._pick(i, lambda s: s.num_uncomputed_tokens == 0)
        if s is not None:
            s.append_token(tok)

    @precondition(lambda self: self.live)
    @rule(tok=st.integers(0, 3))
    def decode_batch(self, tok):
        """Every fully computed sequence samples a token; one batched call makes room for all of
        them."""
        seqs = [s for _, s in sorted(self.live.items()) if s.num_uncomputed_tokens == 0]
        for s in seqs:
            s.append_token(tok)
        before = manager_state(self.bm)
        try:
            slots, copies = self.bm.append_decode_slots(seqs)
        except NoFreeBlocksError:
            assert manager_state(self.bm) == before
            for s in seqs:
                s.token_ids.pop()
            return
        for s, slot in zip(seqs, slots):
            self._write(s, 1, [slot], [c for c in copies if c[1] == slot // self.bs], commit=False)
        assert len(copies) == len({d for _, d in copies})
        self.bm.commit_decodes(seqs)

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 99), frac=st.floats(0, 1), copy=st.booleans())
    def failed_step(self, i, frac, copy):
        """Slots are handed out, then the forward pass raises: the copies may or may not have run,
        the slots hold garbage, nothing is committed. Nothing may be published, and a retry
        (compute) must repair everything."""
        s = self._pick(i, lambda s: s.num_uncomputed_tokens > 0)
        if s is None:
            return
        n = max(1, round(frac * s.num_uncomputed_tokens))
        if not self.bm.can_append(s, n):
            return
        cached, computed = dict(self.bm.cache.cached), s.num_computed_tokens
        slots, copies = self.bm.append_slots(s, n)
        assert self.bm.append_slots(s, n) == (slots, copies)  # scheduling again is idempotent
        for src, dst in copies if copy else ():
            for k in range(self.bs):
                self.kv[dst * self.bs + k] = self.kv.get(src * self.bs + k)
        for slot in slots:
            self.kv[slot] = ("garbage",)
        assert (
            set(self.bm.cache.cached) <= set(cached) and s.num_computed_tokens == computed
        )  # nothing published (taking blocks may evict)

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 99))
    def fork(self, i):
        p = self._pick(
            i, lambda s: s.seq_id not in self.bm.cow_pending
        )  # the engine forks only after a committed step
        if p is None:
            return
        child = p.fork(self.next_id, 1)
        self.next_id += 1
        self.bm.fork(p, child)
        self.live[child.seq_id] = child
        assert child.block_table == p.block_table

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 99))
    def free(self, i):
        s = self._pick(i)
        self.bm.free(s)
        self.freed.append(self.live.pop(s.seq_id))
        assert s.block_table == []

    @precondition(lambda self: self.freed)
    @rule(i=st.integers(0, 99))
    def double_free(self, i):
        s = self.freed[i % len(self.freed)]
        before = manager_state(self.bm)
        with pytest.raises(KeyError, match=f"sequence {s.seq_id}"):
            self.bm.free(s)
        assert manager_state(self.bm) == before

    @rule()
    def free_unknown(self):
        with pytest.raises(KeyError, match="holds no blocks"):
            self.bm.free(mkseq(10**6, [1]))

    @invariant()
    def pool_is_consistent(self):
        bm = self.bm
        held = [b for s in self.live.values() for b in s.block_table]
        used = set(held) | set(bm.pins)  # in a table, or the source of a copy not yet committed
        free = list(bm.free_ids) + list(bm.cache.evictable)
        # free + used = total, and no block is both free and used
        assert len(free) == len(set(free)) and not set(free) & used
        assert len(free) + len(used) == bm.num_blocks == bm.num_free_blocks() + len(used)
        assert abs(bm.usage() - len(used) / bm.num_blocks) < 1e-12
        assert sum(bm.pins.values()) == sum(len(c) for c in bm.cow_pending.values()) and set(
            bm.cow_pending
        ) <= set(self.live)
        # ref counts equal the number of tables holding each block
        for blk in bm.blocks:
            assert blk.ref_count == held.count(blk.block_id), blk
        assert set(bm.seqs) == set(self.live)
        # the cache: hash -> block is a bijection onto the blocks carrying a hash; evictable ones
        # are cached and unreferenced
        assert {h: b for h, b in bm.cache.cached.items()} == {
            blk.hash: blk.block_id for blk in bm.blocks if blk.hash is not None
        }
        parked = [bm.blocks[b] for b in bm.cache.evictable]
        assert all(blk.hash is not None and blk.ref_count == 0 for blk in parked)
        assert all(bm.blocks[b].hash is None for b in bm.free_ids)

    @invariant()
    def cache_content_is_each_sequences_tokens(self):
        """Every computed position of every live sequence reads back its own token: CoW and prefix
        hits never mix sequences."""
        bs = self.bs
        for s in self.live.values():
            if s.seq_id in self.bm.cow_pending:
                continue  # a failed step's copy may not have run: its retry copies again first
            got = [
                self.kv.get(s.block_table[p // bs] * bs + p % bs)
                for p in range(s.num_computed_tokens)
            ]
            assert got == [tuple(s.token_ids[: p + 1]) for p in range(s.num_computed_tokens)], s
        for blk in self.bm.blocks:  # a cached block's content is the tokens it is published under
            if blk.hash is not None:
                assert tuple(self.kv[blk.block_id * bs + k][-1] for k in range(bs)) == blk.token_ids

    def teardown(self):
        "Freeing everything restores the full pool."
        if not hasattr(self, "bm"):
            return
        for s in list(self.live.values()):
            self.bm.free(s)
        bm = self.bm
        assert (
            bm.num_free_blocks() == bm.num_blocks
            and bm.usage() == 0
            and not bm.seqs
            and not bm.pins
            and not bm.cow_pending
        )
        assert all(b.ref_count == 0 for b in bm.blocks)


BlockManagerMachine.TestCase.settings = settings(
    max_examples=200,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestBlockManager = BlockManagerMachine.TestCase


@EXAMPLES
@given(prompts=st.lists(tokens, min_size=1, max_size=8), block_size=st.sampled_from([1, 2, 3, 4]))
def test_prefix_hit_is_longest_cached_prefix(prompts, block_size):
    """With room for everything (no eviction), a prompt reuses exactly its longest full-block prefix
    shared with an earlier one, minus the last token's block."""
    bm, bs = BlockManager(200, block_size), block_size
    for i, toks in enumerate(prompts):
        s = mkseq(i, toks)
        bm.allocate(s)
        best = 0
        for prev in prompts[:i]:
            k = 0
            while k < min(len(prev), len(toks)) and prev[k] == toks[k]:
                k += 1
            best = max(best, min(k // bs, (len(prev)) // bs))  # prev published all its full blocks
        want = min(best, (len(toks) - 1) // bs) * bs
        assert s.num_cached_tokens == s.num_computed_tokens == want
        for j in range(want // bs):
            assert bm.blocks[s.block_table[j]].token_ids == tuple(toks[j * bs : (j + 1) * bs])
        bm.append_slots(s, len(toks) - want)
        bm.commit(s, len(toks) - want)
        bm.free(s)
    assert bm.num_free_blocks() == bm.num_blocks


@EXAMPLES
@given(
    sizes=st.lists(st.integers(1, 40), min_size=1, max_size=10),
    num_blocks=st.integers(1, 16),
    block_size=st.sampled_from([1, 4, 16]),
)
def test_running_out_is_reported_and_changes_nothing(sizes, num_blocks, block_size):
    bm = BlockManager(num_blocks, block_size, enable_prefix_caching=False)
    for i, n in enumerate(sizes):
        s, before = mkseq(i, range(1000 * i, 1000 * i + n)), manager_state(bm)
        fits = -(-n // block_size) <= bm.num_free_blocks()
        assert bm.can_allocate(s) == fits and bm.blocks_needed(s) == -(-n // block_size)
        if fits:
            bm.allocate(s)
        else:
            with pytest.raises(NoFreeBlocksError):
                bm.allocate(s)
            assert manager_state(bm) == before and s.block_table == [] and s.seq_id not in bm.seqs


@EXAMPLES
@given(
    lens=st.lists(st.integers(1, 40), min_size=1, max_size=12),
    block_size=st.sampled_from([1, 2, 4, 8]),
    forks=st.lists(st.integers(0, 11), max_size=4),
    steps=st.integers(1, 20),
)
def test_batched_decode_equals_per_sequence(lens, block_size, forks, steps):
    """append_decode_slots gives the same slots, copies and state as append_slots(seq, 1) per
    sequence."""
    twins = []
    for _ in range(2):
        bm, seqs = BlockManager(2000, block_size), []
        for i, n in enumerate(lens):
            s = mkseq(i, [i % 3] * n)
            bm.allocate(s)
            k = n - s.num_computed_tokens
            bm.append_slots(s, k)
            bm.commit(s, k)
            seqs.append(s)
        for j, f in enumerate(forks):
            c = seqs[f % len(seqs)].fork(100 + j, 1)
            bm.fork(seqs[f % len(seqs)], c)
            seqs.append(c)
        twins.append((bm, seqs))
    (b1, s1), (b2, s2) = twins
    for t in range(steps):
        for s in s1 + s2:
            s.append_token(t % 5)
        got = b1.append_decode_slots(s1)
        slots, copies = [], []
        for s in s2:
            sl, cp = b2.append_slots(s, 1)
            slots += sl
            copies += cp
        assert got == (slots, copies)
        b1.commit_decodes(s1)
        for s in s2:
            b2.commit(s, 1)
        assert (
            b1.cache.cached == b2.cache.cached
            and b1.pins == b2.pins == {}
            and b1.cow_pending == b2.cow_pending == {}
        )
    assert [b.ref_count for b in b1.blocks] == [
        b.ref_count for b in b2.blocks
    ] and b1.num_free_blocks() == b2.num_free_blocks()
    assert [s.block_table for s in s1] == [s.block_table for s in s2]


@EXAMPLES
@given(toks=tokens, block_size=st.sampled_from([1, 2, 4]))
def test_free_unknown_and_double_free_raise(toks, block_size):
    bm = BlockManager(64, block_size)
    s = mkseq(7, toks)
    with pytest.raises(KeyError, match="sequence 7"):
        bm.free(s)
    bm.allocate(s)
    bm.free(s)
    with pytest.raises(KeyError, match="sequence 7 holds no blocks"):
        bm.free(s)
    assert bm.num_free_blocks() == 64


@EXAMPLES
@given(a=tokens, b=tokens, parent=st.binary(max_size=32))
def test_block_hash_names_the_content(a, b, parent):
    assert (hash_block(parent, a) == hash_block(parent, b)) == (a == b)
    assert hash_block(parent, a) == hash_block(bytes(parent), tuple(a))
    assert hash_block(b"", a) != hash_block(hash_block(b"", [4]), a)


# --- issue 10 item 1: publish at commit, never at scheduling ---


def test_failed_step_publishes_nothing():
    """append_slots without commit (the forward pass raised), then free: the same prompt gets no
    cache hit."""
    bm = BlockManager(8, 4)
    a = mkseq(0, range(10))
    bm.allocate(a)
    bm.append_slots(a, 10)
    assert not bm.cache.cached and a.num_computed_tokens == 0
    bm.free(a)
    b = mkseq(1, range(10))
    bm.allocate(b)
    assert b.num_cached_tokens == 0 and bm.stats.cache_hits == 0


def test_commit_publishes_the_blocks_the_step_filled():
    bm = BlockManager(8, 4)
    a = mkseq(0, range(10))
    bm.allocate(a)
    bm.append_slots(a, 6)
    bm.commit(a, 6)
    assert len(bm.cache.cached) == 1 and a.num_computed_tokens == 6  # block 0 full, block 1 half
    bm.append_slots(a, 4)
    bm.commit(a, 4)
    assert len(bm.cache.cached) == 2 and a.num_computed_tokens == 10
    with pytest.raises(ValueError, match="n must be in"):
        bm.commit(a, 1)
    with pytest.raises(KeyError):
        bm.commit(mkseq(5, [1]), 1)


def test_commit_without_slots_is_refused():
    bm = BlockManager(8, 4)
    a = mkseq(0, range(10))
    bm.allocate(a)
    a.append_token(1)
    a.append_token(2)
    a.append_token(3)  # 13 tokens, only 3 blocks reserved
    bm.append_slots(a, 10)
    bm.commit(a, 10)
    with pytest.raises(ValueError, match="have slots"):
        bm.commit(a, 3)


def test_retried_copy_on_write_is_handed_out_again_and_its_source_kept():
    bm = BlockManager(6, 4)
    p = mkseq(0, range(6))
    bm.allocate(p)
    bm.append_slots(p, 6)
    bm.commit(p, 6)
    c = p.fork(1, 1)
    bm.fork(p, c)
    p.append_token(9)
    c.append_token(8)
    first = bm.append_slots(p, 1)
    ((src, dst),) = first[1]
    bm.free(c)  # the only other holder leaves before the retry
    assert (
        bm.blocks[src].ref_count == 0
        and src in bm.pins
        and src not in bm.free_ids
        and src not in bm.cache.evictable
    )
    filler = mkseq(2, range(100, 112))  # takes every free block: src must not be among them
    if bm.can_allocate(filler):
        bm.allocate(filler)
        assert src not in filler.block_table
    assert bm.append_slots(p, 1) == first
    msg = r"^sequence \d+ has copies not yet committed; commit its step before forking it$"
    with pytest.raises(ValueError, match=msg):
        bm.fork(p, mkseq(3, [1]))  # forks come after a committed step
    bm.commit(p, 1)
    assert not bm.pins and not bm.cow_pending and (src in bm.free_ids or src in bm.cache.evictable)


def test_pools_and_managers_cache_prefixes_unless_told_not_to():
    assert BlockPool(2, 4).cache.enabled and BlockManager(2, 4).cache.enabled
    assert not BlockPool(2, 4, enable_prefix_caching=False).cache.enabled


def test_sibling_borrows_then_joins():
    bm = BlockManager(8, 4)
    lead, sib = mkseq(0, list(range(8)) + [1]), mkseq(1, list(range(8)) + [2, 3])
    bm.allocate(lead)
    bm.allocate_sibling(sib, lead, 2)
    assert [bm.blocks[b].ref_count for b in lead.block_table] == [
        1,
        1,
        1,
    ] and bm.num_free_blocks() == 4
    bm.append_slots(lead, 9)  # the leader writes the lent blocks as their only owner: no copy
    assert bm.cow_pending == {}
    bm.commit(lead, 9)
    bm.join_sibling(sib)
    assert sib.num_computed_tokens == 8 and [bm.blocks[b].ref_count for b in lead.block_table] == [
        2,
        2,
        1,
    ]
    bm.free(sib)
    bm.free(lead)
    assert bm.num_free_blocks() == 8 and all(b.ref_count == 0 for b in bm.blocks)


def test_sibling_freed_before_joining_releases_only_its_own():
    bm = BlockManager(8, 4)
    lead, sib = mkseq(0, list(range(8)) + [1]), mkseq(1, list(range(8)) + [2, 3])
    bm.allocate(lead)
    bm.allocate_sibling(sib, lead, 2)
    bm.free(sib)
    assert (
        [bm.blocks[b].ref_count for b in lead.block_table] == [1, 1, 1]
        and bm.num_free_blocks() == 5
        and not bm.lent
    )


# --- found by mutation testing (make mutation): each pins a behaviour a surviving mutant changed --


def test_sibling_bounds_on_k():
    """k counts leading full blocks both share, leaving the sibling at least one token to compute: 0
    is allowed."""
    bm = BlockManager(10, 4)
    lead = mkseq(0, list(range(8)) + [1])
    bm.allocate(lead)
    sib9 = mkseq(1, list(range(8)) + [2])  # 9 tokens: (9 - 1) // 4 = 2 blocks may be shared
    bm.allocate_sibling(sib9, lead, 2)
    assert sib9.block_table[:2] == lead.block_table[:2] and bm.lent[1] == 2
    sib8 = mkseq(2, range(8))  # 8 tokens: sharing both full blocks leaves nothing to compute
    with pytest.raises(ValueError, match="k must count leading full blocks"):
        bm.allocate_sibling(sib8, lead, 2)
    bm.allocate_sibling(sib8, lead, 1)
    assert sib8.block_table[0] == lead.block_table[0] and sib8.block_table[1] != lead.block_table[1]
    other = mkseq(3, [7] + list(range(1, 8)) + [2])  # first block differs from the leader's
    with pytest.raises(ValueError, match="k must count leading full blocks"):
        bm.allocate_sibling(other, lead, 1)
    bm.allocate_sibling(other, lead, 0)  # k = 0: nothing shared, all its own blocks
    assert not set(other.block_table) & set(lead.block_table) and bm.lent[3] == 0


def test_sibling_starts_from_scratch_counts_an_allocation_and_may_take_the_last_block():
    bm = BlockManager(4, 4)
    lead = mkseq(0, list(range(8)) + [1])
    bm.allocate(lead)  # 3 blocks, 1 free
    sib = mkseq(1, list(range(8)) + [2])
    before = bm.stats.allocations
    bm.allocate_sibling(sib, lead, 2)  # needs exactly the one free block
    assert bm.stats.allocations == before + 1 and bm.num_free_blocks() == 0
    assert (sib.num_computed_tokens, sib.num_cached_tokens) == (0, 0)
    with pytest.raises(NoFreeBlocksError, match="needs 3 blocks, 0 free"):
        bm.allocate_sibling(mkseq(2, range(9)), lead, 0)


def test_sibling_and_fork_refuse_a_sequence_that_holds_blocks():
    bm = BlockManager(10, 4)
    lead = mkseq(0, list(range(8)) + [1])
    bm.allocate(lead)
    same_id = mkseq(0, list(range(8)) + [2])  # empty table, but its id holds blocks here
    with pytest.raises(ValueError, match="sequence 0 already holds blocks"):
        bm.allocate_sibling(same_id, lead, 2)
    with pytest.raises(ValueError, match="sequence 0 already holds blocks"):
        bm.fork(lead, same_id)
    stray = mkseq(5, list(range(8)) + [2])
    stray.block_table = [9]  # a table this manager never gave out
    with pytest.raises(ValueError, match="sequence 5 already holds blocks"):
        bm.allocate_sibling(stray, lead, 2)
    with pytest.raises(ValueError, match="sequence 5 already holds blocks"):
        bm.fork(lead, stray)
    with pytest.raises(KeyError, match="sequence 7 holds no blocks; cannot fork it"):
        bm.fork(mkseq(7, [1]), mkseq(8, [1]))


def test_can_append_defaults_to_one_token_and_counts_evictable_blocks():
    bm = BlockManager(3, 4)
    a = mkseq(0, range(7))
    bm.allocate(a)
    bm.append_slots(a, 7)
    bm.commit(a, 7)
    b = mkseq(1, range(100, 104))
    bm.allocate(b)
    bm.append_slots(b, 4)
    bm.commit(b, 4)
    a.append_token(1)
    a.append_token(2)  # position 7 lies in a's second block, 8 in a third
    assert bm.can_append(a) and not bm.can_append(
        a, 2
    )  # a second token needs a third block: none free
    bm.free(b)  # b's full block is cached: evictable, not free
    assert not bm.free_ids and len(bm.cache.evictable) == 1
    assert bm.can_append(a, 2)


def test_decode_of_a_fully_computed_sequence_is_refused():
    bm = BlockManager(4, 4)
    a = mkseq(0, range(3))
    bm.allocate(a)
    bm.append_slots(a, 3)
    bm.commit(a, 3)  # nothing left to compute
    with pytest.raises(ValueError, match="n must be in"):
        bm.append_decode_slots([a])


def test_copies_of_one_block_for_two_forks_are_unpinned_in_full():
    "Two forks copy the same two shared blocks; committing each releases its pins on both sources."
    bm = BlockManager(12, 4)
    p = mkseq(0, range(10))
    bm.allocate(p)
    bm.append_slots(p, 5)
    bm.commit(p, 5)
    kids = [p.fork(i, i) for i in (1, 2)]
    for k in kids:
        bm.fork(p, k)
    copies = [bm.append_slots(k, 5)[1] for k in kids]
    assert [len(c) for c in copies] == [2, 2] and len(bm.pins) == 2 and bm.stats.cow_copies == 4
    for k in kids:
        bm.commit(k, 5)
    assert not bm.pins and not bm.cow_pending
    for s in (p, *kids):
        bm.free(s)
    assert bm.num_free_blocks() == 12 and all(b.ref_count == 0 for b in bm.blocks)


def test_bad_n_is_refused_naming_the_range():
    bm = BlockManager(4, 4)
    a = mkseq(0, range(3))
    bm.allocate(a)
    bm.append_slots(a, 1)
    bm.commit(a, 1)  # 2 tokens left to compute
    for n in (0, 3):
        with pytest.raises(ValueError, match=r"n must be in \[1, 2\] for sequence 0, got %d" % n):
            bm.append_slots(a, n)
        with pytest.raises(ValueError, match=r"n must be in \[1, 2\]"):
            bm.can_append(a, n)
    with pytest.raises(ValueError, match=r"n must be in \[1, 2\] and have slots"):
        bm.commit(a, 3)
    assert bm.append_slots(a) == ([1], [])  # n defaults to one token
    bm.free(a)
    with pytest.raises(KeyError, match="sequence 0 holds no blocks; allocate it first"):
        bm.append_slots(a, 1)
    with pytest.raises(KeyError, match="sequence 0 holds no blocks; allocate it first"):
        bm.append_decode_slots([a])
    with pytest.raises(KeyError, match=r"sequence 0 holds no blocks \(unknown or already freed\)"):
        bm.commit(a, 1)


def test_copy_on_write_counts_only_the_blocks_written():
    """A fork writing one position of a shared block needs one copy, even with more shared blocks
    after it."""
    bm = BlockManager(4, 4)
    p = mkseq(0, range(10))
    bm.allocate(p)
    bm.append_slots(p, 5)
    bm.commit(p, 5)  # blocks 0..2, 1 free
    c = p.fork(1, 1)
    bm.fork(p, c)
    assert bm.can_append(c, 1)  # writes block 1 only: one copy, one free block
    slots, copies = bm.append_slots(c, 1)
    assert len(copies) == 1 and bm.num_free_blocks() == 0
    with pytest.raises(
        NoFreeBlocksError, match="sequence 0 needs 1 blocks to append 5 tokens, 0 free"
    ):
        bm.append_slots(p, 5)


def test_decodes_may_take_the_last_free_blocks():
    bm = BlockManager(4, 4)
    a, b = mkseq(0, range(4)), mkseq(1, range(10, 14))
    for s in (a, b):
        bm.allocate(s)
        bm.append_slots(s, 4)
        bm.commit(s, 4)
        s.append_token(7)
    slots, copies = bm.append_decode_slots([a, b])  # two new blocks, two free
    assert len(slots) == 2 and not copies and bm.num_free_blocks() == 0
    bm.commit_decodes([a, b])
    for s in (a, b):
        s.append_token(7)
    c = mkseq(2, range(20, 24))
    bm.free(b)
    bm.allocate(c)
    bm.append_slots(c, 4)
    bm.commit(c, 4)
    c.append_token(1)
    assert bm.num_free_blocks() == 1  # c's next decode needs a new block
    d = mkseq(3, range(30, 34))
    bm.allocate(d)
    bm.append_slots(d, 4)
    bm.commit(d, 4)
    d.append_token(1)
    with pytest.raises(NoFreeBlocksError, match="2 decodes need 2 blocks, 0 free"):
        bm.append_decode_slots([c, d])


def test_without_prefix_caching_commit_publishes_nothing():
    bm = BlockManager(4, 4, enable_prefix_caching=False)
    a = mkseq(0, range(9))
    bm.allocate(a)
    bm.append_slots(a, 9)
    bm.commit(a, 9)
    assert not bm.cache.cached and all(b.hash is None for b in bm.blocks)
    bm.free(a)
    assert not bm.cache.evictable and sorted(bm.free_ids) == [0, 1, 2, 3]


def test_constructor_bounds_name_the_field():
    for args, msg in (
        ((0, 4), "num_blocks must be an integer >= 1, got 0"),
        ((4, 0), "block_size must be an integer >= 1, got 0"),
    ):
        with pytest.raises(ValueError, match=msg):
            BlockManager(*args)


def test_allocate_counts_evictable_prefix_hits_against_the_pool():
    """Reusing an evictable cached block takes it out of the pool too: a request needing more than
    the pool is refused, state unchanged."""
    bm = BlockManager(3, 4)
    a = mkseq(0, range(8))
    bm.allocate(a)
    bm.append_slots(a, 8)
    bm.commit(a, 8)
    bm.free(a)  # 2 evictable, 1 free
    x = mkseq(1, [50])
    bm.allocate(x)  # takes the free block
    b = mkseq(2, list(range(8)) + [1, 2, 3, 4, 5])  # hits a's 2 blocks, needs 2 more: 4 > 2
    before = manager_state(bm)
    with pytest.raises(NoFreeBlocksError, match=r"sequence 2 needs 4 blocks \(2 new\), 2 free"):
        bm.allocate(b)
    assert manager_state(bm) == before
    same_id = mkseq(1, [60])  # empty table, but id 1 holds blocks here
    with pytest.raises(ValueError, match="sequence 1 already holds blocks"):
        bm.allocate(same_id)


def test_stats_count_each_allocation():
    bm = BlockManager(6, 4)
    a = mkseq(0, range(9))
    bm.allocate(a)
    bm.append_slots(a, 9)
    bm.commit(a, 9)  # publishes blocks 0 and 1
    b = mkseq(1, range(8))
    bm.allocate(b)  # 8 tokens: may reuse 1 block (one token left to compute)
    c = mkseq(2, range(9))
    bm.allocate(c)  # 9 tokens: reuses 2 blocks
    st = bm.stats
    assert (
        st.allocations,
        st.blocks_allocated,
        st.cache_queries,
        st.cache_hits,
        st.cached_tokens,
    ) == (3, 5, 2 + 1 + 2, 3, 12)
    assert st.hit_rate == 3 / 5


def test_a_decode_that_fills_a_sequences_first_block_publishes_that_block():
    "commit_decodes reaching position block_size publishes block 0: a later prompt hits it."
    bm = BlockManager(4, 4)
    a = mkseq(0, [5, 6, 7])
    bm.allocate(a)
    bm.append_slots(a, 3)
    bm.commit(a, 3)
    a.append_token(8)
    bm.append_decode_slots([a])
    bm.commit_decodes([a])  # position 3 computed: block 0 is full
    blk = bm.blocks[a.block_table[0]]
    assert blk.token_ids == (5, 6, 7, 8) and blk.hash == hash_block(b"", [5, 6, 7, 8])
    bm.free(a)
    b = mkseq(1, [5, 6, 7, 8, 9])
    bm.allocate(b)
    assert b.num_cached_tokens == 4


def test_hash_block_hashes_signed_64_bit_ids_chained_from_an_empty_parent():
    "The hash is sha256(parent + int64 ids), pinned: a cached prefix means the same everywhere."
    assert hash_block(b"", [-1, 2]) == hashlib.sha256(array("q", [-1, 2]).tobytes()).digest()
    s = mkseq(0, [1, 2, 3, 4, 5])
    BlockManager(4, 4).allocate(s)
    assert s.block_hashes == [hash_block(b"", [1, 2, 3, 4])]  # the first block's parent is b""
