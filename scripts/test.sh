#!/usr/bin/env bash
# Runs every test. Installs what the tests need first (idempotently): oneDNN 3.2 for the
# `onednn` feature, which loads it at run time from ONEDNN_LIB_DIR, and NVRTC 13 with the CUDA
# headers for the `cuda` feature's kernel compile checks.
set -euo pipefail
cd "$(dirname "$0")/.."

prefix=$(python3 -c 'import sys; print(sys.prefix)')
export ONEDNN_LIB_DIR="${ONEDNN_LIB_DIR:-$prefix/lib}"
if [ ! -e "$ONEDNN_LIB_DIR/libdnnl.so.3" ]; then
    python3 -m pip install --quiet --disable-pip-version-check onednn-devel-cpu-gomp==2023.2.0
fi
if [ ! -e "$ONEDNN_LIB_DIR/libdnnl.so.3" ]; then
    echo "oneDNN was installed but $ONEDNN_LIB_DIR/libdnnl.so.3 is missing" >&2
    exit 1
fi

# NVRTC and the CUDA headers, to compile every generated kernel for sm_90 (no GPU needed).
python3 -m pip install --quiet --disable-pip-version-check \
    nvidia-cuda-nvrtc==13.0.88 nvidia-cuda-runtime==13.0.96

# Every cargo command takes the same features, so each crate is compiled once and every later
# step reuses what the first built (a different feature set would rebuild the runtime and every
# test crate after it).
features=onednn,cuda
start=$SECONDS
run() {
    echo "+ $* ($((SECONDS - start)) s so far)"
    "$@"
}

# Everything, with the oneDNN backend and the CUDA kernels' compile checks.
run cargo test --workspace --release --features $features
# The numeric suites again with the portable kernels (CPUs without AVX2+FMA).
CONV2D_SIMD=portable run cargo test --release --features $features --test conformance_training --test specs_forward --test network
# The suites with Winograd layers on AVX2 alone: where the CPU has AVX-512, the default runs
# take its Winograd products (conv_runtime::wide) and would leave the AVX2 ones untested.
CONV2D_SIMD=avx2 run cargo test --release --features $features --test specs_forward --test network
# A build without the portable kernels (`--no-default-features`, about 0.6 of the build time): a CPU
# without AVX2+FMA (stood in for by CONV2D_SIMD=portable) is refused with a clear error.
run cargo test --release --no-default-features --features $features --test portable_feature
# The numeric suites built for this machine's CPU: where it has AVX2+FMA, the generated code
# compiles no portable fallback and calls the AVX2 kernels without a check (its own target dir:
# other flags rebuild everything).
RUSTFLAGS="-C target-cpu=native" run cargo test --release --target-dir target/native \
    --test conformance_forward --test conformance_training --test specs_forward --test network
# The numeric suites on a 2-thread device that splits every call (tests/common: `cpu()`), so the
# parallel paths meet the references too (tests/threads.rs holds them to the 1-thread bits).
CONV2D_TEST_THREADS=2 run cargo test --release --features $features --test conformance_forward \
    --test conformance_training --test specs_forward --test half_conformance --test half_specs \
    --test gradcheck --test training --test network
# The CUDA backend's device suite without a GPU, against the host stand-ins of the driver, NVRTC
# and cuDNN (cuda_stand_in/): threads in order, permuted, and without cuDNN.
run scripts/cuda-stand-in.sh
# The main example in its short mode: exits non-zero unless the network learned.
run cargo run --release --features $features --example train_digits -- --quick --plot target/ci/train_digits.png --save target/ci/train_digits.safetensors
run cargo run --release --features $features --example train_digits -- --quick --threads 2
run cargo run --release --features $features --example train_digits -- --quick --backend onednn --plot target/ci/train_digits_onednn.png --save target/ci/train_digits_onednn.safetensors
# DQN on MinAtar Breakout in its short mode: exits non-zero unless the agent beats random play.
run cargo run --release --features $features --example dqn_minatar -- --quick --threads 2 --plot target/ci/dqn_minatar.png --save target/ci/dqn_minatar.safetensors
echo "scripts/test.sh: every step passed in $((SECONDS - start)) s"
