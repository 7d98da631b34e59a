"""Replicas (19): `serve --data-parallel-size 2` starts two replicas and the proxy in front.
Greedy answers equal one instance's, both replicas serve, and multi-turn conversations hit the
prefix cache (routed cache-aware) at least 0.8x as often as on one instance."""

import httpx
import pytest

from hetero_infer.core.config import EngineConfig
from hetero_infer.disagg.bench import Process, conversations, hit_rate, ready, scrape
from hetero_infer.engine.llm_engine import LLMEngine
from hetero_infer.server.app import build_app
from hetero_infer.server.serve import serve_in_thread
from hetero_infer.testing import tiny_hf_checkpoint

FLAGS = ["--device", "cpu", "--dtype", "float32", "--block-size", "16", "--num-blocks", "512"]


@pytest.fixture(scope="module")
def deployments(tmp_path_factory):
    model = tmp_path_factory.mktemp("disagg_replicas")
    tiny_hf_checkpoint(model, "llama", bos_token_id=None, eos_token_id=None, pad_token_id=None)
    dp = Process("serve", "--model", str(model), *FLAGS, "--data-parallel-size", "2", threads=2)
    srv = None
    try:
        cfg = EngineConfig(
            model=str(model), device="cpu", dtype="float32", block_size=16, num_blocks=512
        )
        srv, one_url = serve_in_thread(build_app(LLMEngine(cfg)))
        ready(dp, all_instances=True)
        replicas = list(httpx.get(dp.url + "/readyz").json()["instances"])
        yield dp.url, replicas, one_url
    finally:
        dp.stop()  # SIGTERM: the launcher stops its replicas
        if srv is not None:
            srv.should_exit = True
            srv.thread.join(10)


def test_two_replicas_answer_as_one_and_keep_conversations_cached(deployments):
    url, replicas, one_url = deployments
    assert len(replicas) == 2
    before = [scrape(r) for r in replicas]
    one_before = [scrape(one_url)]
    got = conversations(url, 256, convs=8, turns=4, seed=0)
    want = conversations(one_url, 256, convs=8, turns=4, seed=0)
    assert got == want
    rate, one_rate = (
        hit_rate(before, [scrape(r) for r in replicas]),
        hit_rate(one_before, [scrape(one_url)]),
    )
    assert one_rate > 0.3 and rate >= 0.8 * one_rate, (rate, one_rate)
    served = scrape(url)
    for r in replicas:
        labels = f'backend="{r}",outcome="200",role="replica"'
        key = f"hetero_infer:proxy_backend_requests_total{{{labels}}}"
        assert served.get(key, 0) > 0, (r, served)
