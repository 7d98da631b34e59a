"""Disaggregated serving (19) end to end, started as a user starts it: `hetero-infer serve
--kv-role prefill` (sending from 127.0.0.2) and `hetero-infer serve --kv-role decode` (receiving
on 127.0.0.1), each its own process, and the proxy in this process: the KV crosses a process
boundary over TCP, from one address to another, as between two machines.
Greedy answers equal one engine's, twelve at once, streamed and not; the metrics count the
transfer; killing the prefill instance leaves the right answer (or a 5xx) and an empty decode
cache."""

import json
import re
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch

from hetero_infer.core.config import EngineConfig
from hetero_infer.core.sampling_params import SamplingParams
from hetero_infer.disagg.bench import Process, ready, scrape
from hetero_infer.disagg.proxy import Backends, build_proxy_app
from hetero_infer.engine.llm_engine import LLMEngine
from hetero_infer.server.serve import serve_in_thread
from hetero_infer.testing import tiny_hf_checkpoint

CPU = dict(device="cpu", dtype="float32", block_size=16, num_blocks=512)
FLAGS = ["--device", "cpu", "--dtype", "float32", "--block-size", "16", "--num-blocks", "512"]


def ids(n, seed):
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def wait_ready(url, timeout=120):
    end = time.monotonic() + timeout
    while httpx.get(url + "/readyz", timeout=5).status_code != 200:
        assert time.monotonic() < end, f"{url} not ready"
        time.sleep(0.1)


def tokens(url, prompt, stream=False, max_tokens=12, **fields):
    "Greedy token ids of a completion through `url` (a failed request: its HTTP status)."
    body = dict(prompt=prompt, max_tokens=max_tokens, temperature=0, ignore_eos=True, logprobs=0)
    body |= fields
    if not stream:
        r = httpx.post(url + "/v1/completions", json=body, timeout=120)
        if r.status_code != 200:
            return r.status_code
        return [int(t[9:]) for t in r.json()["choices"][0]["logprobs"]["tokens"]]
    out = []
    with httpx.stream(
        "POST", url + "/v1/completions", json=body | {"stream": True}, timeout=120
    ) as r:
        if r.status_code != 200:
            return r.status_code
        for line in r.iter_lines():
            if line.startswith("data: {"):
                lp = json.loads(line[6:])["choices"][0].get("logprobs")
                out += [int(t[9:]) for t in lp["tokens"]] if lp else []
    return out


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    model = tmp_path_factory.mktemp("disagg_serving")
    tiny_hf_checkpoint(model, "llama", bos_token_id=None, eos_token_id=None, pad_token_id=None)
    serve = ["serve", "--model", str(model), *FLAGS, "--kv-role"]
    pre = Process(*serve, "prefill", "--kv-address", "127.0.0.2")
    dec = Process(*serve, "decode", "--kv-address", "127.0.0.1", "--kv-transfer-timeout", "20")
    proxy = None
    try:
        proxy, x_url = serve_in_thread(build_proxy_app(Backends([pre.url], [dec.url])))
        one = LLMEngine(EngineConfig(model=str(model), **CPU))
        ready(pre, dec)
        yield dict(pre=pre, d_url=dec.url, x_url=x_url, one=one)
        one.close()
    finally:
        pre.stop(kill=True)
        dec.stop()
        if proxy is not None:
            proxy.should_exit = True
            proxy.thread.join(10)


def want(one, prompts, max_tokens=12):
    p = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    for rid, x in prompts.items():
        one.add_request(rid, x, p)
    done = {}
    while one.has_unfinished_requests():
        done |= {o.request_id: o.outputs[0].token_ids for o in one.step() if o.finished}
    return done


def test_twelve_at_once_streamed_and_not_equal_one_instance(cluster):
    c = cluster
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(90, 301, (12,), generator=g).tolist()
    prompts = {f"q{i}": ids(n, 100 + i) for i, n in enumerate(lengths)}
    ref = want(c["one"], prompts)
    before_d, before_p = scrape(c["d_url"]), c["pre"].metrics()
    with ThreadPoolExecutor(12) as pool:
        got = dict(
            zip(
                prompts,
                pool.map(lambda k: tokens(c["x_url"], prompts[k], int(k[1:]) % 2 == 0), prompts),
            )
        )
    assert got == ref
    after_d = scrape(c["d_url"])
    delta = lambda a, b, k: a[f"hetero_infer:{k}"] - b[f"hetero_infer:{k}"]
    received = delta(after_d, before_d, "kv_transfer_received_tokens_total")
    assert received >= 0.8 * sum(lengths)
    # the prefill server's /metrics reads its sender's counters as of now, though the last sends
    # end after its last step (an acknowledgement may still be on its way: a few tries)
    for _ in range(50):
        after_p = c["pre"].metrics()
        if delta(after_p, before_p, "kv_transfer_sent_tokens_total") == received:
            break
        time.sleep(0.1)
    assert delta(after_p, before_p, "kv_transfer_sent_tokens_total") == received
    assert after_p["hetero_infer:kv_transfer_send_failures_total"] == 0
    assert delta(after_p, before_p, "generation_tokens_total") <= 2 * 12
    assert delta(after_d, before_d, "kv_transfer_local_prefills_total") == 0
    assert after_d["hetero_infer:kv_cache_usage_perc"] == 0
    px = scrape(c["x_url"])
    assert px['hetero_infer:proxy_requests_total{route="/v1/completions",status="200"}'] >= 12
    assert re.search(
        r'kv_transfer_info\{address="127\.0\.0\.1:\d+",role="decode"\}',
        httpx.get(c["d_url"] + "/metrics").text,
    )


