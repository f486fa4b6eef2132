"""Decoding from a sharded KV cache at P = 4 against one process holding the whole cache.

A small Llama-style causal LM (``MODEL``: 2 layers, hidden 128, 4 query heads and 2 key/value
heads of dim 32, vocabulary 256, float32, weights from a fixed seed) under a LongNet-style
dilated config (``SEGMENTS`` 2048, 4096, 8192, 16384 with ``RATES`` 1, 2, 4, 8, as
``single_device.py``'s) is compiled twice with the ``ring_dilated`` backend under inductor:

* sharded (P = 4 gloo ranks, ``sharding="sharded"``, ``layout="contiguous"``):
  ``ring_rewrite.prefill`` runs the prompt less its last token across the ranks and keeps each
  rank's N/P tokens' keys and values (``ShardedCache``); ``model.generate(input_ids,
  cache=cache, do_sample=False)`` then decodes, every rank feeding the same tokens: a step
  attends each rank's keys (rank 0 also the new tokens) and merges the ranks' ``(out, lse)``
  with one all-gather per layer (Note [A sharded KV cache]).
* whole (today's decode, one process): the same model and config in replicated mode on one
  rank, ``model.generate`` with transformers' ``DynamicCache``: the prefill of the whole prompt,
  then decode steps over the whole cache (``decode_attention``).

Threads: each of the 4 ranks runs with ``torch.set_num_threads(1)`` (4 ranks share the 2 cores
of the machine); the one whole-cache process with 2 threads, the same total, then ``TOKENS``
more decode steps from the same cache with 1 thread (a decode step is many small kernels: a
2-thread pool's synchronisation can cost more than it gains, the more so with other work on the
machine). Inductor compiles in-process (``TORCHINDUCTOR_COMPILE_THREADS=1``).

Check (before timing): one untimed prefill + generate of ``TOKENS`` tokens in each mode (it also
compiles every graph); the sharded ranks' greedy tokens must equal the whole-cache process's,
or the benchmark stops. Both compute the same function (the dilated model), in float32 with a
different order of sums, so the logits differ by rounding only: their max-abs difference over
max-abs value is recorded. The timed runs' tokens are compared again.

Measured per prompt length N (a second, timed run; the cache of the check run freed):

* prefill: sharded, the wall time of ``prefill`` (max over ranks; a barrier before); whole, the
  time from ``generate``'s call to its first token (the whole prompt's forward).
* time per token: each step of ``generate`` stamped by a stopping criterion; the median of the
  step times after the first ``SKIP`` (``TOKENS - 1 - SKIP`` steps), max over ranks (a step
  waits for every rank at its all-gathers, so the ranks run in lockstep). Also the process's
  CPU time per step (``time.process_time``): 4 ranks on 2 cores get half a core each.
* cache bytes per rank: the sum over layers of the keys', values' (and, sharded, positions')
  bytes, after the prefill and after the last step, max over ranks; ratio sharded / whole.
* peak RSS of the timed run (its peak reset before it, so compiles are not in it): the rise of
  VmHWM over RSS before the timed prefill (prefill activations and the cache; glibc serves
  allocations of 256 KiB or more by mmap, so freed tensors leave RSS), and in the JSON
  (``vmhwm_bytes``) the absolute peak, torch's and inductor's own memory included.
* bytes per decode step per rank: computed, ``P * B * Hq * m * (Dv + 1) * 4`` received per
  layer by the all-gather of the packed ``(out, lse)`` (sent: one P-th of that), confirmed from
  ``torch.profiler``'s record of the all-gathers of one more step (their input shapes).

Targets (P = 4): cache memory per rank at most 0.35x of the whole cache (today's: every rank
holds it); the prompt's cache per rank after the prefill at most 0.27x of the whole prompt's,
at every N, powers of two or not (the prefill pads to a bucket, then the ranks even out their
parts: Note [An even cache]); time per token within 1.5x of the one-process whole cache at N = 64k (against the
faster of its 1- and 2-thread settings), and below it where one process no longer fits
(``null``: it fits at every N measured here). The JSON records the load average before and
after: other work on the machine slows every time here.

Writes ``results/decode.json``.

    python benchmarks/decode.py              # N = 64k, 100,000, 128k (about 12 minutes on 2 cores)
    python benchmarks/decode.py --quick      # N = 4,096 and 5,000, segments / 8: a smoke run
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from pathlib import Path

import torch
from tabulate import tabulate

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/, for _common
from _common import (  # noqa: E402
    MIB,
    MMAP_THRESHOLD,
    RESULTS,
    can_measure_memory,
    machine,
    malloc_setup,
    reset_peak,
    rss,
    run_ranks,
    trim,
    verdict,
    write_json,
)

MODEL = {
    "vocab_size": 256, "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "max_position_embeddings": 1 << 18,
}  # fmt: skip
SEGMENTS, RATES = [2048, 4096, 8192, 16384], [1, 2, 4, 8]  # single_device.py's
QUICK_DIVISOR = 8  # --quick: segments 256 .. 2048
LENGTHS = [65536, 100000, 131072]  # 100,000: a prefill of 99,999 tokens padded to 131,072
QUICK_LENGTHS = [4096, 5000]
WORLD = 4
RANK_THREADS, WHOLE_THREADS = 1, 2
TOKENS = 20  # generated per run
SKIP = 3  # first step times left out of the median (none compiles in the timed run; margin)
SEED = 0
LAYOUT = "contiguous"
MEMORY_TARGET = 0.35  # cache per rank at P = 4 <= 0.35x of the whole cache
PREFILL_TARGET = 0.27  # the prompt's cache per rank after the prefill, at any N
TIME_TARGET = 1.5  # time per token at 64k <= 1.5x of one process with the whole cache
TIME_TARGET_N = 65536


# ---- the model, its prompt, its caches -------------------------------------------------------


def build_model(fields: dict | None = None):
    """The benchmark's model (``MODEL`` with ``fields`` over it), the same weights in every
    process."""
    import transformers

    torch.manual_seed(SEED)
    config = transformers.LlamaConfig(
        **{**MODEL, **(fields or {})}, attn_implementation="sdpa", pad_token_id=0, eos_token_id=None,
        bos_token_id=None,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config).eval()


def prompt(n: int, vocab: int) -> torch.Tensor:
    """``(1, n)`` token ids from ``SEED``, none the pad token 0: the same in every process."""
    gen = torch.Generator().manual_seed(SEED)
    return torch.randint(1, vocab, (1, n), generator=gen)


def cache_bytes(cache) -> int:
    """Bytes of the tensors a KV cache holds: over its layers, keys, values and (a
    ``ShardedCache``) the keys' positions."""
    total = 0
    for layer in cache.layers:
        for x in (layer.keys, layer.values, getattr(layer, "positions", None)):
            if x is not None:
                total += x.numel() * x.element_size()
    return total


