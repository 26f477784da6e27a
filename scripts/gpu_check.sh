#!/usr/bin/env bash
# The GPU measurement of issue 38, one command, bounded at 8 minutes on a GPU (each part runs
# under `timeout`: 90 s for each test file, 55 s for each benchmark run; LIMIT overrides the
# latter; on the CPU 900 s each, hang guards):
#   1. the CUDA tests (tests/cuda/test_cuda.py: Triton kernels, scaled_mm);
#   2. benchmarks/fsdp_vs_fsdp2.py --device cuda: ours against torch FSDP2 in one process on 4
#      Llama-3-8B-shaped blocks (seq 4096, bf16 params, fp32 reduction): world 1 (NCCL, torchrun
#      with one process), then worlds 8 and 64 through torch's fake process group, each with and
#      without --checkpoint (step time, copy kernels, peak memory, bytes moved);
#   3. two ranks sharing the GPU over gloo, with prefetch, against one process
#      (tests/cuda/test_cuda_shared_gpu.py).
# Everything goes to OUT: gpu_check.log (all of it) and one table per benchmark run.
# Without a GPU it runs the same steps on the CPU: the CUDA tests say they skipped, and the
# benchmark runs with --device cpu at a small size (SIZE overrides the size options).
# Usage: scripts/gpu_check.sh OUT   (PYTHON: the interpreter, default python3)
set -uo pipefail
out=${1:?usage: scripts/gpu_check.sh OUT}
mkdir -p "$out"
py=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
cd "$(dirname "$0")/.."
exec > >(tee "$out/gpu_check.log") 2>&1

if "$py" -c "import sys, torch; sys.exit(not torch.cuda.is_available())"; then
  device=cuda
  size=${SIZE:---runs 2 --warmup 3 --steps 8}
  limit=${LIMIT:-55} test_limit=90
  "$py" -c "import torch; print(torch.cuda.get_device_name(), 'torch', torch.__version__, 'CUDA', torch.version.cuda)"
else
  device=cpu
  size=${SIZE:---layers 2 --width 64 --ffn 128 --heads 4 --kv-heads 2 --seq 32 --runs 1 --warmup 1 --steps 2 --profile-steps 1}
  limit=${LIMIT:-900} test_limit=900
  echo "no CUDA device: the CUDA tests skip, the benchmark runs on the CPU at a small size"
fi
failed=()
step() {  # step NAME SECONDS COMMAND...: run COMMAND under a time limit, note a failure
  local name=$1 limit=$2; shift 2
  echo "== $name"
  local t0=$SECONDS
  timeout --kill-after 10 "$limit" "$@" || { echo "FAILED ($?) $name"; failed+=("$name"); }
  echo "-- $name: $((SECONDS - t0)) s"
}

step "CUDA tests (tests/cuda/test_cuda.py)" "$test_limit" \
  "$py" -m pytest -q -p no:cacheprovider -p no:xdist tests/cuda/test_cuda.py -m cuda -rs

bench="benchmarks/fsdp_vs_fsdp2.py --device $device $size"
for ckpt in "" "--checkpoint"; do
  tag=${ckpt:+_checkpoint}
  step "world 1 (torchrun, one process)${ckpt:+ $ckpt}" "$limit" bash -o pipefail -c \
    "'$py' -m torch.distributed.run --standalone --nproc-per-node 1 $bench --world 1 $ckpt | tee '$out/bench_w1$tag.txt'"
  for w in 8 64; do
    step "world $w (fake process group)${ckpt:+ $ckpt}" "$limit" bash -o pipefail -c \
      "'$py' $bench --world $w $ckpt | tee '$out/bench_w$w$tag.txt'"
  done
done

step "two ranks on one GPU (tests/cuda/test_cuda_shared_gpu.py)" "$test_limit" \
  "$py" -m pytest -q -p no:cacheprovider -p no:xdist tests/cuda/test_cuda_shared_gpu.py -m cuda -rs

if ((${#failed[@]})); then
  printf 'FAILED: %s\n' "${failed[@]}"
  exit 1
fi
echo "all steps passed ($device); tables in $out"
