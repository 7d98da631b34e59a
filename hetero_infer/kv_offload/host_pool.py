"""A host-memory pool of KV blocks shaped like the device cache, and batched copies between them."""

from __future__ import annotations
from collections import deque
import torch


class HostPoolFullError(RuntimeError):
    "The host pool has too few free blocks; nothing was changed."


def host_num_blocks(
    gib: float,  # host memory for the tier, GiB
    block_bytes: int,  # one block over all layers, K and V (`kv_block_bytes`)
) -> int:
    "How many KV blocks `gib` GiB of host memory holds."
    return int(gib * 2**30 // block_bytes)


class HostBlockPool:
    "Host KV blocks: a free list, and CPU tensors shaped like the device cache once attached."

    def __init__(self, num_blocks: int):
        if not (isinstance(num_blocks, int) and num_blocks >= 1):
            raise ValueError(f"num_blocks must be an integer >= 1, got {num_blocks!r}")
        self.num_blocks = num_blocks
        self.free_ids: deque[int] = deque(range(num_blocks))
        self.caches: list[tuple] = []  # per layer (k, v) on the host, [num_blocks, bs, Hkv, D]

    def __repr__(self):
        return f"HostBlockPool({self.num_free()} of {self.num_blocks} blocks free)"

    def num_free(self) -> int:
        return len(self.free_ids)

    def alloc(self, n: int) -> list[int]:
        "`n` free host blocks, or `HostPoolFullError` with nothing taken."
        if n > len(self.free_ids):
            raise HostPoolFullError(f"{n} host blocks asked for, {len(self.free_ids)} free")
        return [self.free_ids.popleft() for _ in range(n)]

    def free(self, ids):
        "Give host blocks back."
        self.free_ids.extend(ids)

    def attach(
        self,
        device_caches: list,  # the runner's per-layer (k, v) caches, [NB, bs, Hkv, D] each
        pin: bool | None = None,  # page-locked memory; None: when the device cache is on CUDA
    ) -> HostBlockPool:
        "Allocate this pool's tensors: each layer's (k, v) with `num_blocks` blocks, on the host."
        pin = device_caches[0][0].device.type == "cuda" if pin is None else pin
        self.caches = [
            tuple(
                torch.empty((self.num_blocks, *c.shape[1:]), dtype=c.dtype, pin_memory=pin)
                for c in kv
            )
            for kv in device_caches
        ]
        return self


def copy_blocks(
    src_caches: list,  # per layer (k, v), [NB_src, bs, Hkv, D]
    dst_caches: list,  # per layer (k, v), [NB_dst, bs, Hkv, D], same block shape
    src_ids: list[int],  # blocks to read
    dst_ids: list[int],  # where each goes
    non_blocking: bool = False,  # asynchronous to/from pinned host memory (a GPU side stream)
) -> int:
    "Copy blocks between two caches: per layer one gather and one scatter for K, and for V; bytes."
    if not src_ids:
        return 0
    si = torch.tensor(src_ids, dtype=torch.long, device=src_caches[0][0].device)
    di = torch.tensor(dst_ids, dtype=torch.long, device=dst_caches[0][0].device)
    moved = 0
    for src_kv, dst_kv in zip(src_caches, dst_caches):
        for s, d in zip(src_kv, dst_kv):
            x = s.index_select(0, si)  # (n, bs, Hkv, D) gathered
            d.index_copy_(0, di, x.to(d.device, non_blocking=non_blocking))
            moved += x.numel() * x.element_size()
    return moved
