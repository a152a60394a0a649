#!/usr/bin/env bash
# Step 8: deploy my-deploy-buggy.yaml (the policy reaches Ray's workers and vLLM's
# EngineCore only through runtime_env py_modules; no PYTHONPATH), send the cross-tenant
# workload, read the policy's error count from /metrics and /admin/state, shut down.
set -u -m  # -m: job control, so the background `serve run` keeps SIGINT (its Ctrl-C stop)
OUT=docs/results/walkthrough
set -a && . deploy/serve.env && set +a
.venv/bin/serve run $OUT/my-deploy-buggy.yaml > $OUT/8_serve_run.log 2>&1 &
SERVE=$!
t0=$(date +%s)
until curl -sf localhost:8000/v1/models > /dev/null; do
  kill -0 $SERVE 2>/dev/null || { echo "serve run exited"; tail -30 $OUT/8_serve_run.log; exit 1; }
  (( $(date +%s) - t0 > 400 )) && { echo "not up in 400 s"; kill -INT $SERVE; exit 1; }
  sleep 2
done
echo "up in $(( $(date +%s) - t0 )) s"
.venv/bin/python -m blockserve.bench.replay --workload cross_tenant --requests 120 \
  --out $OUT/8_replay.json | python3 -c 'import json,sys; s=json.load(sys.stdin)["summary"]; print({k: s[k] for k in ("requests", "ok", "rejected_429", "errors", "output_tokens_per_s", "ttft_p50_s") if k in s})'
curl -s localhost:8000/metrics | grep '^blockserve_replica_policy_errors_total{' | grep -v ' 0.0$'
curl -s localhost:8000/admin/state | python3 -c 'import json,sys; [print(r["replica_id"] if "replica_id" in r else "", json.dumps(r["block_policies"])) for r in json.load(sys.stdin)["replicas"]]'
.venv/bin/blockserve status
echo "engine log:"; grep -c "block_retention policy my_policy:HeadsStayTailsGo raised RuntimeError" $OUT/8_serve_run.log
grep -m1 -A0 "RuntimeError: deliberate bug" $OUT/8_serve_run.log
kill -INT $SERVE; wait $SERVE
echo "serve run exit $?"
