#!/usr/bin/env bash
# Issue 34's GPU checks in one call on a CUDA machine: the kernel tests compiled for the GPU, then benchmarks/gpu.py.
#   benchmarks/gpu.sh OUT_STEM [benchmarks.gpu arguments...]      e.g. benchmarks/gpu.sh /tmp/gpu --lengths 4096
# Writes OUT_STEM.tests.log, OUT_STEM.json and OUT_STEM.md. Wheels in .whl/ (transformers at the version
# pyproject.toml pins, for a machine whose image has another) are installed first, without the network.
# TESTS_S and BENCH_S bound each part in seconds (TESTS_S=0: no tests).
set -u
out=${1:?usage: benchmarks/gpu.sh OUT_STEM [benchmarks.gpu arguments...]}
shift
export PYTHONUNBUFFERED=1
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/kvsum-site \
    .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/kvsum-site:$PWD
else
  export PYTHONPATH=$PWD
fi
mkdir -p "$(dirname "$out")"
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv
python3 -c "import torch, triton, transformers as t; print('torch', torch.__version__, 'triton', triton.__version__,
'transformers', t.__version__, torch.cuda.get_device_name())"
workers=$(python3 -c "import importlib.util as u; print('-n 8' if u.find_spec('xdist') else '')")
if [ "${TESTS_S:-240}" != 0 ]; then
  KVSUM_KERNEL_TESTS=cuda timeout "${TESTS_S:-240}" python3 -m pytest -q -p no:cacheprovider $workers tests/kernels \
    >"$out.tests.log" 2>&1
  echo "kernel tests: exit $?"; tail -n 30 "$out.tests.log"
fi
timeout "${BENCH_S:-600}" python3 -m benchmarks.gpu --out "$out" "$@"
echo "benchmark: exit $?"
