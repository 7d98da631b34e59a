"""`hetero-infer serve` runs its engine in a child process (`EngineProcess`): the child's death is
the server's clear error and exit 1, and the server's death ends the child (a SIGTERM's drain and
close are checked with the tensor-parallel server in test_parallel.py)."""

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pytest

from hetero_infer.core.config import EngineConfig
from hetero_infer.core.sampling_params import SamplingParams
from hetero_infer.engine.llm import LLM
from hetero_infer.server.engine_process import EngineProcess

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="reads /proc for the child")

CODE = "import sys; from hetero_infer.cli.main import main; sys.exit(main(sys.argv[1:]))"


def children(pid: int) -> list[int]:
    "The processes `pid` started (Linux: /proc/PID/task/*/children)."
    found = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        found += [int(c) for c in (task / "children").read_text().split()]
    return found


def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has exited


def start_server(log):
    with __import__("socket").socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    argv = [sys.executable, "-c", CODE, "serve", "--port", str(port), "--log-level", "warning"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
    url, end = f"http://127.0.0.1:{port}", time.monotonic() + 180
    while True:
        assert proc.poll() is None, "the server exited before it was ready"
        try:
            if httpx.get(url + "/readyz", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        assert time.monotonic() < end, "the server did not become ready"
        time.sleep(0.2)


def wait_gone(pid: int, timeout: float = 60) -> bool:
    end = time.monotonic() + timeout
    while alive(pid) and time.monotonic() < end:
        time.sleep(0.1)
    return not alive(pid)


def test_the_process_engine_gives_the_in_process_tokens_and_its_errors():
    ids = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16]]
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    ep = EngineProcess(EngineConfig(max_num_seqs=4))
    try:
        for i, p in enumerate(ids):
            ep.add_request(str(i), p, greedy)
        assert ep.stats["running"] + ep.stats["waiting"] == 3 and ep.has_unfinished_requests()
        got = {}
        while ep.has_unfinished_requests():
            got |= {o.request_id: o.outputs[0].token_ids for o in ep.step() if o.finished}
        with pytest.raises(ValueError, match="prompt token ids"):
            ep.add_request("bad", [10**9], greedy)
        ep.add_request("gone", ids[0], greedy)
        ep.abort_request(["gone"])
        outs = []
        while ep.has_unfinished_requests():  # a step taken ahead may come before the abort's
            outs += ep.step()
        assert [o.outputs[0].finish_reason for o in outs if o.finished] == ["abort"]
    finally:
        ep.close()
    assert ep.proc.returncode == 0
    here = LLM(max_num_seqs=4).generate(ids, greedy, use_tqdm=False)
    assert [got[str(i)] for i in range(3)] == [o.outputs[0].token_ids for o in here]


def test_a_dead_engine_process_is_a_clear_error_then_exit_1():
    with tempfile.TemporaryFile("w+") as log:
        proc, url = start_server(log)
        try:
            (child,) = children(proc.pid)
            os.kill(child, signal.SIGKILL)
            body = {"prompt": "reverse: a b", "max_tokens": 4}
            r = httpx.post(url + "/v1/completions", json=body, timeout=60)
            assert r.status_code >= 500 and "engine" in r.json()["error"]["message"]
            assert proc.wait(60) == 1
        finally:
            proc.kill()
            proc.wait()
        log.seek(0)
        assert "hetero-infer: error: the engine stopped" in log.read()


def test_the_engine_process_ends_with_its_server():
    "Killed without a goodbye, the server leaves no engine behind: the child sees its pipe close."
    with tempfile.TemporaryFile("w+") as log:
        proc, _ = start_server(log)
        (child,) = children(proc.pid)
        proc.kill()
        proc.wait()
        assert wait_gone(child)
