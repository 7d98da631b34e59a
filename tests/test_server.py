"""The OpenAI-compatible server, started for real (`hetero-infer serve` under uvicorn on 127.0.0.1,
a free port) and driven by the official `openai` client and raw HTTP: shapes, streaming equals
non-streaming, every error row, 50 concurrent clients without cross-talk, disconnects that free
their blocks, backpressure (503), a hypothesis fuzz with no 5xx, SIGTERM with open streams (final
events, exit 0), fields honoured or refused by name, logit_bias, templates (kwargs, refusals),
lone surrogates, CORS, /health and the port-0 banner."""

import asyncio
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from concurrent.futures import ThreadPoolExecutor
import httpx
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

openai = pytest.importorskip("openai")
from hetero_infer.demo.task import demo_prompts  # noqa: E402 (after the skip when openai is missing)

KEY = "test-key"
DEMO_MAX_LEN = 64  # the demo model's max_position_embeddings


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    "`hetero-infer serve` in a subprocess; waits for /readyz, always killed at the end."

    def __init__(self, *args, env=None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        code = "import sys; from hetero_infer.cli.main import main; sys.exit(main(sys.argv[1:]))"
        self.log = tempfile.TemporaryFile(
            "w+"
        )  # a file, not a pipe: a chatty server can never block on a full pipe
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-c",
                code,
                "serve",
                "--port",
                str(self.port),
                "--log-level",
                "warning",
                *args,
            ],
            env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})},
            stdout=self.log,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self.ready = False

    def wait_ready(self, timeout=180):
        if self.ready:
            return self
        end = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited {self.proc.returncode}: {self.output()[-3000:]}")
            try:
                if httpx.get(self.url + "/readyz", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > end:
                self.stop()
                raise RuntimeError("server did not become ready")
            time.sleep(0.2)
        self.ready = True
        return self

    def metrics(self) -> dict:
        "The server's Prometheus samples, `name{labels}` -> value."
        text = httpx.get(self.url + "/metrics", timeout=10).text
        return {
            k: float(v)
            for k, v in (
                l.rsplit(" ", 1) for l in text.splitlines() if l.startswith("hetero_infer:")
            )
        }

    def output(self) -> str:
        self.log.flush()
        self.log.seek(0)
        return self.log.read()

    def stop(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self.log.close()


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """Both server processes, started together (their start-up overlaps): the demo model with an
    API key, a small body cap and speculative decoding (prompt lookup: every answer below must come
    out as without it), and a tiny random model with a long context, two sequences per step, at
    most 2 waiting and 4 admitted, so requests stay in flight long enough to observe."""
    demo = Server(
        "--api-key",
        KEY,
        "--max-body-bytes",
        "8192",
        "--speculative-method",
        "ngram",
        "--num-speculative-tokens",
        "3",
    )  # starts loading while we write the tiny checkpoint
    try:
        from hetero_infer.testing import tiny_hf_checkpoint

        path = tmp_path_factory.mktemp("slow")
        tiny_hf_checkpoint(
            path,
            "llama",
            max_position_embeddings=8192,
            bos_token_id=None,
            eos_token_id=None,
            pad_token_id=None,
        )
    except BaseException:
        demo.stop()
        raise
    slow = Server(
        "--model",
        str(path),
        "--max-num-seqs",
        "2",
        "--max-queued-requests",
        "2",
        "--num-blocks",
        "2048",
        "--block-size",
        "16",
        "--max-admitted-seqs",
        "4",
        "--request-timeout",
        "4",
        "--shutdown-timeout",
        "1",
        "--served-model-name",
        "slow",
    )
    yield demo, slow
    demo.stop()
    slow.stop()


@pytest.fixture(scope="module")
def server(servers):
    return servers[0].wait_ready()


@pytest.fixture(scope="module")
def slow_server(servers):
    return servers[1].wait_ready()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=60)


def questions(n, seed=5):
    "Bare demo questions ('reverse: a b c'), for chat messages."
    return [re.search(r"<\|user\|>(.*?)<\|eos\|>", p)[1] for p in demo_prompts(n, seed=seed)]


def post(server, path, body=None, key=KEY, **kw):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    if isinstance(body, (bytes, str)):
        return httpx.post(
            server.url + path,
            content=body,
            headers={**headers, "content-type": "application/json"},
            timeout=60,
            **kw,
        )
    return httpx.post(server.url + path, json=body, headers=headers, timeout=60, **kw)


def assert_error(r, status, param=None, contains=None):
    assert r.status_code == status, (r.status_code, r.text)
    err = r.json()["error"]
    assert (
        set(err) == {"message", "type", "param", "code"}
        and isinstance(err["message"], str)
        and err["message"]
    )
    if param is not None:
        assert err["param"] == param, err
    if contains is not None:
        assert contains in err["message"], err
    return err


# ---------------------------------------------------------------- the openai client


def test_completions_shapes_and_batch(client, server):
    ps = demo_prompts(3, seed=1)
    r = client.completions.create(model="hetero-infer", prompt=ps, max_tokens=12, temperature=0)
    assert r.object == "text_completion" and r.id and r.created and r.model == "hetero-infer"
    assert [c.index for c in r.choices] == [0, 1, 2] and all(
        c.finish_reason in ("stop", "length") for c in r.choices
    )
    singles = [
        client.completions.create(model="hetero-infer", prompt=p, max_tokens=12, temperature=0)
        .choices[0]
        .text
        for p in ps
    ]
    assert [c.text for c in r.choices] == singles
    assert (
        r.usage.completion_tokens > 0
        and r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    )
    # token-id prompts give the same completion as the text
    ids = (
        httpx.Client()
        .post(
            server.url + "/v1/completions",
            headers={"Authorization": f"Bearer {KEY}"},
            json={"prompt": ps[0], "max_tokens": 1, "echo": True},
        )
        .json()
    )
    assert ids["choices"][0]["text"].startswith(ps[0])


def test_token_id_prompts_match_text(client, server):
    import tokenizers
    from hetero_infer.core.config import DEMO_MODEL_DIR

    tok = tokenizers.Tokenizer.from_file(
        str(DEMO_MODEL_DIR / "tokenizer.json")
    )  # the same ids as the HF tokenizer, without importing transformers
    ps = demo_prompts(2, seed=2)
    ids = [tok.encode(p).ids for p in ps]
    by_text = client.completions.create(
        model="hetero-infer", prompt=ps, max_tokens=10, temperature=0
    )
    by_ids = client.completions.create(
        model="hetero-infer", prompt=ids, max_tokens=10, temperature=0
    )
    assert [c.text for c in by_ids.choices] == [c.text for c in by_text.choices]
    one = client.completions.create(
        model="hetero-infer", prompt=ids[0], max_tokens=10, temperature=0
    )
    assert one.choices[0].text == by_text.choices[0].text and one.usage.prompt_tokens == len(ids[0])


def test_streaming_equals_greedy_completions(client):
    p = demo_prompts(1, seed=3)[0]
    full = client.completions.create(model="hetero-infer", prompt=p, max_tokens=16, temperature=0)
    chunks = list(
        client.completions.create(
            model="hetero-infer",
            prompt=p,
            max_tokens=16,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full.choices[0].text
    finals = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert finals == [full.choices[0].finish_reason]
    assert (
        chunks[-1].choices == []
        and chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    )


def test_chat_and_streaming_chat(client):
    msgs = [
        {"role": "system", "content": "answer"},
        {"role": "user", "content": "reverse: a b c"},
        {"role": "assistant", "content": "c b a"},
        {"role": "user", "content": "sort: d b a c"},
    ]
    full = client.chat.completions.create(model="hetero-infer", messages=msgs, temperature=0)
    assert full.object == "chat.completion" and full.choices[0].message.role == "assistant"
    assert (
        full.choices[0].finish_reason in ("stop", "length") and full.usage.prompt_tokens > 20
    )  # every turn went through the template
    one = client.chat.completions.create(model="hetero-infer", messages=msgs[-1:], temperature=0)
    assert (
        one.choices[0].message.content == "a b c d" and one.choices[0].finish_reason == "stop"
    )  # the demo model answers one turn
    chunks = list(
        client.chat.completions.create(
            model="hetero-infer",
            messages=msgs,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert (
        chunks[0].object == "chat.completion.chunk"
        and chunks[0].choices[0].delta.role == "assistant"
    )
    assert (
        "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        == full.choices[0].message.content
    )
    assert [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ] == [full.choices[0].finish_reason]
    assert chunks[-1].usage.total_tokens == full.usage.total_tokens
    mt = client.chat.completions.create(
        model="hetero-infer", messages=msgs[-1:], temperature=0, max_completion_tokens=2
    )
    assert mt.choices[0].finish_reason == "length" and mt.usage.completion_tokens == 2


def test_n2_seed_and_stop(client):
    p = demo_prompts(1, seed=4)[0]
    r = client.completions.create(
        model="hetero-infer", prompt=p, max_tokens=8, temperature=1.0, n=2, seed=7
    )
    assert [c.index for c in r.choices] == [0, 1]
    again = client.completions.create(
        model="hetero-infer", prompt=p, max_tokens=8, temperature=1.0, n=2, seed=7
    )
    assert [c.text for c in again.choices] == [c.text for c in r.choices]
    chat = client.chat.completions.create(
        model="hetero-infer",
        messages=[{"role": "user", "content": "sort: e d c b a"}],
        n=2,
        temperature=0,
    )
    assert [c.message.content for c in chat.choices] == ["a b c d e"] * 2
    full = client.chat.completions.create(
        model="hetero-infer",
        messages=[{"role": "user", "content": "sort: e d c b a"}],
        temperature=0,
    )
    cut = client.chat.completions.create(
        model="hetero-infer",
        messages=[{"role": "user", "content": "sort: e d c b a"}],
        temperature=0,
        stop=[" c"],
    )
    assert (
        full.choices[0].message.content == "a b c d e" and cut.choices[0].message.content == "a b"
    )
    assert cut.choices[0].finish_reason == "stop"
    streamed = client.chat.completions.create(
        model="hetero-infer",
        messages=[{"role": "user", "content": "sort: e d c b a"}],
        temperature=0,
        stop=[" c"],
        stream=True,
    )
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == "a b"


def test_logprobs_both_shapes(client):
    p = demo_prompts(1, seed=6)[0]
    r = client.completions.create(
        model="hetero-infer", prompt=p, max_tokens=5, temperature=0, logprobs=3
    )
    lp = r.choices[0].logprobs
    n = r.usage.completion_tokens
    assert (
        len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n
    )
    assert all(v <= 0 for v in lp.token_logprobs) and all(1 <= len(t) <= 4 for t in lp.top_logprobs)
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    # greedy: the chosen token is the most likely one
    assert all(abs(max(t.values()) - v) < 1e-5 for t, v in zip(lp.top_logprobs, lp.token_logprobs))
    c = client.chat.completions.create(
        model="hetero-infer",
        messages=[{"role": "user", "content": "reverse: a b c"}],
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    content = c.choices[0].logprobs.content
    assert len(content) == c.usage.completion_tokens
    for e in content:
        assert e.logprob <= 0 and e.bytes == list(e.token.encode()) and len(e.top_logprobs) == 2
        assert e.top_logprobs[0].logprob >= e.top_logprobs[1].logprob
    assert "".join(e.token for e in content[:3]) == "c b a"
    s = list(
        client.chat.completions.create(
            model="hetero-infer",
            messages=[{"role": "user", "content": "reverse: a b c"}],
            temperature=0,
            logprobs=True,
            top_logprobs=2,
            stream=True,
        )
    )
    streamed = [
        e
        for ch in s
        if ch.choices and ch.choices[0].logprobs
        for e in ch.choices[0].logprobs.content
    ]
    assert [(e.token, round(e.logprob, 4)) for e in streamed] == [
        (e.token, round(e.logprob, 4)) for e in content
    ]


def same(a: list, b: list) -> bool:
    "Two lists of logprobs (None where nothing predicts the token) agree to 1e-4."
    return len(a) == len(b) and all(x == y or abs(x - y) < 1e-4 for x, y in zip(a, b))


def test_echo_with_logprobs_scores_the_prompt(client, server, demo_engine):
    """`echo` with `logprobs` (what lm-evaluation-harness sends to score text): the prompt's text
    and its tokens' logprobs (the first null) ahead of the generated ones, equal to the engine's
    prompt logprobs offline; `max_tokens: 0` scores alone; streamed the same; token-id prompts,
    batched; vLLM's `prompt_logprobs` on completions and chat; echo without logprobs echoes."""
    from hetero_infer.core.sampling_params import SamplingParams

    ps = demo_prompts(2, seed=8)
    ids = [demo_engine.tokenizer.encode(p) for p in ps]
    kw = dict(model="hetero-infer", temperature=0, echo=True, logprobs=2)
    r = client.completions.create(prompt=ids, max_tokens=3, **kw)
    for j, (c, p, x) in enumerate(zip(r.choices, ps, ids)):
        lp, n = c.logprobs, len(x)
        assert c.text.startswith(p) and len(c.text) > len(p)
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.text_offset) > n
        assert "".join(lp.tokens[:n]) == p and lp.text_offset[n] == len(p)
        assert all(
            v <= 0 and len(t) <= 3 for v, t in zip(lp.token_logprobs[1:], lp.top_logprobs[1:])
        )
        demo_engine.add_request(f"offline-{j}", x, SamplingParams(prompt_logprobs=2))
        done = []
        while demo_engine.has_unfinished_requests():
            done += [o for o in demo_engine.step() if o.finished]
        offline = done[0].prompt_logprobs
        for i in range(1, n):
            assert abs(lp.token_logprobs[i] - offline[i][x[i]].logprob) < 1e-4
    score = client.completions.create(prompt=ids[0], max_tokens=0, **kw)
    c = score.choices[0]
    assert c.text == ps[0] and c.finish_reason == "length" and score.usage.completion_tokens == 0
    assert same(c.logprobs.token_logprobs, r.choices[0].logprobs.token_logprobs[: len(ids[0])])
    chunks = list(client.completions.create(prompt=ids[0], max_tokens=3, stream=True, **kw))
    assert "".join(ch.choices[0].text for ch in chunks) == r.choices[0].text
    streamed = [v for ch in chunks for v in ch.choices[0].logprobs.token_logprobs]
    assert same(streamed, r.choices[0].logprobs.token_logprobs)
    plain = client.completions.create(
        model="hetero-infer", prompt=ps[0], echo=True, max_tokens=2, temperature=0
    )
    assert plain.choices[0].text.startswith(ps[0]) and plain.choices[0].logprobs is None
    body = {"prompt": ids[0], "max_tokens": 1, "prompt_logprobs": 1}
    v = post(server, "/v1/completions", body).json()["choices"][0]["prompt_logprobs"]
    assert v[0] is None and len(v) == len(ids[0])
    for i in range(1, len(ids[0])):
        entry = v[i][str(ids[0][i])]
        assert set(entry) == {"logprob", "rank", "decoded_token"} and 1 <= len(v[i]) <= 2
        assert abs(entry["logprob"] - r.choices[0].logprobs.token_logprobs[i]) < 1e-4
    chat = post(
        server, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 2, "prompt_logprobs": 0}
    ).json()
    assert chat["prompt_logprobs"][0] is None
    assert len(chat["prompt_logprobs"]) == chat["usage"]["prompt_tokens"]


def test_models_health_ready_metrics(client, server):
    assert [m.id for m in client.models.list().data] == ["hetero-infer"]
    assert httpx.get(server.url + "/healthz").json() == {"status": "ok"}
    assert httpx.get(server.url + "/readyz").status_code == 200
    text = httpx.get(server.url + "/metrics").text
    for name in (
        "num_requests_running",
        "num_requests_waiting",
        "kv_cache_usage_perc",
        "prefix_cache_hit_rate",
        "prompt_tokens_total",
        "generation_tokens_total",
        "num_preemptions_total",
        "num_aborted_requests_total",
        "num_failed_requests_total",
        "time_to_first_token_seconds_bucket",
        "inter_token_latency_seconds_bucket",
        "e2e_request_latency_seconds_bucket",
        "request_queue_time_seconds_bucket",
        "request_success_total",
        "spec_decode_num_drafts_total",
        "spec_decode_num_draft_tokens_total",
        "spec_decode_num_accepted_tokens_total",
        "spec_decode_acceptance_rate",
    ):
        assert f"hetero_infer:{name}" in text, name
    client.completions.create(
        model="hetero-infer",
        prompt="<|bos|><|user|>sort: a b c d e f g<|eos|><|assistant|>",
        temperature=0,
        max_tokens=10,
    )
    m = server.metrics()
    assert (
        m["hetero_infer:spec_decode_num_accepted_tokens_total"] > 0
    )  # a sorted input is copied: proposals get accepted


# ---------------------------------------------------------------- errors


def test_error_rows(server):
    p = "<|bos|><|user|>reverse: a b<|eos|><|assistant|>"
    assert_error(post(server, "/v1/completions", b'{"prompt": "x",'), 400)
    assert_error(post(server, "/v1/completions", {"prompt": 3}), 400, "prompt")
    assert_error(
        post(server, "/v1/completions", {"prompt": "x", "max_tokens": "many"}), 400, "max_tokens"
    )
    assert_error(post(server, "/v1/completions", {"prompt": ""}), 400, "prompt")
    assert_error(post(server, "/v1/completions", {"prompt": []}), 400, "prompt")
    assert_error(post(server, "/v1/chat/completions", {"messages": []}), 400, "messages")
    assert_error(
        post(server, "/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]}), 400
    )
    assert_error(
        post(server, "/v1/completions", {"prompt": p, "temperature": -1}),
        400,
        "temperature",
        "temperature must be >= 0",
    )
    assert_error(post(server, "/v1/completions", {"prompt": p, "top_p": 0}), 400, "top_p")
    assert_error(post(server, "/v1/completions", {"prompt": p, "n": 0}), 400, "n")
    assert_error(post(server, "/v1/completions", {"prompt": p, "logprobs": 99}), 400, "logprobs")
    assert_error(post(server, "/v1/completions", {"prompt": [5, 99999]}), 400, "prompt")
    assert_error(post(server, "/v1/completions", {"prompt": p, "max_tokens": 0}), 400, "max_tokens")
    assert_error(
        post(server, "/v1/completions", {"prompt": p, "max_tokens": -1}), 400, "max_tokens"
    )
    for k in (21, -1, "1"):
        body = {"prompt": p, "echo": True, "logprobs": 1, "prompt_logprobs": k}
        assert_error(post(server, "/v1/completions", body), 400, "prompt_logprobs")
    assert_error(
        post(server, "/v1/completions", {"prompt": p, "prompt_logprobs": 1, "stream": True}),
        400,
        "prompt_logprobs",
        "not available with stream",
    )
    assert_error(
        post(server, "/v1/completions", {"prompt": p, "echo": True, "logprobs": 21}),
        400,
        "logprobs",
    )
    assert_error(
        post(
            server,
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},
        ),
        400,
        "top_logprobs",
    )
    err = assert_error(
        post(server, "/v1/completions", {"prompt": p, "max_tokens": 60}), 400, "max_tokens"
    )
    n_prompt = int(re.search(r"\((\d+) in the prompt", err["message"])[1])
    assert (
        f"maximum context length is {DEMO_MAX_LEN} tokens" in err["message"]
        and f"you requested {n_prompt + 60} tokens" in err["message"]
    )
    assert_error(post(server, "/v1/completions", {"prompt": p, "model": "gpt-4"}), 404, "model")
    assert_error(
        post(
            server,
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "model": "nope"},
        ),
        404,
        "model",
    )
    assert_error(post(server, "/v1/completions", {"prompt": p}, key=None), 401)
    assert_error(post(server, "/v1/completions", {"prompt": p}, key="wrong-key"), 401)
    assert httpx.get(server.url + "/v1/models").status_code == 401
    assert_error(post(server, "/v1/completions", {"prompt": "x" * 10000}), 413)
    assert_error(
        httpx.get(server.url + "/v1/nothing-here", headers={"Authorization": f"Bearer {KEY}"}), 404
    )


def test_n_past_max_num_seqs_names_n_without_internal_ids(server):
    """n beyond the sequences the engine runs at once is the request's fault: 400 naming `n`, in
    words a client can use (no internal request id)."""
    p = "<|bos|><|user|>reverse: a b<|eos|><|assistant|>"
    for path, body in (
        ("/v1/completions", {"prompt": p}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "reverse: a b"}]}),
    ):
        err = assert_error(post(server, path, {**body, "n": 1000}), 400, "n", "n=1000")
        assert err["message"].startswith("n: ") and not re.search(r"req-|'", err["message"]), err


