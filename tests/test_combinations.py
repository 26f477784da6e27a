"""The table of refused feature combinations (:mod:`ragged_placement.combinations`): every row is
refused by every entry point that can reach it (``fully_shard``, ``parallelize_moe``,
``parallelize_hf_moe``, the trainer's options), with the row's error and reason, naming the
caller's arguments before the reason and again in the fix, before any collective or process
group; and the trainer refuses a row once, before its process group."""

from __future__ import annotations

import pytest
import torch
from dist_utils import COLLECTIVES, recording_collectives, run_threaded
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy
from torch.distributed.fsdp import fully_shard as fsdp2_fully_shard
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from ragged_placement import _compat, train
from ragged_placement.combinations import REFUSED, Feature, Refusal
from ragged_placement.fsdp import DataParallelMeshDims, StateSharding, fully_shard
from ragged_placement.models.moe import MoEConfig, MoETransformer
from ragged_placement.parallelize import parallelize_hf_moe, parallelize_moe
from ragged_placement.planner import Granularity
from ragged_placement.quant import BlockFP8Config
from ragged_placement.trainer.build import new_model
from ragged_placement.trainer.config import parse_config

F = Feature
HF_MODEL = ["--model", "hf:qwen3_moe", "--experts", "4", "--layers", "2", "--width", "32",
            "--heads", "2", "--seq", "16"]

# How each entry point turns each feature it can express on: feature -> (the argument a refusal
# names, in what the call gave and in the fix; the value or flags that turn it on). A row whose
# features an entry point cannot all express is not reachable from it.
TRAINER = {
    F.TORCH_FSDP2: ("--runtime", ["--runtime", "fsdp2"]),
    F.STATE_SHARDING: ("--state-sharding", ["--state-sharding", "zero2"]),
    F.QUANT: ("--fp8", ["--fp8"]),
    F.EXPERT_PARALLEL: ("--ep", ["--ep", "2"]),
    F.MATRIX_OPTIMIZER: ("--optimizer", ["--optimizer", "muon"]),
    F.HF_EXPERTS: ("--model", HF_MODEL),
}
_FSDP_KWARGS = {  # fully_shard's keyword arguments, which parallelize_moe passes on
    F.QUANT: ("quant", BlockFP8Config()),
    F.CPU_OFFLOAD: ("offload_policy", CPUOffloadPolicy(pin_memory=False)),
    F.INT_RESHARD: ("reshard_after_forward", 2),
}
FULLY_SHARD = {  # on a 2x2 ("inter", "intra") mesh
    **_FSDP_KWARGS,
    F.STATE_SHARDING: ("state_sharding", StateSharding((), (), ("inter", "intra"))),
    F.DP_MESH_DIMS: ("dp_mesh_dims", DataParallelMeshDims and DataParallelMeshDims(
        shard="intra", replicate="inter")),  # the parameters: replicated DTensors on the mesh
    F.GRANULARITY: ("granularity", {"*": Granularity.row()}),
    F.OTHER_MESH: ("shard_placement_fn", None),  # one placing the second Linear on "intra"
}
PARALLELIZE_MOE = {  # on a ("dp_mod_ep", "ep") mesh of 2x2 ranks (expert parallelism) or 4x1
    **_FSDP_KWARGS,
    F.TORCH_FSDP2: ("shard_fn", fsdp2_fully_shard),
    F.STATE_SHARDING: ("state_sharding", StateSharding((), (), ("dp_mod_ep", "ep"))),
    F.DP_MESH_DIMS: ("dp_mesh_dims", DataParallelMeshDims and DataParallelMeshDims(
        shard="dp_mod_ep")),
    F.EXPERT_PARALLEL: ("mesh", None),  # the 2x2 mesh
}
PARALLELIZE_HF_MOE = {**PARALLELIZE_MOE, F.HF_EXPERTS: ("model", None)}
ENTRY_POINTS = {"trainer": TRAINER, "fully_shard": FULLY_SHARD,
                "parallelize_moe": PARALLELIZE_MOE, "parallelize_hf_moe": PARALLELIZE_HF_MOE}
