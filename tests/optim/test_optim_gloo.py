"""Muon and Shampoo on 4 real gloo processes (uneven all-to-all splits, async return path).

Muon: uneven RaggedShard pieces (one rank empty); Shampoo: element-wise flat cuts. After
10 steps the gathered parameters must equal the single-device runs of the same optimizers
(``DIST_ATOL`` of each test module: same kernels on the same inputs) and the published-algorithm
references (``REF_ATOL`` / ``ATOL``).
"""

from __future__ import annotations

import pytest
import torch
from common.muon import DIST_ATOL as MUON_DIST_ATOL
from common.muon import LR, REF_ATOL, WD, dist_muon, gather_results, max_diff, single_device_results
from common.muon import SHAPES as MUON_SHAPES
from common.shampoo import ATOL, OPTS, dist_shampoo, make_problem, reference_shampoo, single_shampoo
from common.shampoo import DIST_ATOL as SHAMPOO_DIST_ATOL
from common.shampoo import SHAPES as SHAMPOO_SHAPES
from dist_utils import run_gloo

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py


def _both(rank: int, ws: int):
    muon = {
        kind: dist_muon(
            rank, ws, kind, dict(lr=LR, weight_decay=WD, adjust_lr="match_rms_adamw"), 10
        )
        for kind in ("uneven",)
    }
    shampoo = dist_shampoo(rank, ws, "flat", 10, OPTS)
    return muon, shampoo


@pytest.mark.multiprocess
def test_gloo_four_ranks_match_single_device():
    results = run_gloo(_both, 4)
    single, reference = single_device_results()
    for kind in ("uneven",):
        per_rank = [r[0][kind] for r in results]
        full = gather_results(per_rank, MUON_SHAPES)
        assert max_diff(full, single) <= MUON_DIST_ATOL
        assert max_diff(full, reference) < REF_ATOL
        assert all(info.all_to_all_calls == 2 for r in per_rank for info in r[1])
    shampoo = [r[1] for r in results]
    full = [
        torch.cat([r[0][i].reshape(-1) for r in shampoo]).view(s)
        for i, s in enumerate(SHAMPOO_SHAPES)
    ]
    assert max_diff(full, single_shampoo()) <= SHAMPOO_DIST_ATOL
    params, grads = make_problem(0)
    assert max_diff(full, reference_shampoo(params, grads, **OPTS)) < ATOL
    assert all(r[1] == 2 for r in shampoo)
