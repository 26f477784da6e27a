"""The CPU stand-ins torchtitan 0.3.0 needs to train on CPU/gloo, identical for both runtimes.

torchtitan targets accelerators; each stand-in below replaces one piece that cannot run on a
CPU-only machine, and says why. None stands in for a torch API: torchtitan 0.3.0 is written for
torch 2.14, and the harness skips on a torch without the 2.14 APIs it calls
(:func:`ragged_placement._compat.torchtitan_unsupported`). None of them touches the FSDP runtime: the
comparison in ``tests/train/titan/compare.py`` runs torchtitan's FSDP2 and ours with the same set.
The optional ones after :func:`install` serve the measurements of docs/torchtitan.md ("MoE with
expert parallelism"): a reduce-scatter adding in rank order, gradient dumps, an fp64 norm.
"""

from __future__ import annotations

import json
import os
import resource

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.attention.flex_attention import create_block_mask, create_mask


def _sdpa_with_block_mask(q, k, v, *, score_mod, block_mask, scale, enable_gqa, return_aux,
                          kernel_options):
    """FlexAttention's call, computed by SDPA with the block mask's own ``mask_mod``, densified."""
    if score_mod is not None or return_aux.lse:
        raise NotImplementedError("the SDPA stand-in covers mask-only FlexAttention calls")
    b, _, q_len, _ = q.shape
    mask = create_mask(block_mask.mask_mod, b, 1, q_len, k.shape[2], device=q.device)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale,
                                         enable_gqa=enable_gqa)
    return out, None


class _CpuWithDeviceIndex:
    """``torch.cpu`` whose ``current_device()`` is the index 0 rather than the string ``"cpu"``:
    torchtitan's ``set_pg_timeouts`` runs ``barrier(device_ids=[current_device()])``, and c10d's
    ``BarrierOptions.device_ids`` takes integers only."""

    def __getattr__(self, name: str):
        return getattr(torch.cpu, name)

    @staticmethod
    def current_device() -> int:
        return 0


class _HostMemory:
    """torchtitan's ``DeviceMemoryMonitor`` interface on CPU: the step line's memory is this
    process's peak resident set size (``getrusage``'s ``ru_maxrss``; the peak since the process
    started, torch's import included, so a reset does not lower it), with no capacity."""

    device_name, device_capacity_gib = "cpu", 0.0

    def get_peak_stats(self):
        from torchtitan.components.metrics import DeviceMemStats

        peak_gib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux
        return DeviceMemStats(peak_gib, 0.0, peak_gib, 0.0, 0, 0)

    def reset_peak_stats(self) -> None:
        pass


def install(metrics_path: str | None) -> None:
    """Apply every CPU stand-in; with ``metrics_path``, rank 0 records each step's numbers there."""
    from torchtitan.components import metrics
    from torchtitan.distributed import fsdp, parallel_dims
    from torchtitan.distributed import utils as dist_utils
    from torchtitan.models.common import attention, decoder
    from torchtitan.tools import utils

    # Its device choice is `_get_available_device_type() or "cuda"`: CUDA on a CPU-only machine.
    for module in (utils, dist_utils, parallel_dims, metrics):
        module.device_type, module.device_module = "cpu", torch.cpu
    # set_pg_timeouts' barrier takes a device index, which torch.cpu.current_device() is not.
    dist_utils.device_module = _CpuWithDeviceIndex()
    # DeviceMemoryMonitor reads accelerator memory statistics that torch.cpu does not have: the
    # process's peak RSS stands in.
    metrics.build_device_memory_monitor = _HostMemory
    # The mask is built by torch.compile(create_block_mask): on CPU a C++ build in every
    # process; the eager function builds the same BlockMask.
    decoder.create_attention_mask = create_block_mask
    # FlexAttention has no backward on CPU: SDPA with the same mask (from its mask_mod) stands in.
    attention.FlexAttention.compiled_flex_attn = staticmethod(_sdpa_with_block_mask)
    # gloo has no PREMUL_SUM, FSDP2's reduce-scatter op when it divides: sum, then divide.
    fsdp.disable_fsdp_gradient_division = _with_sum_reductions(fsdp.disable_fsdp_gradient_division)
    if metrics_path is not None:
        _record_metrics(metrics.MetricsProcessor, metrics_path)


