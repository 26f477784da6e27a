"""Process-group set-up under ``torchrun`` and bounded failure of a collective.

:func:`init_distributed` reads torchrun's environment, picks the backend from the device
(NCCL on CUDA, gloo on CPU) and puts every key of this attempt under a per-attempt prefix of
torchrun's store (``TORCHELASTIC_RESTART_COUNT``): with the agent's store, workers restarted by
``--max-restarts`` would otherwise read the previous attempt's rendezvous keys and fail to
connect or hang in ``init_process_group``.

:class:`CollectiveWatch` makes a dead or frozen rank an error on the others: every collective
has the process group's timeout, each rank publishes the step it has reached in the store, and
a collective that fails is re-raised as a ``RuntimeError`` naming the collective, the step and
the ranks that did not reach it. It also times the communication this rank waits for.
"""

from __future__ import annotations

import datetime
import functools
import os
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from typing_extensions import Self  # a dependency of torch

import ragged_placement._compat as compat
from ragged_placement.fsdp import collectives

__all__ = ["CollectiveWatch", "DistributedEnv", "init_distributed", "torchrun_env"]

_WATCHED = [
    (dist, ("all_reduce", "broadcast", "barrier", "all_gather", "all_gather_into_tensor",
            "reduce_scatter_tensor", "all_to_all_single", "all_gather_object",
            "all_gather_single", "reduce_scatter_single")),
    (compat, ("_all_gather", "_reduce_scatter", "reduce_scatter_by_all_to_all")),
    (collectives, ("_coalesced",)),
]
# Waits on an asynchronous collective (c10d's Work, which _CoalescingManager.wait also uses)
_WAITS = [(dist.Work, ("wait",))]


class DistributedEnv:
    """The rank's place in the job: ``rank``, ``world_size``, ``local_rank``, ``device``, the
    store the process group was built on and its collectives' timeout."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    store: dist.Store
    timeout_s: float

    def __init__(self, rank: int, world_size: int, local_rank: int, device: torch.device,
                 store: dist.Store, timeout_s: float) -> None:
        self.rank, self.world_size, self.local_rank = rank, world_size, local_rank
        self.device, self.store, self.timeout_s = device, store, timeout_s


def torchrun_env() -> tuple[int, int, int]:
    """``(rank, world_size, local_rank)`` from torchrun's environment, or a ValueError."""
    missing = [v for v in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if v not in os.environ]
    if missing:
        raise ValueError(
            f"environment variables {', '.join(missing)} are not set: start the trainer with "
            "torchrun, e.g. torchrun --standalone --nproc-per-node 2 -m ragged_placement.train"
        )
    return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_RANK", "0"))


def pick_device(name: str, local_rank: int) -> torch.device:
    """``cuda:<local_rank>`` for ``auto`` when CUDA is available (or for ``cuda``), else CPU."""
    if name == "cuda" or (name == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise ValueError("--device cuda: CUDA is not available on this machine")
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def init_distributed(device_name: str, timeout_s: float) -> DistributedEnv:
    """The default process group of this torchrun worker (gloo on CPU, NCCL on CUDA), with
    every collective bounded by ``timeout_s`` and this attempt's keys under their own prefix."""
    rank, world, local_rank = torchrun_env()
    device = pick_device(device_name, local_rank)
    timeout = datetime.timedelta(seconds=timeout_s)
    base = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                         is_master=False, timeout=timeout) if _agent_store() else None
    if base is None:  # no torchrun agent store: rank 0 hosts one
        base = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                             is_master=rank == 0, timeout=timeout, multi_tenant=True)
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    store = dist.PrefixStore(f"ragged_placement/attempt_{attempt}/", base)
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)
    return DistributedEnv(rank, world, local_rank, device, store, timeout_s)


def _agent_store() -> bool:
    return os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"


class CollectiveWatch:
    """Inside ``with``: every collective a rank enters is counted and published in the store
    (``progress/<rank>``: count, step, name); :meth:`failure` turns a collective's error into
    one that names the collective, the step and the ranks that entered fewer collectives (dead
    or frozen before reaching it).

    ``seconds``: the wall time this rank spent inside a collective call or a wait on an
    asynchronous one (c10d's ``Work.wait``), outermost calls only: the communication the rank
    was blocked on, not what overlapped its compute."""

    env: DistributedEnv
    step: int
    count: int
    last: str
    seconds: float
    _depth: int
    _saved: list[tuple[object, str, Callable]]

    def __init__(self, env: DistributedEnv) -> None:
        self.env, self.step, self.count, self.last = env, -1, 0, "none"
        self.seconds, self._depth, self._saved = 0.0, 0, []

    def __enter__(self) -> Self:
        for watched, wrap in ((_WATCHED, self._named), (_WAITS, self._waited)):
            for obj, names in watched:
                for name in names:
                    fn = getattr(obj, name, None)
                    if fn is not None:
                        self._saved.append((obj, name, fn))
                        setattr(obj, name, wrap(name.lstrip("_"), fn))
        return self

    def __exit__(self, *exc) -> None:
        for obj, name, fn in reversed(self._saved):
            setattr(obj, name, fn)
        self._saved.clear()

    def _named(self, name: str, fn: Callable) -> Callable:
        @functools.wraps(fn)
        def entered(*args, **kwargs):
            self.last = name  # the innermost watched call is the one named
            if self._depth == 0:  # one collective, however many wrappers it goes through
                self.count += 1
                self.env.store.set(f"progress/{self.env.rank}", f"{self.count} {self.step} {name}")
            return self._timed(fn, *args, **kwargs)

        return entered

    def _waited(self, name: str, fn: Callable) -> Callable:
        @functools.wraps(fn)
        def waited(*args, **kwargs):
            return self._timed(fn, *args, **kwargs)

        return waited

    def _timed(self, fn: Callable, *args, **kwargs):
        t0 = time.perf_counter()
        self._depth += 1
        try:
            return fn(*args, **kwargs)
        finally:
            self._depth -= 1
            if self._depth == 0:
                self.seconds += time.perf_counter() - t0

    def _behind(self) -> list[str]:
        behind = []
        for r in range(self.env.world_size):
            key = f"progress/{r}"
            try:  # check first: get would wait for a key that is not there
                progress = self.env.store.get(key).decode() if self.env.store.check([key]) else ""
            except RuntimeError:  # the store is gone
                progress = ""
            if not progress:
                behind.append(f"rank {r} (no collective recorded)")
                continue
            count, step, name = progress.split()
            if int(count) < self.count:
                behind.append(f"rank {r} (entered {count} collectives, the last {name} in step {step})")
        return behind

    def failure(self, error: BaseException) -> RuntimeError:
        """The error to raise for the collective that failed or timed out in this step."""
        behind = self._behind()
        who = ", ".join(behind) if behind else "none"
        return RuntimeError(
            f"rank {self.env.rank}: collective {self.last} (number {self.count}) in step {self.step} "
            f"failed or timed out (--collective-timeout {self.env.timeout_s:g} s); ranks behind "
            f"it, dead or frozen: {who}. Cause: {error}"
        )
