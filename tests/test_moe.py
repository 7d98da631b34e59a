"""Mixture of experts (hetero_infer.moe.layer, hetero_infer.moe.kernels): the router against
transformers' (ties included), loop = grouped = the Triton kernel (interpreter on CPU) on awkward
sizes, MoEBlock against transformers' Qwen3-MoE, Mixtral and Qwen2-MoE layers from a saved
checkpoint (per-expert layout) and from a state dict (fused layout), and bad configs and
checkpoints refused naming the cause."""

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from hetero_infer.moe.layer import (
    MoEBlock,
    MOE_METHODS,
    MoEConfig,
    expert_shard,
    is_moe_layer,
    load_moe_weights,
    moe_checkpoint_names,
    moe_grouped,
    moe_loop,
    moe_prefix,
    route,
    sort_by_expert,
)
from hetero_infer.moe.kernels import align_block_size  # the kernel's input layout

torch.set_num_threads(1)  # pinned: 2 shared cores
transformers = pytest.importorskip("transformers")
transformers.utils.logging.disable_progress_bar()

_SMALL = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
_SMALL["vocab_size"] = 128


def _configs():
    "Tiny configs of the three families: top-2 of 8, top-2 of 6, top-3 of 8 + a shared expert."
    q3 = transformers.Qwen3MoeConfig(
        **_SMALL, intermediate_size=96, moe_intermediate_size=32, head_dim=16, num_experts=8,
        num_experts_per_tok=2, norm_topk_prob=True,
    )  # fmt: skip
    mx = transformers.MixtralConfig(
        **_SMALL, intermediate_size=40, num_local_experts=6, num_experts_per_tok=2
    )
    q2 = transformers.Qwen2MoeConfig(
        **_SMALL, intermediate_size=96, moe_intermediate_size=24, num_experts=8,
        num_experts_per_tok=3, shared_expert_intermediate_size=40, norm_topk_prob=False,
    )  # fmt: skip
    return {"qwen3_moe": q3, "mixtral": mx, "qwen2_moe": q2}


def _tiny_model(hf_cfg, seed=0, tie=True):
    "A random HF MoE model; router rows spread, and experts 0, 1, 2 tied in every router."
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(hf_cfg).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            g = layer.mlp.gate.weight
            g.normal_(0, 0.5)
            if tie:
                g[1] = g[2] = g[0]
    return model


