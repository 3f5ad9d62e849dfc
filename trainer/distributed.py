"""Process group set-up: torchrun ranks (gloo on CPU, NCCL on GPU) or one local rank.

Without torchrun the trainer still initialises a one-rank process group (an in-memory store),
so the same FSDP2 and DCP code path runs everywhere.
"""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class DistContext:
    """This process's place in the run."""

    rank: int
    world: int
    local_rank: int
    device: object  # torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def setup(device: str = "auto") -> DistContext:
    """Initialise the default process group for this process and pick its device.

    `device`: "auto" (this rank's GPU, `LOCAL_RANK`, when CUDA is available), "cpu" or "cuda"
    (`csd_pipeline.runtime.model_loading.resolve_device`). Raises `CsdError` when CUDA is asked
    for but missing.
    """
    import torch
    import torch.distributed as dist

    from csd_pipeline.runtime.model_loading import resolve_device

    dev = resolve_device(device)
    use_cuda = dev.type == "cuda"
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if use_cuda:
        torch.cuda.set_device(dev)
    backend = "nccl" if use_cuda else "gloo"
    if not dist.is_initialized():
        if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
            dist.init_process_group(backend, device_id=dev if use_cuda else None)
        else:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    return DistContext(dist.get_rank(), dist.get_world_size(), local_rank, dev)


def teardown() -> None:
    """Destroy the default process group if this process created one."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def all_reduce_sum(values, device):
    """Sum a list of floats over all ranks (float64 on CPU/GPU); returns a list of floats."""
    import torch
    import torch.distributed as dist

    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(tensor)
    return tensor.tolist()


def barrier() -> None:
    """Wait for every rank (no-op with one rank)."""
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def agree_any(flag: bool, device) -> bool:
    """True on every rank when `flag` is True on any rank."""
    return all_reduce_sum([1.0 if flag else 0.0], device)[0] > 0


def broadcast_json(obj, device, src: int = 0):
    """Send a small JSON-able object from `src` to every rank (as UTF-8 bytes, never pickle)."""
    import json

    import torch
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return obj
    payload = json.dumps(obj).encode() if dist.get_rank() == src else b""
    size = torch.tensor([len(payload)], dtype=torch.int64, device=device)
    dist.broadcast(size, src=src)
    buffer = torch.zeros(int(size.item()), dtype=torch.uint8, device=device)
    if dist.get_rank() == src:
        buffer.copy_(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
    dist.broadcast(buffer, src=src)
    return json.loads(bytes(buffer.cpu().tolist()).decode())
