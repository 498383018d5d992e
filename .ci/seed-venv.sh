#!/usr/bin/env bash
# Make the venv of one of the systems dcpstore grew from, .venv-seeds/<system>, from
# requirements/seeds/<system>.txt (docs/integrations/README.md#the-seeds-own-systems):
#   1. the torch lines of that file (torch, torchvision, torchaudio), alone and first, so
#      no resolver picks another build;
#   2. the system and what dcpstore's tests need: the file's other lines plus
#      requirements/core.txt and s3.txt, pinned by that file and, for every package it
#      does not name, by requirements/constraints.txt;
#   3. dcpstore and its S3 and MSC plugins (editable, no dependencies).
# Where the torch matrix already has a venv of that torch (.venv-torch/<version>, made by
# .ci/torch-venv.sh), the seed venv starts as a hard-linked copy of it: step 1 then installs
# nothing, and the torch build (~3-5 GB) is neither downloaded again nor stored twice. pip
# replaces files by unlinking them, so what it changes here never reaches the matrix venv.
# A line "# pip-option: <option>" in the file adds that option to step 2 (megatron-core
# needs --ignore-requires-python on Python 3.11). Finally torch's version is checked.
#
#   .ci/seed-venv.sh physicsnemo        # idempotent: a finished venv is kept
set -euo pipefail
system=${1:?usage: .ci/seed-venv.sh SYSTEM}
python=${PYTHON:-python3}
cd "$(dirname "$0")/.."
reqs=requirements/seeds/$system.txt
test -f "$reqs" || { echo "no $reqs: the seed systems are $(ls requirements/seeds)"; exit 2; }
venv=.venv-seeds/$system
stamp=$venv/.installed
if [[ -f $stamp && $stamp -nt $reqs && $stamp -nt requirements/constraints.txt \
      && $stamp -nt pyproject.toml ]]; then
  exit 0
fi
filter() { sed -e "/^WARNING: Location '.*' is ignored: it is neither a file nor a directory\.$/d"; }
name() { sed -E 's/^([A-Za-z0-9_.-]+).*/\1/' | tr 'A-Z_.' 'a-z--'; }
echo "==> seed system: $venv"
mapfile -t torch_lines < <(grep -E '^torch(vision|audio)?==' "$reqs")
matrix=.venv-torch/${torch_lines[0]#torch==}
if [[ ! -x $venv/bin/python && -f $matrix/.installed ]]; then
  echo "    starting from $matrix (hard links)"
  mkdir -p "$(dirname "$venv")"
  cp -al "$matrix" "$venv"
  # files this script writes below are its own, not the matrix venv's
  rm -f "$venv/.installed" "$venv/pip.conf" "$venv/constraints.txt"
fi
test -x "$venv/bin/python" || "$python" -m venv "$venv"
# The machine's pip config may cap torch at the releases on its local disk; these venvs
# ask for exact releases on purpose (their own pip.conf is read after the machine's).
printf '[global]\nconstraint = /dev/null\n' > "$venv/pip.conf"
pip=("$venv/bin/python" -m pip)
"${pip[@]}" install -q --upgrade pip 2>&1 | filter
"${pip[@]}" install -q "${torch_lines[@]}" 2>&1 | filter
# the seed file pins its own packages; the project's constraints pin the rest
grep -vE '^\s*(#|$)' "$reqs" | name | sort -u > "$venv/seed-names.txt"
: > "$venv/constraints.txt"
while IFS= read -r line; do
  n=$(printf '%s\n' "$line" | name)
  grep -qxF "$n" "$venv/seed-names.txt" || printf '%s\n' "$line" >> "$venv/constraints.txt"
done < <(grep -vE '^\s*(#|$)' requirements/constraints.txt)
grep -vE '^\s*(#|$)' "$reqs" >> "$venv/constraints.txt"
mapfile -t options < <(sed -n 's/^# pip-option: //p' "$reqs")
"${pip[@]}" install -q "${options[@]}" -c "$venv/constraints.txt" -r "$reqs" \
  -r requirements/core.txt -r requirements/s3.txt -r requirements/msc.txt 2>&1 | filter
PYTHONWARNINGS="ignore:Editable installation.:UserWarning" "${pip[@]}" install -q --no-deps \
  --no-build-isolation -e . -e backends/s3 -e backends/msc 2>&1 | filter
"$venv/bin/python" - "${torch_lines[0]#torch==}" <<'PY'
import sys, torch
want = sys.argv[1]
if torch.__version__.split("+")[0] != want:
    sys.exit(f"pip replaced torch: found {torch.__version__}, want {want}")
PY
touch "$stamp"
