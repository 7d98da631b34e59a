"""The host tier of the KV cache (17_kv_offload): swap preemption and the offloaded prefix cache,
through the engine on a tiny random Llama.

Every scenario checks greedy tokens against a run that never preempts, and `kv_audit` (no block
lost or leaked on the device or in either host pool) after every step."""

import ast
import pathlib
import re

import pytest
import torch
from conftest import SaysCuda

import hetero_infer

from hetero_infer.core.config import EngineConfig
from hetero_infer.core.sampling_params import SamplingParams
from hetero_infer.core.sequence import SequenceStatus
from hetero_infer.engine.llm_engine import LLMEngine
from hetero_infer.kv_cache.block_manager import BlockManager
from hetero_infer.kv_offload.plugin import KVOffloadPlugin
from hetero_infer.kv_offload.tier import kv_audit
from hetero_infer.scheduler.scheduler import Scheduler
from hetero_infer.testing import tiny_hf_checkpoint

CPU = dict(device="cpu", dtype="float32", block_size=4, max_model_len=128)
BLOCK_BYTES = 2 * 2 * 4 * 2 * 16 * 4  # layers x (k, v) x bs x kv heads x head_dim x fp32
GIB_PER_BLOCK = BLOCK_BYTES / 2**30


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_offload")
    tiny_hf_checkpoint(
        path, "llama", vocab_size=128, bos_token_id=None, eos_token_id=None, pad_token_id=None
    )
    return path


def engine(path, **kw) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(path), **{**CPU, **kw}))


def tier_of(eng) -> KVOffloadPlugin:
    "The engine's host-tier plugin."
    (p,) = [p for p in eng.plugins if isinstance(p, KVOffloadPlugin)]
    return p


def prompts(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 128, (n,), generator=g).tolist() for n in lengths]


def run(eng, reqs, max_steps=3000, abort_at=None, on_step=None):
    """Step `eng` until done, adding requests as they come: `reqs` is a list of (rid, ids, params,
    step, arrival_time), or a function (engine, step) -> such tuples to add now. Returns {rid:
    [token ids of each completion]} of the finished ones; kv_audit must hold after every step."""
    done, step = {}, 0
    pending = [] if callable(reqs) else sorted(reqs, key=lambda r: r[3])
    more = getattr(reqs, "more", lambda: False)  # a workload function still to add requests
    while pending or eng.has_unfinished_requests() or more():
        new = reqs(eng, step) if callable(reqs) else []
        while pending and pending[0][3] <= step:
            new.append(pending.pop(0))
        for rid, ids, p, _, t in new:
            eng.add_request(rid, ids, p, arrival_time=t)
        if abort_at and step in abort_at:
            eng.abort_request(abort_at[step])
        for o in eng.step():
            if o.finished and o.outputs[0].finish_reason != "abort":
                done[o.request_id] = [c.token_ids for c in o.outputs]
        assert kv_audit(eng.scheduler) == [], (step, kv_audit(eng.scheduler))
        if on_step:
            on_step(eng, step)
        step += 1
        assert step < max_steps
    assert kv_audit(eng.scheduler) == [] and not eng.block_manager.seqs
    return done


def preempted_requests(eng) -> set:
    "Wrap the scheduler's preemption to record every victim's request id."
    seen, orig = set(), eng.scheduler.preempt

    def spy(victim, out):
        seen.add(victim.request_id)
        return orig(victim, out)

    eng.scheduler.preempt = spy
    return seen


VICTIMS = [(5, 1, 40), (11, 2, 24), (18, 1, 24), (26, 1, 24), (33, 1, 24)]  # (prompt, n, max)


def workload():
    """Five requests of several prompt lengths (one with n=2), one at a time; each is joined, once
    it has 2 tokens, by a more urgent `driver` (earlier arrival_time) that needs the blocks: the
    scheduler preempts the victim, and resumes it when the driver is done."""
    ps, drv = prompts([v[0] for v in VICTIMS]), prompts([9], seed=1)[0]
    state = {"i": 0, "phase": "victim"}

    def arrive(eng, step):
        i = state["i"]
        if i == len(VICTIMS) or any(r.startswith(f"r{i - 1}") for r in eng.requests):
            return []  # all added, or the last pair is not done yet
        if state["phase"] == "victim":
            state["phase"] = "driver"
            p = SamplingParams(temperature=0, max_tokens=VICTIMS[i][2], n=VICTIMS[i][1])
            return [(f"r{i}", ps[i], p, step, float(i))]
        req = eng.requests.get(f"r{i}")
        if req is None or max(s.num_output_tokens for s in req.seqs) < 2:
            return []
        state["i"], state["phase"] = i + 1, "victim"
        p = SamplingParams(temperature=0, max_tokens=48)
        return [(f"r{i}-driver", drv, p, step, float(i) - 0.5)]

    arrive.more = lambda: state["i"] < len(VICTIMS)
    return arrive


SMALL = dict(num_blocks=16, max_num_batched_tokens=16, max_num_seqs=8, enable_prefix_caching=True)


def test_swap_and_recompute_give_the_same_tokens_as_no_preemption(tiny_path):
    ref = run(engine(tiny_path, num_blocks=256), workload())
    results, stats = {}, {}
    for mode in ("recompute", "swap"):
        eng = engine(tiny_path, preemption_mode=mode, swap_space=256 * GIB_PER_BLOCK, **SMALL)
        victims = preempted_requests(eng)
        results[mode] = run(eng, workload())
        stats[mode] = {**eng.stats, "prefill_tokens": eng.scheduler.stats.prefill_tokens}
        assert victims == {f"r{i}" for i in range(len(VICTIMS))}, victims  # each, drivers never
    assert results["recompute"] == ref
    assert results["swap"] == ref
    kv = stats["swap"]["kv_offload"]
    assert kv["swapped_out"] >= 5 and kv["swapped_in"] == kv["swapped_out"]
    assert kv["recompute_fallbacks"] == 0 and kv["transfer_failures"] == 0
    assert kv["transfer_blocks_out"] > 0 and kv["swap_blocks_free"] == 256
    assert "kv_offload" not in stats["recompute"]  # off: the stats are as before
    # swap resumes without recomputing: fewer prefill tokens than recompute
    assert stats["swap"]["prefill_tokens"] < stats["recompute"]["prefill_tokens"]


def test_resuming_forks_that_share_a_partly_filled_block_never_crashes_the_step(tiny_path):
    """n > 1 forks share their partly filled last block; swapped back in, each write copies it
    (copy-on-write), so a swap-in must find those blocks too, or scheduling raises
    NoFreeBlocksError outside the step's retry guard. Outputs equal the run that never preempts."""
    arrive, plen, max_tokens, n = [2, 2, 3, 4], [11, 11, 5, 7], [20, 7, 5, 10], [2, 2, 3, 3]
    ps = [list(range(3, 3 + k)) for k in plen]
    reqs = [
        (f"r{i}", ps[i], SamplingParams(temperature=1.0, seed=i, max_tokens=m, n=k), a, float(i))
        for i, (a, m, k) in enumerate(zip(arrive, max_tokens, n))
    ]
    ref = run(engine(tiny_path, num_blocks=256), reqs)
    kw = dict(num_blocks=16, max_num_batched_tokens=16, preemption_mode="swap")
    eng = engine(tiny_path, swap_space=256 * GIB_PER_BLOCK, **kw)
    assert run(eng, reqs) == ref
    assert eng.stats["kv_offload"]["swapped_in"] > 0


