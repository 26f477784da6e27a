"""What torch's code that reaches FSDP2's private state sees for our ``fully_shard`` modules.

Our :class:`~ragged_placement.fsdp.FSDPModule` derives from torch's, so torch's and
torchtitan's ``isinstance(m, torch.distributed.fsdp.FSDPModule)`` branches take these modules
for FSDP2's and call its public methods, which ours implement. A few of those branches go on
to FSDP2's private state:

- ``torch.distributed.pipelining``'s stages, after the last micro-batch, call
  ``fully_shard.state(m)._state_ctx.all_states``, each state's ``_fsdp_param_groups`` (on
  torch 2.11 ``_fsdp_param_group``) ``.post_backward()``, then
  ``_root_post_backward_final_callback()``: :class:`FSDP2StateView` answers these with this
  runtime's post-backward (the gradients accumulated with sync off are reduce-scattered and
  the units resharded); ``ragged_placement._install`` makes ``fully_shard.state`` return it
  (:func:`state_view`). torch's own FSDP2 looks its state up elsewhere
  (``_get_module_fsdp_state``), so its ``fully_shard`` still does not take these modules for
  its own: reaching one, it raises.
- Any other attribute of FSDP2's state (``FSDPMemTracker``, ``share_comm_ctx`` of torch's,
  private methods of torch's ``FSDPModule``) raises ``NotImplementedError`` naming it, never
  a silent no-op or an ``AttributeError`` deep inside torch.

One more path pairs FSDP2's parameters with the autograd graph: the split backward of
``torch.distributed.pipelining``'s zero-bubble schedules (``ScheduleInterleavedZeroBubble``,
``ScheduleZBVZeroBubble``, ``ScheduleDualPipeV``). Its input pass (``stage_backward_input``)
and its later weight pass (``stage_backward_weight``) each map every one of
``stage.submod.parameters()`` to its autograd accumulator and look up the accumulators of the
graph the forward recorded. FSDP2 keeps its unsharded parameters registered there; ours gives the
sharded ones at every point outside its hooks (:class:`~ragged_placement.fsdp.common.
Registration`), and the forward computed with the unsharded ones. So both passes are given, for
each sharded parameter of ours, the unsharded parameter its forward used
(:func:`ragged_placement.fsdp.param.forward_tensors`;
``ragged_placement._install.PIPELINING_PATCHES``): the weight pass
finds it in the graph, and its gradient lands once, through the unit's gradient hook, in the
unit's flat gradient buffer, as a full backward's AccumulateGrad would add it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NoReturn

from torch import nn

if TYPE_CHECKING:
    from ragged_placement.fsdp.state import FSDPState

__all__ = ["FSDP2StateView", "refuse_private_state", "state_view"]


def refuse_private_state(what: str, owner: str) -> NoReturn:
    """Raise the ``NotImplementedError`` for torch code reaching FSDP2's private ``what``."""
    raise NotImplementedError(
        f"{what} of {owner}: torch FSDP2's private state, which ragged_placement's fully_shard "
        f"modules do not have (they are torch.distributed.fsdp.FSDPModule instances with "
        f"FSDP2's public methods; ragged_placement.fsdp.fsdp2_state lists the private paths "
        f"they answer). Use the public FSDPModule methods, or torch's fully_shard for this tool"
    )


class _ParamGroupView:
    """One unit as an FSDP2 ``FSDPParamGroup``: only ``post_backward``."""

    def __init__(self, state: FSDPState) -> None:
        self._state = state

    def post_backward(self) -> None:
        """This unit's post-backward: reduce-scatter the unsharded gradients it holds (when
        gradient sync is on) and reshard (when ``reshard_after_backward``)."""
        self._state.post_backward()

    def __getattr__(self, name: str) -> NoReturn:
        refuse_private_state(f"FSDPParamGroup.{name}", type(self._state.module).__name__)


class _StateContextView:
    def __init__(self, states: list[FSDPState]) -> None:
        self.all_states = [FSDP2StateView(s) for s in states]


class FSDP2StateView:
    """A ``fully_shard`` unit as FSDP2's ``FSDPState``, for ``torch.distributed.pipelining``
    (see the module docstring); other attributes raise ``NotImplementedError``."""

    def __init__(self, state: FSDPState) -> None:
        self._state = state

    @property
    def _state_ctx(self) -> _StateContextView:
        """The root's units (this one and those below it), root first."""
        state = self._state
        if state.root is None:
            state._lazy_init()
        return _StateContextView(state.root.states)

    @property
    def _fsdp_param_groups(self) -> list[_ParamGroupView]:
        return [_ParamGroupView(self._state)]

    @property
    def _fsdp_param_group(self) -> _ParamGroupView:  # torch 2.11's name: one group per state
        return _ParamGroupView(self._state)

    def _root_post_backward_final_callback(self) -> None:
        """The root's end of backward: every unit's post-backward, the pending reduce-scatter
        finished, CPU-offload copies waited for, unused parameters' gradients dropped."""
        root = self._state
        if root.root is None:
            root._lazy_init()
        root.root.states[0]._root_final_callback()

    def __getattr__(self, name: str) -> NoReturn:
        refuse_private_state(f"FSDPState.{name}", type(self._state.module).__name__)


def state_view(module: nn.Module) -> FSDP2StateView | None:
    """What ``torch.distributed.fsdp.fully_shard.state(module)`` returns for ``module`` (hooked
    in by ``ragged_placement._install``): the view of its unit if ours sharded it, else
    ``None`` (torch's lookup then runs)."""
    from ragged_placement.fsdp.state import FSDPState

    state = getattr(module, "_fsdp_state", None)
    if not isinstance(state, FSDPState):
        return None
    return FSDP2StateView(state)
