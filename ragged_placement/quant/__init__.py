"""Block-wise FP8 training on RaggedShard (DeepSeek-V3's recipe).

* :mod:`.blockwise`: ``quantize_blockwise`` / ``dequantize_blockwise`` (128x128 weight blocks),
  ``quantize_tiles`` / ``dequantize_tiles`` (1x128 activation tiles), ``BlockFP8Config``.
* :mod:`.reference` / :mod:`.triton_kernels`: the pure-torch twin and the Triton kernels
  (bitwise equal; Triton is used for CUDA tensors when installed).
* :mod:`.sharded`: quantize a rank's own blocks into the FP8 all-gather send buffer and view
  the gathered buffer as every weight's ``(q, s)`` (``FP8GatherLayout``).
* :mod:`.linear`: ``fp8_linear`` / ``FP8Linear`` (FP8 forward and dgrad, high-precision wgrad).
"""

from .blockwise import (
    BlockFP8Config,
    dequantize_blockwise,
    dequantize_tiles,
    quantize_blockwise,
    quantize_blockwise_into,
    quantize_tiles,
    triton_available,
)
from .linear import FP8Linear, convert_to_fp8_linear, fp8_linear
from .sharded import FlatParam, FP8GatherLayout, FP8Piece, quantize_run

__all__ = [
    "BlockFP8Config",
    "FP8GatherLayout",
    "FP8Linear",
    "FP8Piece",
    "FlatParam",
    "convert_to_fp8_linear",
    "dequantize_blockwise",
    "dequantize_tiles",
    "fp8_linear",
    "quantize_blockwise",
    "quantize_blockwise_into",
    "quantize_run",
    "quantize_tiles",
    "triton_available",
]
