"""The collectives of an FSDP unit: one coalesced all-gather per pass, one reduce-scatter per
backward, over the segments of the unit's plan (torch FSDP2's ``_fsdp_collectives.py``).

Two layers:

* the segment collectives (:func:`all_gather_segments`, :func:`reduce_scatter_segments` and
  their several-part forms :func:`all_gather_parts`, :func:`reduce_scatter_parts`): a rank's
  chunk of each plan segment to and from the segment's place in the unsharded buffer, as one
  coalesced collective (uneven segments as separate calls; on gloo several equal segments of a
  reduce-scatter run packed, :func:`_packed_sizes`);
* one unit's request of a collective (:class:`Gather`, :class:`Reduction`), issued by
  :func:`issue_all_gather` / :func:`issue_reduce_scatter` for all the unit's flat buffers at
  once and counted in its :class:`~ragged_placement.fsdp.common.CommStats`.

c10d is called through the :mod:`ragged_placement._compat` wrappers (torch-version
differences only).
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

import ragged_placement._compat as _compat
from ragged_placement._compat import all_gather_single, reduce_scatter_single
from ragged_placement._gloo import coalesces_all_gathers, sums_by_all_to_all
from ragged_placement.fsdp.common import CommStats
from ragged_placement.planner.plan import Segment

__all__ = [
    "FixedAllGather", "FixedReduceScatter", "Gather", "Reduction", "Works", "all_gather_parts", "coalesces_requests", "all_gather_segments", "issue_all_gather",
    "issue_reduce_scatter", "reduce_scatter_parts", "reduce_scatter_segments",
]


def _coalesced(calls, group, async_op: bool):
    """Run ``calls`` (thunks issuing collectives) as one coalesced collective (one NCCL group /
    one gloo ``*_coalesced`` op); a single call runs as itself."""
    if len(calls) == 1:
        return calls[0](async_op)
    with dist._coalescing_manager(group=group, async_ops=True) as cm:
        for call in calls:
            call(True)
    if async_op:
        return cm
    cm.wait()
    return None


class Works:
    """Several in-flight collectives waited on as one (``wait`` waits for all, in order)."""

    def __init__(self, works) -> None:
        self.works = [w for w in works if w is not None]

    def wait(self, timeout=None) -> bool:
        for w in self.works:
            w.wait() if timeout is None else w.wait(timeout)
        return True

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self.works)


def _rank_views(buffer: torch.Tensor, starts) -> list[torch.Tensor]:
    return [buffer[starts[r]:starts[r + 1]] for r in range(len(starts) - 1)]


def _all_gather_uneven(output: torch.Tensor, input: torch.Tensor, starts, group, async_op: bool):
    """Gather rank ``r``'s ``input`` (``starts[r+1] - starts[r]`` elements) into
    ``output[starts[r]:starts[r+1]]``, zero-copy on the receiving side.

    NCCL runs torch's ``all_gather`` into a list of uneven views as one group of broadcasts. Gloo
    rejects uneven ``all_gather`` and torch's coalescing manager drops gloo broadcasts without an
    error (torch 2.13), so gloo gets one async broadcast per rank that holds elements."""
    views = _rank_views(output, starts)
    if dist.get_backend(group) != "gloo":
        return dist.all_gather(views, input, group=group, async_op=async_op)
    rank = dist.get_rank(group)
    views[rank].copy_(input)
    works = [
        dist.broadcast(v, src=dist.get_global_rank(group, r) if group is not None else r,
                       group=group, async_op=True)
        for r, v in enumerate(views) if v.numel()
    ]
    out = Works(works)
    if async_op:
        return out
    out.wait()
    return None


def _segment_calls(segments, world_size, group, gather_call, uneven_call):
    """One thunk per segment; uneven segments (``rank_starts``) are issued apart, since the
    coalescing manager takes only equal collectives on every backend."""
    equal = [gather_call(s) for s in segments if s.rank_starts is None]
    uneven = [uneven_call(s) for s in segments if s.rank_starts is not None]
    return equal, uneven


def _run(equal, uneven, group, async_op: bool):
    if not uneven:
        return _coalesced(equal, group, async_op)
    works = [_coalesced(equal, group, True)] if equal else []
    works += [call(True) for call in uneven]
    out = Works(works)
    if async_op:
        return out
    out.wait()
    return None


def _run_parts(calls, group, async_op: bool, custom: bool = False, coalesce: bool = True):
    """Run every part's ``(equal, uneven)`` calls as one collective (:func:`_run`); calls of a
    user's collective (``custom``: it may not be c10d's), or all calls where not ``coalesce``,
    one after the other, uncoalesced."""
    equal = [call for part_equal, _ in calls for call in part_equal]
    uneven = [call for _, part_uneven in calls for call in part_uneven]
    if custom and uneven:
        raise ValueError(
            "a custom all-gather / reduce-scatter (FSDPModule.set_custom_all_gather / "
            "set_custom_reduce_scatter) moves equal chunks; this unit has uneven ones"
        )
    if custom or not coalesce:
        works = Works([call(True) for call in equal + uneven])
        if async_op:
            return works
        works.wait()
        return None
    return _run(equal, uneven, group, async_op)


def _packed_sizes(segments, group) -> list[int] | None:
    """Per-segment chunk sizes when a reduce-scatter of ``segments`` runs packed, else ``None``.

    gloo runs a coalesced reduce-scatter through staging of its own, at 2.2-2.3x the time of one
    reduce-scatter of the same bytes for a GPT block's three segments (packed: 1.08-1.17x);
    separate async calls are no faster, while packing an all-gather only adds its copy-out
    (``benchmarks/collectives.py``, table in ``docs/fsdp.md``). There several equal segments
    that tile the chunk in order are reduce-scattered as one collective from a rank-major
    staging buffer that FSDP2's copy-in op fills (``torch._chunk_cat``, counted by
    :class:`~ragged_placement.testing.profiling.LayoutCopyMeter`). NCCL groups coalesced calls
    without copies: segments stay zero-copy there, and all-gathers everywhere."""
    if len(segments) < 2 or any(s.rank_starts is not None for s in segments):
        return None
    if dist.get_backend(group) != "gloo":
        return None
    offset = 0
    for s in segments:
        if s.chunk_offset != offset:
            return None
        offset += s.chunk_numel
    return [s.chunk_numel for s in segments]


def _reduce_scatter_packed(output, inputs, sizes, world_size, op, group):
    """A thunk reduce-scattering ``inputs`` (segments tiling ``output`` in order, chunk
    ``sizes``) as one collective from a rank-major staging buffer, filled here."""
    staging = inputs[0].new_empty(world_size, sum(sizes))
    torch._chunk_cat(list(inputs), dim=0, num_chunks=world_size, out=staging)
    # gloo's work holds ``staging`` until the collective completes
    return lambda a: reduce_scatter_single(output[:sum(sizes)], staging.view(-1), op=op,
                                           group=group, async_op=a)


def _gather_calls(output, input, segments, world_size, rank, group, as_bytes: bool,
                  gather=all_gather_single):
    """The calls gathering one part: equal segments' (coalescable; of byte views of the
    segments where ``as_bytes``; through ``gather``) and uneven ones'."""

    def equal(s):
        out = output[s.buffer_offset:s.buffer_offset + world_size * s.chunk_numel]
        inp = input[s.chunk_offset:s.chunk_offset + s.chunk_numel]
        if as_bytes:
            out, inp = out.view(torch.uint8), inp.view(torch.uint8)
        return lambda a: gather(out, inp, group=group, async_op=a)

    def uneven(s):
        lo, hi = s.rank_starts[rank], s.rank_starts[rank + 1]
        return lambda a: _all_gather_uneven(
            output[s.buffer_offset:s.buffer_offset + s.rank_starts[-1]],
            input[s.chunk_offset:s.chunk_offset + hi - lo], s.rank_starts, group, a)

    return _segment_calls(segments, world_size, group, equal, uneven)