@pytest.fixture(scope="module")
def demo_engine():
    from hetero_infer.engine.llm import LLM

    return LLM().engine


def test_completions_without_max_tokens_use_the_servers_default(demo_engine):
    """`serve --max-tokens N` applies to completions that leave max_tokens out; without it they
    get OpenAI's 16; a request's own value wins."""
    from fastapi.testclient import TestClient
    from hetero_infer.cli.flags import build_parser
    from hetero_infer.cli.config import serve_options
    from hetero_infer.server.app import build_app

    body = {
        "prompt": "<|bos|><|user|>reverse: a b c<|eos|><|assistant|>",
        "temperature": 0,
        "ignore_eos": True,
    }
    defaults = serve_options(build_parser().parse_args(["serve", "--max-tokens", "5"]))[
        "default_sampling"
    ]
    with TestClient(build_app(demo_engine, default_sampling=defaults)) as c:
        assert c.post("/v1/completions", json=body).json()["usage"]["completion_tokens"] == 5
        assert (
            c.post("/v1/completions", json={**body, "max_tokens": 7}).json()["usage"][
                "completion_tokens"
            ]
            == 7
        )
        assert (
            c.post(
                "/v1/chat/completions",
                json={
                    "messages": [{"role": "user", "content": "reverse: a b c"}],
                    "temperature": 0,
                    "ignore_eos": True,
                },
            ).json()["usage"]["completion_tokens"]
            == 5
        )
    with TestClient(build_app(demo_engine)) as c:
        assert c.post("/v1/completions", json=body).json()["usage"]["completion_tokens"] == 16


