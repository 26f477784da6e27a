"""FP8 all-gather of RaggedShard-sharded weights: local quantization, one collective, bitwise."""

from __future__ import annotations

import itertools

import pytest
import torch
from common.quant import PARAMS, WORLD, S
from dist_utils import run_gloo, run_threaded
from hypothesis import given, settings
from hypothesis import strategies as st
from ragged_placement.planner import Granularity, plan

from ragged_placement._compat import all_gather_single
from ragged_placement.placement import RaggedShard
from ragged_placement.quant import FlatParam, FP8GatherLayout, quantize_blockwise, quantize_run

FP8 = torch.float8_e4m3fn


def full_params(seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    # per-row magnitudes spanning 1e-3..1e3 so each block gets its own scale
    return [
        torch.randn(p.shape, generator=g)
        * (torch.logspace(-3, 3, p.shape[0])[:, None] if p.quantize else 1)
        for p in PARAMS
    ]


def flat_buffer(params: list[torch.Tensor]) -> torch.Tensor:
    flat = torch.zeros(S * WORLD)
    for spec, t in zip(PARAMS, params):
        flat[spec.offset : spec.offset + spec.numel] = t.reshape(-1)
    return flat


def gather_unit(rank: int, world_size: int) -> dict:
    """One rank: quantize own blocks into the send buffer, one all-gather, unpack."""
    layout = FP8GatherLayout(PARAMS, S, world_size)
    local = flat_buffer(full_params())[rank * S : (rank + 1) * S].clone()  # this rank's shard only
    send = layout.pack(rank, local)
    gathered = torch.empty(layout.gathered_nbytes, dtype=torch.uint8)
    all_gather_single(gathered, send)
    out = layout.unpack(gathered)
    return {
        "out": [
            (o[0].view(torch.uint8).clone(), o[1].clone()) if isinstance(o, tuple) else o.clone()
            for o in out
        ],
        "send_nbytes": send.numel(),
        "gathered_nbytes": gathered.numel(),
    }


def check_gathered(results: list[dict]) -> None:
    layout = FP8GatherLayout(PARAMS, S, WORLD)
    full = full_params()
    for res in results:
        assert res["gathered_nbytes"] == WORLD * res["send_nbytes"] == layout.gathered_nbytes
        for spec, t, got in zip(PARAMS, full, res["out"]):
            if spec.quantize:
                q_ref, s_ref = quantize_blockwise(t)  # single device, full weight
                assert torch.equal(got[0], q_ref.view(torch.uint8)), spec.name
                assert torch.equal(got[1], s_ref), spec.name
            else:
                assert torch.equal(got, t.to(torch.bfloat16)), spec.name


def test_layout_byte_accounting():
    layout = FP8GatherLayout(PARAMS, S, WORLD)
    assert layout.fp8_nbytes == 384 * 256 + 200 * 256 + 384 * 128  # one byte per weight element
    assert layout.scale_nbytes == 4 * (3 * 2 + 2 * 2 + 3 * 1)  # one fp32 per 128x128 block
    assert layout.raw_nbytes == 2 * (256 + 300)
    assert (
        layout.gathered_nbytes
        == layout.fp8_nbytes + layout.scale_nbytes + layout.raw_nbytes + layout.padding_nbytes
    )
    # ranks 0 and 1 send a full chunk of FP8 (S bytes) plus their scales, 16-byte aligned
    assert layout.rank_nbytes[0] == 16 + S and layout.send_nbytes == 16 + S
    # vs a bf16 all-gather of the same flat buffer: 2 bytes per element of every chunk
    assert layout.gathered_nbytes / (2 * S * WORLD) < 0.51


def test_threaded_fp8_all_gather_is_bitwise_single_device_quantization():
    check_gathered(run_threaded(gather_unit, WORLD))


@pytest.mark.multiprocess
def test_gloo_fp8_all_gather_is_bitwise_single_device_quantization():
    check_gathered(run_gloo(gather_unit, WORLD))


def quantize_ragged_runs(
    rank: int, world_size: int, units: tuple[int, ...], shape: tuple[int, int]
) -> tuple:
    """quantize_run on this rank's RaggedShard run of a weight every rank can rebuild."""
    w = torch.randn(shape, generator=torch.Generator().manual_seed(7)) * 10
    placement = RaggedShard((0,), units)
    r0, _ = placement.local_row_range(shape, rank)
    q, s = quantize_run(placement.shard_local(w, rank), r0, shape)
    return q.view(torch.uint8).clone(), s.clone()


@pytest.mark.parametrize("units", [(1, 2, 1, 0), (0, 0, 4, 0), (1, 1, 1, 1)])
def test_quantize_run_on_ragged_shard_rows_equals_full(units):
    shape = (512, 200)  # unit = 128 rows for sum(units) == 4
    results = run_threaded(quantize_ragged_runs, 4, units, shape)
    q_ref, s_ref = quantize_blockwise(
        torch.randn(shape, generator=torch.Generator().manual_seed(7)) * 10
    )
    assert torch.equal(torch.cat([q for q, _ in results]), q_ref.view(torch.uint8))
    assert torch.equal(torch.cat([s for _, s in results]), s_ref)


def test_cut_block_raises_never_a_silent_scale():
    w = torch.randn(300, 64)
    with pytest.raises(ValueError, match="cuts a \\(128, 128\\) quantization block"):
        quantize_run(w[64:192], 64, w.shape)  # starts mid-block
    with pytest.raises(ValueError, match="cuts a \\(128, 128\\) quantization block"):
        quantize_run(w[0:200], 0, w.shape)  # ends mid-block, not at the last row
    q, s = quantize_run(w[256:300], 256, w.shape)  # the ragged last block is whole: fine
    q_ref, s_ref = quantize_blockwise(w)
    assert torch.equal(q.view(torch.uint8), q_ref[256:].view(torch.uint8)) and torch.equal(
        s, s_ref[2:]
    )
    # FSDP2's Shard(0) on 4 ranks cuts a [300, 64] weight at row 75: the layout refuses it
    with pytest.raises(ValueError, match="rank 0's part of 'w'.*cuts a \\(128, 128\\)"):
        FP8GatherLayout([FlatParam("w", (300, 64), 0, True)], 75 * 64, 4)
    with pytest.raises(ValueError, match="inside a row"):
        FP8GatherLayout([FlatParam("w", (256, 64), 0, True)], 100, 256 * 64 // 100 + 1)
    with pytest.raises(ValueError, match="overlap"):
        FP8GatherLayout(
            [FlatParam("a", (128, 64), 0, True), FlatParam("b", (10,), 100, False)], 8192, 2
        )


def test_unpack_single_rank_weights_are_views_of_the_gathered_buffer():
    layout = FP8GatherLayout(PARAMS, S, WORLD)
    flat = flat_buffer(full_params())
    gathered = torch.cat([layout.pack(r, flat[r * S : (r + 1) * S]) for r in range(WORLD)])
    w3_q, w3_s = layout.unpack(gathered)[3]
    assert w3_q.untyped_storage().data_ptr() == gathered.untyped_storage().data_ptr()
    assert w3_s.untyped_storage().data_ptr() == gathered.untyped_storage().data_ptr()


@settings(max_examples=25, deadline=None)
@given(
    shapes=st.lists(
        st.one_of(
            st.tuples(st.integers(1, 400), st.integers(1, 48)),  # Linear weights (FP8)
            st.tuples(st.integers(1, 300)),  # norms / biases (bf16)
            st.tuples(st.integers(1, 4), st.integers(1, 300), st.integers(1, 48)),  # experts
        ),
        min_size=1,
        max_size=5,
    ),
    world=st.integers(1, 5),
    seed=st.integers(0, 2**16),
)
def test_planner_layouts_round_trip_bitwise(shapes, world, seed):
    """Any unit the planner lays out at 128-row granularity: pack on every rank, concatenate
    (what the all-gather does), unpack == single-device quantize_blockwise of each weight and of
    each matrix of an expert stack (cut between experts or on 128-row bands of one)."""
    named = [(f"p{i}", s) for i, s in enumerate(shapes)]
    p = plan(
        named,
        world,
        granularity=lambda n, s: (
            Granularity.block(128, 128) if len(s) >= 2 else Granularity.element()
        ),
        dtype=torch.float32,
    )
    layout = FP8GatherLayout(
        [FlatParam(n, s, p.offsets[n], len(s) >= 2) for n, s in named], p.chunk_numel, world
    )
    g = torch.Generator().manual_seed(seed)
    full = [
        torch.randn(s, generator=g) * 10.0 ** torch.randint(-3, 4, (), generator=g).item()
        for s in shapes
    ]
    flat = torch.zeros(p.chunk_numel * world)
    for (n, _), t in zip(named, full):
        flat[p.offsets[n] : p.offsets[n] + t.numel()] = t.reshape(-1)
    S = p.chunk_numel
    gathered = torch.cat([layout.pack(r, flat[r * S : (r + 1) * S].clone()) for r in range(world)])
    assert gathered.numel() == layout.gathered_nbytes == world * layout.send_nbytes
    for t, got in zip(full, layout.unpack(gathered)):
        if t.dim() >= 2:
            for matrix, q, s in zip(t.view(-1, *t.shape[-2:]), got[0].view(-1, *t.shape[-2:]),
                                    got[1].view(-1, *got[1].shape[-2:])):
                q_ref, s_ref = quantize_blockwise(matrix)
                assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
                assert torch.equal(s, s_ref)
        else:
            assert torch.equal(got, t.bfloat16())


def gather_with_nan(rank: int, world_size: int) -> str:
    """Rank 2 holds a NaN in w2: pack must not raise (the others would hang in the
    all-gather); unpack raises on every rank alike, naming the weight."""
    layout = FP8GatherLayout(PARAMS, S, world_size)
    local = flat_buffer(full_params())[rank * S : (rank + 1) * S].clone()
    if rank == 2:
        local[5] = float("nan")  # w2 row 128 (rank 2's part of w2 starts at its chunk start)
    send = layout.pack(rank, local)
    gathered = torch.empty(layout.gathered_nbytes, dtype=torch.uint8)
    all_gather_single(gathered, send)
    try:
        layout.unpack(gathered)
    except ValueError as err:
        return str(err)
    return "no error"


def test_non_finite_weight_raises_on_every_rank_after_the_gather():
    messages = run_threaded(gather_with_nan, WORLD)
    assert all("inf or NaN" in m and "'w2' (rank 2)" in m for m in messages), messages


def test_empty_parameters_round_trip():
    params = [
        FlatParam("w", (256, 16), 0, True),
        FlatParam("empty_w", (0, 16), 4096, True),
        FlatParam("empty_b", (0,), 4096, False),
    ]
    layout = FP8GatherLayout(params, 2048, 2)
    w = torch.randn(256, 16)
    gathered = torch.cat(
        [layout.pack(r, w.reshape(-1)[r * 2048 : (r + 1) * 2048]) for r in range(2)]
    )
    (q, s), (eq, es), eb = layout.unpack(gathered)
    q_ref, s_ref = quantize_blockwise(w)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8)) and torch.equal(s, s_ref)
    assert eq.shape == (0, 16) and es.shape == (0, 1) and eb.shape == (0,)