def all_gather_parts(parts, world_size: int, group=None, async_op: bool = False, gather=None):
    """All-gather several parts, each an ``(output, input, segments)`` triple as the arguments
    of :func:`all_gather_segments` (the parts may differ in dtype), as one coalesced collective
    over ``group``: every part's equal segments in one coalescing manager (one NCCL group, one
    gloo ``allgather_into_tensor_coalesced_``), uneven segments as separate calls.

    Parts of several dtypes are gathered as byte views (exact, zero-copy: an all-gather only
    moves bytes): gloo's coalesced all-gather corrupts tensors of mixed element sizes unless
    the largest comes first (torch 2.13: an fp32 part before a float64 or after a bf16 one).
    ``gather``: a user's all-gather (FSDP2's ``AllGather``: ``gather(output, input, group=,
    async_op=)``) called per equal segment on its typed views, in place of c10d's."""
    rank = dist.get_rank(group)
    as_bytes = gather is None and len({input.dtype for _, input, _ in parts}) > 1
    calls = [_gather_calls(output, input, segments, world_size, rank, group, as_bytes,
                           gather or all_gather_single)
             for output, input, segments in parts]
    return _run_parts(calls, group, async_op, custom=gather is not None,
                      coalesce=coalesces_all_gathers(group, parts[0][0].device))


