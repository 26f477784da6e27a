"""Every public entry point of ``ragged_placement.fsdp`` (``fully_shard``, each
``FSDPModule`` method taking arguments, ``register_fsdp_forward_method``, ``share_comm_ctx``)
refuses a bad argument with an error naming the argument and the bad value, on every rank and
before any collective (issue 24). One table, 2 threaded ranks: a rank that issued a collective
for a bad call would hang here against the other's next call."""

from __future__ import annotations

import pytest
import torch
from dist_utils import run_threaded
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from ragged_placement.fsdp import (
    FSDPModule,
    fully_shard,
    register_fsdp_forward_method,
    share_comm_ctx,
)

BAD = "bogus"
_BAD = "'bogus'"

# (entry point, call on a sharded model m (or mesh for fully_shard), exception, message regex)
MODULE_CALLS = [
    ("unshard", lambda m: m.unshard(async_op=BAD), ValueError, f"async_op .*{_BAD}"),
    ("set_requires_gradient_sync", lambda m: m.set_requires_gradient_sync(BAD), ValueError,
     f"requires_gradient_sync .*{_BAD}"),
    ("set_requires_gradient_sync", lambda m: m.set_requires_gradient_sync(True, recurse=BAD),
     ValueError, f"recurse .*{_BAD}"),
    ("reduce_gradients", lambda m: m.reduce_gradients(scale=BAD), ValueError, f"scale .*{_BAD}"),
    ("set_reshard_after_forward", lambda m: m.set_reshard_after_forward(BAD), ValueError,
     f"reshard_after_forward .*{_BAD}"),
    ("set_is_last_backward", lambda m: m.set_is_last_backward(BAD), ValueError,
     f"is_last_backward .*{_BAD}"),
    ("set_reshard_after_backward", lambda m: m.set_reshard_after_backward(BAD), ValueError,
     f"reshard_after_backward .*{_BAD}"),
    ("set_requires_all_reduce", lambda m: m.set_requires_all_reduce(BAD), ValueError,
     f"requires_all_reduce .*{_BAD}"),
    ("set_separate_reduce_scatter_group", lambda m: m.set_separate_reduce_scatter_group(BAD),
     ValueError, f"enable .*{_BAD}"),
    ("set_reduce_scatter_max_input_buffers",
     lambda m: m.set_reduce_scatter_max_input_buffers(BAD), TypeError,
     f"max_input_buffers .*{_BAD}"),
    ("set_allocate_memory_from_process_group_for_comm",
     lambda m: m.set_allocate_memory_from_process_group_for_comm(BAD), ValueError,
     f"enable .*{_BAD}"),
    ("set_symm_mem_for_comm", lambda m: m.set_symm_mem_for_comm(BAD), ValueError,
     f"backend .*{_BAD}"),
    ("set_modules_to_forward_prefetch", lambda m: m.set_modules_to_forward_prefetch(BAD),
     ValueError, "modules must be a list of FSDPModules, got str"),
    ("set_modules_to_backward_prefetch", lambda m: m.set_modules_to_backward_prefetch([BAD]),
     ValueError, f"modules .*{_BAD}"),
    ("set_all_reduce_hook", lambda m: m.set_all_reduce_hook(BAD), ValueError, f"hook .*{_BAD}"),
    ("set_all_reduce_hook", lambda m: m.set_all_reduce_hook(print, stream=BAD), ValueError,
     f"stream .*{_BAD}"),
    ("set_custom_all_gather", lambda m: m.set_custom_all_gather(BAD), ValueError,
     f"comm .*{_BAD}"),
    ("set_custom_reduce_scatter", lambda m: m.set_custom_reduce_scatter(BAD), ValueError,
     f"comm .*{_BAD}"),
    ("set_unshard_in_backward", lambda m: m.set_unshard_in_backward(BAD), ValueError,
     f"unshard_in_backward .*{_BAD}"),
    ("set_reduce_scatter_unused_params", lambda m: m.set_reduce_scatter_unused_params(BAD),
     ValueError, f"reduce_scatter_unused_params .*{_BAD}"),
    ("set_post_optim_event", lambda m: m.set_post_optim_event(BAD), ValueError,
     "event must be a torch.Event, got str"),
    ("set_gradient_divide_factor", lambda m: m.set_gradient_divide_factor(BAD), ValueError,
     f"factor .*{_BAD}"),
    ("set_reduce_scatter_divide_factor", lambda m: m.set_reduce_scatter_divide_factor(BAD),
     ValueError, f"factor .*{_BAD}"),
    ("set_force_sum_reduction_for_comms", lambda m: m.set_force_sum_reduction_for_comms(BAD),
     ValueError, f"enable .*{_BAD}"),
    ("load_state_dict", lambda m: m.load_state_dict(BAD), TypeError,
     "state_dict must be a mapping, got str"),
    ("load_state_dict", lambda m: m.load_state_dict(m.state_dict(), strict=BAD), ValueError,
     f"strict .*{_BAD}"),
    ("register_fsdp_forward_method", lambda m: register_fsdp_forward_method(m, BAD), ValueError,
     f"method_name={_BAD}"),
    ("register_fsdp_forward_method", lambda m: register_fsdp_forward_method(m, 3), TypeError,
     "method_name must be a str, got 3"),
    ("register_fsdp_forward_method", lambda m: register_fsdp_forward_method(BAD, "forward"),
     TypeError, f"module must be an nn.Module, got {_BAD}"),
    ("share_comm_ctx", lambda m: share_comm_ctx(BAD), ValueError,
     "modules must be a list of FSDPModules, got str"),
    ("share_comm_ctx", lambda m: share_comm_ctx([m, BAD]), ValueError,
     f"modules must be a list of FSDPModules, got an item {_BAD}"),
]

