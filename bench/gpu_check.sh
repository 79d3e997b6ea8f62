#!/usr/bin/env bash
# The GPU check of the Triton backend, one script for a CUDA machine:
#   1. installs this checkout (pip install -e ., no dependencies: torch and triton are
#      already there and must not be reinstalled; no network needed);
#   2. runs the Triton parity tests on CUDA (tests/test_backend_parity.py,
#      tests/test_triton_backend.py, -m triton, without TRITON_INTERPRET);
#   3. times GPT-2 small (124M coordinates, 148 tensors), B in {1, 8, 32}: fused step vs
#      reference vs an Opacus-style pipeline, the summed path vs torch.normal + AdamW(fused),
#      sigma = 0 vs sigma > 0, as GB/s against the bytes floor and the copy bandwidth
#      (bench/gpu_check.py; its --smoke mode tests it on CPU);
#   4. runs dpkern.distributed on NCCL, one process per GPU (bench/gpu_dist_check.py).
# Budget: under 8 minutes on an H200 (Triton compilation of the test variants included).
# Usage: bash bench/gpu_check.sh [extra gpu_check.py arguments, e.g. --gs-dtype bfloat16]
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
unset TRITON_INTERPRET

if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "gpu_check: no CUDA device (torch.cuda.is_available() is False); nothing to check."
    exit 0
fi
"$PY" -c "import torch, triton; print('gpu_check:', torch.cuda.get_device_name(), 'torch', torch.__version__, 'triton', triton.__version__)" || {
    echo "gpu_check: triton is not importable; cannot run the Triton backend"; exit 1; }

# 1. install (editable, no deps, no build isolation: nothing is downloaded)
if ! "$PY" -m pip install --quiet --no-deps --no-build-isolation -e . ; then
    echo "gpu_check: pip install -e . failed; using the checkout through PYTHONPATH"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

status=0
# 2. parity tests on CUDA
if "$PY" -c "import pytest" 2>/dev/null; then
    # Four pytest processes in parallel: most of the time goes into compiling the kernel
    # variants (one per update rule, dtype and flag set), which is single-threaded.
    logs=$(mktemp -d)
    parts=("test_step and dtype0" "test_step and dtype1" "test_step and dtype2"
           "not test_step")
    pids=()
    for i in "${!parts[@]}"; do
        timeout 270 "$PY" -m pytest -q -m triton -p no:cacheprovider -k "${parts[$i]}" \
            tests/test_backend_parity.py tests/test_triton_backend.py >"$logs/$i.log" 2>&1 &
        pids+=($!)
    done
    for i in "${!parts[@]}"; do
        wait "${pids[$i]}"; rc=$?
        echo "--- parity tests -k '${parts[$i]}': exit $rc"
        tail -n 25 "$logs/$i.log"
        [ "$rc" -ne 0 ] && status=1
    done
    echo "gpu_check: triton parity tests $([ $status -eq 0 ] && echo passed || echo FAILED)"
else
    echo "gpu_check: pytest is not installed; skipping the parity tests"
fi

# 3. timings
timeout 150 "$PY" bench/gpu_check.py "$@" || status=1

# 4. dpkern.distributed on NCCL (DDP, FSDP2 + ghost, FSDP2 + MacAdam, the noise): the same
#    steps as one process (bench/gpu_dist_check.py; --device cpu runs it on gloo)
timeout 120 "$PY" bench/gpu_dist_check.py || status=1
exit $status
