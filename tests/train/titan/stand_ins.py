"""The CPU stand-ins torchtitan 0.3.0 needs to train on CPU/gloo, identical for both runtimes.

torchtitan targets accelerators; each stand-in below replaces one piece that cannot run on a
CPU-only machine with torch 2.13, and says why. None of them touches the FSDP runtime: the
comparison in ``tests/train/titan/compare.py`` runs torchtitan's FSDP2 and ours with the same set.
"""

from __future__ import annotations

import json
import os

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import create_block_mask, create_mask

# torch's gloo groups run two worker threads that race and corrupt the heap (an abort at exit,
# seen in the HSDP run with FSDP2): importing ragged_placement gives every gloo group one
# worker (ragged_placement._gloo), in both runtimes' jobs.
import ragged_placement  # noqa: F401


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


class _NoDeviceMemory:
    """torchtitan's ``DeviceMemoryMonitor`` interface with nothing to measure on CPU."""

    device_name, device_capacity_gib = "cpu", 0.0

    def get_peak_stats(self):
        from torchtitan.components.metrics import DeviceMemStats

        return DeviceMemStats(0.0, 0.0, 0.0, 0.0, 0, 0)

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
    # DeviceMemoryMonitor reads accelerator memory statistics that torch.cpu does not have.
    metrics.build_device_memory_monitor = _NoDeviceMemory
    # set_pg_timeouts calls torch.distributed.set_timeout, which torch 2.13 does not have.
    dist_utils.set_pg_timeouts = lambda timeout, parallel_dims: None
    # The mask is built by torch.compile(create_block_mask): on CPU a C++ build in every
    # process; the eager function builds the same BlockMask.
    decoder.create_attention_mask = create_block_mask
    # FlexAttention has no backward on CPU: SDPA with the same mask (from its mask_mod) stands in.
    attention.FlexAttention.compiled_flex_attn = staticmethod(_sdpa_with_block_mask)
    # gloo has no PREMUL_SUM, FSDP2's reduce-scatter op when it divides: sum, then divide.
    fsdp.disable_fsdp_gradient_division = _with_sum_reductions(fsdp.disable_fsdp_gradient_division)
    if metrics_path is not None:
        _record_metrics(metrics.MetricsProcessor, metrics_path)


def _with_sum_reductions(disable_division):
    """torchtitan's ``disable_fsdp_gradient_division``, then every FSDP module sums its reductions."""

    def disable_division_and_sum(model: torch.nn.Module) -> None:
        disable_division(model)
        for module in model.modules():
            if hasattr(module, "set_force_sum_reduction_for_comms"):
                module.set_force_sum_reduction_for_comms(True)

    return disable_division_and_sum


def _record_metrics(processor_cls, path: str) -> None:
    """Append each logged step's loss and gradient norm, at full precision, to ``path`` (rank 0).

    torchtitan prints them rounded (the loss to 5 decimals, the norm to 4); the comparison needs
    every bit.
    """
    log = processor_cls.log

    def log_and_record(self, step, global_avg_loss, global_max_loss, grad_norm, *args, **kwargs):
        if int(os.environ.get("RANK", "0")) == 0:
            with open(path, "a") as f:
                f.write(json.dumps({"step": step, "loss": float(global_avg_loss),
                                    "grad_norm": float(grad_norm)}) + "\n")
        return log(self, step, global_avg_loss, global_max_loss, grad_norm, *args, **kwargs)

    processor_cls.log = log_and_record
