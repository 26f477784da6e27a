"""Random ops on RaggedShard DTensors: every rank draws its own part of the same full tensor.

**The contract.** A random op on a DTensor whose placements contain a RaggedShard gives, on every
rank, exactly that rank's region of the tensor that the same op draws on one device from the
same generator state: ``d.normal_()`` on any mesh, with any units, world size or
``split_factor``, holds the values of ``torch.empty(d.shape).normal_()``, bit for bit, and leaves
the generator in the same state as that single-device draw. Nothing depends on the world size or
the units, so a model initialized under ``fully_shard`` equals the unsharded model initialized
with the same seed.

Requirements and costs:

* Every rank of the mesh must start from the same generator state (``torch.manual_seed(s)`` on
  all ranks, or the same ``generator=``), as DTensor requires of its random ops. Nothing is
  communicated, so this is not checked.
* Each rank draws the full tensor, then keeps its region: the draw costs what it costs on one
  device (time, and a transient full-size buffer), on every rank. That is cheap for parameter
  initialization, which is where random ops on this placement occur; a dropout on a large
  RaggedShard activation pays for the full mask on every rank.

Ops: ``normal_``, ``uniform_``, ``bernoulli_(p: float)``, ``rand_like``, ``randn_like``,
``randint_like``, ``native_dropout`` (CUDA's ``F.dropout``; on CPU ``F.dropout`` decomposes into
``empty_like`` + ``bernoulli_`` + pointwise ops) and the factories
``torch.distributed.tensor.rand`` / ``randn``. Hence every ``nn.init`` function that draws with
these (``normal_``, ``uniform_``, ``kaiming_*``, ``xavier_*``, ``trunc_normal_``).
``bernoulli(p: Tensor)`` (the probabilities are the sharded values) and random ops outside
DTensor's random-op set (``exponential_``, ``random_``, torch 2.13's ``randn_like(...,
generator=)`` overloads, ...) raise ``NotImplementedError``: torch's dispatcher runs those
without its random-op branch, where this module takes over.

How torch's own tracker differs (torch 2.11 and 2.13): ``OffsetBasedRNGTracker`` gives each
shard a window of the CUDA philox stream starting at ``shard_index * shard_numel`` (rounded up to
4) and every rank draws its local shape there. The result depends on the number of shards and
is not the single-device draw even on CUDA (the kernels map elements to philox subsequences by
their launch grid; pytorch/pytorch#168058); on CPU there is no tracker at all and each rank
draws its local shape from its own generator, so same-seeded ranks draw identical shards, and
``torch.distributed.tensor.rand`` raises. This module does not use the tracker.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.utils import _pytree as pytree

from ragged_placement.distribute import local_tensor_from_full
from ragged_placement.placement import RaggedShard
from ragged_placement.redistribute import validate_placements

__all__ = ["INPLACE_RANDOM_OPS", "LIKE_RANDOM_OPS", "RANDOM_OPS", "handles", "local_random_results", "random_factory"]

aten = torch.ops.aten

#: In-place draws: the full tensor is drawn into a scratch tensor, the rank's region copied in.
INPLACE_RANDOM_OPS = frozenset({aten.normal_.default, aten.uniform_.default, aten.bernoulli_.float})
#: ``*_like`` draws: only the input's shape, dtype and device matter.
LIKE_RANDOM_OPS = frozenset({
    aten.rand_like.default, aten.randn_like.default, aten.randint_like.default, aten.randint_like.low_dtype,
})
#: Every random op with a RaggedShard rule (its sharding rule: the output keeps the input's
#: placements; the local computation is :func:`local_random_results`).
RANDOM_OPS = INPLACE_RANDOM_OPS | LIKE_RANDOM_OPS | {aten.native_dropout.default}


def _ragged_dtensor(x: object) -> bool:
    return isinstance(x, DTensor) and any(isinstance(p, RaggedShard) for p in x.placements)


def handles(op_call, args: Sequence[object]) -> bool:
    """Whether ``op_call(*args)`` is a random op on a RaggedShard DTensor (run by this module)."""
    return op_call in RANDOM_OPS and bool(args) and _ragged_dtensor(args[0])


def _region(full: torch.Tensor, spec: DTensorSpec) -> torch.Tensor:
    """This rank's local tensor of ``full`` under ``spec``, in its own storage."""
    local = local_tensor_from_full(full, spec.mesh, spec.placements)
    if local.untyped_storage().data_ptr() == full.untyped_storage().data_ptr():
        local = local.clone(memory_format=torch.contiguous_format)
    return local


def local_random_results(op_call, args: Sequence[object], op_info) -> object:
    """The local result of random op ``op_call`` on RaggedShard DTensor ``args[0]``: this rank's
    region of the op's single-device draw (see the module docstring).

    Called by torch's dispatcher in place of its own random-op branch (``_install``); the
    sharding rule (``ragged_placement.ops``) keeps the input's placements, so no input was
    redistributed.
    """
    spec: DTensorSpec = args[0]._spec
    local_args = (
        pytree.tree_unflatten(list(op_info.local_args), op_info.args_tree_spec)
        if op_info.args_tree_spec else op_info.local_args
    )
    kwargs = dict(op_info.local_kwargs)
    local = local_args[0]
    if local.is_meta or not spec.mesh._is_current_rank_part_of_mesh():
        return op_call(*local_args, **kwargs)
    shape = tuple(spec.shape)
    if op_call in INPLACE_RANDOM_OPS:
        scratch = torch.empty(shape, dtype=local.dtype, device=local.device)
        op_call(scratch, *local_args[1:], **kwargs)
        return local.copy_(local_tensor_from_full(scratch, spec.mesh, spec.placements))
    if op_call in LIKE_RANDOM_OPS:
        scratch = torch.empty(shape, dtype=local.dtype, device=local.device)
        return _region(op_call(scratch, *local_args[1:], **kwargs), spec)
    return _native_dropout(op_call, local, spec, *local_args[1:], **kwargs)


def _native_dropout(op_call, local: torch.Tensor, spec: DTensorSpec, p: float, train: bool | None):
    """``native_dropout``: the mask is the region of the full mask; the output is computed from
    it locally as the kernel does (``input * mask * (1 / (1 - p))``)."""
    if not train:
        return op_call(local, p, train)
    ones = torch.ones(tuple(spec.shape), dtype=local.dtype, device=local.device)
    _, mask_full = op_call(ones, p, train)
    mask = _region(mask_full, spec)
    scale = 0.0 if p == 1 else 1.0 / (1.0 - p)
    return local.mul(mask).mul_(scale), mask


def random_factory(
    init_op, size: Sequence[int], device_mesh: DeviceMesh, placements: Sequence[Placement], **kwargs
) -> DTensor:
    """``torch.distributed.tensor.rand`` / ``randn`` with a RaggedShard: this rank's region of
    ``init_op(size)`` drawn on one device (see the module docstring)."""
    placements = list(placements)
    validate_placements(device_mesh, placements, len(size))
    requires_grad = kwargs.pop("requires_grad", False)
    if kwargs.get("layout", torch.strided) != torch.strided:
        raise ValueError(f"{init_op.__name__} with RaggedShard supports layout=torch.strided only, got {kwargs['layout']}")
    kwargs["device"] = device_mesh.device_type
    full = init_op(tuple(size), **kwargs)
    spec = DTensorSpec(device_mesh, tuple(placements),
                       tensor_meta=TensorMeta(full.shape, full.stride(), full.dtype))
    local = _region(full, spec)
    return DTensor(local.requires_grad_(requires_grad), spec, requires_grad=requires_grad)