def test_the_proxy_answers_models_health_readiness_and_refusals(cluster):
    x = cluster["x_url"]
    assert httpx.get(x + "/v1/models").json()["data"][0]["id"] == "hetero-infer"
    assert httpx.get(x + "/healthz").json() == {"status": "ok"}
    r = httpx.get(x + "/readyz")
    assert r.status_code == 200 and all(r.json()["instances"].values())
    bad = httpx.post(x + "/v1/completions", json=dict(prompt=ids(100, 1), max_tokens=-3))
    assert bad.status_code == 400 and "max_tokens" in bad.json()["error"]["message"]
    assert httpx.post(x + "/v1/completions", content=b"{nope").status_code == 400


def test_killing_the_prefill_instance(cluster):
    "Runs last: the prefill process dies; a request still ends in time, right or a 5xx."
    c = cluster
    p = ids(200, 7)
    ref = want(c["one"], {"k": p})["k"]
    c["pre"].stop(kill=True)
    t0 = time.monotonic()
    got = tokens(c["x_url"], p)
    assert time.monotonic() - t0 < 90
    assert got == ref or (isinstance(got, int) and got >= 500)
    assert scrape(c["d_url"])["hetero_infer:kv_cache_usage_perc"] == 0
    assert scrape(c["x_url"])["hetero_infer:proxy_local_prefills_total"] >= 1
    # streamed, too; a client's own kv_transfer_params are dropped by the proxy (else the decode
    # instance would wait kv_transfer_timeout for KV that never comes)
    before = scrape(c["d_url"])["hetero_infer:kv_transfer_timeouts_total"]
    never = {"do_remote_prefill": True, "transfer_id": "never"}
    assert tokens(c["x_url"], p, stream=True, kv_transfer_params=never) == ref
    assert scrape(c["d_url"])["hetero_infer:kv_transfer_timeouts_total"] == before


def test_no_decode_instance_is_a_503():
    app = build_proxy_app(Backends(["http://127.0.0.1:9"], ["http://127.0.0.1:9"]))
    srv, url = serve_in_thread(app)
    try:
        r = httpx.post(url + "/v1/completions", json=dict(prompt=[1, 2, 3], max_tokens=2))
        assert r.status_code == 503 and r.json()["error"]["type"] == "service_unavailable"
        assert httpx.get(url + "/readyz").status_code == 503
    finally:
        srv.should_exit = True
        srv.thread.join(10)


def test_chat_streamed_and_not_through_prefill_and_decode_in_one_process():
    "The shipped demo model (it has a chat template): chat completions split across two roles."
    from hetero_infer.server.app import build_app

    cfg = dict(device="cpu", dtype="float32", block_size=4, num_blocks=256)
    engines = [
        LLMEngine(EngineConfig(**cfg)),
        LLMEngine(EngineConfig(**cfg, kv_role="prefill", kv_address="127.0.0.2")),
        LLMEngine(EngineConfig(**cfg, kv_role="decode", kv_address="127.0.0.1")),
    ]
    servers = [serve_in_thread(build_app(e)) for e in engines]
    try:
        (_, one), (_, pre), (_, dec) = servers
        for u in (one, pre, dec):
            wait_ready(u)
        proxy, x = serve_in_thread(build_proxy_app(Backends([pre], [dec])))
        servers.append((proxy, x))
        msgs = [{"role": "user", "content": "What is seven plus eight? Answer briefly."}]
        body = dict(messages=msgs, max_tokens=8, temperature=0)
        ask = lambda u: httpx.post(u + "/v1/chat/completions", json=body, timeout=60).json()
        want = ask(one)["choices"][0]["message"]["content"]
        assert ask(x)["choices"][0]["message"]["content"] == want
        text = ""
        with httpx.stream("POST", x + "/v1/chat/completions", json=body | {"stream": True}) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    text += json.loads(line[6:])["choices"][0]["delta"].get("content") or ""
        assert text == want
        assert scrape(dec)["hetero_infer:kv_transfer_received_tokens_total"] > 0
    finally:
        for s, _ in servers:
            s.should_exit = True
            s.thread.join(10)
        for e in engines:
            e.close()
