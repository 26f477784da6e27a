"""torchtitan configs for the CPU comparison: its llama3 and DeepSeek-V3 ``debugmodel``s, fp32.

``--module titan_config --config NAME`` selects one (torchtitan's ConfigManager imports a module
by name). Each is torchtitan's own ``llama3_debugmodel()`` or ``deepseek_v3_debugmodel()`` with
only what a CPU run needs changed; the models are untouched (llama3: 6 layers, dim 256, vocab 2048,
fused QKV, FlexAttention masks; DeepSeek-V3: the same sizes, MLA attention, the first layer dense,
then MoE layers of 8 routed experts, top 3, and 2 shared experts; its expert matmuls run in bf16,
as torchtitan's ``GroupedExperts`` casts them).
"""

from __future__ import annotations

from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC
from torchtitan.models.deepseek_v3.config_registry import deepseek_v3_debugmodel
from torchtitan.models.llama3.config_registry import llama3_debugmodel
from torchtitan.trainer import Trainer


def _on_cpu_in_fp32(config: Trainer.Config) -> Trainer.Config:
    """What a CPU run needs changed in one of torchtitan's configs: fp32, 12 steps of 2 x 128
    tokens per data-parallel rank, no AC, no validation, metrics every step."""
    config.training.seq_len = 128
    config.training.local_batch_size = 2
    config.training.steps = 12
    config.training.mixed_precision_param = "float32"   # the 1e-5 comparison is in fp32
    config.training.disable_cuda_graphs = True          # no CUDA
    config.lr_scheduler.warmup_steps = 2
    # Its default backend, spmd_types, needs a newer torch than 2.13; partial_dtensor is the
    # DTensor path (FSDP and TP as DTensors), the one fully_shard serves.
    config.parallelism.spmd_backend = "partial_dtensor"
    config.validator.enable = False
    config.activation_checkpoint = None
    config.checkpoint.enable = False
    config.debug.seed = 0
    config.metrics.log_freq = 1
    return config


def llama3_debugmodel_cpu() -> Trainer.Config:
    """The llama3 debug model in fp32, 12 steps of 2 x 128 tokens per data-parallel rank, no AC."""
    return _on_cpu_in_fp32(llama3_debugmodel())


def llama3_debugmodel_cpu_full_ac() -> Trainer.Config:
    """``llama3_debugmodel_cpu`` with full activation checkpointing of every block."""
    config = llama3_debugmodel_cpu()
    config.activation_checkpoint = FullAC.Config()
    return config


def llama3_debugmodel_cpu_selective_ac() -> Trainer.Config:
    """``llama3_debugmodel_cpu`` with torchtitan's default selective (op-level) checkpointing."""
    config = llama3_debugmodel_cpu()
    config.activation_checkpoint = SelectiveAC.Config()
    return config


def deepseek_v3_debugmodel_cpu() -> Trainer.Config:
    """torchtitan's DeepSeek-V3 ``debugmodel`` (MoE: 8 routed experts, top 3, 2 shared experts,
    MLA attention; 6 layers, the first dense), on CPU in fp32; its selective AC off."""
    return _on_cpu_in_fp32(deepseek_v3_debugmodel())
