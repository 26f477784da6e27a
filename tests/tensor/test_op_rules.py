"""Op sharding rules on RaggedShard DTensors against the single-device result, forward and backward.

Each case is a function of full tensors; it runs once on the full tensors (the reference) and once
on DTensors distributed with RaggedShard rows (uneven units, empty runs included) over 1-8
simulated ranks, and the outputs and every input gradient must match. The incoming gradient of
the output is a random tensor distributed like the output, so backward runs the rules' own
backward ops (``mm`` with transposes, ``_softmax_backward_data``, ``native_layer_norm_backward``,
``embedding_dense_backward``, ``nll_loss_backward``, ...).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from dist_utils import run_gloo, run_threaded
from ragged_placement import RaggedShard
from ragged_placement._compat import dispatcher_runs_rewritten_ops

warnings.filterwarnings("ignore", category=FutureWarning)
# var/std of fewer elements than the correction: torch warns, and so do the single-device references
pytestmark = pytest.mark.filterwarnings("ignore:.*degrees of freedom is <= 0")
SETTINGS = settings(max_examples=8, deadline=None, suppress_health_check=list(HealthCheck))


@dataclass
class Case:
    """``fn(*inputs)``; ``inputs(L, g)`` gives ``(full tensor, placement kind)`` per input, where
    ``L`` is the number of ragged prefix rows and kind is ``"rows"`` (RaggedShard over the first
    ``prefix`` dims), ``"rep"`` (Replicate), ``"const"`` (Replicate, no gradient) or ``None`` (a
    plain Python value). ``local_kernel``: a rule the case reaches runs an op of its own on the
    local tensors (a global variance, a global extreme, an embedding of ragged rows, a mean loss),
    which needs a DTensor dispatcher that runs a rule's rewritten op
    (:func:`~ragged_placement._compat.dispatcher_runs_rewritten_ops`); on a torch without one the
    case expects the rule's ``NotImplementedError`` instead of a result."""

    fn: Callable
    inputs: Callable
    prefix: int = 1
    grad: bool = True
    local_kernel: bool = False


def _r(g, *shape):
    return torch.randn(*shape, generator=g, dtype=torch.float64)


def _ids(g, high, *shape):
    return torch.randint(0, high, shape, generator=g)