def all_gather_segments(output: torch.Tensor, input: torch.Tensor, segments, world_size: int,
                        group=None, async_op: bool = False):
    """All-gather each segment of ``input`` (a rank's chunk: segment ``k`` at
    ``[chunk_offset, chunk_offset + chunk_numel)``) into its place in ``output`` (segment ``k`` at
    ``[buffer_offset, buffer_offset + world_size * chunk_numel)``), as one coalesced collective.

    An uneven segment (``rank_starts`` set) takes rank ``r``'s first
    ``rank_starts[r+1] - rank_starts[r]`` chunk elements into ``output[buffer_offset +
    rank_starts[r]:...]`` with an uneven all-gather (see :func:`_all_gather_uneven`)."""
    return all_gather_parts([(output, input, segments)], world_size, group, async_op)


def _check_reduce_inputs(inputs, segments, world_size: int) -> None:
    """``ValueError`` unless ``inputs`` hold each segment's unsharded buffer (before any
    collective is issued)."""
    sizes = [x.numel() for x in inputs]
    want = [s.rank_starts[-1] if s.rank_starts is not None else world_size * s.chunk_numel
            for s in segments]
    if sizes != want:
        raise ValueError(
            f"inputs must hold world_size * chunk_numel elements per segment (rank_starts[-1] "
            f"for an uneven one): {want}, got {sizes}"
        )


def _reduce_calls(output, inputs, segments, world_size, op, rank, group,
                  scatter=reduce_scatter_single):
    """The calls reduce-scattering one part: one packed call where :func:`_packed_sizes` says
    so (not through a user's ``scatter``), else equal segments' (coalescable) and uneven ones'."""
    packed = _packed_sizes(segments, group) if scatter is reduce_scatter_single else None
    if packed is not None:
        return [_reduce_scatter_packed(output, inputs, packed, world_size, op, group)], []
    by_segment = dict(zip(map(id, segments), inputs))

    def equal(s):
        return lambda a: scatter(
            output[s.chunk_offset:s.chunk_offset + s.chunk_numel], by_segment[id(s)], op=op,
            group=group, async_op=a)

    def uneven(s):
        lo, hi = s.rank_starts[rank], s.rank_starts[rank + 1]
        return lambda a: dist.reduce_scatter(
            output[s.chunk_offset:s.chunk_offset + hi - lo],
            _rank_views(by_segment[id(s)], s.rank_starts), op=op, group=group, async_op=a)

    return _segment_calls(segments, world_size, group, equal, uneven)


