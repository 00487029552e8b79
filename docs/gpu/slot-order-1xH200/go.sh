#!/usr/bin/env bash
# one GPU call: replay at Qwen3-30B-A3B width (2 layers) for moeverify, native, verl; the slot-order bench
set -uo pipefail
h=$(cd "$(dirname "$0")" && pwd)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/wh "$h"/whl/*.whl || exit 3
export PYTHONPATH=/tmp/wh:$h/src PYTHONWARNINGS=ignore PYTHONUNBUFFERED=1 MOEVERIFY_CACHE_DIR=/tmp/mvcache
cd "$h/src"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
for impl in ${IMPLS:-moeverify native verl}; do
  sed "s#NOTES_#$OUT/notes_#" "$h/gpu/replay_$impl.yaml" > "$h/gpu/run_$impl.yaml"
  t0=$(date +%s)
  timeout ${T_REPLAY:-400} python3 -m moeverify run "$h/gpu/run_$impl.yaml" --backend cuda --json "$OUT/replay_$impl.json" \
    --run-dir /tmp/run_$impl --timeout 380 > /tmp/log_$impl.txt 2>&1
  echo "== $impl rc $? $(( $(date +%s) - t0 )) s"; tail -12 /tmp/log_$impl.txt
done
if [[ ${BENCH:-1} == 1 ]]; then
  timeout 90 python3 bench/router_replay.py --device cuda --hidden 2048 --experts 128 --topk 8 --tokens 16384 \
    --dtype bf16 --scope router --scoring softmax --rounds 3 --out "$OUT/router_replay_h200_slot_order.json"
fi
