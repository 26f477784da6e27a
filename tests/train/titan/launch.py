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


def main() -> None:
    runtime = os.environ.get("TITAN_FSDP", "torch")
    if runtime not in ("torch", "ours"):
        raise ValueError(f"TITAN_FSDP must be 'torch' or 'ours', got {runtime!r}")
    if runtime == "ours":
        from ragged_placement.fsdp import fully_shard

        torchtitan.distributed.fsdp.fully_shard = fully_shard
    stand_ins.install(os.environ.get("TITAN_METRICS"))
    torchtitan.train.main()


if __name__ == "__main__":
    main()