def test_errors_surface_in_the_openai_client(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="hetero-infer", prompt="x", temperature=-2)
    assert e.value.body["param"] == "temperature"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4", prompt="x")
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=client.base_url, api_key="bad", max_retries=0).models.list()


# ---------------------------------------------------------------- concurrency


def test_50_concurrent_clients_get_their_own_output(server):
    qs = questions(50, seed=9)
    body = lambda q: {
        "messages": [{"role": "user", "content": q}],
        "max_tokens": 12,
        "temperature": 0,
    }
    hdr = {"Authorization": f"Bearer {KEY}"}
    with httpx.Client(timeout=60, headers=hdr) as h:
        alone = [
            h.post(server.url + "/v1/chat/completions", json=body(q)).json()["choices"][0][
                "message"
            ]["content"]
            for q in qs
        ]

    async def run():
        async with httpx.AsyncClient(
            timeout=120, headers=hdr, limits=httpx.Limits(max_connections=100)
        ) as h:

            async def one(q, stream):
                if not stream:
                    return (await h.post(server.url + "/v1/chat/completions", json=body(q))).json()[
                        "choices"
                    ][0]["message"]["content"]
                text = ""
                async with h.stream(
                    "POST", server.url + "/v1/chat/completions", json={**body(q), "stream": True}
                ) as r:
                    async for line in r.aiter_lines():
                        if line.startswith("data: {"):
                            text += (json.loads(line[6:])["choices"] or [{"delta": {}}])[0][
                                "delta"
                            ].get("content") or ""
                return text

            return await asyncio.gather(*[one(q, i % 2 == 0) for i, q in enumerate(qs)])

    together = asyncio.run(run())
    assert together == alone
    assert len(set(alone)) > 40  # distinct questions, distinct answers: cross-talk could not hide


