"""``fsdp_vs_fsdp2.py --device cpu|cuda --world W``: both runtimes in one process on one device.

With ``W > 1`` the process joins torch's fake process group (``FakeStore``, backend ``"fake"``):
every collective returns at once without moving data, so each runtime does all its own copies,
casts, allocations and compute of a rank in a world of ``W`` while communication costs nothing.
The all-gathered parameters are then whatever the buffers held (the numbers computed are
meaningless; the work is not). ``dist.all_gather_object`` (the planner's check that every rank
planned the same layout) returns this rank's object for every rank: all ranks of a fake world
are this one. With ``W == 1`` it is a real one-rank group (NCCL on CUDA, gloo on CPU; from
``torchrun``'s environment when launched by it).

Per runtime and run: ``--warmup`` steps, then ``--steps`` timed steps (median kept; on CUDA each
step ends in a device synchronize), the peak of ``torch.cuda.max_memory_allocated`` over them
(on CPU the heap peak of a fresh model's steps, :func:`_runtime_table.peak_memory`), one step
under :class:`~ragged_placement.testing.profiling.CollectiveMeter` (the bytes each rank would
move: what an all-gather receives, what a reduce-scatter sends, on a ring) and one under the
torch profiler: the device time of the kernels whose names say they copy (``copy``, ``Memcpy``,
``chunk_cat``, ``CatArray``: FSDP2's copy-in/copy-out, the mixed-precision casts, any other
``copy_``), against all kernels' time; on CPU the ops' own CPU time instead.
"""

from __future__ import annotations

import contextlib
import gc
import os
import re
import statistics
import time
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist

from torch import nn

from _runtime_table import peak_memory
from ragged_placement.testing.profiling import CollectiveMeter
from ragged_placement.models.llama import LlamaConfig, TransformerBlock

__all__ = ["COPY_KERNEL", "LlamaBlocks", "one_process_world", "run_one_process"]

COPY_KERNEL = re.compile(r"copy|memcpy|chunk_cat|catarray", re.IGNORECASE)


class LlamaBlocks(nn.Module):
    """``cfg.n_layers`` Llama blocks (:mod:`ragged_placement.models.llama`, grouped-query
    attention) and a final norm, without embedding and head (at Llama-3-8B's shapes those
    would outweigh four blocks) nor rotary embeddings (no parameters: the runtimes see the
    same); ``forward(x)`` maps hidden states ``[b, s, dim]`` to their output's mean square."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.layers = nn.ModuleList(TransformerBlock(cfg) for _ in range(cfg.n_layers))
        self.norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.norm(x).float().square().mean()


@contextlib.contextmanager
def one_process_world(device: str, world: int) -> Iterator[None]:
    """This process as rank 0 of ``world`` ranks: the fake process group for ``world > 1``,
    else a real one-rank group (``torchrun``'s environment where it set one)."""
    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    saved = dist.all_gather_object
    if world > 1:
        from torch.testing._internal.distributed.fake_pg import FakeStore

        if int(os.environ.get("WORLD_SIZE", 1)) > 1:
            raise ValueError("--world > 1 runs a fake world in one process: launch one process")
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)

        def all_gather_object(out: list, obj: object, group=None) -> None:
            del group
            out[:] = [obj] * len(out)

        dist.all_gather_object = all_gather_object
    else:
        backend = "nccl" if device == "cuda" else "gloo"
        if "RANK" in os.environ:
            dist.init_process_group(backend)
        else:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.all_gather_object = saved
        dist.destroy_process_group()


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _kernel_times(prof, device: str) -> tuple[float, float, list[tuple[str, float]]]:
    """(all kernels' time, the copy kernels' time, the copy kernels by time) in microseconds:
    device kernels on CUDA, ops' own CPU time on CPU."""
    total = copies = 0.0
    by_name: dict[str, float] = {}
    for e in prof.key_averages():
        if e.is_user_annotation:  # record_function ranges (FSDP2's), not kernels nor ops
            continue
        if device == "cuda":
            if e.device_type != torch.autograd.DeviceType.CUDA:
                continue
            t = e.self_device_time_total
        else:
            t = e.self_cpu_time_total
        total += t
        if COPY_KERNEL.search(e.key) and "nccl" not in e.key.lower():
            copies += t
            by_name[e.key] = by_name.get(e.key, 0.0) + t
    return total, copies, sorted(by_name.items(), key=lambda kv: -kv[1])


def _profiled(step: Callable[[int], None], device: str, i: int, n: int):
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=activities) as prof:
        for k in range(n):
            step(i + k)
        _sync(device)
    return prof


def _bytes_moved(step: Callable[[int], None], i: int) -> tuple[int, int]:
    """(collectives, bytes this rank moves) of one step."""
    with CollectiveMeter() as meter:
        step(i)
    return (sum(v[0] for v in meter.by_group.values()),
            sum(v[2] for v in meter.by_group.values()))


