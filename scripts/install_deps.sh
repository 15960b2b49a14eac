#!/usr/bin/env bash
# Installs every Debian package moelora's build and tests need. Idempotent; run as root.
#   install_deps.sh          build + tests (CI, developers)
#   install_deps.sh build    only what compiles the shipped binaries (the Docker build stage)
# (CUDA and NCCL are not Debian packages: they come with the toolkit in /usr/local/cuda, which
# the build uses when present.)
set -euo pipefail
SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
MODE="${1:-all}"
PACKAGES=(
  build-essential cmake ninja-build ccache git pkg-config
  libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler
  libabsl-dev libtorch-dev libgloo-dev prometheus-cpp-dev
  # libtorch links the reference BLAS by default; OpenBLAS (OpenMP, like libtorch) replaces it
  # through Debian's alternatives and makes CPU matmuls about 10x faster.
  libopenblas0-openmp
  libsqlite3-dev nlohmann-json3-dev libgoogle-glog-dev
  # the tokenizer: PCRE2 for the pre-tokenizer regexes, ICU for NFC
  libpcre2-dev libicu-dev
  # the OpenAI-compatible HTTP API (--http-port)
  libmicrohttpd-dev
  # images (vision/): the PNG, JPEG and WebP decoders
  libpng-dev libjpeg62-turbo-dev libwebp-dev
  # SHA-256 (the workers' encoder cache keys)
  libssl-dev
)
if [ "$MODE" != "build" ]; then
  PACKAGES+=(
    libgtest-dev libgmock-dev libbenchmark-dev
    clang libclang-rt-14-dev clang-format
    # clang's OpenMP runtime (the fuzz and TSan trees build lora/ and worker/ with -fopenmp)
    libomp-dev
    # deploy checks: promtool and a live Prometheus; python3-venv for the pip-installed checkers
    prometheus python3-venv
    # the README's metrics example
    curl
    # bench/http_api's HTTP client; bench/sse_streams' other server library
    libcurl4-openssl-dev libcpp-httplib-dev
    # the Docker image test: a Docker engine, and debootstrap for its Debian base image
    docker.io debootstrap
  )
fi
missing=()
for p in "${PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ "${#missing[@]}" -eq 0 ]; then
  echo "install_deps: all ${#PACKAGES[@]} packages already installed"
  exit 0
fi
echo "install_deps: installing ${missing[*]}"
$SUDO apt-get update
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y --no-install-recommends "${missing[@]}"
