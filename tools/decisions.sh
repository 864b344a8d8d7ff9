#!/usr/bin/env bash
# Writes every allocator's decisions on every built-in workload and shared trace, as `compare`, `capacity`
# and `frontier` report them in JSON, with the wall times (fields ending in `_seconds`) left out, so that two
# builds can be compared byte for byte: a change that only restructures code must leave them identical.
#
#   tools/decisions.sh OUT_DIR [CUVMM_BINARY]          write OUT_DIR/{compare,capacity,frontier}_{workloads,traces}.json
#   tools/decisions.sh --against REV                   build REV (a git revision) and the working tree, run both,
#                                                      and fail naming every file that differs
#
# Traces come from ../shared/traces (skipped, with a message, where it is absent). Each run takes about 30 s
# with a release build.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)

normalize() {
    python3 -c '
import json, sys
def strip(v):
    if isinstance(v, dict):
        return {k: strip(x) for k, x in v.items() if not k.endswith("_seconds")}
    if isinstance(v, list):
        return [strip(x) for x in v]
    return v
json.dump(strip(json.load(sys.stdin)), sys.stdout, indent=1, sort_keys=True)
print()'
}

write() {
    local out=$1 bin=$2 traces=()
    mkdir -p "$out"
    if [ -d "$root/../shared/traces" ]; then
        for f in "$root"/../shared/traces/*; do
            case $f in *README*) ;; *) traces+=(--trace "$f") ;; esac
        done
    else
        echo "decisions: ../shared/traces is absent; built-in workloads only" >&2
    fi
    "$bin" compare -q --format json | normalize >"$out/compare_workloads.json"
    "$bin" capacity -q --format json | normalize >"$out/capacity_workloads.json"
    "$bin" frontier --format json | normalize >"$out/frontier_workloads.json"
    if [ ${#traces[@]} -gt 0 ]; then
        "$bin" compare -q --format json "${traces[@]}" | normalize >"$out/compare_traces.json"
        "$bin" capacity -q --format json "${traces[@]}" | normalize >"$out/capacity_traces.json"
        "$bin" frontier --format json "${traces[@]}" | normalize >"$out/frontier_traces.json"
    fi
}

build() { # build the CLI of the checkout at $1 and print its path
    (cd "$1" && cargo build --release --locked --bin cuvmm -q >&2)
    local bin
    bin=$(cd "$1" && cargo metadata --format-version 1 --no-deps | python3 -c 'import json,sys; print(json.load(sys.stdin)["target_directory"])')/release/cuvmm
    echo "$bin"
}

if [ "${1:-}" = "--against" ]; then
    rev=${2:?usage: tools/decisions.sh --against REV}
    scratch=$(mktemp -d)
    trap 'git -C "$root" worktree remove --force "$scratch/base" >/dev/null 2>&1 || true; rm -rf "$scratch"' EXIT
    git -C "$root" worktree add --detach "$scratch/base" "$rev" >/dev/null
    # The base build gets a target directory of its own, kept between runs.
    CARGO_TARGET_DIR="$root/target/decisions-base" write "$scratch/before" "$(CARGO_TARGET_DIR="$root/target/decisions-base" build "$scratch/base")"
    write "$scratch/after" "$(build "$root")"
    if diff -r "$scratch/before" "$scratch/after" >"$scratch/diff"; then
        echo "decisions: identical to $rev ($(ls "$scratch/after" | wc -l) files)"
    else
        head -50 "$scratch/diff"
        echo "decisions: differ from $rev"; exit 1
    fi
else
    out=${1:?usage: tools/decisions.sh OUT_DIR [CUVMM_BINARY] | --against REV}
    write "$out" "${2:-$(build "$root")}"
fi
