"""fully_shard's FSDP2 surface: the arguments torch FSDP2 takes, side by side with FSDP2.

Each training test runs the same small residual MLP on the same data three ways (2 threaded
ranks): one process on the concatenated batch (the reference), ours, and torch FSDP2 called with
the same arguments, with AdamW on the DTensor parameters; fp32 losses and final parameters agree
within 1e-5 over 5 steps. Bad input raises a ``ValueError`` naming the argument or module.
"""

from __future__ import annotations

import sys
import threading
from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from common.surface import (
    BATCH,
    INIT,
    LR,
    STEPS,
    TOL,
    Net,
    X,
    Y,
    assert_matches,
    mse,
    surface_net,
    surface_optimizer,
    surface_reference,
    surface_steps,
)
from common_fsdp import full, fully_shard_of, train_steps
from dist_utils import run_gloo, run_threaded
from ragged_placement.planner import Granularity
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy
from torch.distributed.fsdp import FSDPModule as TorchFSDPModule
from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMixedPrecisionPolicy
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor, Shard
from torch.testing._internal.distributed.multi_threaded_pg import ProcessLocalGroup

from ragged_placement import RaggedShard
from ragged_placement._compat import TORCH_VERSION
from ragged_placement.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

WORLD = 2


def _train(rank: int, ws: int, runtime: str, shard, after_backward=None, sgd: bool = False):
    """``STEPS`` AdamW steps on this rank's part of the batch; ``shard(m, mesh, fully_shard)``
    applies ``runtime``'s fully_shard. Returns the global losses and the full parameters."""
    m = surface_net()
    mesh = DeviceMesh("cpu", list(range(ws)))
    shard(m, mesh, fully_shard_of(runtime))
    opt = surface_optimizer(m.parameters(), sgd)
    return surface_steps(m, opt, rank, ws, after_backward), {k: full(v) for k, v in m.named_parameters()}


def _assert_matches_reference_and_fsdp2(
    shard, after_backward=None, grad_scale: float = 1.0, sgd: bool = False
) -> None:
    ref = surface_reference(grad_scale, sgd)
    for runtime in ("ours", "fsdp2"):
        for result in run_threaded(_train, WORLD, runtime, shard, after_backward, sgd):
            assert_matches(result, ref, runtime)


# -- MixedPrecisionPolicy ----------------------------------------------------------------------


def test_mixed_precision_policy_is_torchs():
    assert MixedPrecisionPolicy is TorchMixedPrecisionPolicy


def _bf16_step(rank: int, ws: int, runtime: str):
    policy = TorchMixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return _train(rank, ws, runtime, _per_block(mp_policy=policy))[0]


def test_torch_mixed_precision_policy_trains_as_in_fsdp2():
    ours = run_threaded(_bf16_step, WORLD, "ours")[0]
    theirs = run_threaded(_bf16_step, WORLD, "fsdp2")[0]
    ref = surface_reference()[0]
    assert ours == pytest.approx(theirs, abs=2e-3)
    assert ours != pytest.approx(ref, abs=1e-6)  # bf16 really ran


# -- reshard_after_forward as an int -----------------------------------------------------------


def _per_block(**kw):
    def shard(m, mesh, fs):
        for block in m.blocks:
            fs(block, mesh=mesh, **kw)
        fs(m, mesh=mesh, **{k: v for k, v in kw.items() if k != "reshard_after_forward"})

    return shard


_COUNTS: dict[int, Counter] = {}
_COUNT_LOCK = threading.Lock()


_IN_COLLECTIVE = threading.local()


def _counting(name: str, fn):
    """Count one call of ``fn`` by ``(name, group size)`` (the threaded PG implements some
    collectives through others: only the outermost call counts)."""

    def wrapped(self, *args, **kwargs):
        if getattr(_IN_COLLECTIVE, "active", False):
            return fn(self, *args, **kwargs)
        with _COUNT_LOCK:
            _COUNTS.setdefault(threading.get_ident(), Counter())[name, self.size()] += 1
        _IN_COLLECTIVE.active = True
        try:
            return fn(self, *args, **kwargs)
        finally:
            _IN_COLLECTIVE.active = False

    return wrapped


def _count_collectives(
    rank: int, ws: int, runtime: str, shard, by_group: bool
) -> dict[str, int] | dict[tuple[str, int], int]:
    m = surface_net()
    fs = fully_shard_of(runtime)
    shard(m, DeviceMesh("cpu", list(range(ws))), fs)
    F.mse_loss(m(X[0, :2]), Y[0, :2]).backward()  # warm-up: records the order for prefetching
    _COUNTS.pop(threading.get_ident(), None)
    F.mse_loss(m(X[1, :2]), Y[1, :2]).backward()
    counts = _COUNTS.get(threading.get_ident(), Counter())
    if by_group:
        return dict(counts)
    return dict(sum((Counter({name: n}) for (name, _), n in counts.items()), Counter()))


