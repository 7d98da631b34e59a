"""The measurements of 17_kv_offload: swap vs recompute time to resume, multi-turn prefix reuse."""

from __future__ import annotations
import statistics
import time
import torch
from ..core.sampling_params import SamplingParams
from ..scheduler.output import SchedulerOutput
from .plugin import KVOffloadPlugin


def _ids(n: int, vocab: int, seed: int) -> list[int]:
    "`n` random token ids."
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n,), generator=g).tolist()


def time_to_resume(
    engine,  # an LLMEngine; its preemption_mode decides swap or recompute
    context_len: int,  # tokens of KV the preempted request holds
    repeats: int = 3,
) -> dict:
    """Preempt one request holding `context_len` tokens of KV and time its way back to the next
    token (median seconds of `repeats`), and the preemption itself (the swap-out copy)."""
    vocab, resume, evict = engine.runner.model.config.vocab_size, [], []
    tiers = [p for p in engine.plugins if isinstance(p, KVOffloadPlugin)]
    for r in range(repeats):
        rid = f"ttr-{context_len}-{r}"
        engine.add_request(rid, _ids(context_len, vocab, r), SamplingParams(max_tokens=3))
        seq = engine.requests[rid].seqs[0]
        while seq.num_output_tokens < 1:  # prefill, first token
            engine.step()
        t0 = time.perf_counter()
        out = SchedulerOutput()
        engine.scheduler.preempt(seq, out)  # as the scheduler does when blocks are short
        for p in tiers:
            p.after_schedule(engine, out)  # the swap-out copy
        t1 = time.perf_counter()
        while seq.num_output_tokens < 2:  # swap-in + a decode, or the whole prefill again
            engine.step()
        resume.append(time.perf_counter() - t1)
        evict.append(t1 - t0)
        while engine.has_unfinished_requests():
            engine.step()
    return dict(
        context_len=context_len,
        resume_s=statistics.median(resume),
        resume_spread_s=max(resume) - min(resume),
        preempt_s=statistics.median(evict),
    )


def multi_turn(
    engine,  # a fresh LLMEngine (its pool, prefix caching and host tier as configured)
    conversations: int = 10,  # conversations, each with its own system prompt
    system_len: int = 256,  # tokens of each system prompt
    question_len: int = 32,  # tokens of each user turn
    answer_len: int = 16,  # tokens generated per turn
) -> dict:
    """Two rounds of `conversations` chats: round 2 sends each conversation again with its answer
    and a new question. Round 2's prefix hits per tier, prefill tokens, mean TTFT, throughput."""
    vocab = engine.runner.model.config.vocab_size
    p = SamplingParams(temperature=0, max_tokens=answer_len)
    first = [
        _ids(system_len, vocab, 100 + i) + _ids(question_len, vocab, 200 + i)
        for i in range(conversations)
    ]
    answers = _round(engine, "a", first, p)[0]
    second = [
        f + a + _ids(question_len, vocab, 300 + i) for i, (f, a) in enumerate(zip(first, answers))
    ]
    before = _counts(engine)
    tokens, ttft, seconds = _round(engine, "b", second, p)
    queries, device, host, prefill = (a - b for a, b in zip(_counts(engine), before))
    return dict(
        device_hit_rate=device / max(queries, 1),
        host_hit_rate=host / max(queries, 1),
        prefill_tokens=prefill,
        mean_ttft_s=statistics.mean(ttft),
        tokens_per_s=sum(len(t) for t in tokens) / seconds,
        seconds=seconds,
        tokens=tokens,
    )


def _counts(engine) -> tuple[int, int, int, int]:
    "Prefix blocks looked up, found on the device, found on the host; prefill tokens so far."
    st = engine.stats
    pc, host = st["prefix_cache"], st.get("kv_offload", {}).get("host_prefix_hits", 0)
    return pc["cache_queries"], pc["cache_hits"], host, engine.scheduler.stats.prefill_tokens


def _round(engine, tag: str, prompts: list, p: SamplingParams):
    "Send `prompts` at once and run them to the end: tokens, TTFTs (s) and the wall time (s)."
    t0 = time.perf_counter()
    for i, ids in enumerate(prompts):
        engine.add_request(f"{tag}{i}", ids, p)
    done = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                done[o.request_id] = o
    seconds = time.perf_counter() - t0
    outs = [done[f"{tag}{i}"] for i in range(len(prompts))]
    return [o.outputs[0].token_ids for o in outs], [o.metrics.ttft for o in outs], seconds
