"""`bench serve --peers vllm` without vLLM: servers started from a `ServerSpec` and always stopped
(their children too, on an error, Ctrl-C or SIGTERM), our own server on both sides of a served
comparison, the table's ratios, and the errors that name their flag. A real vLLM run is opt-in
(HETERO_INFER_VLLM_PYTHON)."""

import argparse
import json
import os
import signal
import socket
import sys
import time

import pytest

from hetero_infer.bench.args import add_bench_arguments
from hetero_infer.bench.load import ServerSpec, free_port, launch, ours_server, port_in_use
from hetero_infer.bench.main import bench_command
from hetero_infer.bench.served import (
    check_vllm_server,
    format_served,
    served_comparison,
    served_ratios,
    vllm_server,
)
from hetero_infer.bench.workload import machine_info, random_workload
from hetero_infer.core.config import DEMO_MODEL_DIR
from hetero_infer.testing import dummy_checkpoint

VLLM_PYTHON = os.environ.get("HETERO_INFER_VLLM_PYTHON")


def parser():
    ap = argparse.ArgumentParser(prog="hetero-infer bench")
    add_bench_arguments(ap)
    return ap


def group_members(pgid: int) -> list[int]:
    "Live processes (zombies left out: the container's init may not reap) of the group `pgid`."
    live = []
    for d in os.listdir("/proc"):
        try:
            stat = open(f"/proc/{d}/stat").read()
        except (OSError, ValueError):
            continue
        state, _, pgrp = stat.rsplit(")", 1)[1].split()[:3]
        if d.isdigit() and int(pgrp) == pgid and state != "Z":
            live.append(int(d))
    return live


def gone(pgid: int) -> bool:
    "No live process of the group `pgid` leads is left, once a SIGKILL has had time to land."
    for _ in range(50):
        if not group_members(pgid):
            return True
        time.sleep(0.1)
    return False


def http_server_with_child(port: int) -> ServerSpec:
    "A server that answers 200 at / and, as vLLM does, runs a child process of its own."
    code = (
        "import subprocess, sys, http.server;"
        "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']);"
        f"http.server.HTTPServer(('127.0.0.1', {port}), http.server.SimpleHTTPRequestHandler)"
        ".serve_forever()"
    )
    return ServerSpec("http", [sys.executable, "-c", code], port, ready_path="/")


# ---- the lifecycle


def test_launch_stops_the_server_and_its_children():
    spec = http_server_with_child(free_port())
    with launch(spec, startup_timeout=60, log=lambda s: None) as run:
        assert run.startup_s > 0 and len(group_members(run.pid)) == 2 and port_in_use(spec.port)
    assert gone(run.pid) and not port_in_use(spec.port)


@pytest.mark.parametrize("how", ["ctrl-c", "sigterm", "error"])
def test_launch_stops_the_server_on_interrupt_and_error(how):
    spec = http_server_with_child(free_port())
    raised = {"ctrl-c": KeyboardInterrupt, "sigterm": KeyboardInterrupt, "error": RuntimeError}
    handler = signal.getsignal(signal.SIGTERM)
    with pytest.raises(raised[how]):
        with launch(spec, startup_timeout=60, log=lambda s: None) as run:
            if how == "ctrl-c":
                raise KeyboardInterrupt
            if how == "sigterm":
                os.kill(os.getpid(), signal.SIGTERM)  # the bench's handler: as Ctrl-C
            raise RuntimeError("the load failed")
    assert gone(run.pid)
    assert signal.getsignal(signal.SIGTERM) is handler  # the bench's handler is put back


def test_a_command_that_exits_at_once_shows_its_last_lines():
    code = "import sys; print('line one'); print('cannot load', file=sys.stderr); sys.exit(3)"
    spec = ServerSpec("quick", [sys.executable, "-c", code], free_port(), flag="--vllm-args")
    with pytest.raises(ValueError) as e:
        launch(spec, log=lambda s: None).__enter__()
    msg = str(e.value)
    assert msg.startswith("--vllm-args: quick exited with status 3")
    assert "line one" in msg and "cannot load" in msg


def test_a_server_never_ready_is_stopped_and_named():
    code = "import sys, time; print('loading ...', flush=True); time.sleep(600)"
    spec = ServerSpec("slow", [sys.executable, "-c", code], free_port())
    with pytest.raises(ValueError) as e:
        launch(spec, startup_timeout=2, log=lambda s: None).__enter__()
    assert str(e.value).startswith("--startup-timeout: slow was not ready (/readyz) within 2 s")
    assert "loading ..." in str(e.value)


