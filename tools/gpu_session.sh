#!/usr/bin/env bash
# What one session runs on the lent GPU node (one H200), in one call, with the wheelhouse carried as .whl
# (tools/wheelhouse.sh): host-overhead diagnostics of the router-replay patch, the router-replay zoo in bf16
# (deterministic kernels), the one-GPU scenarios, and (STAGE=bench) the router-replay benchmark.
# Usage on the node: OUT=dir tools/gpu_session.sh   (records land in $OUT; docs/gpu/ keeps them)
set -uo pipefail
out=${OUT:?set OUT}
pip install --quiet --no-index --no-deps --target /tmp/wh .whl/*.whl
export PYTHONPATH=/tmp/wh:$PWD PYTHONWARNINGS=ignore
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$out/gpu.txt"
python -c "import torch; print('torch', torch.__version__, torch.version.cuda)" >> "$out/gpu.txt"
shape=(--hidden 2048 --experts 128 --topk 8 --tokens 16384 --dtype bf16)
if [[ ${STAGE:-checks} == checks ]]; then
  for scoring in softmax sigmoid; do
    python bench/replay_overhead.py "${shape[@]}" --scope router --scoring "$scoring" > "$out/overhead_router_$scoring.txt" 2>&1
    tail -8 "$out/overhead_router_$scoring.txt"
  done
  MOEVERIFY_TEST_BACKEND=cuda python -m pytest -q -p no:cacheprovider tests/unit/test_router_replay_zoo.py \
    --junitxml "$out/zoo-1xH200.xml" > "$out/zoo-1xH200.txt" 2>&1; echo "zoo rc $?"; tail -3 "$out/zoo-1xH200.txt"
  python -m moeverify run scenarios/gpu.yaml --backend cuda --json "$out/gpu-scenarios-1xH200.json" \
    > "$out/gpu-scenarios-1xH200.txt" 2>&1; echo "scenarios rc $?"; tail -15 "$out/gpu-scenarios-1xH200.txt"
else
  for scope in router layer; do
    for scoring in softmax sigmoid; do
      python bench/router_replay.py --device cuda "${shape[@]}" --scope "$scope" --scoring "$scoring" \
        --out "$out/router_replay_h200_${scope}_${scoring}.json" | tail -12
    done
  done
fi
