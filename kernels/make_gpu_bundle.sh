#!/usr/bin/env bash
# Builds the GPU binaries on this machine (Debian packages, nvcc) against the PyTorch wheel's
# CUDA libtorch, and packs them with the shared libraries a bare GPU machine lacks, for
#   kernels/gpu_check.sh --bundle DIR
# on a machine that has a GPU, PyTorch (same version) and NCCL from its wheels, but not the
# project's Debian packages (the device tool's machines are such).
#
#   kernels/make_gpu_bundle.sh [DIR]    (default .gpu-bundle, which git ignores)
# MOELORA_TORCH_VERSION picks the wheel (default 2.11.0: what the GPU machine's python3 has).
set -euo pipefail
cd "$(dirname "$0")/.."
OUTDIR="${1:-.gpu-bundle}"
TV="${MOELORA_TORCH_VERSION:-2.11.0}"
W="$PWD/.cache/torch-$TV"
if [ ! -f "$W/torch/share/cmake/Torch/TorchConfig.cmake" ]; then
  mkdir -p "$W"
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 -d "$W" "torch==$TV"
  (cd "$W" && unzip -q -o torch-*.whl 'torch/include/*' 'torch/lib/*' 'torch/share/*' && rm -f torch-*.whl)
fi
B="build-gpu-bundle"
export CCACHE_DIR="${CCACHE_DIR:-$PWD/.cache/ccache}"
# libtorch_cuda needs libraries from NVIDIA's wheels (cuSPARSELt, cuFile, NVSHMEM) that this
# machine lacks; they resolve at run time on the GPU machine, so the link allows them undefined.
TORCH_CUDA_ARCH_LIST=9.0 cmake -S . -B "$B" -DCMAKE_BUILD_TYPE=Release -DMOELORA_ENABLE_CUDA=ON \
  -DCMAKE_PREFIX_PATH="$W/torch" -DTorch_DIR="$W/torch/share/cmake/Torch" \
  -DTORCH_CUDA_ARCH_LIST=9.0 -DCMAKE_EXE_LINKER_FLAGS=-Wl,--allow-shlib-undefined >/dev/null
TARGETS=(kernels_gpu_test kernels_test worker_engine_test worker_process_test moelora-worker gpu_kernels
  decode_step)
cmake --build "$B" -j"$(nproc)" --target "${TARGETS[@]}"
rm -rf "$OUTDIR"
mkdir -p "$OUTDIR/bin" "$OUTDIR/lib"
for t in tests/kernels_gpu_test tests/kernels_test tests/worker_engine_test tests/worker_process_test \
  worker/moelora-worker bench/gpu_kernels bench/decode_step; do
  strip -o "$OUTDIR/bin/$(basename "$t")" "$B/$t"
done
# Every shared library the binaries need, except what the GPU machine brings: glibc and the
# compiler runtime (newer there), libtorch and its NVIDIA libraries (its PyTorch), the driver,
# and the CUDA runtime: the wheel's libcudart serves libtorch, so it must serve us too (a copy of
# this machine's would shadow it through LD_LIBRARY_PATH).
skip='^(libc|libm|libdl|librt|libpthread|ld-linux-x86-64|libstdc\+\+|libgcc_s|libtorch.*|libc10.*|libcuda|libcudart|libnccl|libcublas.*|libcudnn.*|libcufft|libcurand|libcusparse.*|libcusolver|libnvrtc.*|libnvJitLink|libnvToolsExt|libcupti|libgomp|libshm|libcaffe2_nvrtc|libnvshmem.*|libcufile.*|libutil)\.so'
for f in "$OUTDIR"/bin/*; do
  ldd "$f" | awk '/=> \// {print $3}'
done | sort -u | while read -r lib; do
  name=$(basename "$lib")
  if ! [[ "$name" =~ $skip ]]; then cp -L "$lib" "$OUTDIR/lib/$name"; fi
done
strip --strip-unneeded "$OUTDIR"/lib/*.so* 2>/dev/null || true
# No binary may carry a static CUDA runtime (CMAKE_CUDA_RUNTIME_LIBRARY Shared).
for t in "${TARGETS[@]}"; do
  f=$(find "$B" -name "$t" -type f -perm -u+x | head -1)
  if nm "$f" 2>/dev/null | grep -qE ' T cudaMalloc$'; then
    echo "$f: links the CUDA runtime statically" >&2
    exit 1
  fi
done
if ls "$OUTDIR"/lib/libcudart* >/dev/null 2>&1; then echo "bundle holds libcudart" >&2; exit 1; fi
du -sh "$OUTDIR"
echo "run there: kernels/gpu_check.sh --bundle $OUTDIR"