def reduce_scatter_parts(parts, world_size: int, op=dist.ReduceOp.SUM, group=None,
                         async_op: bool = False, scatter=None):
    """Reduce-scatter several parts, each an ``(output, inputs, segments)`` triple as the
    arguments of :func:`reduce_scatter_segments` (the parts may differ in dtype), as one
    coalesced collective over ``group``: every part's equal calls (a part packed on gloo is one
    of them) in one coalescing manager, uneven segments as separate calls. ``scatter``: a
    user's reduce-scatter (FSDP2's ``ReduceScatter``: ``scatter(output, input, group=, op=,
    async_op=)``) called per equal segment, in place of c10d's."""
    parts = [(output, list(inputs), segments) for output, inputs, segments in parts]
    for _, inputs, segments in parts:
        _check_reduce_inputs(inputs, segments, world_size)
    rank = dist.get_rank(group)
    calls = [_reduce_calls(output, inputs, segments, world_size, op, rank, group,
                           scatter or reduce_scatter_single)
             for output, inputs, segments in parts]
    return _run_parts(calls, group, async_op, custom=scatter is not None,
                      coalesce=not sums_by_all_to_all(op, group))


def reduce_scatter_segments(output: torch.Tensor, inputs, segments, world_size: int,
                            op=dist.ReduceOp.SUM, group=None, async_op: bool = False):
    """The inverse of :func:`all_gather_segments`: reduce each segment's unsharded buffer
    (``inputs[k]``, ``world_size * chunk_numel`` elements, or ``rank_starts[-1]`` for an uneven
    segment) and keep this rank's chunk of it in ``output`` (segment ``k`` at ``chunk_offset``),
    as one coalesced collective (uneven segments: torch's list ``reduce_scatter``, which NCCL runs
    as one group of reduces; on gloo several equal segments run packed, :func:`_packed_sizes`)."""
    return reduce_scatter_parts([(output, inputs, segments)], world_size, op, group, async_op)


@dataclass(frozen=True)
class Gather:
    """One flat buffer's share of a unit's all-gather
    (:meth:`~ragged_placement.fsdp.buffer.FlatBuffer.prepare_unshard`): this rank's ``input``
    gathered into ``output`` by ``segments`` over ``group`` of ``world_size`` ranks (the
    post-forward group where ``post_forward``)."""

    output: torch.Tensor
    input: torch.Tensor
    segments: Sequence[Segment]
    world_size: int
    group: object
    post_forward: bool


@dataclass(frozen=True)
class Reduction:
    """One flat buffer's share of a unit's reduce-scatter
    (:meth:`~ragged_placement.fsdp.grads.FlatGrads.prepare_reduce`): ``inputs`` (one per
    segment) summed over ``group`` of ``world_size`` ranks into ``output``. ``output`` is
    ``None`` for a reduction that issues nothing here (a ``state_sharding`` with unsharded
    parameters: :mod:`ragged_placement.fsdp.nested` reduces ``inputs`` later)."""

    output: torch.Tensor | None
    inputs: list[torch.Tensor]
    segments: Sequence[Segment]
    world_size: int
    group: object


def _one_group(requests: list) -> tuple[object, int]:
    """The group and world size ``requests`` share (the buffers of one unit share its mesh)."""
    group, world_size = requests[0].group, requests[0].world_size
    if any(r.group is not group or r.world_size != world_size for r in requests):
        raise RuntimeError(
            "buffers coalesced into one collective must share its process group: got "
            f"{[(r.group, r.world_size) for r in requests]}"
        )
    return group, world_size


def _segment_runs(segments: Sequence[Segment]) -> list[tuple[int, int, int]]:
    """Over one rank: ``(chunk_offset, buffer_offset, numel)`` of each segment, where the
    gathered buffer holds the chunk's elements."""
    return [(s.chunk_offset, s.buffer_offset,
             s.rank_starts[-1] if s.rank_starts is not None else s.chunk_numel)
            for s in segments]


def _copy_unless_same(dst: torch.Tensor, src: torch.Tensor) -> None:
    if dst.data_ptr() != src.data_ptr():
        dst.copy_(src)


