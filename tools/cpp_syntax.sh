#!/usr/bin/env bash
# Syntax-checks the C++ layer (cuvmm-torch/csrc/cuvmm_allocator.cpp) against an installed PyTorch's headers,
# on a machine without a GPU or CUDA toolkit: the compiler only parses and type-checks, nothing is built.
#
#   python3 -m venv /tmp/torchvenv && /tmp/torchvenv/bin/pip install torch   # the CUDA wheel: it brings the
#                                                                            # CUDA runtime's headers
#   tools/cpp_syntax.sh [/tmp/torchvenv]
#
# Prints the file's own errors and warnings (the headers' warnings are left out), and exits non-zero if it
# does not compile.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${1:-${TORCH_VENV:-/tmp/torchvenv}}
site=$("$venv/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
[ -d "$site/torch/include" ] || { echo "no PyTorch headers under $site/torch/include"; exit 2; }
py_include=$(python3 -c "import sysconfig; print(sysconfig.get_paths()['include'])")
log=$(mktemp)
trap 'rm -f "$log"' EXIT
status=0
g++ -fsyntax-only -std=c++17 -Wall -Wextra -DTORCH_EXTENSION_NAME=cuvmm_torch_ext -D_GLIBCXX_USE_CXX11_ABI=1 \
    -I"$site/torch/include" -I"$site/torch/include/torch/csrc/api/include" \
    -I"$site/nvidia/cuda_runtime/include" -I"$site/nvidia/cuda_nvcc/include" \
    -I"$py_include" -Icuvmm-torch cuvmm-torch/csrc/cuvmm_allocator.cpp 2>"$log" || status=$?
grep -A4 -E "cuvmm_allocator.cpp:[0-9]+:[0-9]+: (error|warning)|: error:" "$log" || true
[ "$status" -eq 0 ] || { echo "cuvmm_allocator.cpp: does not compile"; exit 1; }
echo "cuvmm_allocator.cpp: syntax OK"
