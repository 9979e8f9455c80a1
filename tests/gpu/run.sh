#!/usr/bin/env bash
# The GPU checks, in one command, on a machine with CUDA GPUs:
#
#     bash tests/gpu/run.sh
#
# Installs the package where it is not importable yet (or, on a machine that reaches no package
# index, unpacks the Ray that tests/gpu/pack_ray.sh put in .whl/raysite.tar.xz), then
# runs the GPU tests (pytest -m gpu), an NCCL check over every GPU, the step-time benchmark
# against Lightning's ddp on the same GPUs, and the cold start broken into its parts (Ray start,
# actor start, CUDA init, process group, Lightning's import) against a new ddp process's. Exits
# non-zero if any of them failed.
set -uo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python3}
if [ -f .whl/raysite.tar.xz ]; then
    mkdir -p /tmp/raysite && tar xJf .whl/raysite.tar.xz -C /tmp/raysite
    export PYTHONPATH=/tmp/raysite${PYTHONPATH:+:$PYTHONPATH}
elif ! $PY -c "import ray_lightning_sgd" 2>/dev/null; then
    $PY -m pip install --quiet -e ".[dev]"
fi
# Ray's workers import the package and the tests' models from the checkout
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
$PY -c "import torch, ray, pytorch_lightning as pl; print('torch', torch.__version__, \
'cuda', torch.version.cuda, 'nccl', torch.cuda.nccl.version(), 'ray', ray.__version__, \
'lightning', pl.__version__, 'gpus', torch.cuda.device_count())"
status=0
echo "=== pytest -m gpu"
$PY -m pytest -m gpu -v -p no:cacheprovider tests/test_gpu.py || status=1
echo "=== NCCL check"
$PY tests/gpu/nccl_check.py || status=1
echo "=== step time against Lightning's ddp on the same GPUs"
$PY benchmarks/bench.py --gpu --modes ddp ray_sgd_cold ray_sgd_warm --repeats 3 \
    --transfer-params 0 --ship-mb 0 || status=1
echo "=== cold start by part, against a new ddp process"
$PY benchmarks/cold_start.py --gpu --repeats 3 \
    --workers "$($PY -c 'import torch; print(min(2, torch.cuda.device_count()))')" || status=1
exit $status