def _gather_locally(gathers: list[Gather]) -> Works:
    """An all-gather over one rank: each input copied to its place in the output, unless it is
    there already (the sharded chunk viewed as the unsharded buffer); no collective."""
    for g in gathers:
        for chunk_at, buffer_at, n in _segment_runs(g.segments):
            _copy_unless_same(g.output[buffer_at:buffer_at + n], g.input[chunk_at:chunk_at + n])
    return Works([])


def _reduce_locally(reductions: list[Reduction]) -> Works:
    """A reduce-scatter over one rank: each segment's input is its sum, copied to its place in
    the output unless it is the output itself; no collective."""
    for r in reductions:
        for (chunk_at, _, n), x in zip(_segment_runs(r.segments), r.inputs):
            _copy_unless_same(r.output[chunk_at:chunk_at + n], x)
    return Works([])


# (id(group), device type, all-gathers) -> (a weak reference to the group, whether a unit's equal
# segments run as one coalesced c10d call over it; a group's backend never changes)
_COALESCES: dict[tuple[int, str, bool], tuple[weakref.ref, bool]] = {}


def coalesces_requests(requests: list, group, *, all_gathers: bool) -> bool:
    """Whether ``requests`` (one unit's :class:`Gather` or :class:`Reduction` shares, over
    ``group``) are equal segments that the backend runs as one coalesced collective: then
    :func:`issue_all_gather` / :func:`issue_reduce_scatter` call c10d's coalesced collective
    directly (what :func:`all_gather_parts` / :func:`reduce_scatter_parts` issue for them, less
    the coalescing manager's per-call Python). Not for uneven segments, nor on gloo's
    reduce-scatter sums (all-to-alls, packed), nor for all-gathers of CUDA tensors on gloo."""
    if group is None or any(s.rank_starts is not None for r in requests for s in r.segments):
        return False
    device = (requests[0].output if all_gathers else requests[0].inputs[0]).device
    key = (id(group), device.type, all_gathers)
    cached = _COALESCES.get(key)
    if cached is None or cached[0]() is not group:
        if all_gathers:
            ok = coalesces_all_gathers(group, device)
        else:
            ok = not sums_by_all_to_all(dist.ReduceOp.SUM, group)
        cached = _COALESCES[key] = (weakref.ref(group), ok)
    return cached[1]


def issue_all_gather(gathers: list[Gather], stats: CommStats, gather=None):
    """Issue ``gathers`` (the flat buffers of one unit) as one coalesced all-gather (or through
    a user's ``gather``, see :func:`all_gather_parts`), counted once in ``stats`` (bytes: all
    outputs); returns its work. Over one rank nothing is issued nor counted: the inputs are
    copied into the outputs where they are not views of them already."""
    group, world_size = _one_group(gathers)
    if world_size == 1 and gather is None:
        return _gather_locally(gathers)
    nbytes = sum(g.output.numel() * g.output.element_size() for g in gathers)
    stats.all_gathers += 1
    stats.all_gather_bytes += nbytes
    if any(g.post_forward for g in gathers):
        stats.post_forward_all_gathers += 1
        stats.post_forward_all_gather_bytes += nbytes
    if gather is None and coalesces_requests(gathers, group, all_gathers=True):
        return _issue_views(*_all_gather_views(gathers, [g.input for g in gathers]), group)
    return all_gather_parts(
        [(g.output, g.input, g.segments) for g in gathers], world_size, group=group,
        async_op=True, gather=gather,
    )


def _issue_views(outputs: list[torch.Tensor], inputs: list[torch.Tensor], group):
    """The async all-gather of :func:`_all_gather_views`' tensors: one c10d call."""
    if len(outputs) == 1:
        return all_gather_single(outputs[0], inputs[0], group=group, async_op=True)
    return _compat.all_gather_coalesced(outputs, inputs, group, async_op=True)


