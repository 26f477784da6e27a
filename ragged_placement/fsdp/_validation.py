"""Checks of :func:`~ragged_placement.fsdp.fully_shard`'s input that span several calls.

* :data:`OWNERS`, the one registry of what our runtime owns: every parameter object a unit took
  over and every module whose parameters a unit owns. A parameter tied across units (an
  embedding and an output head each under its own ``fully_shard``) would become two
  parameters, silently untied: a later ``fully_shard`` that meets an owned parameter raises, as
  FSDP2 does (at its lazy init; here at the call, before any collective). torch's
  ``fully_shard`` reaching an owned module raises naming the unit
  (:attr:`ragged_placement._install.FSDP2Hooks.sharded_by`).
* A ``granularity`` mapping whose pattern matches no parameter (a typo) would change the layout
  without a word. Per-unit calls share one mapping (the FSDP2 recipe), so a pattern need not
  match in every call: each call keeps the patterns that matched nothing in its module tree, and
  the root raises at its lazy init (before the first all-gather, on every rank alike) for those
  that match no parameter of the whole model.
* FSDP2's all-gather extensions (``fsdp_pre_all_gather``/``fsdp_post_all_gather`` defined on a
  parameter's tensor subclass, or set on its local tensor after ``fully_shard``) change what
  the all-gather moves (e.g. a bf16 copy of an fp32 weight); this runtime gathers a unit's flat
  buffer and would skip them without a word: the call (for the parameters) and the root's lazy
  init (for the local tensors) raise ``NotImplementedError`` naming the parameter.
* A gloo process group created outside :func:`ragged_placement.one_worker_gloo` runs torch's
  two worker threads, which corrupt the heap when two of its collectives complete together;
  this runtime overlaps collectives on its groups, so each call warns once per such group of
  its mesh.
"""

from __future__ import annotations

import fnmatch
import warnings
import weakref
from collections.abc import Mapping, Sequence

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.utils.weak import WeakIdKeyDictionary

from ragged_placement._gloo import gloo_worker_threads
from ragged_placement.planner.granularity import Granularity

__all__ = [
    "OWNERS", "Owners", "check_granularity", "check_no_all_gather_extension",
    "unmatched_patterns", "warn_on_racy_gloo_groups",
]

class Owners:
    """Which ``fully_shard`` unit owns what (weakly: a module or parameter that is garbage
    collected leaves it)."""

    # parameter object -> "Module's parameter 'name'" (the unit's first module's class)
    params: WeakIdKeyDictionary
    # module whose parameters a unit owns -> the unit's module class name ("FSDPModule")
    modules: weakref.WeakKeyDictionary[nn.Module, str]

    def __init__(self) -> None:
        self.params = WeakIdKeyDictionary()
        self.modules = weakref.WeakKeyDictionary()

    def record(self, where: str, names: Sequence[str], params: Sequence[nn.Parameter],
               modules: Sequence[nn.Module], owner: str) -> None:
        """The unit built by ``fully_shard(where)`` (its first module's class name before the
        call) now owns ``params`` (named ``names``) and ``modules``; ``owner``: the unit's
        module class (``FSDP<where>``), which torch's ``fully_shard`` names."""
        for name, p in zip(names, params):
            self.params[p] = f"{where}'s parameter {name!r}"
        for m in modules:
            self.modules[m] = owner

    def check_not_owned(self, names: Sequence[str], params: Sequence[nn.Parameter],
                        where: str) -> None:
        """Raise if one of ``params`` (named ``names`` in ``where``) belongs to another unit."""
        for name, p in zip(names, params):
            owner = self.params.get(p)
            if owner is not None:
                raise ValueError(
                    f"fully_shard({where}): parameter {name!r} is shared with {owner}, already "
                    f"managed by another fully_shard unit (a tied weight would be silently "
                    f"untied). For shared/tied parameters, use fully_shard([module_a, module_b]) "
                    f"to place them in the same unit."
                )

    def sharded_by(self, module: nn.Module) -> str | None:
        """The class name of the ``fully_shard`` module whose unit owns ``module``'s
        parameters, or ``None``."""
        return self.modules.get(module)


