"""torchrun entry: torchtitan's own trainer, ``torchtitan.train.main``, with FSDP2 or ours.

    TITAN_FSDP=ours TITAN_METRICS=m.jsonl torchrun --nproc-per-node 2 tests/train/titan/launch.py \
        --module titan_config --config llama3_debugmodel_cpu [torchtitan options...]

``TITAN_FSDP=ours`` switches the one import, torchtitan's ``fully_shard`` (its
``torchtitan/distributed/fsdp.py`` imports it from ``torch.distributed.fsdp``), to
``ragged_placement.fsdp.fully_shard``; ``torch`` leaves torchtitan as it is. Both get the same
CPU stand-ins (``stand_ins.py``).
"""

import os

import torchtitan.distributed.fsdp
import torchtitan.train

import stand_ins
from ragged_placement import one_worker_gloo


def main() -> None:
    runtime = os.environ.get("TITAN_FSDP", "torch")
    if runtime not in ("torch", "ours"):
        raise ValueError(f"TITAN_FSDP must be 'torch' or 'ours', got {runtime!r}")
    if runtime == "ours":
        from ragged_placement.fsdp import fully_shard

        torchtitan.distributed.fsdp.fully_shard = fully_shard
    stand_ins.install(os.environ.get("TITAN_METRICS"))
    order = os.environ.get("TITAN_REDUCE_SCATTER", "gloo")
    if order not in ("gloo", "rank_order"):
        raise ValueError(f"TITAN_REDUCE_SCATTER must be 'gloo' or 'rank_order', got {order!r}")
    if order == "rank_order":
        stand_ins.reduce_scatter_in_rank_order()
    if os.environ.get("TITAN_GRADS"):
        steps = {int(s) for s in os.environ.get("TITAN_GRAD_STEPS", "1").split(",")}
        stand_ins.dump_gradients(os.environ["TITAN_GRADS"], steps)
    if os.environ.get("TITAN_EXACT_NORMS"):
        stand_ins.record_exact_grad_norm(os.environ["TITAN_EXACT_NORMS"])
    # Both runtimes overlap collectives on torchtitan's gloo groups: each runs one worker thread
    # against torch's race in ProcessGroupGloo (ragged_placement.one_worker_gloo).
    with one_worker_gloo():
        torchtitan.train.main()


if __name__ == "__main__":
    main()
