"""Disaggregation (19) inside one process: KV payloads and their transfer over loopback, the
connector on prefill and decode engines (greedy equal to one engine, timeouts, refusals, aborts),
the router, and the command-line checks. The servers and the proxy are in test_disagg.py."""

import subprocess
import sys
import time

import pytest
import torch

from hetero_infer.core.config import EngineConfig
from hetero_infer.core.sampling_params import SamplingParams
from hetero_infer.core.sequence import Sequence
from hetero_infer.cli.main import main
from hetero_infer.disagg.connector import connector_of, with_kv_transfer
from hetero_infer.disagg.router import Router, prefix_hashes, prompt_key
from hetero_infer.disagg.transfer import (
    KVHeader,
    KVReceiver,
    KVSender,
    gather_kv,
    scatter_kv,
    split_address,
)
from hetero_infer.engine.llm_engine import LLMEngine
from hetero_infer.testing import tiny_hf_checkpoint

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
FIRST = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("disagg_tiny")
    tiny_hf_checkpoint(path, "llama", bos_token_id=None, eos_token_id=None, pad_token_id=None)
    return str(path)


def cfg(model, **kw):
    return dict(model=model, device="cpu", dtype="float32", block_size=16, num_blocks=96, **kw)


def ids(n, seed):
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def run(engine, reqs, params=GREEDY):
    "Step `engine` over `reqs`; `params`: one for all, or one per request id."
    for rid, p in reqs.items():
        engine.add_request(rid, p, params[rid] if isinstance(params, dict) else params)
    done = {}
    for _ in range(10_000):
        if not engine.has_unfinished_requests():
            return done
        done |= {o.request_id: o for o in engine.step() if o.finished}
    raise AssertionError("the engine did not finish")


@pytest.fixture(scope="module")
def engines(model):
    one = LLMEngine(EngineConfig(**cfg(model)))
    pre = LLMEngine(EngineConfig(**cfg(model), kv_role="kv_producer", kv_address="127.0.0.2"))
    dec = LLMEngine(EngineConfig(**cfg(model), kv_role="decode", kv_address="127.0.0.1"))
    yield one, pre, dec
    for e in (one, pre, dec):
        e.close()


def sending(rid, to, params=FIRST):
    "A prefill request's params: its prompt's KV goes to decode connector `to` as transfer `rid`."
    return with_kv_transfer(params, do_remote_decode=True, transfer_id=rid, remote_address=to)


def taking(rid, params=GREEDY):
    "A decode request's params: its prompt's KV comes as transfer `rid`."
    return with_kv_transfer(params, do_remote_prefill=True, transfer_id=rid)


def disaggregated(pre, dec, reqs, tag):
    "Prefill `reqs` on `pre` (one token), their KV to `dec`, then decode them there."
    P, D = connector_of(pre), connector_of(dec)
    first = run(pre, reqs, {rid: sending(tag + rid, D.address) for rid in reqs})
    assert P.exporter.sender.flush(30), P.exporter.sender.last_error
    return first, run(dec, reqs, {rid: taking(tag + rid) for rid in reqs})


# ---- payloads and transfer


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_payload_round_trip_between_block_sizes(dtype):
    g = torch.Generator().manual_seed(0)
    src = [tuple(torch.randn(7, 8, 2, 4, generator=g).to(dtype) for _ in "kv") for _ in range(3)]
    p = gather_kv(src, [5, 2, 6])  # 24 tokens
    assert p.shape == (3, 2, 24, 2, 4) and p.dtype == dtype
    dst = [tuple(torch.zeros(20, 4, 2, 4, dtype=dtype) for _ in "kv") for _ in range(3)]
    scatter_kv(p, dst, [19, 0, 3, 7, 11, 8])  # blocks of 4: six of them
    for (sk, sv), (dk, dv) in zip(src, dst):
        assert torch.equal(
            torch.cat([dk[b] for b in (19, 0, 3, 7, 11, 8)]), torch.cat([sk[b] for b in (5, 2, 6)])
        )
        assert torch.equal(
            torch.cat([dv[b] for b in (19, 0, 3, 7, 11, 8)]), torch.cat([sv[b] for b in (5, 2, 6)])
        )


def test_transfer_over_loopback_from_a_distinct_address_many_at_once():
    rx = KVReceiver("127.0.0.1", 0, timeout=20)
    txs = [KVSender("127.0.0.2", timeout=20), KVSender("127.0.0.3", timeout=20)]
    sent = {}
    for i in range(10):
        pl = torch.randn(2, 2, 16, 2, 8, dtype=torch.bfloat16)
        sent[f"t{i}"] = pl
        txs[i % 2].submit(rx.address, KVHeader.of(f"t{i}", list(range(16)), pl), pl)
    assert all(tx.flush(30) for tx in txs)
    for tid, pl in sent.items():
        hdr, got = rx.poll(tid)
        assert hdr.num_tokens == 16 and torch.equal(got, pl)
    assert rx.stats["transfers"] == 10 and rx.stats["failures"] == 0
    assert sum(tx.stats["transfers"] for tx in txs) == 10
    assert rx.purge(time.monotonic() + 1) == 0  # everything was taken
    rx.close()