OWNERS = Owners()
"""The process's one :class:`Owners` registry."""


def check_no_scalar_params(names: Sequence[str], params: Sequence[nn.Parameter], where: str) -> None:
    """Raise ``ValueError`` (FSDP2's message) if one of ``params`` (named ``names`` in ``where``)
    is 0-d: a RaggedShard needs a dim to cut."""
    for name, p in zip(names, params):
        if p.ndim == 0:
            raise ValueError(
                f"fully_shard({where}) doesn't support scalar parameters. Change {name} to a "
                f"1D tensor with numel equal to 1."
            )


_EXTENSION_HOOKS = ("fsdp_pre_all_gather", "fsdp_post_all_gather")


def check_no_all_gather_extension(
    names: Sequence[str], tensors: Sequence[object], where: str
) -> None:
    """Raise ``NotImplementedError`` if one of ``tensors`` (parameters or their local tensors,
    named ``names`` in ``where``) carries FSDP2's all-gather extension hooks."""
    for name, t in zip(names, tensors):
        hooks = [h for h in _EXTENSION_HOOKS if hasattr(t, h)]
        if hooks:
            raise NotImplementedError(
                f"fully_shard({where}): parameter {name!r} ({type(t).__name__}) defines "
                f"{' and '.join(hooks)}, FSDP2's all-gather extension, which this runtime does "
                f"not run (it all-gathers a unit's flat buffer of plain tensors; the hooks would "
                f"be skipped silently). Shard this module with torch's fully_shard, or use "
                f"fully_shard(quant=...) for FP8 all-gathers."
            )


def check_granularity(granularity: object) -> None:
    """A ``{pattern: Granularity}`` mapping's keys must be strings and its values
    ``Granularity``; other policies are checked by the planner."""
    if not isinstance(granularity, Mapping):
        return
    for pattern, gran in granularity.items():
        if not isinstance(pattern, str):
            raise TypeError(
                f"granularity's keys must be fnmatch patterns (str), got {pattern!r} "
                f"({type(pattern).__name__})"
            )
        if not isinstance(gran, Granularity):
            raise TypeError(
                f"granularity maps {pattern!r} to {gran!r} ({type(gran).__name__}), "
                f"not a Granularity"
            )


def unmatched_patterns(granularity: object, modules: Sequence[nn.Module]) -> set[str]:
    """The patterns of a ``granularity`` mapping that match no parameter name of ``modules``'
    trees, relative to any module in them (``"fc1.weight"`` matches ``blocks.0.fc1.weight``)."""
    if not isinstance(granularity, Mapping) or not granularity:
        return set()
    names = {
        ".".join(parts[i:])
        for m in modules
        for fqn, _ in m.named_parameters(remove_duplicate=False)
        for parts in [fqn.split(".")]
        for i in range(len(parts))
    }
    if len(modules) > 1:  # a list's names, as the planner sees them, start with the index
        names |= {f"{i}.{fqn}" for i, m in enumerate(modules) for fqn, _ in m.named_parameters()}
    return {p for p in granularity if not any(fnmatch.fnmatchcase(n, p) for n in names)}


_WARNED_GROUPS: set[str] = set()


def warn_on_racy_gloo_groups(mesh: DeviceMesh) -> None:
    """Warn once per process group of ``mesh`` that runs gloo on more than one worker thread
    (created outside :func:`ragged_placement.one_worker_gloo`; see the module docstring)."""
    for group in mesh.get_all_groups():
        threads = gloo_worker_threads(group)
        name = getattr(group, "group_name", str(id(group)))
        if threads is None or threads <= 1 or name in _WARNED_GROUPS:
            continue
        _WARNED_GROUPS.add(name)
        warnings.warn(
            f"process group {name} runs gloo on {threads} worker threads: torch's "
            f"ProcessGroupGloo frees memory twice when two collectives of one group complete "
            f"together (a crash, 'malloc(): unaligned tcache chunk detected', or a corrupted "
            f"heap), and fully_shard overlaps collectives. Create the process groups "
            f"(init_process_group, init_device_mesh) inside `with ragged_placement."
            f"one_worker_gloo():`, whose gloo groups run one worker thread",
            stacklevel=3,
        )
