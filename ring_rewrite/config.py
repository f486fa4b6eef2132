"""The one configuration object of the backend."""

from __future__ import annotations

import dataclasses
import datetime
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import torch.distributed as dist

from .comm.tags import MAX_BRANCHES

__all__ = ["RingDilatedConfig"]

_INT64_MAX = 2**63 - 1
_MAX_TIMEOUT = 1e12  # seconds: in milliseconds, an int64 the transfers carry

Sharding = Literal["replicated", "sharded"]
Layout = Literal["contiguous", "zigzag"]
Comm = Literal["ring", "all_to_all", "hybrid"]
Compiler = Literal["inductor", "aot_eager", "eager"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class RingDilatedConfig:
    """How the ``ring_dilated`` backend rewrites every SDPA site it captures.

    A frozen, keyword-only dataclass that holds every option of the backend: the branches of
    dilated attention, the process group the ring runs in, whether each rank holds the whole
    sequence or its shard, how the sequence is cut into shards, what lowers the rewritten graph,
    and how long a rank waits for a transfer. Branch ``i`` attends within segments of ``w_i``
    tokens on the lattice of every ``r_i``-th position (query head ``j`` takes offset
    ``j % r_i``), and the branches merge exactly by their log-sum-exps (docs/semantics.md, The
    function). The default, no branches, is one branch ``(w = N, r = 1)``: exact attention (ring
    attention across ranks). Every value is checked when the config is built; sequences are
    stored as tuples and ``timeout`` as a float. ``ring_rewrite.backend(**fields)``,
    ``ring_rewrite.ring_dilated(**fields)`` and ``torch.compile(..., options={...})`` build one
    from the same fields.

    Args:
        segment_lengths (Sequence[int], optional): segment length ``w_i >= 1`` of each branch;
            ``w_i >= N`` is one segment over the whole sequence. Given together with
            ``dilation_rates`` or not at all. Default: ``None`` (exact attention).
        dilation_rates (Sequence[int], optional): dilation rate ``r_i >= 1`` of each branch,
            with ``w_i % r_i == 0``. At least one branch has rate 1 (or some head and position
            would attend to nothing), no ``(w_i, r_i)`` pair repeats, and there are at most 16
            branches. Default: ``None``.
        group (ProcessGroup or DeviceMesh, optional): the ranks that share the sequence: a
            ``ProcessGroup``, a 1-D ``DeviceMesh`` (such as ``mesh["cp"]``), with
            ``comm="hybrid"`` a 2-D ``DeviceMesh`` of dims ``(ring, a2a)`` (each row an
            all-to-all group of consecutive ranks, the ring across the rows; it sets
            ``a2a_ranks``), or ``None`` for WORLD when ``torch.distributed`` is initialised (one
            device otherwise). Default: ``None``.
        sharding (str): ``"replicated"``: every rank runs the model on the whole sequence and
            the rewritten site takes its shard (drop-in); ``"sharded"``: every rank runs the
            model on its own shard (context parallel; cut inputs with ``ring_rewrite.shard`` or
            ``ring_rewrite.shard_batch``), and a site that cannot be rewritten is an error.
            Default: ``"replicated"``.
        layout (str): how the sequence is cut into rank shards: ``"contiguous"`` (rank ``k``
            holds tokens ``[kN/P, (k+1)N/P)``) or ``"zigzag"`` (``2P`` chunks, rank ``k`` holds
            chunks ``k`` and ``2P-1-k``). Default: ``"contiguous"``.
        comm (str): how the ranks share a site's work: ``"ring"`` (every rank keeps its heads
            and its shard of the sequence; K/V go round a ring) or ``"all_to_all"`` (an
            all-to-all turns the shards of the sequence into shards of the heads, each rank
            attends the whole sequence for ``H / P`` heads, and a second one turns the output
            back: Note [Heads across ranks]) or ``"hybrid"`` (all-to-alls within groups of
            ``a2a_ranks`` consecutive ranks, a ring across the groups). Default: ``"ring"``.
        a2a_ranks (int, optional): ranks in each all-to-all group of ``comm="hybrid"``; it
            must divide the group's ranks. Default: ``None``.
        compiler (str): what lowers the rewritten graph: ``"inductor"``, or ``"aot_eager"`` /
            ``"eager"`` to debug. Default: ``"inductor"``.
        strict (bool): raise instead of leaving a site that cannot be rewritten as written
            (docs/semantics.md, Sites left alone). Default: ``False``.
        timeout (float or datetime.timedelta): seconds a rank waits for one ring transfer (a
            call's opening header, twice that) before it raises ``ring_rewrite.TransferTimeout``;
            positive and below ``1e12``. It must cover a peer's compile: the backward compiles
            at the first ``.backward()`` while the other ranks wait. Over NCCL the host does not
            wait for a transfer: the process group's own timeout bounds it, and this one the
            headers (Note [The CUDA transport]). Default: ``300.0``.
        disable_passes (Sequence[str]): normalising passes not to run, by name:
            ``"attention_modules"`` (spells ``nn.MultiheadAttention`` /
            ``nn.TransformerEncoderLayer`` out as SDPA), ``"length_buckets"``. The SDPA rewrite
            always runs. The names are checked when a backend is built from the config.
            Default: ``()``.

    Raises:
        ValueError: a value of the wrong type or out of range, naming the field.
        TypeError: a field that does not exist (the dataclass's own check).

    Example::

        config = RingDilatedConfig(segment_lengths=[2048, 8192], dilation_rates=[1, 4],
                                   sharding="sharded", layout="zigzag")
        model = torch.compile(model, backend=ring_rewrite.backend(config))
        config.branches(16384)  # ((2048, 1), (8192, 4))

    .. warning::
        Every test runs on CPU over gloo. The CUDA block kernel has run on one GPU only
        (``P = 1``); rings across GPUs over NCCL have never run.
    """

    segment_lengths: tuple[int, ...] | None = None
    """Segment length ``w_i`` of each branch; ``w_i >= N`` means one segment over the whole
    sequence. ``None`` (with ``dilation_rates=None``) is the exact config."""

    dilation_rates: tuple[int, ...] | None = None
    """Dilation rate ``r_i`` of each branch, ``w_i % r_i == 0``. At least one branch must have
    rate 1, or some (head, position) would attend to nothing."""

    group: Any = None
    """Process group: a ``ProcessGroup``, a 1-D ``DeviceMesh``, a 2-D ``DeviceMesh`` ``(ring,
    a2a)`` with ``comm="hybrid"``, or ``None`` for WORLD when ``torch.distributed`` is
    initialised (single device otherwise)."""

    sharding: Sharding = "replicated"
    """``"replicated"``: every rank holds the full sequence (drop-in). ``"sharded"``: the
    model already runs on local sequence shards (context parallel)."""

    layout: Layout = "contiguous"
    """How the sequence is cut into rank shards: ``"contiguous"`` or ``"zigzag"``."""

    comm: Comm = "ring"
    """``"ring"``: K/V go round a ring of the ranks; ``"all_to_all"``: the ranks exchange
    sequence shards for head shards and back (Note [Heads across ranks]); ``"hybrid"``: they do
    so within groups of ``a2a_ranks``, and a ring runs across the groups."""

    a2a_ranks: int | None = None
    """Ranks in each all-to-all group of ``comm="hybrid"`` (consecutive ranks of the group)."""

    compiler: Compiler = "inductor"
    """What lowers the rewritten graph: ``"inductor"``, or ``"aot_eager"`` / ``"eager"`` to debug."""

    strict: bool = False
    """Raise instead of leaving an unsupported SDPA site alone."""

    timeout: float = 300.0
    """Seconds any rank waits for one ring transfer before it raises naming the site, branch,
    step, tag and peer ranks (docs/ring.md, Faults). A call's opening header, where a rank waits
    for its peers to arrive (they may compile, or run code of their own between calls), waits
    twice that and at least 10 minutes. A ``datetime.timedelta`` is accepted."""

    disable_passes: tuple[str, ...] = ()
    """Normalising passes not to run, by name (``passes/pipeline.py``: ``"attention_modules"``
    spells ``nn.MultiheadAttention`` out as SDPA). The SDPA rewrite always runs."""

    def __post_init__(self) -> None:
        seg, rates = self.segment_lengths, self.dilation_rates
        if (seg is None) != (rates is None):
            raise ValueError(
                "segment_lengths and dilation_rates must be given together "
                f"(got segment_lengths={seg!r}, dilation_rates={rates!r})"
            )
        if seg is not None:
            seg, rates = _int_tuple("segment_lengths", seg), _int_tuple("dilation_rates", rates)
            object.__setattr__(self, "segment_lengths", seg)
            object.__setattr__(self, "dilation_rates", rates)
            if not seg:
                raise ValueError("segment_lengths must name at least one branch")
            if len(seg) != len(rates):
                raise ValueError(
                    f"segment_lengths ({len(seg)} branches) and dilation_rates "
                    f"({len(rates)} branches) must have the same length"
                )
            for i, (w, r) in enumerate(zip(seg, rates)):
                if w < 1:
                    raise ValueError(f"segment_lengths[{i}] = {w} must be >= 1")
                if r < 1:
                    raise ValueError(f"dilation_rates[{i}] = {r} must be >= 1")
                # NOTE: sizes reach the custom ops as int64; any w >= N is one segment anyway.
                for name, x in (("segment_lengths", w), ("dilation_rates", r)):
                    if x > _INT64_MAX:
                        raise ValueError(f"{name}[{i}] = {x} is larger than an int64 ({_INT64_MAX})")
                if w % r:
                    raise ValueError(
                        f"segment_lengths[{i}] = {w} is not a multiple of dilation_rates[{i}] = {r}"
                    )
            if len(set(zip(seg, rates))) != len(seg):
                raise ValueError(f"branches repeat: segment_lengths={seg}, dilation_rates={rates}")
            if 1 not in rates:
                # Head j's lattice in every branch holds position j; position j + 1 lies on no
                # lattice unless some branch has rate 1.
                raise ValueError(
                    f"dilation_rates={rates} has no rate 1: for each head, positions off every "
                    "branch's lattice would attend to nothing. Add a branch with rate 1."
                )
            if len(seg) > MAX_BRANCHES:
                raise ValueError(f"at most {MAX_BRANCHES} branches are supported, got {len(seg)}")
        timeout = self.timeout
        if isinstance(timeout, datetime.timedelta):
            timeout = timeout.total_seconds()
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout < _MAX_TIMEOUT:
            raise ValueError(
                f"timeout must be a positive, finite number of seconds below {_MAX_TIMEOUT:.0e}, got {self.timeout!r}"
            )
        object.__setattr__(self, "timeout", float(timeout))
        if self.sharding not in ("replicated", "sharded"):
            raise ValueError(f"sharding must be 'replicated' or 'sharded', got {self.sharding!r}")
        if self.layout not in ("contiguous", "zigzag"):
            raise ValueError(f"layout must be 'contiguous' or 'zigzag', got {self.layout!r}")
        if self.comm not in ("ring", "all_to_all", "hybrid"):
            raise ValueError(f"comm must be 'ring', 'all_to_all' or 'hybrid', got {self.comm!r}")
        if self.group is not None and _is_mesh(self.group, ndim=2):
            object.__setattr__(self, "a2a_ranks", _hybrid_mesh(self.group, self.comm, self.a2a_ranks))
        if (self.comm == "hybrid") != (self.a2a_ranks is not None):
            raise ValueError(
                f"a2a_ranks (ranks in each all-to-all group) goes with comm='hybrid' and only with it; "
                f"got comm={self.comm!r}, a2a_ranks={self.a2a_ranks!r}"
            )
        if self.a2a_ranks is not None and (not isinstance(self.a2a_ranks, int) or self.a2a_ranks < 1):
            raise ValueError(f"a2a_ranks must be a positive int, got {self.a2a_ranks!r}")
        if self.compiler not in ("inductor", "aot_eager", "eager"):
            raise ValueError(
                f"compiler must be 'inductor', 'aot_eager' or 'eager', got {self.compiler!r}"
            )
        if not isinstance(self.disable_passes, (list, tuple)) or not all(
            isinstance(name, str) for name in self.disable_passes
        ):
            raise ValueError(
                f"disable_passes must be a sequence of pass names, got {self.disable_passes!r}"
            )
        object.__setattr__(self, "disable_passes", tuple(self.disable_passes))
        if not isinstance(self.strict, bool):
            raise ValueError(f"strict must be a bool, got {self.strict!r}")
        if self.group is not None and not _is_group(self.group):
            raise ValueError(
                "group must be a ProcessGroup, a 1-D DeviceMesh, a 2-D DeviceMesh (ring, a2a) with "
                f"comm='hybrid', or None, got {type(self.group)}"
            )

    @classmethod
    def from_options(cls, options: Mapping[str, Any] | RingDilatedConfig | None) -> RingDilatedConfig:
        """Build a config from ``torch.compile(..., options={...})``.

        Args:
            options (Mapping[str, Any] or RingDilatedConfig, optional): config fields by name;
                a config is returned as it is, ``None`` gives the default config.

        Returns:
            RingDilatedConfig: the config.

        Raises:
            ValueError: a key that names no field (listing the valid ones), or a bad value.
        """
        if options is None:
            return cls()
        if isinstance(options, cls):
            return options
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(options) - names)
        if unknown:
            raise ValueError(
                f"unknown ring_dilated option(s) {unknown}; valid options are {sorted(names)}"
            )
        return cls(**options)

    def branches(self, seq_len: int) -> tuple[tuple[int, int], ...]:
        """``(w, r)`` of every branch for a sequence of ``seq_len`` tokens.

        Args:
            seq_len (int): the sequence length ``N``.

        Returns:
            tuple[tuple[int, int], ...]: the configured pairs, or ``((seq_len, 1),)`` for the
            exact config.
        """
        if self.segment_lengths is None:
            return ((seq_len, 1),)
        return tuple(zip(self.segment_lengths, self.dilation_rates))  # type: ignore[arg-type]

    @property
    def is_exact(self) -> bool:
        """Whether no branches are given: exact attention."""
        return self.segment_lengths is None