def test_a_port_in_use_is_refused_before_anything_starts():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        spec = ServerSpec("x", [sys.executable, "-c", "raise SystemExit(1)"], s.getsockname()[1])
        with pytest.raises(ValueError, match=r"^--port: 127\.0\.0\.1:\d+ is in use"):
            launch(spec).__enter__()


# ---- our own server on both sides


def test_served_comparison_with_ours_on_both_sides():
    """Two real `hetero-infer serve` on the demo model, one after the other, the same seeded
    load: every request served by each, the figures of each, ratios from them, both stopped."""
    wl = random_workload(6, (3, 10), (2, 6), vocab_size=297, seed=1, low_id=3)
    engine = ["--model", str(DEMO_MODEL_DIR), "--dtype", "float32", "--max-num-seqs", "8"]
    specs = [ours_server(engine), ours_server(engine, env={"OMP_NUM_THREADS": "1"})]
    specs[1].name = "twin"
    logged = []
    res = served_comparison(specs, wl, [float("inf")], max_concurrency=4, log=logged.append)
    assert set(res["servers"]) == {"ours", "twin"}
    for s in res["servers"].values():
        (run,) = s["runs"]
        assert run["rate"] == "burst" and run["completed"] == 6 and run["failed"] == 0
        assert run["output_throughput"] > 0 and s["startup_s"] > 0 and s["model"]
    assert (res["servers"]["ours"]["threads"], res["servers"]["twin"]["threads"]) == (
        None,
        "OMP_NUM_THREADS=1",
    )
    assert res["load"]["max_concurrency"] == 4 and res["machine"]["cpu"]
    ratios, startup = served_ratios(res, "ours", "twin")
    o, t = (res["servers"][k]["runs"][0] for k in ("ours", "twin"))
    assert ratios[0]["out tok/s"] == pytest.approx(o["output_throughput"] / t["output_throughput"])
    assert ratios[0]["TTFT p99"] == pytest.approx(o["ttft"]["p99_ms"] / t["ttft"]["p99_ms"])
    table = format_served(res, "ours", "twin")
    assert "| burst | ours ÷ twin |" in table and "startup (seconds to ready)" in table
    assert not any(port_in_use(s.port) for s in specs)


# ---- the table


def canned(tok_s, ttft, itl, startup, failed=0):
    lat = lambda p50, p99: {"mean_ms": p50, "p50_ms": p50, "p90_ms": p99, "p99_ms": p99}
    run = {"rate": "burst", "completed": 8 - failed, "failed": failed, "output_throughput": tok_s}
    run |= {"ttft": lat(ttft, 2 * ttft), "itl": lat(itl, 4 * itl), "tpot": lat(itl, itl)}
    run |= {"errors": [], "tokens_per_chunk": 1.0}
    if failed == 8:
        run |= {"output_throughput": 0.0, "ttft": lat(None, None), "errors": ["HTTP 500: x"]}
    return {"startup_s": startup, "load_avg_1min": 1.0, "runs": [run]}


def comparison(ours, vllm):
    return {
        "machine": machine_info(),
        "workload": {"num_requests": 8, "input_len": [4, 8], "output_len": [4, 8]},
        "load": {"rates": ["burst"], "max_concurrency": None},
        "servers": {"ours": ours, "vLLM": vllm},
    }


def test_ratios_and_table():
    res = comparison(canned(300.0, 50.0, 10.0, 5.0), canned(200.0, 100.0, 8.0, 40.0))
    (r,), startup = served_ratios(res)
    assert r["out tok/s"] == pytest.approx(1.5) and startup == pytest.approx(0.125)
    assert (r["TTFT p50"], r["TTFT p99"]) == (pytest.approx(0.5), pytest.approx(0.5))
    assert (r["ITL p50"], r["ITL p99"]) == (pytest.approx(1.25), pytest.approx(1.25))
    lines = format_served(res).splitlines()
    assert "| burst | ours | 8 | 0 | 1.0 | 300 | 50.0 | 100.0 | 10.0 | 40.0 | 10.0 |" in lines
    ratio_row = "| burst | ours ÷ vLLM | | | | **1.50×** | **0.50×** | **0.50×** | "
    assert ratio_row + "**1.25×** | **1.25×** | **1.25×** |" in lines
    assert any("ours 5.0, vLLM 40.0 (ours ÷ vLLM 0.12×)" in ln for ln in lines)