def test_uneven_rank_starts_layout_and_bad_rank_starts():
    """Uneven chunks (what an UnevenPlan cuts): rank 0 holds w1's first 2 bands, rank 1 its last
    band and w2's first, ranks 2 and 3 the rest; unpadded sends land back to back, and the
    unpacked weights are bitwise single-device quantization."""
    params = PARAMS[:3]
    starts = [0, 65536, 98304 + 32768, 149504, 149760]
    layout = FP8GatherLayout(params, 65536, WORLD, rank_starts=starts, equal=False)
    assert layout.uneven and layout.padding_nbytes < 16 * WORLD
    assert list(layout.send_starts[1:]) == list(itertools.accumulate(layout.send_sizes))
    full = full_params()[:3]
    flat = torch.zeros(starts[-1])
    for spec, t in zip(params, full):
        flat[spec.offset:spec.offset + spec.numel] = t.reshape(-1)
    gathered = torch.empty(layout.gathered_nbytes, dtype=torch.uint8)
    for r in range(WORLD):
        chunk = torch.zeros(65536)
        chunk[:starts[r + 1] - starts[r]] = flat[starts[r]:starts[r + 1]]
        gathered[layout.send_starts[r]:layout.send_starts[r + 1]] = layout.pack(r, chunk)
    for spec, t, got in zip(params, full, layout.unpack(gathered)):
        if spec.quantize:
            q_ref, s_ref = quantize_blockwise(t)
            assert torch.equal(got[0].view(torch.uint8), q_ref.view(torch.uint8)), spec.name
            assert torch.equal(got[1], s_ref), spec.name
        else:
            assert torch.equal(got, t.to(torch.bfloat16)), spec.name
    for bad in ([0, 1, 2], [0, 70000, 70001, 70002, 149760], [1, 2, 3, 4, 149760]):
        with pytest.raises(ValueError, match="rank_starts"):
            FP8GatherLayout(params, 65536, WORLD, rank_starts=bad)
