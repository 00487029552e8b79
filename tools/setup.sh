#!/usr/bin/env bash
# Set up .venv for moeverify from scratch, idempotently.
#
# The pinned stack (requirements/*.txt, about 5 GB with torch's CUDA build) is installed once into a venv
# cached OUTSIDE the repo, keyed by the hash of the requirement files and the interpreter version, so a
# clean clone does not download it again. The repo's .venv is a tiny venv that sees the cached stack through
# a .pth file and this checkout through another, with a `moeverify` launcher in .venv/bin.
#
# Python 3.12 is found by itself: $PYTHON, then python3.12 on PATH, then pyenv's versions, then common paths.
# Exit 2 with instructions if none exists.
set -euo pipefail

repo=$(cd "$(dirname "$0")/.." && pwd)
cache_root=${MOEVERIFY_CACHE_DIR:-$HOME/.cache/moeverify}

find_python() {
  local candidates=()
  [ -n "${PYTHON:-}" ] && candidates+=("$PYTHON")
  command -v python3.12 >/dev/null 2>&1 && candidates+=("$(command -v python3.12)")
  local pyenv_root=${PYENV_ROOT:-$HOME/.pyenv}
  command -v pyenv >/dev/null 2>&1 && pyenv_root=$(pyenv root)
  for p in "$pyenv_root"/versions/3.12*/bin/python3.12 /usr/local/bin/python3.12 /usr/bin/python3.12 /opt/python*/bin/python3.12; do
    [ -x "$p" ] && candidates+=("$p")
  done
  command -v python3 >/dev/null 2>&1 && candidates+=("$(command -v python3)")
  for p in "${candidates[@]}"; do
    if "$p" -c 'import sys; sys.exit(0 if sys.version_info[:2] == (3, 12) else 1)' 2>/dev/null; then
      echo "$p"; return 0
    fi
  done
  return 1
}

if ! py=$(find_python); then
  cat >&2 <<'MSG'
moeverify setup: no Python 3.12 interpreter found (megatron-core >= 0.17 needs >= 3.12; megatron-bridge 0.6.2 needs < 3.13).
Looked at: $PYTHON, python3.12 on PATH, $(pyenv root)/versions/3.12*/bin, /usr/local/bin, /usr/bin.
Get one with e.g. `pyenv install 3.12` or `apt-get install python3.12 python3.12-venv`, or point to it: make setup PYTHON=/path/to/python3.12
MSG
  exit 2
fi

pyver=$("$py" -c 'import sys; print("%d.%d.%d" % sys.version_info[:3])')
key=$(cat "$repo"/requirements/stack.txt "$repo"/requirements/nodeps.txt <(echo "$pyver") | sha256sum | cut -c1-16)
stack="$cache_root/stack-$key"

if [ ! -f "$stack/.complete" ]; then
  mkdir -p "$cache_root"
  exec 9>"$cache_root/.stack-$key.lock"
  flock 9
  if [ ! -f "$stack/.complete" ]; then
    echo "moeverify setup: installing the pinned stack into $stack (once per requirements hash; a few minutes)"
    tmp="$stack.tmp.$$"
    rm -rf "$tmp"
    "$py" -m venv "$tmp"
    "$tmp/bin/python" -m pip install --quiet --disable-pip-version-check --no-input -r "$repo/requirements/stack.txt"
    "$tmp/bin/python" -m pip install --quiet --disable-pip-version-check --no-input --no-deps -r "$repo/requirements/nodeps.txt"
    touch "$tmp/.complete"
    rm -rf "$stack"
    mv "$tmp" "$stack"
    # a venv records its own path in scripts and pyvenv.cfg; the stack is only used through .pth, so the
    # interpreter path is all that matters and it does not move.
  fi
  flock -u 9
fi

venv="$repo/.venv"
if [ -L "$venv" ] || { [ -e "$venv" ] && [ ! -f "$venv/.moeverify-stack" ]; }; then
  rm -rf "$venv"
fi
if [ ! -f "$venv/.moeverify-stack" ] || [ "$(cat "$venv/.moeverify-stack")" != "$stack" ]; then
  rm -rf "$venv"
  "$py" -m venv --without-pip "$venv"
  site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  stack_site=$("$stack/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  echo "import site; site.addsitedir('$stack_site')" > "$site/00-moeverify-stack.pth"
  echo "$repo" > "$site/moeverify-src.pth"
  cat > "$venv/bin/moeverify" <<EOF
#!$venv/bin/python
import sys
from moeverify.cli import main
sys.exit(main())
EOF
  chmod +x "$venv/bin/moeverify"
  "$venv/bin/python" -c 'import torch, megatron.core, yaml, safetensors' 2>/dev/null || {
    echo "moeverify setup: the stack in $stack does not import; remove it and run make setup again" >&2; exit 1; }
  echo "$stack" > "$venv/.moeverify-stack"
fi
# Lint tools: a small venv of their own, cached by the hash of requirements/tools.txt, so changing them does
# not reinstall the stack. `make lint` runs .venv/bin/ruff, a link into it.
tkey=$(cat "$repo"/requirements/tools.txt <(echo "$pyver") | sha256sum | cut -c1-16)
tools="$cache_root/tools-$tkey"
if [ ! -f "$tools/.complete" ]; then
  mkdir -p "$cache_root"
  exec 8>"$cache_root/.tools-$tkey.lock"
  flock 8
  if [ ! -f "$tools/.complete" ]; then
    echo "moeverify setup: installing the lint tools into $tools"
    ttmp="$tools.tmp.$$"
    rm -rf "$ttmp"
    "$py" -m venv "$ttmp"
    "$ttmp/bin/python" -m pip install --quiet --disable-pip-version-check --no-input -r "$repo/requirements/tools.txt"
    touch "$ttmp/.complete"
    rm -rf "$tools"
    mv "$ttmp" "$tools"
  fi
  flock -u 8
fi
# A script in .venv/bin, written only when its text changed, and replaced in one rename: a second setup leaves the
# venv as it was, and a command running the old script meanwhile never reads a half-written one.
put_script() {
  local path=$1 text=$2
  if [ -f "$path" ] && [ "$(cat "$path")" = "$text" ] && [ -x "$path" ]; then return 0; fi
  printf '%s\n' "$text" > "$path.tmp.$$"
  chmod +x "$path.tmp.$$"
  mv -f "$path.tmp.$$" "$path"
}
# torchrun as pip installs it (torch.distributed.run:main), under .venv's interpreter: the stack's own torchrun
# names the stack's interpreter, which does not see this checkout.
put_script "$venv/bin/torchrun" "#!$venv/bin/python
import sys
from torch.distributed.run import main
sys.exit(main())"
[ "$(readlink "$venv/bin/ruff" 2>/dev/null)" = "$tools/bin/ruff" ] || ln -sfn "$tools/bin/ruff" "$venv/bin/ruff"
# mypy checks against the stack's packages (torch, numpy): it runs in the tools venv, reading .venv's interpreter
put_script "$venv/bin/mypy" "#!/bin/sh
exec \"$tools/bin/python\" -m mypy --python-executable \"$venv/bin/python\" \"\$@\""
# import-linter's own script names the venv's temporary path: run its entry point through the venv's python
# (the working directory, the repo root, is on its path, so the package is analysed without being installed).
put_script "$venv/bin/lint-imports" "#!/bin/sh
exec \"$tools/bin/python\" -c \"import sys; from importlinter.cli import lint_imports_command; sys.exit(lint_imports_command())\" --no-cache \"\$@\""
echo "moeverify setup: .venv ready (python $pyver, stack $key)"
