"""The trainer with a fault injected, for the tests of its restarts and failure reports.

``torchrun ... tests/train/fault_injection.py TRAIN_ARGS`` runs :func:`ragged_placement.train.main`
with :func:`inject` as its test-only ``on_step`` seam. ``RAGGED_PLACEMENT_TRAIN_FAULT=kill:R:S``
(or ``hang:R:S``) makes rank ``R`` die (SIGKILL) or freeze when it starts step ``S``, in
torchrun's first attempt only: the restarted workers run clean.
"""

from __future__ import annotations

import os
import signal
import sys
import time

FAULT_ENV = "RAGGED_PLACEMENT_TRAIN_FAULT"
SCRIPT = os.path.abspath(__file__)


def inject(rank: int, step: int) -> None:
    """Kill or freeze this process if :data:`FAULT_ENV` names ``(rank, step)`` (first attempt)."""
    spec = os.environ.get(FAULT_ENV)
    if not spec or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return
    kind, fault_rank, fault_step = spec.split(":")
    if kind not in ("kill", "hang"):
        raise ValueError(f"{FAULT_ENV}={spec!r}: expected kill:<rank>:<step> or hang:<rank>:<step>")
    if (rank, step) != (int(fault_rank), int(fault_step)):
        return
    if kind == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(3600)  # "hang": frozen until torchrun's agent ends it


if __name__ == "__main__":
    from ragged_placement._gloo import exit_without_finalization
    from ragged_placement.train import main

    main(sys.argv[1:], on_step=inject)
    exit_without_finalization()  # as a torchrun worker: see its docstring
