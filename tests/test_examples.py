"""Every example in ``examples/`` runs, in its fast mode, and reports OK (so none can rot).

Each runs as a subprocess, the way its docstring says: ``python examples/x.py`` or, for the ones
that shard across ranks, ``torchrun --standalone --nproc-per-node 2`` (gloo on CPU; the rendezvous
picks a free port). Each example checks its own numbers and exits non-zero when they are off.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT_S = 300  # generous: a loaded 2-core machine compiles slowly
WORLD = 2


def run(script: str, *args: str, torchrun: bool = False) -> subprocess.CompletedProcess:
    launcher = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={WORLD}"] if torchrun else []
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    return subprocess.run(
        [sys.executable, *launcher, str(ROOT / "examples" / script), *args],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=TIMEOUT_S,
    )  # fmt: skip


def assert_ok(proc: subprocess.CompletedProcess, pattern: str, count: int = 1) -> None:
    """Exit code 0 and ``count`` lines matching ``pattern`` (one per rank under torchrun)."""
    output = proc.stdout + proc.stderr
    tail = "\n".join(output.splitlines()[-60:])
    assert proc.returncode == 0, f"exit code {proc.returncode}:\n{tail}"
    lines = re.findall(pattern, proc.stdout, flags=re.MULTILINE)
    assert len(lines) == count, f"expected {count} line(s) matching {pattern!r}, got {lines}:\n{tail}"
    assert not re.search(r"^FAIL", proc.stdout, flags=re.MULTILINE), tail


@pytest.mark.parametrize(
    "script, args",
    [
        ("quickstart.py", ["--seq", "256", "--compiler", "aot_eager"]),
        ("decorate_class.py", ["--fast"]),
        ("explain_model.py", ["--fast"]),
    ],
)
def test_single_process_example(script: str, args: list[str]) -> None:
    assert_ok(run(script, *args), r"^OK\b")


@pytest.mark.parametrize(
    "script, args",
    [
        ("transformer_encoder_replicated.py", ["--fast"]),  # train, and eval under no_grad
        ("shard_positions.py", ["--fast"]),  # both layouts
        # aot_eager: the sharded recipe under inductor is test_zoo.py's; here the script itself
        ("finetune_hf.py", ["--fast", "--compiler", "aot_eager"]),
        ("trainer_hf.py", ["--fast", "--compiler", "aot_eager"]),  # (dp, cp) = (1, 2); inductor: test_trainer.py
    ],
)
def test_torchrun_example(script: str, args: list[str]) -> None:
    proc = run(script, *args, torchrun=True)
    for rank in range(WORLD):
        # NOTE: not anchored: unbuffered, the ranks' prints can interleave mid-line.
        assert_ok(proc, rf"OK rank {rank}/{WORLD}\b")


def test_ring_torchrun_example() -> None:
    proc = run("ring_torchrun.py", "--seq", "1024", torchrun=True)
    for rank in range(WORLD):
        assert_ok(proc, rf"OK rank {rank}/{WORLD}\b")  # not anchored, as above


def test_trainer_example_under_accelerate_launch() -> None:
    """``accelerate launch`` starts the ranks as torchrun does (``--multi_gpu`` is its multi-process
    launcher, CPU included; ``--cpu`` starts one process), and RingTrainer runs the same."""
    pytest.importorskip("accelerate")
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    launcher = [
        "-m", "accelerate.commands.launch", "--multi_gpu", f"--num_processes={WORLD}", "--num_machines=1",
        "--mixed_precision=no", "--dynamo_backend=no", f"--main_process_port={port}",
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(
        [sys.executable, *launcher, str(ROOT / "examples" / "trainer_hf.py"), "--fast", "--compiler", "aot_eager"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=TIMEOUT_S,
    )  # fmt: skip
    for rank in range(WORLD):
        assert_ok(proc, rf"OK rank {rank}/{WORLD}\b")
