"""Tensor parallelism on CPU (gloo, 2 processes on 127.0.0.1): greedy output with
tensor_parallel_size=2 equals one process and transformers for every family (one replicated KV
head, a vocabulary not divisible by 2, tied and untied embeddings), also with chunked prefill,
prefix caching and preemption; mixture-of-experts models with TP over experts and with expert
parallelism; the server answers with 2 ranks and leaves no process behind; a worker that dies
ends the engine with an error naming it, within the timeout. The same engine with its ranks as
threads of the test's process (`ThreadGroup`), where every line of the split runs in-process."""

import copy
import dataclasses
import datetime
import os
import re
import signal
import subprocess
import sys
import threading
import time
import pytest
import torch
from types import SimpleNamespace
from hetero_infer.core.sampling_params import SamplingParams
from hetero_infer.engine.llm import LLM, EngineStepError
from hetero_infer.engine.plugins import EngineDeadError
from hetero_infer.scheduler.output import SchedulerOutput
from hetero_infer.testing import FAMILIES, tiny_hf_checkpoint
from test_engine import hf_greedy, prompts

# One shape per family that stresses a different part of the split: Llama with an odd vocabulary
# (padded LM head), Qwen2 with
# one KV head (replicated on both ranks) and tied embeddings, Qwen3 with q/k norms, Mistral with
# plain GQA.
SHAPES = {
    "llama": dict(vocab_size=257),
    "qwen2": dict(num_key_value_heads=1, tie_word_embeddings=True),
    "qwen3": dict(vocab_size=255),
    "mistral": {},
}
N_NEW = 24
GREEDY = SamplingParams(temperature=0, max_tokens=N_NEW, ignore_eos=True)
CPU = dict(device="cpu", dtype="float32", block_size=16)


def _model(path, family):
    return tiny_hf_checkpoint(
        path,
        family,
        initializer_range=0.2,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
        **SHAPES[family],
    )


def _run(path, ps, **kw):
    llm = LLM(str(path), **CPU, **kw)
    try:
        return [o.outputs[0].token_ids for o in llm.generate(ps, GREEDY, use_tqdm=False)]
    finally:
        llm.close()


@pytest.mark.parametrize("family", list(FAMILIES))
def test_tp2_equals_one_process_and_transformers(family, tmp_path):
    hf = _model(tmp_path, family)
    ps = prompts((3, 17, 40, 9), vocab=min(255, hf.config.vocab_size))
    tp2 = _run(tmp_path, ps, tensor_parallel_size=2)
    assert tp2 == _run(tmp_path, ps)
    assert tp2 == [hf_greedy(hf, p, N_NEW)[0] for p in ps]


def test_tp2_with_chunked_prefill_prefix_caching_and_preemption(tmp_path):
    hf = _model(tmp_path, "llama")
    shared = prompts((32,), seed=3)[0]
    ps = [shared + p for p in prompts((5, 9, 13, 2), seed=4)] + prompts((30,), seed=5)
    kw = dict(
        max_num_batched_tokens=32, num_blocks=8, max_num_seqs=4, enable_prefix_caching=True
    )  # tight: forces preemption
    llm = LLM(str(tmp_path), **CPU, tensor_parallel_size=2, **kw)
    try:
        outs = llm.generate(ps, GREEDY, use_tqdm=False)
        stats = llm.engine.stats
    finally:
        llm.close()
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(hf, p, N_NEW)[0] for p in ps]
    assert stats["preemptions"] > 0 and stats["prefix_cache"]["cache_hits"] > 0, stats


@pytest.mark.parametrize(
    "family, ep, fused",  # EP + Qwen2-MoE: below
    [
        ("qwen3_moe", False, True),
        ("qwen3_moe", True, False),
        ("mixtral", False, False),
        ("mixtral", True, True),
        ("qwen2_moe", False, False),
    ],
)
def test_moe_tp2_and_expert_parallel_equal_transformers(family, ep, fused, tmp_path):
    "TP over experts (each rank half of every expert) and EP (each rank half of the experts)."
    hf = tiny_hf_checkpoint(tmp_path, family, fused=fused, bos_token_id=None, eos_token_id=None)
    ps = prompts((3, 17, 40, 9))
    got = _run(tmp_path, ps, tensor_parallel_size=2, enable_expert_parallel=ep)
    assert got == [hf_greedy(hf, p, N_NEW)[0] for p in ps]