CASES: dict[str, Case] = {
    # matrix products
    "linear": Case(lambda x, w, b: F.linear(x, w, b),
                   lambda L, g: [(_r(g, L, 3), "rows"), (_r(g, 5, 3), "rep"), (_r(g, 5), "rep")]),
    "linear_3d": Case(lambda x, w: F.linear(x, w),
                      lambda L, g: [(_r(g, L, 2, 3), "rows"), (_r(g, 5, 3), "rep")]),
    "matmul": Case(lambda x, w: x @ w, lambda L, g: [(_r(g, L, 3), "rows"), (_r(g, 3, 4), "rep")]),
    "addmm": Case(lambda b, x, w: torch.addmm(b, x, w, beta=0.5, alpha=2.0),
                  lambda L, g: [(_r(g, 4), "rep"), (_r(g, L, 3), "rows"), (_r(g, 3, 4), "rep")]),
    "bmm": Case(lambda x, y: torch.bmm(x, y), lambda L, g: [(_r(g, L, 2, 3), "rows"), (_r(g, L, 3, 4), "rows")]),
    "bmm_rep": Case(lambda x, y: torch.bmm(x, y), lambda L, g: [(_r(g, L, 2, 3), "rows"), (_r(g, L, 3, 4), "rep")]),
    "contract_rows": Case(lambda x, y: x.t() @ y, lambda L, g: [(_r(g, L, 3), "rows"), (_r(g, L, 4), "rows")]),
    # views
    "view_split": Case(lambda x: x.view(x.shape[0], 2, 3) * 2, lambda L, g: [(_r(g, L, 6), "rows")]),
    "reshape_merge": Case(lambda x: x.reshape(-1, 3), lambda L, g: [(_r(g, L, 2, 3), "rows")]),
    "view_prefix_merge": Case(lambda x: x.view(-1, 3), lambda L, g: [(_r(g, L, 2, 3), "rows")], prefix=2),
    "flatten_unflatten": Case(lambda x: x.flatten(1).unflatten(1, (3, 2)), lambda L, g: [(_r(g, L, 2, 3), "rows")]),
    "transpose": Case(lambda x: x.transpose(1, 2).contiguous() * 3, lambda L, g: [(_r(g, L, 2, 3), "rows")]),
    "permute_prefix2": Case(lambda x: x.permute(0, 1, 3, 2), lambda L, g: [(_r(g, L, 2, 3, 2), "rows")], prefix=2),
    "slice_select": Case(lambda x: x[:, 1:3] * x[:, 0:1] + x.select(1, 2)[:, None],
                         lambda L, g: [(_r(g, L, 4), "rows")]),
    "index_select": Case(lambda x, i: x.index_select(1, i), lambda L, g: [(_r(g, L, 4), "rows"),
                                                                        (torch.tensor([3, 0, 3]), "rep")]),
    "cat_stack": Case(lambda x, y: torch.cat([x, y], dim=1) + torch.stack([x, y], dim=-1).sum(-1).repeat(1, 2),
                      lambda L, g: [(_r(g, L, 3), "rows"), (_r(g, L, 3), "rows")]),
    "split_unbind_squeeze": Case(
        lambda x: torch.cat(x.split([1, 2], dim=1)[::-1], 1) * sum(c.sum(-1, keepdim=True) for c in x.chunk(2, 2))
        + sum(x.unbind(2))[:, :, None] + x[:, :, :1].squeeze(2)[:, :, None],
        lambda L, g: [(_r(g, L, 3, 4), "rows")]),
    "cat_replicated": Case(lambda x, y: torch.cat([x, y], dim=-1), lambda L, g: [(_r(g, L, 2), "rows"),
                                                                               (_r(g, L, 3), "rep")]),
    # normalization
    "softmax": Case(lambda x: torch.softmax(x, -1) * torch.log_softmax(x, 1).exp(),
                    lambda L, g: [(_r(g, L, 5), "rows")]),
    "softmax_prefix2": Case(lambda x: torch.softmax(x, 2), lambda L, g: [(_r(g, L, 2, 4), "rows")], prefix=2),
    "layer_norm": Case(lambda x, w, b: F.layer_norm(x, (6,), w, b),
                       lambda L, g: [(_r(g, L, 6), "rows"), (_r(g, 6), "rep"), (_r(g, 6), "rep")]),
    "layer_norm_2d": Case(lambda x: F.layer_norm(x, (2, 3)), lambda L, g: [(_r(g, L, 2, 3), "rows")]),
    "rms_norm": Case(lambda x, w: F.rms_norm(x, (6,), w, eps=1e-6),
                     lambda L, g: [(_r(g, L, 6), "rows"), (_r(g, 6), "rep")]),
    # statistics
    "var_std": Case(lambda x: x.var() + x.std(correction=0) * 2, lambda L, g: [(_r(g, L, 3), "rows")],
                    local_kernel=True),
    "var_rows_dim": Case(lambda x: x.var(0, keepdim=True) * x.std(dim=(0, 1)),
                         lambda L, g: [(_r(g, L, 3), "rows")], local_kernel=True),
    "var_within_rows": Case(lambda x: x.var(-1) + x.std(2, correction=0), lambda L, g: [(_r(g, L, 2, 4), "rows")],
                            prefix=2),
    "amax_amin": Case(lambda x: x.amax() - x.amin(dim=(0, 1)) + x.amax(1).sum(), lambda L, g: [(_r(g, L, 5), "rows")],
                      local_kernel=True),
    "max_min": Case(lambda x: x.max() * x.min(), lambda L, g: [(_r(g, L, 2), "rows")], local_kernel=True),
    "argmax": Case(lambda x: x.argmax(1) + x.argmin(-1, keepdim=True).squeeze(1), lambda L, g: [(_r(g, L, 5), "rows")],
                   grad=False),
    # embedding and loss
    "embedding_rows": Case(lambda w, i: F.embedding(i, w) * 3, lambda L, g: [(_r(g, L, 4), "rows"),
                                                                            (_ids(g, max(L, 1), 5, 2), "rep")],
                           local_kernel=True),
    "embedding_batch": Case(lambda i, w: F.embedding(i, w, padding_idx=1),
                            lambda L, g: [(_ids(g, 6, L, 2), "rows"), (_r(g, 6, 3), "rep")]),
    "cross_entropy_mean": Case(lambda x, t, w: F.cross_entropy(x, t, w, ignore_index=2),
                               lambda L, g: [(_r(g, L, 5), "rows"), (_ids(g, 5, L), "rows"),
                                             (_r(g, 5).abs(), "const")], local_kernel=True),
    "cross_entropy_sum_none": Case(
        lambda x, t: F.cross_entropy(x, t, reduction="sum") + F.cross_entropy(x, t, reduction="none").sum() * 0.5,
        lambda L, g: [(_r(g, L, 5), "rows"), (_ids(g, 5, L), "rows")]),
}


