#!/usr/bin/env bash
# Compiles cuvmm's C++ layer (cuvmm-torch/csrc/cuvmm_allocator.cpp) against PyTorch VERSION's headers, and
# checks that it overrides every virtual method of that PyTorch's CUDAAllocator (python/test_torch_interface.py),
# without installing PyTorch and without a GPU or CUDA toolkit:
#   - torch/include from the PyTorch wheel (pip download --no-deps; only torch/include and the wheel's
#     METADATA are extracted),
#   - the CUDA runtime's headers from the nvidia-cuda-runtime and nvidia-cuda-crt wheels of the CUDA version
#     that wheel requires,
#   - Python.h from this interpreter (python3-dev), pybind11 from the wheel.
# g++ -fsyntax-only with the standard PyTorch asks for (C++17 up to 2.14, C++20 from 2.15): every template
# the layer uses is instantiated, nothing is linked.
#
# Usage: tools/torch_headers.sh VERSION        e.g. tools/torch_headers.sh 2.15.0
#        TORCH_HEADERS_DIR=DIR tools/torch_headers.sh VERSION   (where downloads are kept; default
#        target/torch-headers/VERSION, reused by the next run)
# CI checks 2.11 and 2.13 (.ci/run); the README names the others and this command.
set -euo pipefail
cd "$(dirname "$0")/.."
version=${1:?usage: tools/torch_headers.sh TORCH_VERSION (e.g. 2.11.0)}
dir=${TORCH_HEADERS_DIR:-target/torch-headers/$version}
python=${PYTHON:-python3}
mkdir -p "$dir"

extract() { # extract WHEEL PREFIX DEST: the members of WHEEL under PREFIX, into DEST
    "$python" - "$@" <<'EOF'
import sys, zipfile
wheel, prefix, dest = sys.argv[1:]
with zipfile.ZipFile(wheel) as z:
    z.extractall(dest, [n for n in z.namelist() if n.startswith(prefix)])
EOF
}

if [ ! -f "$dir/torch.done" ]; then
    echo "== downloading torch==$version (headers only are kept)"
    rm -rf "$dir/wheel" && mkdir -p "$dir/wheel"
    "$python" -m pip download --quiet --no-deps --only-binary=:all: "torch==$version" -d "$dir/wheel"
    wheel=$(ls "$dir"/wheel/torch-*.whl)
    extract "$wheel" torch/include/ "$dir"
    extract "$wheel" "torch-$version" "$dir"
    rm -rf "$dir/wheel"
    touch "$dir/torch.done"
fi
include=$dir/torch/include
metadata=$(ls "$dir"/torch-*.dist-info/METADATA)

# The CUDA version the wheel was built for: cuda-toolkit==13.0.2 (PyTorch 2.11 on), or nvidia-cuda-runtime-cu12==12.8.90.
cuda=$(grep -oE "(cuda-toolkit\[[^]]*\]==|nvidia-cuda-runtime-cu[0-9]+==)[0-9]+\.[0-9]+" "$metadata" | head -1 | grep -oE "[0-9]+\.[0-9]+$")
[ -n "$cuda" ] || { echo "no CUDA runtime named in $metadata"; exit 1; }
if [ ! -f "$dir/cuda.done" ]; then
    echo "== downloading the CUDA $cuda runtime's headers"
    rm -rf "$dir/cuda-wheels" && mkdir -p "$dir/cuda-wheels"
    for package in nvidia-cuda-runtime nvidia-cuda-crt; do
        "$python" -m pip download --quiet --no-deps --only-binary=:all: "$package==$cuda.*" -d "$dir/cuda-wheels"
    done
    for wheel in "$dir"/cuda-wheels/*.whl; do extract "$wheel" nvidia/ "$dir/cuda"; done
    rm -rf "$dir/cuda-wheels"
    touch "$dir/cuda.done"
fi
cuda_include=$(dirname "$(find "$dir/cuda" -name cuda_runtime_api.h | head -1)")

std=c++17
if grep -q "C++20 or later" "$include/torch/csrc/api/include/torch/all.h" 2>/dev/null; then std=c++20; fi
python_include=$("$python" -c 'import sysconfig; print(sysconfig.get_paths()["include"])')
[ -f "$python_include/Python.h" ] || { echo "no Python.h in $python_include (install python3-dev)"; exit 1; }

echo "== the C++ layer against PyTorch $version's headers ($std, CUDA $cuda)"
${CXX:-g++} -std=$std -fsyntax-only -Wall -Werror=overloaded-virtual -Werror=suggest-override \
    -Wno-unused-parameter -Wno-sign-compare -Wno-unknown-pragmas \
    -DTORCH_EXTENSION_NAME=cuvmm_torch_cpp -DTORCH_API_INCLUDE_EXTENSION_H -D_GLIBCXX_USE_CXX11_ABI=1 \
    -isystem "$include" -isystem "$include/torch/csrc/api/include" -isystem "$cuda_include" \
    -isystem "$python_include" -I cuvmm-torch cuvmm-torch/csrc/cuvmm_allocator.cpp

echo "== every virtual method of PyTorch $version's CUDAAllocator is overridden"
CUVMM_TORCH_INCLUDE="$include" "$python" -m unittest python/test_torch_interface.py
echo "PyTorch $version: the C++ layer compiles and overrides the whole interface"