def test_a_small_swap_space_falls_back_to_recompute(tiny_path):
    ref = run(engine(tiny_path, num_blocks=256), workload())
    eng = engine(tiny_path, preemption_mode="swap", swap_space=3 * GIB_PER_BLOCK, **SMALL)
    assert run(eng, workload()) == ref
    kv = eng.stats["kv_offload"]
    assert kv["recompute_fallbacks"] > 0 and kv["swap_blocks_free"] == 3


def conversations(n=10, system=24, turn=6):
    "`n` conversations, each with its own system prompt of `system` tokens and a first question."
    return [p + q for p, q in zip(prompts([system] * n, seed=2), prompts([turn] * n, seed=3))]


def two_rounds(path, **kw):
    """Round 1: ten conversations one after another; round 2: each goes on (its prompt, the answer,
    a new question). Returns the round-2 tokens, the engine and its prefill tokens in round 2."""
    eng = engine(path, num_blocks=14, max_num_seqs=1, max_num_batched_tokens=64, **kw)
    p = SamplingParams(temperature=0, max_tokens=8)
    first = conversations()
    r1 = run(eng, [(f"a{i}", ids, p, 0, float(i)) for i, ids in enumerate(first)])
    follow = prompts([5] * len(first), seed=4)
    second = [ids + r1[f"a{i}"][0] + q for i, (ids, q) in enumerate(zip(first, follow))]
    before = eng.scheduler.stats.prefill_tokens
    r2 = run(eng, [(f"b{i}", ids, p, 0, float(i)) for i, ids in enumerate(second)])
    return r2, eng, eng.scheduler.stats.prefill_tokens - before


def test_a_host_prefix_tier_serves_the_second_round(tiny_path):
    # the device pool (14 blocks of 4) holds one conversation (<= 13 blocks); the host tier ten
    base, eng0, prefill0 = two_rounds(tiny_path)
    tiered, eng1, prefill1 = two_rounds(tiny_path, kv_offloading_size=120 * GIB_PER_BLOCK)
    assert tiered == base
    kv = eng1.stats["kv_offload"]
    assert kv["host_prefix_hits"] >= 10 * 6, kv  # >= 6 blocks (24 tokens) of each conversation
    assert prefill1 < prefill0 / 2, (prefill1, prefill0)
    assert eng0.stats["prefix_cache"]["cache_hits"] <= 10  # without it: at most one device hit
    assert kv["transfer_failures"] == 0


class FailOnce:
    "A `copy_blocks` that raises on its n-th call, then copies."

    def __init__(self, n, copy):
        self.n, self.copy, self.calls = n, copy, 0

    def __call__(self, *a):
        self.calls += 1
        if self.calls == self.n:
            raise RuntimeError("injected copy failure")
        return self.copy(*a)


@pytest.mark.parametrize("fail_at", [1, 2, 3, 5])
def test_a_failed_copy_recomputes_and_never_serves_stale_kv(tiny_path, fail_at):
    ref = run(engine(tiny_path, num_blocks=256), workload())
    eng = engine(
        tiny_path,
        preemption_mode="swap",
        swap_space=256 * GIB_PER_BLOCK,
        kv_offloading_size=64 * GIB_PER_BLOCK,
        **SMALL,
    )
    tier = tier_of(eng).tier
    tier.copy = FailOnce(fail_at, tier.copy)
    assert run(eng, workload()) == ref
    assert tier.copy.calls >= fail_at
    assert eng.stats["kv_offload"]["transfer_failures"] == 1


def test_aborts_leave_no_block_behind_in_either_tier(tiny_path):
    eng = engine(
        tiny_path,
        preemption_mode="swap",
        swap_space=256 * GIB_PER_BLOCK,
        kv_offloading_size=64 * GIB_PER_BLOCK,
        **SMALL,
    )
    aborted = []

    def abort(e, step):  # a request while it is swapped out, and a driver while it runs
        if not aborted and e.scheduler.swapped:
            aborted.append(e.scheduler.swapped[0].request_id)
            e.abort_request(aborted[-1])
        if "r3-driver" in e.requests and len(aborted) == 1:
            aborted.append("r3-driver")
            e.abort_request("r3-driver")

    done = run(eng, workload(), on_step=abort)
    assert len(aborted) == 2 and not set(aborted) & set(done)
    st = eng.stats["kv_offload"]
    assert st["swapped"] == 0 and st["swap_blocks_free"] == 256
    assert not tier_of(eng).tier.prefix.pins
    assert eng.block_manager.num_free_blocks() == 16


def test_an_engine_without_a_host_tier_builds_none_of_it(tiny_path):
    eng = engine(tiny_path, swap_space=4)  # preemption_mode="recompute", kv_offloading_size=0
    assert not any(isinstance(p, KVOffloadPlugin) for p in eng.plugins)
    assert type(eng.scheduler) is Scheduler and type(eng.block_manager) is BlockManager
    assert "kv_offload" not in eng.stats


def test_the_block_manager_and_the_scheduler_know_nothing_of_the_host_tier():
    "Chapters 01 and 02 import nothing of chapter 17 and name none of its parts."
    root = pathlib.Path(hetero_infer.__file__).parent
    files = sorted((root / "kv_cache").glob("*.py")) + sorted((root / "scheduler").glob("*.py"))
    assert len(files) >= 5
    for f in files:
        src = f.read_text()
        for node in ast.walk(ast.parse(src)):
            if isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            assert not any("kv_offload" in n for n in names), (f.name, names)
        assert not re.search(r"swap|host|offload|tier", src, re.IGNORECASE), f.name


def test_swapped_is_a_state_of_its_own():
    assert not SequenceStatus.SWAPPED.finished and SequenceStatus.SWAPPED.finish_reason is None


@pytest.mark.parametrize(
    "kw, field",
    [
        ({"preemption_mode": "drop"}, "preemption_mode"),
        ({"swap_space": -1}, "swap_space"),
        ({"kv_offloading_size": "4"}, "kv_offloading_size"),
        ({"preemption_mode": "swap", "tensor_parallel_size": 2}, "preemption_mode"),
        ({"kv_offloading_size": 1, "tensor_parallel_size": 2}, "kv_offloading_size"),
        ({"kv_offloading_size": 1, "enable_prefix_caching": False}, "kv_offloading_size"),
    ],
)
def test_bad_values_are_refused_naming_the_field(kw, field):
    with pytest.raises(ValueError, match=field):
        EngineConfig(**kw)


@pytest.mark.parametrize(
    "kw, field",
    [
        ({"preemption_mode": "swap", "swap_space": 125.0}, "swap_space"),
        ({"kv_offloading_size": 125.0}, "kv_offloading_size"),
        ({"preemption_mode": "swap", "swap_space": 45.0, "kv_offloading_size": 50.0}, None),
    ],
)
def test_a_host_tier_beyond_the_machines_memory_is_refused_naming_the_field(monkeypatch, kw, field):
    "On a 100 GiB machine at most 70 GiB; swap_space counts only with preemption_mode='swap'."
    import hetero_infer.kv_offload.plugin as plugin

    monkeypatch.setattr(plugin, "host_memory_gib", lambda: 100.0)
    with pytest.raises(ValueError, match=f"^{field or 'kv_offloading_size'}: .* 100.0 GiB"):
        EngineConfig(**kw)
    assert EngineConfig(swap_space=125.0).swap_space == 125.0  # recompute: no pool is made
    assert EngineConfig(preemption_mode="swap", swap_space=70.0).preemption_mode == "swap"


