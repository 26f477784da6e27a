"""torch's Adam and AdamW steps on runs of flat shards.

``torch.optim.Adam`` / ``AdamW`` call ``torch.optim.adam._multi_tensor_adam`` (``foreach``),
``_fused_adam`` (``fused``) or ``_single_tensor_adam`` (neither: what torch picks for DTensor
parameters) with parallel lists of parameters, gradients, state and step tensors.
:func:`flat_adam` wraps each (a row of :data:`ragged_placement._install.OPTIM_PATCHES`,
applied at the first ``fully_shard``): the elements whose parameter, gradient and state are
RaggedShard DTensors of one layout go to torch's function as the local tensors of their runs
(:class:`~ragged_placement.optim._flat.FlatStep`: one tensor per run of a unit's flat shard,
state adopted into run buffers), every other element to torch's function as it is (the
per-parameter DTensor path), and so does the whole call under ``differentiable``, complex
parameters, ``torch.compile``, CUDA graph capture or
:func:`~ragged_placement.optim._flat.per_parameter_step`. The update is torch's own, element
by element, so the numbers are the per-parameter step's.
"""

from __future__ import annotations

import functools

import torch

from ragged_placement.optim._flat import (
    LOCAL,
    FlatStep,
    NotFlat,
    _count,
    flat_step_enabled,
    run_candidates,
)

__all__ = ["flat_adam"]


def _capturing() -> bool:
    """Whether a CUDA graph is being captured (the flat step's first call allocates)."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def flat_adam(original):
    """``original`` (``torch.optim.adam._multi_tensor_adam``, ``_fused_adam`` or
    ``_single_tensor_adam``) on the runs of the RaggedShard parameters, and on the other
    parameters as they are (see the module docstring)."""

    @functools.wraps(original)
    def adam_impl(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps,
                  grad_scale, found_inf, **kwargs):
        lists = [params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps]
        if (not params or kwargs["differentiable"] or kwargs["has_complex"]
                or not flat_step_enabled() or torch.compiler.is_compiling() or _capturing()):
            return original(*lists, grad_scale, found_inf, **kwargs)
        states = [exp_avgs, exp_avg_sqs] + ([max_exp_avg_sqs] if kwargs["amsgrad"] else [])
        cand, rest = run_candidates(params, [grads, *states])
        step = None
        if cand:
            whole = len(cand) == len(params)
            dtensors = [lst if whole else [lst[i] for i in cand] for lst in (params, grads, *states)]
            try:
                step = FlatStep(
                    [list(map(LOCAL, lst)) for lst in dtensors], 2,
                    state_steps if whole else [state_steps[i] for i in cand],
                    lambda k, i, view: setattr(dtensors[k][i], "_local_tensor", view),
                )
            except NotFlat:
                cand, rest = [], list(range(len(params)))
        if step is not None:
            t = step.tensors
            original(t[0], t[1], t[2], t[3], t[4] if kwargs["amsgrad"] else [], step.steps,
                     grad_scale, found_inf, **kwargs)
            step.finish()
        if rest:
            _count(per_parameter=len(rest))
            original(*([lst[i] for i in rest] if lst else lst for lst in lists),
                     grad_scale, found_inf, **kwargs)

    return adam_impl
