"""The sampler's penalties are incremental: each step reads only the tokens appended since the last
one.

`Sampler.adjust_logits` keeps a `PenaltyCounts` on the sampler and brings it up to date with each
step's new tokens; rebuilding the counts from the Python token lists (`seen_tokens` over every
prompt and output) gives the same logits but costs O(context) per step. These tests fail if the
sampler goes back to the from-scratch path."""

import pytest
import torch

import hetero_infer.sample.penalties as penalties_mod
from hetero_infer.core.sequence import Sequence
from hetero_infer.core.sampling_params import SamplingParams
from hetero_infer.sample.penalties import SeenPairs, apply_penalties, seen_tokens
from hetero_infer.sample.sampler import Sampler

V = 50
PENALTIES = dict(presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.3)


def seq(seq_id, prompt, out=(), **kw) -> Sequence:
    "A sequence with prompt `prompt` that has generated `out` so far."
    return Sequence(
        seq_id, f"r{seq_id}", list(prompt) + list(out), len(prompt), SamplingParams(**kw)
    )


def reference(logits, seqs):
    "The from-scratch penalized logits: counts rebuilt from every prompt and output token."
    rows, toks, counts = seen_tokens(
        [s.prompt_token_ids for s in seqs], [s.output_token_ids for s in seqs], V
    )
    col = lambda k: torch.tensor([getattr(s.params, f"{k}_penalty") for s in seqs])
    return apply_penalties(
        logits, rows, toks, counts, col("presence"), col("frequency"), col("repetition")
    )


@pytest.fixture
def added(monkeypatch):
    """Record the (row, token) occurrences each `SeenPairs.add` call counts; the from-scratch
    `seen_tokens` raises."""
    calls, add = [], SeenPairs.add

    def spy(self, rows, toks, weights):
        calls.append(list(zip(rows, toks)))
        return add(self, rows, toks, weights)

    monkeypatch.setattr(SeenPairs, "add", spy)

    def from_scratch(*a, **k):
        raise AssertionError("adjust_logits rebuilt the penalty counts from the token lists")

    monkeypatch.setattr(penalties_mod, "seen_tokens", from_scratch)
    return calls


def test_each_step_counts_only_the_new_tokens(added):
    seqs = [
        seq(0, [1, 2, 3, 2], [7], **PENALTIES),
        seq(1, [4, 4], [], **PENALTIES),
        seq(2, [9], [9, 9], temperature=0),
    ]
    smp, g = Sampler(eos_token_ids=[0]), torch.Generator().manual_seed(0)
    logits = torch.randn(3, V, generator=g)
    expect = reference(logits[:2], seqs[:2])
    got = smp.adjust_logits(logits, seqs)
    assert torch.allclose(got[:2], expect) and torch.equal(
        got[2], logits[2]
    )  # the unpenalized row is untouched
    assert (
        sum(len(c) for c in added) == 5 + 2
    )  # first step: prompt + output of the two penalized rows
    pc = smp.penalty_counts
    for step in range(4):
        for s, t in zip(seqs, (3, 4, 5 + step)):
            s.append_token(t)
        added.clear()
        logits = torch.randn(3, V, generator=g)
        got = smp.adjust_logits(logits, seqs)
        assert smp.penalty_counts is pc  # the same counts object, kept across steps
        assert sorted(t for c in added for _, t in c) == [
            3,
            4,
        ]  # one new token per penalized row, nothing else
        assert torch.allclose(got[:2], reference(logits[:2], seqs[:2]))
        assert [pc.synced[pc.row_of[id(s)]] for s in seqs[:2]] == [
            s.num_output_tokens for s in seqs[:2]
        ]


def test_a_call_with_no_new_tokens_counts_nothing(added):
    s = seq(0, [5, 6, 5], [6, 8], **PENALTIES)
    smp, logits = Sampler(), torch.randn(1, V, generator=torch.Generator().manual_seed(1))
    first = smp.adjust_logits(logits, [s])
    added.clear()
    assert torch.equal(smp.adjust_logits(logits, [s]), first)  # e.g. a retried step: same logits
    assert sum(len(c) for c in added) == 0