@pytest.mark.parametrize(
    "argv, flag",
    [
        (["--preemption-mode", "swap", "--swap-space", "1e5"], "--swap-space"),
        (["--kv-offloading-size", "1e5"], "--kv-offloading-size"),
    ],
)
def test_cli_refuses_a_host_tier_beyond_the_machines_memory(capsys, argv, flag):
    from hetero_infer.cli.main import main

    assert main(["generate", "x", *argv]) == 2
    err = capsys.readouterr().err
    assert f"hetero-infer: error: {flag}" in err and "of this machine's" in err, err


def test_offloading_needs_prefix_caching(tiny_path):
    with pytest.raises(ValueError, match="kv_offloading_size"):
        engine(tiny_path, kv_offloading_size=0.001, enable_prefix_caching=False)


def test_metrics_show_the_host_tier(tiny_path):
    from types import SimpleNamespace
    from hetero_infer.server.metrics import ServerMetrics

    eng = engine(
        tiny_path,
        preemption_mode="swap",
        swap_space=256 * GIB_PER_BLOCK,
        kv_offloading_size=64 * GIB_PER_BLOCK,
        **SMALL,
    )
    run(eng, workload())
    text = ServerMetrics(SimpleNamespace(snapshot=eng.stats, listeners=[])).render().decode()
    kv = eng.stats["kv_offload"]
    assert f"hetero_infer:kv_swapped_out_total {float(kv['swapped_out'])}" in text
    for name in (
        "num_requests_swapped",
        "kv_swapped_in_total",
        "kv_recompute_fallbacks_total",
        "kv_prefix_hits_device_total",
        "kv_prefix_hits_host_total",
        "kv_offloaded_blocks_total",
        "kv_host_prefix_blocks",
        "kv_transfer_bytes_total",
        "kv_transfer_failures_total",
    ):
        assert f"hetero_infer:{name}" in text, name
    plain = (
        ServerMetrics(SimpleNamespace(snapshot=engine(tiny_path).stats, listeners=[]))
        .render()
        .decode()
    )
    assert "kv_swapped" not in plain  # off: /metrics as before


@pytest.mark.parametrize(
    "argv, flag",
    [
        (["--preemption-mode", "drop"], "--preemption-mode"),
        (["--swap-space", "-1"], "--swap-space"),
        (["--kv-offloading-size", "-2"], "--kv-offloading-size"),
    ],
)
@pytest.mark.parametrize("command", ["generate", "serve", "bench"])
def test_cli_refuses_bad_values_naming_the_flag(capsys, command, argv, flag):
    from hetero_infer.cli.main import main

    args = {"generate": ["generate", "x"], "serve": ["serve"], "bench": ["bench", "offline"]}[
        command
    ]
    try:
        code = main(args + argv)
    except SystemExit as e:  # argparse's own refusals (choices)
        code = e.code
    err = capsys.readouterr().err
    assert code == 2 and f"hetero-infer: error: {flag}" in err.replace("argument ", ""), err


def test_cli_flags_reach_the_engine_config():
    from hetero_infer.cli.flags import build_parser
    from hetero_infer.cli.config import engine_config

    argv = ["generate", "x", "--preemption-mode", "swap", "--swap-space", "2"]
    args = build_parser().parse_args(argv + ["--kv-offloading-size", "0.5"])
    cfg = engine_config(args)
    assert (cfg.preemption_mode, cfg.swap_space, cfg.kv_offloading_size) == ("swap", 2.0, 0.5)
    bench = build_parser().parse_args(["bench", "offline", "--preemption-mode", "swap"])
    assert (bench.preemption_mode, bench.swap_space, bench.kv_offloading_size) == (
        "swap",
        None,
        None,
    )


def test_swap_with_speculative_decoding_keeps_the_tokens(tiny_path):
    ref = run(engine(tiny_path, num_blocks=256), workload())
    eng = engine(
        tiny_path,
        preemption_mode="swap",
        swap_space=256 * GIB_PER_BLOCK,
        kv_offloading_size=64 * GIB_PER_BLOCK,
        speculative_method="ngram",
        **SMALL,
    )
    assert run(eng, workload()) == ref
    assert eng.stats["kv_offload"]["swapped_out"] > 0
    assert eng.stats["speculative"]["num_accepted_tokens"] > 0