# ------------------------------------- a slow model: backpressure, disconnects, timeouts, SIGTERM


def long_body(i=0, stream=True):
    return {
        "prompt": [1 + i, 2, 3, 4],
        "max_tokens": 6000,
        "ignore_eos": True,
        "temperature": 0,
        "stream": stream,
    }


def open_stream(url, body):
    "Start a streaming request and return (client, response) once its headers arrived."
    h = httpx.Client(timeout=30)
    r = h.send(h.build_request("POST", url + "/v1/completions", json=body), stream=True)
    return h, r


def wait_for(cond, timeout=20, what=""):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        v = cond()
        if v:
            return v
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def test_disconnect_aborts_and_frees_blocks(slow_server):
    s = slow_server
    before = s.metrics()
    h, r = open_stream(s.url, long_body(0))
    lines = r.iter_lines()
    got = [next(lines) for _ in range(6)]
    assert any(l.startswith("data: {") for l in got)
    wait_for(lambda: s.metrics()["hetero_infer:kv_cache_usage_perc"] > 0, what="blocks in use")
    r.close()
    h.close()  # the client goes away mid-stream
    m = wait_for(
        lambda: (
            lambda m: (
                m
                if m["hetero_infer:num_aborted_requests_total"]
                > before["hetero_infer:num_aborted_requests_total"]
                and m["hetero_infer:num_requests_running"] == 0
                else None
            )
        )(s.metrics()),
        what="the abort",
    )
    assert m["hetero_infer:kv_cache_usage_perc"] == 0.0  # every block returned
    assert m["hetero_infer:num_requests_waiting"] == 0


