#!/usr/bin/env bash
# The test suite (README's test command): the main pytest process, then the Triton kernels
# under the CPU interpreter in their own pytest process (TRITON_INTERPRET is read when the
# kernels are defined, so it must be set before they are imported). Extra arguments are
# passed to both pytest runs.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}

"$PY" -m pytest tests -m "not triton" "$@"
main=$?
TRITON_INTERPRET=1 "$PY" -m pytest tests -m triton "$@"
kern=$?
[ "$kern" -eq 5 ] && kern=0   # no triton test collected (triton not installed): not a failure
echo "main suite exit $main, triton suite exit $kern"
[ "$main" -eq 0 ] && [ "$kern" -eq 0 ]