@pytest.fixture
def count_collectives(monkeypatch):
    # the single-tensor forms (equal chunks), the list forms (uneven per-rank chunks) and the
    # coalesced forms (a unit's parts: one collective, as CollectiveMeter counts it; the
    # threaded PG runs them one part after the other)
    for method, name in (
        ("all_gather_single", "all_gather"), ("allgather", "all_gather"),
        ("reduce_scatter_single", "reduce_scatter"), ("reduce_scatter", "reduce_scatter"),
        ("all_gather_single_coalesced", "all_gather"),
        ("allgather_into_tensor_coalesced", "all_gather"),
        ("reduce_scatter_single_coalesced", "reduce_scatter"),
        ("reduce_scatter_tensor_coalesced", "reduce_scatter"),
    ):
        if method in vars(ProcessLocalGroup):
            monkeypatch.setattr(
                ProcessLocalGroup, method, _counting(name, getattr(ProcessLocalGroup, method))
            )
    def count(runtime, shard, world: int = WORLD, by_group: bool = False):
        """Per rank: collectives of one step by name, or by ``(name, group size)``."""
        return run_threaded(_count_collectives, world, runtime, shard, by_group)

    return count


@pytest.mark.parametrize("value, blocks_all_gather", [(WORLD, 2), (1, 1)])
def test_reshard_after_forward_int_matches_fsdp2(value, blocks_all_gather, count_collectives):
    """``WORLD`` (the shard world size) is ``True``, ``1`` is ``False``, as FSDP2 reads them."""
    shard = _per_block(reshard_after_forward=value)
    _assert_matches_reference_and_fsdp2(shard)
    # one (single-segment) all-gather per block per pass, one for the root
    expected = {"all_gather": 1 + 3 * blocks_all_gather, "reduce_scatter": 1 + 3}
    assert count_collectives("ours", shard) == [expected] * WORLD
    assert count_collectives("fsdp2", shard) == [expected] * WORLD


