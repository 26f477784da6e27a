"""torchtitan configs on our runtime through ``ragged_placement.integrations.torchtitan.configure``,
and their references, for ``tests/train/test_titan_integration.py`` and ``benchmarks/titan.py``:

    PYTHONPATH=tests/train/titan torchrun --nproc-per-node 4 -m torchtitan.train \\
        --module integration_config --config llama3_amsp --parallelism.data_parallel_replicate_degree 2

torchtitan's own entry point runs; nothing of torchtitan is rebound for the runtime switch (the
configs below are ``configure``'s results). Every config is ``titan_config``'s CPU llama3 debug
model in fp32 (6 layers, dim 256, vocab 2048). Importing this module on a machine without a GPU
prepares the process as ``launch.py`` does for both runtimes' jobs: the harness's CPU stand-ins
(``stand_ins.install``, with ``TITAN_METRICS`` recording each step's numbers) and one worker
thread per gloo group (``ragged_placement.one_worker_gloo``, entered for the process).
``TITAN_ATTRIBUTES=path``: rank 0 writes to ``path``, at exit, the attributes of torchtitan's
modules and classes that changed after the stand-ins were installed (``configure``, building
and training must change none).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import sys
from dataclasses import dataclass

import torch
from torchtitan.hf_datasets.text_datasets import HuggingFaceTextDataLoader

import stand_ins
from ragged_placement import one_worker_gloo
from ragged_placement.integrations.torchtitan import (
    BlockFP8LinearConverter,
    configure,
    from_adamw,
)
from titan_config import llama3_debugmodel_cpu
from torchtitan.components.dataloader import BaseDataLoader
from torchtitan.models.llama3 import model_registry

# Exact comparisons with one process: Newton-Schulz in fp32 (in bf16 one fp32 rounding of a
# gradient can flip a rounding of its input and move the update by ~1e-3; docs/optimizers.md).
MUON = {"ns_dtype": "float32"}


def _torchtitan_attributes() -> dict[str, dict[str, int]]:
    """``{module or class: {attribute: id(value)}}`` of every loaded torchtitan module and of
    the classes it defines."""
    out = {}
    for name, module in list(sys.modules.items()):
        if name.split(".")[0] != "torchtitan" or module is None:
            continue
        out[name] = {k: id(v) for k, v in vars(module).items()}
        for k, v in vars(module).items():
            if isinstance(v, type) and v.__module__ == name:
                out[f"{name}.{k}"] = {a: id(b) for a, b in vars(v).items()}
    return out


def _write_changed(path: str, before: dict[str, dict[str, int]]) -> None:
    if int(os.environ.get("RANK", "0")) != 0:
        return
    after = _torchtitan_attributes()
    changed = sorted(f"{owner}.{attr}" for owner, attrs in before.items()
                     for attr, ident in attrs.items() if after.get(owner, {}).get(attr) != ident)
    with open(path, "w") as f:
        json.dump({"changed": changed, "owners": len(before)}, f)


if not torch.cuda.is_available():
    stand_ins.install(os.environ.get("TITAN_METRICS"))
    if os.environ.get("TITAN_GRADS"):  # as launch.py: full gradients after these steps
        stand_ins.dump_gradients(os.environ["TITAN_GRADS"],
                                 {int(s) for s in os.environ.get("TITAN_GRAD_STEPS", "1").split(",")})
    if os.environ.get("TITAN_EXACT_NORMS"):  # as launch.py: the fp64 full-gradient norm per step
        stand_ins.record_exact_grad_norm(os.environ["TITAN_EXACT_NORMS"])
    _GLOO = contextlib.ExitStack()
    _GLOO.enter_context(one_worker_gloo())
    atexit.register(_GLOO.close)
if os.environ.get("TITAN_ATTRIBUTES"):
    import torchtitan.models.deepseek_v3.config_registry  # noqa: F401  (more modules watched)
    import torchtitan.models.qwen3.config_registry  # noqa: F401

    atexit.register(_write_changed, os.environ["TITAN_ATTRIBUTES"], _torchtitan_attributes())


class RanksInTurn(BaseDataLoader):
    """One process's micro-batches: what each of ``ranks`` data-parallel ranks of torchtitan's
    text dataloader gets, in rank order. With ``training.global_batch_size`` = ranks x
    ``local_batch_size`` a step accumulates the gradients of the ranks' batches in rank order,
    the sum a data-parallel reduction of ``ranks`` gradients makes (:func:`_one_process`)."""

    @dataclass(kw_only=True, slots=True)
    class Config(HuggingFaceTextDataLoader.Config):
        ranks: int = 2
        """The data-parallel ranks whose batches each step takes in turn."""

    def __init__(self, config: Config, *, dp_world_size: int, dp_rank: int, tokenizer,
                 seq_len: int, local_batch_size: int, **kwargs) -> None:
        if dp_world_size != 1:
            raise ValueError(f"RanksInTurn is one process's dataloader, got dp_world_size "
                             f"{dp_world_size}")
        each = HuggingFaceTextDataLoader.Config(dataset=config.dataset,
                                                dataset_path=config.dataset_path,
                                                infinite=config.infinite)
        self.loaders = [each.build(dp_world_size=config.ranks, dp_rank=r, tokenizer=tokenizer,
                                   seq_len=seq_len, local_batch_size=local_batch_size, **kwargs)
                        for r in range(config.ranks)]

    def __iter__(self):
        for batches in zip(*self.loaders):
            yield from batches

    def state_dict(self):
        return {str(r): loader.state_dict() for r, loader in enumerate(self.loaders)}

    def load_state_dict(self, state_dict) -> None:
        for r, loader in enumerate(self.loaders):
            loader.load_state_dict(state_dict[str(r)])


def _one_process(config, ranks: int = 2):
    """``config`` on one process, each step accumulating the gradients of the batches
    ``ranks`` data-parallel ranks get (``--dataloader.ranks`` on the command line, with
    ``--training.global_batch_size`` = ranks x local batch): the same data, and the same sums
    in the same order as a data-parallel run of ``ranks`` ranks."""
    config.training.global_batch_size = ranks * config.training.local_batch_size
    config.dataloader = RanksInTurn.Config(dataset=config.dataloader.dataset, ranks=ranks)
    return config


def _fp8_model(config):
    """``config`` with torchtitan's llama3 debug model built through our FP8 converter."""
    config.model_spec = model_registry("debugmodel",
                                       converters=[BlockFP8LinearConverter.Config()])
    return config


