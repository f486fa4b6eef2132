"""Train a small LongNet-style byte-level language model on ranks that each hold part of the sequence.

    make demo                  # 4 CPU ranks (gloo), 16,384 tokens per sample, about 2 minutes
    torchrun --standalone --nproc-per-node 4 examples/train_longnet.py [--seq 16384] [--steps 80]
    make demo ARGS="--dp 2 --dp-mode fsdp"   # 2 data-parallel replicas x a ring of 2 ranks each

The model is ordinary PyTorch: causal `F.scaled_dot_product_attention` with GQA, RoPE on the
tokens' global positions, RMSNorm, SwiGLU. Compiled with `ring_rewrite.backend(...,
sharding="sharded", group=mesh["cp"])`, each attention becomes ring dilated attention: the ranks
sit on a `(dp, cp)` mesh; every rank of a `cp` group holds 1/cp of its replica's sequence (cut
with `ring_rewrite.shard`) and the group passes K/V blocks around its ring, while each of the `dp`
replicas trains on samples of its own. DistributedDataParallel (or FSDP2's `fully_shard`, with
`--dp-mode fsdp`) averages the parameter gradients over all dp x cp ranks.

Before the first optimizer step, every replica's loss and logits, and the parameter gradients
(averaged over the ranks), are checked against one process per replica running the same model and
weights on that replica's whole sequence with the float64 `reference_attention` (the gradients
against the replicas' mean); the script exits non-zero if any differs by more than the float32
bound (1e-5 relative, per tensor: max-abs difference / max-abs value). Then one progress line per
step (loss, tokens/s, peak memory per rank), a summary table, `results/demo_loss.png`.
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import datetime
import functools
import gc
import math
import os
import re
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from tabulate import tabulate
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

import ring_rewrite
from ring_rewrite import cpu_choice
from ring_rewrite.reference import reference_attention

ROOT = Path(__file__).resolve().parents[1]


# --- the model: plain PyTorch, nothing ring-specific ---------------------------------------------


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    vocab: int = 256  # bytes
    dim: int = 64
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    rope_theta: float = 10000.0

    @property
    def head_dim(self) -> int:
        return self.dim // self.heads

    @property
    def hidden(self) -> int:  # SwiGLU width: 8/3 of dim, rounded up to a multiple of 16
        return -(-8 * self.dim // 3 // 16) * 16


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


def rope(pos: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype):
    """cos / sin of the rotary angles at positions ``pos``; the angles in float64 (exact at 16k+)."""
    inv_freq = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float64, device=pos.device) / head_dim)
    angles = pos.to(torch.float64)[:, None] * inv_freq
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, attend) -> None:
        super().__init__()
        self.cfg, self.attend = cfg, attend
        self.wq = nn.Linear(cfg.dim, cfg.heads * cfg.head_dim, bias=False)
        self.wkv = nn.Linear(cfg.dim, 2 * cfg.kv_heads * cfg.head_dim, bias=False)
        self.wo = nn.Linear(cfg.heads * cfg.head_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        cfg = self.cfg
        q = self.wq(x).view(b, n, cfg.heads, cfg.head_dim).transpose(1, 2)
        k, v = self.wkv(x).view(b, n, 2, cfg.kv_heads, cfg.head_dim).permute(2, 0, 3, 1, 4)
        out = self.attend(apply_rope(q, cos, sin), apply_rope(k, cos, sin), v)
        return self.wo(out.transpose(1, 2).reshape(b, n, -1))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, attend) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.RMSNorm(cfg.dim, eps=1e-6), nn.RMSNorm(cfg.dim, eps=1e-6)
        self.attn = Attention(cfg, attend)
        self.w1 = nn.Linear(cfg.dim, cfg.hidden, bias=False)
        self.w3 = nn.Linear(cfg.dim, cfg.hidden, bias=False)
        self.w2 = nn.Linear(cfg.hidden, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin)
        h = self.norm2(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


class LongNetLM(nn.Module):
    """Byte-level causal LM; ``pos`` are the global positions of the tokens this process holds.
    ``attend(q, k, v)`` is the attention (causal SDPA unless told otherwise)."""

    def __init__(self, cfg: ModelConfig, attend=causal_attention) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab, cfg.dim)
        self.blocks = nn.ModuleList(Block(cfg, attend) for _ in range(cfg.layers))
        self.norm = nn.RMSNorm(cfg.dim, eps=1e-6)
        self.head = nn.Linear(cfg.dim, cfg.vocab, bias=False)

    def forward(self, tokens: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        cos, sin = rope(pos, self.cfg.head_dim, self.cfg.rope_theta, x.dtype)
        for block in self.blocks:
            x = block(x, cos, sin)
        return self.head(self.norm(x))


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


# --- measuring -----------------------------------------------------------------------------------


def peak_mib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    try:  # peak resident set size of this process (Linux)
        return int(re.search(r"VmHWM:\s+(\d+) kB", Path("/proc/self/status").read_text())[1]) / 1024
    except (OSError, TypeError):
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    gc.collect()
    try:  # hand freed heap back first, so that the new peak starts from what is in use
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM (Linux)
    except OSError:
        pass


def per_rank(values: list[float]) -> str:
    if len(values) <= 8:
        return " ".join(f"{v:,.0f}" for v in values)
    top = max(range(len(values)), key=values.__getitem__)
    return f"max {values[top]:,.0f} (rank {top})"


def rel_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


# --- the run -------------------------------------------------------------------------------------


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="The number of ranks comes from torchrun (make demo RANKS=8): dp x cp. --device cuda uses "
        "NCCL and the same code path; it is untested (this project is developed on CPU only).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    arg = p.add_argument
    arg("--seq", type=int, default=16384, help="tokens per sample (the whole sequence, all ranks)")
    arg("--steps", type=int, default=80, help="optimizer steps")
    arg("--batch-size", type=int, default=1, help="samples per step and replica (each rank holds its shard of each)")
    arg("--dp", type=int, default=1, help="data-parallel replicas, each with its own samples and a ring "
        "of (ranks / dp) ranks")
    arg("--dp-mode", default="ddp", choices=["ddp", "fsdp"], help="parameters replicated "
        "(DistributedDataParallel) or sharded (FSDP2 fully_shard) over all ranks")  # fmt: skip
    arg("--lr", type=float, default=1e-2, help="peak AdamW learning rate (warmup, cosine to 10%%)")
    arg("--segments", type=int, nargs="+", default=[1024, 4096, 16384], help="segment lengths w")
    arg("--rates", type=int, nargs="+", default=[1, 4, 16], help="dilation rates r, one per segment")
    arg("--layout", default="zigzag", choices=["zigzag", "contiguous"], help="how ranks cut the sequence")
    arg("--compiler", default="inductor", choices=["inductor", "aot_eager", "eager"],
        help="what lowers the rewritten graph")  # fmt: skip
    arg("--dim", type=int, default=64, help="model width")
    arg("--layers", type=int, default=2, help="transformer blocks")
    arg("--heads", type=int, default=4, help="query heads")
    arg("--kv-heads", type=int, default=2, help="key/value heads (GQA)")
    arg("--device", default="cpu", choices=["cpu", "cuda"], help="cuda: a GPU per rank, NCCL; untested")
    arg("--data", type=Path, default=ROOT / "data" / "devils_dictionary.txt", help="text, read as bytes")
    arg("--out", type=Path, default=ROOT / "results" / "demo_loss.png", help="loss-curve PNG")
    arg("--seed", type=int, default=0, help="weights and samples (the same on every rank)")
    arg("--ref-chunk", type=int, default=512, help="query rows per chunk of the float64 check")
    arg("--check-bound", type=float, default=1e-5, help="largest relative difference the first-step "
        "check accepts (float32)")  # fmt: skip
    return p.parse_args()


def main() -> int:
    t_start = time.perf_counter()
    args = parse_args()
    device = torch.device("cpu")
    if args.device == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    dist.init_process_group(
        "nccl" if device.type == "cuda" else "gloo", timeout=datetime.timedelta(minutes=10)
    )
    try:
        return train(args, device, t_start)
    finally:
        # NOTE: DDP must be gone (train() has returned) before the group is destroyed. DDP's
        # Reducer holds the group from C++ and frees it with the GIL held; gloo's destructor then
        # joins a worker thread that may need the GIL to free the last collective's tensors: a
        # deadlock at exit. Released from Python, the group is freed without the GIL.
        gc.collect()
        dist.destroy_process_group()


def train(args: argparse.Namespace, device: torch.device, t_start: float) -> int:
    world, rank = dist.get_world_size(), dist.get_rank()
    say = functools.partial(print, flush=True) if rank == 0 else lambda *a, **k: None
    cfg = ModelConfig(dim=args.dim, layers=args.layers, heads=args.heads, kv_heads=args.kv_heads)
    n, batch, layout = args.seq, args.batch_size, args.layout
    if args.dp < 1 or world % args.dp:
        raise SystemExit(f"--dp {args.dp} must divide the {world} ranks")
    dp, cp = args.dp, world // args.dp
    # Each dp replica trains on samples of its own; the cp ranks of a replica share each of its
    # samples through their ring.
    mesh = init_device_mesh(device.type, (dp, cp), mesh_dim_names=("dp", "cp"))
    replica, cp_rank = mesh.get_local_rank("dp"), mesh.get_local_rank("cp")

    text = torch.frombuffer(bytearray(args.data.read_bytes()), dtype=torch.uint8).long()
    if len(text) <= n + 1:
        raise SystemExit(f"--seq {n} needs a text longer than {n + 1} bytes; {args.data} has {len(text)}")
    # Every rank draws the same samples (same seed), takes its replica's and cuts its shard of each.
    gen = torch.Generator().manual_seed(args.seed)
    starts = torch.randint(0, len(text) - n - 1, (args.steps, dp, batch), generator=gen)
    window = torch.arange(n + 1)

    torch.manual_seed(args.seed)  # the same initial weights on every rank
    model = LongNetLM(cfg).to(device)
    backend = ring_rewrite.backend(
        segment_lengths=args.segments, dilation_rates=args.rates, sharding="sharded", layout=layout,
        group=mesh["cp"], compiler=args.compiler,
    )  # fmt: skip
    wrapped = data_parallel(model, args.dp_mode, backend, device)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    warmup = max(1, args.steps // 10)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * (0.55 + 0.45 * math.cos(math.pi * s / args.steps))
    )
    pos = ring_rewrite.positions(n, world=cp, rank=cp_rank, layout=layout, device=device)
    cut = functools.partial(ring_rewrite.shard, dim=1, group=mesh["cp"], layout=layout)

    params = sum(p.numel() for p in model.parameters())
    say(f"LongNet-style byte LM: {cfg.layers} layers, d_model {cfg.dim}, {cfg.heads} query / "
        f"{cfg.kv_heads} KV heads, RoPE, RMSNorm, SwiGLU; {params / 1e6:.2f} M parameters")
    say(f"data: {args.data.name} ({len(text):,} bytes), {dp * batch} x {n:,} tokens per step")
    say(f"{world} ranks ({dist.get_backend()}, {device.type})"
        + (f" = {dp} data-parallel replicas x rings of {cp}" if dp > 1 else "")
        + f", layout {layout}: {n // cp:,} tokens per rank; dilated attention: segments "
        f"{args.segments}, rates {args.rates}")  # fmt: skip
    say(f"compiler {args.compiler}; gradients averaged over all {world} ranks by "
        f"{'DistributedDataParallel' if args.dp_mode == 'ddp' else 'FSDP2 (fully_shard)'}")
    if device.type == "cpu":
        say(f"CPU block kernel: {cpu_choice.describe()}")
    if device.type == "cuda":
        say("NOTE: --device cuda (NCCL) takes the same code path but is untested: this project is "
            "developed and checked on CPU only.")  # fmt: skip
    say("compiling the forward...")

    losses: list[float] = []
    step_times: list[float] = []
    peaks: list[float] = []
    tty, width = sys.stdout.isatty(), 0
    for step in range(args.steps):
        t0 = time.perf_counter()
        seq = text[starts[step, replica][:, None] + window].to(device)  # (B, N + 1) bytes
        inputs, targets = seq[:, :-1], seq[:, 1:]
        logits = wrapped(cut(inputs), pos)
        loss = lm_loss(logits, cut(targets))
        if step == 0:
            say(f"compiled in {time.perf_counter() - t0:.1f} s\n\n{ring_rewrite.Report(backend.records)}\n")
            say("compiling the backward...")
        loss.backward()
        if step == 0:
            t_check = time.perf_counter()
            if not first_step_check(args, cfg, model, mesh, inputs, targets, logits, loss, say):
                say("FAIL: the sharded model does not compute what one process computes; not training")
                return 1
            reset_peak(device)  # the float64 check ran on one rank per replica: leave it out of the peaks
            say("training")
            t0 += time.perf_counter() - t_check
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)

        stats = torch.tensor([loss.item(), peak_mib(device)], dtype=torch.float64, device=device)
        gathered = [torch.empty_like(stats) for _ in range(world)]
        dist.all_gather(gathered, stats)
        dt = time.perf_counter() - t0
        losses.append(sum(g[0].item() for g in gathered) / world)  # equal shards: the global mean
        peaks = [g[1].item() for g in gathered]
        step_times.append(dt)
        done = 20 * (step + 1) // args.steps
        line = (f"step {step + 1:>{len(str(args.steps))}}/{args.steps} [{'#' * done}{'.' * (20 - done)}] "
                f"loss {losses[-1]:.4f} | {dp * batch * n / dt:,.0f} tok/s | {dt:.2f} s | "
                f"peak MiB/rank {per_rank(peaks)}")  # fmt: skip
        if tty:  # one line, rewritten in place
            width = max(width, len(line))
            say("\r" + line.ljust(width), end="\n" if step + 1 == args.steps else "")
        else:
            say(line)

    if rank == 0:
        steady = step_times[1:] or step_times
        replicas = f"{dp} replicas x " if dp > 1 else ""
        rows = [
            ["steps", f"{args.steps} of {dp * batch} x {n:,} tokens ({replicas}{cp} ranks x {n // cp:,}, {layout})"],
            ["loss first -> last", f"{losses[0]:.4f} -> {losses[-1]:.4f}"],
            ["tokens/s (all ranks, steps 2+)",
             f"{dp * batch * n * len(steady) / sum(steady):,.0f}  ({sum(steady) / len(steady):.2f} s/step)"],
            ["step 1 (compiles fwd + bwd)", f"{step_times[0]:.1f} s"],
            [f"peak {'CUDA' if device.type == 'cuda' else 'RSS'} MiB per rank", per_rank(peaks)],
            ["wall time", f"{time.perf_counter() - t_start:.1f} s"],
        ]  # fmt: skip
        print("\n" + tabulate(rows, tablefmt="simple"))
        print(f"loss curve: {plot(losses, args, dp, cp)}", flush=True)
    return 0


def data_parallel(model: LongNetLM, mode: str, backend, device: torch.device) -> nn.Module:
    """``model`` compiled with ``backend``, its parameters replicated (DDP) or sharded (FSDP2)
    over every rank and their gradients averaged over all: each rank holds other tokens (its
    replica's samples, its part of each), as with torchtitan's ``dp_shard_cp`` mesh and
    Megatron's data-parallel group with context parallel. Call the result.

    DDP: the module is compiled in place, then wrapped. Dynamo traces the model, never DDP, so
    torch._dynamo.config.optimize_ddp (which splits a compiled DDP graph at its gradient buckets)
    does not come into play; DDP's hooks fire on the gradients that the compiled backward produces.
    FSDP2: dynamo cannot trace its hooks in one graph, so each block (where the attention is) is
    compiled, then sharded: the hooks sit on the compiled block, outside its graph (as torchtitan
    does); the embedding and the head run eagerly.
    """
    if mode == "ddp":
        model.compile(backend=backend, fullgraph=True)
        return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    from torch.distributed.fsdp import fully_shard

    every_rank = init_device_mesh(device.type, (dist.get_world_size(),))
    for i, block in enumerate(model.blocks):
        model.blocks[i] = fully_shard(torch.compile(block, backend=backend, fullgraph=True), mesh=every_rank)
    return fully_shard(model, mesh=every_rank)


def _full(x: torch.Tensor) -> torch.Tensor:
    """The whole tensor: FSDP2 holds a shard of each parameter and gradient (a DTensor)."""
    return x.full_tensor() if isinstance(x, DTensor) else x


def first_step_check(args, cfg, model, mesh: DeviceMesh, inputs, targets, logits, loss, say) -> bool:
    """Every replica's first loss and logits, and the parameter gradients (what the optimizer will
    use: the average over the ranks), vs one process per replica with float64 reference attention:
    same weights, the replica's whole sequence; the gradients vs the mean of the replicas'.
    Returns whether every rank may go on (the same answer on every rank)."""
    dp, cp = mesh.shape
    replica, cp_rank = mesh.get_local_rank("dp"), mesh.get_local_rank("cp")
    with torch.no_grad():
        sharded = loss.detach().clone()
        dist.all_reduce(sharded, group=mesh["cp"].get_group())  # means over equal shards
        sharded = sharded.item() / cp  # the replica's mean
        full_logits = ring_rewrite.unshard(logits.detach(), 1, group=mesh["cp"], layout=args.layout)
        # (A compiled block's parameters are named inside it: "blocks.0._orig_mod.attn...".)
        names = [name.replace("_orig_mod.", "") for name, _ in model.named_parameters()]
        weights = {name: _full(p).detach() for name, p in zip(names, model.parameters())}
        grads = {name: _full(p.grad) for name, p in zip(names, model.parameters())}
    result = None
    if cp_rank == 0:  # one process per replica: the first rank of its ring
        t0 = time.perf_counter()
        threads = torch.get_num_threads()
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        torch.set_num_threads(max(1, (cores or threads) // dp))  # the other ranks wait meanwhile
        attend = functools.partial(
            reference_attention, segment_lengths=args.segments, dilation_rates=args.rates,
            is_causal=True, query_chunk=args.ref_chunk,
        )  # fmt: skip
        ref = LongNetLM(cfg, attend=attend).to(inputs.device)
        ref.load_state_dict(weights)
        ref.double()
        ref_logits = ref(inputs, torch.arange(inputs.shape[1], device=inputs.device))
        ref_loss = lm_loss(ref_logits, targets)
        ref_loss.backward()
        torch.set_num_threads(threads)
        # What the ranks' average is: the mean over the replicas (equal shards everywhere).
        ref_grads = torch.cat([p.grad.flatten() for p in ref.parameters()])
        dist.all_reduce(ref_grads, group=mesh["dp"].get_group())
        ref_grads = (ref_grads / dp).split([p.numel() for p in ref.parameters()])
        grad_errs = {
            name: rel_error(grads[name], r.view_as(grads[name])) for name, r in zip(grads, ref_grads)
        }
        result = (
            replica, sharded, ref_loss.item(), abs(sharded - ref_loss.item()) / abs(ref_loss.item()),
            rel_error(full_logits, ref_logits.detach()), grad_errs, time.perf_counter() - t0,
        )  # fmt: skip
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, result)
    results = sorted(r for r in everyone if r is not None)
    passed = all(max(loss_err, logits_err, *errs.values()) <= args.check_bound
                 for _, _, _, loss_err, logits_err, errs, _ in results)  # fmt: skip
    per_replica = "one process per replica" if dp > 1 else "one process"
    say(f"first-step check vs {per_replica} with float64 reference attention "
        f"({max(r[-1] for r in results):.1f} s):")  # fmt: skip
    for d, sharded, ref_loss, loss_err, logits_err, _, _ in results:
        which = f" (replica {d})" if dp > 1 else ""
        say(f"  loss{which}    sharded over {cp} ranks {sharded:.8f}   reference {ref_loss:.8f}   "
            f"rel. difference {loss_err:.2e}")
        say(f"  logits{which}  max-abs rel. difference {logits_err:.2e}")
    grad_errs = results[0][5]
    worst = max(grad_errs, key=grad_errs.get)
    mean = f" vs the mean of {dp} replicas'" if dp > 1 else ""
    say(f"  grads   max-abs rel. difference {grad_errs[worst]:.2e}{mean} (worst of {len(grad_errs)} "
        f"parameters: {worst}; median {sorted(grad_errs.values())[len(grad_errs) // 2]:.2e})")
    say(f"  {'OK' if passed else 'FAIL'}: bound {args.check_bound:.0e} (float32)")
    return passed


def plot(losses: list[float], args: argparse.Namespace, dp: int, cp: int) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=120)
    ax.plot(range(1, len(losses) + 1), losses, marker="o", markersize=3)
    ax.set_xlabel("step")
    ax.set_ylabel("loss (cross-entropy, nats/byte)")
    replicas = f"{dp} replicas x " if dp > 1 else ""
    ax.set_title(f"ring dilated attention: {replicas}{cp} ranks x {args.seq // cp:,} tokens ({args.layout}), "
                 f"segments {args.segments}, rates {args.rates}", fontsize=8)  # fmt: skip
    ax.grid(alpha=0.3)
    fig.tight_layout()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out)
    plt.close(fig)
    return args.out


if __name__ == "__main__":
    sys.exit(main())