def _reshard_values(rank: int, ws: int):
    mesh = DeviceMesh("cpu", list(range(ws)))
    for bad in (3, 0, 8, -2):
        with pytest.raises(ValueError, match=f"reshard_after_forward={bad} must be a factor of"):
            fully_shard(surface_net().blocks[0], mesh=mesh, reshard_after_forward=bad)
    for bad in ("yes", 2.0):
        with pytest.raises(ValueError, match="reshard_after_forward must be a bool, None or an int"):
            fully_shard(surface_net().blocks[0], mesh=mesh, reshard_after_forward=bad)
    m = surface_net()
    fully_shard(m.blocks[0], mesh=mesh, reshard_after_forward=None)
    fully_shard(m.blocks[1], mesh=mesh, reshard_after_forward=2)
    fully_shard(m.blocks[2], mesh=mesh, reshard_after_forward=2)
    fully_shard(m, mesh=mesh, reshard_after_forward=4)
    assert m.blocks[0]._fsdp_state.reshard_after_forward is True
    pf = m.blocks[1]._fsdp_state.reshard_after_forward  # groups of 2 consecutive ranks
    assert (pf.size, pf.rank, pf.factor) == (2, rank % 2, 2)
    assert torch.distributed.get_process_group_ranks(pf.group) == [rank // 2 * 2, rank // 2 * 2 + 1]
    # created once per mesh and size
    assert m.blocks[2]._fsdp_state.reshard_after_forward.group is pf.group
    # as FSDP2's: a bool, recurse may be positional
    m.set_reshard_after_forward(False, False)
    assert m._fsdp_state.reshard_after_forward is False
    assert m.blocks[1]._fsdp_state.reshard_after_forward is pf
    m.set_reshard_after_forward(False)
    assert all(b._fsdp_state.reshard_after_forward is False for b in m.blocks)
    for bad in (2, None, 1, "yes"):
        with pytest.raises(ValueError, match="reshard_after_forward should be a bool"):
            m.set_reshard_after_forward(bad)
    with pytest.raises(ValueError, match="recurse must be a bool"):
        m.set_reshard_after_forward(True, 1)
    return True


def test_reshard_after_forward_values_and_bad_values():
    """fully_shard: a divisor of the shard world size (4), a bool or None; others raise naming
    the argument. set_reshard_after_forward: a bool, as FSDP2's."""
    assert all(run_threaded(_reshard_values, 4))


def _per_block_pairs(m, mesh, fs):
    # element granularity: equal chunks on 4 ranks (row cuts would make uneven ones, which
    # gather per segment), so that the counts compare with FSDP2's one all-gather per unit
    kw = {"granularity": Granularity.element()} if fs is fully_shard else {}
    for block in m.blocks:
        fs(block, mesh=mesh, reshard_after_forward=2, **kw)
    fs(m, mesh=mesh, **kw)


def test_reshard_after_forward_2_of_4_gathers_backward_over_pairs(count_collectives):
    """On 4 ranks, ``2``: forward gathers each block over the 4 ranks, backward over its pair
    (2 consecutive ranks), as FSDP2; the root (kept from forward to backward) gathers once."""
    expected = {
        ("all_gather", 4): 1 + 3,  # the root, then each block's forward
        ("all_gather", 2): 3,  # each block's backward, within the pair
        ("reduce_scatter", 4): 1 + 3,
    }
    for runtime in ("ours", "fsdp2"):
        assert count_collectives(runtime, _per_block_pairs, 4, True) == [expected] * 4, runtime


def _train_pairs_on_gloo(rank: int, ws: int):
    """Ours and FSDP2 with ``reshard_after_forward=2`` on real gloo ranks; ours also reports,
    per step and block, the backward all-gathers over the pair and their bytes."""
    torch.set_num_threads(1)
    shard = _per_block(reshard_after_forward=2)
    pair_gathers: list[list[tuple[int, int, int, int]]] = []

    def after_backward(m):
        units = [b.fsdp_unit for b in m.blocks]
        pair_gathers.append([
            (u.stats.post_forward_all_gathers, u.stats.post_forward_all_gather_bytes,
             u.buffers[0].plan.buffer_numel * 4, len(u.buffers[0].plan.segments))
            for u in units
        ])
        for u in units:
            u.stats.reset()

    ours = _train(rank, ws, "ours", shard, after_backward)
    return ours, _train(rank, ws, "fsdp2", shard), pair_gathers


@pytest.mark.multiprocess
def test_reshard_after_forward_2_on_4_gloo_ranks_trains_as_one_process_and_fsdp2():
    ref = surface_reference()
    for ours, theirs, pair_gathers in run_gloo(_train_pairs_on_gloo, 4):
        assert_matches(ours, ref, "ours")
        assert_matches(theirs, ref, "fsdp2")
        # every step, each block gathers once over its pair in backward: its whole buffer
        assert len(pair_gathers) == STEPS
        for step in pair_gathers:
            assert [(n, nbytes) for n, nbytes, _, _ in step] == [(1, full) for *_, full, _ in step]
        # row cuts on 4 ranks: 3 segments per block, coarsened and gathered as one collective
        assert all(segments == 3 for *_, segments in pair_gathers[0])


def _tp_and_hsdp_pairs(rank: int, ws: int) -> list[tuple[list[float], list[float], int]]:
    """A small Llama on 8 ranks, tensor parallel on a (dp=4, tp=2) mesh, then HSDP on a
    (replicate=2, shard=4) one, with ``reshard_after_forward`` 2 and ``True``: per run the
    losses of 2 steps, the full parameters' sums, and block 0's backward gathers over the pair."""
    from torch.distributed.device_mesh import init_device_mesh

    from ragged_placement.models.llama import Llama, LlamaConfig
    from ragged_placement.parallelize import parallelize_llama

    torch.set_num_threads(1)
    cfg = LlamaConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, hidden_dim=64)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (2, 4, 9), generator=g)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        init = Llama(cfg).state_dict()
    out = []
    for dims, names in (((4, 2), ("dp", "tp")), ((2, 4), ("replicate", "shard"))):
        mesh = init_device_mesh("cpu", dims, mesh_dim_names=names)
        for value in (2, True):
            m = Llama(cfg)
            m.load_state_dict(init)
            if names[1] == "tp":
                parallelize_llama(m, mesh["tp"])
                dp, row = mesh["dp"], mesh["dp"].get_local_rank()
            else:
                dp, row = mesh, mesh.get_local_rank(0) * 4 + mesh.get_local_rank(1)
            for block in m.layers.values():
                fully_shard(block, mesh=dp, reshard_after_forward=value)
            fully_shard(m, mesh=dp)
            opt = torch.optim.AdamW(m.parameters(), lr=LR)
            losses = []
            for batch in tokens:
                b = batch[row % 4 : row % 4 + 1]
                logits = m(b[:, :-1])
                loss = F.cross_entropy(logits.reshape(-1, cfg.vocab_size), b[:, 1:].reshape(-1))
                loss.backward()
                opt.step()
                opt.zero_grad()
                losses.append(loss.item())
            sums = [float(p.full_tensor().sum()) for p in m.parameters()]
            out.append((losses, sums, m.layers["0"].fsdp_unit.stats.post_forward_all_gathers))
    return out


