#!/usr/bin/env bash
# The GPU checks: the CUDA tests (tests/cuda/test_cuda.py: Triton kernels, scaled_mm), then the trainer
# on one CUDA device under torchrun (NCCL, world 1): ours against torch FSDP2 on the same model
# and data, resume after a killed worker (--max-restarts 1), bf16 throughput, FP8 against bf16,
# and the optimizers and options on CUDA. About 5 minutes on an H100.
# Usage: scripts/cuda_train_check.sh OUTDIR   (needs a GPU; ragged_placement importable)
set -uo pipefail
out=${1:?usage: scripts/cuda_train_check.sh OUTDIR}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 CUBLAS_WORKSPACE_CONFIG=:4096:8
run() { torchrun --standalone --nproc-per-node 1 "$@"; }
T="-m ragged_placement.train --device ${DEVICE:-cuda} --log-every 10"
# the trainer with a fault injected (RAGGED_PLACEMENT_TRAIN_FAULT): tests/train/fault_injection.py
FAULTY="tests/train/fault_injection.py --device ${DEVICE:-cuda} --log-every 10"
small="--steps 20 --seed 0 --precision fp32"
echo "== tests/cuda/test_cuda.py"
python3 -m pytest -q -p no:cacheprovider tests/cuda/test_cuda.py -m cuda || echo "FAILED test_cuda"
echo "== fp32: ours vs fsdp2"
run $T $small --runtime ours --output "$out/ours.pt" || echo "FAILED ours fp32"
run $T $small --runtime fsdp2 --output "$out/fsdp2.pt" || echo "FAILED fsdp2 fp32"
echo "== fp32: kill rank 0 at step 12, torchrun --max-restarts 1, resume from step 10"
for rt in ours fsdp2; do
  RAGGED_PLACEMENT_TRAIN_FAULT=kill:0:12 run --max-restarts 1 $FAULTY $small --runtime $rt --checkpoint-dir "$out/ck_$rt" --checkpoint-every 5 \
    --output "$out/${rt}_resumed.pt" || echo "FAILED $rt resume"
done
python3 - "$out" <<'PY'
import sys, torch
d = sys.argv[1]
def load(n):
    return torch.load(f"{d}/{n}.pt", map_location="cpu")
def diff(a, b):
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)
try:
    o, f = load("ours"), load("fsdp2")
    print(f"ours vs fsdp2 fp32, 20 steps: max |diff| {diff(o, f):.3g}, bitwise {all(torch.equal(o[k], f[k]) for k in o)}")
    for rt in ("ours", "fsdp2"):
        r, u = load(f"{rt}_resumed"), load(rt)
        print(f"{rt} killed+resumed vs uninterrupted: bitwise {all(torch.equal(r[k], u[k]) for k in u)}, max |diff| {diff(r, u):.3g}")
except Exception as e:
    print("COMPARE FAILED", repr(e))
PY
echo "== bf16, GPT 12 x 768, seq 1024, batch 8: ours vs fsdp2 (tokens/s, peak memory)"
big="${BIG:---model gpt --layers 12 --width 768 --heads 12 --seq 1024 --batch 8 --precision bf16 --steps 30 --data-bytes 4194304}"
for rt in ours fsdp2; do
  run $T $big --runtime $rt --metrics "$out/bf16_$rt.json" || echo "FAILED bf16 $rt"
done
echo "== ours --fp8 (block-wise FP8 linears), same model"
run $T $big --runtime ours --fp8 --metrics "$out/fp8_ours.json" || echo "FAILED fp8"
python3 - "$out" <<'PY'
import json, sys, os
d = sys.argv[1]
for n in ("bf16_ours", "bf16_fsdp2", "fp8_ours"):
    p = f"{d}/{n}.json"
    if not os.path.exists(p):
        print(n, "missing"); continue
    m = json.load(open(p))
    print(f"{n:11s} tokens/s {m['tokens_per_s']:,.0f}  peak {m['peak']/2**20:,.0f} MiB  "
          f"final loss {m['losses'][-1]:.4f}  copy bytes {m['copy_bytes']:,}")
PY
echo "== FP8 against bf16, GPT 2 x 768, seq 256 (final losses)"
mid="--layers 2 --width 768 --heads 12 --seq 256 --batch 8 --precision bf16 --steps 30"
for f in --no-fp8 --fp8; do run $T $mid $f 2>&1 | grep "^step   30" | sed "s/^/$f  /"; done
echo "== options on CUDA, GPT 2 x 256, 10 steps"
tiny="--layers 2 --width 256 --heads 4 --seq 128 --batch 8 --steps 10"
for a in "--optimizer muon" "--optimizer shampoo" "--activation-checkpointing --precision bf16" \
         "--compile --precision bf16" "--compile --precision bf16 --runtime fsdp2"; do
  run $T $tiny $a 2>&1 | grep "^step   10" | sed "s/^/$a  /" || echo "FAILED $a"
done
