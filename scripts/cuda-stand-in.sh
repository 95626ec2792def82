#!/usr/bin/env bash
# Runs the CUDA backend's device suite (tests/cuda_device.rs, the device-resident training test
# included) without a GPU, against the host stand-ins of the driver, NVRTC and cuDNN 9
# (cuda_stand_in/): once with each block's threads in order, once in a permuted order.
#
# Builds the stand-in, links it under the libraries' names in target/cuda-stand-in/lib (with
# its headers in target/cuda-stand-in/include), points the backend at that directory only, and
# sets CONV2D_REQUIRE_GPU=1 so that no test can skip. Compiled kernels are cached in
# target/cuda-stand-in/cache, so a second run compiles nothing. Installs g++ (the stand-in
# NVRTC's compiler) when it is missing.
set -euo pipefail
cd "$(dirname "$0")/.."
start=$SECONDS
# scripts/test.sh's features, so the test binary it built is reused, not rebuilt.
features=onednn,cuda

if ! command -v g++ >/dev/null 2>&1; then
    apt-get update -qq
    apt-get install -y -qq g++
fi

cargo build --release -p cuda_stand_in

root=$PWD/target/cuda-stand-in
rm -rf "$root/lib" "$root/include"
mkdir -p "$root/lib" "$root/include" "$root/cache"
for name in libcuda.so libcuda.so.1 libnvrtc.so libnvrtc.so.13 libnvrtc-builtins.so.13.0 \
    libcudnn.so libcudnn.so.9; do
    ln -s "$PWD/target/release/libcuda_stand_in.so" "$root/lib/$name"
done
cp cuda_stand_in/include/*.h "$root/include/"

# Only the stand-ins: no toolkit or pip wheel the backend would otherwise look in.
unset CUDA_HOME CUDA_PATH
export LD_LIBRARY_PATH="$root/lib"
export NVRTC_LIB_DIR="$root/lib"
export CUDNN_LIB_DIR="$root/lib"
export CUDA_INCLUDE_DIR="$root/include"
export CUDA_STAND_IN_CACHE="$root/cache"
export CONV2D_REQUIRE_GPU=1

echo "+ cuda_device, threads in order"
CUDA_STAND_IN_SCHEDULE=in-order cargo test --release --features "$features" --test cuda_device
echo "+ cuda_device, threads in a permuted order ($((SECONDS - start)) s so far)"
CUDA_STAND_IN_SCHEDULE=permuted CUDA_STAND_IN_SEED=20240607 \
    cargo test --release --features "$features" --test cuda_device 2>&1 | tee "$root/permuted.log"
# Without cuDNN: the device and the direct-kernel layers run, a cuDNN layer is an error.
rm -rf "$root/lib-no-cudnn"
mkdir -p "$root/lib-no-cudnn"
for name in libcuda.so libcuda.so.1 libnvrtc.so libnvrtc.so.13 libnvrtc-builtins.so.13.0; do
    ln -s "$PWD/target/release/libcuda_stand_in.so" "$root/lib-no-cudnn/$name"
done
echo "+ cuda_device without cuDNN"
LD_LIBRARY_PATH="$root/lib-no-cudnn" NVRTC_LIB_DIR="$root/lib-no-cudnn" \
    CUDNN_LIB_DIR="$root/lib-no-cudnn" CONV2D_NO_CUDNN=1 \
    cargo test --release --features "$features" --test cuda_device direct_layers_need_no_cudnn
echo "cuda-stand-in: every run passed in $((SECONDS - start)) s"
tail -n 3 "$root/permuted.log"