INHERENT = {"parallelize_hf_moe": {F.HF_EXPERTS}}  # on in every call of the entry point
_NEEDS = {F.DP_MESH_DIMS: DataParallelMeshDims, F.OTHER_MESH: _compat.ShardPlacementResult}


def _reachable(entry: str) -> list[Refusal]:
    """The rows ``entry`` can express every feature of (on this torch)."""
    return [row for row in REFUSED
            if all(f in ENTRY_POINTS[entry] and _NEEDS.get(f, True) is not None
                   for f in row.features)]


def _check(row: Refusal, entry: str, error: BaseException | None) -> None:
    """``error`` is ``row``'s (or, where the entry point's own features complete an earlier
    row, that row's), naming each feature's argument before the reason and in the fix."""
    where = f"{entry}: {[f.name for f in row.features]}"
    on = {*row.features, *INHERENT.get(entry, ())}
    row = next(r for r in REFUSED if set(r.features) <= on)
    assert type(error) is row.error, (where, error)
    message = str(error)
    given, _, fix = message.partition(row.reason)
    assert fix, (where, message)  # the row's own reason, not an earlier row's
    for feature in row.features:
        name = ENTRY_POINTS[entry][feature][0]
        assert name in given and name in fix, (where, name, message)


def _replicated(model: nn.Module, mesh) -> nn.Module:
    for m in model.modules():
        for k, p in list(m._parameters.items()):
            m._parameters[k] = nn.Parameter(distribute_tensor(p.detach(), mesh, [Replicate()] * 2))
    return model


def _kwargs(row: Refusal, entry: str) -> dict:
    """The keyword arguments of ``entry`` that turn ``row``'s features on."""
    args = ENTRY_POINTS[entry]
    return {args[f][0]: args[f][1] for f in row.features if args[f][1] is not None}


def _fully_shard_call(row: Refusal, mesh):
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    kwargs = _kwargs(row, "fully_shard")
    if F.DP_MESH_DIMS in row.features:
        _replicated(model, mesh)
    if F.OTHER_MESH in row.features:
        from torch.distributed.fsdp._fully_shard._fsdp_common import FSDPMeshInfo

        info = FSDPMeshInfo(mesh=mesh["intra"], shard_mesh_dim=0)
        kwargs["shard_placement_fn"] = lambda p: (
            _compat.ShardPlacementResult(Shard(0), info)
            if any(p is q for q in model[1].parameters()) else None)
    return lambda: fully_shard(model, mesh=mesh, **kwargs)


def _ep(row: Refusal) -> int:
    return 2 if F.EXPERT_PARALLEL in row.features else 1


def _hf_model() -> nn.Module:
    with torch.device("meta"):
        return new_model(parse_config(HF_MODEL))


_MOE = MoEConfig(vocab_size=64, dim=16, n_layers=2, n_dense_layers=1, n_heads=2, hidden_dim=32,
                 moe_hidden_dim=16, num_experts=4, top_k=2)


