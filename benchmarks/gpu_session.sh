#!/usr/bin/env bash
# What a session lent a CUDA machine runs there, in one call: the CUDA tests (tests/test_gpu.py: fp32
# greedy identity, bf16, CUDA graphs on static shapes, a draft head, `draft train`'s and a
# `--draft train:N` job's, trained and drafting in fp32 and
# bf16), then benchmarks/gpu_compile.py. Logs land in
# $OUT (or ./gpu-out).
#
# That machine has torch and transformers but not specq's other needs; the compiled path needs
# platformdirs, carried as a wheel. Prepare here, once:
#     echo /.whl/ >> .git/info/exclude
#     python3 -m pip download --no-deps --only-binary=:all: -d .whl platformdirs
# and call the device tool with carry [".whl"] and the command `bash benchmarks/gpu_session.sh`.
set -uo pipefail
out=${OUT:-gpu-out}
mkdir -p "$out"
if compgen -G ".whl/*.whl" > /dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD" SPECQ_HOME=/tmp/specq-home PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/device.txt"
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" \
    | tee -a "$out/device.txt"
# conftest.py reaches for Redis and Postgres, which the CUDA tests do not use
timeout 240 python3 -m pytest --noconftest -p no:cacheprovider -q -rs tests/test_gpu.py 2>&1 | tee "$out/gpu_tests.log"
timeout 480 python3 benchmarks/gpu_compile.py 2>&1 | tee "$out/gpu_compile.log"
