#!/usr/bin/env bash
# The GPU check, one prepared script of a few minutes on one GPU machine: the GPU suite
# (tests/gpu, with Megatron's GPU paths where megatron-core and megatron-fsdp are importable)
# and the GPU stall benchmark (benchmarks.cuda_stall), results into OUTDIR.
#
#   benchmarks/gpu_run.sh OUTDIR [COMMIT]      # SIZE=2GiB by default, PYTHON=python3
#
# Needs torch with CUDA and dcpstore's dependencies importable (PYTHONPATH gets the
# checkout). Exit status: non-zero if the suite or the benchmark failed.
set -uo pipefail
out=${1:?usage: benchmarks/gpu_run.sh OUTDIR [COMMIT]}
commit=${2:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
py=${PYTHON:-python3}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
{
  echo "commit $commit"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  $py -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda,
      'nccl', '.'.join(map(str, torch.cuda.nccl.version())), 'gpus', torch.cuda.device_count())"
  nproc
} 2>&1 | tee "$out/env.txt"
timeout 420 $py -m pytest -p no:cacheprovider tests/gpu -v -rs --timeout 200 --junitxml="$out/gpu-suite.xml" \
  2>&1 | grep -v DEBUG | tee "$out/gpu-suite.log"
suite=${PIPESTATUS[0]}
timeout 300 $py -m benchmarks.cuda_stall --size "${SIZE:-2GiB}" --saves 4 --compute-s 1 \
  --commit "$commit" --out "$out/stall" 2>&1 | tee "$out/stall.log"
bench=${PIPESTATUS[0]}
echo "gpu suite rc=$suite, stall benchmark rc=$bench" | tee -a "$out/env.txt"
exit $(( suite || bench ))
