#!/usr/bin/env bash
# Syntax-checks the C++ layer (cuvmm-torch/csrc/cuvmm_allocator.cpp) against an installed PyTorch's headers,
# on a machine without a GPU or CUDA toolkit: log=$(mktemp)
trap 'rm -f "$log"' EXIT
status=0
g++ -fsyntax-only -std=c++17 -Wall -Wextra -DTORCH_EXTENSION_NAME=cuvmm_torch_ext -D_GLIBCXX_USE_CXX11_ABI=1 \
    -I"$site/torch/include" -I"$site/torch/include/torch/csrc/api/include" \
    -I"$site/nvidia/cuda_runtime/include" -I"$site/nvidia/cuda_nvcc/include" \
    -I"$py_include" -Icuvmm-torch cuvmm-torch/csrc/cuvmm_allocator.cpp 2>"$log" || status=$?
# The file's own diagnostics, and any error wherever it is (the headers' warnings are not ours).
grep -A4 -E "cuvmm_allocator.cpp:[0-9]+:[0-9]+: (error|warning)|: error:" "$log" || true
[ "$status" -eq 0 ] || { echo "cuvmm_allocator.cpp: does not compile"; exit 1; }
echo "cuvmm_allocator.cpp: syntax OK"
