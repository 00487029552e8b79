#!/usr/bin/env bash
# Prepare an offline bundle of the Python packages a GPU node lacks (see ENVIRONMENT.md), as wheels for
# CPython 3.12 on x86-64 Linux. On the node: pip install --no-index --no-deps --target DIR .whl/*.whl and put
# DIR on PYTHONPATH. Usage: tools/wheelhouse.sh [OUT_DIR]   (default .whl)
set -euo pipefail
out=${1:-.whl}
mkdir -p "$out"
# What the GPU image lacks, at the versions moeverify pins (requirements/*.txt). torch, numpy, safetensors,
# pyyaml, rich, matplotlib, huggingface-hub are in the image already.
packages=(
  megatron-core==0.19.2
  megatron-bridge==0.6.2
  transformers==5.12.1
  tokenizers==0.22.2
  omegaconf==2.4.0
  deepdiff==9.1.0
  orderly-set==5.5.0
  cachebox==5.2.3
  verl==0.9.1
  pytest==9.2.0  # the GPU runs of the unit tests that take MOEVERIFY_TEST_BACKEND=cuda
  pluggy
  iniconfig
)
platforms=()
for n in 17 24 27 28 31 34 35; do platforms+=(--platform "manylinux_2_${n}_x86_64"); done
platforms+=(--platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any)
for p in "${packages[@]}"; do
  python3 -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: \
    --python-version 3.12 --implementation cp "${platforms[@]}" -d "$out" "$p"
done
ls -la "$out"
du -sh "$out"
