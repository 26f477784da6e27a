#!/usr/bin/env bash
# Two emulated nodes on one machine: a training job over a slow link.
#
#   scripts/two_nodes.sh [--rate 1gbit] [--latency 0.1ms] [--queue 10ms] [--nproc-per-node 2]
#                        [--script FILE | --module MODULE] [--] TRAIN_ARGS...
#
# Creates two network namespaces joined by a veth pair (10.231.N.1 <-> 10.231.N.2, addresses
# only inside them) and shapes each direction of the link (loopback inside each namespace stays
# fast):
#   --rate     the link's rate: a tc token-bucket filter (tbf);
#   --queue    how long a packet may wait in that filter's queue before it is dropped (tbf's
#              "latency": rate x queue bytes of buffer; 10ms = 1.25 MB at 1 Gbit/s). A real
#              NIC at line rate makes its sender wait, it does not drop: a queue much shorter
#              than a burst of the job's messages (0.1ms = 12.5 KB) turns the link into a lossy
#              one, and each lost tail costs TCP a 200 ms retransmission timeout;
#   --latency  a one-way delay added with netem under the filter, where the kernel has netem
#              (sch_netem); where it has not, the script says so and adds none.
# Then starts `torchrun --nnodes 2 --node-rank i --nproc-per-node P` with c10d rendezvous in
# each, gloo bound to the namespace's veth (GLOO_SOCKET_IFNAME), running
# `python -m ragged_placement.train TRAIN_ARGS` (or `python FILE TRAIN_ARGS` with --script,
# `python -m MODULE TRAIN_ARGS` with --module: e.g. torchtitan.train).
# Everything it created (processes, namespaces,
# the veth pair) is removed when it exits, also on Ctrl-C or failure. Needs root or
# CAP_NET_ADMIN; without, it says so and exits 1. The exit status is the first failing node's
# (the other node is then stopped), else 0. PYTHON selects the interpreter (default
# .venv/bin/python).
set -euo pipefail

RATE=1gbit
LATENCY=0.1ms
QUEUE=10ms
BURST=128kb
NPROC=2
ENTRY=(-m ragged_placement.train)
PY=${PYTHON:-.venv/bin/python}
while [[ $# -gt 0 ]]; do
  case $1 in
    --rate) RATE=$2; shift 2 ;;
    --latency) LATENCY=$2; shift 2 ;;
    --queue) QUEUE=$2; shift 2 ;;
    --nproc-per-node) NPROC=$2; shift 2 ;;
    --script) ENTRY=("$2"); shift 2 ;;
    --module) ENTRY=(-m "$2"); shift 2 ;;
    --) shift; break ;;
    *) break ;;
  esac
done

TAG="rp$$"
NET="10.231.$(($$ % 250)).0"
ADDR=("10.231.$(($$ % 250)).1" "10.231.$(($$ % 250)).2")
NS=("${TAG}n0" "${TAG}n1")
VETH=("${TAG}v0" "${TAG}v1")
PIDS=()

cleanup() {
  local status=$?
  trap - EXIT INT TERM
  for pid in "${PIDS[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
  for _ in $(seq 50); do  # torchrun ends its workers on SIGTERM; give it 5 s
    local alive=0
    for ns in "${NS[@]}"; do
      [[ -n $(ip netns pids "$ns" 2>/dev/null) ]] && alive=1
    done
    [[ $alive == 0 ]] && break
    sleep 0.1
  done
  for ns in "${NS[@]}"; do
    for pid in $(ip netns pids "$ns" 2>/dev/null); do kill -KILL "$pid" 2>/dev/null || true; done
    ip netns del "$ns" 2>/dev/null || true  # removes the veth end inside it, hence the pair
  done
  ip link del "${VETH[0]}" 2>/dev/null || true  # still in this namespace if set-up failed early
  exit "$status"
}

if ! ip netns add "${NS[0]}" 2>/dev/null; then
  echo "two_nodes.sh: cannot create a network namespace: needs root or CAP_NET_ADMIN" \
       "(running as uid $(id -u))" >&2
  exit 1
fi
trap cleanup EXIT
trap 'exit 130' INT TERM
ip netns add "${NS[1]}"
ip link add "${VETH[0]}" type veth peer name "${VETH[1]}"
for i in 0 1; do
  ip link set "${VETH[$i]}" netns "${NS[$i]}"
  ip -n "${NS[$i]}" addr add "${ADDR[$i]}/24" dev "${VETH[$i]}"
  ip -n "${NS[$i]}" link set lo up
  ip -n "${NS[$i]}" link set "${VETH[$i]}" up
  ip netns exec "${NS[$i]}" tc qdisc add dev "${VETH[$i]}" root handle 1: tbf rate "$RATE" \
    burst "$BURST" latency "$QUEUE"
  if [[ $LATENCY =~ ^0+(\.0*)?[a-z]*$ ]]; then
    DELAY="no added delay"
  elif ip netns exec "${NS[$i]}" tc qdisc add dev "${VETH[$i]}" parent 1:1 handle 10: netem \
       delay "$LATENCY" 2>/dev/null; then
    DELAY="netem delay $LATENCY"
  else
    DELAY="no added delay: this kernel has no netem, --latency $LATENCY not applied"
  fi
done
echo "two_nodes.sh: ${NS[0]} (${ADDR[0]}) <-> ${NS[1]} (${ADDR[1]}) on $NET/24, tbf rate $RATE" \
     "queue $QUEUE, $DELAY; $NPROC ranks per node"

IS_HOST=(true false)  # node 0 hosts the rendezvous store (its address is not the hostname's)
for i in 0 1; do
  ip netns exec "${NS[$i]}" env GLOO_SOCKET_IFNAME="${VETH[$i]}" TWO_NODES_NODE="$i" \
    "$PY" -m torch.distributed.run --nnodes 2 --node-rank "$i" --nproc-per-node "$NPROC" \
    --rdzv-backend c10d --rdzv-endpoint "${ADDR[0]}:29400" --rdzv-id "$TAG" \
    --rdzv-conf "is_host=${IS_HOST[$i]}" --local-addr "${ADDR[$i]}" "${ENTRY[@]}" "$@" &
  PIDS+=("$!")
done
status=0
for _ in 0 1; do  # the first node to fail ends the job (the other would wait in torchrun's barriers)
  wait -n || { status=$?; break; }
done
exit "$status"
