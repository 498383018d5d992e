#!/usr/bin/env bash
# Make the venv of one torch release of the matrix, .venv-torch/<version>: that torch
# alone and first (pip's pin, so no resolver swaps it), then what the core suite needs,
# pinned by requirements/constraints.txt less its torch pin, then dcpstore and its S3
# plugin (editable, no dependencies: torch stays the one asked for).
#
#   .ci/torch-venv.sh 2.10.0        # idempotent: a finished venv is kept
set -euo pipefail
version=${1:?usage: .ci/torch-venv.sh TORCH_VERSION}
python=${PYTHON:-python3}
venv=.venv-torch/$version
stamp=$venv/.installed
cd "$(dirname "$0")/.."
if [[ -f $stamp && $stamp -nt requirements/constraints.txt && $stamp -nt pyproject.toml ]]; then
  exit 0
fi
filter() { sed -e "/^WARNING: Location '.*' is ignored: it is neither a file nor a directory\.$/d"; }
echo "==> torch matrix: $venv"
test -x "$venv/bin/python" || "$python" -m venv "$venv"
# The machine's pip config may cap torch at the releases on its local disk; this venv
# asks for one exact release on purpose. Its own pip.conf (read after the machine's)
# drops that cap and keeps the rest (local wheel folders, indexes).
printf '[global]\nconstraint = /dev/null\n' > "$venv/pip.conf"
pip=("$venv/bin/python" -m pip)
"${pip[@]}" install -q --upgrade pip 2>&1 | filter
"${pip[@]}" install -q "torch==$version" 2>&1 | filter
grep -v '^torch==' requirements/constraints.txt > "$venv/constraints.txt"
"${pip[@]}" install -q -c "$venv/constraints.txt" -r requirements/core.txt -r requirements/s3.txt \
  2>&1 | filter
PYTHONWARNINGS="ignore:Editable installation.:UserWarning" "${pip[@]}" install -q --no-deps \
  --no-build-isolation -e . -e backends/s3 2>&1 | filter
"$venv/bin/python" - "$version" <<'PY'
import sys, torch
want = sys.argv[1]
if torch.__version__.split("+")[0] != want:
    sys.exit(f"pip replaced torch: found {torch.__version__}, want {want}")
PY
touch "$stamp"
