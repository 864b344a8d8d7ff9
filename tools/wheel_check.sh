#!/usr/bin/env bash
# The "fresh machine" check of a cuvmm-torch wheel (tools/wheel.sh builds it): pip installs the wheel into a new
# virtual environment, then, from a folder outside the checkout and with no cargo or rustc on PATH, runs
#   - the C ABI's Python tests against the installed copy (python/test_cuvmm_torch.py: ctypes on the simulated
#     device; the package's library, header and `cuvmm`, never the checkout's: CUVMM_TORCH_TEST_INSTALLED=1),
#   - `python -m cuvmm_torch SCRIPT.py` and CUVMM_TORCH_AUTOINSTALL through the installed .pth file, with a
#     stand-in for PyTorch (python/test_run.py),
#   - the installed `cuvmm` against the README's figures: capacity and frontier examples, and a PyTorch
#     snapshot of ../shared/traces (if there) through capacity, compare, frontier, fidelity and snapshot
#     (tools/cli_check.py).
# With --torch SITE_PACKAGES (a folder holding a CUDA build of PyTorch, e.g. a venv's site-packages), the
# environment also sees that PyTorch (after its own packages), and the C++ layer's tests run against the installed
# package: the layer built from the sources the wheel carries, `python -m cuvmm_torch` and torchrun on the
# simulated device (python/test_cpp_layer.py; a C++ compiler is needed, as for any user).
# Needs python3 with venv, and PyPI for the wheel's one dependency (ninja), or PIP_FIND_LINKS and PIP_NO_INDEX.
#
#   tools/wheel_check.sh WHEEL [--torch SITE_PACKAGES]
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
wheel=$(realpath "${1:?usage: tools/wheel_check.sh WHEEL [--torch SITE_PACKAGES]}")
torch_site=
if [ "${2:-}" = --torch ]; then torch_site=$(realpath "${3:?--torch needs a site-packages folder}"); fi
python=${PYTHON:-python3}
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
venv=$scratch/venv

echo "== a fresh virtual environment, and pip install $(basename "$wheel")"
"$python" -m venv "$venv"
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check "$wheel"
if [ -n "$torch_site" ]; then
    # After the environment's own site-packages: the installed cuvmm_torch comes first.
    echo "$torch_site" >"$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')/zz-torch.pth"
fi

echo "== no Rust on PATH, outside the checkout"
clean=
IFS=: read -ra dirs <<<"$PATH"
for dir in "${dirs[@]}"; do
    [ -e "$dir/cargo" ] || [ -e "$dir/rustc" ] || clean=${clean:+$clean:}$dir
done
export PATH=$clean
unset CUVMM_TORCH_LIB CUVMM_BIN CUVMM_ALLOC_CONF CUVMM_TORCH_BUILD PYTHONPATH
export CUVMM_TORCH_TEST_INSTALLED=1 CUVMM_BACKEND=sim
if command -v cargo || command -v rustc; then echo "cargo or rustc is still on PATH"; exit 1; fi
mkdir "$scratch/work" && cd "$scratch/work"
"$venv/bin/python" - "$root" <<'EOF'
import os, sys, sysconfig, cuvmm_torch
here = os.path.dirname(os.path.realpath(cuvmm_torch.__file__))
assert here.startswith(sysconfig.get_path("purelib")), here
assert not here.startswith(os.path.realpath(sys.argv[1])), here
print(f"cuvmm_torch {here}\nlibrary     {cuvmm_torch.library_path()}\nC++ layer   {cuvmm_torch.csrc_dir()}")
EOF
echo "cuvmm       $venv/bin/cuvmm"

echo "== the C ABI's Python tests and python -m cuvmm_torch, against the installed package"
# Each test file run as a script (unittest's discovery would import the checkout's python/cuvmm_torch, a package
# beside them); each takes its folder off sys.path before importing cuvmm_torch.
"$venv/bin/python" "$root/python/test_cuvmm_torch.py"
"$venv/bin/python" "$root/python/test_run.py"

echo "== the installed cuvmm against the README's figures"
"$venv/bin/python" "$root/tools/cli_check.py" "$venv/bin/cuvmm"

if [ -n "$torch_site" ]; then
    echo "== the C++ layer from the installed package, with PyTorch from $torch_site"
    # The layer's build goes to the user's cache by default; here, to the scratch folder.
    export CUVMM_TORCH_TEST_BUILD_ROOT=$scratch/cpp-layer
    "$venv/bin/python" "$root/python/test_cpp_layer.py" -v 2>&1 | tee "$scratch/cpp-layer.txt"
    if grep "skipped '" "$scratch/cpp-layer.txt"; then echo "wheel_check: C++ layer tests skipped (above)"; exit 1; fi
fi
echo "wheel_check: $(basename "$wheel") installs and works with no Rust toolchain"
