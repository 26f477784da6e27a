"""``fully_shard``: torch FSDP2's call shape on a zero-copy, RaggedShard-placed runtime."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from functools import partial

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._composable.contract import REGISTRY_KEY, RegistryItem
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy
from torch.distributed.fsdp import FSDPModule as TorchFSDPModule
from torch.distributed.tensor import DTensor, Shard

from ragged_placement._compat import DataParallelMeshDims
from ragged_placement._install import FSDP2Hooks, install_fsdp2
from ragged_placement.combinations import Feature, Given, check_combinations
from ragged_placement.fsdp._validation import (
    OWNERS,
    check_granularity,
    check_no_all_gather_extension,
    check_no_scalar_params,
    unmatched_patterns,
    warn_on_racy_gloo_groups,
)
from ragged_placement.fsdp.common import UnitOptions
from ragged_placement.fsdp.fp8 import check_quant, convert_unit_linears, unit_gathers
from ragged_placement.fsdp.state import FSDPState
from ragged_placement.fsdp.mesh import DataParallelMesh, PostForwardMesh, UnitMesh
from ragged_placement.fsdp.module import (
    FSDPModule,
    UnshardHandle,
    _check_bool,
    register_fsdp_forward_method,
    share_comm_ctx,
)
from ragged_placement.fsdp.fsdp2_state import state_view
from ragged_placement.fsdp.nested import check_state_sharding, state_sharded_mesh
from ragged_placement.fsdp.param import (
    ParamSlot,
    check_tp_dims_disjoint,
    forward_tensors,
    mesh_device,
)
from ragged_placement.fsdp.param_meshes import split_by_mesh
from ragged_placement.fsdp.spmd import check_dp_mesh_dims, localize_spmd_params
from ragged_placement.planner.sharding import StateSharding
from ragged_placement.fsdp.unit import FSDPUnit
from ragged_placement.planner.granularity import Granularity, default_granularity, resolve_policy
from ragged_placement.quant import BlockFP8Config

__all__ = [
    "CPUOffloadPolicy",
    "FSDPModule",
    "MixedPrecisionPolicy",
    "OffloadPolicy",
    "UnshardHandle",
    "fully_shard",
    "register_fsdp_forward_method",
    "share_comm_ctx",
]


# MixedPrecisionPolicy, OffloadPolicy and CPUOffloadPolicy are torch FSDP2's own classes,
# re-exported: ``from torch.distributed.fsdp import MixedPrecisionPolicy`` and
# ``from ragged_placement.fsdp import MixedPrecisionPolicy`` give the same class (its fields,
# ``param_dtype``, ``reduce_dtype``, ``output_dtype`` and ``cast_forward_inputs``, are the same in
# torch 2.11 and 2.13).


_CLASS_LOCK = threading.Lock()
_FSDP_CLASSES: dict[type, type] = {}


def _fsdp_class(cls: type) -> type:
    with _CLASS_LOCK:
        if cls not in _FSDP_CLASSES:
            _FSDP_CLASSES[cls] = type(f"FSDP{cls.__name__}", (FSDPModule, cls), {})
        return _FSDP_CLASSES[cls]


def _default_mesh() -> DeviceMesh:
    if not dist.is_initialized():
        raise ValueError(
            "mesh=None needs an initialized default process group (dist.init_process_group)"
        )
    device_type = "cuda" if dist.get_backend() == "nccl" else "cpu"
    return init_device_mesh(device_type, (dist.get_world_size(),))


def _root_modules(modules: Sequence[nn.Module]) -> list[nn.Module]:
    """``modules`` without those nested in another of them (FSDP2 groups the roots), once each."""
    roots: list[nn.Module] = []
    for m in modules:
        if any(m is r for r in roots):
            continue
        if not any(m is not o and any(m is d for d in o.modules()) for o in modules):
            roots.append(m)
    return roots


def _check_modules(module: object) -> list[nn.Module]:
    """The modules of one unit (``module`` or the roots of a list of modules), validated."""
    modules = list(module) if isinstance(module, (list, tuple)) else [module]
    if not modules:
        raise ValueError("module must be an nn.Module or a non-empty list of nn.Modules, got []")
    for m in modules:
        if not isinstance(m, nn.Module):
            raise ValueError(
                f"module must be an nn.Module or a list of nn.Modules, got {type(m).__name__}"
            )
        if isinstance(m, FSDPModule):
            raise ValueError(f"fully_shard was already applied to this {type(m).__name__}")
        if isinstance(m, TorchFSDPModule):
            raise ValueError(
                f"torch.distributed.fsdp.fully_shard was already applied to this "
                f"{type(m).__name__}: ragged_placement's fully_shard and torch's cannot share a "
                f"module; shard the whole model with one of them"
            )
    return _root_modules(modules)


def _check_reshard_type(value: object) -> None:
    if not (value is None or isinstance(value, (bool, int))):
        raise ValueError(
            f"reshard_after_forward must be a bool, None or an int, got {value!r}"
        )


def _resolve_reshard_after_forward(value: object, shard_size: int) -> bool | int:
    """FSDP2's ``reshard_after_forward`` as a bool, or the int ``1 < N < shard_size`` of the
    groups to reshard to (see :func:`fully_shard`)."""
    _check_reshard_type(value)
    if value is None or isinstance(value, bool):
        return value is not False
    if value < 1 or value > shard_size or shard_size % value:
        raise ValueError(
            f"reshard_after_forward={value} must be a factor of the shard world size "
            f"{shard_size} (the world size to reshard to after forward)"
        )
    if value == shard_size:
        return True
    if value == 1:
        return False
    return int(value)


def _reshard_setting(value: object, unit) -> bool | PostForwardMesh:
    """What a unit's hooks take for ``reshard_after_forward`` ``value``: a bool, or the
    :class:`PostForwardMesh` of an int ``1 < N < W`` (its groups created on first use)."""
    resolved = _resolve_reshard_after_forward(value, unit.dp.shard_size)
    if isinstance(resolved, bool):
        return resolved
    return PostForwardMesh.of(unit.dp, resolved)


def _unit_mesh(
    mesh: object, sharding: StateSharding | None, dp_mesh_dims: object,
    reshard_after_forward: object,
) -> Callable[[], UnitMesh]:
    """Check the unit's mesh from ``fully_shard``'s arguments now; the returned function builds
    it (called once the unit's parameters are checked): ``sharding``'s
    (:func:`check_state_sharding`: ``None`` for none or ``mesh``'s default; collective over its
    groups the first time), else FSDP / HSDP on ``mesh`` or on the data-parallel sub-mesh
    ``dp_mesh_dims`` names."""
    _check_reshard_type(reshard_after_forward)
    if sharding is not None:
        return partial(state_sharded_mesh, sharding, mesh)
    dp = DataParallelMesh.of(
        mesh if dp_mesh_dims is None else check_dp_mesh_dims(mesh, dp_mesh_dims)
    )
    _resolve_reshard_after_forward(reshard_after_forward, dp.shard_size)
    return lambda: dp


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _features(
    *, sharding: StateSharding | None, quant: object, dp_mesh_dims: object, offload: object,
    reshard_after_forward: object, granularity: object,
) -> dict[Feature, Given]:
    """The features of :data:`ragged_placement.combinations.REFUSED` a ``fully_shard`` call
    turns on, in its arguments' words (``sharding``: the checked ``state_sharding``)."""
    features = (
        (Feature.STATE_SHARDING, sharding, f"state_sharding={sharding}",
         "drop state_sharding (None or StateSharding.default(mesh) keeps every state on the "
         "same dims)"),
        (Feature.QUANT, quant, f"quant={quant!r}", "drop quant"),
        (Feature.DP_MESH_DIMS, dp_mesh_dims, f"dp_mesh_dims={dp_mesh_dims!r}",
         "drop dp_mesh_dims (pass the data-parallel sub-mesh as mesh)"),
        (Feature.CPU_OFFLOAD, offload, f"offload_policy={offload!r}",
         "pass offload_policy=OffloadPolicy()"),
        (Feature.INT_RESHARD, _is_int(reshard_after_forward) or None,
         f"reshard_after_forward={reshard_after_forward!r}",
         "pass reshard_after_forward as a bool or None"),
        (Feature.GRANULARITY, granularity, f"granularity={granularity!r}", "drop granularity"),
    )
    return {f: Given(spelling, fix) for f, value, spelling, fix in features if value is not None}


def _check_offload_policy(offload_policy: object) -> CPUOffloadPolicy | None:
    """The ``CPUOffloadPolicy`` to honour, or ``None`` for ``OffloadPolicy()`` (no offload).

    ``pin_memory=True`` needs an accelerator (pinned host memory is allocated through its
    driver): without one torch's allocator raises ``RuntimeError``, as does FSDP2's
    ``fully_shard`` with this policy; here it is a ``ValueError`` naming the argument."""
    if not isinstance(offload_policy, OffloadPolicy):
        raise ValueError(
            f"offload_policy must be a torch.distributed.fsdp.OffloadPolicy, got {offload_policy!r}"
        )
    if not isinstance(offload_policy, CPUOffloadPolicy):
        return None
    _check_bool("offload_policy.pin_memory", offload_policy.pin_memory)
    if offload_policy.pin_memory and not torch.accelerator.is_available():
        raise ValueError(
            f"offload_policy={offload_policy!r}: pin_memory=True needs an accelerator (pinned "
            f"host memory is allocated through its driver) and none is available; pass "
            f"CPUOffloadPolicy(pin_memory=False)"
        )
    return offload_policy


def _torch_fsdp_error(root: nn.Module, path: str, child: nn.Module) -> ValueError:
    return ValueError(
        f"fully_shard({type(root).__name__}): its submodule {path!r} ({type(child).__name__}) was "
        f"sharded by torch.distributed.fsdp.fully_shard; ragged_placement's fully_shard and "
        f"torch's cannot be mixed in one model: shard every module with one of them"
    )


def _collect_params(
    modules: Sequence[nn.Module], ignored: set[int]
) -> tuple[list[ParamSlot], list[nn.Parameter], list[nn.Module]]:
    """Parameters of ``modules`` not owned by a ``fully_shard`` module below them and not in
    ``ignored`` (ids), deduplicated. With several modules, names start with the module's index
    in the list (``"1.weight"``)."""
    slots: dict[int, ParamSlot] = {}
    params: dict[int, nn.Parameter] = {}
    owned_modules: list[nn.Module] = []
    seen: set[int] = set()
    for i, module in enumerate(modules):
        base = f"{i}." if len(modules) > 1 else ""
        stack = [(base, module)]
        while stack:
            prefix, m = stack.pop()
            if id(m) in seen:
                continue
            seen.add(id(m))
            owned_modules.append(m)
            for attr, p in m._parameters.items():
                if p is None or id(p) in ignored:
                    continue
                if id(p) in slots:
                    slots[id(p)].owners.append((m, attr))
                else:
                    # A tensor-parallel DTensor is planned on its TP-local shape.
                    shape = p._local_tensor.shape if isinstance(p, DTensor) else p.shape
                    slots[id(p)] = ParamSlot(f"{prefix}{attr}", [(m, attr)], shape, p.requires_grad)
                    params[id(p)] = p
            for name, child in reversed(list(m._modules.items())):
                if child is None or isinstance(child, FSDPModule):
                    continue
                if isinstance(child, TorchFSDPModule):
                    raise _torch_fsdp_error(module, f"{prefix[len(base):]}{name}", child)
                stack.append((f"{prefix}{name}.", child))
    order = list(slots)
    return [slots[i] for i in order], [params[i] for i in order], owned_modules


def _check_ignored_params(ignored_params: object) -> set[int]:
    if ignored_params is None:
        return set()
    if not isinstance(ignored_params, (set, frozenset, list, tuple)) or not all(
        isinstance(p, nn.Parameter) for p in ignored_params
    ):
        raise ValueError(
            f"ignored_params must be a set of nn.Parameters, got {type(ignored_params).__name__}"
        )
    return {id(p) for p in ignored_params}


def _placement_policy(
    shard_placement_fn: Callable[[nn.Parameter], Shard | None] | None,
    slots: list[ParamSlot],
    params: list[nn.Parameter],
    granularity,
):
    """The planner policy of a unit given FSDP2's ``shard_placement_fn`` (see
    :func:`fully_shard`): ``granularity`` where it returns ``None`` or ``Shard(0)``; where it
    returns ``Shard(d)``, ``d > 0``, cuts between whole slices ``x[i_0, ..., i_d]`` (a
    RaggedShard over dims ``(0, ..., d)``), which spreads a stack with fewer dim-0 rows than
    ranks (MoE experts) over every rank as FSDP2's ``Shard(d)`` does."""
    if shard_placement_fn is None:
        return granularity
    if not callable(shard_placement_fn):
        raise ValueError(f"shard_placement_fn must be callable, got {shard_placement_fn!r}")
    cuts: dict[str, Granularity] = {}
    for slot, p in zip(slots, params):
        result = shard_placement_fn(p)
        if result is None:
            continue
        if type(result) is not Shard:
            raise ValueError(
                f"shard_placement_fn returned {result!r} for parameter {slot.fqn!r}: fully_shard "
                f"takes None, Shard(dim) or FSDP2's ShardPlacementResult(placement, mesh_info)"
            )
        ndim = max(len(slot.shape), 1)
        dim = result.dim + ndim if result.dim < 0 else result.dim
        if not 0 <= dim < ndim:
            raise ValueError(
                f"shard_placement_fn returned {result!r} for parameter {slot.fqn!r} of shape "
                f"{tuple(slot.shape)}: dim out of range"
            )
        if dim > 0 and isinstance(p, DTensor):
            raise ValueError(
                f"shard_placement_fn returned {result!r} for parameter {slot.fqn!r}, a DTensor "
                f"with {tuple(p.placements)} on {p.device_mesh}: the planner cuts the local "
                f"tensor of a tensor- or expert-parallel parameter between whole dim-0 rows only "
                f"(RaggedShard composes with that placement by rows), so Shard({dim}) would not "
                f"spread it as FSDP2 does. Return Shard(0) or None for it"
            )
        if dim > 0:
            cuts[slot.fqn] = Granularity.element(
                keep_dims_whole=(dim + 1,) if dim + 1 < ndim else ()
            )
            continue
        gran = resolve_policy(granularity, slot.fqn, tuple(slot.shape))
        if gran.kind == "element" and len(slot.shape) >= 2:
            raise ValueError(
                f"shard_placement_fn returned Shard(0) for parameter {slot.fqn!r}, but "
                f"granularity gives it {gran}, which cuts inside dim-0 rows: drop one of them"
            )
    if not cuts:
        return granularity
    if granularity is not None:
        name = next(iter(cuts))
        raise ValueError(
            f"shard_placement_fn returned Shard(d > 0) for parameter {name!r} and granularity="
            f"{granularity!r} is given too: both say where the planner may cut; pass one of them"
        )
    return lambda name, shape: cuts.get(name) or default_granularity(shape)


def _register_fully_shard(module: nn.Module) -> None:
    """Record ``fully_shard`` in ``module``'s composable-API registry, as FSDP2's ``@contract``
    does: torch's ``replicate()`` reads it to leave a sharded module's parameters to it (and to
    refuse replicating the module itself)."""
    registry = module.__dict__.setdefault(REGISTRY_KEY, OrderedDict())
    registry["fully_shard"] = RegistryItem()


def fully_shard(
    module: nn.Module | list[nn.Module],
    *,
    mesh: DeviceMesh | None = None,
    reshard_after_forward: bool | int | None = None,
    shard_placement_fn: Callable[[nn.Parameter], Shard | None] | None = None,
    mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy(),
    offload_policy: OffloadPolicy = OffloadPolicy(),
    ignored_params: set[nn.Parameter] | None = None,
    granularity=None,
    quant: BlockFP8Config | None = None,
    dp_mesh_dims: DataParallelMeshDims | None = None,
    state_sharding: StateSharding | None = None,
) -> nn.Module | list[nn.Module]:
    """Shard ``module``'s parameters over ``mesh`` as one FSDP unit (call on inner modules first).

    The parameters of ``module`` that no inner ``fully_shard`` module owns are packed by
    :func:`ragged_placement.planner.plan` into one flat buffer; each becomes an
    ``nn.Parameter(DTensor)`` with a :class:`RaggedShard` placement whose local tensor is a view
    of this rank's chunk. Forward and backward all-gather the unit with one collective into a
    buffer the unsharded parameters are views of; gradients are reduce-scattered (averaged over
    the mesh) with one collective into a flat buffer the sharded ``.grad`` DTensors are views of.
    When ``module`` wraps other ``fully_shard`` modules (a root holding the embedding and the
    output projection), its layout follows its submodules where that pads no more, so that a
    submodule's gradient buffer is only allocated when backward reaches it.

    The arguments shared with ``torch.distributed.fsdp.fully_shard`` take FSDP2's values, so
    changing the import is enough; where FSDP2 allows a value this runtime cannot honour exactly,
    it raises (never a silent difference). Mixing this ``fully_shard`` and torch's in one model
    is refused with a ``ValueError`` naming the module, in both orders: torch's on ``module`` or
    a module below it before this call, and torch's over a module this one sharded (a guard on
    FSDP2's parameter initialization, :data:`ragged_placement._install.FSDP2_PATCHES`).

    Args:
        module: the module to shard; its class is swapped to a subclass that also derives from
            :class:`FSDPModule` (as torch FSDP2 does). Returned for convenience. A list of
            modules forms one unit (one all-gather before the first of them runs forward, one
            reduce-scatter after all of their backwards; modules nested in another of the
            list belong to it); their parameter names, as seen by ``granularity``, start with
            the module's index in the list (``"0.weight"``). The list is returned.
        mesh: a 1-D device mesh; ``None`` builds one over the default process group (``cuda``
            for NCCL, else ``cpu``). A 2-D ``(replicate, shard)`` mesh gives HSDP: the unit is
            sharded over dim 1 and its gradients are also all-reduced over dim 0. Parameters
            that are DTensors on a tensor-parallel mesh (``parallelize_module`` on a sibling
            sub-mesh of the same root) are planned on their TP-local shape and become DTensors
            on the ``(mesh..., tp)`` mesh (see :mod:`ragged_placement.fsdp.param`).
        reshard_after_forward: ``True``: free the unsharded parameters after forward and
            all-gather them again in backward; ``False``: keep them until backward; ``None``
            (the default, as FSDP2): ``True``, except at the root. The outermost (root) unit
            always keeps them (FSDP2 does so for ``None``; with an explicit ``True`` it
            re-gathers the root, to the same values), which changes no result.
            ``model.parameters()`` gives the sharded parameters between forward and backward
            whatever the setting (an optimizer built there trains them); a unit keeping its
            gathered buffer shows the unsharded ones to attribute reads (``model.head.weight``)
            until its backward (FSDP2 registers them in ``parameters()`` too, where an
            optimizer built from them steps copies that never train; see
            :class:`~ragged_placement.fsdp.common.Registration`). As FSDP2, an ``int`` ``N``
            is the world size to reshard to after forward and must divide the shard world size
            ``W``; ``W`` means ``True`` and ``1`` means ``False``. For ``1 < N < W`` each rank
            keeps, between forward and backward, ``1/N`` of the unit's gathered parameters (one
            copy out of the all-gather buffer, which is then freed), and backward all-gathers
            within its group of ``N`` consecutive ranks (rows of ``mesh.mesh.reshape(-1, N)``;
            for HSDP the 2-D mesh flattened, as FSDP2 does), e.g. inside a node. The groups are
            created once per mesh and ``N`` by their members (collective over each group at
            that call). FP8 units
            (``quant``) and tensor-parallel parameters take it too. Values that are not a bool,
            ``None`` or a divisor of ``W`` raise ``ValueError``.
        shard_placement_fn: FSDP2's per-parameter placement, ``Callable[[nn.Parameter],
            Shard | None]``, called once per managed parameter; it says where the planner may
            cut the parameter (the unit stays one run of whole rows per rank, so a local shard
            is not FSDP2's slice; the numbers are). ``None`` and ``Shard(0)``: between whole
            dim-0 rows (the planner's ``row`` or a coarser granularity; ``Shard(0)`` with a
            ``granularity`` that cuts inside rows raises ``ValueError``). ``Shard(d)``, ``d >
            0``: between whole slices ``x[i_0, ..., i_d]`` (RaggedShard dims ``(0, ..., d)``),
            e.g. torchtitan's ``Shard(1)`` for an expert stack ``[E, H, D]`` with fewer experts
            than ranks, which then spreads over every rank; with ``granularity`` also given,
            or for a parameter that is a tensor- or expert-parallel DTensor (its local tensor
            is cut between whole dim-0 rows only), ``ValueError``. FSDP2's
            ``ShardPlacementResult(placement, mesh_info)`` (torch 2.13; torchtitan's MoE recipe
            under expert parallelism) places a parameter on ``mesh_info.mesh``: the parameters on
            each mesh other than ``mesh`` become one unit of the submodules that register them,
            nested in this one (FSDP2 keeps a second parameter group in this module instead: the
            same shards and numbers; that unit gathers when those submodules run, and this
            module's ``unshard()``/``reshard()`` do not reach it), see
            :mod:`ragged_placement.fsdp.param_meshes`. Such a submodule must register parameters
            of that mesh only, and not with ``granularity``, ``quant``, ``state_sharding`` or
            ``dp_mesh_dims`` (``ValueError``).
        mp_policy: parameter / reduction dtypes: torch's
            :class:`torch.distributed.fsdp.MixedPrecisionPolicy` (``MixedPrecisionPolicy`` of
            this package is the same class). ``param_dtype`` is the dtype of the all-gather and
            of the unsharded parameters (the sharded ones, which the optimizer sees, keep their
            dtype), ``reduce_dtype`` that of the gradient reduce-scatter (default
            ``param_dtype``), ``output_dtype`` casts floating outputs, ``cast_forward_inputs``
            casts floating inputs to ``param_dtype``.
        offload_policy: torch's :class:`~torch.distributed.fsdp.OffloadPolicy` (no offload)
            or :class:`~torch.distributed.fsdp.CPUOffloadPolicy`, as FSDP2: the unit's sharded
            chunk and sharded gradient live on CPU (pinned with ``pin_memory=True``, which
            needs an accelerator, else ``ValueError``), so each sharded parameter is a DTensor
            on ``mesh`` whose local tensor is on CPU and the optimizer steps on CPU. Before
            each all-gather the chunk is copied host-to-device into the send buffer (with the
            ``param_dtype`` cast); the all-gather output and the unsharded parameters stay on
            the mesh's device; the averaged reduce-scatter (and HSDP all-reduce) output is
            copied device-to-host into the sharded gradient. Moving the module to another
            device than CPU afterwards (``to("cuda")``, ``to_empty(device="cuda")``) raises
            ``ValueError`` (FSDP2 raises at the first forward); materialize a meta-device model
            with ``to_empty(device="cpu")``. See ``docs/fsdp.md``.
        ignored_params: parameters left unsharded and unmanaged, as FSDP2: not planned, not
            moved to the mesh's device, their gradients not reduced (each rank keeps its own).
        granularity: the planner's policy: ``None``, a callable ``(name, shape) -> Granularity``
            or a ``{fnmatch pattern: Granularity}`` dict over parameter names in ``module``.
        quant: block-wise FP8 training (:class:`~ragged_placement.quant.BlockFP8Config`): the
            unit's ``nn.Linear`` modules become :class:`~ragged_placement.quant.FP8Linear`, their
            weights (unless tied to a non-Linear) are planned at ``block`` granularity, each
            rank quantizes its own blocks, and the unit's one all-gather moves FP8 bytes and
            block scales; master weights stay in the sharded buffer. See
            :mod:`ragged_placement.fsdp.fp8`.
        dp_mesh_dims: FSDP2's :class:`~torch.distributed.fsdp.DataParallelMeshDims` (torch >=
            2.13; on 2.11 a ``TypeError``): ``mesh`` is then the whole SPMD mesh, every managed
            parameter a DTensor on it with ``Replicate()`` on the named dims; ``shard`` names
            the dim the unit is sharded over, ``replicate`` the HSDP dim (before ``shard`` in
            the mesh), and at most one other dim is tensor parallel. One dim name per role;
            DDP (no ``shard``) and ``quant`` raise ``ValueError``, an ``int``
            ``reshard_after_forward`` ``NotImplementedError`` (as FSDP2). See
            :mod:`ragged_placement.fsdp.spmd`.
        state_sharding: a :class:`~ragged_placement.fsdp.StateSharding`: the dims of ``mesh``
            (any number of named dims) that parameters, gradients and optimizer state are each
            sharded over (AMSP; ``params`` ⊆ ``grads`` ⊆ ``optim``). ``model.parameters()``
            are then DTensors over this rank's optimizer shard (``1/|optim|`` of each unit), so
            any optimizer steps and stores ``1/|optim|`` of the state; backward
            reduce-scatters over ``params`` then ``grads \\ params`` and all-reduces over the
            rest; after a step the first all-gather refreshes the parameter shards over
            ``optim \\ params``. See :mod:`ragged_placement.fsdp.nested`. ``None``, or the
            default of ``mesh`` (:meth:`StateSharding.default`), is the behaviour without it.
            Tensor-parallel parameters compose as without it. Not yet with CPU offload, an
            ``int`` ``reshard_after_forward`` or ``dp_mesh_dims`` (``ValueError``).

    Raises:
        ValueError: ``module`` is not a module (or list of them), was sharded already by this
            ``fully_shard`` or torch's, or holds a module torch's sharded; an argument has a
            wrong type or a value this runtime cannot honour exactly (named in the message).
        ValueError, NotImplementedError: a combination of arguments in
            :data:`ragged_placement.combinations.REFUSED` (the arguments, the reason and the
            fix in the message), before any process group is built.
        RuntimeError: this torch changed a target of :mod:`ragged_placement._install`'s rows
            (named in the message; torch is left unpatched).
    """
    install_fsdp2(_FSDP2_HOOKS)  # the first call teaches torch's DTensor and FSDP2 about ours
    modules = _check_modules(module)
    if not isinstance(mp_policy, MixedPrecisionPolicy):
        raise ValueError(
            f"mp_policy must be a torch.distributed.fsdp.MixedPrecisionPolicy, got {mp_policy!r}"
        )
    ignored = _check_ignored_params(ignored_params)
    mesh = mesh if mesh is not None else _default_mesh()
    if isinstance(mesh, DeviceMesh):
        warn_on_racy_gloo_groups(mesh)
        mesh_device(mesh)  # a device type it cannot compute on: ValueError, before any group
        if dp_mesh_dims is None:  # with it, parameters are DTensors on the whole mesh
            check_tp_dims_disjoint(mesh, modules)
    offload = _check_offload_policy(offload_policy)
    sharding = check_state_sharding(state_sharding, mesh)
    features = _features(sharding=sharding, quant=quant, dp_mesh_dims=dp_mesh_dims,
                         offload=offload, reshard_after_forward=reshard_after_forward,
                         granularity=granularity)
    check_combinations(features)
    build_mesh = _unit_mesh(mesh, sharding, dp_mesh_dims, reshard_after_forward)
    device = mesh_device(mesh)
    check_granularity(granularity)
    spmd = None
    if dp_mesh_dims is not None:
        spmd = localize_spmd_params(mesh, dp_mesh_dims, modules, ignored, FSDPModule)
    slots, params, owned_modules = _collect_params(modules, ignored)
    where = type(modules[0]).__name__
    OWNERS.check_not_owned([s.fqn for s in slots], params, where)
    check_no_scalar_params([s.fqn for s in slots], params, where)
    check_no_all_gather_extension([s.fqn for s in slots], params, where)
    placement_fn = shard_placement_fn
    shard_placement_fn, other_meshes = split_by_mesh(
        shard_placement_fn, slots, params, mesh, modules
    )
    if other_meshes:  # FSDP2's per-parameter mesh: a nested unit per other mesh
        check_combinations({**features, Feature.OTHER_MESH: Given(
            f"shard_placement_fn={placement_fn!r} placing parameters on another mesh "
            f"(ShardPlacementResult)", "return placements on mesh from shard_placement_fn")})
        for group in other_meshes:
            fully_shard(
                group.modules if len(group.modules) > 1 else group.modules[0], mesh=group.mesh,
                reshard_after_forward=reshard_after_forward,
                shard_placement_fn=group.placement_fn(), mp_policy=mp_policy,
                offload_policy=offload_policy, ignored_params=ignored_params,
            )
        slots, params, owned_modules = _collect_params(modules, ignored)
    policy = _placement_policy(shard_placement_fn, slots, params, granularity)
    if check_quant(quant) is not None:
        for m in modules:
            convert_unit_linears(m, slots, params, quant)
        slots, params, owned_modules = _collect_params(modules, ignored)  # owners: FP8Linears
    originals = list(params)  # the parameter objects this unit takes over (before any move)
    # Tensors on the meta device stay there until ``to_empty`` (FSDP2's meta-device init).
    for m in owned_modules:
        for k, b in m._buffers.items():
            if b is not None and b.device != device and not b.is_meta:
                m._buffers[k] = b.to(device)
    # Under CPU offload the unit copies each rank's run straight into its CPU chunk.
    if offload is None and params and any(p.device != device and not p.is_meta for p in params):
        params = [p if p.is_meta else p.to(device) for p in params]
    wraps_units = any(
        isinstance(sub, FSDPModule) for m in modules for sub in m.modules() if sub is not m
    )
    options = UnitOptions(
        unit_gathers(quant), mp_policy.param_dtype, mp_policy.reduce_dtype, policy,
        split_by_submodule=wraps_units, offload_policy=offload, spmd=spmd,
    )
    unit = FSDPUnit(slots, params, build_mesh(), options)
    state = FSDPState(modules, unit, _reshard_setting(reshard_after_forward, unit), mp_policy)
    state.unmatched_granularity = unmatched_patterns(granularity, modules)
    for m in modules:
        m._fsdp_state = state
        m.__class__ = _fsdp_class(type(m))
        _register_fully_shard(m)
    OWNERS.record(where, [s.fqn for s in slots], originals, owned_modules,
                  type(modules[0]).__name__)
    return module


# What torch's FSDP2 and pipelining, once patched (ragged_placement._install.FSDP2_PATCHES and
# PIPELINING_PATCHES), call for our modules.
_FSDP2_HOOKS = FSDP2Hooks(module_type=FSDPModule,
                          register_forward_method=register_fsdp_forward_method,
                          sharded_by=OWNERS.sharded_by, state_view=state_view,
                          forward_tensors=forward_tensors)