def test_moe_tp2_ep_with_chunked_prefill_prefix_caching_and_preemption(tmp_path):
    hf = tiny_hf_checkpoint(tmp_path, "qwen2_moe", bos_token_id=None, eos_token_id=None)
    shared = prompts((32,), seed=3)[0]
    ps = [shared + p for p in prompts((5, 9, 13, 2), seed=4)] + prompts((30,), seed=5)
    kw = dict(max_num_batched_tokens=32, num_blocks=8, max_num_seqs=4, enable_prefix_caching=True)
    llm = LLM(str(tmp_path), **CPU, tensor_parallel_size=2, enable_expert_parallel=True, **kw)
    try:
        outs = llm.generate(ps, GREEDY, use_tqdm=False)
        stats = llm.engine.stats
    finally:
        llm.close()
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(hf, p, N_NEW)[0] for p in ps]
    assert stats["preemptions"] > 0 and stats["prefix_cache"]["cache_hits"] > 0, stats


def test_tp_refuses_a_split_the_model_cannot_take(tmp_path):
    _model(tmp_path, "llama")  # 4 heads
    with pytest.raises(
        ValueError, match=r"tensor_parallel_size \(3\) must divide num_attention_heads"
    ):
        LLM(str(tmp_path), **CPU, tensor_parallel_size=3)


def _children(pid: int) -> list[int]:
    out = subprocess.run(
        ["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True
    ).stdout
    return [int(x) for x in out.split()]


def test_dead_worker_ends_the_engine_with_an_error(tmp_path):
    """A worker killed mid-run: the step raises `EngineDeadError` naming the rank, promptly, with
    the running requests ended with that error as its outputs; later ones are refused too."""
    _model(tmp_path, "llama")
    llm = LLM(str(tmp_path), **CPU, tensor_parallel_size=2)
    try:
        eng = llm.engine
        for i, p in enumerate(prompts((5, 9, 7))):
            eng.add_request(
                f"r{i}", p, SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)
            )
        for _ in range(4):
            eng.step()  # prefill and a few decodes
        worker = eng.runner.workers[0]
        os.kill(worker.pid, signal.SIGKILL)
        t, outs = time.time(), []
        with pytest.raises(EngineDeadError, match="worker rank 1 exited") as dead:
            while eng.has_unfinished_requests() and time.time() - t < 60:
                outs += eng.step()
        outs += dead.value.outputs  # every request it held, ended with the error
        assert time.time() - t < 60 and not eng.has_unfinished_requests()
        finals = [o for o in outs if o.finished]
        assert len(finals) == 3 and all(
            o.outputs[0].finish_reason == "error" and "worker rank 1 exited" in o.error
            for o in finals
        ), finals
        assert all(0 < len(o.outputs[0].token_ids) < 50 for o in finals)  # it died mid-run
        with pytest.raises(EngineStepError, match="worker rank 1 exited"):
            llm.generate(prompts((5,)), GREEDY, use_tqdm=False)
    finally:
        llm.close()


