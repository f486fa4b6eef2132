"""Run a function on P gloo ranks (spawned processes) and fail if any rank fails."""

from __future__ import annotations

import datetime
import os
import socket
from collections.abc import Callable

import torch.distributed as dist
import torch.multiprocessing as mp

GROUP_TIMEOUT = datetime.timedelta(seconds=120)  # covers a backward compile on a peer


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world: int, port: int, fn: Callable, args: tuple, backend: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group(backend, rank=rank, world_size=world, timeout=GROUP_TIMEOUT)
    try:
        fn(rank, world, *args)
    finally:
        dist.destroy_process_group()


def run_ranks(world: int, fn: Callable, *args, backend: str = "gloo") -> None:
    """``fn(rank, world, *args)`` on every rank; a rank's exception fails the caller."""
    mp.start_processes(
        _entry, args=(world, free_port(), fn, args, backend), nprocs=world, join=True, start_method="spawn"
    )
