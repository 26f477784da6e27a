"""Muon on RaggedShard / Shard(0) / Replicate DTensors and plain tensors.

The update of one matrix ``W`` with gradient ``G`` (Keller Jordan's Muon, in the same form as
``torch.optim.Muon``)::

    B <- lerp(B, G, 1 - momentum)                    # momentum buffer, local (sharded) state
    U <- lerp(G, B, momentum) if nesterov else B
    O <- NewtonSchulz(U)                              # bf16 (ns_dtype), 5 quintic steps, see newton_schulz.py
    W <- W * (1 - lr * weight_decay) - adjusted_lr * O

``adjust_lr``: ``"original"`` scales ``lr`` by ``sqrt(max(1, rows / cols))`` (Keller Jordan);
``"match_rms_adamw"`` by ``0.2 * sqrt(max(rows, cols))`` (Moonlight, so AdamW's lr and weight
decay carry over). The names are ``torch.optim.Muon``'s ``adjust_lr_fn`` values.

Parameters of a group with ``"algorithm": "adamw"`` get ``torch.optim.AdamW``'s update instead
(keys ``lr``, ``betas``, ``adamw_eps``, ``weight_decay``): embeddings, norms, biases, heads.

Distribution. Everything before and after ``NewtonSchulz`` is elementwise and runs on local
shards. Each matrix (3-D parameters: each matrix of the stack) has an owner rank; the owner is the
rank that holds all of it when one does, otherwise it is chosen by greedy LPT over the NS FLOPs.
Per step, one ``all_to_all_single`` sends every rank's bf16 pieces of every matrix to its owner
(NS runs in bf16 on the bf16 cast of ``U``, so bf16 on the wire is exact; ``ns_dtype=torch.float32``
runs NS and the exchange in fp32, for comparisons that a flipped bf16 rounding would blur),
owners orthogonalize,
and one ``all_to_all_single`` returns the pieces, asynchronously, while the AdamW parameters are
updated. Matrices whole on their owner are orthogonalized while the first collective is in flight.
When every matrix is whole on some rank of a 1-D mesh no collective is issued at all.

On an N-D mesh with one sharded dim (HSDP) each matrix still has one owner in the whole mesh, so
every Newton-Schulz runs once in the world, not once per replica row; the momentum stays
replicated. The all-to-alls run inside each replica row and one all-gather per ``Replicate``
dim brings the other rows' results (:mod:`._sharding`); that all-gather runs even when every
matrix is whole on a rank. Parameters sharded over several mesh dims (FSDP x TP) move one matrix
at a time by DTensor redistribution (:mod:`._mesh_nd`), except stacks split by whole matrices on
all those dims but one (FSDP x EP experts: ``Shard(0)`` over ``ep``): each ep rank's block is
its own problem over the other dim's group (:func:`~._sharding.stack_layout`), so an expert
held whole on a rank is orthogonalized there and sends nothing.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from ragged_placement.optim._adamw import adamw_math, adamw_update
from ragged_placement.optim._flat import (
    LOCAL,
    FlatStep,
    NotFlat,
    flat_step_enabled,
    flat_view,
    run_candidates,
)
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
    assign_owners,
    check_grad_placement,
    layout_of,
    local_flat,
    local_tensor,
)
from ragged_placement.optim._state import (
    ShardedStateOptimizer,
    check_non_negative,
    check_unit_interval,
)
from ragged_placement.optim.newton_schulz import (
    DEFAULT_NS_COEFFICIENTS,
    newton_schulz,
    newton_schulz_flops,
)

__all__ = ["Muon", "MuonStepInfo", "adjusted_lr"]

ADJUST_LR = ("original", "match_rms_adamw")
_BATCH_MAX_NUMEL = 1 << 20
ALGORITHMS = ("muon", "adamw")
NS_DTYPES = (torch.bfloat16, torch.float32)


def adjusted_lr(lr: float, adjust_lr: str, rows: int, cols: int) -> float:
    """``lr`` scaled for a ``rows x cols`` matrix (see the module docstring)."""
    if adjust_lr == "original":
        return lr * math.sqrt(max(1.0, rows / cols))
    if adjust_lr == "match_rms_adamw":
        return lr * 0.2 * math.sqrt(max(rows, cols))
    raise ValueError(f"adjust_lr must be one of {ADJUST_LR}, got {adjust_lr!r}")


@dataclass
class MuonStepInfo:
    """What the last :meth:`Muon.step` did (machine-independent counts).

    ``bytes_sent``: bytes this rank put on the wire in its all-to-alls (both directions) and its
    replica all-gathers. ``all_to_all_calls``, ``all_gather_calls``: collectives this rank issued
    (all-gathers: one per ``Replicate`` mesh dim, see :class:`~._sharding.Exchange`).
    ``flops_per_rank``: NS FLOPs assigned to each owner slot of the (last) process group by the
    owner plan (on N-D meshes: slot ``row * group_size + rank`` of each replica row);
    ``flops_local``: NS FLOPs of
    unsharded (plain / Replicate) matrices, which every rank computes itself. ``nd_matrices``:
    matrices sharded over several mesh dims (FSDP x TP), moved by DTensor redistribution (not counted in the fields above).
    """

    bytes_sent: int = 0
    all_to_all_calls: int = 0
    all_gather_calls: int = 0
    nd_matrices: int = 0
    flops_per_rank: list[float] = field(default_factory=list)
    flops_local: float = 0.0

    @property
    def flops_imbalance(self) -> float:
        """max / mean of :attr:`flops_per_rank` (1.0 is perfect)."""
        if not self.flops_per_rank or max(self.flops_per_rank) == 0:
            return 1.0
        return max(self.flops_per_rank) / (sum(self.flops_per_rank) / len(self.flops_per_rank))


class _Plan:
    """Owners and exchange for one process group (cached while the layouts stay the same)."""

    def __init__(
        self, layouts: list[Layout], items: list[Item], device: torch.device, dtype: torch.dtype
    ) -> None:
        self.owners, self.loads = assign_owners(items, layouts)
        first = layouts[0]
        self.exchange = Exchange(items, self.owners, layouts, first.group, first.rank, dtype, device)


class Muon(ShardedStateOptimizer):
    """Muon with AdamW param groups, stepping directly on sharded DTensors.

    Args:
        params: tensors or param groups. A group with ``"algorithm": "adamw"`` is updated by
            AdamW; other groups must hold 2-D matrices or 3-D stacks of matrices.
        lr: learning rate (Muon groups: before ``adjust_lr``).
        momentum: momentum in [0, 1).
        nesterov: use Nesterov momentum.
        ns_steps: Newton-Schulz iterations.
        ns_coefficients: quintic coefficients ``(a, b, c)``.
        eps: added to the Frobenius norm before NS.
        weight_decay: decoupled weight decay (``W *= 1 - lr * weight_decay``), both algorithms.
        adjust_lr: ``"original"`` or ``"match_rms_adamw"``.
        betas: AdamW betas (adamw groups).
        adamw_eps: AdamW epsilon (adamw groups).
        ns_dtype: the dtype Newton-Schulz runs in and the exchange moves: ``torch.bfloat16``
            (Muon's) or ``torch.float32`` (exact comparisons: in bf16 a gradient difference of
            one fp32 rounding can flip a rounding of ``U`` and move the update by ~1e-3).
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 0.02,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_steps: int = 5,
        ns_coefficients: tuple[float, float, float] = DEFAULT_NS_COEFFICIENTS,
        eps: float = 1e-7,
        weight_decay: float = 0.0,
        adjust_lr: str = "original",
        betas: tuple[float, float] = (0.9, 0.95),
        adamw_eps: float = 1e-8,
        ns_dtype: torch.dtype = torch.bfloat16,
    ) -> None:
        if ns_dtype not in NS_DTYPES:
            raise ValueError(f"ns_dtype must be one of {NS_DTYPES}, got {ns_dtype!r}")
        self.ns_dtype = ns_dtype
        defaults = {
            "algorithm": "muon",
            "lr": lr,
            "momentum": momentum,
            "nesterov": nesterov,
            "ns_steps": ns_steps,
            "ns_coefficients": tuple(ns_coefficients),
            "eps": eps,
            "weight_decay": weight_decay,
            "adjust_lr": adjust_lr,
            "betas": tuple(betas),
            "adamw_eps": adamw_eps,
        }
        self._plans: dict[tuple, _Plan] = {}
        self.last_step_info = MuonStepInfo()
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group after checking its hyper-parameters and parameter shapes."""
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        if group["algorithm"] not in ALGORITHMS:
            raise ValueError(f"algorithm must be one of {ALGORITHMS}, got {group['algorithm']!r}")
        check_non_negative("lr", group["lr"])
        check_non_negative("weight_decay", group["weight_decay"])
        betas = group["betas"]
        if len(betas) != 2:
            raise ValueError(f"betas must be a pair, got {betas!r}")
        check_unit_interval("betas[0]", betas[0])
        check_unit_interval("betas[1]", betas[1])
        check_non_negative("adamw_eps", group["adamw_eps"])
        if group["algorithm"] == "adamw":
            return
        check_unit_interval("momentum", group["momentum"])
        check_non_negative("eps", group["eps"])
        if (
            isinstance(group["ns_steps"], bool)
            or not isinstance(group["ns_steps"], int)
            or group["ns_steps"] < 1
        ):
            raise ValueError(f"ns_steps must be a positive int, got {group['ns_steps']!r}")
        if len(group["ns_coefficients"]) != 3:
            raise ValueError(
                f"ns_coefficients must be three floats (a, b, c), got {group['ns_coefficients']!r}"
            )
        if group["adjust_lr"] not in ADJUST_LR:
            raise ValueError(f"adjust_lr must be one of {ADJUST_LR}, got {group['adjust_lr']!r}")
        for i, p in enumerate(group["params"]):
            if p.ndim not in (2, 3):
                hint = (
                    "put vectors and scalars in a param group with 'algorithm': 'adamw'"
                    if p.ndim < 2
                    else "reshape it to a matrix or a 3-D stack of matrices, or use an "
                    "'adamw' group"
                )
                raise ValueError(
                    f"params[{i}] has shape {tuple(p.shape)}: Muon orthogonalizes 2-D matrices and "
                    f"3-D stacks of matrices; {hint}"
                )

    def _plan(self, layouts: list[Layout], items: list[Item], params: list[torch.Tensor]) -> _Plan:
        key = tuple((id(p), layout) for p, layout in zip(params, layouts))
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plans[key] = _Plan(
                layouts, items, local_flat(params[0]).device, self.ns_dtype
            )
        return plan

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        info = MuonStepInfo()
        entries: list[tuple[torch.Tensor, dict[str, Any]]] = [
            (p, g)
            for g in self.param_groups
            if g["algorithm"] == "muon"
            for p in g["params"]
            if p.grad is not None
        ]
        # 1. momentum, locally; U in ns_dtype (what NS consumes) is what travels. On runs of
        #    flat shards (a unit's matrices back to back) one op per run; weight decay (6.)
        #    runs on the same runs.
        flat = flat_step_enabled()
        decays: list[tuple[list[torch.Tensor], float]] = []
        if flat:
            updates, decayed = self._flat_momenta(entries, decays)
        else:
            updates, decayed = [self._momentum(p, g) for p, g in entries], set()

        # 2. split parameters into unsharded ones (plain / Replicate: every rank computes them)
        #    and one exchange per process group.
        #    Parameters sharded over several mesh dims (FSDP x TP) go through DTensor
        #    redistribution instead; one sharded dim (HSDP) exchanges over that dim's group.
        by_group: dict[Any, list[int]] = {}
        unsharded: list[int] = []
        nd = [i for i, (p, _) in enumerate(entries) if sharded_on_several_dims(p)]
        layouts = [None if sharded_on_several_dims(p) else layout_of(p) for p, _ in entries]
        for i, layout in enumerate(layouts):
            if layout is not None:
                (unsharded if layout.group is None else by_group.setdefault(layout.exchange_key, [])).append(i)
        exchanges = []
        for idx in by_group.values():
            sub_layouts = [layouts[i] for i in idx]
            items = [
                Item(j, b * m * n, (m, n), newton_schulz_flops(m, n, entries[i][1]["ns_steps"]))
                for j, i in enumerate(idx)
                for m, n in [layouts[i].shape[-2:]]
                for b in range(math.prod(layouts[i].shape[:-2]))
            ]
            plan = self._plan(sub_layouts, items, [entries[i][0] for i in idx])
            flats = [updates[i] for i in idx]
            pending = plan.exchange.start_gather(flats)
            info.all_to_all_calls += pending.work is not None
            info.bytes_sent += sum(plan.exchange.send_splits) * self.ns_dtype.itemsize
            info.flops_per_rank = plan.loads
            exchanges.append((idx, plan.exchange, flats, pending))

        # 3. while the gathers fly: NS of unsharded parameters and of matrices already on their
        #    owner.
        unsharded_out = {
            i: self._orthogonalize({0: updates[i].view(layouts[i].shape)}, entries[i][1])[0]
            for i in unsharded
        }
        info.flops_local = sum(
            newton_schulz_flops(*layouts[i].shape[-2:], entries[i][1]["ns_steps"])
            * math.prod(layouts[i].shape[:-2])
            for i in unsharded
        )
        nd_out = self._step_nd(entries, updates, nd)
        info.nd_matrices = len(nd)
        results: list[dict[int, torch.Tensor]] = []
        for idx, ex, flats, _ in exchanges:
            results.append(self._orthogonalize_items(ex, ex.local_owned, flats, None, entries, idx))

        # 4. the rest once their pieces are here; 5. send results back asynchronously.
        returns = []
        for (idx, ex, flats, pending), res in zip(exchanges, results):
            recv = pending.wait()
            res.update(
                self._orthogonalize_items(ex, sorted(ex.remote_owned), flats, recv, entries, idx)
            )
            back = ex.start_scatter(res)
            info.all_to_all_calls += back.work is not None
            info.bytes_sent += sum(ex.recv_splits) * self.ns_dtype.itemsize
            calls, sent = ex.replica_gather_stats()
            info.all_gather_calls += calls
            info.bytes_sent += sent
            returns.append(back)

        # 6. meanwhile: weight decay, unsharded parameters, AdamW groups.
        for tensors, factor in decays:
            for t in tensors:
                t.mul_(factor)
        for j, (p, g) in enumerate(entries):
            if g["weight_decay"] and j not in decayed:
                local_flat(p).mul_(1 - g["lr"] * g["weight_decay"])
        for i in unsharded:
            self._apply(entries[i], unsharded_out[i])
        for i, out in nd_out.items():
            self._apply(entries[i], out)
        for g in self.param_groups:
            if g["algorithm"] == "adamw":
                params = [p for p in g["params"] if p.grad is not None]
                rest = self._flat_adamw(params, g) if flat and params else params
                for p in rest:
                    check_grad_placement(p)
                    adamw_update(
                        local_tensor(p),
                        local_tensor(p.grad),
                        self.state[p],
                        lr=g["lr"],
                        betas=g["betas"],
                        eps=g["adamw_eps"],
                        weight_decay=g["weight_decay"],
                    )

        # 7. land the returned pieces (flat: one foreach add per learning rate).
        for (idx, ex, flats, _), res, back in zip(exchanges, results, returns):
            outs = [torch.empty_like(f) for f in flats]
            ex.finish_scatter(back, res, outs)
            if flat:
                self._apply_all([entries[i] for i in idx], outs)
            else:
                for j, i in enumerate(idx):
                    self._apply(entries[i], outs[j])
        self.last_step_info = info
        return loss

    def _flat_momenta(
        self,
        entries: list[tuple[torch.Tensor, dict[str, Any]]],
        decays: list[tuple[list[torch.Tensor], float]],
    ) -> tuple[list[torch.Tensor], set[int]]:
        """Step 1 on runs of flat shards, per param group: the momentum buffers adopted into
        one buffer per run (:class:`~._flat.FlatStep`), ``lerp`` and the cast once per run,
        each matrix's ``U`` a view of its run's. Appends each group's weight decay on the same
        runs to ``decays``; returns the updates (1-D, as :meth:`_momentum`'s) and the entries
        that decay there."""
        updates: list[torch.Tensor | None] = [None] * len(entries)
        decayed: set[int] = set()
        by_group: dict[int, tuple[dict[str, Any], list[int]]] = {}
        for j, (_, g) in enumerate(entries):
            by_group.setdefault(id(g), (g, []))[1].append(j)
        for group, idx in by_group.values():
            params = [entries[j][0] for j in idx]
            grads = [p.grad for p in params]
            cand, rest = run_candidates(params, [grads])
            for k in rest:
                updates[idx[k]] = self._momentum(params[k], group)
            if not cand:
                continue
            ps = [params[k] for k in cand]
            states = [self.state[p] for p in ps]
            try:
                step = FlatStep(
                    [list(map(LOCAL, ps)), [grads[k]._local_tensor for k in cand],
                     [st.get("momentum_buffer") for st in states]],
                    2, None, lambda _, i, view: states[i].__setitem__("momentum_buffer", view),
                )
            except NotFlat:
                for k in cand:
                    updates[idx[k]] = self._momentum(params[k], group)
                continue
            m = group["momentum"]
            for run, g, buf in zip(step.runs, step.tensors[1], step.tensors[2]):
                buf.lerp_(g, 1 - m)
                u = (g.lerp(buf, m) if group["nesterov"] else buf).to(self.ns_dtype).view(-1)
                offset = 0
                for i in run.members:
                    numel = ps[i]._local_tensor.numel()
                    updates[idx[cand[i]]] = u[offset : offset + numel]
                    offset += numel
            if group["weight_decay"]:
                decays.append((step.tensors[0], 1 - group["lr"] * group["weight_decay"]))
                decayed.update(idx[k] for k in cand)
        return updates, decayed

    def _flat_adamw(self, params: list[torch.Tensor], group: dict[str, Any]) -> list[torch.Tensor]:
        """An ``"adamw"`` group's step on runs of flat shards (:class:`~._flat.FlatStep`):
        :func:`~._adamw.adamw_math` once per run with its step count. Returns the parameters
        left to the per-parameter update."""
        grads = [p.grad for p in params]
        cand, rest = run_candidates(params, [grads])
        if not cand:
            return params
        ps = [params[k] for k in cand]
        states = [self.state[p] for p in ps]
        fresh = ["step" not in st for st in states]
        keys = ("exp_avg", "exp_avg_sq")
        lists = [list(map(LOCAL, ps)), [grads[k]._local_tensor for k in cand],
                 *([None if new else st[key] for st, new in zip(states, fresh)] for key in keys)]
        steps = [torch.tensor(0.0) if new else st["step"] for st, new in zip(states, fresh)]
        try:
            step = FlatStep(lists, 2, steps, lambda k, i, view: states[i].__setitem__(keys[k - 2], view))
        except NotFlat:
            return params
        for st, new, count in zip(states, fresh, steps):
            if new:
                st["step"] = count
        torch._foreach_add_(step.steps, 1)
        for p, g, exp_avg, exp_avg_sq, count in zip(*step.tensors, step.steps):
            adamw_math(p, g, exp_avg, exp_avg_sq, int(count.item()), lr=group["lr"],
                       betas=group["betas"], eps=group["adamw_eps"],
                       weight_decay=group["weight_decay"])
        step.finish()
        return [params[k] for k in rest]

    @staticmethod
    def _apply_all(entries: list[tuple[torch.Tensor, dict[str, Any]]], updates: list[torch.Tensor]) -> None:
        """:meth:`_apply` of every entry, as one foreach add per learning rate."""
        by_lr: dict[float, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
        for (p, group), update in zip(entries, updates):
            rows, cols = p.shape[-2:]
            lr = adjusted_lr(group["lr"], group["adjust_lr"], rows, cols)
            local = local_tensor(p)
            if not local.is_contiguous():
                raise ValueError(f"local tensor of shape {tuple(local.shape)} must be contiguous")
            params, outs = by_lr.setdefault(lr, ([], []))
            params.append(flat_view(local, local.numel()))
            outs.append(update.reshape(-1))
        for lr, (params, outs) in by_lr.items():
            torch._foreach_add_(params, outs, alpha=-lr)

    def _step_nd(
        self, entries: list[tuple[torch.Tensor, dict[str, Any]]], updates: list[torch.Tensor], nd: list[int]
    ) -> dict[int, torch.Tensor]:
        """Newton-Schulz of parameters sharded over several mesh dims: each matrix is gathered to an owner by
        DTensor redistribution, orthogonalized there and returned in its own placements."""
        if not nd:
            return {}
        params = [entries[i][0] for i in nd]
        costs = [
            newton_schulz_flops(*p.shape[-2:], entries[i][1]["ns_steps"]) * math.prod(p.shape[:-2])
            for i, p in zip(nd, params)
        ]
        out = {}
        for i, p, owner in zip(nd, params, assign_nd_owners(params, costs)):
            placements = owner_placements(p, owner)
            full = gather_to_owner(updates[i], p, placements)
            if full.numel():  # this rank owns the matrix
                full = self._orthogonalize({0: full.view(p.shape)}, entries[i][1])[0].to(self.ns_dtype)
            out[i] = scatter_from_owner(full, p, placements)
        return out

    def _momentum(self, p: torch.Tensor, group: dict[str, Any]) -> torch.Tensor:
        check_grad_placement(p)
        grad = local_flat(p.grad)
        state = self.state[p]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(local_tensor(p.grad))
        buf = state["momentum_buffer"].view(-1)
        m = group["momentum"]
        buf.lerp_(grad, 1 - m)
        update = grad.lerp(buf, m) if group["nesterov"] else buf
        return update.to(self.ns_dtype)

    def _orthogonalize(
        self, mats: dict[int, torch.Tensor], group: dict[str, Any]
    ) -> dict[int, torch.Tensor]:
        """NS of every matrix (or stack) in ``mats``.

        Small matrices of equal shape run as one batch (they are launch-bound); matrices of at
        least ``_BATCH_MAX_NUMEL`` elements run one by one (a stack would only add a copy).
        """
        by_shape: dict[tuple[int, ...], list[int]] = {}
        for k, x in mats.items():
            by_shape.setdefault(tuple(x.shape), []).append(k)
        out = {}
        for shape, keys in by_shape.items():
            chunks = [keys] if math.prod(shape) < _BATCH_MAX_NUMEL else [[k] for k in keys]
            for chunk in chunks:
                batch = (
                    torch.stack([mats[k] for k in chunk])
                    if len(chunk) > 1
                    else mats[chunk[0]].unsqueeze(0)
                )
                ortho = newton_schulz(
                    batch, group["ns_steps"], group["ns_coefficients"], group["eps"],
                    dtype=self.ns_dtype,
                )
                out.update(zip(chunk, ortho.unbind(0)))
        return out

    def _orthogonalize_items(
        self,
        ex: Exchange,
        keys: list[int],
        flats: list[torch.Tensor],
        recv: torch.Tensor | None,
        entries: list[tuple[torch.Tensor, dict[str, Any]]],
        idx: list[int],
    ) -> dict[int, torch.Tensor]:
        by_group: dict[int, dict[int, torch.Tensor]] = {}
        groups: dict[int, dict[str, Any]] = {}
        for k in keys:
            group = entries[idx[ex.items[k].param]][1]
            groups[id(group)] = group
            by_group.setdefault(id(group), {})[k] = ex.assemble(k, flats, recv)
        out: dict[int, torch.Tensor] = {}
        for gid, mats in by_group.items():
            out.update(self._orthogonalize(mats, groups[gid]))
        return out

    @staticmethod
    def _apply(entry: tuple[torch.Tensor, dict[str, Any]], update: torch.Tensor) -> None:
        p, group = entry
        rows, cols = p.shape[-2:]
        lr = adjusted_lr(group["lr"], group["adjust_lr"], rows, cols)
        local_flat(p).add_(update.reshape(-1), alpha=-lr)