def test_a_sender_dying_mid_payload_is_a_failure_not_a_hang():
    rx = KVReceiver("127.0.0.1", 0, timeout=20)
    script = (
        "import os, sys\n"
        "from hetero_infer.disagg.transfer import KVHeader, KVSender\n"
        "pg = KVSender('127.0.0.2', timeout=10).group(sys.argv[1])\n"
        "pg.send([KVHeader('doomed', 8, [2, 2, 8, 2, 8], 'float32', '').encode()], 1, 0).wait()\n"
        "os._exit(1)\n"
    )
    subprocess.run([sys.executable, "-c", script, rx.address], timeout=120)
    end = time.monotonic() + 15
    while (got := rx.poll("doomed")) is None and time.monotonic() < end:
        rx.wait(0.05)
    assert isinstance(got, str) and rx.stats["failures"] == 1
    rx.close()


def test_a_dead_receiver_is_a_counted_failure():
    tx = KVSender(timeout=5)
    pl = torch.zeros(1, 2, 16, 1, 4)
    tx.submit("127.0.0.1:9", KVHeader.of("x", list(range(16)), pl), pl)  # nobody listens on 9
    assert tx.flush(30)
    assert tx.stats["failures"] == 1 and "127.0.0.1:9" in tx.last_error


def test_addresses():
    assert split_address("10.1.2.3:99") == ("10.1.2.3", 99)
    assert split_address("127.0.0.2") == ("127.0.0.2", 0)
    with pytest.raises(ValueError, match="kv_address"):
        split_address("host:port")


# ---- the connector


def test_greedy_equal_to_one_engine_and_prompts_come_from_the_cache(engines):
    one, pre, dec = engines
    reqs = {f"r{n}": ids(n, n) for n in (17, 90, 161, 300)}
    want = run(one, reqs)
    first, got = disaggregated(pre, dec, reqs, "a")
    for rid, p in reqs.items():
        assert got[rid].outputs[0].token_ids == want[rid].outputs[0].token_ids
        assert first[rid].outputs[0].token_ids == want[rid].outputs[0].token_ids[:1]
        assert got[rid].num_cached_tokens == (len(p) - 1) // 16 * 16
    kv = dec.stats["kv_transfer"]
    assert kv["received_tokens"] == 16 + 80 + 160 + 288 and kv["local_prefills"] == 0
    assert pre.stats["kv_transfer"]["sent_tokens"] == kv["received_tokens"]
    assert dec.block_manager.usage() == 0 and pre.block_manager.usage() == 0


def test_a_prompt_already_cached_on_the_decode_side_is_not_written_again(engines):
    one, pre, dec = engines
    p = ids(120, 7)
    disaggregated(pre, dec, {"x1": p}, "b")
    before = dec.stats["kv_transfer"]["imported_tokens"]
    _, got = disaggregated(pre, dec, {"x2": p}, "c")
    assert dec.stats["kv_transfer"]["imported_tokens"] == before  # all 7 blocks were hits
    assert got["x2"].outputs[0].token_ids == run(one, {"x2": p})["x2"].outputs[0].token_ids


def test_another_block_size_on_the_decode_side(model, engines):
    one, pre, _ = engines
    dec8 = LLMEngine(EngineConfig(**{**cfg(model), "block_size": 8}, kv_role="decode"))
    try:
        reqs = {"s": ids(100, 11)}
        _, got = disaggregated(pre, dec8, reqs, "d")
        assert got["s"].outputs[0].token_ids == run(one, reqs)["s"].outputs[0].token_ids
        assert got["s"].num_cached_tokens == 96  # 96 tokens sent: twelve blocks of 8
    finally:
        dec8.close()


def test_a_transfer_that_never_comes_times_out_and_frees_its_blocks(engines):
    one, _, dec = engines
    D, p = connector_of(dec), ids(150, 21)
    D.importer.timeout = 0.3
    try:
        dec.add_request("lost", p, taking("never"))
        dec.step()
        assert dec.block_manager.usage() > 0 and dec.stats["kv_transfer"]["waiting"] == 1
        got = run(dec, {})
    finally:
        D.importer.timeout = 30
    assert got["lost"].outputs[0].token_ids == run(one, {"lost": p})["lost"].outputs[0].token_ids
    assert dec.stats["kv_transfer"]["timeouts"] >= 1 and dec.block_manager.usage() == 0


def test_a_payload_of_another_prompt_is_refused(engines):
    one, pre, dec = engines
    P, D = connector_of(pre), connector_of(dec)
    a, b = ids(80, 31), ids(80, 32)
    run(pre, {"pa": a}, sending("swap", D.address))
    assert P.exporter.sender.flush(30)
    before = dec.stats["kv_transfer"]["mismatches"]
    got = run(dec, {"pb": b}, taking("swap"))  # b's request, a's KV
    assert dec.stats["kv_transfer"]["mismatches"] == before + 1
    assert got["pb"].outputs[0].token_ids == run(one, {"pb": b})["pb"].outputs[0].token_ids
    assert got["pb"].num_cached_tokens == 0