def _int_tuple(name: str, value: Sequence[int]) -> tuple[int, ...]:
    if isinstance(value, int) or not isinstance(value, Sequence):
        raise ValueError(f"{name} must be a sequence of ints, got {value!r}")
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise ValueError(f"{name} must hold ints only, got {value!r}")
    return tuple(value)


def _is_group(group: Any) -> bool:
    if dist.is_available() and isinstance(group, dist.ProcessGroup):
        return True
    return _is_mesh(group, ndim=1) or _is_mesh(group, ndim=2)


def _is_mesh(group: Any, *, ndim: int) -> bool:
    try:
        from torch.distributed.device_mesh import DeviceMesh
    except ImportError:  # pragma: no cover - distributed disabled builds
        return False
    return isinstance(group, DeviceMesh) and group.ndim == ndim


def _hybrid_mesh(mesh: Any, comm: str, a2a_ranks: int | None) -> int:
    """The all-to-all group size of a 2-D mesh given as a hybrid's group: its dims are ``(ring,
    a2a)``, each row an all-to-all group of consecutive ranks, the ring across the rows (Note
    [Heads across ranks]). Raises where the mesh is not that."""
    if comm != "hybrid":
        raise ValueError(
            f"a 2-D DeviceMesh is the (ring, a2a) mesh of comm='hybrid', got comm={comm!r}; "
            "pass a 1-D mesh (such as mesh['cp']) for a ring or an all-to-all"
        )
    size = mesh.size(1)
    if a2a_ranks is not None and a2a_ranks != size:
        raise ValueError(
            f"a2a_ranks={a2a_ranks} but the (ring, a2a) mesh's all-to-all groups hold {size} ranks; "
            "leave a2a_ranks out, the mesh's last dim sets it"
        )
    ranks = mesh.mesh.flatten().tolist()
    if ranks != list(range(ranks[0], ranks[0] + len(ranks))) or not mesh.mesh_dim_names:
        raise ValueError(
            f"comm='hybrid' takes a 2-D mesh (ring, a2a) with named dims whose rows are consecutive "
            f"ranks (the all-to-all groups), got ranks {mesh.mesh.tolist()}; a mesh of (a2a, ring) "
            "is its transpose: name the dims the other way round when you make it"
        )
    return size
