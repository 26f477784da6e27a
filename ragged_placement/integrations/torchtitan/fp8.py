"""Block-wise FP8 Linear layers in torchtitan's models, through its model-converter configs.

This package's ``fully_shard(quant=BlockFP8Config(...))`` gathers, and trains in block-wise FP8
(:mod:`ragged_placement.fsdp.fp8`), the weights of ``nn.Linear`` modules (exactly that class)
and of :class:`~ragged_placement.quant.FP8Linear`. torchtitan's ``Linear`` subclasses
``nn.Linear`` for its module protocol (built from a config, initialized by ``param_init``), so
``fully_shard`` leaves it in high precision (a subclass may have a forward of its own).
:class:`BlockFP8LinearConverter` is a torchtitan ``ModelConfigConverter`` (the kind its Float8
and MXFP8 converters are) that replaces the model config's ``Linear.Config`` nodes by
:class:`BlockFP8Linear` ones: ``FP8Linear`` with torchtitan's module protocol, the same
``param_init`` and sharding config.

Without our runtime (torch FSDP2, one process) a ``BlockFP8Linear`` quantizes its gathered weight
in each forward: the one-process FP8 reference of the tests. Under ours with the same config as
``quant`` (what ``configure(fp8=...)`` sets), each rank quantizes its own 128-row bands once per
unshard and the all-gather moves FP8 bytes and scales.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from torchtitan.components.quantization import QuantizationConverter
from torchtitan.models.common.linear import Linear
from torchtitan.protocols.module import Module

from ragged_placement.quant import BlockFP8Config, FP8Linear

__all__ = ["DEFAULT_FILTER_FQNS", "BlockFP8Linear", "BlockFP8LinearConverter", "fp8_configs"]

# Left in high precision, as DeepSeek-V3's recipe leaves them: the output head (also called on
# its own by torchtitan's ChunkedLossWrapper) and the MoE routers' gates.
DEFAULT_FILTER_FQNS = ("lm_head", "router.gate")


class BlockFP8Linear(FP8Linear, Module):
    """torchtitan's ``Linear`` computing in block-wise FP8: :class:`~ragged_placement.quant.
    FP8Linear` built from a ``Linear.Config`` with the FP8 recipe ``fp8``."""

    @dataclass(kw_only=True, slots=True)
    class Config(Linear.Config):
        """``Linear.Config`` and the block-wise FP8 recipe."""

        fp8: BlockFP8Config = field(default_factory=BlockFP8Config)

    def __init__(self, config: Config) -> None:
        FP8Linear.__init__(self, config.in_features, config.out_features, config.bias,
                           config=config.fp8)


class BlockFP8LinearConverter(QuantizationConverter):
    """Replace the model config's ``Linear.Config`` nodes (exactly that class) by
    :class:`BlockFP8Linear` configs, but those whose FQN contains one of ``filter_fqns``.

    ``model_registry(flavor, converters=[BlockFP8LinearConverter.Config()])`` or, with our
    runtime, ``configure(config, fp8=True)``."""

    @dataclass(kw_only=True, slots=True)
    class Config(QuantizationConverter.Config):
        block: tuple[int, int] = (128, 128)
        """Weight blocks (rows, cols), one fp32 scale each."""
        activation_tile: int = 128
        """Activations and output gradients are quantized in 1 x tile groups."""
        kernel: Literal["auto", "triton", "torch"] = "auto"
        """Triton on CUDA when installed (auto), else the bitwise-equal pure-torch twin."""
        filter_fqns: list[str] = field(default_factory=lambda: list(DEFAULT_FILTER_FQNS))
        """Linear layers whose FQN contains one of these stay in high precision."""

        def recipe(self) -> BlockFP8Config:
            """The :class:`~ragged_placement.quant.BlockFP8Config` of this converter."""
            return BlockFP8Config(block=tuple(self.block), activation_tile=self.activation_tile,
                                  kernel=self.kernel)

    config: Config

    def __init__(self, config: Config) -> None:
        self.config = config

    def convert(self, model_config: Module.Config) -> Module.Config:
        """Swap the configs in place (and return the root); ``ValueError`` if none is left to
        convert."""
        recipe = self.config.recipe()
        swaps = [(fqn, linear, parent, attr)
                 for fqn, linear, parent, attr in model_config.traverse(Linear.Config)
                 if type(linear) is Linear.Config
                 and not any(f in fqn for f in self.config.filter_fqns)]
        if not swaps:
            raise ValueError(f"BlockFP8LinearConverter converts no Linear layer of this model "
                             f"(filter_fqns={self.config.filter_fqns}): narrow filter_fqns")
        for _, linear, parent, attr in swaps:
            new = BlockFP8Linear.Config(
                in_features=linear.in_features, out_features=linear.out_features,
                bias=linear.bias, param_init=linear.param_init,
                sharding_config=linear.sharding_config, fp8=recipe)
            if parent is None:
                model_config = new
            elif isinstance(parent, list):
                parent[attr] = new
            else:
                setattr(parent, attr, new)
        return model_config


def fp8_configs(model_config: Module.Config) -> set[BlockFP8Config]:
    """The FP8 recipes of the model config's :class:`BlockFP8Linear` layers (empty: none)."""
    return {c.fp8 for _, c, _, _ in model_config.traverse(BlockFP8Linear.Config)}