def test_aborting_a_held_request_frees_its_blocks(engines):
    _, _, dec = engines
    D = connector_of(dec)
    dec.add_request("gone", ids(200, 41), taking("gone"))
    dec.step()
    assert dec.block_manager.usage() > 0
    dec.abort_request("gone")
    outs = dec.step()
    assert [o.outputs[0].finish_reason for o in outs] == ["abort"]
    assert dec.block_manager.usage() == 0 and D.importer.waiting == {}


def test_a_request_that_can_never_fit_is_refused_at_once(engines):
    _, _, dec = engines
    with pytest.raises(ValueError, match="max_num_seqs"):
        dec.add_request("big", ids(100, 1), taking("big", SamplingParams(n=300, max_tokens=1)))
    assert connector_of(dec).importer.waiting == {}


def test_config_checks():
    assert EngineConfig(kv_role="kv_producer").kv_role == "prefill"
    assert EngineConfig().kv_role is None
    for kw, msg in [
        (dict(kv_role="both"), "kv_role must be one of"),
        (dict(kv_role="decode", kv_transfer_timeout=-1), "kv_transfer_timeout"),
        (dict(kv_role="decode", enable_prefix_caching=False), "prefix cache"),
        (dict(kv_role="decode", tensor_parallel_size=2), "tensor_parallel_size"),
        (dict(kv_role="decode", kv_address="a:b"), "kv_address"),
    ]:
        with pytest.raises(ValueError, match=msg):
            EngineConfig(**kw)


def test_an_engine_without_a_role_has_no_connector(engines):
    one, pre, dec = engines
    assert connector_of(one) is None and "kv_transfer" not in one.stats
    assert (connector_of(pre).role, connector_of(dec).role) == ("prefill", "decode")


def test_carriers_are_sequences_of_full_blocks(engines):
    _, _, dec = engines
    D = connector_of(dec)
    seq = Sequence(10_000, "c", ids(33, 5), 33)
    D.importer.hold(dec, seq, {"do_remote_prefill": True, "transfer_id": "c"})
    w = D.importer.waiting[seq.seq_id]
    assert len(w.carrier.token_ids) == 33 and len(w.carrier.block_table) == 3
    D.importer.forget(dec, seq)
    assert dec.block_manager.usage() == 0


# ---- routing and the command line


def test_round_robin_and_cache_aware_routing():
    rr = Router(["a", "b", "c"], "round_robin")
    assert [rr.choose([]) for _ in range(4)] == ["a", "b", "c", "a"]
    ca = Router(["a", "b"])
    h = prefix_hashes(list(range(64)))
    first = ca.choose(h)
    assert [ca.choose(prefix_hashes(list(range(64)) + [1] * 16)) for _ in range(3)] == [first] * 3
    ca.inflight[first] = 10  # out of balance: the least loaded wins whatever it holds
    assert ca.choose(h) != first
    assert ca.choose(h, exclude={"a", "b"}) is None
    assert prompt_key({"messages": [{"role": "user", "content": "hi"}]}) == '<user>"hi"'
    with pytest.raises(ValueError, match="policy"):
        Router(["a"], "random")


def test_command_line_checks(capsys):
    "Bad deployments exit 2 naming the flag, before anything loads."
    for argv, words in [
        (["proxy", "--prefill", "http://p"], "--prefill: give --prefill and --decode"),
        (["proxy", "--replica", "http://r", "--decode", "http://d"], "--prefill: give"),
        (["proxy", "--replica", "http://r", "--timeout", "0"], "--timeout: must be > 0"),
        (["serve", "--port", "0", "--kv-role", "decode", "--data-parallel-size", "2"], "decode"),
        (["serve", "--port", "0", "--data-parallel-size", "0"], "--data-parallel-size: must"),
        (["serve", "--port", "0", "--kv-role", "decode", "--kv-transfer-timeout", "0"], "> 0"),
        (["serve", "--port", "0", "--kv-role", "prefill", "--kv-address", "a:b"], "--kv-address"),
    ]:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err.strip().splitlines()[-1]
        assert err.startswith("hetero-infer: error: ") and words in err, (argv, err)


def test_the_request_field_reaches_the_connector():
    "`kv_transfer_params` in a request body: checked, then in the request's SamplingParams."
    from hetero_infer.disagg.openai import KVTransferParams
    from hetero_infer.server.extensions import ExtendedRequest
    from hetero_infer.server.protocol import APIError, CompletionRequest

    def kwargs(kv):
        req = CompletionRequest(model="m", prompt=[1], kv_transfer_params=kv)
        return ExtendedRequest([KVTransferParams()], req, "completions").sampling_kwargs()

    kv = {"do_remote_decode": True, "transfer_id": "t", "remote_address": "10.0.0.2:7000"}
    assert kwargs(kv) == {"extra_args": {"kv_transfer_params": kv}}
    for bad, part in [
        ({"do_remote_prefill": True}, "transfer_id"),
        ({"transfer_id": "t", "do_remote_decode": True, "remote_address": "10.0.0.2"}, "remote"),
        ("not an object", "kv_transfer_params"),
    ]:
        with pytest.raises(APIError, match=part):
            kwargs(bad)