def whole_cache_bytes(tokens: int, fields: dict | None = None, dtype=torch.float32) -> int:
    """Bytes of a ``DynamicCache`` of ``tokens`` tokens of the model: keys and values of every
    layer, ``(1, Hkv, tokens, head_dim)`` each."""
    m = {**MODEL, **(fields or {})}
    size = torch.empty((), dtype=dtype).element_size()
    return m["num_hidden_layers"] * 2 * m["num_key_value_heads"] * tokens * m["head_dim"] * size


def gathered_bytes(world: int, fields: dict | None = None, batch: int = 1, m: int = 1) -> int:
    """Bytes a rank receives per decode step (every layer): one all-gather per layer of the
    packed float32 ``(out, lse)``, ``(B, Hq, m, Dv + 1)`` from each of ``world`` ranks."""
    f = {**MODEL, **(fields or {})}
    return f["num_hidden_layers"] * world * batch * f["num_attention_heads"] * m * (f["head_dim"] + 1) * 4


def compile_model(model, *, segments, rates, sharded: bool, compiler: str = "inductor"):
    """``model.forward`` compiled with the ``ring_dilated`` backend (sharded or replicated);
    returns the backend (its site records)."""
    import ring_rewrite

    options = {"segment_lengths": segments, "dilation_rates": rates, "compiler": compiler}
    if sharded:
        options.update(sharding="sharded", layout=LAYOUT)
    backend = ring_rewrite.backend(**options)
    model.forward = torch.compile(model.forward, backend=backend)
    return backend


class _Stamps:
    """A stopping criterion that never stops: the wall and CPU time of each step's end."""

    def __init__(self):
        self.times: list[float] = []
        self.cpu: list[float] = []

    def __call__(self, input_ids, scores, **kwargs):
        self.times.append(time.perf_counter())
        self.cpu.append(time.process_time())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool)


