#!/usr/bin/env bash
# A/B of two commits' libraries, in one session on one machine: each checkout runs its
# own harness (python -m benchmarks) on the same stores and sizes, with dcpstore's
# systems alone and no tuning, in alternating rounds (A B, then B A, ...), so that a
# change of the machine's load hits both alike. benchmarks/ab_summary.py compares them.
#
#   benchmarks/ab_commits.sh OLD_CHECKOUT NEW_CHECKOUT OUTDIR [ROUNDS] [SIZE]
#
# Each checkout needs its own .venv (make setup there). Stores: local disk, SeaweedFS
# (dcpstore's S3 and MSC backends) and fake-gcs-server at 2 ranks; moto at 1 rank.
set -euo pipefail
old=$(cd "${1:?usage: OLD NEW OUTDIR [ROUNDS] [SIZE]}" && pwd)
new=$(cd "${2:?}" && pwd)
out=$(mkdir -p "${3:?}" && cd "$3" && pwd)
rounds=${4:-2}
size=${5:-256MiB}
run() {  # run CHECKOUT NAME ROUND
  local dir=$1 name=$2 round=$3
  echo "==> round $round: $name ($(git -C "$dir" rev-parse --short HEAD))"
  (cd "$dir" && .venv/bin/python -m benchmarks --stores local seaweedfs gcs --size "$size" \
      --systems dcpstore-local dcpstore-s3 dcpstore-msc dcpstore-gcs --no-tune --runs 3 \
      --reshard --out "$out/$name-$round/main")
  (cd "$dir" && .venv/bin/python -m benchmarks --stores moto --world-size 1 \
      --moto-size 128MiB --systems dcpstore-s3 --no-tune --runs 3 --reshard \
      --out "$out/$name-$round/moto")
}
for ((r = 1; r <= rounds; r++)); do
  if ((r % 2)); then run "$old" old "$r"; run "$new" new "$r"
  else run "$new" new "$r"; run "$old" old "$r"; fi
done
echo "old=$(git -C "$old" rev-parse HEAD) new=$(git -C "$new" rev-parse HEAD)" > "$out/commits.txt"
