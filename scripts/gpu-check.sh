#!/usr/bin/env bash
# The CUDA backend's numeric checks on a GPU machine (driver 580 / CUDA 13.0): installs NVRTC 13,
# the CUDA headers and cuDNN 9 for CUDA 13 from pip, builds, and runs tests/cuda_device.rs with
# CONV2D_REQUIRE_GPU=1 (a missing GPU fails instead of skipping) — every spec against the CPU
# device on both convolution paths, on host tensors and device-resident, the optimizers' GPU step
# against their CPU step, and the synthetic training task on the GPU — then the kernel compile
# checks (tests/cuda_kernels.rs). Prints pass/fail counts; exits non-zero on any failure.
# Budget: about 8 minutes on a fresh machine (pip ~1 min, build ~2-4 min, tests ~1 min).
set -uo pipefail
cd "$(dirname "$0")/.."
start=$SECONDS

python3 -m pip install --quiet --disable-pip-version-check \
    nvidia-cuda-nvrtc==13.0.88 nvidia-cuda-runtime==13.0.96 nvidia-cudnn-cu13==9.13.1.26 \
    || { echo "gpu-check: pip install failed" >&2; exit 1; }

# NVIDIA's wheels put their libraries in site-packages/nvidia/*/lib (cuDNN also needs cuBLAS's).
libs=$(python3 - <<'PY'
import glob, os, site, sysconfig
roots = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"], site.getusersitepackages()}
roots.update(getattr(site, "getsitepackages", list)())
print(":".join(sorted({d for r in roots for d in glob.glob(os.path.join(r, "nvidia", "*", "lib"))})))
PY
)
export LD_LIBRARY_PATH="${libs}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export CONV2D_REQUIRE_GPU=1
echo "gpu-check: libraries in $libs"
nvidia-smi --query-gpu=name,driver_version,compute_cap --format=csv,noheader 2>/dev/null || echo "gpu-check: nvidia-smi not found"

log=target/gpu-check
mkdir -p "$log"
status=0
run() {
    local name=$1; shift
    echo "+ $*"
    "$@" 2>&1 | tee "$log/$name.log"
    local rc=${PIPESTATUS[0]}
    [ "$rc" -eq 0 ] || status=1
    echo "gpu-check: $name exited $rc ($((SECONDS - start)) s elapsed)"
}

run build cargo build --release --features cuda --tests
if [ "$status" -eq 0 ]; then
    # --nocapture: the GPU name and the training run's losses and accuracy are printed.
    run cuda_device cargo test --release --features cuda --test cuda_device -- --nocapture --test-threads 4
    run cuda_kernels cargo test --release --features cuda --test cuda_kernels
fi

passed=0; failed=0
for f in "$log"/cuda_device.log "$log"/cuda_kernels.log; do
    [ -f "$f" ] || continue
    p=$(grep -o '[0-9]* passed' "$f" | awk '{s+=$1} END {print s+0}')
    q=$(grep -o '[0-9]* failed' "$f" | awk '{s+=$1} END {print s+0}')
    passed=$((passed + p)); failed=$((failed + q))
done
grep -h "^test .* FAILED$" "$log"/*.log 2>/dev/null | sort -u
grep -h "GPU training:" "$log"/cuda_device.log 2>/dev/null
echo "gpu-check: $passed passed, $failed failed, $((SECONDS - start)) s"
[ "$status" -eq 0 ] && [ "$failed" -eq 0 ]
