#!/usr/bin/env bash
# Do two builds of cuvmm make the same decisions? Replays every built-in workload and every shared trace
# (../shared/traces) at 80, 40 and 24 GiB with `cuvmm snapshot` through each binary and byte-compares the
# pickles (every segment, block and event: any change of a placement, a map or an unmap shows).
#
#   tools/snapshot_identity.sh OLD_CUVMM NEW_CUVMM [WORKLOAD|TRACE ...]
#
# Build the old one in a worktree: git worktree add /tmp/old REV && (cd /tmp/old && cargo build --bin cuvmm).
# Prints each difference and a summary; exits 1 if any pickle or exit status differs.
set -u
[ $# -ge 2 ] || { sed -n '2,9p' "$0"; exit 2; }
old=$1 new=$2
shift 2
cd "$(dirname "$0")/.."
sources=("$@")
if [ ${#sources[@]} -eq 0 ]; then
    mapfile -t sources < <("$new" workloads | awk '/^[a-z]/ {print $1}')
    for trace in ../shared/traces/*.pickle ../shared/traces/*.gz; do
        [ -e "$trace" ] && sources+=("$trace")
    done
fi
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
same=0 differ=0
for src in "${sources[@]}"; do
    case $src in *.pickle | *.gz | *.csv | *.txt) arg=(--trace "$src") ;; *) arg=(--workload "$src") ;; esac
    for capacity in 80GiB 40GiB 24GiB; do
        "$old" snapshot "${arg[@]}" --capacity "$capacity" -o "$scratch/old.pickle" >/dev/null 2>&1
        a=$?
        "$new" snapshot "${arg[@]}" --capacity "$capacity" -o "$scratch/new.pickle" >/dev/null 2>&1
        b=$?
        if [ "$a" != "$b" ]; then
            echo "exit status differs: $src at $capacity ($a before, $b after)"
            differ=$((differ + 1))
        elif [ "$a" != 0 ]; then
            echo "both failed ($a): $src at $capacity"
        elif cmp -s "$scratch/old.pickle" "$scratch/new.pickle"; then
            same=$((same + 1))
        else
            echo "pickles differ: $src at $capacity"
            differ=$((differ + 1))
        fi
        rm -f "$scratch/old.pickle" "$scratch/new.pickle"
    done
done
echo "$same identical, $differ different"
[ "$differ" -eq 0 ]