def test_llm_takes_vllm_names(tiny_path):
    from hetero_infer.engine.llm import LLM

    llm = LLM(str(tiny_path), **CPU, preemption_mode="swap", swap_space=0.001)
    tier = tier_of(llm.engine).tier
    assert tier.swap.num_blocks == int(0.001 * 2**30 // BLOCK_BYTES)
    assert tier.prefix is None and llm.engine.block_manager.host is None
    plain = LLM(str(tiny_path), **CPU, swap_space=4)  # recompute: no tier is built
    assert not any(isinstance(p, KVOffloadPlugin) for p in plain.engine.plugins)
    assert type(plain.engine.scheduler) is Scheduler


# --- the host pool and the host prefix tier on their own ---


def test_host_pool_sizes_allocates_in_order_and_refuses_by_name():
    from hetero_infer.kv_offload.host_pool import HostBlockPool, HostPoolFullError, host_num_blocks

    assert host_num_blocks(1, 2**20) == 1024 and host_num_blocks(0.5, 3) == 2**29 // 3
    assert type(host_num_blocks(1.5, 7)) is int
    for bad in (0, -1, 2.0, None):
        with pytest.raises(ValueError, match=f"num_blocks must be an integer >= 1, got {bad!r}"):
            HostBlockPool(bad)
    pool = HostBlockPool(4)
    assert repr(pool) == "HostBlockPool(4 of 4 blocks free)" and pool.caches == []
    assert pool.alloc(2) == [0, 1] and pool.num_free() == 2
    pool.free([0])
    assert pool.alloc(3) == [2, 3, 0] and repr(pool) == "HostBlockPool(0 of 4 blocks free)"
    pool.free([1])
    with pytest.raises(HostPoolFullError, match="^2 host blocks asked for, 1 free$"):
        pool.alloc(2)
    assert pool.num_free() == 1 and pool.alloc(0) == [] and HostBlockPool(1).alloc(1) == [0]


def test_host_pool_attach_and_copy_blocks():
    "The pool's tensors take the device cache's block shape; copies move blocks, counting bytes."
    from hetero_infer.kv_offload.host_pool import HostBlockPool, copy_blocks

    dev = [tuple(torch.randn(5, 2, 3, 4) for _ in range(2)) for _ in range(2)]  # 2 layers
    pool = HostBlockPool(3).attach(dev)
    assert [[tuple(c.shape) for c in kv] for kv in pool.caches] == [[(3, 2, 3, 4)] * 2] * 2
    assert not pool.caches[0][0].is_pinned()
    assert copy_blocks(dev, pool.caches, [], []) == 0
    assert copy_blocks(dev, pool.caches, [4, 1], [0, 2]) == 2 * 2 * 2 * (2 * 3 * 4) * 4
    for (dk, dv), (hk, hv) in zip(dev, pool.caches):
        assert torch.equal(hk[[0, 2]], dk[[4, 1]]) and torch.equal(hv[[0, 2]], dv[[4, 1]])
    copy_blocks(pool.caches, dev, [2], [0])
    assert all(torch.equal(d[0], d[1]) for kv in dev for d in kv)


def test_host_pool_pins_beside_cuda_and_indexes_each_cache_on_its_device():
    """Page-locked host blocks by default beside a CUDA cache only, and whenever asked for; a copy
    indexes each cache with indices on that cache's device (a meta cache stands in for a GPU)."""
    from hetero_infer.kv_offload.host_pool import HostBlockPool, copy_blocks, pins_beside

    assert pins_beside(torch.device("cuda", 1)) and not pins_beside(torch.device("cpu"))
    dev = [tuple(torch.randn(2, 2, 1, 4) for _ in range(2))]
    if torch.cuda.is_available():
        assert HostBlockPool(1).attach(dev, pin=True).caches[0][0].is_pinned()
    else:  # asked for, so tried: torch has no page-locked memory without an accelerator
        with pytest.raises(RuntimeError, match="pin_memory"):
            HostBlockPool(1).attach(dev, pin=True)
    meta = [tuple(torch.empty(3, 2, 1, 4, device="meta") for _ in range(2))]
    assert copy_blocks(dev, meta, [1, 0], [2, 0]) == 2 * 2 * (2 * 4) * 4


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_host_pool_keeps_the_cache_dtype(dtype):
    "Host blocks hold the device cache's dtype (not float32): half the memory, exact round trips."
    from hetero_infer.kv_offload.host_pool import HostBlockPool, copy_blocks

    dev = [tuple(torch.randn(4, 2, 3, 4).to(dtype) for _ in range(2))]
    pool = HostBlockPool(2).attach(dev)
    assert {c.dtype for c in pool.caches[0]} == {dtype}
    assert copy_blocks(dev, pool.caches, [3], [1]) == 2 * (2 * 3 * 4) * 2
    back = [tuple(torch.zeros_like(c) for c in dev[0])]
    copy_blocks(pool.caches, back, [1], [0])
    assert all(torch.equal(b[0], d[3]) for b, d in zip(back[0], dev[0]))


# `make mutation` leaves these mutants of kv_offload/host_pool.py alive on a machine without a GPU,
# where every cache is on the CPU: the device of the source indices (a CPU tensor takes indices
# on any device), which of a layer's caches names the device (K and V are on one), `non_blocking`,
# and `pin` left None in place of the default on a CPU cache. `torch.tensor(ids)` without
# `dtype=torch.long` is int64 anyway.


def test_host_prefix_cache_lru_pins_and_drops():
    from hetero_infer.core.sampling_params import SamplingParams
    from hetero_infer.core.sequence import Sequence
    from hetero_infer.kv_offload.host_pool import HostBlockPool
    from hetero_infer.kv_offload.prefix_tier import HostPrefixCache

    tier = HostPrefixCache(HostBlockPool(2))
    assert tier.put(b"a", (1, 2)) == 0 and tier.put(b"b", (3, 4)) == 1
    assert tier.put(b"a", (1, 2)) is None  # already here: now most recent
    assert tier.put(b"c", (5, 6)) is None and tier.stats.dropped == 1  # every block pinned
    tier.unpin(0)
    assert tier.pins == {1: 1}
    assert tier.put(b"c", (5, 6)) == 0 and tier.stats.evictions == 1  # "a" was the only unpinned
    assert tier.put(b"d", (7, 8)) is None and tier.stats.dropped == 2
    assert tier.lookup(b"a", (1, 2)) is None and tier.lookup(b"c", (5, 7)) is None
    assert tier.lookup(b"c", (5, 6)) == 0 and tier.stats.hits == 1 and tier.stats.offloaded == 3
    assert list(tier.entries) == [b"b", b"c"]
    assert repr(tier).startswith("HostPrefixCache(2 of 2 blocks, HostTierStats(offloaded=3")
    tier.unpin(0)
    tier.unpin(1)
    assert tier.pins == {}
    seq = Sequence(0, "r", [3, 4, 5, 6, 9], 5, SamplingParams())
    seq.block_hashes = [b"b", b"c"]
    assert tier.hits(seq, 0, 2) == [1, 0] and tier.pins == {1: 1, 0: 1}
    assert tier.hits(seq, 1, 2) == [0] and tier.pins[0] == 2
    seq.token_ids = [3, 4, 5, 6]  # the last token is never a hit: one full block here
    assert tier.hits(seq, 0, 2) == [1] and tier.pins[1] == 2
    tier.drop([1])
    assert list(tier.entries) == [b"c"] and 1 not in tier.tokens and tier.pins == {0: 2}
    assert tier.pool.num_free() == 1 and tier.lookup(b"b", (3, 4)) is None
    tier.unpin(0)
    tier.unpin(0)
    assert tier.put(b"e", (1, 1)) == 1 and tier.put(b"f", (2, 2)) == 0
    assert tier.stats.evictions == 2 and list(tier.entries) == [b"e", b"f"]
    tier.unpin(1)
    tier.drop([1])  # unpinned: dropped all the same
    assert list(tier.entries) == [b"f"] and tier.pins == {0: 1} and tier.pool.num_free() == 1


def test_swap_space_can_swap_out_and_blocks_needed():
    """What may go to the host (some computed KV, nothing pending or lent, room), and the device
    blocks a swap-in takes: one per host block, the rest, and a copy per extra writer of a shared
    partly filled block."""
    from hetero_infer.core.sequence import Sequence
    from hetero_infer.kv_offload.block_manager import TieredBlockManager
    from hetero_infer.kv_offload.host_pool import HostBlockPool
    from hetero_infer.kv_offload.swap import SwapSpace

    bm = TieredBlockManager(16, 4, False)
    sw = SwapSpace(HostBlockPool(2), bm)
    a = Sequence(0, "a", list(range(10)), 10, SamplingParams())
    bm.allocate(a)  # 3 blocks
    assert not sw.can_swap_out([a])  # nothing computed
    for computed, ok in [(3, True), (8, True), (9, False)]:  # 1, 2 (= free), 3 host blocks
        a.num_computed_tokens = computed
        assert sw.can_swap_out([a]) is ok, computed
    a.num_computed_tokens = 8
    for pending in (bm.cow_pending, bm.lent):
        pending[a.seq_id] = [(0, 1)]
        assert not sw.can_swap_out([a])
        del pending[a.seq_id]
    b = Sequence(1, "b", list(range(10)), 10, SamplingParams())
    for computed, tables, want in [
        (10, ([5, 6, 7], [5, 6, 8]), 4),  # 4 host blocks, no shared tail
        (10, ([5, 6, 7], [5, 6, 7]), 3 + 1),  # 3 host blocks, a shared partly filled tail
        (8, ([5, 6], [5, 6]), 2 + 2),  # 2 host blocks, a block each to come, full tails
    ]:
        a.num_computed_tokens = b.num_computed_tokens = computed
        sw.tables = {0: tables[0], 1: tables[1]}
        assert sw.blocks_needed([a, b]) == want, tables


def test_tiered_block_manager_restore():
    """A swap-in takes one device block per distinct host block (shared ones shared) and the rest
    of each sequence's blocks; it fits exactly when as many blocks are free, else it is refused."""
    from hetero_infer.core.sequence import Sequence
    from hetero_infer.kv_cache.block_manager import NoFreeBlocksError
    from hetero_infer.kv_offload.block_manager import TieredBlockManager

    bm = TieredBlockManager(5, 4, False)
    assert not bm.cache.enabled and bm.host is None
    a = Sequence(0, "a", list(range(10)), 10, SamplingParams())
    b = Sequence(1, "b", list(range(10)), 10, SamplingParams())
    tables = [[7, 8], [7, 9]]
    assert bm.restore_needed([a, b], tables) == 3 + 2
    bm.take()  # 4 free: one short
    with pytest.raises(NoFreeBlocksError, match="^5 blocks needed to swap in, 4 free$"):
        bm.restore([a, b], tables)
    bm = TieredBlockManager(5, 4, False)
    copies = bm.restore([a, b], tables)
    assert [h for h, _ in copies] == [7, 8, 9] and bm.num_free_blocks() == 0
    dev = dict(copies)
    assert a.block_table[:2] == [dev[7], dev[8]] and b.block_table[:2] == [dev[7], dev[9]]
    assert len(a.block_table) == len(b.block_table) == 3  # the third: tokens 8-9, to compute
    assert bm.blocks[dev[7]].ref_count == 2 and bm.blocks[dev[8]].ref_count == 1
    assert bm.seqs == {0: a, 1: b}


def test_tiered_block_manager_offloads_evictions_and_reloads_host_hits():
    """Cached blocks evicted for another request go to the host; a request with their prefix
    finds them there: reloads to copy, its tokens computed, and once the copies ran the device
    blocks are prefix-cache hits again (after a failed copy they are not)."""
    from hetero_infer.core.sequence import Sequence
    from hetero_infer.kv_cache.block_manager import NoFreeBlocksError
    from hetero_infer.kv_offload.block_manager import TieredBlockManager
    from hetero_infer.kv_offload.host_pool import HostBlockPool
    from hetero_infer.kv_offload.prefix_tier import HostPrefixCache

    def seq(i, toks):
        return Sequence(i, str(i), list(toks), len(toks), SamplingParams())

    for ok in (True, False):
        bm = TieredBlockManager(3, 4, True, host=HostPrefixCache(HostBlockPool(4)))
        a = seq(0, range(9))
        bm.allocate(a)
        bm.commit(a, 9)  # two full blocks published
        bm.free(a)
        c = seq(1, range(100, 109))
        bm.allocate(c)  # evicts both cached blocks: to the host first
        offloads, reloads, reloaded = bm.take_transfers()
        assert len(offloads) == 2 and reloads == [] and reloaded == []
        bm.transfers_done(offloads, [])
        assert bm.host.pins == {}
        with pytest.raises(NoFreeBlocksError):
            bm.allocate(seq(9, range(9)))  # does not fit: no host block pinned for it
        assert bm.host.pins == {}
        bm.free(c)
        bm.stats.cached_tokens = 5
        b = seq(2, range(9))
        bm.allocate(b)
        offloads, reloads, reloaded = bm.take_transfers()
        assert [d for _, d in reloads] == b.block_table[:2] and reloaded == [b]
        assert b.num_computed_tokens == b.num_cached_tokens == 8 and bm.stats.cached_tokens == 13
        assert sorted(bm.host.pins) == sorted(h for h, _ in reloads)
        bm.transfers_done(offloads, reloads, ok)
        assert bm.host.pins == {}
        blocks = [bm.blocks[d] for _, d in reloads]
        if ok:
            assert [blk.token_ids for blk in blocks] == [(0, 1, 2, 3), (4, 5, 6, 7)]
            assert [bm.cache.cached[blk.hash] for blk in blocks] == b.block_table[:2]
        else:
            assert [blk.hash for blk in blocks] == [None, None]


def tiered_scheduler(budget=4, num_blocks=16, host_blocks=16, mode="swap"):
    "A `TieredScheduler` over 4-token blocks, with a swap space of `host_blocks`."
    from hetero_infer.kv_offload.block_manager import TieredBlockManager
    from hetero_infer.kv_offload.host_pool import HostBlockPool
    from hetero_infer.kv_offload.scheduler import TieredScheduler
    from hetero_infer.kv_offload.swap import SwapSpace

    cfg = EngineConfig(
        block_size=4,
        num_blocks=num_blocks,
        enable_prefix_caching=False,
        preemption_mode=mode,
        max_num_batched_tokens=budget,
    )
    bm = TieredBlockManager(num_blocks, 4, False)
    return TieredScheduler(cfg, bm, SwapSpace(HostBlockPool(host_blocks), bm))


def tier_seq(i, n):
    from hetero_infer.core.sequence import Sequence

    return Sequence(i, f"r{i}", list(range(n)), n, SamplingParams(), arrival_time=float(i))


def tier_step(sch):
    "One step as the engine runs it: schedule, the copies, commit, a token for each sampled row."
    out = sch.schedule()
    copies = sch.take_copies()
    sch.copies_done(copies)
    sch.update(out)
    for x in out.scheduled:
        if x.seq.num_computed_tokens == len(x.seq):
            x.seq.append_token(7)
    return out, copies


def test_tiered_scheduler_counts_every_swap_and_fallback():
    """Two requests preempted one after the other: both swap out in one step's copies, both come
    back in the next, and every counter adds up (a second preemption of a request included)."""
    from hetero_infer.scheduler.output import SchedulerOutput

    sch = tiered_scheduler(budget=32)
    a, b = tier_seq(0, 8), tier_seq(1, 8)
    sch.add(a), sch.add(b)
    tier_step(sch)
    sch.preempt(a, SchedulerOutput())
    sch.preempt(b, SchedulerOutput())
    assert sch.swapped == [a, b] and a.num_preemptions == b.num_preemptions == 1
    assert sch.stats.preemptions == sch.stats.swapped_out == 2
    out, copies = tier_step(sch)  # a step that swaps out admits nothing
    assert out.scheduled == [] and copies.swapped == [a, b] and len(copies.swap_out) == 4
    assert copies.swap_in == copies.resumed == []
    out, copies = tier_step(sch)
    assert copies.resumed == [a, b] and len(copies.swap_in) == 4 and copies.swap_out == []
    assert [x.seq for x in out.scheduled] == [a, b] and sch.stats.swapped_in == 2
    sch.preempt(a, SchedulerOutput())
    assert a.num_preemptions == 2 and sch.stats.preemptions == sch.stats.swapped_out == 3
    assert sch.stats.recompute_fallbacks == 0
    for mode, fallbacks in (("swap", 2), ("recompute", 0)):
        sch = tiered_scheduler(budget=32, host_blocks=1, mode=mode)
        a, b = tier_seq(0, 8), tier_seq(1, 8)
        sch.add(a), sch.add(b)
        tier_step(sch)
        out = SchedulerOutput()
        sch.preempt(a, out)
        sch.preempt(b, out)  # two blocks each, one host block: both recompute, the last first
        assert out.preempted == [a, b] and list(sch.waiting) == [b, a] and sch.swapped == []
        assert sch.stats.recompute_fallbacks == fallbacks and sch.stats.swapped_out == 0


def test_tiered_scheduler_swaps_in_only_with_budget_left():
    """A swapped request resumes only in a step with tokens left for it: not while a prefill
    takes the whole budget, and as soon as one token is left."""
    from hetero_infer.scheduler.output import SchedulerOutput

    sch = tiered_scheduler(budget=4)
    s, p = tier_seq(0, 1), tier_seq(1, 10)
    sch.add(s), sch.add(p)
    out, _ = tier_step(sch)  # s's prompt, 3 tokens of p's
    assert [x.num_tokens for x in out.scheduled] == [1, 3]
    sch.preempt(s, SchedulerOutput())
    assert sch.take_copies().swapped == [s]  # copied out before the next step
    out, copies = tier_step(sch)  # p's next 4 tokens: no budget left for s
    assert [(x.seq, x.num_tokens) for x in out.scheduled] == [(p, 4)]
    assert sch.swapped == [s] and copies.swap_in == []
    out, copies = tier_step(sch)  # p's last 3: one token left, s's
    assert [(x.seq, x.num_tokens) for x in out.scheduled] == [(s, 1), (p, 3)]
    assert sch.swapped == [] and copies.resumed == [s] and len(copies.swap_in) == 1


def test_tiered_scheduler_copies_failed_recomputes_what_they_touched():
    """Failed swap-out copies: the swapped sequences still swapped go back to the front of
    `waiting` in order, with nothing computed, their host blocks freed (an aborted one is left
    alone). A failed swap-in: the resumed request is preempted by recompute and leaves the step."""
    from hetero_infer.scheduler.output import SchedulerOutput

    sch = tiered_scheduler(budget=32, host_blocks=8)
    a, b, c, w = tier_seq(0, 8), tier_seq(1, 8), tier_seq(2, 8), tier_seq(3, 8)
    for s in (a, b, c):
        sch.add(s)
    tier_step(sch)
    sch.add(w)
    for s in (a, b, c):
        sch.preempt(s, SchedulerOutput())
    assert sch.swap.pool.num_free() == 2
    sch.abort("r1")
    out = sch.schedule()
    copies = sch.take_copies()
    assert copies.swapped == [a, b, c] and out.scheduled == []
    sch.copies_failed(copies, out)
    assert list(sch.waiting) == [a, c, w] and sch.swapped == [] and sch.swap.tables == {}
    assert sch.swap.pool.num_free() == 8
    for s in (a, c):
        assert (s.status, s.num_computed_tokens, s.num_cached_tokens) == (
            SequenceStatus.WAITING,
            0,
            0,
        )
    sch.update(out)

    sch = tiered_scheduler(budget=32, host_blocks=8)
    a, b = tier_seq(0, 8), tier_seq(1, 8)
    sch.add(a), sch.add(b)
    tier_step(sch)
    sch.preempt(a, SchedulerOutput())
    tier_step(sch)  # the swap-out step: b decodes
    out = sch.schedule()
    copies = sch.take_copies()
    assert copies.resumed == [a] and [x.seq for x in out.scheduled] == [b, a]
    sch.copies_failed(copies, out)
    assert [x.seq for x in out.scheduled] == [b] and out.num_batched_tokens == 1
    assert out.preempted == [a] and list(sch.waiting) == [a] and sch.running == [b]
    assert a.status is SequenceStatus.WAITING and a.num_computed_tokens == 0
    assert not a.block_table and sch.block_manager.num_free_blocks() == 16 - len(b.block_table)


def test_tiered_block_manager_caches_by_default_and_pins_nothing_for_a_refused_sequence():
    """Prefix caching is on unless asked off, as in `BlockManager`. A sequence that already holds
    blocks (or looks as if it did) is refused before any host block is pinned for it."""
    from hetero_infer.core.sequence import Sequence
    from hetero_infer.kv_offload.block_manager import TieredBlockManager
    from hetero_infer.kv_offload.host_pool import HostBlockPool
    from hetero_infer.kv_offload.prefix_tier import HostPrefixCache

    assert TieredBlockManager(8, 4).cache.enabled

    def seq(i, toks):
        return Sequence(i, str(i), list(toks), len(toks), SamplingParams())

    bm = TieredBlockManager(3, 4, True, host=HostPrefixCache(HostBlockPool(4)))
    a = seq(0, range(9))
    bm.allocate(a)
    bm.commit(a, 9)
    bm.free(a)
    c = seq(1, range(100, 109))
    bm.allocate(c)  # both cached blocks of `a` go to the host
    bm.transfers_done(*bm.take_transfers()[:2])
    bm.free(c)
    for stale in ([0], []):  # a stale block table; a sequence the manager still holds
        b = seq(2, range(9))
        b.block_table = list(stale)
        if not stale:
            bm.seqs[b.seq_id] = b
        with pytest.raises(ValueError, match="already holds blocks"):
            bm.allocate(b)
        assert bm.host.pins == {} and bm.take_transfers() == ([], [], [])
        bm.seqs.pop(b.seq_id, None)


# Equivalent mutants of kv_offload/scheduler.py: `return` for the `break` that ends `_swap_in`'s
# loop (nothing follows it), and `ok=None` for `ok=False` (both falsy).


def test_tiered_scheduler_drops_the_host_copies_of_a_failed_offload():
    """Offloads whose copy failed leave nothing on the host (the blocks may hold garbage);
    offloads that ran stay there as host prefix hits."""
    from hetero_infer.core.sequence import Sequence
    from hetero_infer.kv_offload.block_manager import TieredBlockManager
    from hetero_infer.kv_offload.host_pool import HostBlockPool
    from hetero_infer.kv_offload.prefix_tier import HostPrefixCache
    from hetero_infer.kv_offload.scheduler import TieredScheduler
    from hetero_infer.scheduler.output import SchedulerOutput

    for failed in (False, True):
        cfg = EngineConfig(block_size=4, num_blocks=3, enable_prefix_caching=True)
        bm = TieredBlockManager(3, 4, True, host=HostPrefixCache(HostBlockPool(4)))
        sch = TieredScheduler(cfg, bm)
        a = Sequence(0, "a", list(range(9)), 9, SamplingParams())
        bm.allocate(a)
        bm.commit(a, 9)
        bm.free(a)
        bm.allocate(Sequence(1, "c", list(range(100, 109)), 9, SamplingParams()))  # evicts a's
        copies = sch.take_copies()
        assert len(copies.offload) == 2
        if failed:
            sch.copies_failed(copies, SchedulerOutput())
        else:
            sch.copies_done(copies)
        assert len(bm.host.entries) == (0 if failed else 2) and bm.host.pins == {}
        assert bm.host.pool.num_free() == (4 if failed else 2)


def _tier_and_caches(cuda=False):
    from hetero_infer.kv_offload.host_pool import HostBlockPool
    from hetero_infer.kv_offload.prefix_tier import HostPrefixCache
    from hetero_infer.kv_offload.tier import KVTier

    dev = [tuple(torch.randn(6, 2, 1, 4) for _ in range(2)) for _ in range(2)]
    if cuda:
        dev = [tuple(c.as_subclass(SaysCuda) for c in kv) for kv in dev]
    tier = KVTier(HostBlockPool(4).attach(dev), HostPrefixCache(HostBlockPool(6).attach(dev)))
    return tier, dev


def test_kv_tier_counts_each_steps_copies_out_then_in(monkeypatch):
    "Device -> host first (swap-outs, offloads), then host -> device; blocks, bytes, time."
    import itertools
    from hetero_infer.kv_offload.scheduler import HostCopies
    from hetero_infer.kv_offload.tier import TransferStats

    tier, dev = _tier_and_caches()
    for c in [c for kv in tier.swap.caches for c in kv]:  # host blocks start uninitialized
        c.normal_()
    calls, copy = [], tier.copy
    tier.copy = lambda *a: calls.append((a[0] is dev, a[2], a[3], a[4])) or copy(*a)
    tier.apply(HostCopies(), dev)
    assert tier.stats == TransferStats() and calls == []  # nothing to copy: not a copying step
    clock = itertools.count(100.0, 0.5)  # each perf_counter call: half a second later
    monkeypatch.setattr("hetero_infer.kv_offload.tier.time.perf_counter", lambda: next(clock))
    c = HostCopies(swap_out=[(0, 0), (1, 1)], offload=[(2, 0)], swap_in=[(2, 3)], reload=[(1, 5)])
    for step in (1, 2):
        tier.apply(c, dev)
        s = tier.stats
        assert (s.steps, s.blocks_out, s.blocks_in, s.failures) == (step, 3 * step, 2 * step, 0)
        assert s.bytes == step * 5 * 2 * 2 * (2 * 1 * 4) * 4  # blocks x layers x (k, v) x fp32
        assert s.seconds == 0.5 * step
    assert calls[:4] == [
        (True, [0, 1], [0, 1], False),
        (True, [2], [0], False),
        (False, [2], [3], False),
        (False, [1], [5], False),
    ]
    assert torch.equal(dev[1][0][3], tier.swap.caches[1][0][2])


def test_kv_tier_copies_on_a_side_stream_ordered_against_the_forward_pass(monkeypatch):
    """Beside CUDA caches (a CPU stand-in here), one side stream, made once on the caches'
    device, waits for the step's KV writes, runs every copy (non-blocking), and the forward pass
    waits for it; beside a CPU cache no stream is touched."""
    import contextlib
    from hetero_infer.kv_offload.scheduler import HostCopies

    log = []

    class Stream:
        def __init__(self, device=None):
            self.device = device
            log.append(("new", device))

        def wait_stream(self, other):
            log.append((self, "waits", other))

    main = Stream.__new__(Stream)

    @contextlib.contextmanager
    def on(stream):
        log.append(("enter", stream))
        yield
        log.append(("exit", stream))

    monkeypatch.setattr(torch.cuda, "Stream", Stream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: main)
    monkeypatch.setattr(torch.cuda, "stream", on)
    c = HostCopies(swap_out=[(0, 0)], reload=[(1, 5)])
    tier, dev = _tier_and_caches()
    tier.apply(c, dev)
    assert log == [] and tier._stream is None
    tier, dev = _tier_and_caches(cuda=True)
    copy = tier.copy
    tier.copy = lambda *a: log.append(("copy", a[4])) or copy(*a)
    for _ in range(2):
        tier.apply(c, dev)
    side = tier._stream
    assert isinstance(side, Stream) and side.device == dev[0][0].device
    step = [(side, "waits", main), ("enter", side), ("copy", True), ("copy", True), ("exit", side),
            (main, "waits", side)]  # fmt: skip
    assert log == [("new", dev[0][0].device)] + step + step


def test_kv_audit_names_each_corruption():
    "Each way the device pool can go wrong has its own line (and the host audit adds to them)."
    from hetero_infer.core.sequence import Sequence
    from hetero_infer.kv_offload.block_manager import TieredBlockManager
    from hetero_infer.kv_offload.scheduler import TieredScheduler

    def sched(tiered=False):
        cfg = EngineConfig(block_size=4, num_blocks=8, enable_prefix_caching=True)
        if tiered:
            return TieredScheduler(cfg, TieredBlockManager(8, 4, True))
        return Scheduler(cfg, BlockManager(8, 4, True))

    def running(sch):
        s = Sequence(0, "a", list(range(6)), 6, SamplingParams())
        sch.add(s)
        sch.schedule()
        return s

    for tiered in (False, True):
        sch = sched(tiered)
        sch.block_manager.free_ids.append(sch.block_manager.free_ids[0])
        assert kv_audit(sch) == ["device: a block is twice in the free lists"]
    sch = sched()
    s = running(sch)
    sch.block_manager.blocks[s.block_table[0]].ref_count = 2
    assert kv_audit(sch) == [f"device: block {s.block_table[0]} has ref_count 2, 1 tables"]
    sch = sched()
    b = sch.block_manager.free_ids.pop()
    assert kv_audit(sch) == [f"device: block {b} is held by no one and free 0 times (lost)"]
    sch = sched()
    s = running(sch)
    sch.block_manager.blocks[s.block_table[1]].hash = 12345
    assert kv_audit(sch) == [f"device: block {s.block_table[1]}'s hash is not cached under it"]
    sch = sched()
    s = running(sch)
    sch.running.remove(s)
    assert kv_audit(sch) == [
        "device: blocks held by [0] (not running)",
        "device: an idle scheduler holds blocks",
    ]


def test_kv_audit_names_each_corruption_of_the_host_tiers():
    "The swap pool, the host prefix tier and the copies between steps: each fault its own line."
    from hetero_infer.kv_offload.block_manager import TieredBlockManager
    from hetero_infer.kv_offload.host_pool import HostBlockPool
    from hetero_infer.kv_offload.prefix_tier import HostPrefixCache
    from hetero_infer.kv_offload.scheduler import TieredScheduler
    from hetero_infer.kv_offload.swap import SwapSpace

    def sched():
        cfg = EngineConfig(block_size=4, num_blocks=8, enable_prefix_caching=True)
        bm = TieredBlockManager(8, 4, True, host=HostPrefixCache(HostBlockPool(4)))
        return TieredScheduler(cfg, bm, SwapSpace(HostBlockPool(4), bm))

    def audit(corrupt):
        sch = sched()
        assert kv_audit(sch) == []
        corrupt(sch)
        return kv_audit(sch)

    lost, pending = "host blocks lost or held twice", "copies pinned or pending outside a step"
    assert audit(lambda s: s.swap.pool.alloc(1)) == [f"swap: {lost}"]
    assert audit(lambda s: s.swap.tables.update({7: []})) == [
        "swap: host tables do not match the swapped queue"
    ]
    assert audit(lambda s: s.block_manager.host.pool.alloc(1)) == [f"prefix tier: {lost}"]
    for name in ("offloads", "reloads"):
        assert audit(lambda s: getattr(s.block_manager, name).append((0, 1))) == [
            f"prefix tier: {pending}"
        ]
    assert audit(lambda s: s.block_manager.host.pins.update({0: 1})) == [f"prefix tier: {pending}"]
    assert audit(lambda s: s.block_manager.reload_names.update({0: ()})) == [
        f"prefix tier: {pending}"
    ]
    for name in ("swap_out", "swap_in", "swapped", "resumed"):
        assert audit(lambda s: getattr(s.copies, name).append(0)) == [
            "swap: copies pending outside a step"
        ]


def test_build_kv_tier_builds_the_pools_asked_for():
    from hetero_infer.kv_offload.tier import build_kv_tier

    dev = [tuple(torch.zeros(6, 2, 1, 4) for _ in range(2)) for _ in range(2)]  # 128 B a block
    gib = 10 * 128 / 2**30
    for mode, offload, swap_blocks, prefix_blocks in [
        ("recompute", 0, None, None),
        ("swap", 0, 10, None),
        ("recompute", gib, None, 10),
        ("swap", gib / 2, 10, 5),
    ]:
        tier = build_kv_tier(
            EngineConfig(preemption_mode=mode, swap_space=gib, kv_offloading_size=offload), dev
        )
        assert (tier.swap and tier.swap.num_blocks) == swap_blocks, mode
        assert (tier.prefix and tier.prefix.pool.num_blocks) == prefix_blocks


# Equivalent mutants of kv_offload/tier.py: which layer's K or V cache names the device or says
# CUDA (all are on one device), the block size read from V instead of K (the same shape), and
# `lent.get(seq_id)` without its 0 (a slice from None starts at 0 too).


def test_host_memory_gib_is_the_machines_memory():
    from hetero_infer.kv_offload.plugin import host_memory_gib

    meminfo = pathlib.Path("/proc/meminfo")
    if not meminfo.exists():
        pytest.skip("no /proc/meminfo to compare with")
    total_kib = int(re.search(r"MemTotal:\s+(\d+) kB", meminfo.read_text()).group(1))
    assert host_memory_gib() == pytest.approx(total_kib / 2**20, rel=0.1)


def test_each_failed_copy_is_counted_and_left_on_the_engine():
    "Two failed steps of copies: two failures counted, the last error kept for the engine."
    from types import SimpleNamespace
    from hetero_infer.kv_offload.host_pool import HostBlockPool
    from hetero_infer.kv_offload.scheduler import HostCopies
    from hetero_infer.kv_offload.tier import KVTier

    errors = [RuntimeError("first"), RuntimeError("second")]
    tier = KVTier(HostBlockPool(2))
    tier.apply = lambda copies, caches: (_ for _ in ()).throw(errors.pop(0))
    failed = []
    sch = SimpleNamespace(take_copies=HostCopies, copies_failed=lambda c, s: failed.append(s))
    engine = SimpleNamespace(scheduler=sch, runner=SimpleNamespace(kv_caches=[]), last_error=None)
    plugin = KVOffloadPlugin()
    plugin.tier = tier
    for step in ("a", "b"):
        plugin.after_schedule(engine, step)
    assert tier.stats.failures == 2 and str(engine.last_error) == "second" and failed == ["a", "b"]


@pytest.mark.parametrize("swap, offload", [(True, False), (False, True)])
def test_stats_of_a_tier_with_one_pool_show_zeros_for_the_other(tiny_path, swap, offload):
    eng = engine(
        tiny_path,
        num_blocks=32,
        enable_prefix_caching=True,
        preemption_mode="swap" if swap else "recompute",
        swap_space=32 * GIB_PER_BLOCK,
        kv_offloading_size=16 * GIB_PER_BLOCK if offload else 0,
    )
    kv = eng.stats["kv_offload"]
    assert kv["swap_blocks_free"] == (32 if swap else 0)
    assert (kv["host_prefix_hits"], kv["host_prefix_blocks"]) == (0, 0)
    assert ("host_hits" in kv) == offload and kv["transfer_steps"] == 0


# ---- the chapter's measurements (kv_offload.bench), with a scripted clock


class ScriptedClock:
    """A stand-in for the `time` module of `kv_offload.bench`: `perf_counter` reads these in turn,
    and records what `probe()` says of the engine at each reading."""

    def __init__(self, *readings, probe=lambda: None):
        self.readings, self.probe, self.seen = iter(readings), probe, []

    def perf_counter(self):
        self.seen.append(self.probe())
        return next(self.readings)


def test_time_to_resume_times_each_preemption_and_reports_median_and_spread(tiny_path, monkeypatch):
    from hetero_infer.kv_offload import bench

    eng = engine(tiny_path, num_blocks=64, preemption_mode="swap", swap_space=64 * GIB_PER_BLOCK)
    victims = preempted_requests(eng)
    # per repeat: before the preemption, after it, back at the next token
    sch = eng.scheduler
    clock = ScriptedClock(
        *(0, 1, 6, 10, 12, 14, 20, 23, 32),
        probe=lambda: (len(sch.running), len(sch.swapped), len(sch.copies.swap_out)),
    )
    monkeypatch.setattr(bench, "time", clock)
    r = bench.time_to_resume(eng, 40, repeats=3)
    assert r == dict(context_len=40, resume_s=5, resume_spread_s=7, preempt_s=2)
    # (running, swapped, copies pending): the preemption's time includes its copy out, the
    # resume's ends running again
    assert clock.seen == [(1, 0, 0), (0, 1, 0), (1, 0, 0)] * 3
    assert victims == {"ttr-40-0", "ttr-40-1", "ttr-40-2"}
    kv = eng.stats["kv_offload"]
    assert (kv["swapped_out"], kv["swapped_in"], kv["recompute_fallbacks"]) == (3, 3, 0)
    assert kv["transfer_blocks_out"] == 3 * 10  # the 40 tokens' blocks, each copied out
    assert not eng.has_unfinished_requests() and kv_audit(eng.scheduler) == []
    # swap resumes each without a second prefill; recompute prefills each again
    assert eng.scheduler.stats.prefill_tokens == 3 * 40
    rec = engine(tiny_path, num_blocks=64, enable_prefix_caching=False)
    monkeypatch.setattr(bench, "time", ScriptedClock(0, 0, 0))
    bench.time_to_resume(rec, 40, repeats=1)
    assert rec.scheduler.stats.prefill_tokens == 40 + 41
    # each repeat is a prompt of its own, of the asked length, in the model's vocabulary
    ids = [bench._ids(40, 128, r) for r in range(3)]
    assert len(set(map(tuple, ids))) == 3 and all(len(i) == 40 for i in ids)
    assert all(0 <= t < 128 for i in ids for t in i) and bench._ids(40, 128, 1) == ids[1]


def multi_turn_with_stats(monkeypatch, eng, **kw):
    """`multi_turn` with a scripted clock (round 1 from 0 to 100 s, round 2 from 200 to 204 s), and
    the engine's counts just before round 2 (prefix blocks looked up, device and host hits, and
    prefill tokens), read from the engine itself."""
    from hetero_infer.kv_offload import bench

    monkeypatch.setattr(bench, "time", ScriptedClock(0, 100, 200, 204))
    seen, play = [], bench._round

    def round_(engine, tag, prompts, p):
        seen.append((tag, engine.stats, engine.scheduler.stats.prefill_tokens))
        return play(engine, tag, prompts, p)

    monkeypatch.setattr(bench, "_round", round_)
    m = bench.multi_turn(eng, **kw)
    assert [s[0] for s in seen] == ["a", "b"]
    return m, seen[1][1:]


def test_multi_turn_reports_round_two_from_the_engines_own_counts(tiny_path, monkeypatch):
    kw = dict(conversations=3, system_len=24, question_len=6, answer_len=8)
    plain, _ = multi_turn_with_stats(
        monkeypatch, engine(tiny_path, num_blocks=64, enable_prefix_caching=False), **kw
    )
    assert (plain["device_hit_rate"], plain["host_hit_rate"]) == (0, 0)
    on_device = engine(tiny_path, num_blocks=64)  # room for every conversation's prefix
    cached, (before, _) = multi_turn_with_stats(monkeypatch, on_device, **kw)
    pc0, pc1 = before["prefix_cache"], on_device.stats["prefix_cache"]
    hits, queries = (pc1[k] - pc0[k] for k in ("cache_hits", "cache_queries"))
    assert hits > 0 and cached["device_hit_rate"] == hits / queries
    assert plain["prefill_tokens"] == 3 * (24 + 6 + 8 + 6)  # round 2 prefills every token
    # the host tier: the device pool (14 blocks) holds one conversation, the host all three
    eng = engine(
        tiny_path,
        num_blocks=14,
        max_num_seqs=1,
        max_num_batched_tokens=64,
        kv_offloading_size=64 * GIB_PER_BLOCK,
    )
    m, (before, prefill_before) = multi_turn_with_stats(monkeypatch, eng, **kw)
    after, pc0, pc1 = eng.stats, before["prefix_cache"], eng.stats["prefix_cache"]
    queries = pc1["cache_queries"] - pc0["cache_queries"]
    host = after["kv_offload"]["host_prefix_hits"] - before["kv_offload"]["host_prefix_hits"]
    assert queries > 0 and host > 0
    assert m["device_hit_rate"] == (pc1["cache_hits"] - pc0["cache_hits"]) / queries
    assert m["host_hit_rate"] == host / queries
    assert m["prefill_tokens"] == eng.scheduler.stats.prefill_tokens - prefill_before
    assert 0 < m["prefill_tokens"] < plain["prefill_tokens"]
    # the same greedy answers; 3 x 8 tokens in the 4 scripted seconds of round 2
    assert m["tokens"] == plain["tokens"] and [len(t) for t in m["tokens"]] == [8, 8, 8]
    assert (m["seconds"], m["tokens_per_s"]) == (4, 24 / 4) == (plain["seconds"], 6)
    assert 0 < m["mean_ttft_s"] < 10  # the engine's own clock: real seconds


# Equivalent mutants of kv_offload/bench.py: other seeds for the random prompts (`100 - i`,
# `101 + i`, `randint(1, vocab)`, `randint(vocab)`), other default workload sizes (the notebook
# passes its own), a longer `max_tokens` for the preempted request (it is timed to its second
# token), `after_schedule(engine, None)` (the step's output is read only when a copy fails),
# `max(queries, 2)` (round 2 always looks blocks up) and a default host hit count of 1 when the
# engine has no host tier (the difference of two readings is 0 either way).
