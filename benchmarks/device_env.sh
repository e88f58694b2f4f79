#!/usr/bin/env bash
# The GPU machine made ready for this repository's commands, sourced at the start of a call (before any
# `python3 benchmarks/...` or `python3 -m pytest -m gpu ...` of one's own):
#   source benchmarks/device_env.sh
# Installs the wheels of .whl/ (benchmarks/device_inputs.sh makes them; carry the folder) to /tmp/site once a
# machine and puts them on PYTHONPATH, unbuffers Python's output, and builds the native CPU kernel for the
# machine's CPU. benchmarks/gpu_check.sh sources it too.
if compgen -G ".whl/*.whl" >/dev/null && [[ ! -d /tmp/site/msgspec ]]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
fi
[[ -d /tmp/site ]] && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1
python3 setup.py build_ext --inplace 2>&1 | tail -1