FULLY_SHARD_CALLS = [
    ("module", lambda mesh: fully_shard(BAD, mesh=mesh), ValueError, "module .*got str"),
    ("mesh", lambda mesh: fully_shard(_net(), mesh=BAD), ValueError, f"mesh .*{_BAD}"),
    ("reshard_after_forward", lambda mesh: fully_shard(_net(), mesh=mesh,
     reshard_after_forward=BAD), ValueError, f"reshard_after_forward .*{_BAD}"),
    ("shard_placement_fn", lambda mesh: fully_shard(_net(), mesh=mesh,
     shard_placement_fn=BAD), ValueError, f"shard_placement_fn .*{_BAD}"),
    ("mp_policy", lambda mesh: fully_shard(_net(), mesh=mesh, mp_policy=BAD), ValueError,
     f"mp_policy .*{_BAD}"),
    ("offload_policy", lambda mesh: fully_shard(_net(), mesh=mesh, offload_policy=BAD),
     ValueError, f"offload_policy .*{_BAD}"),
    ("ignored_params", lambda mesh: fully_shard(_net(), mesh=mesh, ignored_params=BAD),
     ValueError, "ignored_params .*got str"),
    ("granularity", lambda mesh: fully_shard(_net(), mesh=mesh, granularity=BAD),
     (TypeError, ValueError), "granularity"),
    ("quant", lambda mesh: fully_shard(_net(), mesh=mesh, quant=BAD), (TypeError, ValueError),
     f"quant .*{_BAD}"),
    ("dp_mesh_dims", lambda mesh: fully_shard(_net(), mesh=mesh, dp_mesh_dims=BAD), TypeError,
     f"dp_mesh_dims .*{_BAD}"),
]


def _net() -> nn.Sequential:
    return nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))


def _bad_calls(rank: int, ws: int) -> list[str]:
    mesh = DeviceMesh("cpu", list(range(ws)))
    m = _net()
    fully_shard(m, mesh=mesh)
    checked = []
    for name, call, exc, match in MODULE_CALLS:
        with pytest.raises(exc, match=match):
            call(m)
        checked.append(name)
    for name, call, exc, match in FULLY_SHARD_CALLS:
        with pytest.raises(exc, match=match):
            call(mesh)
        checked.append(f"fully_shard.{name}")
    m(torch.ones(2, 4)).sum().backward()  # still trains: no rank is left inside a collective
    return checked


def test_every_public_entry_point_refuses_bad_arguments_naming_them():
    results = run_threaded(_bad_calls, 2)
    assert results[0] == results[1]
    methods = {n for n, v in vars(FSDPModule).items() if callable(v) and not n.startswith("_")}
    no_args = {"fsdp_unit", "fsdp_units", "reshard", "reset_iter_state"}
    assert methods - no_args <= set(results[0]), methods - no_args - set(results[0])