def _all_gather_views(gathers: list[Gather], inputs: list[torch.Tensor]):
    """The c10d output and input tensors of ``gathers`` (one unit's equal segments) sending
    ``inputs`` (one per gather): each segment's place in the output and its run of the input,
    as bytes where the buffers' dtypes differ (one coalesced call takes one dtype per part)."""
    outputs, parts = [], []
    world_size = gathers[0].world_size
    as_bytes = len({x.dtype for x in inputs}) > 1
    for g, x in zip(gathers, inputs):
        for s in g.segments:
            out = g.output[s.buffer_offset:s.buffer_offset + world_size * s.chunk_numel]
            inp = x[s.chunk_offset:s.chunk_offset + s.chunk_numel]
            if as_bytes:
                out, inp = out.view(torch.uint8), inp.view(torch.uint8)
            outputs.append(out)
            parts.append(inp)
    return outputs, parts


class FixedAllGather:
    """One unit's all-gather on the common path, its c10d views built once.

    The common path: every flat buffer sends its sharded chunk, as it is or cast to
    ``param_dtype`` (no CPU-offload staging, no FP8 packing, no post-forward group, no custom
    all-gather), over more than one rank, in equal segments the backend runs as one coalesced
    collective (:func:`coalesces_requests`). The gathered buffers keep their tensor objects
    while their storage is resized, so the output views (and, where no buffer casts, the input
    views of the chunks) stay valid across unshards: an unshard is then each buffer's storage
    allocation, the casts, and one c10d call, counted in ``stats`` as
    :func:`issue_all_gather` counts it. Valid while the buffers keep their chunks and gathers:
    the unit builds a new one after a move or cast.

    Args:
        gathers: the unit's first :class:`Gather` of each buffer, from which the views are
            built (the output tensors, segments, group).
        chunks: each buffer's sharded chunk; where a gather's input is not the chunk itself,
            it is the chunk's cast to the input's dtype, made again at every unshard.
        allocate: each buffer's storage allocation of its gathered buffer.
    """

    __slots__ = ("group", "nbytes", "_allocate", "_gathers", "_sends", "_outputs", "_inputs")

    def __init__(self, gathers: list[Gather], chunks: list[torch.Tensor], allocate) -> None:
        self.group = gathers[0].group
        self.nbytes = sum(g.output.numel() * g.output.element_size() for g in gathers)
        self._allocate = list(allocate)
        self._gathers = gathers
        # per gather: the dtype its chunk is cast to before sending (None: sent as it is)
        self._sends = [(c, None if g.input is c else g.input.dtype)
                       for g, c in zip(gathers, chunks)]
        self._outputs, inputs = _all_gather_views(gathers, [g.input for g in gathers])
        self._inputs = inputs if all(d is None for _, d in self._sends) else None

    @staticmethod
    def applies(gathers: list[Gather], group) -> bool:
        """Whether ``gathers`` (one unit's, none over a post-forward group) take the common
        path: more than one rank, equal segments the backend coalesces."""
        return (gathers[0].world_size > 1 and not any(g.post_forward for g in gathers)
                and coalesces_requests(gathers, group, all_gathers=True))

    def issue(self, stats: CommStats):
        """Allocate the gathered buffers and issue the all-gather (async); returns its work
        and the cast send buffers to keep alive until it is waited on (``None``: the chunks
        themselves)."""
        for allocate in self._allocate:
            allocate()
        inputs, sends = self._inputs, None
        if inputs is None:
            sends = [c if d is None else c.to(d) for c, d in self._sends]
            inputs = _all_gather_views(self._gathers, sends)[1]
        stats.all_gathers += 1
        stats.all_gather_bytes += self.nbytes
        return _issue_views(self._outputs, inputs, self.group), sends


