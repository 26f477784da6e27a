"""Block-diagonal Shampoo with grafting, on RaggedShard / Shard(0) / Replicate DTensors.

Definition (per matrix ``W``; a 3-D parameter is a stack of matrices). ``W`` is cut into blocks
of at most ``B x B`` (``B = max_preconditioner_dim``), row block ``i``, column block ``j``. Every
step ``t`` with gradient block ``G``::

    L <- L + G G^T,   R <- R + G^T G                     (fp32, per block)
    every precondition_frequency steps, starting at t = 1:
        L_root <- (L + eps I)^e_left,  R_root <- (R + eps I)^e_right
        (fp32 symmetric eigendecomposition, negative eigenvalues clamped to 0 first)
    P <- L_root G R_root
    D <- grafting direction of G (see below);   U <- P * ||D||_F / (||P||_F + 1e-16)
    W <- W * (1 - lr * weight_decay) - lr * U

Grafting (the step size of each block comes from a diagonal method's update norm):
``"sgd"``: ``D = G``; ``"rmsprop"``: ``v <- b2 v + (1 - b2) G^2``, ``D = G / (sqrt(v) + eps_g)``;
``"adam"``: ``m <- lerp(m, G, 1 - b1)``, ``v`` as rmsprop, ``D = m_hat / (sqrt(v_hat) + eps_g)``
(bias corrected); ``"none"``: ``U = P``. Parameters with fewer than 2 dims get ``U = D``
(``G`` for ``"none"``).

Distribution: the unit of work is a row slab (one row block, all its column blocks), a
contiguous range of the flattened parameter. A slab held whole by one rank is computed there
with its state; when the placement cuts only on B-row boundaries (``RaggedShard`` with
``B``-row units, or whole matrices per rank) that is every slab and a step issues no collective.
Otherwise slabs are gathered to owners (greedy LPT on their FLOPs) with one
``all_to_all_single`` and the updates return with one more, as in :mod:`.muon`. Owners are fixed
at the first step, so slab state stays where it was built. On an N-D mesh with one sharded dim
(HSDP) every slab has one owner in the whole mesh, so its statistics and roots exist once, not
once per replica row; the updates reach the other rows by one all-gather per ``Replicate`` dim
(:mod:`._sharding`), also when every slab is whole on a rank.

Slab state (statistics, roots, grafting moments) lives only on the slab's owner and is saved as
rank-local tensors under ``state[p]["blocks"][offset]``, ``offset`` the slab's first element in
the whole flattened parameter (also for a block of an expert stack: ``Layout.offset``): it
reloads into the same world size and placements. State of parameters with fewer than 2 dims has the parameter's placement.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
from ragged_placement.optim._mesh_nd import (
    assign_nd_owners,
    gather_to_owner,
    owner_placements,
    scatter_from_owner,
    sharded_on_several_dims,
)
from ragged_placement.optim._sharding import (
    Exchange,
    Item,
    Layout,
    _whole,
    assign_owners,
    check_grad_placement,
    layout_of,
    local_flat,
)
from ragged_placement.optim._state import (
    ShardedStateOptimizer,
    check_non_negative,
    check_unit_interval,
)

__all__ = ["Shampoo", "matrix_power"]

GRAFTING = ("adam", "rmsprop", "sgd", "none")


def matrix_power(a: torch.Tensor, exponent: float, epsilon: float) -> torch.Tensor:
    """``(a + epsilon I)^exponent`` of a symmetric PSD ``a``, by fp32 eigendecomposition."""
    evals, evecs = torch.linalg.eigh(a.float())
    evals = evals.clamp_min(0.0).add_(epsilon).pow_(exponent)
    return (evecs * evals) @ evecs.mT


def _spans(size: int, block: int) -> list[tuple[int, int]]:
    return [(s, min(s + block, size)) for s in range(0, size, block)]


class Shampoo(ShardedStateOptimizer):
    """Block-diagonal Shampoo (see the module docstring for the exact update).

    Args:
        params: tensors or param groups.
        lr: learning rate.
        max_preconditioner_dim: block size ``B``.
        precondition_frequency: recompute the inverse roots every this many steps.
        epsilon: added to the statistics' eigenvalues before the root.
        exponents: ``(e_left, e_right)``, the powers of ``L`` and ``R``.
        grafting: ``"adam"``, ``"rmsprop"``, ``"sgd"`` or ``"none"``.
        grafting_betas: ``(b1, b2)`` of the grafting method.
        grafting_epsilon: epsilon of the grafting method.
        weight_decay: decoupled weight decay.
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        max_preconditioner_dim: int = 1024,
        precondition_frequency: int = 10,
        epsilon: float = 1e-12,
        exponents: tuple[float, float] = (-0.25, -0.25),
        grafting: str = "adam",
        grafting_betas: tuple[float, float] = (0.9, 0.999),
        grafting_epsilon: float = 1e-8,
        weight_decay: float = 0.0,
    ) -> None:
        defaults = {
            "lr": lr,
            "max_preconditioner_dim": max_preconditioner_dim,
            "precondition_frequency": precondition_frequency,
            "epsilon": epsilon,
            "exponents": tuple(exponents),
            "grafting": grafting,
            "grafting_betas": tuple(grafting_betas),
            "grafting_epsilon": grafting_epsilon,
            "weight_decay": weight_decay,
        }
        self._owners: dict[tuple, dict[tuple[int, int, int], int]] = {}
        self._exchanges: dict[tuple, Exchange] = {}
        self.last_step_all_to_all_calls = 0
        self.last_step_all_gather_calls = 0
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group after checking its hyper-parameters."""
        super().add_param_group(param_group)
        g = self.param_groups[-1]
        check_non_negative("lr", g["lr"])
        check_non_negative("weight_decay", g["weight_decay"])
        check_non_negative("epsilon", g["epsilon"])
        check_non_negative("grafting_epsilon", g["grafting_epsilon"])
        for name in ("max_preconditioner_dim", "precondition_frequency"):
            v = g[name]
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        if g["grafting"] not in GRAFTING:
            raise ValueError(f"grafting must be one of {GRAFTING}, got {g['grafting']!r}")
        if len(g["exponents"]) != 2 or any(not e < 0 for e in g["exponents"]):
            raise ValueError(
                f"exponents must be two negative floats (left, right), got {g['exponents']!r}"
            )
        if len(g["grafting_betas"]) != 2:
            raise ValueError(f"grafting_betas must be a pair, got {g['grafting_betas']!r}")
        check_unit_interval("grafting_betas[0]", g["grafting_betas"][0])
        check_unit_interval("grafting_betas[1]", g["grafting_betas"][1])

    # -- planning --------------------------------------------------------------------------------
    def _slabs(self, param_index: int, layout: Layout, group: dict[str, Any]) -> list[Item]:
        """Row slabs of every matrix of a parameter, with their FLOP cost."""
        rows, cols = layout.shape[-2:]
        block = group["max_preconditioner_dim"]
        freq = group["precondition_frequency"]
        items = []
        for b in range(math.prod(layout.shape[:-2])):
            for r0, r1 in _spans(rows, block):
                r = r1 - r0
                cost = sum(
                    8 * r * (c1 - c0) * (r + c1 - c0) + 10 * (r**3 + (c1 - c0) ** 3) / freq
                    for c0, c1 in _spans(cols, block)
                )
                items.append(Item(param_index, b * rows * cols + r0 * cols, (r, cols), cost))
        return items

    def _owner_map(self, key: tuple) -> dict[tuple[int, int, int], int]:
        """Owner of every slab of every matrix parameter of exchange ``key``
        (``Layout.exchange_key``), fixed at first use."""
        if key not in self._owners:
            params = [
                (p, g)
                for g in self.param_groups
                for p in g["params"]
                if p.ndim >= 2
                and not sharded_on_several_dims(p)
                and layout_of(p).exchange_key == key
            ]
            layouts = [layout_of(p) for p, _ in params]
            items = [it for i, (p, g) in enumerate(params) for it in self._slabs(i, layouts[i], g)]
            owners, _ = assign_owners(items, layouts)
            self._owners[key] = {
                (id(params[it.param][0]), it.start, it.numel): o for it, o in zip(items, owners)
            }
        return self._owners[key]

    # -- step ------------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.last_step_all_to_all_calls = 0
        self.last_step_all_gather_calls = 0
        matrices: list[tuple[torch.Tensor, dict[str, Any]]] = []
        for g in self.param_groups:
            for p in g["params"]:
                if p.grad is None:
                    continue
                check_grad_placement(p)
                state = self.state[p]
                if "step" not in state:
                    state["step"] = torch.tensor(0.0)
                state["step"] += 1
                if g["weight_decay"]:
                    local_flat(p).mul_(1 - g["lr"] * g["weight_decay"])
                if p.ndim >= 2:
                    matrices.append((p, g))
                else:
                    grad = local_flat(p.grad).float()
                    update = self._graft(grad, state, g, int(state["step"].item()))
                    local_flat(p).add_(update, alpha=-g["lr"])

        self._step_nd([m for m in matrices if sharded_on_several_dims(m[0])])
        matrices = [m for m in matrices if not sharded_on_several_dims(m[0])]
        by_group: dict[Any, list[int]] = {}
        layouts = [layout_of(p) for p, _ in matrices]
        for i, layout in enumerate(layouts):
            by_group.setdefault(layout.exchange_key, []).append(i)
        for key, idx in by_group.items():
            self._step_matrices(key, [matrices[i] for i in idx], [layouts[i] for i in idx])
        return loss

    def _step_nd(self, entries: list[tuple[torch.Tensor, dict[str, Any]]]) -> None:
        """Matrices sharded over several mesh dims: the gradient goes whole to a balanced owner by DTensor
        redistribution, the owner runs every slab (and keeps their statistics), the update comes
        back in the parameter's placements."""
        params = [p for p, _ in entries]
        for (p, g), owner in zip(entries, assign_nd_owners(params, [p.numel() for p in params])):
            placements = owner_placements(p, owner)
            full = gather_to_owner(local_flat(p.grad).float(), p, placements)
            if full.numel():  # this rank owns the matrix
                flat = full.reshape(-1)
                out = torch.empty_like(flat)
                for it in self._slabs(0, _whole(tuple(p.shape)), g):
                    out[it.start:it.end] = self._slab_update((p, g), it, flat[it.start:it.end].view(it.shape)).reshape(-1)
                full = out.view(full.shape)
            update = scatter_from_owner(full, p, placements)
            local_flat(p).add_(update.reshape(-1), alpha=-g["lr"])

    def _step_matrices(
        self, key: tuple, entries: list[tuple[torch.Tensor, dict[str, Any]]], layouts: list[Layout]
    ) -> None:
        grads = [local_flat(p.grad).float() for p, _ in entries]
        items = [it for i, (_, g) in enumerate(entries) for it in self._slabs(i, layouts[i], g)]
        pg = layouts[0].group
        if pg is None:  # whole on every rank: every slab is computed here
            outs = [torch.empty_like(g) for g in grads]
            for it in items:
                upd = self._slab_update(
                    entries[it.param], it, grads[it.param][it.start : it.end].view(it.shape),
                    layouts[it.param].offset,
                )
                outs[it.param][it.start : it.end] = upd.reshape(-1)
        else:
            owner_of = self._owner_map(key)
            owners = [owner_of[(id(entries[it.param][0]), it.start, it.numel)] for it in items]
            key = tuple((id(p), layout) for (p, _), layout in zip(entries, layouts))
            ex = self._exchanges.get(key)
            if ex is None:
                ex = self._exchanges[key] = Exchange(
                    items, owners, layouts, pg, layouts[0].rank, torch.float32, grads[0].device
                )
            pending = ex.start_gather(grads)
            results = {}
            offsets = [layout.offset for layout in layouts]
            for k in ex.local_owned:  # overlaps the gather
                results[k] = self._slab_update(
                    entries[items[k].param], items[k], ex.assemble(k, grads, None),
                    offsets[items[k].param],
                )
            recv = pending.wait()
            for k in sorted(ex.remote_owned):
                results[k] = self._slab_update(
                    entries[items[k].param], items[k], ex.assemble(k, grads, recv),
                    offsets[items[k].param],
                )
            back = ex.start_scatter(results)
            self.last_step_all_to_all_calls += 2 if ex.traffic else 0
            self.last_step_all_gather_calls += ex.replica_gather_stats()[0]
            outs = [torch.empty_like(g) for g in grads]
            ex.finish_scatter(back, results, outs)
        for (p, g), out in zip(entries, outs):
            local_flat(p).add_(out, alpha=-g["lr"])

    def _slab_update(
        self, entry: tuple[torch.Tensor, dict[str, Any]], item: Item, grad: torch.Tensor,
        offset: int = 0,
    ) -> torch.Tensor:
        """Shampoo update of one row slab (owner side); creates the slab's state on first use,
        under the slab's offset in the whole parameter (``offset``: the item's layout's)."""
        p, g = entry
        state = self.state[p]
        step = int(state["step"].item())
        blocks = state.setdefault("blocks", {})
        cols = item.shape[1]
        spans = _spans(cols, g["max_preconditioner_dim"])
        rows = item.shape[0]
        key = offset + item.start
        slab = blocks.get(key)
        if slab is None:
            slab = blocks[key] = {
                "L": [grad.new_zeros(rows, rows) for _ in spans],
                "R": [grad.new_zeros(c1 - c0, c1 - c0) for c0, c1 in spans],
                "L_root": [grad.new_zeros(rows, rows) for _ in spans],
                "R_root": [grad.new_zeros(c1 - c0, c1 - c0) for c0, c1 in spans],
            }
        direction = self._graft(grad, slab, g, step) if g["grafting"] != "none" else None
        recompute = (step - 1) % g["precondition_frequency"] == 0
        e_left, e_right = g["exponents"]
        out = torch.empty_like(grad)
        for j, (c0, c1) in enumerate(spans):
            gb = grad[:, c0:c1]
            slab["L"][j].addmm_(gb, gb.mT)
            slab["R"][j].addmm_(gb.mT, gb)
            if recompute:
                slab["L_root"][j] = matrix_power(slab["L"][j], e_left, g["epsilon"])
                slab["R_root"][j] = matrix_power(slab["R"][j], e_right, g["epsilon"])
            pre = slab["L_root"][j] @ gb @ slab["R_root"][j]
            if direction is not None:
                pre.mul_(direction[:, c0:c1].norm() / (pre.norm() + 1e-16))
            out[:, c0:c1] = pre
        return out

    @staticmethod
    def _graft(
        grad: torch.Tensor, state: dict[str, Any], g: dict[str, Any], step: int
    ) -> torch.Tensor:
        """The grafting method's update direction for ``grad`` (``exp_avg``, ``exp_avg_sq``)."""
        kind = g["grafting"]
        if kind in ("sgd", "none"):
            return grad
        beta1, beta2 = g["grafting_betas"]
        eps = g["grafting_epsilon"]
        if "exp_avg_sq" not in state:
            state["exp_avg_sq"] = torch.zeros_like(grad)
            if kind == "adam":
                state["exp_avg"] = torch.zeros_like(grad)
        v = state["exp_avg_sq"]
        v.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        if kind == "rmsprop":
            return grad / (v.sqrt() + eps)
        m = state["exp_avg"]
        m.lerp_(grad, 1 - beta1)
        return (m / (1 - beta1**step)) / ((v / (1 - beta2**step)).sqrt() + eps)
