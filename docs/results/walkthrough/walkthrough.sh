#!/usr/bin/env bash
# Issue 27's walkthrough (docs/block-policies.md), timed: run from a clean clone after
# `make setup`, with the user's policy module in /tmp/mypolicy (outside the repo). Each
# step's output goes to docs/results/walkthrough/<step>.txt, its wall time to times.txt.
# `walkthrough.sh` runs steps 3-7 (each under 30 s); `walkthrough.sh deploy` runs step 8,
# a deployment (under the machine's heavy-work lock: flock /tmp/blockserve-heavy.lock).
set -u
cd "$(dirname "$0")/../../.."          # the clone's root
OUT=docs/results/walkthrough
PY=.venv/bin/python
mkdir -p "$OUT"
step() {  # step NAME COMMAND...: run it, keep stdout+stderr and its wall time
  local name=$1; shift
  local t0=$(date +%s.%N)
  { echo "\$ $*"; "$@"; echo "exit $?"; } > "$OUT/$name.txt" 2>&1
  echo "$name $(echo "$(date +%s.%N) - $t0" | bc)" >> "$OUT/times.txt"
}
if [ "${1:-}" = deploy ]; then step 8_deploy bash $OUT/deploy.sh; exit; fi
: > "$OUT/times.txt"
MINE="my_policy:HeadsStayTailsGo"
export PYTHONPATH=/tmp/mypolicy      # for the lab, the simulator; not for the deployment
WL=(--workload-kwargs cross_tenant:tenants=40)

step 3_lab $PY -m blockserve.bench.block_lab --workloads cross_tenant \
  --requests 300 "${WL[@]}" --configs "vllm (LRU)" s3fifo \
  "scheduler.block_retention=$MINE(keep_positions=12)" --out $OUT/lab
step 4_sweep $PY -m blockserve.bench.block_lab --workloads cross_tenant --requests 300 "${WL[@]}" \
  --configs "scheduler.block_retention=$MINE" \
  --sweep scheduler.block_retention.keep_positions=0,4,8,12,16 --out $OUT/sweep
step 5_simulator $PY -m blockserve.bench.simulator --replicas 2 --workload cross_tenant \
  "${WL[@]}" --requests 400 --rate 12 --configs blockserve "scheduler.block_eviction=vllm" \
  "scheduler.block_eviction=s3fifo" "scheduler.block_retention=$MINE(keep_positions=12)" \
  --out $OUT/simulator
step 6_exception $PY -m blockserve.bench.block_lab --workloads cross_tenant --requests 300 "${WL[@]}" \
  --configs "scheduler.block_retention=$MINE(keep_positions=12)" \
  "scheduler.block_retention=$MINE(keep_positions=12, fail_every=7)" --out $OUT/exception
unset PYTHONPATH
step 7_check .venv/bin/blockserve check $OUT/my-deploy.yaml
step 7_check_buggy .venv/bin/blockserve check $OUT/my-deploy-buggy.yaml
