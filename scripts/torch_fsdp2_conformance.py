"""Run torch's own FSDP2 tests with torch's ``fully_shard`` and then with ours, and compare.

torch's tests live in its source tree (``test/distributed/_composable/fsdp/test_fully_shard_*.py``),
not in the wheel; the wheel ships what they import (``torch.testing._internal.common_fsdp``). Point
``--tests`` at that folder of a pytorch checkout at the installed version's tag::

    git clone --depth 1 --branch v2.13.0 --filter=blob:none --sparse \\
        https://github.com/pytorch/pytorch && git -C pytorch sparse-checkout set test/distributed
    make conformance TORCH_TESTS=pytorch/test/distributed/_composable/fsdp

Each file runs twice, in a fresh interpreter per runtime (``torch``, then ``ours``), with the same
CPU stand-ins (``install_cpu_stand_ins``): the tests are written for CUDA/NCCL. For ``ours`` the
names ``fully_shard``, ``FSDPModule``, ``UnshardHandle``, ``register_fsdp_forward_method`` and
``share_comm_ctx`` of ``torch.distributed.fsdp`` (and of its ``_composable`` alias and
``common_fsdp``) are rebound to ``ragged_placement.fsdp``'s before the test file is imported. The
report prints per file: tests passed with torch, passed with ours, and every test that passes with
torch and not with ours, with the reason from ``KNOWN_DIFFERENCES`` (or the error, when new).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import importlib
import json
import os
import re
import subprocess
import sys
import tempfile
import traceback
import unittest
from pathlib import Path

#: The files of torch's test folder the table covers (``test_fully_shard_<name>.py``).
DEFAULT_FILES = (
    "training",
    "state_dict",
    "frozen",
    "clip_grad_norm_",
    "mixed_precision",
    "autograd",
    "comm",
    "init",
    "extensions",
    "memory",
)

#: Devices the stand-in reports (``CONFORMANCE_DEVICES``, default 4): the tests size their world
#: from it, and ``FSDPTest`` skips a test whose world is larger (the 8-rank classes at 4).
CPU_DEVICE_COUNT = int(os.environ.get("CONFORMANCE_DEVICES", "4"))

_LAYOUT = (
    "assumes FSDP2's layout, each parameter cut on dim 0 over all ranks (an empty local shard "
    "only on trailing ranks, every rank holding rows of a parameter with dim 0 >= the world "
    "size); ours packs a unit's parameters in order into one run of whole rows per rank, so a "
    "parameter sits on a contiguous range of ranks, not always including rank 0"
)
_STATE = "reads FSDP2's private state"
_LOW_PRECISION = (
    "a bf16/fp16 reduction rounds differently: on gloo ours reduce-scatters as an all-to-all, "
    "each rank summing its chunk in rank order, and divides once after the sum; FSDP2 and the "
    "test's reference use gloo's reduce_scatter_tensor with FSDP2's pre- and post-divide "
    "factors, and the test compares bitwise (a few elements differ by bf16 roundings; the "
    "fp32-reduction subtests pass)"
)
#: Tests that pass with torch and not with ours, by test id suffix, with the reason: FSDP2's
#: private state or layout, a behaviour we refuse on purpose, or an open issue owned elsewhere.
#: Anything else that passes with torch and fails with ours is reported as NEW: a bug to fix.
KNOWN_DIFFERENCES: dict[str, str] = {
    # state_dict
    "TestFullyShardStateDictMultiProcess.test_dp_state_dict_save_load": (
        f"{_LAYOUT} (rank 0 holds no row of a later parameter: `assertGreater(self.rank, 0)`)"
    ),
    "TestFullyShardStateDictMultiProcess.test_dp_tp_state_dict_save_load": _LAYOUT,
    "TestFullyShardStateDictMultiProcess.test_hsdp_tp_state_dict_save_load": _LAYOUT,
    # clip_grad_norm_
    "TestClipGradNormWorldSize2.test_clip_grad_norm_1d": (
        f"{_LAYOUT}: the test takes `vector_norm(ord=inf)` of each rank's local gradient "
        "itself, and torch raises on an empty tensor; our clip_grad_norm_ agrees for norm 2 and "
        "1 in the same test, and handles the inf-norm of empty shards "
        "(tests/fsdp/test_fsdp2_parity.py::test_clip_grad_norm_matches_one_process_and_fsdp2_with_"
        "empty_shards)"
    ),
    # frozen
    "TestFullyShardFrozen.test_train_mixed_requires_grad_per_group": (
        f"{_STATE}: patches and counts FSDP2's RegisterPostBackwardFunction.backward and its "
        "per-group dist.reduce_scatter_tensor (ours reduce-scatters a unit's packed buffer "
        "through its own collectives)"
    ),
    "TestFullyShardFrozen.test_train_mixed_requires_grad_across_groups": (
        f"{_STATE}: counts FSDP2's RegisterPostBackwardFunction.backward (the losses agree "
        "since a parameter frozen after fully_shard stopped training, issue 34)"
    ),
    # mixed_precision
    "TestFullyShardMixedPrecisionTraining.test_compute_dtype": _LOW_PRECISION,
    "TestFullyShardMixedPrecisionTraining.test_reduce_dtype": _LOW_PRECISION,
    # training
    "TestFullyShardRegisteredParams.test_modules_to_run_forward_empty_for_single_module": _STATE,
    "TestFullyShardRegisteredParams.test_param_registration_after_forward": (
        "accepted on purpose: after a forward, FSDP2 registers the unsharded parameters of the "
        "root and of units with reshard_after_forward=False in model.parameters(), which an "
        "optimizer built there then steps without ever training them; ours gives the sharded "
        "parameters at every point outside its hooks (the root keeps its gathered buffer in "
        "memory, as FSDP2's, and shows the unsharded parameters to attribute reads), so such an "
        "optimizer trains exactly as one process (tests/fsdp/test_fsdp2_semantics.py)"
    ),
    "TestFullyShardSharedParams.test_shared_params_separate_fsdp_groups_error": (
        "refused earlier on purpose: ours raises the same ValueError ('already managed by "
        "another fully_shard unit') at the second fully_shard call that shares the weight, "
        "before any collective; FSDP2 raises it at lazy init (the first forward)"
    ),
    "TestFullyShard1DTrainingCompose.test_partial_group_reshard_toggle": (
        f"{_STATE}: `_get_fsdp_state()._fsdp_param_group.is_unsharded`"
    ),
    "TestFullyShardShareCommContext.test_share_comm_context": (
        f"{_STATE}: `_get_fsdp_state()._lazy_init()`, `_comm_ctx`, FSDP2's foreach_all_gather "
        "and foreach_reduce"
    ),
    # comm
    **dict.fromkeys(
        (
            "TestFullyShardPrefetch.test_fully_shard_backward_prefetch",
            "TestFullyShardPrefetch.test_fully_shard_multi_module_backward_prefetch",
            "TestFullyShardPrefetch.test_fully_shard_multi_module_unused_module",
            "TestFullyShardPrefetch.test_set_modules_to_backward_prefetch",
            "TestFullyShardPrefetch.test_set_modules_to_backward_prefetch_inside_ac",
            "TestFullyShardPrefetch.test_set_modules_to_forward_prefetch",
        ),
        f"{_STATE}: patches FSDPParamGroup.unshard/reshard/post_backward and records their "
        "calls (ours has no FSDPParamGroup: no event is recorded)",
    ),
    **dict.fromkeys(
        (
            "TestFullyShardCommunication.test_reduce_scatter_max_input_buffers_resolves_to_max",
            "TestFullyShardReduceOpWorldSize1.test_size1_reduceop",
        ),
        f"{_STATE}: `_get_fsdp_state()`, `_comm_ctx`, `_fsdp_param_group(s)`",
    ),
    **dict.fromkeys(
        (
            "TestFullyShardCommunication.test_fully_shard_communication_count",
            "TestFullyShardCommunication.test_set_reshard_after_forward",
            "TestFullyShardCommunication.test_manual_reshard_with_reshard_after_forward_false",
        ),
        "counts FSDP2's c10d ops (`_allgather_base_`, `_reduce_scatter_base_`): on gloo ours "
        "reduce-scatters a unit with one all-to-all (gloo's reduce_scatter_tensor is an "
        "all-reduce of the whole input) and all-gathers an uneven plan with broadcasts; one "
        "collective per unit and pass as FSDP2 (tests/fsdp: CommDebugMode counts)",
    ),
    "TestFullyShardReduceOpWorldSize1.test_singleton_copy_division_divide_factor_2_0": (
        "counts FSDP2's out-of-place `aten.div.Tensor` at world size 1 with a divide factor; "
        "ours divides in place (`aten.div_.Tensor`), the gradient is the same (3 / 2)"
    ),
    "TestFullyShardAllocFromPG.test_exception_when_used_together_with_comm_hooks": (
        "refused on purpose: set_allocate_memory_from_process_group_for_comm(True) raises "
        "NotImplementedError (ours all-gathers straight into the unsharded parameters' storage)"
    ),
    # init
    **dict.fromkeys(
        (
            "TestFullyShardLazyInit.test_fully_shard_is_root",
            "TestFullyShardLazyInit.test_fully_shard_module_and_param_fqns",
            "TestFullyShardLazyInit.test_fully_shard_double_lazy_init",
            "TestFullyShardLazyInit.test_fully_shard_multi_module_root",
        ),
        f"{_STATE}: `fully_shard.state(module)`, its `_lazy_init()`, `_is_root`, `_state_ctx`, "
        "`_fsdp_param_group`",
    ),
    **dict.fromkeys(
        (
            "TestFullyShardManagedModulesAndStates.test_managed_modules_nested",
            "TestFullyShardManagedModulesAndStates.test_managed_modules_nested_fully_shard_and_"
            "replicate",
            "TestFullyShardManagedModulesAndStates.test_managed_states_nested_fully_shard",
        ),
        f"{_STATE}: calls FSDP2's private `_get_managed_modules`/`_get_managed_states`, which "
        "skip the modules FSDP2's own state registry marks as sharded (ours are not in it)",
    ),
    **dict.fromkeys(
        (
            "TestFullyShardShardedParameterTensor.test_shard_tensor_parameters",
            "TestFullyShardShardPlacementFn.test_init_1d_transformer_shard_largest_dim",
            "TestFullyShardHSDPBroadcast.test_hsdp_broadcast_across_replicas",
            "TestHSDPWithCustomHook.test_custom_hsdp_all_reduce_hook",
        ),
        f"{_LAYOUT}: the test checks `Shard` placements, `torch.chunk` local shards or local "
        "gradient shapes, or that replicas' local shards differ after filling one (two empty "
        "local shards are equal)",
    ),
    "TestFullyShardShardedParameterDTensor.test_shard_dtensor_parameters": (
        "refused on purpose: a tensor-parallel parameter sharded unevenly over the TP mesh "
        "(27 rows over 2 ranks) raises ValueError (the planner needs even TP-local shapes); the "
        f"test also checks `_StridedShard`/`Shard` placements ({_LAYOUT})"
    ),
    "TestFullyShardShardPlacementFn.test_init_2d_transformer_shard_diff_dim": (
        "refused on purpose: `shard_placement_fn` returning Shard(1) for a tensor-parallel "
        "DTensor raises ValueError (its local tensor is cut between whole dim-0 rows)"
    ),
    "TestFullyShardShardPlacementFn.test_invalid_shard_dim": (
        "refused as FSDP2 does, with a ValueError naming the parameter and the dim (FSDP2: an "
        "AssertionError 'Shard dim 1 is invalid for 1D tensor')"
    ),
    "TestFullyShardShardPlacementFn.test_init_1d_uneven_shard_largest_dim": (
        "accepted on purpose: Shard(1) of a dim the world size does not divide (FSDP2: "
        "NotImplementedError 'uneven sharding on dim 1'); ours cuts between whole slices "
        "x[i, j], losses equal FSDP2's where both run"
    ),
    "TestFullyShardShardedParameterTensor.test_raise_noncontiguous_parameter": (
        "accepted on purpose: a non-contiguous (channels_last) parameter (FSDP2: "
        "NotImplementedError); ours packs its values into the flat buffer, the unsharded "
        "parameter is a contiguous view of it (same values, default memory format)"
    ),
    "TestFullyShardMeshArg.test_2d_mesh_without_mesh_dim_names": (
        "accepted on purpose: a 2-D mesh without mesh_dim_names (FSDP2: AssertionError); ours "
        "takes dim 0 as replicate and dim 1 as shard, as FSDP2 does with names"
    ),
    "TestFullyShardMetaDeviceInit.test_invalid_meta_device_init": (
        "refused as FSDP2 does, before any collective, with a ValueError naming the unit's "
        "first parameter still on the meta device (FSDP2: a RuntimeError listing them all)"
    ),
    "TestFullyShardLazyInit.test_reset_sharded_param_in_lazy_init": (
        "open: a parameter replaced after fully_shard (a new nn.Parameter assigned to the "
        "module) is adopted by FSDP2 at lazy init; ours keeps its flat buffer and raises a "
        "ValueError at the first forward (here: that unit was never materialized from meta)"
    ),
    "TestFullyShardMetaDeviceInit.test_rank0_broadcast_meta_device_init": (
        "refused on purpose: `load_state_dict(assign=True)` raises ValueError (ours loads in "
        "place, into the flat buffer the parameters view); the test also rebuilds each shard "
        f"with `distribute_tensor(full, mesh, placements)` ({_LAYOUT})"
    ),
    # extensions
    **dict.fromkeys(
        (
            "MultiProcess.test_all_gather_extensions_train_parity",
            "MultiThread.test_all_gather_extensions_end_to_end",
            "MultiThread.test_all_gather_extensions_monkey_patch",
            "MultiThread.test_all_gather_extension_outer_size_stride",
            "MultiThread.test_all_gather_extension_hsdp_mesh",
        ),
        "refused on purpose: FSDP2's all-gather extensions (fsdp_pre_all_gather/"
        "fsdp_post_all_gather) raise NotImplementedError naming the parameter (ours gathers a "
        "unit's flat buffer of plain tensors and would skip the hooks)",
    ),
}


# -- child: one file, one runtime ---------------------------------------------------------------


def install_cpu_stand_ins() -> None:
    """Make CUDA/NCCL-written tests run on CPU ranks over gloo; the same for both runtimes.

    - ``torch.accelerator.device_count()`` and ``torch.cpu.device_count()`` report
      ``CPU_DEVICE_COUNT``: ``FSDPTest`` skips, and the tests size their world, from them.
    - ``skip_if_lt_x_gpu`` runs the test: the ranks are CPU processes.
    - ``MultiProcessTestCase`` and ``MultiProcContinuousTest`` (``FSDPTestContinuous``) fork
      their ranks instead of spawning them: a spawned rank imports torch again (seconds per
      rank on a 2-core machine) and would not see the stand-ins or the rebinding below; a
      test of a continuous class that fails does not skip the rest of its class (each test is
      counted on its own; the class's ranks and process group stay in use).
    - ``DistributedDataParallel`` (the tests' reference, through ``replicate``) drops
      ``device_ids``/``output_device``, which DDP refuses for CPU modules.
    - ``.cuda()`` on tensors and modules, ``device="cuda"`` in the common factories and
      ``init_device_mesh("cuda", ...)`` stay on CPU, and ``torch.cuda.device_count()`` reports
      ``CPU_DEVICE_COUNT``, for the older test files that name CUDA directly (they still see
      ``torch.cuda.is_available()`` false); their ``common_fsdp.test_compiled_fsdp`` is today's
      ``compiled_fsdp_test``; ``torch.cuda.can_device_access_peer`` reports ``False`` (what
      ``requires_cuda_p2p_access`` asks at import, for each pair of those devices).
    """
    import torch
    import torch.distributed.device_mesh as device_mesh
    import torch.testing._internal.common_distributed as common_distributed

    torch.accelerator.device_count = lambda: CPU_DEVICE_COUNT
    torch.cpu.device_count = lambda: CPU_DEVICE_COUNT

    def skip_if_lt_x_gpu(x, *, allow_cpu=False):
        return lambda func: func

    common_distributed.skip_if_lt_x_gpu = skip_if_lt_x_gpu

    def fork_processes(self) -> None:
        self._start_processes(torch.multiprocessing.get_context("fork").Process)

    common_distributed.MultiProcessTestCase._spawn_processes = fork_processes
    continuous = common_distributed.MultiProcContinuousTest
    continuous._spawn_processes = classmethod(_forking(continuous._spawn_processes.__func__))
    continuous_set_up = continuous.setUp

    def set_up_each(self) -> None:
        type(self).poison_pill = False  # one failure would skip the rest of its class
        continuous_set_up(self)

    continuous.setUp = set_up_each

    ddp_init = torch.nn.parallel.DistributedDataParallel.__init__

    def cpu_ddp_init(self, module, *args, **kwargs):
        kwargs.pop("device_ids", None)
        kwargs.pop("output_device", None)
        ddp_init(self, module, *args, **kwargs)

    torch.nn.parallel.DistributedDataParallel.__init__ = cpu_ddp_init

    torch.Tensor.cuda = lambda self, *args, **kwargs: self.cpu()
    torch.nn.Module.cuda = lambda self, *args, **kwargs: self.cpu()
    init_device_mesh = device_mesh.init_device_mesh

    def init_cpu_device_mesh(device_type, *args, **kwargs):
        return init_device_mesh("cpu" if device_type == "cuda" else device_type, *args, **kwargs)

    device_mesh.init_device_mesh = init_cpu_device_mesh
    torch.distributed.device_mesh.init_device_mesh = init_cpu_device_mesh
    torch.cuda.device_count = lambda: CPU_DEVICE_COUNT
    torch.cuda.can_device_access_peer = lambda *args, **kwargs: False
    # ``with torch.device("meta")`` matches the factories it redirects against a set it builds
    # (and caches) on first use: built after the wrapping below, it would hold the wrappers,
    # and the meta-device tests would build their models on CPU
    torch.utils._device._device_constructors()
    for name in _FACTORIES:
        setattr(torch, name, _on_cpu(getattr(torch, name)))
    common_fsdp = importlib.import_module("torch.testing._internal.common_fsdp")
    if not hasattr(common_fsdp, "test_compiled_fsdp"):  # its name before torch 2.7
        common_fsdp.test_compiled_fsdp = common_fsdp.compiled_fsdp_test


def _forking(spawn_processes):
    """``MultiProcContinuousTest._spawn_processes`` with fork in place of its spawn: its
    ``set_start_method("spawn")`` is skipped and ``torch.multiprocessing.Process``/``Queue``
    are the fork context's while it runs."""
    import torch.multiprocessing as mp

    def fork_processes(cls, world_size) -> None:
        fork = mp.get_context("fork")
        saved = mp.set_start_method, mp.Process, mp.Queue
        mp.set_start_method = lambda *args, **kwargs: None
        mp.Process, mp.Queue = fork.Process, fork.Queue
        try:
            spawn_processes(cls, world_size)
        finally:
            mp.set_start_method, mp.Process, mp.Queue = saved

    return fork_processes


#: Factories whose ``device="cuda"`` the older test files pass: created on CPU instead.
_FACTORIES = ("rand", "randn", "randint", "zeros", "ones", "empty", "full", "tensor", "arange")


def _on_cpu(factory):
    def factory_on_cpu(*args, **kwargs):
        device = kwargs.get("device")
        if device is not None and str(device).startswith("cuda"):
            kwargs["device"] = "cpu"
        return factory(*args, **kwargs)

    return factory_on_cpu


def install_ours() -> None:
    """Rebind torch's FSDP2 names to ``ragged_placement.fsdp``'s, where the tests import them."""
    import torch.distributed._composable.fsdp as composable_fsdp
    import torch.distributed.fsdp as torch_fsdp
    import torch.testing._internal.common_fsdp as common_fsdp

    import ragged_placement.fsdp as ours

    names = (
        "fully_shard",
        "FSDPModule",
        "UnshardHandle",
        "register_fsdp_forward_method",
        "share_comm_ctx",
    )
    for module in (torch_fsdp, composable_fsdp, common_fsdp):
        for name in names:
            if hasattr(module, name):
                setattr(module, name, getattr(ours, name))


def import_test_module(path: Path):
    """Import a torch test file with ``current_accelerator()`` reading as CPU during the import."""
    import torch

    current_accelerator = torch.accelerator.current_accelerator
    torch.accelerator.current_accelerator = lambda *args, **kwargs: torch.device("cpu")
    sys.path.insert(0, str(path.parent))
    try:
        return importlib.import_module(path.stem)
    finally:
        torch.accelerator.current_accelerator = current_accelerator


_EXCEPTION = re.compile(r"\b((?:[\w.]*(?:Error|Exception|Failure)|AssertionError)\b:.*)")


def _reason(err) -> str:
    """The exception a failure ends in: for a multi-rank test, the first rank's own (the line
    after a rank's traceback, not the runner's 'exited with' summary, nor a continuous test
    class's 'Exception in worker process:' header)."""
    text = "".join(traceback.format_exception(*err))
    for line in text.splitlines():
        match = _EXCEPTION.search(line)
        skip = ("exited with", "terminated or timed out", "Exception in worker process:")
        if match and not any(x in line for x in skip):
            return match.group(1).strip()[:300]
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return (lines[-1] if lines else "")[:300]


class _RecordingResult(unittest.TestResult):
    def __init__(self) -> None:
        super().__init__()
        self.outcomes: dict[str, dict[str, str]] = {}

    def _record(self, test, outcome: str, reason: str = "") -> None:
        test_id = test.id().split(".", 1)[-1]
        self.outcomes[test_id] = {"outcome": outcome, "reason": reason}
        print(f"  {outcome:7s} {test_id} {reason}", flush=True)

    def addSuccess(self, test):
        self._record(test, "passed")

    def addFailure(self, test, err):
        self._record(test, "failed", _reason(err))

    def addError(self, test, err):
        self._record(test, "failed", _reason(err))

    def addSkip(self, test, reason):
        self._record(test, "skipped", str(reason)[:200])

    def addExpectedFailure(self, test, err):
        self._record(test, "xfail", _reason(err))

    def addUnexpectedSuccess(self, test):
        self._record(test, "passed")


def run_child(path: Path, runtime: str, out: Path, pattern: str | None, exclude: list[str]) -> None:
    """Run one test file under one runtime and write ``{test id: outcome}`` as JSON to ``out``."""
    os.environ.setdefault("DISTRIBUTED_TESTS_DEFAULT_TIMEOUT", "300")
    install_cpu_stand_ins()
    if runtime == "ours":
        install_ours()
    outcomes: dict[str, dict[str, str]] = {}
    try:
        module = import_test_module(path)
    except Exception:
        outcomes["<import>"] = {"outcome": "failed", "reason": _reason(sys.exc_info())}
    else:
        suite = unittest.defaultTestLoader.loadTestsFromModule(module)
        suite = unittest.TestSuite(
            t
            for t in _flatten(suite)
            if (not pattern or pattern in t.id()) and not any(x in t.id() for x in exclude)
        )
        result = _RecordingResult()
        suite.run(result)
        outcomes = result.outcomes
    out.write_text(json.dumps(outcomes, indent=1, sort_keys=True))


def _flatten(suite):
    for item in suite:
        if isinstance(item, unittest.TestSuite):
            yield from _flatten(item)
        else:
            yield item


# -- parent: the table --------------------------------------------------------------------------


def _run_one(
    path: Path, runtime: str, pattern: str | None, exclude: str, timeout: float, log_dir: Path
):
    out = log_dir / f"{path.stem}.{runtime}.json"
    log = log_dir / f"{path.stem}.{runtime}.log"
    command = [sys.executable, __file__, "--child", str(path), "--runtime", runtime]
    command += ["--out", str(out)]
    if pattern:
        command += ["-k", pattern]
    if exclude:
        command += ["--exclude", exclude]
    with open(log, "w") as log_file:
        try:
            subprocess.run(
                command, stdout=log_file, stderr=subprocess.STDOUT, timeout=timeout, check=False
            )
        except subprocess.TimeoutExpired:
            reason = f"timed out after {timeout:.0f} s (log {log})"
            return {"<file>": {"outcome": "failed", "reason": reason}}
    if not out.exists():
        return {"<file>": {"outcome": "failed", "reason": f"no result (log {log})"}}
    return json.loads(out.read_text())


def known_reason(test_id: str) -> str | None:
    """The recorded reason a test passing with torch differs with ours, or ``None``."""
    for suffix, reason in KNOWN_DIFFERENCES.items():
        if test_id.endswith(suffix):
            return reason
    return None


def compare(name: str, torch_outcomes: dict, our_outcomes: dict) -> dict:
    """One file's row: counts and the differences (passes with torch, not with ours)."""
    torch_passed = sorted(t for t, o in torch_outcomes.items() if o["outcome"] == "passed")
    our_passed = {t for t, o in our_outcomes.items() if o["outcome"] == "passed"}
    differences = []
    for test_id in torch_passed:
        if test_id in our_passed:
            continue
        got = our_outcomes.get(test_id, {"outcome": "missing", "reason": ""})
        known = known_reason(test_id)
        differences.append(
            {
                "test": test_id,
                "ours": got["outcome"],
                "reason": known or f"NEW: {got['reason']}",
                "known": known is not None,
            }
        )
    return {
        "file": name,
        "tests": len(torch_outcomes),
        "torch_passed": len(torch_passed),
        "ours_passed": len(our_passed & set(torch_passed)),
        "ours_only": sorted(our_passed - set(torch_passed)),
        "differences": differences,
    }


def print_table(rows: list[dict]) -> None:
    print("\n| file | tests | passed with torch | passed with ours | differences |")
    print("|---|---|---|---|---|")
    for row in rows:
        print(
            f"| `test_fully_shard_{row['file']}.py` | {row['tests']} | {row['torch_passed']} "
            f"| {row['ours_passed']} | {len(row['differences'])} |"
        )
    total_torch = sum(r["torch_passed"] for r in rows)
    total_ours = sum(r["ours_passed"] for r in rows)
    total = sum(r["tests"] for r in rows)
    print(f"| all | {total} | {total_torch} | {total_ours} | {total_torch - total_ours} |")
    for row in rows:
        for diff in row["differences"]:
            print(f"- `{row['file']}`: `{diff['test']}` ({diff['ours']}): {diff['reason']}")
        for test_id in row["ours_only"]:
            print(f"- `{row['file']}`: `{test_id}` passes with ours only")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--tests", default=os.environ.get("TORCH_TESTS", ""),
        help="torch's test/distributed/_composable/fsdp folder",
    )
    parser.add_argument(
        "--files", default=",".join(DEFAULT_FILES),
        help="comma-separated file names without test_fully_shard_ and .py",
    )
    parser.add_argument("--runtime", choices=("torch", "ours", "both"), default="both")
    parser.add_argument("-k", dest="pattern", default=None, help="only test ids containing this")
    parser.add_argument("--exclude", default="", help="comma-separated: skip ids containing one")
    parser.add_argument("-j", "--jobs", type=int, default=1, help="runs at once (each forks ranks)")
    parser.add_argument(
        "--timeout", type=float, default=3600.0, help="hang guard per file and runtime, seconds"
    )
    parser.add_argument("--json", type=Path, default=None, help="write the rows here too")
    parser.add_argument("--child", type=Path, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child is not None:
        exclude = [x for x in args.exclude.split(",") if x]
        run_child(args.child, args.runtime, args.out, args.pattern, exclude)
        return 0
    if not args.tests or not Path(args.tests).is_dir():
        parser.error(
            f"--tests (make conformance TORCH_TESTS=...) must name the folder "
            f"test/distributed/_composable/fsdp of a pytorch checkout, got {args.tests!r}"
        )
    runtimes = ("torch", "ours") if args.runtime == "both" else (args.runtime,)
    names = [n for n in args.files.split(",") if n]
    missing = [n for n in names if not (Path(args.tests) / f"test_fully_shard_{n}.py").exists()]
    if missing:
        parser.error(f"--files names {missing} not found under {args.tests}")
    log_dir = Path(tempfile.mkdtemp(prefix="torch_fsdp2_conformance_"))
    print(f"logs: {log_dir}", flush=True)
    jobs = [(n, r) for n in names for r in runtimes]
    results: dict[tuple[str, str], dict] = {}
    with concurrent.futures.ThreadPoolExecutor(max_workers=args.jobs) as pool:
        futures = {
            pool.submit(
                _run_one, Path(args.tests) / f"test_fully_shard_{n}.py", r, args.pattern,
                args.exclude, args.timeout, log_dir,
            ): (n, r)
            for n, r in jobs
        }
        for future in concurrent.futures.as_completed(futures):
            results[futures[future]] = future.result()
            print(f"done: {futures[future]}", flush=True)
    if args.runtime != "both":
        for (name, runtime), outcomes in sorted(results.items()):
            for test_id, outcome in sorted(outcomes.items()):
                print(f"{name} {runtime} {outcome['outcome']:7s} {test_id} {outcome['reason']}")
        return 0
    rows = [compare(n, results[(n, "torch")], results[(n, "ours")]) for n in names]
    print_table(rows)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 1 if any(not d["known"] for row in rows for d in row["differences"]) else 0


if __name__ == "__main__":
    sys.exit(main())