def _make_step(runtime: str, args, cfg: LlamaConfig, shard) -> Callable[[int], None]:
    from torch.distributed.device_mesh import init_device_mesh

    device = args.device
    mesh = init_device_mesh(device, (args.world,))
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaBlocks(cfg)
    shard(model, runtime, mesh, args)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, foreach=True)
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(args.batch, args.seq, cfg.dim, device=device, generator=gen)

    def step(i: int) -> None:
        del i
        model(x).backward()
        opt.step()
        opt.zero_grad()

    return step


def _one_run(runtime: str, args, cfg: LlamaConfig, shard) -> dict:
    device = args.device
    make = lambda: _make_step(runtime, args, cfg, shard)  # noqa: E731
    step = make()
    for i in range(args.warmup):
        step(i)
    _sync(device)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times = []
    for i in range(args.steps):
        _sync(device)
        t0 = time.perf_counter()
        step(i)
        _sync(device)
        times.append(time.perf_counter() - t0)
    peak = torch.cuda.max_memory_allocated() if device == "cuda" else None
    collectives, moved = _bytes_moved(step, 0)
    total, copies, names = _kernel_times(_profiled(step, device, 0, args.profile_steps), device)
    del step
    gc.collect()  # the sharded model's reference cycles: free it before the next runtime's
    if device == "cpu":
        peak = peak_memory(make, warmup=1, steps=1)
    elif device == "cuda":
        torch.cuda.empty_cache()
    n = args.profile_steps
    return {"time": statistics.median(times), "peak": peak, "collectives": collectives,
            "moved": moved, "kernel_time": total / n, "copy_time": copies / n,
            "copy_names": [(k, t / n) for k, t in names[:5]]}


def _table(results: dict[str, list[dict]], title: str, device: str) -> str:
    med = {rt: {**runs[0], **{k: statistics.median(r[k] for r in results[rt]) for k in
                              ("time", "peak", "kernel_time", "copy_time")}}
           for rt, runs in results.items()}
    what = "GPU kernels" if device == "cuda" else "CPU ops"
    rows = [
        ("step time (ms, median)", lambda r: r["time"] * 1e3, "{:.2f}"),
        (f"copy {what} (ms/step)", lambda r: r["copy_time"] / 1e3, "{:.2f}"),
        (f"copy share of {what} time (%)",
         lambda r: 100 * r["copy_time"] / max(r["kernel_time"], 1e-9), "{:.1f}"),
        ("peak memory (MiB, " + ("max_memory_allocated)" if device == "cuda" else "heap)"),
         lambda r: r["peak"] / 2**20, "{:.1f}"),
        ("collectives per step", lambda r: r["collectives"], "{:.0f}"),
        ("bytes moved per rank per step (MiB)", lambda r: r["moved"] / 2**20, "{:.1f}"),
    ]
    lines = [title, "", "| | torch FSDP2 | ours | ours / FSDP2 |", "| --- | ---: | ---: | ---: |"]
    for name, get, fmt in rows:
        theirs, ours = get(med["fsdp2"]), get(med["ours"])
        ratio = f"{ours / theirs:.2f}x" if theirs else ("=" if ours == theirs else "-")
        lines.append(f"| {name} | {fmt.format(theirs)} | {fmt.format(ours)} | {ratio} |")
    for rt in ("fsdp2", "ours"):
        lines.append("")
        names = "; ".join(f"{t:.0f} {name[:90]}" for name, t in med[rt]["copy_names"])
        lines.append(f"{rt}: copy {what} (us/step): {names or 'none'}")
    return "\n".join(lines)


def run_one_process(args, shard) -> None:
    """Both runtimes in this process at world size ``args.world`` (see the module docstring);
    ``shard(model, runtime, mesh, args)`` wraps the blocks then the root. Prints the table."""
    cfg = LlamaConfig(n_layers=args.layers, dim=args.width, hidden_dim=args.ffn,
                      n_heads=args.heads, n_kv_heads=args.kv_heads)
    results: dict[str, list[dict]] = {"fsdp2": [], "ours": []}
    with one_process_world(args.device, args.world):
        for _ in range(args.runs):
            for runtime in ("fsdp2", "ours"):
                results[runtime].append(_one_run(runtime, args, cfg, shard))
        name = torch.cuda.get_device_name() if args.device == "cuda" else "CPU"
    kind = f"fake process group, world {args.world}" if args.world > 1 else "one rank"
    title = (
        f"FSDP runtimes in one process on {name} ({kind}): {cfg.n_layers} Llama-shaped blocks "
        f"(dim {cfg.dim}, FFN {cfg.hidden_dim}, {cfg.n_heads} heads, {cfg.n_kv_heads} KV heads), "
        f"seq {args.seq} x batch {args.batch}, bf16 params / fp32 reduce"
        f"{', activation checkpointing' if args.checkpoint else ''}"
        f"{f', per-block compile ({args.compile_backend})' if args.compile else ''}, "
        f"torch {torch.__version__}"
        f"{f' CUDA {torch.version.cuda}' if args.device == 'cuda' else ''}, "
        f"{args.runs} runs x {args.steps} steps"
    )
    print(_table(results, title, args.device))