def test_disconnect_of_a_non_streaming_request_aborts_it(slow_server):
    """A client that gives up on a plain (non-streamed) request: the server notices the
    disconnect and aborts, well before the 4 s request timeout."""
    s = slow_server
    rejected = lambda: s.metrics().get('hetero_infer:request_rejected_total{status="504"}', 0.0)
    before, timeouts = s.metrics()["hetero_infer:num_aborted_requests_total"], rejected()
    t0 = time.monotonic()
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(
            s.url + "/v1/completions",
            json=long_body(stream=False),
            timeout=httpx.Timeout(30, read=0.7),
        )
    wait_for(
        lambda: s.metrics()["hetero_infer:num_aborted_requests_total"] > before, what="the abort"
    )
    m = s.metrics()
    assert (
        m["hetero_infer:kv_cache_usage_perc"] == 0.0 and m["hetero_infer:num_requests_running"] == 0
    )
    time.sleep(max(0.0, 4.5 - (time.monotonic() - t0)))
    assert rejected() == timeouts  # it was the disconnect, not the request timeout, that ended it


def test_admission_bounds_answer_503_then_recover(slow_server):
    """Both bounds: core's max_admitted_seqs (running + waiting, n counted) and the server's
    max_queued_requests (waiting)."""
    s = slow_server
    opened = [open_stream(s.url, long_body(i)) for i in range(3)]  # 2 running + 1 waiting
    try:
        wait_for(lambda: s.metrics()["hetero_infer:num_requests_waiting"] == 1, what="one waiting")
        r = httpx.post(
            s.url + "/v1/completions", json={"prompt": [5, 6], "max_tokens": 2, "n": 2}, timeout=30
        )  # 3 + 2 > 4 admitted
        err = assert_error(r, 503)
        assert (
            err["type"] == "server_overloaded"
            and "max_admitted_seqs=4" in err["message"]
            and r.headers.get("retry-after")
        )
        opened.append(open_stream(s.url, long_body(3)))  # 2 running + 2 waiting: the queue is full
        wait_for(lambda: s.metrics()["hetero_infer:num_requests_waiting"] == 2, what="two waiting")
        err = assert_error(
            httpx.post(
                s.url + "/v1/completions", json={"prompt": [5, 6], "max_tokens": 2}, timeout=30
            ),
            503,
        )
        assert err["type"] == "server_overloaded" and "max_queued_requests=2" in err["message"]
        assert s.metrics()['hetero_infer:request_rejected_total{status="503"}'] >= 2
    finally:
        for h, r in opened:
            r.close()
            h.close()
    wait_for(
        lambda: (
            s.metrics()["hetero_infer:num_requests_running"]
            + s.metrics()["hetero_infer:num_requests_waiting"]
            == 0
        ),
        what="aborts",
    )
    ok = httpx.post(
        s.url + "/v1/completions",
        json={"prompt": [5, 6], "max_tokens": 3, "ignore_eos": True, "n": 2},
        timeout=30,
    )
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 6
    assert s.metrics()["hetero_infer:kv_cache_usage_perc"] == 0.0


def test_request_timeout_aborts(slow_server):
    s = slow_server

    def streamed():
        with httpx.stream("POST", s.url + "/v1/completions", json=long_body(1), timeout=60) as r:
            return [l for l in r.iter_lines() if l]

    with ThreadPoolExecutor(
        1
    ) as ex:  # both run at once (one waits in the queue, and times out all the same)
        fut = ex.submit(streamed)
        t0 = time.monotonic()
        err = assert_error(
            httpx.post(s.url + "/v1/completions", json=long_body(stream=False), timeout=60), 504
        )
        assert err["type"] == "timeout" and 3.5 < time.monotonic() - t0 < 30
        lines = fut.result()
    assert lines[-1] == "data: [DONE]" and json.loads(lines[-2][6:])["error"]["type"] == "timeout"
    wait_for(
        lambda: s.metrics()["hetero_infer:kv_cache_usage_perc"] == 0.0,
        what="blocks freed after timeouts",
    )


# ---------------------------------------------------- fuzzing (hypothesis over the request models)

