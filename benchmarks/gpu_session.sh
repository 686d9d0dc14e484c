#!/bin/bash
# One device call for a session that is lent a GPU: the one-shot GPU check, then the GPU probe, everything under $OUT
# in a few files (the device tool brings back at most 8). Run from the repository root on the device machine, with the
# wheels docs/benchmarks.md names in .whl (carry: [".whl"]):  bash benchmarks/gpu_session.sh
# CHECK_S and PROBE_S bound each part in seconds (defaults 300 and 250: both, with the wheels' install and the
# tarball, inside one 10-minute call; the check with --again takes about 180 s and the whole probe about 200 s on an
# H200; PROBE_S=0 leaves the probe out); CHECK_ARGS and PROBE_ARGS pass flags to each (e.g. --again zb-h1,
# --no-compile, --parts dense).
set -u
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 3
mkdir -p /tmp/pp && ln -sfn "$PWD" /tmp/pp/pipesim
export PYTHONPATH=/tmp/pp:/tmp/site
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,power.limit,driver_version --format=csv | tee "$OUT/smi.txt"
python3 -c "import torch; print(torch.__version__, torch.version.cuda, torch.backends.cudnn.version())" | tee -a "$OUT/smi.txt"
start=$(date +%s)
# shellcheck disable=SC2086  # CHECK_ARGS and PROBE_ARGS hold several flags
timeout "${CHECK_S:-300}" python3 benchmarks/gpu_check.py --out /tmp/gpu-check ${CHECK_ARGS:-} 2>&1 | tee "$OUT/gpu-check.log"
echo "gpu_check: exit ${PIPESTATUS[0]} in $(( $(date +%s) - start )) s" | tee -a "$OUT/gpu-check.log"
tar -czf "$OUT/gpu-check.tar.gz" -C /tmp gpu-check  # check.json is rewritten after each step: a stopped check keeps it
[ "${PROBE_S:-250}" = 0 ] && exit 0
start=$(date +%s)
# shellcheck disable=SC2086
timeout "${PROBE_S:-250}" python3 benchmarks/gpu_probe.py --out "$OUT/gpu-probe.json" ${PROBE_ARGS:-} 2>&1 | tee "$OUT/gpu-probe.log"
echo "gpu_probe: exit ${PIPESTATUS[0]} in $(( $(date +%s) - start )) s" | tee -a "$OUT/gpu-probe.log"