def generate(model, ids: torch.Tensor, tokens: int, cache=None) -> dict:
    """Greedy ``tokens`` new tokens; their ids, logits, the call's start and each step's end."""
    from transformers import StoppingCriteriaList

    stamps = _Stamps()
    kwargs = {} if cache is None else {"cache": cache}
    with torch.no_grad():
        t0 = time.perf_counter()
        out = model.generate(
            # NOTE: an explicit mask of ones: without one, generate infers padding from any
            # pad_token_id among the ids (a generated token too), which a sharded step refuses.
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False, return_dict_in_generate=True,
            output_logits=True, stopping_criteria=StoppingCriteriaList([stamps]), **kwargs,
        )  # fmt: skip
    return {
        "tokens": out.sequences[0, ids.shape[1]:].tolist(),
        "logits": torch.cat(out.logits).tolist(),
        "start": t0,
        "stamps": stamps.times,
        "cpu_stamps": stamps.cpu,
        "cache": out.cache,
        "sequences": out.sequences,
    }


def step_times(run: dict, clock: str = "stamps") -> list[float]:
    """Each decode step's time: between consecutive step ends (the first step, the prefill
    in a whole-cache run, left out); ``clock="cpu_stamps"``: the process's CPU time."""
    s = run[clock]
    return [b - a for a, b in zip(s, s[1:])]


def logits_diff(got: list, want: list) -> float:
    """Max-abs difference over max-abs value of two runs' logits."""
    got, want = torch.tensor(got, dtype=torch.float64), torch.tensor(want, dtype=torch.float64)
    return ((got - want).abs().max() / want.abs().max()).item()


def _gather_events(model, sequences: torch.Tensor, cache) -> list[dict]:
    """``torch.profiler``'s all-gathers of one more decode step from ``sequences`` and the
    ``cache`` that holds them: each one's input shape (float32)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        generate(model, sequences, 1, cache=cache)
    # gloo's own event inside each (the same transfer) is not counted again.
    return [
        {"op": e.name, "input_shape": list(e.input_shapes[0])}
        for e in prof.events() if e.name == "_c10d_functional::all_gather_into_tensor"
    ]  # fmt: skip


# ---- one process: a sharded rank, or the whole cache ---------------------------------------------


def _run(rank: int, world: int, args: dict) -> dict:
    """One process's check run and timed run (``run_ranks`` has joined the gloo group)."""
    import torch.distributed as dist

    import ring_rewrite

    malloc_fixed = malloc_setup()
    sharded = args["sharded"]
    torch.set_num_threads(RANK_THREADS if sharded else WHOLE_THREADS)
    n, segments, rates = args["n"], args["segments"], args["rates"]
    model = build_model()
    ids = prompt(n, MODEL["vocab_size"])
    backend = compile_model(model, segments=segments, rates=rates, sharded=sharded)

    def prefill():
        return ring_rewrite.prefill(model, ids, layout=LAYOUT, multiple_of=max(rates))

    # The check run: compiles every graph; its tokens against the whole-cache process's.
    t0 = time.perf_counter()
    cache = prefill() if sharded else None
    check = generate(model, ids, TOKENS, cache=cache)
    first_s = time.perf_counter() - t0
    result = {"rank": rank, "check_tokens": check["tokens"], "check_logits": check["logits"], "first_run_s": first_s}
    if sharded:
        if check["tokens"] != args["expected_tokens"]:
            raise AssertionError(
                f"N = {n}, rank {rank}: sharded tokens {check['tokens']} differ from the whole-cache "
                f"process's {args['expected_tokens']}"
            )
        result["check_logits_diff"] = logits_diff(check["logits"], args["expected_logits"])
        result["check_logits"] = None  # the whole-cache process's are kept
    del cache, check
    trim()

    # The timed run.
    if sharded:
        dist.barrier()
    reset_peak()
    base = rss()["VmRSS"]
    if sharded:
        t0 = time.perf_counter()
        cache = prefill()
        prefill_s = time.perf_counter() - t0
        result["cache_bytes_prefill"] = cache_bytes(cache)
        run = generate(model, ids, TOKENS, cache=cache)
    else:
        run = generate(model, ids, TOKENS)
        cache = run["cache"]
        prefill_s = run["stamps"][0] - run["start"]  # the whole prompt's forward, to the first token
        result["cache_bytes_prefill"] = whole_cache_bytes(n)  # the prompt's, before any step
    after = rss()
    steps = step_times(run)
    result.update(
        prefill_s=prefill_s,
        steps_s=steps,
        step_median_s=statistics.median(steps[SKIP:]),
        step_cpu_median_s=statistics.median(step_times(run, "cpu_stamps")[SKIP:]),
        tokens=run["tokens"],
        cache_bytes_end=cache_bytes(cache),
        cache_tokens_end=cache.layers[0].keys.shape[2],
        peak_rise_bytes=after["VmHWM"] - base,
        malloc_mmap_forced=malloc_fixed,
    )  # fmt: skip
    if sharded:
        result["logits_diff"] = logits_diff(run["logits"], args["expected_timed_logits"])
        # One more step under the profiler: the all-gathers' shapes.
        result["gathers"] = _gather_events(model, run["sequences"], cache)
    else:
        result["logits"] = run["logits"]
        # 20 more steps from the same cache with 1 thread: one process's step without the
        # thread pool's synchronisation (context for the 2-thread number the targets use).
        torch.set_num_threads(1)
        more = generate(model, run["sequences"], TOKENS, cache=cache)
        result["steps_1thread_s"] = step_times(more)
        result["step_median_1thread_s"] = statistics.median(step_times(more)[SKIP:])
        result["step_cpu_median_1thread_s"] = statistics.median(step_times(more, "cpu_stamps")[SKIP:])
    result["vmhwm_bytes"] = rss()["VmHWM"]  # after reset_peak: the timed run's peak, at least
    result["records"] = [
        {"site": r.site, "rewritten": r.rewritten, "decode": bool(r.decode), "reason": r.reason} for r in backend.records
    ]
    return result