def _row_placements(layout: str, units, prefix: int, ndim: int):
    rows = RaggedShard(tuple(range(prefix)), units)
    if layout == "1d":
        return [rows]
    if layout == "rep_rows":  # e.g. HSDP's replicate dim, then the ragged rows
        return [Replicate(), rows]
    return [rows, Shard(1) if ndim > 1 else Replicate()]  # "rows_shard1": the rules replicate dim 1 first


def _distribute(mesh, t, kind, units, prefix, layout):
    if kind is None:
        return t
    if kind in ("rep", "const"):
        d = distribute_tensor(t, mesh, [Replicate()] * mesh.ndim)
    else:
        d = distribute_tensor(t, mesh, _row_placements(layout, units, prefix, t.ndim))
    return d.requires_grad_(t.is_floating_point() and kind != "const")


def _full(x):
    return x.full_tensor() if isinstance(x, DTensor) else x


def _assert_close(actual, expected, what, rtol=1e-7, atol=1e-9):
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol, equal_nan=True, msg=lambda m: f"{what}: {m}")


# A GEMM over fewer rows may take another BLAS kernel with another summation order: on some CPUs
# the local [4, 4] x [4, 5] product differs from the rows of the full [12, 4] x [4, 5] one by
# 2.4e-7 (measured); torch's own fp32 tolerance then applies to what is computed from it.
_GEMM_TOL = {"rtol": 1.3e-6, "atol": 1e-5}


