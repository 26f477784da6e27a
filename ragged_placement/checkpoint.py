"""Distributed-checkpoint support for RaggedShard DTensors.

A rank's local run is one box in the global tensor for ``dims=(0,)`` and up to
``2 * len(dims) - 1`` boxes for a flattened run (:func:`ragged_placement.distribute.local_chunks`).
Each box is saved as its own chunk straight from the local tensor: saving moves no data between
ranks, and loading reads whatever boxes of the saved chunks overlap this rank's boxes, so a
checkpoint saved with one set of units or world size loads into any other placement
(other units, ``Shard(0)``, ``Replicate``) and vice versa.
"""

from __future__ import annotations

import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
from torch.distributed.tensor import DTensor

from ragged_placement.distribute import local_chunks

__all__ = ["create_write_items", "create_chunk_list", "get_tensor_shard"]


def _chunks(dt: DTensor):
    if any(p.is_partial() for p in dt.placements):
        raise ValueError("Any checkpointing related operations are not supported for DTensor with partial placements!")
    return local_chunks(dt.shape, dt.device_mesh, dt.placements)


def create_chunk_list(dt: DTensor) -> list[ChunkStorageMetadata]:
    """One ``ChunkStorageMetadata`` per box of this rank's local tensor (none if it is empty)."""
    return [ChunkStorageMetadata(offsets=torch.Size(o), sizes=torch.Size(s))
            for o, s, _ in _chunks(dt) if all(s)]


def create_write_items(dt: DTensor, fqn: str, obj: object) -> list[WriteItem]:
    """Write items for this rank's boxes, read straight from the local tensor."""
    props = TensorProperties.create_from_tensor(dt.to_local())
    return [
        WriteItem(
            index=MetadataIndex(fqn, torch.Size(o)),
            type=WriteItemType.SHARD,
            tensor_data=TensorWriteData(
                chunk=ChunkStorageMetadata(offsets=torch.Size(o), sizes=torch.Size(s)),
                properties=props,
                size=dt.size(),
            ),
        )
        for o, s, _ in _chunks(dt)
        if all(s)
    ]


def get_tensor_shard(dt: DTensor, index: MetadataIndex) -> torch.Tensor:
    """The view of the local tensor that holds the box saved or loaded under ``index``."""
    flat = dt._local_tensor.view(-1)
    for o, s, start in _chunks(dt):
        if index.offset is None or torch.Size(o) == index.offset:
            numel = 1
            for x in s:
                numel *= x
            return flat[start:start + numel].view(s)
    raise ValueError(f"{index.fqn}: no local box at offset {tuple(index.offset)} for {dt.placements}")
