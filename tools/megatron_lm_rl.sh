#!/usr/bin/env bash
# Megatron-LM's RL loop (train_rl.py) for tests/special_distributed/jobs/megatron_lm_rl_job.py, outside the repo:
# the files of Megatron-LM it runs (train_rl.py, its three builder modules, megatron/rl, megatron/inference; megatron.core
# and megatron.training come from the megatron-core wheel, whose megatron/training equals Megatron-LM's at this commit)
# extracted from a Megatron-LM git checkout at the pinned commit, and the RL loop's own packages
# (requirements/megatron_lm_rl.txt) installed with --target, both under ~/.cache/moeverify.
#   eval "$(tools/megatron_lm_rl.sh env CHECKOUT)"   prints MOEVERIFY_MEGATRON_LM and MOEVERIFY_MEGATRON_LM_DEPS
#   tools/megatron_lm_rl.sh pack CHECKOUT OUT.tar.gz  the snapshot and the packages a GPU node lacks, for carrying
# CHECKOUT: a clone of github.com/NVIDIA/Megatron-LM holding the commit (branch core_r0.19.0, megatron-core 0.19.1;
# the installed 0.19.2 wheel differs from it in three megatron/core files, none on this path).
set -euo pipefail
commit=f8837c04ef6cbef6cdefb8de001aad63178aebbf
paths=(train_rl.py gpt_builders.py hybrid_builders.py model_provider.py megatron/rl megatron/inference)
cache=${XDG_CACHE_HOME:-$HOME/.cache}/moeverify
py=${PYTHON:-.venv/bin/python}
cmd=${1:?usage: megatron_lm_rl.sh env|pack CHECKOUT [OUT.tar.gz]}
checkout=${2:?usage: megatron_lm_rl.sh env|pack CHECKOUT [OUT.tar.gz]}
src=$cache/megatron-lm-${commit:0:12}
if [[ ! -f "$src/.complete" ]]; then
  git -C "$checkout" cat-file -e "$commit^{commit}" 2>/dev/null \
    || { echo "megatron_lm_rl.sh: $checkout has no commit $commit (fetch branch core_r0.19.0)" >&2; exit 2; }
  rm -rf "$src" && mkdir -p "$src"
  git -C "$checkout" archive "$commit" "${paths[@]}" | tar -x -C "$src"
  touch "$src/.complete"
fi
key=$(sha256sum requirements/megatron_lm_rl.txt | cut -c1-12)
deps=$cache/megatron-lm-rl-deps-$key
if [[ ! -f "$deps/.complete" ]]; then
  rm -rf "$deps"
  "$py" -m pip install --quiet --disable-pip-version-check --target "$deps" -r requirements/megatron_lm_rl.txt >&2
  touch "$deps/.complete"
fi
case $cmd in
  env) echo "export MOEVERIFY_MEGATRON_LM=$src MOEVERIFY_MEGATRON_LM_DEPS=$deps" ;;
  pack)
    out=${3:?usage: megatron_lm_rl.sh pack CHECKOUT OUT.tar.gz}
    # A GPU node has torch and the wheelhouse (.whl/); it lacks the RL loop's server and client packages. pip's
    # copies of what the stack already has (numpy, pydantic, typing_extensions, ...) stay behind: the job appends
    # this folder to sys.path after the stack's.
    # Left behind: what the node's torch image has (numpy, pillow, setuptools) and pip's bin/ scripts.
    keep=$(cd "$deps" && ls -A | grep -Ev '^(numpy|PIL|pillow|setuptools|_distutils_hack|distutils-precedence|bin$|\.complete$)')
    stage=$(mktemp -d)
    mkdir -p "$stage/megatron-lm" "$stage/deps"
    cp -r "$src"/. "$stage/megatron-lm/"
    (cd "$deps" && cp -r $keep "$stage/deps/")
    find "$stage" -name __pycache__ -prune -exec rm -rf {} +
    tar -C "$stage" -czf "$out" megatron-lm deps
    rm -rf "$stage"
    du -h "$out"
    ;;
  *) echo "megatron_lm_rl.sh: unknown command $cmd (env, pack)" >&2; exit 2 ;;
esac