def _library_refusals(rank: int, ws: int, hf_model: nn.Module) -> dict:
    """Each library entry point's calls of its reachable rows: the error raised, and the
    collectives and process groups issued while they ran (``hf_model``: on meta)."""
    shard_mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("inter", "intra"))
    ep_meshes = {ep: init_device_mesh("cpu", (4 // ep, ep), mesh_dim_names=("dp_mod_ep", "ep"))
                 for ep in (1, 2)}
    calls = {}
    for row in _reachable("fully_shard"):
        calls["fully_shard", row] = _fully_shard_call(row, shard_mesh)
    for row in _reachable("parallelize_moe"):
        calls["parallelize_moe", row] = lambda row=row: parallelize_moe(
            MoETransformer(_MOE), ep_meshes[_ep(row)], **_kwargs(row, "parallelize_moe"))
    for row in _reachable("parallelize_hf_moe"):
        calls["parallelize_hf_moe", row] = lambda row=row: parallelize_hf_moe(
            hf_model, ep_meshes[_ep(row)], hf_model.model.layers,
            **_kwargs(row, "parallelize_hf_moe"))
    errors = {}
    with recording_collectives((*COLLECTIVES, "new_group")) as record:
        for key, call in calls.items():
            try:
                call()
                errors[key] = None
            except (ValueError, NotImplementedError, TypeError) as e:
                errors[key] = e
    return {"errors": errors, "calls": record.calls}


def test_every_row_is_reached_and_every_feature_is_in_a_row():
    reached = {row for entry in ENTRY_POINTS for row in _reachable(entry)}
    assert reached == set(REFUSED) - {r for r in REFUSED if any(
        _NEEDS.get(f, True) is None for f in r.features)}
    assert {f for row in REFUSED for f in row.features} == set(Feature)
    assert len({row.features for row in REFUSED}) == len(REFUSED)


def test_library_entry_points_refuse_every_row_they_reach_before_any_collective():
    pytest.importorskip("transformers")
    for out in run_threaded(_library_refusals, 4, _hf_model()):
        assert out["calls"] == {}
        for (entry, row), error in out["errors"].items():
            _check(row, entry, error)
        assert {key[0] for key in out["errors"]} == {"fully_shard", "parallelize_moe",
                                                     "parallelize_hf_moe"}


@pytest.mark.parametrize("row", _reachable("trainer"), ids=lambda r: "+".join(
    f.name for f in r.features))
def test_the_trainer_refuses_every_row_it_reaches_and_each_fix_is_taken(row):
    """``parse_config`` raises the row's error; each fix of the message alone (the options
    without that feature) is accepted."""
    def argv(features) -> list[str]:
        base = [] if F.HF_EXPERTS in features else ["--model", "moe"]
        return base + [a for f in features for a in TRAINER[f][1]]

    if F.HF_EXPERTS in row.features:
        pytest.importorskip("transformers")
    with pytest.raises(row.error) as e:
        parse_config(argv(row.features))
    _check(row, "trainer", e.value)
    for dropped in row.features:
        parse_config(argv([f for f in row.features if f is not dropped]))


MUON_WITH_FSDP2_EP = ["--model", "moe", "--ep", "2", "--runtime", "fsdp2", "--optimizer", "muon",
                      "--steps", "2"]


@pytest.mark.parametrize("local_rank", ["0", "1"])
def test_a_refused_combination_ends_the_trainer_once_before_the_process_group(
        local_rank, monkeypatch, capsys):
    """Under torchrun (its environment; MASTER_PORT 1 would refuse a connection, so no process
    group is built): local rank 0 prints the row's one ``error:`` line and exits 2, the node's
    other ranks exit 0 without a word, as for any bad option. Before the table held this row,
    every rank trained until Muon met FSDP2's _StridedShard at the first step."""
    for name, value in (("RANK", local_rank), ("LOCAL_RANK", local_rank), ("WORLD_SIZE", "2"),
                        ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "1")):
        monkeypatch.setenv(name, value)
    if local_rank == "0":
        with pytest.raises(SystemExit) as e:
            train.main(MUON_WITH_FSDP2_EP)
        err = capsys.readouterr().err
        assert e.value.code == 2
        assert err.count("error: --optimizer muon with --runtime fsdp2 and --ep 2 is not "
                         "supported: torch FSDP2 lays out an expert-parallel stack as "
                         "_StridedShard") == 1, err
        assert "Traceback" not in err
    else:  # torchrun's @record turns its SystemExit(0) into a return
        assert train.main(MUON_WITH_FSDP2_EP) is None
        assert capsys.readouterr() == ("", "")