def test_reshard_after_forward_2_with_tensor_parallel_and_hsdp_trains_as_true():
    """With tensor parallel beside a 4-rank data-parallel dim, and with HSDP (the 2-D mesh
    flattened: pairs inside each replica's shard row), ``2`` trains bitwise as ``True``."""
    for tp2, tp_true, hsdp2, hsdp_true in run_threaded(_tp_and_hsdp_pairs, 8):
        for pairs, whole in ((tp2, tp_true), (hsdp2, hsdp_true)):
            assert pairs[:2] == whole[:2]
            assert (pairs[2], whole[2]) == (2, 0)  # one backward gather over the pair per step


def _held_between_forward_and_backward(rank: int, ws: int, value):
    """Per block after a forward: (bytes of its unsharded buffer, of its post-forward shard,
    whether the modules show the sharded parameters); then the backward's gathers by group."""
    m = surface_net()
    _per_block(reshard_after_forward=value)(m, DeviceMesh("cpu", list(range(ws))), fully_shard)
    blocks = [b.fsdp_unit for b in m.blocks]
    loss = F.mse_loss(m(X[0, :2]), Y[0, :2])
    held = []
    for unit in blocks:
        (flat,) = unit.buffers
        shard = flat.post_forward_shard
        held.append((
            flat.unsharded.untyped_storage().nbytes(),
            0 if shard is None else shard.untyped_storage().nbytes(),
            flat.plan.buffer_numel * 4,
        ))
    # parameters() gives the sharded ones whatever the setting (FSDP2's: the unsharded ones with
    # False); attribute reads give what the forward computes with until backward
    sharded = all(isinstance(p, DTensor) for b in m.blocks for p in b.parameters())
    sharded_attrs = all(isinstance(b.fc1.weight, DTensor) for b in m.blocks)
    for unit in blocks:
        unit.stats.reset()
    loss.backward()
    gathers = [(u.stats.all_gathers, u.stats.post_forward_all_gathers,
                u.stats.post_forward_all_gather_bytes) for u in blocks]
    # a forward no backward follows (an optimizer may step after it), then another: the
    # second gathers from the sharded parameters over all ranks, not from the stale shards
    m(X[0, :2])
    for unit in blocks:
        unit.stats.reset()
    m(X[0, :2])
    next_forward = [(u.stats.all_gathers, u.stats.post_forward_all_gathers) for u in blocks]
    return held, (sharded, sharded_attrs), gathers, next_forward


