#!/usr/bin/env bash
# userdp's GPU check, as a GPU session runs it on the bare, offline box (docs/gpus.md, "The GPU check"):
#   run(command="bash benchmarks/gpu/run.sh", carry=[".whl"], timeout_s=600)
# Carried wheels (.whl/, ignored by git) are installed into /tmp/site first; src/ goes on the path;
# the rows land in $OUT (the device tool's output folder) or ./gpu_out, one JSON line each, as they come.
set -u
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python3}
if ls .whl/*.whl >/dev/null 2>&1; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONUNBUFFERED=1
exec $PY benchmarks/gpu/check.py --out "${OUT:-gpu_out}" "$@"
