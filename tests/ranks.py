"""Run a function on P gloo ranks (processes) and fail if any rank fails.

The ranks fork from a server that has imported torch once (``forkserver``, with torch, dynamo
and inductor preloaded): a rank starts in under a second, where a spawned one imports torch
anew (several seconds, for every test that runs ranks). Spawned, a rank would see the caller's
environment at the call and import the test's module fresh; so here each rank takes the
caller's environment first, then imports the function by name, and reads every
``RING_REWRITE_*`` variable as a spawned rank would (the preloaded modules read none).
"""

from __future__ import annotations

import datetime
import functools
import importlib
import os
import socket
from collections.abc import Callable

import torch.distributed as dist
import torch.multiprocessing as mp

GROUP_TIMEOUT = datetime.timedelta(seconds=120)  # covers a backward compile on a peer
PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "torch._inductor.compile_fx"]

mp.set_forkserver_preload(PRELOAD)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world: int, port: int, target: tuple[str, str], args: tuple, backend: str, env: dict) -> None:
    os.environ.clear()
    os.environ.update(env, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    module, name = target
    fn = functools.reduce(getattr, name.split("."), importlib.import_module(module))
    dist.init_process_group(backend, rank=rank, world_size=world, timeout=GROUP_TIMEOUT)
    try:
        fn(rank, world, *args)
    finally:
        dist.destroy_process_group()


def start_ranks(world: int, fn: Callable, args: tuple, *, backend: str = "gloo", join: bool = True):
    """``fn(rank, world, *args)`` on ``world`` new processes (``fn`` a module-level function,
    imported by name in each); ``mp.start_processes``' context where ``join`` is False."""
    target = (fn.__module__, fn.__qualname__)
    return mp.start_processes(
        _entry, args=(world, free_port(), target, args, backend, dict(os.environ)), nprocs=world, join=join,
        start_method="forkserver",
    )  # fmt: skip


def run_ranks(world: int, fn: Callable, *args, backend: str = "gloo") -> None:
    """``fn(rank, world, *args)`` on every rank; a rank's exception fails the caller."""
    start_ranks(world, fn, args, backend=backend)
