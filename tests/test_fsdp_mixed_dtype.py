"""Units whose parameters have several dtypes (fp32 norms next to bf16 matrices).

Not supported yet: ``fully_shard`` refuses them with a ``ValueError`` that names the parameters
of each dtype and the two ways out, before any collective (torch FSDP2 accepts such units)."""

from __future__ import annotations

import pytest
import torch
from dist_utils import run_threaded
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from ragged_placement.fsdp import fully_shard


class NormThenLinear(nn.Sequential):
    """An fp32 norm feeding a bf16 matrix (the mixed-dtype block of HF-style models)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self[1](self[0](x).to(torch.bfloat16))


def _block() -> NormThenLinear:
    g = torch.Generator().manual_seed(0)
    block = NormThenLinear(nn.LayerNorm(8), nn.Linear(8, 8).bfloat16())
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    return block


def _refused(rank: int, ws: int) -> None:
    mesh = DeviceMesh("cpu", list(range(ws)))
    block = _block()
    x = torch.randn(2, 8, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expect = _block()(x)
    with pytest.raises(
        ValueError,
        match=r"share a dtype, got torch\.float32: 0\.weight, 0\.bias; "
        r"torch\.bfloat16: 1\.weight, 1\.bias\. Give the differently-typed modules units",
    ):
        fully_shard(block, mesh=mesh)
    fully_shard(block[1], mesh=mesh)  # the way out: the bf16 Linear in a unit of its own
    fully_shard(block, mesh=mesh)
    with torch.no_grad():
        assert torch.equal(block(x), expect)


def test_unit_with_several_dtypes_is_refused_naming_the_parameters():
    run_threaded(_refused, 2)