def reduce_scatter_in_rank_order() -> None:
    """Optional, for isolating summation order (``compare.py``'s ``*_rank_order`` cases): torch's
    gloo reduce-scatter, the one FSDP2 calls, adds in rank order as ours does.

    gloo runs ``reduce_scatter_single`` as an all-reduce of the whole input, which adds each
    element's rank contributions in an order that depends on its place in the buffer; ours on
    gloo is an all-to-all and a sum of the received chunks in rank order
    (``ragged_placement._gloo.reduce_scatter_by_all_to_all``). This replaces torch's
    ``reduce_scatter_single``/``reduce_scatter_tensor`` for gloo sums with that same function, so
    that both runtimes' gradients are the same sums in the same order; no division moves (with
    torchtitan's divide factor 1.0 neither runtime divides). Ours does not call these two (its
    ``_compat`` bound torch's own at import, and a gloo sum never reaches it), so ours' jobs run
    unchanged with it installed.
    """
    from ragged_placement._gloo import reduce_scatter_by_all_to_all, sums_by_all_to_all

    def in_rank_order(original):
        def reduce_scatter(output, input, op=dist.ReduceOp.SUM, group=None, async_op=False):
            if not sums_by_all_to_all(op, group):
                return original(output, input, op=op, group=group, async_op=async_op)
            return reduce_scatter_by_all_to_all(output, input, group=group, async_op=async_op)

        return reduce_scatter

    for name in ("reduce_scatter_single", "reduce_scatter_tensor"):
        if hasattr(dist, name):
            setattr(dist, name, in_rank_order(getattr(dist, name)))


def _full_gradients(trainer):
    """``(name, full gradient)`` of every parameter of ``trainer``'s model (collective: every
    rank calls it; a DTensor gradient is gathered whole)."""
    for part in trainer.model_parts:
        for name, p in part.named_parameters():
            g = p.grad
            if g is not None and hasattr(g, "full_tensor"):
                g = g.full_tensor()
            yield name, g


def _after_train_step(action) -> None:
    """Wrap torchtitan's ``Trainer.train_step`` to call ``action(trainer)`` after each step (the
    gradients are still there: the next step zeroes them)."""
    from torchtitan.trainer import Trainer

    train_step = Trainer.train_step

    def train_step_then_act(self, *args, **kwargs):
        out = train_step(self, *args, **kwargs)
        action(self)
        return out

    Trainer.train_step = train_step_then_act


def dump_gradients(folder: str, steps: set[int]) -> None:
    """After each train step in ``steps``, rank 0 saves every parameter's full gradient (fp32, by
    name) to ``folder/step{N}.pt``: the per-parameter comparison of docs/torchtitan.md."""

    def dump(trainer) -> None:
        if trainer.step not in steps:
            return
        grads = {n: None if g is None else g.detach().clone() for n, g in _full_gradients(trainer)}
        if dist.get_rank() == 0:
            os.makedirs(folder, exist_ok=True)
            torch.save(grads, os.path.join(folder, f"step{trainer.step}.pt"))

    _after_train_step(dump)


def record_exact_grad_norm(path: str) -> None:
    """At each train step's clipping (torchtitan's ``clip_grad_norm_``), rank 0 appends to
    ``path`` the norm of the full gradients it clips, summed in fp64: the norm torchtitan logs,
    without its dependence on the shards (it sums fp32 squares over each rank's shard, whose
    rounding depends on the cuts), and the gradients' before any clipping."""
    from torchtitan.distributed import utils as dist_utils
    from torchtitan.trainer import Trainer

    current: dict[str, int] = {}
    train_step, clip = Trainer.train_step, dist_utils.clip_grad_norm_

    def train_step_numbered(self, *args, **kwargs):
        current["step"] = self.step
        return train_step(self, *args, **kwargs)

    def clip_recording(parameters, *args, **kwargs):
        parameters = list(parameters)
        total = torch.zeros((), dtype=torch.float64)
        for p in parameters:
            g = p.grad
            if g is not None:
                g = g.full_tensor() if hasattr(g, "full_tensor") else g
                total += g.double().pow(2).sum()
        if dist.get_rank() == 0:
            with open(path, "a") as f:
                f.write(json.dumps({"step": current["step"],
                                    "grad_norm_fp64": total.sqrt().item()}) + "\n")
        return clip(parameters, *args, **kwargs)

    Trainer.train_step = train_step_numbered
    dist_utils.clip_grad_norm_ = clip_recording


def _with_sum_reductions(disable_division):
    """torchtitan's ``disable_fsdp_gradient_division``, then every FSDP module sums its reductions."""

    def disable_division_and_sum(model: torch.nn.Module) -> None:
        disable_division(model)
        for module in model.modules():
            if hasattr(module, "set_force_sum_reduction_for_comms"):
                module.set_force_sum_reduction_for_comms(True)

    return disable_division_and_sum


def _record_metrics(processor_cls, path: str) -> None:
    """Append each logged step's loss and gradient norm, at full precision, to ``path``, on the
    rank ``TITAN_METRICS_RANK`` names (default 0; with pipeline parallelism a rank of the last
    stage, the only ones whose logged loss is the loss).

    torchtitan prints them rounded (the loss to 5 decimals, the norm to 4); the comparison needs
    every bit.
    """
    log = processor_cls.log
    rank = int(os.environ.get("TITAN_METRICS_RANK", "0"))

    def log_and_record(self, step, global_avg_loss, global_max_loss, grad_norm, *args, **kwargs):
        if int(os.environ.get("RANK", "0")) == rank:
            with open(path, "a") as f:
                f.write(json.dumps({"step": step, "loss": float(global_avg_loss),
                                    "grad_norm": float(grad_norm)}) + "\n")
        return log(self, step, global_avg_loss, global_max_loss, grad_norm, *args, **kwargs)

    processor_cls.log = log_and_record
