#!/usr/bin/env bash
# Everything a GPU proves, in one call of the device tool (a lease is short and rare):
#   run(command="bash benchmarks/gpu_session.sh", carry=[".whl"], timeout_s=580)
# On the device machine python3 has torch (CUDA), NVML, rich, yaml, psutil, pytest; the wheels in
# .whl/ (pydantic and its parts, py-spy: see the download line below) are what it lacks. Nothing
# is installed from the network there: the tree itself is on PYTHONPATH.
#   python -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
#     -d .whl pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 py-spy==0.4.3
# Records under $OUT: selftest.json (feeds benchmarks/selftest_section.py -> BENCHMARKS.md), the
# NVML recording (a test fixture: tests/unit/data/nvml/), the gpu tests' log, nvidia-smi.
set -uo pipefail
OUT=${OUT:-/tmp/gpu-session}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
export PATH=/tmp/site/bin:$PATH
{ date -u; git log -1 --format=%H 2>/dev/null; nvidia-smi; python3 -c "import torch; print(torch.__version__, torch.version.cuda)"; } > "$OUT/machine.txt" 2>&1
python3 -m launcher.runtime.nvml --record > "$OUT/nvml_record.json" 2> "$OUT/nvml.err"
python3 -m launcher.runtime.nvml > "$OUT/nvml_inventory.json" 2>> "$OUT/nvml.err"
timeout "${SELFTEST_S:-300}" python3 -m launcher selftest --full --json --out /tmp/gl-runs > "$OUT/selftest.json" 2> "$OUT/selftest.log"
echo "selftest rc=$?"
timeout "${PYTEST_S:-200}" python3 -m pytest -m gpu -q -p no:cacheprovider -x tests/gpu tests/benchmarks/test_recorder_gpu.py > "$OUT/pytest_gpu.log" 2>&1
echo "pytest -m gpu rc=$?"
tail -n 40 "$OUT/selftest.log"
tail -n 15 "$OUT/pytest_gpu.log"