# ---- driving, in the parent --------------------------------------------------------------------


def measure(n: int, segments: list[int], rates: list[int]) -> dict:
    args = {"n": n, "segments": segments, "rates": rates}
    t0 = time.perf_counter()
    (whole,) = run_ranks(_run, 1, {**args, "sharded": False})
    print(f"  N = {n:,}: whole cache, one process: {time.perf_counter() - t0:.0f} s", flush=True)
    t0 = time.perf_counter()
    ranks = run_ranks(_run, WORLD, {
        **args, "sharded": True, "expected_tokens": whole["check_tokens"],
        "expected_logits": whole["check_logits"], "expected_timed_logits": whole["logits"],
    })  # fmt: skip
    print(f"  N = {n:,}: sharded, P = {WORLD}: {time.perf_counter() - t0:.0f} s", flush=True)
    for r in ranks:
        if r["tokens"] != whole["tokens"]:
            raise AssertionError(f"N = {n}, rank {r['rank']}: timed tokens differ from the whole-cache process's")
    return {"n": n, "whole": whole, "ranks": ranks}


def summarise(m: dict) -> dict:
    whole, ranks = m["whole"], m["ranks"]
    expected = gathered_bytes(WORLD)
    seen = [
        sum(WORLD * math.prod(g["input_shape"]) * 4 for g in r["gathers"]) for r in ranks
    ]  # received: P times each rank's packed (out, lse), float32
    per_rank = max(r["step_median_s"] for r in ranks)
    return {
        "N": m["n"],
        "prefill s (P=4)": max(r["prefill_s"] for r in ranks),
        "prefill s (whole)": whole["prefill_s"],
        "ms/token (P=4)": 1e3 * per_rank,
        "ms/token (whole, 2 thr)": 1e3 * whole["step_median_s"],
        "ms/token (whole, 1 thr)": 1e3 * whole["step_median_1thread_s"],
        "time ratio": per_rank / min(whole["step_median_s"], whole["step_median_1thread_s"]),
        "ratio to 2 thr": per_rank / whole["step_median_s"],
        "CPU ms/token/rank (P=4)": 1e3 * max(r["step_cpu_median_s"] for r in ranks),
        "CPU ms/token (whole, 1 thread)": 1e3 * whole["step_cpu_median_1thread_s"],
        "cache MiB/rank (P=4)": max(r["cache_bytes_end"] for r in ranks) / MIB,
        "cache MiB (whole)": whole["cache_bytes_end"] / MIB,
        "cache ratio": max(r["cache_bytes_end"] for r in ranks) / whole["cache_bytes_end"],
        "prefill cache ratio": max(r["cache_bytes_prefill"] for r in ranks) / whole["cache_bytes_prefill"],
        "peak rise MiB/rank (P=4)": max(r["peak_rise_bytes"] for r in ranks) / MIB,
        "peak rise MiB (whole)": whole["peak_rise_bytes"] / MIB,
        "gathered B/step/rank": expected,
        "profiler B/step/rank": max(seen) if seen and min(seen) == max(seen) else seen,
        "logits diff": max(max(r["check_logits_diff"], r["logits_diff"]) for r in ranks),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", help=f"prompt lengths N (default {' '.join(map(str, LENGTHS))})")
    parser.add_argument("--quick", action="store_true", help=f"N = {' '.join(map(str, QUICK_LENGTHS))}, segments / {QUICK_DIVISOR}: a smoke run")
    parser.add_argument("--out", type=Path, default=RESULTS / "decode.json")
    opts = parser.parse_args(argv)
    lengths = opts.lengths or (QUICK_LENGTHS if opts.quick else LENGTHS)
    segments, rates = ([w // QUICK_DIVISOR for w in SEGMENTS] if opts.quick else list(SEGMENTS)), list(RATES)
    if not can_measure_memory():
        parser.error("measuring peak RSS needs Linux (/proc/self/clear_refs and VmHWM)")
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")  # the spawned processes inherit it
    print(
        f"Llama-style LM {MODEL}, float32, segments {segments}, rates {rates}, inductor;\n"
        f"sharded: P = {WORLD} gloo ranks, layout {LAYOUT}, {RANK_THREADS} thread each; whole cache: one process, "
        f"{WHOLE_THREADS} threads; {os.cpu_count()} cores; {TOKENS} greedy tokens per run\n",
        flush=True,
    )
    record_machine = machine(threads=WHOLE_THREADS)
    load = {"before": os.getloadavg()}
    runs = [measure(n, segments, rates) for n in lengths]
    load["after"] = os.getloadavg()
    rows = [summarise(m) for m in runs]
    print()
    print(tabulate(rows, headers="keys", floatfmt=".3g"))
    print(
        f"\nsharded: P = {WORLD} ranks x {RANK_THREADS} thread; whole: 1 process x {WHOLE_THREADS} threads (2 cores);"
        f" tokens equal in both runs at every N (checked before timing)\n"
        f"prefill: sharded ring_rewrite.prefill (N - 1 tokens), max over ranks; whole: generate's call to its first "
        f"token\nms/token: median of {TOKENS - 1 - SKIP} decode steps (max over ranks); cache: keys + values "
        f"(+ positions, sharded) after {TOKENS} tokens, max over ranks\npeak rise: VmHWM over RSS before the timed "
        f"prefill + generate; gathered: all-gather bytes a rank receives per step (computed), profiler: from "
        f"the all-gathers' shapes\nwhole, 1 thr: {TOKENS} more steps from the same cache with 1 thread; time ratio: "
        f"P = {WORLD} over the faster whole-cache setting; CPU ms: the process's CPU time per step\nlogits diff: max-abs difference / max-abs value of the sharded logits against "
        f"the whole-cache process's"
    )

    by_n = {row["N"]: row for row in rows}
    memory_met = all(row["cache ratio"] <= MEMORY_TARGET for row in rows)
    prefill_met = all(row["prefill cache ratio"] <= PREFILL_TARGET for row in rows)
    time_met = None
    if TIME_TARGET_N in by_n:
        time_met = by_n[TIME_TARGET_N]["time ratio"] <= TIME_TARGET
    lines = [
        (f"cache memory per rank at P = {WORLD} <= {MEMORY_TARGET}x of the whole cache", memory_met),
        (f"the prompt's cache per rank after the prefill <= {PREFILL_TARGET}x of the whole prompt's, "
         f"at every N measured ({', '.join(f'{n:,}' for n in lengths)})", prefill_met),
        (f"time per token at N = {TIME_TARGET_N:,} within {TIME_TARGET}x of one process holding the whole cache "
         "(its faster of 1 and 2 threads)", time_met),
        ("time per token below one process's where one process no longer fits "
         "(one process fits at every N measured here)", None),
    ]  # fmt: skip
    print()
    for line, met in lines:
        print(f"target: {line}: {verdict(met)}")
    record = {
        "benchmark": "decode",
        "machine": record_machine,
        "setup": {
            "model": MODEL, "dtype": "float32", "segment_lengths": segments, "dilation_rates": rates,
            "world": WORLD, "layout": LAYOUT, "compiler": "inductor", "rank_threads": RANK_THREADS,
            "whole_threads": WHOLE_THREADS, "inductor_compile_threads": 1, "tokens": TOKENS, "skip": SKIP,
            "lengths": lengths, "seed": SEED, "malloc_mmap_threshold_bytes": MMAP_THRESHOLD,
            "check": "the sharded ranks' greedy tokens equal the whole-cache process's, before timing",
            "prefill": "sharded: ring_rewrite.prefill, max over ranks; whole: generate's call to its first token",
            "time per token": f"median of the step times after the first {SKIP}, max over ranks",
        },  # fmt: skip
        "targets": [{"line": line, "met": met} for line, met in lines],
        "load_average": load,  # 1, 5, 15 minutes: other work on the machine slows thread pools
        "rows": rows,
        "runs": runs,
    }
    print()
    write_json(opts.out, record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
