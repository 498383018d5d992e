#!/usr/bin/env bash
# The torch matrix's test run (make test-matrix; docs/torch-matrix.md): the core suite on
# every release of TORCH_MATRIX, each in its venv (.ci/torch-venv.sh made them), then
# checkpoints across releases: each release (the development one too) saves one, and
# each loads every one, bit-exact. Exit status: non-zero if anything failed.
#
#   TORCH_MATRIX="2.9.1 2.10.0" MATRIX_TESTS="tests/..." DEV_PYTHON=.venv/bin/python \
#     MATRIX_STORES=local,seaweedfs .ci/torch-matrix.sh
set -uo pipefail
cd "$(dirname "$0")/.."
: "${TORCH_MATRIX:?}" "${MATRIX_TESTS:?}" "${DEV_PYTHON:=.venv/bin/python}"
failed=()
# some releases' gloo prints a line per connection; everything else on stderr shows
quiet_gloo() { grep -v '^\[Gloo\] Rank' >&2; }
for v in $TORCH_MATRIX; do
  echo "==> torch $v: the core suite (.venv-torch/$v)"
  # shellcheck disable=SC2086  # MATRIX_TESTS is a list of paths
  DCPSTORE_TEST_STORES=${MATRIX_STORES:-local,seaweedfs} \
    ".venv-torch/$v/bin/python" -m pytest -q $MATRIX_TESTS || failed+=("$v")
done
echo "==> checkpoints across torch releases"
shared=$(mktemp -d "${TMPDIR:-/tmp}/dcpstore-cross-release-XXXXXX")
trap 'rm -rf "$shared"' EXIT
pythons=("$DEV_PYTHON")
for v in $TORCH_MATRIX; do pythons+=(".venv-torch/$v/bin/python"); done
for py in "${pythons[@]}"; do
  release=$("$py" -c "import torch; print(torch.__version__)")
  "$py" tests/cross_release.py save "$shared/$release" 2> >(quiet_gloo) \
    || failed+=("save:$release")
done
for py in "${pythons[@]}"; do
  "$py" tests/cross_release.py load "$shared" 2> >(quiet_gloo) || failed+=("load:$py")
done
if ((${#failed[@]})); then
  echo "torch matrix failed: ${failed[*]}"
  exit 1
fi
echo "torch matrix passed: $TORCH_MATRIX (core suite), and checkpoints across them and $("$DEV_PYTHON" -c 'import torch; print(torch.__version__)')"