def _check_case(rank, world, name, units, per_unit, seed, layout="1d"):
    case = CASES[name]
    mesh = init_device_mesh("cpu", (world,) if layout == "1d" else (2, world // 2))
    g = torch.Generator().manual_seed(seed)
    rows = sum(units) * per_unit
    inputs = case.inputs(rows, g)
    ref = [t.clone().requires_grad_(k not in (None, "const") and t.is_floating_point()) for t, k in inputs]
    dts = [_distribute(mesh, t.clone(), k, units, case.prefix, layout) for t, k in inputs]
    try:
        expected = case.fn(*ref)
    except (RuntimeError, IndexError):  # e.g. amax of an empty tensor: the DTensor raises too
        with pytest.raises((RuntimeError, IndexError, NotImplementedError)):
            case.fn(*dts)
        return
    if case.local_kernel and not dispatcher_runs_rewritten_ops():
        with pytest.raises(NotImplementedError, match="DTensor dispatcher does not support"):
            case.fn(*dts)
        return
    out = case.fn(*dts)
    _assert_close(_full(out), expected, f"{name} forward")
    if not case.grad or not expected.requires_grad:
        return
    grad = torch.randn(expected.shape, generator=g, dtype=expected.dtype)
    expected.backward(grad)
    grad_placements = [Replicate() if p.is_partial() else p for p in out.placements]
    out.backward(distribute_tensor(grad, mesh, grad_placements))
    for i, (r, d) in enumerate(zip(ref, dts)):
        if r.requires_grad:
            _assert_close(_full(d.grad), r.grad, f"{name} grad of input {i}")


FAMILIES = {
    "matrix": ["linear", "linear_3d", "matmul", "addmm", "bmm", "bmm_rep", "contract_rows"],
    "views": ["view_split", "reshape_merge", "view_prefix_merge", "flatten_unflatten", "transpose",
              "permute_prefix2", "slice_select", "index_select", "cat_stack", "cat_replicated",
              "split_unbind_squeeze"],
    "norms": ["softmax", "softmax_prefix2", "layer_norm", "layer_norm_2d", "rms_norm"],
    "stats": ["var_std", "var_rows_dim", "var_within_rows", "amax_amin", "max_min", "argmax"],
    "nn": ["embedding_rows", "embedding_batch", "cross_entropy_mean", "cross_entropy_sum_none"],
}


def _check_family(rank, world, names, units, per_unit, seed):
    for name in names:
        _check_case(rank, world, name, units, per_unit, seed)


def test_families_cover_every_case():
    assert sorted(n for names in FAMILIES.values() for n in names) == sorted(CASES)


units_st = st.integers(1, 8).flatmap(
    lambda n: st.lists(st.integers(0, 3), min_size=n, max_size=n).filter(lambda u: sum(u) > 0))


@pytest.mark.parametrize("family", sorted(FAMILIES))
@SETTINGS
@given(units=units_st, per_unit=st.integers(0, 2), seed=st.integers(0, 2**16))
def test_ops_match_single_device(one_torch_thread, family, units, per_unit, seed):
    """Every case of ``family`` on 1-8 simulated ranks with random units (zeros included) and
    0-2 rows per unit (empty tensors included): output and gradients equal the full-tensor run."""
    run_threaded(_check_family, len(units), FAMILIES[family], tuple(units), per_unit, seed)


# Cases that run on a (2, 2) mesh too: the rows on one mesh dim, Replicate or Shard(1) on the other.
MESH_2D_CASES = ["linear", "linear_3d", "contract_rows", "bmm_rep", "view_split", "slice_select", "cat_replicated",
                 "softmax", "layer_norm", "rms_norm", "var_std", "amax_amin", "embedding_batch", "cross_entropy_mean"]


def _check_2d(rank, world, layout, units, per_unit, seed):
    for name in MESH_2D_CASES:
        # rms_norm's mean over a Shard(1) hidden dim is a pending mean, and its in-place add_
        # then raises (as torch's own rules do): not a layout rms_norm runs on
        if not (layout == "rows_shard1" and name == "rms_norm"):
            _check_case(rank, world, name, units, per_unit, seed, layout)


@pytest.mark.parametrize("layout", ["rep_rows", "rows_shard1"])
@pytest.mark.parametrize("units", [(1, 2), (0, 3)])
def test_ops_on_2d_mesh(one_torch_thread, layout, units):
    """On a 2x2 mesh: rows on the second mesh dim next to Replicate, or on the first next to a
    ``Shard(1)`` (which the rules replicate before a row-wise op); an empty run included."""
    run_threaded(_check_2d, 4, layout, units, 1, 7)


def _check_unsupported(rank, world):
    mesh = init_device_mesh("cpu", (world,))
    g = torch.Generator().manual_seed(0)
    rows = RaggedShard((0,), (1, 0, 2))
    x = distribute_tensor(torch.randn(6, 4, 3, generator=g), mesh, [rows]).requires_grad_()
    m = distribute_tensor(torch.randn(6, 3, generator=g), mesh, [rows])
    flat2 = distribute_tensor(torch.randn(6, 2, 3, generator=g), mesh, [RaggedShard((0, 1), (1, 0, 2))])
    rep = distribute_tensor(torch.randn(3, 6, generator=g), mesh, [Replicate()])
    ids = distribute_tensor(torch.randint(0, 5, (6, 2), generator=g), mesh, [rows])
    table = distribute_tensor(torch.randn(5, 3, generator=g), mesh, [Replicate()]).requires_grad_()
    cases = [
        (r"aten._softmax.*dim 0", lambda: torch.softmax(x, 0)),
        (r"aten.transpose.int", lambda: x.transpose(0, 1)),
        (r"aten.unsqueeze.default", lambda: x.unsqueeze(0)),
        (r"aten.mm.default.*replicated left operand", lambda: rep @ m),
        (r"aten.var.correction.*part of the dims", lambda: flat2.var(1)),
        (r"aten.amax.default.*part of the dims", lambda: flat2.amax(1)),
        (r"aten.argmax.default", lambda: m.argmax(0)),
        (r"aten.native_layer_norm.default", lambda: torch.nn.functional.layer_norm(x, (6, 4, 3))),
        (r"aten.cumsum.default", lambda: torch.cumsum(x, 0)),
        (r"aten.sum.default.*transpose of a RaggedShard", lambda: m.t().sum()),
        (r"aten.add.Tensor.*transpose of a RaggedShard", lambda: m.t() + rep),
        # a [1, 1, 1] replica against a (0, 1)-prefix whose local tensor has 2 dims
        (r"aten.mul.Tensor.*do not broadcast",
         lambda: flat2 * distribute_tensor(torch.ones(1, 1, 1), mesh, [Replicate()])),
        (r"aten.embedding_dense_backward.*scale_grad_by_freq",
         lambda: torch.nn.functional.embedding(ids, table, scale_grad_by_freq=True).sum().backward()),
    ]
    for pattern, fn in cases:
        with pytest.raises(NotImplementedError, match=pattern):
            fn()
    # cat along the ragged prefix (parameters_to_vector) has a rule now: it gathers, exactly
    joined = torch.cat([x, x], 0)
    assert joined.placements == (Replicate(),)
    assert torch.equal(joined.to_local(), torch.cat([x.full_tensor()] * 2, 0))
    with pytest.raises(RuntimeError, match="not supported"):  # the transposed layout does not redistribute
        m.t().full_tensor()


def test_ops_without_a_rule_raise(one_torch_thread):
    """Uses outside the rules raise ``NotImplementedError`` naming the op, never a wrong result."""
    run_threaded(_check_unsupported, 3)


def _rms_norm_backward_reference(grad_out, x, normalized_shape, rstd, weight, output_mask):
    """``_fused_rms_norm_backward`` from its formula: torch has only a CUDA kernel, and the rule
    (what F.rms_norm dispatches on GPU) is what this test checks."""
    dims = list(range(x.ndim - len(normalized_shape), x.ndim))
    xhat = x * rstd
    gw = grad_out * weight if weight is not None else grad_out
    grad_input = rstd * (gw - xhat * (gw * xhat).mean(dims, keepdim=True))
    lead = list(range(x.ndim - len(normalized_shape)))
    return grad_input, (grad_out * xhat).sum(lead)


def _check_fused_rms_norm(rank, world, units):
    mesh = init_device_mesh("cpu", (world,))
    g = torch.Generator().manual_seed(3)
    rows = sum(units) * 2
    x, go, w = torch.randn(rows, 2, 4, generator=g), torch.randn(rows, 2, 4, generator=g), torch.randn(4, generator=g)
    placement = [RaggedShard((0,), units)]
    dx, dgo = distribute_tensor(x, mesh, placement), distribute_tensor(go, mesh, placement)
    dw = distribute_tensor(w, mesh, [Replicate()])
    with torch.inference_mode():  # the composite op reaches DTensor whole, as it does on CUDA
        out, rstd = torch.ops.aten._fused_rms_norm.default(dx, [4], dw, 1e-6)
    ref_out, ref_rstd = torch.ops.aten._fused_rms_norm.default(x, [4], w, 1e-6)
    assert out.placements == rstd.placements == tuple(placement)
    _assert_close(out.full_tensor(), ref_out, "_fused_rms_norm")
    _assert_close(rstd.full_tensor(), ref_rstd, "_fused_rms_norm rstd")
    gi, gw = torch.ops.aten._fused_rms_norm_backward.default(dgo, dx, [4], rstd, dw, [True, True])
    ref_gi, ref_gw = _rms_norm_backward_reference(go, x, [4], ref_rstd, w, [True, True])
    assert gi.placements == tuple(placement) and gw.placements[0].is_partial()
    _assert_close(gi.full_tensor(), ref_gi, "_fused_rms_norm_backward input")
    _assert_close(gw.full_tensor(), ref_gw, "_fused_rms_norm_backward weight")


def test_fused_rms_norm_rules(one_torch_thread):
    """The rules for ``_fused_rms_norm`` and its backward (F.rms_norm on CUDA), with a reference
    CPU kernel for the backward registered for this test only."""
    lib = torch.library.Library("aten", "IMPL")  # noqa: TOR901
    lib.impl("_fused_rms_norm_backward", _rms_norm_backward_reference, "CPU")
    try:
        run_threaded(_check_fused_rms_norm, 3, (1, 0, 2))
        run_threaded(_check_fused_rms_norm, 2, (0, 1))
    finally:
        lib._destroy()


def _check_local_kernels_refused(rank, world):
    mesh = init_device_mesh("cpu", (world,))
    x = distribute_tensor(torch.randn(5, 7), mesh, [RaggedShard((0,), (2, 3))])
    for pattern, fn in [(r"aten.var.correction.*global_var", lambda: x.var()),
                        (r"aten.amax.default.*extreme", lambda: x.amax()),
                        (r"aten.squeeze.default.*squeeze.dims", lambda: x[:, :1].squeeze())]:
        with pytest.raises(NotImplementedError, match=pattern):
            fn()


def test_rules_with_local_kernels_raise_where_the_dispatcher_cannot_run_them(monkeypatch, one_torch_thread):
    """On a torch whose DTensor dispatcher would run the original op instead of a rule's own local
    kernel (a local variance where a global one is due), those rules raise."""
    from ragged_placement.ops import _common

    monkeypatch.setattr(_common, "dispatcher_runs_rewritten_ops", lambda: False)
    run_threaded(_check_local_kernels_refused, 2)


def _check_all_families(rank, world):
    for names in FAMILIES.values():
        _check_family(rank, world, names, (1, 0, 2, 1), 2, 11)


@pytest.mark.multiprocess
def test_ops_match_single_device_on_gloo():
    """Every case once on 4 real gloo processes (functional collectives by group name, c10d's own
    max/min reductions), uneven units with an empty run."""
    run_gloo(_check_all_families, 4)


def _check_inference_mode(rank, world):
    mesh = init_device_mesh("cpu", (world,))
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(6, 2, 4, generator=g), torch.randn(5, 4, generator=g)
    t = torch.randint(0, 5, (12,), generator=g)
    rows = [RaggedShard((0,), (1, 0, 2))]
    d, dt = distribute_tensor(x, mesh, rows), distribute_tensor(t, mesh, rows)
    dw = distribute_tensor(w, mesh, [Replicate()])
    with torch.inference_mode():  # composite ops (linear, layer_norm, cross_entropy, ...) reach DTensor whole
        y = F.linear(d, dw)
        _assert_close(y.full_tensor(), F.linear(x, w), "linear", **_GEMM_TOL)
        _assert_close(F.layer_norm(y, (5,)).full_tensor(), F.layer_norm(F.linear(x, w), (5,)), "layer_norm", **_GEMM_TOL)
        if dispatcher_runs_rewritten_ops():  # the mean loss is a local kernel of its own (see Case)
            _assert_close(F.cross_entropy(y.reshape(-1, 5), dt).full_tensor(),
                          F.cross_entropy(F.linear(x, w).reshape(-1, 5), t), "cross_entropy", **_GEMM_TOL)
        else:
            with pytest.raises(NotImplementedError, match="nll_loss_mean.*DTensor dispatcher does not support"):
                F.cross_entropy(y.reshape(-1, 5), dt)
        _assert_close(F.rms_norm(d, (4,)).full_tensor(), F.rms_norm(x, (4,)), "rms_norm")
        _assert_close(torch.softmax(d, -1).flatten(1).unflatten(1, (4, 2)).full_tensor(),
                      torch.softmax(x, -1).flatten(1).unflatten(1, (4, 2)), "softmax, flatten, unflatten")
    # squeeze() would squeeze a one-row run dim locally: the rule names the dims (outside inference
    # mode, where DTensor's aliasing fix-up of a rewritten view op fails on inference tensors)
    if dispatcher_runs_rewritten_ops():  # the rule runs squeeze.dims in place of squeeze()
        _assert_close(d[:, :1].squeeze().full_tensor(), x[:, :1].squeeze(), "squeeze()")
    else:
        with pytest.raises(NotImplementedError, match="squeeze.dims.*DTensor dispatcher does not support"):
            d[:, :1].squeeze()


def test_ops_under_inference_mode(one_torch_thread):
    """Under inference mode DTensor sees composite ops undecomposed: those without a rule raise
    NotImplementedError, which DTensor answers by decomposing them into ops with rules."""
    run_threaded(_check_inference_mode, 3)
