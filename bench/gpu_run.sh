#!/usr/bin/env bash
# The GPU check (bench/gpu.py) on a machine that has Python and a CUDA build of torch but no
# package index, and takes at most 64 MiB of files beside the repository tree.
#
#   bench/gpu_run.sh prepare          here: wheels of every package the check imports beyond torch
#                                     and torch's own requirements, into build/gpu-carry/
#   bench/gpu_run.sh run [ARGS...]    there, in the repository root with build/gpu-carry/ beside it:
#                                     installs the wheels into build/gpu-site/ and runs
#                                     bench/gpu.py --time-limit $TIME_LIMIT ARGS under a timeout;
#                                     a death by signal ends with `gpu_check=failed: killed by signal N`
#
# The wheels are for CPython $PY_VERSION (3.12) on manylinux x86_64, at the versions this
# repository's virtualenv has (the tested ones). A package published only as source is built here
# and carried only if the wheel is pure Python. tests/test_bench_gpu.py holds CARRIED to what
# bench/gpu.py imports.
set -euo pipefail
cd "$(dirname "$0")/.."

CARRIED="pydantic pydantic-core annotated-types typing-extensions typing-inspection boto3 botocore s3transfer jmespath urllib3 python-dateutil six certifi numpy s3torchconnector s3torchconnectorclient tenacity"
PY_VERSION=${PY_VERSION:-3.12}
CARRY_DIR=${CARRY_DIR:-build/gpu-carry}
SITE_DIR=${SITE_DIR:-build/gpu-site}
CARRY_LIMIT_BYTES=$((64 * 1024 * 1024))
LOCAL_PYTHON=${LOCAL_PYTHON:-.venv/bin/python}   # prepare: the pip that downloads, the versions to carry
PYTHON=${PYTHON:-python3}                        # run: the interpreter with the CUDA torch
TIME_LIMIT=${TIME_LIMIT:-480}                    # run: bench/gpu.py's own limit; the timeout adds a minute

fail() {
  echo "gpu_run: $*" >&2
  exit 1
}

prepare() {
  rm -rf "$CARRY_DIR"
  mkdir -p "$CARRY_DIR"
  local dist version spec built
  for dist in $CARRIED; do
    version=$("$LOCAL_PYTHON" -c 'import importlib.metadata as m, sys; print(m.version(sys.argv[1]))' "$dist") \
      || fail "$LOCAL_PYTHON has no $dist: its version is the one carried"
    spec="$dist==$version"
    if ! "$LOCAL_PYTHON" -m pip download --quiet --only-binary=:all: --python-version "$PY_VERSION" \
        --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 --no-deps -d "$CARRY_DIR" "$spec" 2>/dev/null; then
      built=$(mktemp -d)
      "$LOCAL_PYTHON" -m pip wheel --quiet --no-deps -w "$built" "$spec" || fail "no wheel of $spec for Python $PY_VERSION"
      compgen -G "$built/*-none-any.whl" >/dev/null || fail "$spec has no wheel for Python $PY_VERSION and is not pure Python"
      mv "$built"/*.whl "$CARRY_DIR"/
      rm -rf "$built"
    fi
  done
  local total
  total=$(du -cb "$CARRY_DIR"/*.whl | tail -1 | cut -f1)
  ls -l "$CARRY_DIR"
  if ((total > CARRY_LIMIT_BYTES)); then
    fail "$CARRY_DIR holds $((total / 1024 / 1024)) MiB of wheels, more than the $((CARRY_LIMIT_BYTES / 1024 / 1024)) MiB carried beside the tree"
  fi
  echo "$CARRY_DIR: $(ls "$CARRY_DIR" | wc -l) wheels, $((total / 1024)) KiB for CPython $PY_VERSION"
  echo "carry $CARRY_DIR and run there, in the repository root: bench/gpu_run.sh run"
}

run() {
  [[ -d $CARRY_DIR ]] || fail "no $CARRY_DIR: run 'bench/gpu_run.sh prepare' where a package index is reachable"
  rm -rf "$SITE_DIR"
  if "$PYTHON" -m pip --version >/dev/null 2>&1; then
    "$PYTHON" -m pip install --quiet --no-index --no-deps --disable-pip-version-check --target "$SITE_DIR" \
      "$CARRY_DIR"/*.whl || { echo "gpu_check=failed: the carried wheels did not install into $SITE_DIR"; exit 1; }
  else
    # No pip: a wheel is a zip archive laid out as site-packages wants it.
    local wheel
    for wheel in "$CARRY_DIR"/*.whl; do
      "$PYTHON" -m zipfile -e "$wheel" "$SITE_DIR" || { echo "gpu_check=failed: $wheel did not unpack"; exit 1; }
    done
  fi
  local status=0 limit=$((TIME_LIMIT + 60)) started=$SECONDS
  # -X faulthandler from the first line: a crash in native code (SIGSEGV, SIGABRT from NCCL's
  # watchdog) prints every thread's Python stack before the process dies.
  PYTHONPATH="$SITE_DIR${PYTHONPATH:+:$PYTHONPATH}" \
    timeout --kill-after=30 "$limit" "$PYTHON" -X faulthandler bench/gpu.py --time-limit "$TIME_LIMIT" "$@" \
    || status=$?
  verdict "$status" $((SECONDS - started)) "$limit"
  exit "$status"
}

# The last line when bench/gpu.py could not print its own: a process that died by a signal prints
# nothing. timeout exits 124 when it ended the check with TERM, 137 (128 + KILL) when it had to
# kill it 30 s later; 137 before the limit is a SIGKILL from elsewhere (the host's OOM killer), and
# any other status above 128 is the signal 128 less (134 SIGABRT, NCCL's watchdog; 139 SIGSEGV).
verdict() {
  local status=$1 elapsed=$2 limit=$3
  if ((status == 124 || (status == 137 && elapsed >= limit))); then
    echo "gpu_check=failed: killed by timeout after $limit s; its own time limit did not end it"
  elif ((status > 128)); then
    local signal=$((status - 128)) why=""
    ((signal == 9)) && why=" (SIGKILL before the time limit: the host's OOM killer, or another process)"
    echo "gpu_check=failed: killed by signal $signal$why"
  fi
  return 0
}

case "${1:-}" in
  prepare) prepare ;;
  run) shift; run "$@" ;;
  *) fail "usage: bench/gpu_run.sh prepare | bench/gpu_run.sh run [bench/gpu.py arguments]" ;;
esac