def _random_moe(T, E, k, H=40, I=24, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g).to(dtype)
    gate_up = (torch.randn(E, 2 * I, H, generator=g) / H**0.5).to(dtype)
    down = (torch.randn(E, H, I, generator=g) / I**0.5).to(dtype)
    w, ids = route(torch.randn(T, E, generator=g), k)
    return x, gate_up, down, w, ids


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    "family -> (HF model, tensors of its saved checkpoint)."
    out = {}
    for fam, hf_cfg in _configs().items():
        model = _tiny_model(hf_cfg)
        d = tmp_path_factory.mktemp(fam)
        model.save_pretrained(d)
        out[fam] = model, load_file(d / "model.safetensors")
    return out


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "qwen2_moe"])
def test_router_equals_transformers_with_ties(family, saved):
    model, _ = saved[family]
    gate = model.model.layers[0].mlp.gate
    x = torch.randn(200, 64, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        _, hf_w, hf_ids = gate(x)
        cfg = MoEConfig.from_hf(model.config)
        w, ids = route(F.linear(x, gate.weight), cfg.top_k, cfg.norm_topk_prob)
    assert torch.equal(ids, hf_ids)
    torch.testing.assert_close(w, hf_w.float(), atol=1e-7, rtol=0)
    tied = torch.isin(ids, torch.tensor([0, 1, 2])).sum(-1) >= 2
    assert tied.any()  # the tie is exercised


def test_route_renormalises_only_when_asked():
    logits = torch.randn(5, 8)
    w, _ = route(logits, 3, norm_topk_prob=True)
    torch.testing.assert_close(w.sum(-1), torch.ones(5))
    w2, _ = route(logits, 3, norm_topk_prob=False)
    assert (w2.sum(-1) < 1).all()
    assert w.dtype == torch.float32 and route(logits.half(), 3)[0].dtype == torch.float32


@pytest.mark.parametrize("T,E,k", [(1, 5, 1), (3, 7, 2), (17, 16, 8), (33, 6, 6), (2, 128, 8)])
def test_loop_equals_grouped(T, E, k):
    args = _random_moe(T, E, k, seed=T + E)
    torch.testing.assert_close(moe_grouped(*args), moe_loop(*args), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("T,E,k", [(1, 5, 1), (17, 16, 8)])
def test_grouped_mm_equals_the_loop_and_gives_zeros_when_no_expert_is_held(T, E, k):
    from hetero_infer.moe.layer import moe_grouped_mm

    args = _random_moe(T, E, k, seed=T + E)
    torch.testing.assert_close(moe_grouped_mm(*args), moe_loop(*args), atol=1e-5, rtol=1e-5)
    x, gu, dn, w, ids = args
    none_held = moe_grouped_mm(x, gu[:1], dn[:1], w, ids, first_expert=E)  # an expert past all
    assert torch.equal(none_held, torch.zeros_like(x))


def test_empty_batch():
    args = _random_moe(0, 4, 2)
    assert moe_grouped(*args).shape == (0, 40)
    assert moe_loop(*args).shape == (0, 40)


@pytest.mark.parametrize("T,E,k", [(1, 5, 2), (7, 6, 3), (19, 12, 4)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_triton_equals_loop(T, E, k, dtype):
    from hetero_infer.moe.kernels import fused_moe

    x, gu, dn, w, ids = _random_moe(T, E, k, seed=T, dtype=dtype)
    want = moe_loop(x.float(), gu.float(), dn.float(), w, ids)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    for tiles in (None, (64, 16, 16), (16, 32, 16)):
        got = fused_moe(x, gu, dn, w, ids, tiles=tiles).float()
        torch.testing.assert_close(got, want, atol=tol, rtol=tol)


def test_sort_and_align():
    ids = torch.tensor([[3, 0], [0, 3], [1, 0]])
    order, counts = sort_by_expert(ids, 5)
    assert order.tolist() == [1, 2, 5, 4, 0, 3] and counts == [3, 1, 0, 2, 0]
    s, be = align_block_size(ids, 5, 2)
    assert s.tolist() == [1, 2, 5, 6, 4, 6, 0, 3] and be.tolist() == [0, 0, 1, 3]
    for T, E, k, bm in [(1, 128, 8, 16), (50, 8, 2, 64), (9, 3, 3, 4)]:
        ids = torch.rand(T, E).topk(k, dim=-1).indices
        s, be = align_block_size(ids, E, bm)
        assert s.numel() == be.numel() * bm
        real = s[s < T * k]
        assert sorted(real.tolist()) == list(range(T * k))  # every pair once
        blk = torch.arange(s.numel()) // bm
        assert (ids.reshape(-1)[real.long()] == be[blk[s < T * k]]).all()  # in its expert's block


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "qwen2_moe"])
@pytest.mark.parametrize("method", ["loop", "grouped", "grouped_mm", "triton"])
def test_layer_equals_transformers(family, method, saved):
    model, tensors = saved[family]
    cfg = MoEConfig.from_hf(model.config)
    x = torch.randn(37, 64, generator=torch.Generator().manual_seed(2))
    for layer in range(2):
        prefix = moe_prefix(tensors, f"model.layers.{layer}.mlp.")
        assert ("block_sparse_moe" in prefix) == (family == "mixtral")  # the saved layout
        block = MoEBlock.from_checkpoint(tensors, prefix, cfg, method=method)
        hf_block = model.model.layers[layer].mlp
        with torch.no_grad():
            assert torch.equal(block.route(x)[1], hf_block.gate(x)[2])
            torch.testing.assert_close(block(x), hf_block(x[None])[0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "qwen2_moe"])
def test_fused_layout_loads(family, saved):
    model, _ = saved[family]
    hf_block = model.model.layers[1].mlp
    state = {"p." + k: v for k, v in hf_block.state_dict().items()}
    assert "p.experts.gate_up_proj" in state
    cfg = MoEConfig.from_hf(model.config)
    block = MoEBlock.from_checkpoint(state, "p.", cfg, method="grouped")
    x = torch.randn(9, 64)
    with torch.no_grad():
        torch.testing.assert_close(block(x), hf_block(x[None])[0], atol=1e-5, rtol=1e-5)
    half = load_moe_weights(state, "p.", cfg, experts=range(2, 4))
    assert torch.equal(half["experts.down_proj"], state["p.experts.down_proj"][2:4])


def test_expert_slice_per_expert_layout(saved):
    _, tensors = saved["mixtral"]
    cfg = MoEConfig.from_hf(saved["mixtral"][0].config)
    p = "model.layers.0.block_sparse_moe."
    st = load_moe_weights(tensors, p, cfg, experts=expert_shard(6, 3, 2))
    assert st["experts.gate_up_proj"].shape == (2, 80, 64)
    want = torch.cat([tensors[p + "experts.5.w1.weight"], tensors[p + "experts.5.w3.weight"]])
    assert torch.equal(st["experts.gate_up_proj"][1], want)


def test_missing_expert_tensor_is_named(saved):
    _, tensors = saved["mixtral"]
    cfg = MoEConfig.from_hf(saved["mixtral"][0].config)
    broken = dict(tensors)
    del broken["model.layers.1.block_sparse_moe.experts.4.w3.weight"]
    with pytest.raises(ValueError, match=r"experts\.4\.w3\.weight.*6 experts"):
        load_moe_weights(broken, "model.layers.1.block_sparse_moe.", cfg)
    with pytest.raises(ValueError, match="mlp.gate.weight"):
        moe_prefix(broken, "model.layers.7.mlp.")


def test_checkpoint_with_fewer_experts_than_config(saved):
    model, tensors = saved["qwen3_moe"]
    cfg = MoEConfig.from_hf({**model.config.to_dict(), "num_experts": 10})
    with pytest.raises(ValueError, match=r"experts\.8\.gate_proj\.weight"):
        load_moe_weights(tensors, "model.layers.0.mlp.", cfg)


def test_wrong_shape_is_named(saved):
    model, tensors = saved["qwen3_moe"]
    cfg = MoEConfig.from_hf({**model.config.to_dict(), "moe_intermediate_size": 16})
    with pytest.raises(ValueError, match="experts.gate_up_proj: shape"):
        load_moe_weights(tensors, "model.layers.0.mlp.", cfg)


def test_expert_count_not_divisible_by_ep_size():
    assert expert_shard(8, 2, 1) == range(4, 8)
    assert expert_shard(8) == range(8)
    with pytest.raises(ValueError, match=r"num_experts \(6\) is not divisible.*\(4 = "):
        expert_shard(6, 4, 0)
    with pytest.raises(ValueError, match="ep_rank"):
        expert_shard(8, 2, 2)


def test_bad_configs_name_the_field():
    with pytest.raises(ValueError, match="top_k"):
        MoEConfig(num_experts=4, top_k=5, hidden_size=8, intermediate_size=4)
    with pytest.raises(ValueError, match="num_experts"):
        MoEConfig(num_experts=0, top_k=1, hidden_size=8, intermediate_size=4)
    with pytest.raises(ValueError, match="family"):
        MoEConfig(4, 2, 8, 4, family="llama")
    with pytest.raises(ValueError, match="model_type"):
        MoEConfig.from_hf({"model_type": "qwen3"})
    hf = _configs()["mixtral"].to_dict()
    with pytest.raises(ValueError, match="hidden_act"):
        MoEConfig.from_hf({**hf, "hidden_act": "gelu"})
    with pytest.raises(ValueError, match="method"):
        MoEBlock(MoEConfig(4, 2, 8, 4), method="fast")


def test_config_and_layer_rules():
    cfgs = _configs()
    assert MoEConfig.from_hf(cfgs["mixtral"]).norm_topk_prob  # Mixtral always renormalises
    q2 = MoEConfig.from_hf(cfgs["qwen2_moe"])
    assert (q2.norm_topk_prob, q2.shared_expert_intermediate_size) == (False, 40)
    d = {**cfgs["qwen3_moe"].to_dict(), "decoder_sparse_step": 2, "mlp_only_layers": [3]}
    assert [is_moe_layer(d, i) for i in range(6)] == [False, True, False, False, False, True]
    assert is_moe_layer(cfgs["mixtral"].to_dict(), 5)
    c = MoEConfig.from_hf(cfgs["qwen2_moe"])
    names = moe_checkpoint_names("m.", c, fused=False, experts=range(1))
    assert names[-1] == "m.shared_expert_gate.weight" and len(names) == 1 + 3 + 4


@pytest.mark.parametrize("family,ep", [("qwen3_moe", 2), ("mixtral", 3), ("qwen2_moe", 4)])
@pytest.mark.parametrize("method", ["loop", "grouped", "grouped_mm", "triton"])
def test_expert_parallel_partial_sums(family, ep, method, saved):
    "Each rank runs only its experts' pairs; the ranks' outputs sum to the layer (shared once)."
    model, tensors = saved[family]
    cfg = MoEConfig.from_hf(model.config)
    prefix = moe_prefix(tensors, "model.layers.0.mlp.")
    x = torch.randn(23, 64, generator=torch.Generator().manual_seed(3))
    parts = []
    for r in range(ep):
        held = expert_shard(cfg.num_experts, ep, r)
        block = MoEBlock.from_checkpoint(tensors, prefix, cfg, method, experts=held)
        assert block.experts.gate_up_proj.shape[0] == len(held)
        with torch.no_grad():
            parts.append(block(x))
    with torch.no_grad():
        want = model.model.layers[0].mlp(x[None])[0]
    torch.testing.assert_close(sum(parts), want, atol=1e-5, rtol=1e-5)


def test_held_slice_skips_other_experts():
    x, gu, dn, w, ids = _random_moe(9, 8, 3, seed=4)
    full = moe_loop(x, gu, dn, w, ids)
    halves = [moe_grouped(x, gu[s], dn[s], w, ids, first_expert=s.start) for s in
              (slice(0, 5), slice(5, 8))]  # fmt: skip
    torch.testing.assert_close(halves[0] + halves[1], full, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(moe_loop(x, gu[5:], dn[5:], w, ids, first_expert=5), halves[1])
    order, counts = sort_by_expert(ids, 3, first_expert=5)
    assert len(order) == sum(counts) == int((ids >= 5).sum())
    s, be = align_block_size(ids, 3, 4, first_expert=5)
    assert sorted(s[s < ids.numel()].tolist()) == sorted(
        torch.where(ids.reshape(-1) >= 5)[0].tolist()
    )


def test_method_choice_and_the_sm75_refusal():
    from hetero_infer.moe.layer import moe_method

    assert moe_method("auto", "cpu") == "grouped"  # one token: the loop of matmuls
    assert moe_method("auto", "cpu", num_tokens=16) == "grouped_mm"
    assert moe_method("auto", "cuda", capability=(8, 0)) == "triton"
    assert moe_method("auto", "cuda", capability=(7, 5)) == "grouped"
    with pytest.raises(ValueError, match=r"compute capability 8.0 .* this GPU has 7.5"):
        moe_method("triton", "cuda", capability=(7, 5))
    with pytest.raises(ValueError, match="method must be one of"):
        MoEBlock(MoEConfig(4, 2, 8, 4), method="fast")


# --- the layer across ranks (moe.parallel) ---


def _all_to_all_rank(rank, world, init, out):
    "One rank: the all-to-all MoE of its own tokens equals the whole layer and the replicated one."
    import torch.distributed as dist
    from hetero_infer.parallel.runner import init_group

    init_group(rank, world, init, "cpu", timeout=30)
    for family in ("qwen3_moe", "qwen2_moe"):  # without and with a shared expert
        torch.save(_all_to_all_check(rank, world, family), f"{out}/{family}-{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


_A2A_TOKENS = (5, 1)  # rank r's tokens: a different count per rank


def _a2a_full(family):
    "The same MoE block (8 experts, top 3, hidden 32) on every rank, and each rank's tokens."
    shared = 24 if family == "qwen2_moe" else 0
    cfg = MoEConfig(8, 3, 32, 16, shared_expert_intermediate_size=shared, family=family)
    torch.manual_seed(0)
    full = MoEBlock(cfg, "grouped").requires_grad_(False)
    for p in full.parameters():
        p.normal_(0, 0.3)
    xs = [torch.randn(n, 32, generator=torch.Generator().manual_seed(n)) for n in _A2A_TOKENS]
    return cfg, full, xs


def _all_to_all_check(rank, world, family):
    from hetero_infer.moe.parallel import moe_all_to_all
    from hetero_infer.parallel.shards import COMM_BYTES, COMM_SECONDS, all_reduce

    cfg, full, xs = _a2a_full(family)
    experts = expert_shard(8, world, rank)
    state = {k: (v[experts.start : experts.stop] if k.startswith("experts.") else v)
             for k, v in full.state_dict().items()}  # fmt: skip
    local = MoEBlock(cfg, "grouped", experts)
    local.load_state_dict(state)
    local.owns_shared = rank == 0
    mine = xs[rank]
    sent, spent = COMM_BYTES.get("all_to_all", 0), COMM_SECONDS.get("all_to_all", 0.0)
    got = moe_all_to_all(local, mine)
    torch.testing.assert_close(got, full(mine), rtol=1e-5, atol=1e-5)
    k = cfg.top_k
    here = sum(int((full.route(x)[1] // 4 == rank).sum()) for x in xs)  # pairs for my experts
    # out: rows (fp32), weights (fp32) and expert ids (int64) of my pairs; back: the results
    assert COMM_BYTES["all_to_all"] - sent == len(mine) * k * (32 * 4 + 4 + 8) + here * 32 * 4
    assert COMM_SECONDS["all_to_all"] > spent
    every = torch.cat(xs)  # the replicated form over everyone's tokens, for this rank's rows
    rep = all_reduce(local(every)).split([len(x) for x in xs])[rank]  # every rank reduces
    torch.testing.assert_close(got, rep, rtol=1e-5, atol=1e-5)
    return got


def test_all_to_all_dispatch_equals_the_replicated_form(tmp_path):
    "Two ranks exchange their pairs; each rank's output equals one process's all-to-all form."
    import torch.multiprocessing as mp
    from hetero_infer.moe.parallel import moe_all_to_all
    from hetero_infer.parallel.runner import _free_port

    init = f"tcp://127.0.0.1:{_free_port()}"
    mp.spawn(_all_to_all_rank, args=(2, init, str(tmp_path)), nprocs=2, join=True)
    for family in ("qwen3_moe", "qwen2_moe"):
        _, full, xs = _a2a_full(family)
        for rank, x in enumerate(xs):
            got = torch.load(tmp_path / f"{family}-{rank}.pt")
            torch.testing.assert_close(got, moe_all_to_all(full, x), rtol=1e-5, atol=1e-5)


def _full_block(family="qwen2_moe", seed=0):
    "A MoE block of 8 experts (top 3, width 32) over hidden size 16, with a shared expert."
    shared = 24 if family == "qwen2_moe" else 0
    cfg = MoEConfig(8, 3, 16, 32, shared_expert_intermediate_size=shared, family=family)
    torch.manual_seed(seed)
    full = MoEBlock(cfg, "grouped").requires_grad_(False)
    for p in full.parameters():
        p.normal_(0, 0.3)
    return cfg, full


def test_feature_slice_cuts_gate_up_rows_and_down_columns():
    from hetero_infer.moe.parallel import feature_slice

    gu, dn = torch.randn(2, 12, 4), torch.randn(2, 4, 6)
    state = {"experts.gate_up_proj": gu, "experts.down_proj": dn}
    assert feature_slice(state, range(6), 6) is state
    cut = feature_slice(dict(state), range(2, 5), 6)
    assert torch.equal(cut["experts.gate_up_proj"], torch.cat([gu[:, 2:5], gu[:, 8:11]], dim=1))
    assert torch.equal(cut["experts.down_proj"], dn[:, :, 2:5])


@pytest.mark.parametrize("ep", [False, True])
def test_the_ranks_parts_of_a_moe_block_sum_to_the_whole(ep):
    """`shard_moe` gives each of 2 ranks whole experts (expert parallel) or a slice of every
    expert's features, the shared expert on rank 0; their outputs (before the all-reduce, which
    one process skips) add up to the whole block's."""
    from types import SimpleNamespace
    from hetero_infer.moe.parallel import ParallelMoEBlock, feature_slice, shard_moe
    from hetero_infer.parallel.shards import ShardPlan

    cfg, full = _full_block()
    x = torch.randn(7, 16)
    parts = []
    for rank in (0, 1):
        plan = ShardPlan(rank, 2, range(0), range(0), range(0), range(0), 0)
        block = shard_moe(full, None, plan, SimpleNamespace(enable_expert_parallel=ep))
        assert isinstance(block, ParallelMoEBlock) and block.owns_shared == (rank == 0)
        if ep:
            assert (block.held, block.features) == (range(4 * rank, 4 * rank + 4), range(32))
        else:
            assert (block.held, block.features) == (range(8), range(16 * rank, 16 * rank + 16))
        assert block.cfg.intermediate_size == len(block.features) and block.full is cfg
        state = {
            k: (v[block.held.start : block.held.stop] if k.startswith("experts.") else v)
            for k, v in full.state_dict().items()
        }
        block.load_state_dict(feature_slice(state, block.features, 32))
        parts.append(block(x))
    torch.testing.assert_close(parts[0] + parts[1], full(x), rtol=1e-5, atol=1e-5)
    assert shard_moe(torch.nn.Linear(2, 2), None, plan, SimpleNamespace()) is None
    plan = ShardPlan(0, 3, range(0), range(0), range(0), range(0), 0)
    with pytest.raises(ValueError, match=r"^tensor_parallel_size \(3\) must divide the experts' "):
        shard_moe(full, None, plan, SimpleNamespace(enable_expert_parallel=False))


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe"])
def test_all_to_all_moe_in_one_process_equals_the_block(family):
    "One rank: every pair stays here; dispatch, the experts and combine give the block's output."
    from hetero_infer.moe.parallel import all_to_all, ep_combine, ep_dispatch, moe_all_to_all

    _, full = _full_block(family)
    x = torch.randn(6, 16)
    torch.testing.assert_close(moe_all_to_all(full, x), full(x), rtol=1e-5, atol=1e-5)
    assert all_to_all(x, [6]) == (x, [6])
    weights, ids = full.route(x)
    rows, w, e, state = ep_dispatch(x, weights, ids, 8)
    k = ids.shape[1]
    assert torch.equal(rows, x.repeat_interleave(k, 0)) and torch.equal(e, ids.reshape(-1))
    assert w.dtype == torch.float32 and torch.equal(w, weights.reshape(-1).float())
    assert torch.equal(state[0], torch.arange(6).repeat_interleave(k)) and state[1] == [6 * k]
    assert torch.equal(
        ep_combine(rows * w[:, None], state, 6), (x[:, None] * weights[..., None]).sum(1)
    )


def test_moe_families_read_their_sliding_windows():
    from hetero_infer.moe.model import mixtral_windows, qwen2_moe_windows, qwen3_moe_windows

    assert mixtral_windows({"num_hidden_layers": 2}) == [None, None]
    assert mixtral_windows({"num_hidden_layers": 2, "sliding_window": 64}) == [64, 64]
    d = {"num_hidden_layers": 3, "sliding_window": 32}
    assert qwen3_moe_windows(d) == [None] * 3
    assert qwen3_moe_windows({**d, "use_sliding_window": True}) == [32] * 3
    assert qwen2_moe_windows(d) == [None] * 3
    types = ["full_attention", "sliding_attention"]
    got = qwen2_moe_windows({**d, "num_hidden_layers": 2, "use_sliding_window": True,
                             "layer_types": types, "max_window_layers": 1})  # fmt: skip
    assert got == [None, 32]
    msg = (
        "unsupported use_sliding_window: a Qwen2-MoE config with sliding windows but no layer_types"
    )
    with pytest.raises(ValueError, match=f"^{msg}$"):
        qwen2_moe_windows({**d, "use_sliding_window": True})


def test_fused_moe_specs_name_the_binaries_fused_moe_launches():
    "Gated and plain at both row tiles from sm_80 on; fp32 with exact dots on 8 warps."
    from hetero_infer.moe.kernels import fused_moe_tiles
    from hetero_infer.moe.model import fused_moe_specs

    assert fused_moe_specs("sm_75", "float16") == []
    for arch, dtype, warps, precision in [("sm_80", "float16", 4, "tf32"),
                                          ("sm_90", "float32", 8, "ieee")]:  # fmt: skip
        tiles = sorted({fused_moe_tiles(n, 8, getattr(torch, dtype)) for n in (8, 136)})
        assert len(tiles) == 2
        got = [(s.kernel, s.dtype, s.arch, s.head_dims, s.constexprs, s.num_warps, s.module, s.fn,
                s.pointers) for s in fused_moe_specs(arch, dtype)]  # fmt: skip
        pointers = {"w_ptr": "fp32", "sorted_ids_ptr": "i32", "block_expert_ptr": "i32"}
        assert got == [
            ("fused_moe", dtype, arch, (64,),
             dict(GATED=g, MUL_WEIGHT=not g, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
                  DOT_PRECISION=precision),
             warps, "hetero_infer.moe.kernels", "_fused_moe_kernel", pointers)
            for g in (True, False) for bm, bn, bk in tiles
        ]  # fmt: skip


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe"])
@pytest.mark.parametrize("ep", [False, True])
def test_each_rank_reads_its_part_of_a_checkpoint(family, ep, saved):
    "A rank's block reads only its experts, cut to its features; the parts sum to the layer."
    from types import SimpleNamespace
    from hetero_infer.moe.parallel import shard_moe
    from hetero_infer.parallel.shards import ShardPlan

    model, tensors = saved[family]
    cfg = MoEConfig.from_hf(model.config)
    full = MoEBlock.from_checkpoint(tensors, moe_prefix(tensors, "model.layers.0.mlp."), cfg)
    x = torch.randn(11, 64, generator=torch.Generator().manual_seed(5))
    parts = []
    for rank in (0, 1):
        plan = ShardPlan(rank, 2, range(0), range(0), range(0), range(0), 0)
        block = shard_moe(full, None, plan, SimpleNamespace(enable_expert_parallel=ep))
        state = block.read_checkpoint(tensors, "model.layers.0.mlp.")
        E, I = len(block.held), len(block.features)
        assert state["experts.gate_up_proj"].shape == (E, 2 * I, 64)
        assert state["experts.down_proj"].shape == (E, 64, I)
        block.load_state_dict(state)
        with torch.no_grad():
            parts.append(block(x))
    with torch.no_grad():
        torch.testing.assert_close(parts[0] + parts[1], full(x), rtol=1e-5, atol=1e-5)


QWEN3 = dict(model_type="qwen3_moe", num_experts=4, num_experts_per_tok=2, hidden_size=8)
QWEN3["moe_intermediate_size"] = 6  # the least a config.json may say


def test_a_config_json_may_leave_out_what_has_a_default():
    "No hidden_act, sparse step, norm_topk_prob or shared expert: SiLU, every layer, False, none."
    c = MoEConfig.from_hf(QWEN3)
    assert (c.norm_topk_prob, c.shared_expert_intermediate_size) == (False, 0)
    assert all(is_moe_layer(QWEN3, i) for i in range(4))
    q2 = MoEConfig.from_hf({**QWEN3, "model_type": "qwen2_moe"})
    assert q2.shared_expert_intermediate_size == 0
    q2 = MoEConfig.from_hf(
        {**QWEN3, "model_type": "qwen2_moe", "shared_expert_intermediate_size": 0}
    )
    assert q2.shared_expert_intermediate_size == 0
    other = MoEConfig.from_hf({**QWEN3, "shared_expert_intermediate_size": 16})
    assert other.shared_expert_intermediate_size == 0  # only Qwen2-MoE has a shared expert


def test_config_errors_say_the_field_and_the_family():
    missing = {k: v for k, v in QWEN3.items() if k != "num_experts_per_tok"}
    with pytest.raises(ValueError) as e:
        MoEConfig.from_hf(missing)
    assert str(e.value) == "config.json lacks 'num_experts_per_tok', which a qwen3_moe model needs"
    with pytest.raises(ValueError) as e:
        MoEConfig.from_hf({**QWEN3, "norm_topk_prob": "yes"})
    assert str(e.value) == "norm_topk_prob must be true or false, got 'yes'"


def test_which_layers_are_sparse():
    mx = {"model_type": "mixtral", "num_local_experts": 4, "decoder_sparse_step": 2}
    assert all(is_moe_layer(mx, i) for i in range(3))  # Mixtral: every layer, Qwen's fields aside
    step3 = {**QWEN3, "decoder_sparse_step": 3}
    assert [is_moe_layer(step3, i) for i in range(6)] == [False, False, True] * 2
    assert is_moe_layer({**QWEN3, "num_experts": 1}, 0)
    assert not is_moe_layer({**QWEN3, "num_experts": 0}, 0)
    assert not is_moe_layer({"model_type": "qwen3_moe"}, 0)  # no experts named


@pytest.mark.parametrize("form", [moe_loop, moe_grouped, "grouped_mm"])
def test_bf16_activations_with_fp32_routing_weights(form):
    "Mixtral's routing weights stay fp32, as in transformers; the output is in the input's dtype."
    from hetero_infer.moe.layer import moe_grouped_mm

    run = moe_grouped_mm if form == "grouped_mm" else form
    x, gu, dn, w, ids = _random_moe(5, 6, 2, seed=3)
    got = run(x.bfloat16(), gu.bfloat16(), dn.bfloat16(), w, ids)
    assert got.dtype == torch.bfloat16
    want = moe_loop(x, gu, dn, w, ids)
    torch.testing.assert_close(got.float(), want, atol=0.1, rtol=0.05)


def test_a_rank_reads_only_the_experts_it_holds(saved):
    "Its slice of a per-expert checkpoint that lacks the others; a missing one is named."
    model, tensors = saved["mixtral"]
    cfg = MoEConfig.from_hf(model.config)
    p = "model.layers.0.block_sparse_moe."
    mine = {k: v for k, v in tensors.items() if ".experts." not in k or ".experts.4." in k}
    mine.update({k: v for k, v in tensors.items() if ".experts.5." in k})
    block = MoEBlock(cfg, experts=range(4, 6))
    state = block.read_checkpoint(mine, "model.layers.0.mlp.")
    assert state["experts.down_proj"].shape == (2, 64, 40)
    assert torch.equal(state["experts.down_proj"][1], tensors[p + "experts.5.w2.weight"])
    lacks = {k: v for k, v in mine.items() if ".experts.5." not in k}
    names = [f"{p}experts.5.{w}.weight" for w in ("w1", "w3", "w2")]
    with pytest.raises(ValueError) as e:
        load_moe_weights(lacks, p, cfg, experts=range(4, 6))
    assert (
        str(e.value)
        == f"checkpoint lacks MoE tensors {', '.join(names)} (the config says 6 experts)"
    )
    no_w1 = {k: v for k, v in lacks.items() if not k.endswith("experts.4.w1.weight")}
    with pytest.raises(ValueError, match=r"\.5\.w3\.weight \.\.\. \(4 in all\) \(the"):
        load_moe_weights(no_w1, p, cfg, experts=range(4, 6))
    with pytest.raises(ValueError) as e:
        load_moe_weights(lacks, p, cfg, experts=range(3, 6))
    four = [f"{p}experts.3.{w}.weight" for w in ("w1", "w3", "w2")] + names
    assert str(e.value) == (
        f"checkpoint lacks MoE tensors {', '.join(four[:3])} ... (6 in all) "
        "(the config says 6 experts)"
    )


def test_fused_expert_tensors_are_read_as_slices():
    "`CheckpointSlices` asks the checkpoint for a slice of fused experts, the whole of the rest."
    from hetero_infer.moe.layer import CheckpointSlices

    class Asked(dict):
        def get_slice(self, name):
            return ("slice", name)

    ckpt = CheckpointSlices(Asked(a=1))
    assert ckpt["m.experts.gate_up_proj"] == ("slice", "m.experts.gate_up_proj")
    assert ckpt["m.experts.down_proj"] == ("slice", "m.experts.down_proj")
    assert ckpt["a"] == 1 and "a" in ckpt and "b" not in ckpt


def test_config_bounds_are_inclusive_and_name_the_field():
    c = MoEConfig(num_experts=1, top_k=1, hidden_size=1, intermediate_size=1)
    assert (c.num_experts, c.top_k) == (1, 1)
    assert MoEConfig(4, 4, 8, 4).top_k == 4  # every expert
    with pytest.raises(ValueError, match=r"^hidden_size must be an integer >= 1, got 2\.5$"):
        MoEConfig(4, 2, 2.5, 4)
    with pytest.raises(ValueError, match=r"^num_experts must be an integer >= 1, got '4'$"):
        MoEConfig("4", 2, 8, 4)
    with pytest.raises(ValueError) as e:
        MoEConfig(4, 2, 8, 4, shared_expert_intermediate_size=-1)
    assert str(e.value) == "shared_expert_intermediate_size must be >= 0"


def test_route_renormalises_by_default():
    w, _ = route(torch.randn(3, 6), 2)
    torch.testing.assert_close(w.sum(-1), torch.ones(3))


@pytest.mark.parametrize(
    "family, dtype", [("qwen3_moe", torch.bfloat16), ("mixtral", torch.float32)]
)
def test_block_routing_weights_dtype(family, dtype):
    "Qwen's routing weights in the model dtype, Mixtral's kept in fp32 (as transformers does)."
    block = MoEBlock(MoEConfig(4, 2, 8, 4, family=family)).bfloat16()
    w, ids = block.route(torch.randn(3, 8, dtype=torch.bfloat16))
    assert w.dtype == dtype and ids.shape == (3, 2)


def test_what_each_method_means_where():
    from hetero_infer.moe.layer import moe_method

    assert moe_method("auto", "cpu", num_tokens=2) == "grouped_mm"
    assert moe_method("loop", "cpu", num_tokens=5) == "loop"
    assert moe_method("loop", "cuda", capability=(9, 0)) == "loop"
    assert moe_method("loop", "cuda", capability=(7, 5)) == "loop"
    with pytest.raises(ValueError) as e:
        moe_method("fast", "cpu")
    assert str(e.value) == f"method must be one of {MOE_METHODS}, got 'fast'"


def test_align_gives_the_int32_layout_the_compiled_kernel_takes():
    "`sorted_ids` and `block_expert` are int32, as `FUSED_MOE_POINTERS` declares them."
    from hetero_infer.moe.model import FUSED_MOE_POINTERS

    s, be = align_block_size(torch.tensor([[3, 0], [0, 3]]), 5, 2)
    assert (s.dtype, be.dtype) == (torch.int32, torch.int32)
    assert FUSED_MOE_POINTERS["sorted_ids_ptr"] == FUSED_MOE_POINTERS["block_expert_ptr"] == "i32"


def test_fused_moe_tiles_follow_the_pairs_per_expert_and_the_dtype():
    from hetero_infer.moe.kernels import fused_moe_tiles

    assert fused_moe_tiles(16 * 8, 8, torch.bfloat16) == (16, 64, 64)  # 16 pairs each: 16 rows
    assert fused_moe_tiles(16 * 8 + 1, 8, torch.bfloat16) == (64, 64, 64)
    assert fused_moe_tiles(8, 8, torch.float32) == (16, 64, 32)  # fp32: half as deep
    assert fused_moe_tiles(8, 8) == (16, 64, 64)


def test_checkpoint_architecture_before_and_after_the_model_is_known(tmp_path):
    from types import SimpleNamespace

    from hetero_infer.moe.model import checkpoint_architecture

    assert checkpoint_architecture(SimpleNamespace(model=None)) is None
    assert checkpoint_architecture(SimpleNamespace(model=str(tmp_path))) is None  # no config
    (tmp_path / "config.json").write_text('{"architectures": ["MixtralForCausalLM"]}')
    assert checkpoint_architecture(SimpleNamespace(model=str(tmp_path))) == "MixtralForCausalLM"
    (tmp_path / "config.json").write_text("{}")
    assert checkpoint_architecture(SimpleNamespace(model=str(tmp_path))) is None


def test_all_to_all_counts_its_bytes_and_seconds(monkeypatch):
    "Between two ranks (a stand-in exchange that gives back what it sends), under a scripted clock."
    from types import SimpleNamespace

    from hetero_infer.moe import parallel
    from hetero_infer.parallel.shards import COMM_BYTES, COMM_SECONDS

    def exchange(out, inp, out_split=None, in_split=None):
        assert inp.dtype == out.dtype
        out.copy_(inp)

    ticks = iter([10.0, 10.25])
    monkeypatch.setattr(parallel, "group_size", lambda: 2)
    monkeypatch.setattr(parallel, "dist", SimpleNamespace(all_to_all_single=exchange))
    monkeypatch.setattr(parallel, "time", SimpleNamespace(perf_counter=lambda: next(ticks)))
    monkeypatch.setitem(COMM_BYTES, "all_to_all", 0)
    monkeypatch.delitem(COMM_SECONDS, "all_to_all", raising=False)
    x = torch.randn(5, 4)
    out, recv = parallel.all_to_all(x, [2, 3])
    assert torch.equal(out, x) and recv == [2, 3]
    assert COMM_BYTES["all_to_all"] == 5 * 4 * 4 and COMM_SECONDS["all_to_all"] == 0.25


# `make mutation MUTATION_MODULES=moe.layer`: the mutants these tests leave alive are equivalent,
# no output can tell them apart:
# - `dim=+1` for `dim=-1` on 2-D tensors (the router's softmax, top-k and sum; `expert_mlp`'s and
#   `moe_grouped_mm`'s chunks), and `topk` without `dim` (the last one by default);
# - `bias=None` for `bias=False` in the router, the shared expert and its gate (both falsy);
# - `sort_by_expert`'s `minlength=E + 2` (cut to E anyway), `_local_ids`' `local <= E` (E maps
#   to E either way), and an unstable argsort (each expert gets the same pairs; only the order of
#   the additions changes, which rounding alone can show);
# - `_layer_rules` checking a missing `decoder_sparse_step` against a default of 2, not 1 (only
#   checked there; `is_moe_layer` reads the field itself);
# - `run_experts` asking `moe_method` without the step's token count: "grouped" for
#   "grouped_mm", the same sums to rounding;
# - `device=None` for `device=x.device` in `moe_grouped_mm` and `get_device_capability(None)`:
#   the same device on a machine with one GPU or none.


# `make mutation MUTATION_MODULES="moe.kernels moe.model moe.parallel"`: what these tests leave
# alive. Equivalent (no output can tell them apart):
# - `align_block_size`: `local <= E` (E maps to E either way), `minlength=E + 2` (cut to E), an
#   unstable argsort (each expert's block holds the same pairs);
# - `fused_moe_specs` sizing its two row tiles at 9 and 8 * 17, or 8 and 9 * 17 or 8 * 18 pairs:
#   the same two tiles (16 and 64 rows);
# - `fused_moe` scaling by the routing weight in the gated launch instead of the down launch
#   (`down` is linear), where a run under the interpreter reaches it;
# - `all_to_all`'s counts tensor without `dtype=torch.int64` (Python ints make int64 already).
# Only a GPU tells apart: the `device=` arguments of `align_block_size`, `fused_moe`'s compute
# capability checks, and its `num_warps` and `DOT_PRECISION` (the interpreter ignores both; the
# binaries are checked by tests/test_kernel_compile.py).