junk = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-3, 3),
    st.floats(allow_nan=False, allow_infinity=False, width=32),
    st.text(max_size=4),
    st.lists(st.integers(-2, 400), max_size=3),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
)
small = st.one_of(st.integers(-2, 6), junk)
fields = {
    "model": st.one_of(st.just("hetero-infer"), junk),
    "n": st.one_of(st.integers(0, 3), junk),
    "temperature": st.one_of(st.floats(-1, 3), junk),
    "top_p": st.one_of(st.floats(-0.5, 1.5), junk),
    "top_k": st.one_of(st.integers(-2, 400), junk),
    "min_p": st.one_of(st.floats(-0.5, 1.5), junk),
    "presence_penalty": st.one_of(st.floats(-3, 3), junk),
    "frequency_penalty": st.one_of(st.floats(-3, 3), junk),
    "repetition_penalty": st.one_of(st.floats(-1, 3), junk),
    "seed": st.one_of(st.integers(-(2**70), 2**70), junk),
    "stop": st.one_of(st.text(max_size=3), st.lists(st.text(max_size=3), max_size=3), junk),
    "stop_token_ids": st.one_of(st.lists(st.integers(-5, 400), max_size=3), junk),
    "ignore_eos": st.one_of(st.booleans(), junk),
    "min_tokens": small,
    "max_tokens": small,
    "stream": st.one_of(st.booleans(), junk),
    "stream_options": st.one_of(st.fixed_dictionaries({"include_usage": st.booleans()}), junk),
    "logprobs": st.one_of(st.integers(-1, 25), junk),
    "echo": st.one_of(st.booleans(), junk),
    "prompt_logprobs": st.one_of(st.integers(-1, 21), junk),
    "user": junk,
}
prompts = st.one_of(
    st.text(max_size=20),
    st.lists(st.integers(-3, 300), max_size=6),
    st.lists(st.text(max_size=8), max_size=3),
    st.lists(st.lists(st.integers(-1, 300), max_size=4), max_size=3),
    junk,
)
messages = st.one_of(
    st.lists(
        st.fixed_dictionaries(
            {
                "role": st.sampled_from(["user", "system", "assistant", "tool", ""]),
                "content": st.one_of(st.text(max_size=20), junk),
            }
        ),
        max_size=3,
    ),
    junk,
)
chat_fields = {
    **{k: v for k, v in fields.items() if k not in ("echo", "logprobs")},
    "logprobs": st.one_of(st.booleans(), junk),
    "top_logprobs": st.one_of(st.integers(-1, 25), junk),
    "max_completion_tokens": small,
    "chat_template_kwargs": st.one_of(
        st.dictionaries(st.sampled_from(["messages", "documents", "x", "chat_template"]), junk),
        junk,
    ),
    "logit_bias": st.one_of(st.dictionaries(st.text(max_size=3), st.integers(-200, 200)), junk),
    "response_format": junk,
    "tool_choice": junk,
}
completion_bodies = st.fixed_dictionaries({"prompt": prompts}, optional=fields)
chat_bodies = st.fixed_dictionaries({"messages": messages}, optional=chat_fields)


def check_no_5xx(server, path, body):
    r = post(server, path, body)
    assert r.status_code < 500, (r.status_code, r.text, body)
    if r.status_code >= 400:
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    elif r.headers["content-type"].startswith("text/event-stream"):
        lines = [l for l in r.text.split("\n") if l]
        assert lines[-1] == "data: [DONE]", body
        for l in lines[:-1]:
            ev = json.loads(l[6:])
            assert "error" not in ev or ev["error"]["type"] != "internal_error", (ev, body)
    else:
        assert r.json()["usage"]["total_tokens"] >= 0


@settings(
    derandomize=True, max_examples=100, deadline=None, suppress_health_check=list(HealthCheck)
)
@given(body=st.one_of(completion_bodies, chat_bodies.map(lambda b: {"__chat__": True, **b})))
def test_fuzz_request_bodies_never_5xx(server, body):
    path = "/v1/chat/completions" if body.pop("__chat__", False) else "/v1/completions"
    check_no_5xx(server, path, body)


def test_server_healthy_after_fuzz(server, client):
    assert (
        httpx.get(server.url + "/healthz").status_code == 200
        and httpx.get(server.url + "/readyz").status_code == 200
    )
    r = client.chat.completions.create(
        model="hetero-infer", messages=[{"role": "user", "content": "sort: c b a"}], temperature=0
    )
    assert r.choices[0].message.content == "a b c"
    m = server.metrics()
    assert (
        m["hetero_infer:kv_cache_usage_perc"] == 0.0 and m["hetero_infer:num_requests_running"] == 0
    )
    assert server.proc.poll() is None


# ------------------------------------------------------- SIGTERM (last: it stops the slow server)


def test_sigterm_drains_open_streams_and_exits_0(slow_server):
    s = slow_server
    opened = [open_stream(s.url, long_body(i)) for i in range(2)]
    its = [r.iter_lines() for _, r in opened]
    for it in its[:1]:
        next(it)
    s.proc.send_signal(signal.SIGTERM)
    try:
        ready = httpx.get(s.url + "/readyz", timeout=5).status_code
    except httpx.HTTPError:
        ready = None
    assert ready in (503, None)
    for (h, r), it in zip(opened, its):
        rest = [l for l in it if l]  # read to the end: a final event and [DONE], or a clean close
        events = [json.loads(l[6:]) for l in rest if l.startswith("data: {")]
        assert rest and rest[-1] == "data: [DONE]", rest[-3:]
        assert events[-1]["choices"][0]["finish_reason"] == "abort"
        r.close()
        h.close()
    assert s.proc.wait(30) == 0


# ---------------------------------------------------------------- the README's examples, as written


def readme_serve_section() -> tuple[str, list[tuple[str, str]], str]:
    """The README's Serve section: its `hetero-infer serve` line, each curl command with the
    answer its comment promises, and the openai snippet."""
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    sec = readme.split("## Serve\n", 1)[1].split("\n## ", 1)[0]
    serve = re.search(r"^hetero-infer serve$", sec, re.M)
    curls = re.findall(r"^(curl .*)\n# answer: \"(.*?)\"", sec, re.M)
    client = re.search(r"^```python\n(from openai import OpenAI\n.*?)^```", sec, re.M | re.S)
    assert serve and len(curls) == 3 and client, (
        "README.md's Serve section lost its serve line, its three curl examples or its openai"
        " snippet"
    )
    return serve[0], curls, client[1]