def _serve_tp2():
    """Start `hetero-infer serve --tensor-parallel-size 2` on a free port; returns (process, openai
    client, worker pids)."""
    import socket
    from openai import OpenAI

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    p = subprocess.Popen(
        [
            os.path.join(os.path.dirname(sys.executable), "hetero-infer"),
            "serve",
            "--port",
            str(port),
            "--tensor-parallel-size",
            "2",
            "--device",
            "cpu",
        ],
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", timeout=30, max_retries=0)
    for _ in range(240):
        try:
            client.models.list()
            break
        except Exception:
            if p.poll() is not None:
                break
            time.sleep(0.5)
    # the server's child is its engine's process; the ranks' processes are that process's own
    engines = _children(p.pid)
    return p, client, [k for e in engines for k in _children(e)]


def _alive(pids):
    return [
        k
        for k in pids
        if os.path.exists(f"/proc/{k}") and "zombie" not in open(f"/proc/{k}/status").read().lower()
    ]


def _chat(client):
    return client.chat.completions.create(
        model="hetero-infer",
        messages=[{"role": "user", "content": "reverse: a b c"}],
        max_tokens=8,
        temperature=0,
    )


def test_serve_with_two_ranks_answers_and_leaves_no_process():
    p, client, kids = _serve_tp2()
    kids += _children(p.pid)  # and the engine's process itself
    try:
        assert kids, "no worker process started"
        assert _chat(client).choices[0].message.content == "c b a"
    finally:
        p.send_signal(signal.SIGTERM)
        out, _ = p.communicate(timeout=60)
    assert p.returncode == 0, out[-2000:]
    time.sleep(1)
    assert not _alive(kids), "orphan workers"


def test_serve_exits_non_zero_when_a_worker_dies():
    import openai

    p, client, kids = _serve_tp2()
    try:
        assert _chat(client).choices[0].message.content == "c b a"
        for k in kids:
            os.kill(k, signal.SIGKILL)
        with pytest.raises(openai.APIStatusError) as e:
            _chat(client)
        assert e.value.status_code in (500, 503) and "worker rank 1" in str(e.value.body), (
            e.value.body
        )
        out, _ = p.communicate(timeout=60)  # the server stops by itself
    finally:
        if p.poll() is None:
            p.kill()
            p.communicate()
    assert p.returncode == 1 and "hetero-infer: error: the engine stopped" in out, out[-2000:]


TORCHRUN_SCRIPT = """
import json, sys
from hetero_infer import LLM, SamplingParams
# ranks > 0 serve the loop inside this call
llm = LLM(sys.argv[1], device="cpu", dtype="float32", tensor_parallel_size=2)
sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
outs = llm.generate(json.loads(sys.argv[2]), sp, use_tqdm=False)
print("TOKENS", json.dumps([o.outputs[0].token_ids for o in outs]), flush=True)
llm.close()
"""


def test_under_torchrun_the_ranks_come_from_the_environment(tmp_path):
    import json
    import socket

    _model(tmp_path / "m", "llama")
    (tmp_path / "run.py").write_text(TORCHRUN_SCRIPT)
    ps = prompts((4, 11))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    r = subprocess.run(
        [
            torchrun,
            "--nproc-per-node",
            "2",
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            str(port),
            str(tmp_path / "run.py"),
            str(tmp_path / "m"),
            json.dumps(ps),
        ],
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert r.returncode == 0, r.stderr[-3000:]
    lines = [l for l in r.stdout.splitlines() if l.startswith("TOKENS")]
    assert len(lines) == 1, r.stdout  # only rank 0 returns from LLM(...)
    single = LLM(str(tmp_path / "m"), **CPU).generate(
        ps, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False
    )
    assert json.loads(lines[0][len("TOKENS ") :]) == [o.outputs[0].token_ids for o in single]


def test_cli_refuses_an_impossible_split_naming_the_flag():
    exe = os.path.join(os.path.dirname(sys.executable), "hetero-infer")
    r = subprocess.run(
        [exe, "generate", "--tensor-parallel-size", "3", "x"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2 and r.stderr.strip().endswith(
        "hetero-infer: error: --tensor-parallel-size: tensor_parallel_size (3) must divide "
        "num_attention_heads (4)"
    ), r.stderr
    assert "Traceback" not in r.stderr


def test_bench_offline_with_two_ranks(tmp_path):
    import json

    exe = os.path.join(os.path.dirname(sys.executable), "hetero-infer")
    r = subprocess.run(
        [
            exe,
            "bench",
            "offline",
            "--tensor-parallel-size",
            "2",
            "--num-requests",
            "4",
            "--peers",
            "",
            "--repeats",
            "1",
            "--warmup",
            "0",
            "--output",
            str(tmp_path / "b.json"),
        ],
        capture_output=True,
        text=True,
        timeout=180,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads((tmp_path / "b.json").read_text())
    assert (
        res["config"]["tensor_parallel_size"] == 2
        and "tensor_parallel_size=2" in res["results"][0]["system"]
    ), res["results"][0]


def test_code_from_stdin_is_refused_at_once():
    """Workers re-import the main script; from stdin they cannot: a clear error in seconds, not a
    2-minute rendezvous timeout."""
    import subprocess
    import sys
    import time

    t = time.monotonic()
    r = subprocess.run(
        [sys.executable, "-"],
        input='from hetero_infer import LLM\nLLM(device="cpu", tensor_parallel_size=2)\n',
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert (
        r.returncode != 0
        and "tensor_parallel_size: worker processes re-import the main script" in r.stderr
    )
    assert time.monotonic() - t < 60


# ---- the ranks as threads of this process


class ThreadGroup:
    """The calls to torch.distributed the tensor-parallel code makes, for ranks that are threads of
    this process: each collective meets at a barrier and combines what every rank put in.

    The spawned-process tests above run the same code, but only in child processes; this runs it
    in the test's own process, where a debugger, coverage and mutation testing can see it."""

    class ReduceOp:
        SUM, MIN = "sum", "min"

    def __init__(self, world: int, timeout: float = 30.0):
        self.world, self.local = world, threading.local()
        self.meet = threading.Barrier(world, timeout=timeout)
        self.slots: list = [None] * world
        self.calls: list = []  # (rank, collective)

    def init_process_group(self, backend, *, init_method, rank, world_size, timeout):
        from hetero_infer.parallel.runner import COLLECTIVE_TIMEOUT_S

        assert (backend, world_size) == ("gloo", self.world)  # gloo: the ranks are on a CPU
        port = re.fullmatch(r"tcp://127\.0\.0\.1:(\d+)", init_method)
        assert init_method == "env://" or port and 1024 <= int(port[1]) < 65536, init_method
        assert timeout == datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S)
        self.local.rank = rank

    def is_available(self):
        return True

    def is_initialized(self):
        return getattr(self.local, "rank", None) is not None

    def get_world_size(self):
        return self.world

    def destroy_process_group(self):
        self.local.rank = None

    def _exchange(self, what: str, x) -> list:
        "Every rank's `x`, in rank order."
        self.calls.append((self.local.rank, what))
        self.slots[self.local.rank] = x
        self.meet.wait()
        got = list(self.slots)
        self.meet.wait()  # every rank has read before any writes again
        return got

    def all_reduce(self, x, op="sum"):
        if op not in (self.ReduceOp.SUM, self.ReduceOp.MIN):
            raise TypeError(f"all_reduce: no reduction {op!r}")
        parts = self._exchange("all_reduce", x.clone())
        x.copy_(torch.stack(parts).sum(0) if op == "sum" else torch.stack(parts).amin(0))

    def all_gather(self, parts, x):
        for p, got in zip(parts, self._exchange("all_gather", x.clone())):
            p.copy_(got)

    def broadcast_object_list(self, box, *, src):
        box[0] = copy.deepcopy(self._exchange("broadcast", box[0])[src])  # as if pickled

    def barrier(self):
        self._exchange("barrier", None)


class RankThread(threading.Thread):
    """A worker rank as a thread, with the parts of `multiprocessing.Process` the runner uses. A
    rank that raises leaves the group broken, as a dead process breaks gloo's connections."""

    group: ThreadGroup

    def __init__(self, target, args, daemon, name):
        assert daemon is True  # a worker never keeps the interpreter alive
        super().__init__(target=self._main, args=(target, args), daemon=daemon, name=name)
        self.exitcode, self.error = None, None

    def _main(self, target, args):
        try:
            target(*args)
            self.exitcode = 0
        except SystemExit as e:  # a rank whose whole job is done
            self.exitcode = e.code
        except BaseException as e:
            self.exitcode, self.error = 1, e
            self.group.meet.abort()

    def kill(self):
        raise AssertionError(f"{self.name} had to be killed")


@pytest.fixture
def threaded_ranks(monkeypatch):
    """`install(world)`: tensor-parallel ranks 1.. start as threads, and every collective is a
    `ThreadGroup`'s. Returns the group, {rank: its runner} (filled as the ranks load) and the
    thread counts the ranks set."""
    from hetero_infer.moe import parallel as moe_parallel
    from hetero_infer.parallel import runner, shards

    runners, load, configs, thread_counts = {}, runner.rank_runner, {}, []

    def rank_runner(config, rank, world):
        if rank in configs:
            config = dataclasses.replace(config, num_blocks=configs[rank])
        runners[rank] = load(config, rank, world)
        return runners[rank]

    def install(world: int, blocks: dict | None = None):
        "`blocks`: {rank: KV blocks it can afford}, to make the ranks disagree."
        group = ThreadGroup(world)
        for rank, n in (blocks or {}).items():
            configs[rank] = n
        for mod in (runner, shards, moe_parallel):
            monkeypatch.setattr(mod, "dist", group)
        monkeypatch.setattr(RankThread, "group", group, raising=False)
        return group, runners, thread_counts

    monkeypatch.setattr(runner, "rank_runner", rank_runner)
    monkeypatch.setattr(runner, "_worker_context", lambda: SimpleNamespace(Process=RankThread))
    for k in shards.COMM_BYTES:
        monkeypatch.setitem(shards.COMM_BYTES, k, 0)
        monkeypatch.setitem(shards.COMM_SECONDS, k, 0.0)
    ticks = threading.local()

    def perf_counter():  # each thread's own clock, one tick per reading
        ticks.n = getattr(ticks, "n", 0) + 1
        return float(ticks.n)

    monkeypatch.setattr(shards, "time", SimpleNamespace(perf_counter=perf_counter))
    # each rank on a CPU takes its share of the threads: recorded, not set (more than one intra-op
    # thread here would also slow every other test of the process)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 4)
    monkeypatch.setattr(torch, "set_num_threads", lambda n: thread_counts.append(n))
    return install


THREADED = {  # family, ranks, config, engine options: each a different part of the split
    "padded-vocab-biases": (
        "llama", 2, dict(vocab_size=257, attention_bias=True, mlp_bias=True), {}
    ),
    "one-kv-head-tied": ("qwen2", 2, dict(num_key_value_heads=1, tie_word_embeddings=True), {}),
    "kv-heads-shared-by-4": ("mistral", 4, dict(num_key_value_heads=2), {}),
    "experts-split-by-features": ("qwen3_moe", 2, {}, {}),
    "experts-split-by-rank": ("mixtral", 2, {}, dict(enable_expert_parallel=True)),
}  # fmt: skip


@pytest.mark.parametrize("case", list(THREADED))
def test_tp_as_threads_equals_one_process_and_counts_its_traffic(case, tmp_path, threaded_ranks):
    """Every rank runs in this process, so every line of the split runs here. Greedy tokens equal
    one process's; the prompts hold the ids at each rank's edge of the vocabulary; every step's
    logits are cut to the vocabulary; the bytes counted per collective are those each step
    passes; the workers leave their loops at close."""
    from hetero_infer.parallel import shards

    family, world, shape, options = THREADED[case]
    hf = tiny_hf_checkpoint(
        tmp_path, family, initializer_range=0.2, bos_token_id=None, eos_token_id=None,
        pad_token_id=None, **shape,
    )  # fmt: skip
    hf.to(torch.bfloat16).save_pretrained(tmp_path)  # stored in bfloat16, run in float32
    c = hf.config
    per_rank = -(-c.vocab_size // world)
    edges = [0, per_rank - 1, per_rank, c.vocab_size - 1, per_rank + 1, 5]
    ps = [edges] + prompts((17,), vocab=c.vocab_size)
    want = _run(tmp_path, ps)
    group, runners, thread_counts = threaded_ranks(world, blocks={world - 1: 40})
    llm = LLM(str(tmp_path), **CPU, tensor_parallel_size=world, num_blocks=64, **options)
    try:
        eng = llm.engine
        assert thread_counts == [4 // world] * world  # of 4
        assert all(type(n) is int for n in thread_counts)
        assert eng.runner.execute(SchedulerOutput()).shape == (0, c.vocab_size)  # nothing to run
        # every rank keeps the fewest blocks any rank can afford (each rank has its runner once it
        # has joined the step above)
        assert [runners[r].num_blocks for r in range(world)] == [40] * world
        params = [p for r in runners.values() for p in r.model.parameters()]
        assert {(p.dtype, p.requires_grad) for p in params} == {(torch.float32, False)}
        workers = eng.runner.workers
        assert [w.name for w in workers] == [f"hetero-infer-tp{r}" for r in range(1, world)]
        assert all(w.is_alive() for w in workers)
        assert eng.stats["tensor_parallel"] == {"world_size": world}
        r = repr(eng.runner)
        assert r.startswith(f"TensorParallelRunner(rank 0 of {world}: ") and r.endswith(")")
        assert "ModelRunner(" not in r and r.count("(") == r.count(")"), r
        with pytest.raises(RuntimeError, match="already running in this process; close it first"):
            LLM(str(tmp_path), **CPU, tensor_parallel_size=world)
        widths, execute = [], eng.runner.execute

        def recorded(sched):
            out = execute(sched)
            widths.append(out.shape[-1])
            return out

        eng.runner.execute = recorded
        got = [o.outputs[0].token_ids for o in llm.generate(ps, GREEDY, use_tqdm=False)]
    finally:
        llm.close()
    assert got == want
    assert all(not w.is_alive() and w.exitcode == 0 for w in workers)
    with pytest.raises(
        RuntimeError, match=r"^this tensor-parallel engine was closed; start a new one$"
    ):
        eng.runner.execute(SchedulerOutput())
    assert set(widths) == {c.vocab_size}
    # every rank meets at the barrier before the group is torn down
    assert {r for r, what in group.calls if what == "barrier"} == set(range(world))
    assert group.local.rank is None
    if "moe" in family or family == "mixtral":
        return  # a mixture of experts passes its own traffic (16_mixture_of_experts)
    # the seconds in each collective: here each rank's clock ticks once per reading
    calls = [what for _, what in group.calls]
    assert shards.COMM_SECONDS["all_reduce"] == calls.count("all_reduce") - world  # not the
    assert shards.COMM_SECONDS["all_gather"] == calls.count("all_gather")  # blocks' agreement
    # per rank and token: the embedding, and each layer's o_proj and down_proj, sum hidden floats;
    # per logits row: the rank's part of the padded vocabulary is gathered
    tokens = sum(len(p) for p in ps) + len(ps) * (N_NEW - 1)
    layers = 1 + 2 * c.num_hidden_layers
    assert shards.COMM_BYTES["all_reduce"] == world * layers * tokens * c.hidden_size * 4
    assert shards.COMM_BYTES["all_gather"] == world * len(ps) * N_NEW * per_rank * 4


def test_a_failing_worker_thread_ends_the_engine_naming_its_rank(tmp_path, threaded_ranks):
    "Rank 1's forward raises mid-run: the step that waits for it ends every request with the error."
    from hetero_infer.testing import fail_forward

    _model(tmp_path, "llama")
    group, runners, _ = threaded_ranks(2)
    llm = LLM(str(tmp_path), **CPU, tensor_parallel_size=2)
    try:
        eng = llm.engine
        eng.runner.execute(SchedulerOutput())  # every rank has its runner once past a step
        fail_forward(runners[1].model, {5}, RuntimeError("rank 1 broke"))
        for i, p in enumerate(prompts((5, 9, 7))):
            eng.add_request(f"r{i}", p, SamplingParams(temperature=0, max_tokens=50))
        outs = []
        with pytest.raises(EngineDeadError, match="worker rank 1 exited") as dead:
            while eng.has_unfinished_requests():
                outs += eng.step()
        (worker,) = eng.runner.workers
        assert worker.exitcode == 1 and str(worker.error) == "rank 1 broke"
        with pytest.raises(RuntimeError, match=r"^tensor-parallel worker rank 1 exited \(exit"):
            eng.runner.check_workers()
        assert eng.stats["tensor_parallel"]["fatal"] == eng.runner.broken
        finals = [o for o in outs + dead.value.outputs if o.finished]
        assert sorted(o.request_id for o in finals) == ["r0", "r1", "r2"]
        assert all("worker rank 1 exited (exit code 1)" in o.error for o in finals)
        with pytest.raises(EngineStepError, match="worker rank 1 exited"):
            llm.generate(prompts((5,)), GREEDY, use_tqdm=False)
    finally:
        llm.close()
    assert eng.runner.closed and eng.runner.workers == []


def test_a_main_script_that_is_no_file_is_refused_before_any_rank_starts(
    tmp_path, monkeypatch, threaded_ranks
):
    _model(tmp_path, "llama")
    group, runners, _ = threaded_ranks(2)
    monkeypatch.setattr(sys.modules["__main__"], "__file__", "<stdin>", raising=False)
    with pytest.raises(ValueError, match="re-import the main script, and '<stdin>' is not a file"):
        LLM(str(tmp_path), **CPU, tensor_parallel_size=2)
    assert runners == {} and group.calls == []


def test_a_failing_step_on_rank_0_ends_the_engine_with_its_first_line(tmp_path, threaded_ranks):
    "Rank 0's forward raises while the workers wait: the engine is broken, with the error's line."
    from hetero_infer.testing import fail_forward

    _model(tmp_path, "llama")
    group, runners, _ = threaded_ranks(2)
    llm = LLM(str(tmp_path), **CPU, tensor_parallel_size=2, max_retry_attempts=0)
    try:
        eng = llm.engine
        fail_forward(eng.runner.model, {1}, RuntimeError("rank 0 broke " + "x" * 300 + "\nmore"))
        eng.add_request("r", prompts((5,))[0], SamplingParams(temperature=0, max_tokens=4))
        outs = eng.step()
        want = f"a tensor-parallel step failed (RuntimeError: rank 0 broke {'x' * 187}); the "
        assert eng.runner.broken == want + "engine cannot continue"
        assert [o.outputs[0].finish_reason for o in outs] == ["error"]
        assert want in outs[0].error  # the request ends with the reason
        with pytest.raises(EngineDeadError, match="the engine cannot continue"):
            eng.step()
        group.meet.abort()  # the worker waiting in its collective gives up, as gloo's would
    finally:
        llm.close()


def test_each_rank_finds_its_device(monkeypatch):
    from types import SimpleNamespace
    from hetero_infer.parallel import runner

    cfg = SimpleNamespace(device="cpu")
    assert [runner._rank_device(cfg, r) for r in (0, 1)] == ["cpu", "cpu"]
    monkeypatch.setattr(runner, "resolve_device", lambda d: "cuda")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert [runner._rank_device(cfg, r) for r in (0, 1, 2)] == ["cuda:0", "cuda:1", "cuda:0"]
    monkeypatch.setenv("LOCAL_RANK", "3")  # torchrun's rank on this machine
    assert runner._rank_device(cfg, 0) == "cuda:1"


@pytest.mark.parametrize(
    "env, under",
    [
        ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "h"}, True),
        ({"WORLD_SIZE": "2", "MASTER_ADDR": "h"}, False),
        ({"RANK": "0", "MASTER_ADDR": "h"}, False),
        ({"RANK": "0", "WORLD_SIZE": "2"}, False),
    ],
)
def test_torchrun_is_recognised_by_its_three_variables(monkeypatch, env, under):
    from hetero_infer.parallel import runner

    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR"):
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert runner._under_torchrun() is under


class RankEnviron(dict):
    "`os.environ` as each rank's thread sees it: its own RANK, every other variable shared."

    def __init__(self, env: dict, ranks: dict):  # ranks: {thread name: rank}
        super().__init__(env)
        self.ranks = ranks

    def __getitem__(self, k):
        if k == "RANK":
            return str(self.ranks.get(threading.current_thread().name, 0))
        return super().__getitem__(k)


def test_under_torchrun_rank_0_serves_and_the_others_run_their_loop(
    tmp_path, monkeypatch, threaded_ranks
):
    """torchrun started two processes (here: threads, each reading its own RANK): rank 0 returns
    the engine, rank 1 serves steps until it closes, then exits. A WORLD_SIZE other than
    tensor_parallel_size is refused naming both."""
    from hetero_infer.core.config import EngineConfig
    from hetero_infer.parallel import runner

    hf = _model(tmp_path, "llama")
    ps = prompts((3, 17), vocab=hf.config.vocab_size)
    want = _run(tmp_path, ps)
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1"}
    monkeypatch.setattr(runner, "os", SimpleNamespace(environ=RankEnviron(env, {"rank1": 1})))
    group, runners, _ = threaded_ranks(2)
    cfg = EngineConfig(model=str(tmp_path), tensor_parallel_size=2, **CPU)
    worker = RankThread(runner.torchrun_runner, (cfg, 2), daemon=True, name="rank1")
    worker.start()
    llm = LLM(str(tmp_path), **CPU, tensor_parallel_size=2)
    try:
        assert llm.engine.runner.workers == []  # torchrun, not the engine, owns the processes
        got = [o.outputs[0].token_ids for o in llm.generate(ps, GREEDY, use_tqdm=False)]
    finally:
        llm.close()
    worker.join(10)
    assert got == want and worker.exitcode == 0 and sorted(runners) == [0, 1]
    runner.os.environ["WORLD_SIZE"] = "3"
    with pytest.raises(
        ValueError, match=r"tensor_parallel_size \(2\) differs from the WORLD_SIZE=3"
    ):
        LLM(str(tmp_path), **CPU, tensor_parallel_size=2)


def test_a_torchrun_of_one_process_starts_its_own_ranks(tmp_path, monkeypatch, threaded_ranks):
    """torchrun with one process (WORLD_SIZE=1) and tensor_parallel_size=2: the engine spawns them.
    A bfloat16 checkpoint: every rank loads its shard in the dtype asked for."""
    _model(tmp_path, "llama").to(torch.bfloat16).save_pretrained(tmp_path)
    for k, v in {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1"}.items():
        monkeypatch.setenv(k, v)
    _, runners, _ = threaded_ranks(2)
    llm = LLM(str(tmp_path), **CPU, tensor_parallel_size=2)
    try:
        assert len(llm.engine.runner.workers) == 1
        llm.engine.runner.execute(SchedulerOutput())
        dtypes = {p.dtype for r in runners.values() for p in r.model.parameters()}
        assert dtypes == {torch.float32} and len(runners) == 2
    finally:
        llm.close()


def test_without_a_group_every_collective_is_the_identity():
    from hetero_infer.parallel import shards

    x = torch.arange(6.0).view(2, 3)
    before = dict(shards.COMM_BYTES)
    assert shards.group_size() == 1
    assert shards.all_reduce(x) is x and shards.all_gather_last(x) is x
    assert shards.COMM_BYTES == before and x.tolist() == [[0, 1, 2], [3, 4, 5]]


def test_shard_plan_splits_heads_features_and_vocabulary_or_names_what_it_cannot():
    from hetero_infer.model.layers import ModelConfig
    from hetero_infer.parallel.shards import shard_plan

    base = dict(
        architecture="LlamaForCausalLM", vocab_size=11, hidden_size=8, intermediate_size=12,
        num_layers=1, num_heads=4, num_kv_heads=4, head_dim=2,
    )  # fmt: skip
    plan = shard_plan(ModelConfig(**base), 1, 2)
    assert (plan.rank, plan.world_size, plan.q_heads, plan.kv_heads) == (
        1,
        2,
        range(2, 4),
        range(2, 4),
    )
    assert (plan.inter, plan.vocab, plan.vocab_per_rank) == (range(6, 12), range(6, 12), 6)
    assert shard_plan(ModelConfig(**{**base, "num_kv_heads": 2}), 3, 4).kv_heads == range(1, 2)
    for kw, world, what in [
        (dict(num_heads=6, num_kv_heads=3), 2, r"num_key_value_heads \(3\) or be a multiple of it"),
        (dict(intermediate_size=13), 2, r"intermediate_size \(13\)"),
    ]:
        with pytest.raises(
            ValueError, match=rf"^tensor_parallel_size \({world}\) must divide {what}$"
        ):
            shard_plan(ModelConfig(**{**base, **kw}), 0, world)


# Equivalent mutants of parallel/runner.py and parallel/shards.py, or ones only a GPU or another
# machine tells apart:
# - a device moved to or named as None, or left out, in `_meta_to`, `execute`, `rank_runner`,
#   `load_shard` and `_place` (every rank here is on the one CPU), and the CUDA branches of
#   `rank_runner` and `init_group` (nccl, `torch.cuda.set_device`);
# - the checkpoint's dtype read by other names in `rank_runner` (`dtype="auto"` is float32 on a
#   CPU whatever the checkpoint says);
# - `p.join(2.0)` or `join(None)` for a worker that has already exited, and `close` run again
#   with no workers left (nothing to do either way);
# - in `shard_plan`, `>` for `>=` where the ranks equal the KV heads (one head each either way);
#   `dim=+1` for `dim=-1` on (rows, vocabulary) logits; an id outside a rank's rows looked up at
#   row 1 instead of 0 (masked to zero either way).
# - `register_sharder` storing None (sharders register at import, before any mutant is chosen),
#   the config's tie redone by `load_shard` after `shard_model`, `c` not passed to a sharder that
#   does not read it, and padding when the rows already fit (`<=`: zero rows of zeros).
# `_worker_context` runs only in the spawned-process tests above; `_check_split` with rank 1's
# plan for rank 0's (every rank's shapes are refused alike).


def test_a_free_port_is_one_the_system_hands_out(monkeypatch):
    from hetero_infer.parallel import runner

    assert 1024 <= runner._free_port() < 65536  # an ephemeral port, never a fixed one
    monkeypatch.delattr(sys.modules["__main__"], "__file__", raising=False)  # python -c, Jupyter
    runner._check_spawnable()  # no file to re-import: nothing to refuse


def test_a_shard_that_does_not_fit_is_refused_by_name(tmp_path):
    "A shard of the wrong shape, a weight the checkpoint lacks, a block no way can split."
    from safetensors.torch import load_file, save_file
    from hetero_infer.parallel.shards import _place, _rows, load_shard, shard_mlp, shard_plan
    from hetero_infer.model.loading import parse_config

    m = torch.nn.Sequential(torch.nn.Linear(4, 3, bias=False))
    with pytest.raises(ValueError, match=r"^weight 0.weight: shard of shape \(2, 4\), rank 1 "):
        _place(m, "0.weight", torch.zeros(2, 4), 1, torch.float32, "cpu")
    with pytest.raises(ValueError, match=r"rank 1 expects \(3, 4\)$"):
        _place(m, "0.weight", torch.zeros(2, 4), 1, torch.float32, "cpu")

    class Slice:  # a safetensors slice: its shape, and rows on indexing
        def __init__(self, t):
            self.t = t

        def get_shape(self):
            return list(self.t.shape)

        def __getitem__(self, s):
            return self.t[s]

    last = _rows(Slice(torch.ones(5, 8)), range(3, 6), 3)  # the last rank's rows, padded
    assert last.tolist() == [[1.0] * 8] * 2 + [[0.0] * 8]
    hf = _model(tmp_path, "llama")
    c = parse_config(hf.config.to_dict())
    with pytest.raises(ValueError, match=r"^tensor_parallel_size: no registered way to split a "):
        shard_mlp(torch.nn.Identity(), c, shard_plan(c, 0, 2), None)
    (f,) = tmp_path.glob("*.safetensors")
    tensors = load_file(f)
    del tensors["model.norm.weight"]
    save_file(tensors, f, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"lacks weight model\.norm\.weight$"):
        load_shard(tmp_path, shard_plan(c, 0, 2), torch.float32, "cpu", None)
