"""``transformers``' mixtures of experts under expert parallelism: their style
(:class:`~ragged_placement.expert_parallel.HFExpertParallel`, :func:`~ragged_placement.
expert_parallel.hf_experts`) and recipe (:func:`~ragged_placement.parallelize.
parallelize_hf_moe`), re-exported under the models path; the models are ``transformers``' own."""

from ragged_placement.expert_parallel import HFExpertParallel, hf_experts
from ragged_placement.parallelize import parallelize_hf_moe

__all__ = ["HFExpertParallel", "hf_experts", "parallelize_hf_moe"]