class FixedReduceScatter:
    """One unit's reduce-scatter on the steady state, its c10d views built once.

    Built from the first issue of ``reductions`` on the coalescing path of
    :func:`issue_reduce_scatter` (more than one rank, equal segments, c10d's own reduce-scatter),
    and reissued while the unit hands over the same :class:`Reduction` objects: each flat
    buffer's steady reduction (:meth:`~ragged_placement.fsdp.grads.FlatGrads.prepare_reduce`:
    its kept gradient buffers into its spare flat gradient, tensors whose storage is resized
    but which stay the same objects) and the agreement's part where every parameter was used.
    An issue is then one c10d call, counted in ``stats`` as :func:`issue_reduce_scatter`
    counts it.

    Args:
        reductions: the unit's reductions, issued once through :func:`issue_reduce_scatter`.
    """

    __slots__ = ("_inputs", "_outputs", "_reductions", "group", "nbytes")

    def __init__(self, reductions: list[Reduction]) -> None:
        self.group = reductions[0].group
        self._reductions = tuple(reductions)
        self.nbytes = sum(g.numel() * g.element_size() for r in reductions for g in r.inputs)
        # per part: its reduction and the run of the output it writes. The output views are
        # made at each issue, not kept: a kept view would reference the spare flat gradient,
        # which FlatGrads hands out again only where nothing else references it
        self._outputs = [(r, s.chunk_offset, s.chunk_offset + s.chunk_numel)
                         for r in reductions for s in r.segments]
        self._inputs = [x for r in reductions for x in r.inputs]

    @staticmethod
    def of(reductions: list[Reduction]) -> FixedReduceScatter | None:
        """The fixed reduce-scatter of ``reductions``, where :func:`issue_reduce_scatter` issues
        them as one coalesced c10d call of more than one part (else ``None``)."""
        group, world_size = _one_group(reductions)
        if world_size == 1 or sum(len(r.inputs) for r in reductions) < 2:
            return None
        if not coalesces_requests(reductions, group, all_gathers=False):
            return None
        return FixedReduceScatter(reductions)

    def matches(self, reductions: list[Reduction]) -> bool:
        """Whether ``reductions`` are the objects this was built from."""
        built = self._reductions
        return len(reductions) == len(built) and all(a is b for a, b in zip(reductions, built))

    def issue(self, stats: CommStats):
        """Issue the reduce-scatter (a sum, async); returns its work."""
        stats.reduce_scatters += 1
        stats.reduce_scatter_bytes += self.nbytes
        outputs = [r.output[lo:hi] for r, lo, hi in self._outputs]
        return _compat.reduce_scatter_coalesced(outputs, self._inputs, dist.ReduceOp.SUM,
                                                self.group, async_op=True)


def issue_reduce_scatter(reductions: list[Reduction], stats: CommStats, scatter=None):
    """Issue ``reductions`` (the flat buffers of one unit) as one coalesced reduce-scatter (a
    sum; or through a user's ``scatter``, see :func:`reduce_scatter_parts`), counted once in
    ``stats`` (bytes: all inputs); returns its work. Over one rank nothing is issued nor
    counted (as :func:`issue_all_gather`)."""
    group, world_size = _one_group(reductions)
    if world_size == 1 and scatter is None:
        return _reduce_locally(reductions)
    stats.reduce_scatters += 1
    stats.reduce_scatter_bytes += sum(
        g.numel() * g.element_size() for r in reductions for g in r.inputs
    )
    if scatter is None and coalesces_requests(reductions, group, all_gathers=False):
        outputs, inputs = [], []
        for r in reductions:
            _check_reduce_inputs(r.inputs, r.segments, world_size)
            for s, x in zip(r.segments, r.inputs):
                outputs.append(r.output[s.chunk_offset:s.chunk_offset + s.chunk_numel])
                inputs.append(x)
        if len(outputs) == 1:
            return reduce_scatter_single(outputs[0], inputs[0], op=dist.ReduceOp.SUM,
                                         group=group, async_op=True)
        return _compat.reduce_scatter_coalesced(outputs, inputs, dist.ReduceOp.SUM, group,
                                                async_op=True)
    return reduce_scatter_parts(
        [(r.output, r.inputs, r.segments) for r in reductions], world_size,
        op=dist.ReduceOp.SUM, group=group, async_op=True, scatter=scatter,
    )