def port_is_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed")
def test_readme_serve_examples_work_as_written():
    """`hetero-infer serve` exactly as the README writes it, then each README curl command run by
    the shell as written, and the openai snippet: each gives the answer its comment promises.
    (Only when port 3000 is taken here is the port swapped for a free one.)"""
    serve, curls, client = readme_serve_section()
    port = 3000 if port_is_free(3000) else free_port()
    here = (
        (lambda text: text)
        if port == 3000
        else (lambda text: text.replace("127.0.0.1:3000", f"127.0.0.1:{port}"))
    )
    argv = shlex.split(serve) + ([] if port == 3000 else ["--port", str(port)])
    exe = os.path.join(os.path.dirname(sys.executable), "hetero-infer")
    argv = (
        [exe]
        if os.path.exists(exe)
        else [
            sys.executable,
            "-c",
            "import sys; from hetero_infer.cli.main import main; sys.exit(main())",
        ]
    ) + argv[1:]
    log = tempfile.TemporaryFile("w+")
    proc = subprocess.Popen(
        argv, env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=log, stderr=subprocess.STDOUT
    )
    try:
        end = time.monotonic() + 180
        while True:
            if proc.poll() is not None:
                log.seek(0)
                raise RuntimeError(f"`{serve}` exited {proc.returncode}: {log.read()[-3000:]}")
            try:
                if httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < end, "the server did not become ready"
            time.sleep(0.2)
        for cmd, answer in curls:
            r = subprocess.run(
                here(cmd),
                shell=True,
                executable="/bin/bash",
                capture_output=True,
                text=True,
                timeout=120,
            )
            assert r.returncode == 0, (cmd, r.stderr)
            if '"stream": true' in cmd:
                events = [
                    l[len("data: ") :] for l in r.stdout.splitlines() if l.startswith("data: ")
                ]
                assert events and events[-1] == "[DONE]", r.stdout
                chunks = [json.loads(e) for e in events[:-1]]
                text = "".join(
                    c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]
                )
            else:
                choice = json.loads(r.stdout)["choices"][0]
                text = choice["message"]["content"] if "message" in choice else choice["text"]
            assert text == answer, (cmd, r.stdout)
        promised = re.search(r"#\s*(.+)$", client.strip().splitlines()[-1])[1]
        r = subprocess.run(
            [sys.executable, "-c", here(client)], capture_output=True, text=True, timeout=120
        )
        assert r.returncode == 0 and r.stdout.strip() == promised, (r.stdout, r.stderr)
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
        log.close()


# ---------------------------------------------------- fields, templates, text, CORS, health

P = "<|bos|><|user|>reverse: a b c<|eos|><|assistant|>"
CHAT = [{"role": "user", "content": "reverse: a b c"}]


def test_unimplemented_fields_are_refused_by_name(server, client):
    """OpenAI/vLLM fields the server does not implement, and malformed structured-output and tool
    fields: a 400 naming each, never an ignoring 200."""
    for path, body, param in (
        ("/v1/completions", {"prompt": P, "suffix": "!"}, "suffix"),
        ("/v1/completions", {"prompt": P, "best_of": 2}, "best_of"),
        ("/v1/completions", {"prompt": P, "prompt_logprobs": 21}, "prompt_logprobs"),
        ("/v1/chat/completions", {"messages": CHAT, "prompt_logprobs": -1}, "prompt_logprobs"),
        ("/v1/completions", {"prompt": P, "guided_json": {"type": "nope"}}, "guided_json"),
        ("/v1/completions", {"prompt": P, "tools": [], "tool_choice": "auto"}, "tools"),
        (
            "/v1/chat/completions",
            {"messages": CHAT, "response_format": {"type": "json_schema", "json_schema": {}}},
            "response_format.json_schema.schema",
        ),
        (
            "/v1/chat/completions",
            {"messages": CHAT, "structured_outputs": {"regex": "(", "choice": ["a"]}},
            "structured_outputs",
        ),
        ("/v1/chat/completions", {"messages": CHAT, "structural_tag": "x"}, "structural_tag"),
        ("/v1/chat/completions", {"messages": CHAT, "tools": [{"type": "function"}]}, "tools"),
        ("/v1/chat/completions", {"messages": CHAT, "tool_choice": "auto"}, "tool_choice"),
        ("/v1/chat/completions", {"messages": CHAT, "use_beam_search": True}, "use_beam_search"),
        (
            "/v1/chat/completions",
            {"messages": CHAT, "stream_options": {"include_usage": True}},
            "stream_options",
        ),
    ):
        assert_error(post(server, path, body), 400, param, param)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="hetero-infer", prompt=P, suffix="!")
    assert e.value.body["param"] == "suffix"
    # what asks for nothing passes, and `user` (advisory) is accepted
    for path, body in (
        ("/v1/chat/completions", {"messages": CHAT, "tool_choice": "none", "user": "u1"}),
        ("/v1/completions", {"prompt": P, "best_of": 1, "suffix": None, "user": "u1"}),
    ):
        r = post(server, path, {**body, "max_tokens": 2})
        assert r.status_code == 200, r.text


def test_logit_bias_is_honoured_and_checked(server):
    """logit_bias moves the greedy choice (+100 forces a token, -100 forbids one); bad keys,
    values and ids are 400s naming logit_bias."""
    from hetero_infer.core.config import DEMO_MODEL_DIR
    from hetero_infer.engine.tokenization import load_tokenizer

    tok = load_tokenizer(DEMO_MODEL_DIR)
    body = {"prompt": P, "max_tokens": 3, "temperature": 0, "ignore_eos": True}
    plain = post(server, "/v1/completions", body).json()["choices"][0]["text"]
    z = tok.encode("z", add_special_tokens=False)[-1]
    forced = post(server, "/v1/completions", {**body, "logit_bias": {str(z): 100}}).json()
    assert forced["choices"][0]["text"] == tok.decode([z]) * 3, forced
    first = tok.encode(plain, add_special_tokens=False)[0]
    banned = post(server, "/v1/completions", {**body, "logit_bias": {str(first): -100}}).json()
    assert not banned["choices"][0]["text"].startswith(tok.decode([first])), (plain, banned)
    chat = {"messages": CHAT, "max_tokens": 2, "temperature": 0, "logit_bias": {str(z): 100}}
    assert (
        post(server, "/v1/chat/completions", chat).json()["choices"][0]["message"]["content"]
        == tok.decode([z]) * 2
    )
    for bias in ({"a": 1}, {"-1": 1}, {str(z): 101}, {str(z): -100.5}, {"999999": 1}):
        assert_error(
            post(server, "/v1/completions", {**body, "logit_bias": bias}), 400, "logit_bias"
        )