# -- torchtitan as it ships (torch FSDP2), and the one-process references ---------------------
def llama3_fsdp2():
    """The reference: torchtitan's trainer with torch FSDP2 (FSDP or HSDP by the options)."""
    return llama3_debugmodel_cpu()


def llama3_muon_one_process():
    """One process (torch FSDP2 on one rank) with our Muon, on the ranks' batches in turn."""
    config = _one_process(llama3_debugmodel_cpu())
    config.optimizer = from_adamw(config.optimizer, "muon", MUON)
    return config


def llama3_fp8_one_process():
    """One process (torch FSDP2 on one rank), our block-wise FP8 Linear layers quantizing their
    whole weight in each forward, on the ranks' batches in turn."""
    return _one_process(_fp8_model(llama3_debugmodel_cpu()))


def llama3_fp8_fsdp2():
    """torch FSDP2 with our block-wise FP8 Linear layers: each quantizes its gathered weight in
    each forward (the same blocks and scales ours gathers in FP8)."""
    return _fp8_model(llama3_debugmodel_cpu())


# -- ours, through configure --------------------------------------------------------------------
def llama3_ours():
    """Our runtime in torchtitan's FSDP (HSDP with a replicate degree), nothing else chosen."""
    return configure(llama3_debugmodel_cpu())


def llama3_amsp():
    """AMSP: parameters sharded over ``fsdp``, gradients and optimizer state over both dims
    (needs ``--parallelism.data_parallel_replicate_degree`` > 1)."""
    return configure(llama3_debugmodel_cpu(), state_sharding="amsp")


def llama3_auto():
    """The partitioner's state sharding (bandwidth profiled on the mesh)."""
    return configure(llama3_debugmodel_cpu(), state_sharding="auto")


def llama3_auto_muon():
    """The issue's example on the debug model: the partitioner's choice and our Muon."""
    return configure(llama3_debugmodel_cpu(), state_sharding="auto", optimizer="muon",
                     optimizer_kwargs=MUON)


def llama3_amsp_muon():
    """AMSP and our Muon (its optimizer mesh spans both dims: one owner per matrix)."""
    return configure(llama3_debugmodel_cpu(), state_sharding="amsp", optimizer="muon",
                     optimizer_kwargs=MUON)


def llama3_muon():
    """Our runtime and our Muon (FSDP, or HSDP with a replicate degree)."""
    return configure(llama3_debugmodel_cpu(), optimizer="muon", optimizer_kwargs=MUON)


def llama3_fp8():
    """Block-wise FP8 all-gathers and GEMMs of the blocks' Linear layers."""
    return configure(llama3_debugmodel_cpu(), fp8=True)


def llama3_fsdp2_one_process():
    """One process (torch FSDP2 on one rank), torchtitan's AdamW, on the ranks' batches in turn."""
    return _one_process(llama3_debugmodel_cpu())