def test_a_failed_side_has_no_ratio_and_its_errors_are_shown():
    res = comparison(canned(300.0, 50.0, 10.0, 5.0), canned(0.0, 0.0, 0.0, 40.0, failed=8))
    (r,), _ = served_ratios(res)
    assert r["out tok/s"] is None and r["TTFT p50"] is None
    table = format_served(res)
    assert "| burst | vLLM | 0 | 8 | 1.0 |" in table and "vLLM errors: ['HTTP 500: x']" in table


# ---- vLLM's spec and the command's errors


def test_vllm_spec_names_its_interpreter_module_and_cache(tmp_path):
    spec = vllm_server("/v/bin/python", DEMO_MODEL_DIR, ["--dtype", "float32"], ["--x"], 9, 2)
    assert spec.argv[:3] == ["/v/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
    assert spec.argv[-3:] == ["--dtype", "float32", "--x"] and "--port" in spec.argv
    assert (
        spec.env["VLLM_CPU_KVCACHE_SPACE"] == "4" and spec.env["VLLM_CPU_OMP_THREADS_BIND"] == "0-1"
    )
    assert spec.ready_path == "/health" and spec.url == "http://127.0.0.1:9"
    no_tokenizer = dummy_checkpoint("tiny-llama", tmp_path / "tiny")
    assert "--skip-tokenizer-init" in vllm_server("/v/bin/python", no_tokenizer).argv


def fake_python(tmp_path, body: str) -> str:
    p = tmp_path / "python"
    p.write_text(f"#!/bin/sh\n{body}\n")
    p.chmod(0o755)
    return str(p)


def test_vllm_python_checks(tmp_path):
    without = fake_python(tmp_path, f'exec {sys.executable} "$@"')  # this venv has no vLLM
    with pytest.raises(ValueError, match="^--vllm-python: vllm does not import in"):
        check_vllm_server(without)
    with pytest.raises(ValueError, match="^--vllm-python: .* is not a Python interpreter"):
        check_vllm_server(fake_python(tmp_path, "echo nope >&2; exit 1"))
    with pytest.raises(ValueError, match="^--vllm-python: .* is not an executable file"):
        check_vllm_server(str(tmp_path / "missing"))


@pytest.mark.parametrize(
    "argv, flag",
    [
        (["--peers", "vllm"], "--vllm-python: --peers vllm needs"),
        (["--vllm-python", "FAKE"], "--vllm-python: vllm does not import"),
        (["--url", "http://127.0.0.1:1", "--max-num-seqs", "4"], "--max-num-seqs: a server given"),
        (["--threads", "0"], "--threads must be >= 1"),
        (["--max-concurrency", "0"], "--max-concurrency must be >= 1"),
        (["--serve-args=--no-such-flag"], "--serve-args: ours exited with status 2"),
        (["--startup-timeout", "0.1"], "--startup-timeout: ours was not ready"),
        (["--port", "HELD"], "--port: 127.0.0.1:"),
    ],
)
def test_serve_errors_name_their_flag(argv, flag, tmp_path, capsys):
    fake = fake_python(tmp_path, f'exec {sys.executable} "$@"')
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        held = str(s.getsockname()[1])
        argv = [{"FAKE": fake, "HELD": held}.get(a, a) for a in argv]
        args = parser().parse_args(["serve", "--num-requests", "2", "--rates", "", *argv])
        assert bench_command(args) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"hetero-infer: error: {flag}")
    if "--serve-args=--no-such-flag" in argv:
        assert "unrecognized arguments: --no-such-flag" in err  # the server's own last lines


@pytest.mark.skipif(
    not (VLLM_PYTHON and os.access(VLLM_PYTHON, os.X_OK)),
    reason="set HETERO_INFER_VLLM_PYTHON to an interpreter with vLLM to run it",
)
def test_served_against_real_vllm(tmp_path, capsys):
    """Ours and vLLM's OpenAI server on the demo model, the same streamed load: every request
    served by both, each server's startup and version stored, the ratio row printed."""
    out = tmp_path / "served.json"
    argv = ["serve", "--num-requests", "8", "--rates", "", "--vllm-python", VLLM_PYTHON]
    argv += ["--max-num-seqs", "8", "--output", str(out)]
    assert bench_command(parser().parse_args(argv)) == 0
    res = json.loads(out.read_text())
    for name in ("ours", "vLLM"):
        run = res["servers"][name]["runs"][0]
        assert run["completed"] == 8 and run["failed"] == 0, run["errors"]
    assert res["servers"]["vLLM"]["version"] and res["servers"]["vLLM"]["startup_s"] > 0
    assert "| burst | ours ÷ vLLM |" in capsys.readouterr().out
