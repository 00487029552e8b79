#!/usr/bin/env bash
# verl 0.9.1 as a peer for tests/unit/test_verl_actor_r3.py: verl and the few packages its Megatron engine path
# imports, each installed with --no-deps into a cache directory (never into the project's venv: verl's declared
# requirements are GPU-only and huge). Prints the two environment variables the test reads.
# Usage: eval "$(tools/verl_peer.sh)"   (default directory: ~/.cache/moeverify/verl-0.9.1)
set -euo pipefail
dir=${1:-${XDG_CACHE_HOME:-$HOME/.cache}/moeverify/verl-0.9.1}
py=${PYTHON:-.venv/bin/python}
if [[ ! -f "$dir/.complete" ]]; then
  rm -rf "$dir"
  mkdir -p "$dir"
  "$py" -m pip install --quiet --disable-pip-version-check --no-deps --target "$dir/site" verl==0.9.1 >&2
  "$py" -m pip install --quiet --disable-pip-version-check --no-deps --target "$dir/deps" \
    tensordict==0.10.0 cloudpickle importlib_metadata zipp orjson pyvers \
    ray==2.60.0 msgpack protobuf jsonschema jsonschema-specifications referencing rpds-py attrs \
    requests certifi charset-normalizer idna urllib3 codetiming psutil >&2
  touch "$dir/.complete"
fi
echo "export MOEVERIFY_VERL_SITE=$dir/site MOEVERIFY_VERL_DEPS=$dir/deps"
