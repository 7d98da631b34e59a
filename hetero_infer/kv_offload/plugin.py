"""How the host tier plugs in: the engine plugin, its config check, CLI flags and /metrics lines."""

from __future__ import annotations
import dataclasses
import math
from ..cli.flags import register_engine_flags
from ..core.config import EngineConfig, register_config_check
from ..engine.plugins import EnginePlugin, register_plugin
from ..server.metrics import register_metrics
from .block_manager import TieredBlockManager
from .scheduler import TieredScheduler
from .swap import SwapSpace
from .tier import build_kv_tier

PREEMPTION_MODES = ("recompute", "swap")  # what preemption does with a request's KV


def tier_asked(config: EngineConfig) -> bool:
    "Whether `config` asks for a host tier: swap preemption, or an offloaded prefix cache."
    return config.preemption_mode == "swap" or config.kv_offloading_size > 0


@register_config_check
def check_kv_offload(config: EngineConfig):
    "The host tier's fields: a known preemption mode, GiB in range, and what it cannot run with."
    if config.preemption_mode not in PREEMPTION_MODES:
        raise ValueError(
            f"preemption_mode must be one of {PREEMPTION_MODES}, got {config.preemption_mode!r}"
        )
    for name in ("swap_space", "kv_offloading_size"):
        v = getattr(config, name)
        ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
        if not (ok and 0 <= v < 2**20):
            raise ValueError(f"{name} must be GiB in [0, 2**20), got {v!r}")
    if tier_asked(config) and config.tensor_parallel_size > 1:
        name = "preemption_mode" if config.preemption_mode == "swap" else "kv_offloading_size"
        raise ValueError(
            f"{name}: the host KV tier is not supported with tensor_parallel_size="
            f"{config.tensor_parallel_size}; use preemption_mode='recompute', kv_offloading_size=0"
        )
    if config.kv_offloading_size and not config.enable_prefix_caching:
        raise ValueError("kv_offloading_size: the host prefix tier needs enable_prefix_caching")


# fmt: off
register_engine_flags({
    "preemption_mode": (["--preemption-mode"], str, PREEMPTION_MODES,
        "recompute a preempted request's KV, or swap it to host memory"),
    "swap_space": (["--swap-space"], float, None,
        "GiB of host memory for swapped-out KV blocks (with --preemption-mode swap)"),
    "kv_offloading_size": (["--kv-offloading-size"], float, None,
        "GiB of host memory that keeps KV blocks evicted from the prefix cache; 0 = off"),
}, bench=True)
# fmt: on


@register_metrics
def kv_offload_metrics(stats: dict, gauge, counter):
    "The host tier's gauges and counters, from `engine.stats['kv_offload']` (none when it is off)."
    kv = stats.get("kv_offload")
    if kv is None:
        return
    yield gauge("num_requests_swapped", "Sequences swapped out to host memory", kv["swapped"])
    yield counter(
        "kv_swapped_out", "Sequences preempted by swapping their KV to host", kv["swapped_out"]
    )
    yield counter("kv_swapped_in", "Swapped-out sequences resumed from host", kv["swapped_in"])
    yield counter(
        "kv_recompute_fallbacks",
        "Preemptions that asked for swap but recomputed (host pool full)",
        kv["recompute_fallbacks"],
    )
    yield counter(
        "kv_prefix_hits_device", "Prefix blocks found on the device", kv["device_prefix_hits"]
    )
    yield counter(
        "kv_prefix_hits_host", "Prefix blocks reloaded from the host tier", kv["host_prefix_hits"]
    )
    yield counter(
        "kv_offloaded_blocks",
        "Evicted prefix blocks copied to the host tier",
        kv.get("host_offloaded", 0),
    )
    yield gauge(
        "kv_host_prefix_blocks", "Blocks held by the host prefix tier", kv["host_prefix_blocks"]
    )
    yield counter("kv_transfer_bytes", "Bytes copied between host and device", kv["transfer_bytes"])
    yield counter(
        "kv_transfer_seconds", "Seconds spent copying between tiers", kv["transfer_seconds"]
    )
    yield counter(
        "kv_transfer_failures",
        "Steps whose host copies failed (their requests recomputed)",
        kv["transfer_failures"],
    )


@register_plugin
class KVOffloadPlugin(EnginePlugin):
    """A host tier under the engine's KV cache: the block manager and scheduler over it, and each
    step's copies between the tiers, run before the forward pass."""

    name = "kv_offload"

    @classmethod
    def create(cls, config: EngineConfig) -> KVOffloadPlugin | None:
        return cls() if tier_asked(config) else None

    def make_block_manager(self, engine) -> TieredBlockManager:
        cfg = engine.config
        self.tier = build_kv_tier(cfg, engine.runner.kv_caches)
        return TieredBlockManager(
            cfg.num_blocks, cfg.block_size, cfg.enable_prefix_caching, self.tier.prefix
        )

    def make_scheduler(self, engine) -> TieredScheduler:
        pool, bm = self.tier.swap, engine.block_manager
        return TieredScheduler(engine.config, bm, SwapSpace(pool, bm) if pool else None)

    def after_schedule(self, engine, sched):
        "Run the step's copies between the tiers; if they fail, whatever they touched recomputes."
        copies = engine.scheduler.take_copies()
        try:
            self.tier.apply(copies, engine.runner.kv_caches)
        except Exception as e:  # never read KV a failed copy should have brought
            engine.last_error = e
            self.tier.stats.failures += 1
            engine.scheduler.copies_failed(copies, sched)
        else:
            engine.scheduler.copies_done(copies)

    def stats(self, engine) -> dict:
        "Swaps, prefix hits per tier, the host tier's own counters and the copies'."
        sch, tier, host = engine.scheduler, self.tier, self.tier.prefix
        host_stats = dataclasses.asdict(host.stats) if host else {}
        return {
            "swapped": len(sch.swapped),
            "swapped_out": sch.stats.swapped_out,
            "swapped_in": sch.stats.swapped_in,
            "recompute_fallbacks": sch.stats.recompute_fallbacks,
            "swap_blocks_free": tier.swap.num_free() if tier.swap else 0,
            "device_prefix_hits": engine.block_manager.stats.cache_hits,
            "host_prefix_hits": host.stats.hits if host else 0,
            "host_prefix_blocks": len(host.entries) if host else 0,
            **{f"host_{k}": v for k, v in host_stats.items()},
            **{f"transfer_{k}": v for k, v in dataclasses.asdict(tier.stats).items()},
        }
