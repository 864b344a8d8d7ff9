#!/usr/bin/env bash
# Builds, on a machine without a GPU, everything the GPU steps of docs/gpu.md run, into one folder to carry
# to the GPU machine (default gpu-bin/, which .gitignore leaves out): the `cuvmm` binary and the service
# example built with `--features cuda`, the CUDA test binaries under fixed names, libcuvmm_torch.so and ninja
# (all that the PyTorch steps, tools/gpu/torch_suite.py included, need from here), the cuvmm-torch wheel with
# ninja's wheel beside it in wheels/ (tools/wheel.sh; the `wheel` step installs them with no network), and the
# shared traces (../shared/traces) with each one converted to cuvmm's format for tools/torch_replay.py.
# Binaries are stripped to keep the folder small. Then, on the GPU machine: tools/gpu/run.sh STEP...
#
#   tools/gpu/build.sh [DIR]
#   WHEEL_ONLY=1 tools/gpu/build.sh DIR   only what the `wheel` step needs (wheels/, ninja, one trace): a few MiB
set -euo pipefail
cd "$(dirname "$0")/../.."
dir=${1:-gpu-bin}
rm -rf "$dir" && mkdir -p "$dir/traces"

# install() builds the C++ layer on the GPU machine with torch.utils.cpp_extension, which needs ninja; that
# machine has no network, so ninja's binary (from its wheel on PyPI) travels in $dir/bin, and run.sh puts it on
# PATH where the machine has none; its wheel goes to $dir/wheels, beside the cuvmm-torch wheel a user installs
# (manylinux_2_28; the cargo build under target/x86_64-unknown-linux-gnu/ is reused).
wheels() {
    local downloaded
    downloaded=$(mktemp -d)
    if python3 -m pip download --quiet --no-deps --only-binary=:all: --platform manylinux2014_x86_64 ninja \
        -d "$downloaded" >/dev/null 2>&1; then
        mkdir -p "$dir/bin" "$dir/wheels"
        python3 - "$downloaded"/ninja-*.whl "$dir/bin/ninja" <<'PY'
import shutil, sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as wheel:
    (name,) = [n for n in wheel.namelist() if n.endswith(".data/scripts/ninja")]
    with wheel.open(name) as source, open(sys.argv[2], "wb") as target:
        shutil.copyfileobj(source, target)
PY
        chmod +x "$dir/bin/ninja"
        cp "$downloaded"/ninja-*.whl "$dir/wheels/"
    else
        echo "build.sh: ninja could not be downloaded: the GPU machine must have its own" >&2
    fi
    rm -rf "$downloaded"
    tools/wheel.sh "$dir/wheels"
}

commit() {
    git rev-parse HEAD >"$dir/COMMIT"
    if git status --porcelain | grep -q .; then echo "(with uncommitted changes)" >>"$dir/COMMIT"; fi
    du -sh "$dir"
}

if [ -n "${WHEEL_ONLY:-}" ]; then
    wheels
    # tools/cli_check.py's trace (the README's table has its row).
    if [ -f ../shared/traces/bert_large_inference.pickle ]; then
        cp ../shared/traces/bert_large_inference.pickle "$dir/traces/"
    fi
    commit
    exit 0
fi

cargo build --locked --release --features cuda --bin cuvmm --example service
cargo build --locked --release -p cuvmm-torch
# The test binaries' paths, from cargo's JSON messages: the library's unit tests and four integration tests
# (only those: every test binary of the crate with fat LTO takes many minutes).
cargo test --locked --release -p cuvmm --features cuda --no-run --message-format=json \
    --lib --test conformance_cuda --test cuda_streams --test cuda_graphs --test conformance_sim 2>/dev/null |
    python3 -c '
import json, shutil, sys
wanted = {("lib", "cuvmm"): "cuvmm-lib", ("test", "conformance_cuda"): "conformance_cuda",
          ("test", "cuda_streams"): "cuda_streams", ("test", "cuda_graphs"): "cuda_graphs",
          ("test", "conformance_sim"): "conformance_sim"}
found = set()
for line in sys.stdin:
    message = json.loads(line)
    target, executable = message.get("target", {}), message.get("executable")
    for kind in target.get("kind", []):
        name = wanted.get((kind, target.get("name")))
        if name and executable:
            shutil.copy(executable, sys.argv[1] + "/" + name)
            found.add(name)
missing = set(wanted.values()) - found
sys.exit(f"test binaries not built: {sorted(missing)}" if missing else 0)
' "$dir"
cp target/release/cuvmm target/release/examples/service target/release/libcuvmm_torch.so "$dir/"
strip "$dir"/cuvmm "$dir"/service "$dir"/libcuvmm_torch.so "$dir"/cuvmm-lib "$dir"/conformance_cuda \
    "$dir"/cuda_streams "$dir"/cuda_graphs "$dir"/conformance_sim

if [ -d ../shared/traces ]; then
    for trace in ../shared/traces/*.pickle ../shared/traces/*.gz; do
        [ -e "$trace" ] || continue
        cp "$trace" "$dir/traces/"
        "$dir/cuvmm" workload --trace "$trace" -o "$dir/traces/$(basename "$trace").trace"
    done
else
    echo "build.sh: ../shared/traces is absent: no traces in $dir/traces" >&2
fi
wheels
# The torch-suite step's cases load without PyTorch: a broken registry shows here, not in a GPU session.
python3 tools/gpu/torch_suite.py --list >/dev/null
commit