@pytest.mark.parametrize("value", [4, 2, 1])
def test_reshard_after_forward_holds_1_over_n_between_forward_and_backward(value):
    for held, sharded, gathers, next_forward in run_threaded(
        _held_between_forward_and_backward, 4, value
    ):
        assert sharded == (True, value != 1)
        for unsharded, shard, full in held:
            if value == 4:  # True: nothing held
                assert (unsharded, shard) == (0, 0)
            elif value == 1:  # False: the whole gathered buffer
                assert (unsharded, shard) == (full, 0)
            else:
                assert (unsharded, shard) == (0, full // value)
        for (gathers_, over_pair, pair_bytes), (*_, full) in zip(gathers, held):
            assert gathers_ == (0 if value == 1 else 1)
            assert (over_pair, pair_bytes) == ((1, full) if value == 2 else (0, 0))
        assert next_forward == [(1, 0)] * 3  # over all ranks (for 1 too: the kept gather is stale)


# -- fully_shard([a, b]) -------------------------------------------------------------------------


def _grouped(m, mesh, fs):
    fs([m.blocks[0], m.blocks[1]], mesh=mesh)  # one unit for two blocks
    fs(m.blocks[2], mesh=mesh)
    fs(m, mesh=mesh)


def test_list_of_modules_is_one_unit_matching_fsdp2(count_collectives):
    _assert_matches_reference_and_fsdp2(_grouped)
    # the group gathers once before its first module and once in backward, and reduces once
    expected = {"all_gather": 1 + 2 + 2, "reduce_scatter": 1 + 1 + 1}
    assert count_collectives("ours", _grouped) == [expected] * WORLD
    assert count_collectives("fsdp2", _grouped) == [expected] * WORLD


def _grouped_from_meta(rank: int, ws: int) -> list[float]:
    with torch.device("meta"):
        m = Net()
    _grouped(m, DeviceMesh("cpu", list(range(ws))), fully_shard)
    m.to_empty(device="cpu")  # moves the group's one unit once per module of the group
    m.load_state_dict(INIT)
    return train_steps(m, torch.optim.AdamW(m.parameters(), lr=LR), zip(X, Y), rank, ws, loss_fn=mse)


def test_list_of_modules_built_on_meta_matches_reference():
    ref = surface_reference()[0]
    for losses in run_threaded(_grouped_from_meta, WORLD):
        assert losses == pytest.approx(ref, abs=TOL)


class CheckpointedNet(Net):
    """``Net`` whose blocks run under non-reentrant activation checkpointing."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        h = self.inp(x)
        for block in self.blocks:
            h = checkpoint(block, h, use_reentrant=False)
        return self.head(h)


def _grouped_checkpointed(rank: int, ws: int, runtime: str) -> list[float]:
    m = CheckpointedNet()
    m.load_state_dict(INIT)
    _grouped(m, DeviceMesh("cpu", list(range(ws))), fully_shard_of(runtime))
    return train_steps(m, torch.optim.AdamW(m.parameters(), lr=LR), zip(X, Y), rank, ws, loss_fn=mse)


def test_list_of_modules_under_activation_checkpointing_matches_reference_and_fsdp2():
    ref = surface_reference()[0]
    for runtime in ("ours", "fsdp2"):
        for losses in run_threaded(_grouped_checkpointed, WORLD, runtime):
            assert losses == pytest.approx(ref, abs=TOL), runtime


class Trunk(Net):
    """``Net`` whose forward stops before the head: the loss applies the head per chunk."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return h


def _chunked_loss(m: Trunk, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    h = m(x)
    parts = [F.mse_loss(m.head(c), t, reduction="sum") for c, t in zip(h.chunk(2), y.chunk(2))]
    return sum(parts) / y.numel()


def _chunked_head(rank: int, ws: int, runtime: str | None) -> list[float]:
    m = Trunk()
    m.load_state_dict(INIT)
    if runtime is not None:
        fs = fully_shard_of(runtime)
        mesh = DeviceMesh("cpu", list(range(ws)))
        for block in m.blocks[:2]:
            fs(block, mesh=mesh)
        fs([m.blocks[2], m.head], mesh=mesh)  # the head runs after the root's forward, per chunk
        fs(m, mesh=mesh)
    opt = torch.optim.AdamW(m.parameters(), lr=LR)
    return train_steps(m, opt, zip(X, Y), rank, ws, loss_fn=_chunked_loss)


def test_list_of_modules_with_a_chunked_head_matches_reference_and_fsdp2():
    """FSDP2's motivating case for lists: ``fully_shard([norm, head])``, head called per chunk."""
    ref = _chunked_head(0, 1, None)
    runtimes = ("ours", "fsdp2") if TORCH_VERSION >= (2, 13) else ("ours",)
    for runtime in runtimes:
        for losses in run_threaded(_chunked_head, WORLD, runtime):
            assert losses == pytest.approx(ref, abs=TOL), runtime


def _group_layout(rank: int, ws: int):
    m = surface_net()
    mesh = DeviceMesh("cpu", list(range(ws)))
    matrices = {"1.*": Granularity.matrix()}
    out = fully_shard([m.blocks[0], m.blocks[1]], mesh=mesh, granularity=matrices)
    fully_shard(m, mesh=mesh)
    assert out == [m.blocks[0], m.blocks[1]]
    assert m.blocks[0]._fsdp_state is m.blocks[1]._fsdp_state
    names = [name for name, _ in m.fsdp_units()]
    assert names == ["", "blocks.0"]  # the group's unit listed once
    unit = m.blocks[0].fsdp_unit
    assert [s.fqn for s in unit.slots][:2] == ["0.norm.weight", "0.norm.bias"]
    assert {s.fqn for s in unit.slots} >= {"1.fc1.weight", "1.fc2.bias"}
    # the granularity policy sees the index-prefixed names: block 1's matrices are never cut
    assert unit.buffers[0].plan.granularities["1.fc1.weight"] == Granularity.matrix()
    assert isinstance(m.blocks[1].fc1.weight.placements[0], RaggedShard)
    return True


def test_list_of_modules_names_and_shared_state():
    assert all(run_threaded(_group_layout, WORLD))


# -- ignored_params ----------------------------------------------------------------------------


def _ignored(m) -> set[nn.Parameter]:
    return {m.blocks[1].fc1.weight, m.head.bias}


def _shard_ignoring(m, mesh, fs):
    for block in m.blocks:
        fs(block, mesh=mesh, ignored_params=_ignored(m))
    fs(m, mesh=mesh, ignored_params=_ignored(m))


def _average_ignored_grads(m) -> None:
    """What a user does for ignored parameters (FSDP2 leaves their gradients alone)."""
    for p in _ignored(m):
        assert not isinstance(p, DTensor) and p.grad is not None and not isinstance(p.grad, DTensor)
        torch.distributed.all_reduce(p.grad)
        p.grad /= torch.distributed.get_world_size()


def test_ignored_params_are_unsharded_and_unmanaged_as_in_fsdp2():
    _assert_matches_reference_and_fsdp2(_shard_ignoring, _average_ignored_grads)


def _ignored_layout(rank: int, ws: int):
    m = surface_net()
    _shard_ignoring(m, DeviceMesh("cpu", list(range(ws))), fully_shard)
    managed = {id(p) for _, u in m.fsdp_units() for p in u.sharded_params}
    assert all(id(p) not in managed for p in _ignored(m))
    assert isinstance(m.blocks[1].fc2.weight, DTensor)
    with pytest.raises(ValueError, match="ignored_params must be a set of nn.Parameters"):
        fully_shard(surface_net(), mesh=DeviceMesh("cpu", list(range(ws))), ignored_params={"head.bias"})
    return True


def test_ignored_params_stay_plain_tensors():
    assert all(run_threaded(_ignored_layout, WORLD))


# -- shard_placement_fn --------------------------------------------------------------------------


def _dim0(p: nn.Parameter) -> Shard | None:
    return Shard(0) if p.ndim >= 2 else None


def test_shard_placement_fn_shard0_matches_fsdp2():
    _assert_matches_reference_and_fsdp2(_per_block(shard_placement_fn=_dim0))


def _last_dim(p: nn.Parameter) -> Shard:
    return Shard(p.ndim - 1)


def test_shard_placement_fn_last_dim_matches_fsdp2():
    """``Shard(1)`` of every matrix (FSDP2 slices dim 1; ours may cut between elements)."""
    _assert_matches_reference_and_fsdp2(_per_block(shard_placement_fn=_last_dim))


def _placement_fn_errors(rank: int, ws: int):
    mesh = DeviceMesh("cpu", list(range(ws)))
    expected = r"Shard\(d > 0\) for parameter 'fc1.weight' and granularity=.*pass one of them"
    with pytest.raises(ValueError, match=expected):
        fully_shard(
            surface_net().blocks[0], mesh=mesh, shard_placement_fn=_last_dim,
            granularity=Granularity.row(),
        )
    with pytest.raises(ValueError, match="shard_placement_fn must be callable"):
        fully_shard(surface_net().blocks[0], mesh=mesh, shard_placement_fn=Shard(0))
    with pytest.raises(ValueError, match=r"takes None, Shard\(dim\) or FSDP2.s ShardPlacementResult"):
        fully_shard(surface_net().blocks[0], mesh=mesh, shard_placement_fn=lambda p: "rows")
    with pytest.raises(ValueError, match="cuts inside dim-0 rows"):
        fully_shard(
            surface_net().blocks[0], mesh=mesh, shard_placement_fn=lambda p: Shard(0),
            granularity=Granularity.element(),
        )
    block = surface_net().blocks[0]
    last_if_1d = lambda p: Shard(-1) if p.ndim == 1 else Shard(0)  # noqa: E731
    fully_shard(block, mesh=mesh, shard_placement_fn=last_if_1d)
    return True


def test_shard_placement_fn_bad_values_raise_naming_the_parameter():
    assert all(run_threaded(_placement_fn_errors, WORLD))


# -- FSDP2's all-gather extensions (fsdp_pre_all_gather / fsdp_post_all_gather) -----------------


class _Bf16GatherWeight(torch.Tensor):
    """A parameter type carrying FSDP2's all-gather extension: gather a bf16 copy (as in torch's
    test_fully_shard_extensions.py), which this runtime would skip."""

    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        return (self.to(torch.bfloat16),), None

    def fsdp_post_all_gather(self, outputs, metadata, param_dtype, *, out=None):
        return outputs[0].to(param_dtype), outputs


def _all_gather_extension_errors(rank: int, ws: int):
    mesh = DeviceMesh("cpu", list(range(ws)))
    net = surface_net()
    net.blocks[0].fc1.weight = nn.Parameter(net.blocks[0].fc1.weight.as_subclass(_Bf16GatherWeight))
    with pytest.raises(NotImplementedError, match=r"'fc1.weight' .*fsdp_pre_all_gather"):
        fully_shard(net.blocks[0], mesh=mesh)
    # set on a local tensor after fully_shard (FSDP2's monkey-patching idiom): the first forward
    model = fully_shard(surface_net(), mesh=mesh)
    local = model.blocks[0].fc1.weight._local_tensor
    local.fsdp_pre_all_gather = _Bf16GatherWeight.fsdp_pre_all_gather.__get__(local)
    with pytest.raises(NotImplementedError, match=r"'blocks.0.fc1.weight' .*fsdp_pre_all_gather"):
        model(X[0])
    return True


def test_all_gather_extensions_raise_instead_of_being_skipped():
    assert all(run_threaded(_all_gather_extension_errors, WORLD))


# -- offload_policy, FSDPModule, bad input -----------------------------------------------------


def _surface_checks(rank: int, ws: int):
    mesh = DeviceMesh("cpu", list(range(ws)))
    # CPUOffloadPolicy: the sharded chunk on CPU, staged through the mesh's device (see
    # tests/fsdp/test_fsdp_offload.py); pinned memory needs an accelerator, as in FSDP2
    m = fully_shard(surface_net(), mesh=mesh, offload_policy=CPUOffloadPolicy(pin_memory=False))
    assert isinstance(m, FSDPModule) and isinstance(m, TorchFSDPModule)
    assert m.fsdp_unit.buffers[0].offload_device == torch.device("cpu")
    if not torch.accelerator.is_available():
        with pytest.raises(ValueError, match="pin_memory=True needs an accelerator"):
            fully_shard(surface_net(), mesh=mesh, offload_policy=CPUOffloadPolicy())
    fully_shard(surface_net(), mesh=mesh, offload_policy=OffloadPolicy())
    with pytest.raises(ValueError, match="offload_policy must be"):
        fully_shard(surface_net(), mesh=mesh, offload_policy="cpu")
    with pytest.raises(ValueError, match="mp_policy must be"):
        fully_shard(surface_net(), mesh=mesh, mp_policy=torch.bfloat16)
    with pytest.raises(ValueError, match="non-empty list"):
        fully_shard([], mesh=mesh)
    with pytest.raises(ValueError, match="got Tensor"):
        fully_shard([surface_net(), torch.zeros(1)], mesh=mesh)
    with pytest.raises(ValueError, match="already applied to this FSDPNet"):
        fully_shard([surface_net(), m], mesh=mesh)
    return True


def test_offload_policy_fsdp_module_and_bad_arguments():
    assert all(run_threaded(_surface_checks, WORLD))


def test_fsdp_module_answers_every_method_of_torchs():
    """Every public method of torch's FSDPModule (of the installed torch) exists on ours."""
    public = [n for n, v in vars(TorchFSDPModule).items() if callable(v) and not n.startswith("_")]
    assert len(public) >= 10
    for name in public:
        assert callable(getattr(FSDPModule, name, None)), name


def _fsdp_module_methods(rank: int, ws: int):
    mesh = DeviceMesh("cpu", list(range(ws)))
    m = surface_net()
    fully_shard(m.blocks[0], mesh=mesh)
    fully_shard(m, mesh=mesh)
    m.set_is_last_backward(False)
    m.set_force_sum_reduction_for_comms(True)
    m.set_reshard_after_backward(True)
    m.set_requires_all_reduce(True)
    with pytest.raises(NotImplementedError, match=r"FSDPModule.set_symm_mem_for_comm"):
        m.set_symm_mem_for_comm()
    with pytest.raises(ValueError, match="factor must be a positive number"):
        m.set_gradient_divide_factor(0)
    with pytest.raises(ValueError, match="is_last_backward must be a bool"):
        m.set_is_last_backward(1)
    # unshard(async_op=True) returns a handle, as FSDP2
    handle = m.blocks[0].unshard(async_op=True)
    handle.wait()
    assert not isinstance(m.blocks[0].fc1.weight, DTensor)
    assert torch.equal(m.blocks[0].fc1.weight, INIT["blocks.0.fc1.weight"])
    m.blocks[0].reshard()
    assert isinstance(m.blocks[0].fc1.weight, DTensor)
    return True


def test_fsdp_module_methods_work_or_raise_not_implemented():
    assert all(run_threaded(_fsdp_module_methods, WORLD))


def _sum_gradients(m, mesh, fs):
    _per_block()(m, mesh, fs)
    for module in m.modules():
        if isinstance(module, (FSDPModule, TorchFSDPModule)):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)  # the threaded PG has no PreMulSum


def test_gradient_divide_factor_matches_fsdp2():
    """Factor 1: the summed gradients, the reference's gradients of the loss times the world."""
    _assert_matches_reference_and_fsdp2(_sum_gradients, grad_scale=WORLD, sgd=True)


def _mixed_with_torch(rank: int, ws: int):
    mesh = DeviceMesh("cpu", list(range(ws)))
    m = surface_net()
    torch_fully_shard(m.blocks[1], mesh=mesh)
    by_torch = r"submodule 'blocks\.1' \(FSDPResidualMLP\) was sharded by torch"
    with pytest.raises(ValueError, match=by_torch):
        fully_shard(m, mesh=mesh)
    with pytest.raises(ValueError, match=r"fully_shard\(ModuleList\): its submodule '1' \(FSDP"):
        fully_shard([m.inp, m.blocks], mesh=mesh)
    already = "torch.distributed.fsdp.fully_shard was already applied to this FSDPResidualMLP"
    with pytest.raises(ValueError, match=already):
        fully_shard(m.blocks[1], mesh=mesh)
    # torch's fully_shard over modules ours sharded (each on a fresh model: torch leaves a failed
    # call's state on the module). On the module itself, torch's own composable-API check
    # refuses first: ours records "fully_shard" in the module's registry, as FSDP2 does, so that
    # torch's replicate() leaves our units' parameters alone.
    ours = surface_net()
    fully_shard(ours.blocks[0], mesh=mesh)
    with pytest.raises(AssertionError, match="fully_shard has already been applied"):
        torch_fully_shard(ours.blocks[0], mesh=mesh)
    # over a root: the first parameter it reaches is ours
    reached = (
        r"torch.distributed.fsdp.fully_shard reached parameter 'weight' of LayerNorm, which "
        r"ragged_placement.fsdp.fully_shard sharded already \(as part of FSDPResidualMLP\)"
    )
    ours = surface_net()
    fully_shard(ours.blocks[0], mesh=mesh)
    with pytest.raises(ValueError, match=reached):
        torch_fully_shard(ours, mesh=mesh)
    return True


def test_mixing_with_torchs_fully_shard_raises_naming_the_module():
    assert all(run_threaded(_mixed_with_torch, WORLD))


# -- set_model_state_dict(broadcast_from_rank0=True) (gloo: needs the PG's device types) ----------


def _load_full_state_dict(rank: int, ws: int):
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    with torch.random.fork_rng():
        torch.manual_seed(1)
        source = Net().state_dict()
    out = {}
    for runtime, fs in (("ours", fully_shard), ("fsdp2", torch_fully_shard)):
        for broadcast in (True, False):
            m = surface_net()
            _per_block()(m, DeviceMesh("cpu", list(range(ws))), fs)
            sd = {k: v.clone() for k, v in source.items()} if rank == 0 or not broadcast else {}
            options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=broadcast)
            set_model_state_dict(m, sd, options=options)
            out[(runtime, broadcast)] = max(
                (full(v) - source[k]).abs().max().item() for k, v in m.state_dict().items()
            )
            if runtime == "ours":  # loaded in place: the flat buffers the next all-gather reads
                for flat in (b for _, unit in m.fsdp_units() for b in unit.buffers):
                    buffer = flat.sharded.untyped_storage().data_ptr()
                    for p in flat.sharded_params:
                        assert p.to_local().untyped_storage().data_ptr() == buffer
    return out