def test_lone_surrogate_is_the_clients_400(server):
    """A lone UTF-16 surrogate (a JavaScript client cutting an emoji) is a 400 naming the field,
    on both endpoints."""
    assert_error(post(server, "/v1/completions", b'{"prompt": "a\\ud800b"}'), 400, "prompt")
    assert_error(post(server, "/v1/completions", b'{"prompt": ["ok", "\\udfff"]}'), 400, "prompt")
    body = b'{"messages": [{"role": "user", "content": "x\\ud83d"}]}'
    assert_error(post(server, "/v1/chat/completions", body), 400, "messages")
    assert server.proc.poll() is None


def test_top_logprobs_out_of_range_names_top_logprobs(server):
    for k in (21, -1):
        body = {"messages": CHAT, "logprobs": True, "top_logprobs": k, "max_tokens": 1}
        assert_error(post(server, "/v1/chat/completions", body), 400, "top_logprobs")


def test_tool_role_and_health(server):
    "Role `tool` is accepted as offline LLM.chat accepts it; /health answers beside /healthz."
    msgs = [
        {"role": "user", "content": "reverse: a b c"},
        {"role": "assistant", "content": "", "tool_calls": None},
        {"role": "tool", "content": "c b a", "tool_call_id": "call-1"},
    ]
    r = post(server, "/v1/chat/completions", {"messages": msgs, "max_tokens": 2})
    assert r.status_code == 200, r.text
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}


def test_cors_preflight_and_headers(server):
    "A browser's preflight is answered (no key needed); answers carry Access-Control-Allow-Origin."
    origin = {"Origin": "https://app.example"}
    r = httpx.options(
        server.url + "/v1/chat/completions",
        headers={
            **origin,
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization,content-type",
        },
    )
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "*", r.headers
    hdr = {**origin, "Authorization": f"Bearer {KEY}"}
    body = {"prompt": P, "max_tokens": 1}
    r = httpx.post(server.url + "/v1/completions", json=body, headers=hdr, timeout=60)
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "*"
    r = httpx.get(server.url + "/v1/models", headers=origin)  # refused, still readable by the page
    assert r.status_code == 401 and r.headers["access-control-allow-origin"] == "*"


def in_thread(app):
    "A real uvicorn server on a free port, in this process; yields its URL."
    from hetero_infer.server.serve import serve_in_thread

    srv, url = serve_in_thread(app)
    try:
        yield url
    finally:
        srv.should_exit = True
        srv.thread.join(10)


def test_allowed_origins_limit_cors():
    from hetero_infer.engine.llm_engine import LLMEngine
    from hetero_infer.server.app import build_app

    app = build_app(LLMEngine(), allowed_origins=["https://app.example"], allowed_methods=["POST"])
    for url in in_thread(app):
        ok = httpx.get(url + "/health", headers={"Origin": "https://app.example"})
        other = httpx.get(url + "/health", headers={"Origin": "https://evil.example"})
        assert ok.headers["access-control-allow-origin"] == "https://app.example"
        assert "access-control-allow-origin" not in other.headers
        pre = {"Origin": "https://app.example", "Access-Control-Request-Method": "DELETE"}
        assert httpx.options(url + "/v1/completions", headers=pre).status_code == 400


TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] == 'system' and not loop.first %}"
    "{{ raise_exception('a system message must come first') }}{% endif %}"
    "<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}{% endfor %}"
    "{% if hint is defined %}{{ hint }}{% endif %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


@pytest.fixture(scope="module")
def template_url(tmp_path_factory):
    "The demo model, with a template that takes a `hint` and refuses a late system message."
    from hetero_infer.core.config import DEMO_MODEL_DIR
    from hetero_infer.engine.llm_engine import LLMEngine
    from hetero_infer.server.app import build_app

    path = tmp_path_factory.mktemp("template") / "m"
    shutil.copytree(DEMO_MODEL_DIR, path)
    cfg = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": TEMPLATE}))
    yield from in_thread(build_app(LLMEngine(model=str(path))))


def test_chat_template_kwargs_reach_the_template(template_url):
    """vLLM's chat_template_kwargs become template variables; add_generation_prompt false leaves
    the assistant's turn out."""
    body = {"messages": CHAT, "max_tokens": 1}
    usage = lambda **kw: httpx.post(
        template_url + "/v1/chat/completions", json={**body, **kw}, timeout=60
    ).json()["usage"]["prompt_tokens"]
    base = usage()
    assert usage(chat_template_kwargs={"hint": "abc"}) == base + 3
    assert usage(add_generation_prompt=False) < base
    for kwargs in ({"tokenize": True}, {"chat_template": "{{ 1/0 }}"}, {"messages": 1}):
        r = httpx.post(
            template_url + "/v1/chat/completions",
            json={**body, "chat_template_kwargs": kwargs},
            timeout=60,
        )
        assert_error(r, 400, "chat_template_kwargs")


def test_a_template_that_refuses_the_conversation_is_a_400(template_url):
    msgs = [*CHAT, {"role": "system", "content": "late"}]
    r = httpx.post(template_url + "/v1/chat/completions", json={"messages": msgs}, timeout=60)
    assert_error(r, 400, "messages", "a system message must come first")


def test_port_0_banner_names_the_bound_port():
    "`serve --port 0` prints the port the system chose, and the server answers there."
    code = "import sys; from hetero_infer.cli.main import main; sys.exit(main(sys.argv[1:]))"
    proc = subprocess.Popen(
        [sys.executable, "-c", code, "serve", "--port", "0", "--log-level", "warning"],
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    lines, banner = [], r"serving 'hetero-infer' on http://127\.0\.0\.1:(\d+)/v1"

    def read():  # the server keeps stderr open: read it aside, look for the banner here
        for line in proc.stderr:
            lines.append(line)

    threading.Thread(target=read, daemon=True).start()
    try:
        port, end = None, time.monotonic() + 180
        while port is None and time.monotonic() < end and proc.poll() is None:
            found = [m for m in (re.search(banner, line) for line in list(lines)) if m]
            port = int(found[0][1]) if found else None
            time.sleep(0.2)
        assert port, "no banner with the bound port"
        assert port != 0
        assert httpx.get(f"http://127.0.0.1:{port}/health", timeout=10).status_code == 200
    finally:
        proc.terminate()
        proc.wait(30)