def _load_optimizer_state_from_rank0(rank: int, ws: int):
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    per = BATCH // ws
    out = {}
    for runtime, fs in (("ours", fully_shard), ("fsdp2", torch_fully_shard)):
        models = []
        for step in (0, 1):  # two models whose AdamW states differ after one step each
            m = surface_net()
            _per_block()(m, DeviceMesh("cpu", list(range(ws))), fs)
            opt = torch.optim.AdamW(m.parameters(), lr=LR)
            x, y = X[step, rank * per : (rank + 1) * per], Y[step, rank * per : (rank + 1) * per]
            F.mse_loss(m(x), y).backward()
            opt.step()
            models.append((m, opt))
        (m, opt), (m2, opt2) = models
        full = get_optimizer_state_dict(m, opt, options=StateDictOptions(full_state_dict=True))
        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
        set_optimizer_state_dict(m2, opt2, full if rank == 0 else {}, options=options)
        out[runtime] = max(
            float((opt.state[p][k].to_local() - opt2.state[p2][k].to_local()).abs().sum())
            for p, p2 in zip(m.parameters(), m2.parameters())
            for k in ("exp_avg", "exp_avg_sq")
        )
    return out


def _load_from_full_state_dicts(rank: int, ws: int):
    return _load_full_state_dict(rank, ws), _load_optimizer_state_from_rank0(rank, ws)


def test_set_model_and_optimizer_state_dict_full_and_broadcast_from_rank0_load_exactly():
    for model, optim in run_gloo(_load_from_full_state_dicts, WORLD):
        assert model == {(r, b): 0.0 for r in ("ours", "fsdp2") for b in (True, False)}
        assert optim == {"ours": 0.0, "fsdp2": 0.0}


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
