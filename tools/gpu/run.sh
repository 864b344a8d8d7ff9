#!/usr/bin/env bash
# Runs GPU steps of docs/gpu.md from the folder tools/gpu/build.sh filled (GPU_BIN, default gpu-bin/), each
# under a time limit, each step's output into $OUT/STEP.txt (OUT, default gpu-out/), and a one-line result
# per step on stdout. Steps (docs/gpu.md says what each checks):
#   info          nvidia-smi, the driver and the commit built
#   conformance   the CUDA conformance suite (tests/conformance_cuda.rs)
#   capture       only its capture rules and facts (a quick first check of issue 29's rules)
#   lib           what CudaDriver reads from CUDA (the library's driver::cuda tests)
#   streams       the caller's streams and threads (tests/cuda_streams.rs)
#   graphs        record_stream, a memory limit, CUDA graphs replayed, peers, with real kernels (tests/cuda_graphs.rs)
#   service       the service example: four workers, a kernel on cuvmm memory
#   driver-bench  driver call costs by page size (JSON and table)
#   workloads     every built-in workload replayed on the GPU with --touch
#   traces        every shared trace replayed with --touch on the GPU, and on the simulator for comparison
#   torch         every shared trace through PyTorch: default allocator, expandable segments, cuvmm plugged in
#   train         a small GPT trained under each allocator: figures, and the smallest memory fraction that completes
#   hot           cached alloc+free pairs per second through PyTorch's allocator interface, each allocator,
#                 and cuvmm again with stream_cache_eager:True (the C ABI's pairs served by the caches)
#   torch-suite   PyTorch's uses of its allocator (record_stream, a memory limit, CUDA graphs, torch.compile,
#                 memory_stats, OOM, IPC, NCCL, transformers) under each allocator, checked against references:
#                 a JSON line per case and allocator, and a table (also $OUT/torch-suite.jsonl)
#   mempools      the suite's cases of issue 41 alone: MemPool (use_count, deletion, no_split, use_on_oom, an
#                 allocator of its own), torch.compile training with two shapes, IPC between cuvmm and
#                 PyTorch's allocators both ways, a vLLM-style sleep mode on a pluggable MemPool
#                 ($OUT/mempools.jsonl)
#   bench-cuda    cached alloc+free pairs per entry point at 1-8 threads on real streams, against cudarc's
#                 default, cuMemAllocAsync and cuMemAlloc (issue 31's goals), as JSON (BENCH_ARGS adds options);
#                 then again with capture_detection:False, and with stream_cache_eager:False (one thread on the
#                 strategy's lock, as the PyTorch backend runs)
#   sleep-wake    sleep and wake of 4 and 16 GiB tagged regions through PyTorch, four cycles each, with and
#                 without their contents: GB/s of the first cycle and of the later ones, host memory kept,
#                 bytes given back and intact (tools/sleep_wake_bench.py; SLEEP_WAKE_ARGS replaces the sizes)
#   sleep-wake-hostalloc  the same, 16 GiB, two cycles, pinned by cuMemHostAlloc as before registration was the
#                 default (CUVMM_ALLOC_CONF=pinned_use_cuda_host_register:False): the first sleep's two ways
#                 of pinning, compared in one run
#   sleep-wake-prepared  the same, 16 GiB, two cycles, the host memory pinned before the first sleep
#                 (cuvmm_torch.prepare_sleep, timed apart): the first sleep at the rate of the later ones
#   sleep-frameworks  torch_memory_saver's and vLLM's CuMemAllocator's APIs over cuvmm (cuvmm_torch.memory_saver,
#                 cuvmm_torch.cumem), a CUDA graph captured in a tag replayed after five sleeps and wakes, and
#                 a tensor dropped while its tag sleeps, freed at the wake (tools/gpu/sleep_frameworks.py;
#                 SLEEP_FRAMEWORKS_ARGS, e.g. --case memory_saver, picks cases)
#   pin-rate      how fast the machine pins host memory: cuMemHostAlloc, and cuMemHostRegister of memory faulted
#                 in by threads, with and without huge pages, at 1, 4 and 8 threads (tools/gpu/pin_rate.py;
#                 PIN_RATE_ARGS adds options): what the first sleep with contents costs, and what could pin faster
#   two-process   an inference and a training process taking turns on the GPU, each sleeping what the other
#                 needs: time per cycle (tools/two_process_bench.py; TWO_PROCESS_ARGS adds options)
#   cuda-async    every built-in workload through cuvmm and cuda-async (cuMemAllocAsync's pool) on the GPU
#   wheel         the cuvmm-torch wheel as a user installs it: pip install from $GPU_BIN/wheels (no network, no
#                 cargo) into a fresh venv that sees the machine's PyTorch and transformers, then an unchanged
#                 transformers training script (tools/gpu/train_transformers.py) under `python -m cuvmm_torch`,
#                 under torchrun, and under PyTorch's own allocator for reference; checks that PyTorch's
#                 memory_stats and snapshot are cuvmm's (backend "cuvmm", every segment expandable, cuvmm's
#                 peaks) ($OUT/wheel-*.json); then the wheel's `cuvmm` against the README's figures
#   capacity-cuda every shared trace's min capacity on the GPU (a ballast makes each capacity) and peak
#                 reserved there, for cuvmm, pytorch-expandable and cuda-async; then the table for
#                 docs/gpu-results.md from tools/gpu/tables.py ($OUT/capacity-cuda.md). CAPACITY_LIMIT: seconds
#                 per trace (default 300); CAPACITY_TRACES: the traces' names, without extension (default all)
#   capacity-split  the same for cuvmm under compaction:split (issue 43), on three traces ($OUT/capacity-split.md),
#                 after the two PyTorch cases that move live tensors' pages: release_stranded and
#                 split_under_limit, each behind a running kernel ($OUT/stranded.jsonl)
#
# The PyTorch steps (torch, train, hot, torch-suite, mempools, sleep-wake, sleep-frameworks, two-process,
# capacity-split) first build the C++ layer, once ($OUT/cpp-layer.txt).
#
# RUN_BUDGET=SECONDS bounds the whole run: each step's limit is cut to what is left, and a step with less than
# 15 s left is skipped (a device lease is short: the run ends, and its files are there, before the lease does).
# ARCHIVE=FILE also packs every output file into one .tar.gz, again after each step (a device tool returns at
# most 8 files, and a run stopped from outside keeps what it had). On a lent machine, outputs outside the
# tool's $OUT and only the archive in it (bash expands OUT=... before ARCHIVE=$OUT/..., hence A):
#
#   A=$OUT; OUT=/tmp/gpu-out ARCHIVE=$A/gpu-out.tar.gz RUN_BUDGET=540 tools/gpu/run.sh info torch-suite
set -u
cd "$(dirname "$0")/../.."
[ $# -gt 0 ] || { sed -n '2,/^set -u/p' "$0" | grep '^#'; exit 2; }
bin=$(realpath "${GPU_BIN:-gpu-bin}")
out=${OUT:-gpu-out}
mkdir -p "$out"
# (A folder of WHEEL_ONLY=1 tools/gpu/build.sh holds only what the `wheel` step needs.)
[ -x "$bin/cuvmm" ] || [ -d "$bin/wheels" ] ||
    { echo "run.sh: $bin/cuvmm is missing: run tools/gpu/build.sh first and carry $bin"; exit 2; }

# ninja, which the C++ layer's build needs (build.sh brings one), where the machine has none.
command -v ninja >/dev/null || PATH="$bin/bin:$PATH"

budget_end=$((SECONDS + ${RUN_BUDGET:-1000000}))
# clip SECONDS: SECONDS, or what is left of the run's budget if that is less.
clip() {
    local left=$((budget_end - SECONDS))
    echo $(($1 < left ? $1 : left))
}

# step NAME SECONDS COMMAND...: runs COMMAND with its output in $out/NAME.txt, then prints the status, the
# time taken and the output's last line.
step() {
    local name=$1 limit
    limit=$(clip "$2")
    shift 2
    if [ "$limit" -lt 15 ]; then
        echo "$name: skipped: the run's budget (RUN_BUDGET) is spent" | tee -a "$out/$name.txt"
        return
    fi
    local began=$SECONDS
    # -k: a command that ignores SIGTERM is killed 10 s later (RUN_BUDGET leaves room for it).
    timeout -k 10 "$limit" "$@" >>"$out/$name.txt" 2>&1
    local status=$?
    echo "$name: status $status, $((SECONDS - began)) s: $(tail -n 1 "$out/$name.txt")"
    pack
}

# pack: every output so far into $ARCHIVE, when set (written aside, then renamed: never a half archive). An
# archive inside $out leaves itself out; tar's status 1 (a file changed as it was read: the archive's own
# folder) still made a whole archive.
pack() {
    [ -n "${ARCHIVE:-}" ] || return 0
    tar czf "$ARCHIVE.part" --exclude="./$(basename "$ARCHIVE")*" -C "$out" . 2>/dev/null
    [ $? -le 1 ] && mv -f "$ARCHIVE.part" "$ARCHIVE"
}

# Builds the C++ layer once, before the first step that installs cuvmm into PyTorch: a failed build shows in
# its own step, and CUVMM_TORCH_CPP=1 makes the steps after it fail rather than fall back to the ctypes path.
cpp_built=
cpp_layer() {
    export CUVMM_TORCH_LIB="$bin/libcuvmm_torch.so" CUVMM_TORCH_CPP=1
    [ -n "$cpp_built" ] && return
    cpp_built=1
    step cpp-layer 300 env PYTHONPATH="$PWD/python${PYTHONPATH:+:$PYTHONPATH}" python3 -m cuvmm_torch build
}

# The `wheel` step: a fresh venv that also sees the machine's packages (its PyTorch, transformers), and the wheel
# pip-installed from $bin/wheels with no index. Outside $out, which comes back from a device session.
wheel_venv=${TMPDIR:-/tmp}/cuvmm-wheel-venv
wheel_step() {
    rm -rf "$wheel_venv" "$out"/wheel-*.json
    local pip=("$wheel_venv/bin/python" -m pip)
    if ! python3 -m venv "$wheel_venv" >>"$out/wheel.txt" 2>&1; then
        # No ensurepip here: the machine's pip installs into the venv.
        rm -rf "$wheel_venv"
        python3 -m venv --without-pip "$wheel_venv"
        pip=(python3 -m pip --python "$wheel_venv/bin/python")
    fi
    # The site-packages folders of the python3 that has PyTorch (a system's or a venv's), after the venv's own.
    python3 -c 'import sys; print("\n".join(p for p in sys.path if p.rstrip("/").endswith(("site-packages", "dist-packages"))))' \
        >"$("$wheel_venv/bin/python" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')/zz-machine.pth"
    step wheel 300 "${pip[@]}" install --no-index --find-links "$bin/wheels" cuvmm-torch
    local python=$wheel_venv/bin/python
    # As a user runs it: no CUVMM_TORCH_LIB or PYTHONPATH, the package's own library and C++ sources, the layer
    # built into a fresh folder at first use (CUVMM_TORCH_CPP=1: a failed build is an error, not the ctypes path).
    local env=(env -u CUVMM_TORCH_LIB -u PYTHONPATH CUVMM_TORCH_CPP=1 CUVMM_TORCH_BUILD="$wheel_venv/cpp-layer"
               PYTHONUNBUFFERED=1)
    step wheel 60 "${env[@]}" "$python" -c "import cuvmm_torch, torch; print(cuvmm_torch.__file__, cuvmm_torch.library_path(), cuvmm_torch.csrc_dir(), torch.__version__)"
    local script=tools/gpu/train_transformers.py
    step wheel 300 "${env[@]}" "$python" -m cuvmm_torch "$script" --report "$out/wheel-cuvmm.json"
    step wheel 300 "${env[@]}" "$python" -m torch.distributed.run --standalone --nproc-per-node 1 \
        -m cuvmm_torch "$script" --steps 6 --report "$out/wheel-torchrun.json"
    step wheel 300 "${env[@]}" "$python" "$script" --report "$out/wheel-native.json"
    step wheel 60 "$python" tools/gpu/wheel_reports.py "$out"
    step wheel 120 "$python" tools/cli_check.py "$wheel_venv/bin/cuvmm" --traces "$bin/traces"
}

# wanted_trace FILE: whether CAPACITY_TRACES (names without their extension, space-separated; default all)
# names the trace in FILE.
wanted_trace() {
    [ -z "${CAPACITY_TRACES:-}" ] && return 0
    local name
    name=$(basename "$1")
    name=${name%%.*}
    [[ " $CAPACITY_TRACES " == *" $name "* ]]
}

run_step() {
    case $1 in
    info)
        step info 60 date -u
        step info 60 nvidia-smi
        step info 60 nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
        step info 60 python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
        step info 60 cat "$bin/COMMIT" ;;
    bench-cuda)
        # JSON only: the tables are printed from it elsewhere. As a program gets it, then without capture
        # detection (one driver query per allocation that reaches the strategy or the caches), then with
        # caches that wait for contention (the PyTorch backend's default).
        for conf in "" capture_detection:False stream_cache_eager:False; do
            step bench-cuda 300 "$bin/cuvmm" bench-threads --backend cuda --size 512,64KiB,20MiB --format json \
                ${conf:+--alloc-conf $conf} ${BENCH_ARGS:-}
        done ;;
    sleep-wake)
        cpp_layer
        step sleep-wake 240 python3 tools/sleep_wake_bench.py ${SLEEP_WAKE_ARGS:---sizes-gib 4,16 --cycles 4} ;;
    sleep-wake-hostalloc)
        cpp_layer
        CUVMM_ALLOC_CONF=pinned_use_cuda_host_register:False step sleep-wake-hostalloc 120 \
            python3 tools/sleep_wake_bench.py --sizes-gib 16 --cycles 2 ;;
    sleep-wake-prepared)
        cpp_layer
        step sleep-wake-prepared 120 python3 tools/sleep_wake_bench.py --sizes-gib 16 --cycles 2 --prepare ;;
    sleep-frameworks)
        cpp_layer
        step sleep-frameworks 300 python3 tools/gpu/sleep_frameworks.py ${SLEEP_FRAMEWORKS_ARGS:-} ;;
    pin-rate) step pin-rate 180 python3 tools/gpu/pin_rate.py ${PIN_RATE_ARGS:-} ;;
    two-process)
        cpp_layer
        step two-process 300 python3 tools/two_process_bench.py ${TWO_PROCESS_ARGS:-} ;;
    cuda-async)
        step cuda-async 540 "$bin/cuvmm" compare --backend cuda --allocator cuda-async --allocator cuvmm --quiet \
            --format json ;;
    capacity-cuda)
        # Nothing else may use the GPU meanwhile: a ballast leaves C free at its start, not throughout.
        for trace in "$bin"/traces/*.pickle "$bin"/traces/*.gz; do
            [ -e "$trace" ] || continue
            wanted_trace "$trace" || continue
            step capacity-cuda "${CAPACITY_LIMIT:-300}" "$bin/cuvmm" capacity --backend cuda --allocator cuvmm \
                --allocator pytorch-expandable --allocator cuda-async --quiet --format json --trace "$trace"
        done
        python3 tools/gpu/tables.py "$out" capacity-cuda.txt >"$out/capacity-cuda.md" 2>&1
        echo "capacity-cuda: table in $out/capacity-cuda.md" ;;
    capacity-split)
        # Issue 43 on the device: first the splits of live tensors' pages with their contents checked, then
        # cuvmm with compaction:split on the three traces where the default strands the most (capacity-cuda
        # gives the default's and pytorch-expandable's on the same traces).
        cpp_layer
        export PYTHONUNBUFFERED=1
        step stranded 150 python3 tools/gpu/torch_suite.py --budget 120 --json "$out/stranded.jsonl" \
            --allocator cuvmm --case release_stranded,split_under_limit
        for name in cs336_medium_ctx128_trainstep cs336_compiled_train_bcrafton bert_large_inference; do
            [ -e "$bin/traces/$name.pickle" ] || continue
            step capacity-split "${CAPACITY_LIMIT:-300}" "$bin/cuvmm" capacity --backend cuda --allocator cuvmm \
                --alloc-conf compaction:split --quiet --format json --trace "$bin/traces/$name.pickle"
        done
        python3 tools/gpu/tables.py "$out" capacity-split.txt >"$out/capacity-split.md" 2>&1
        echo "capacity-split: table in $out/capacity-split.md" ;;
    conformance) step conformance 540 "$bin/conformance_cuda" --test-threads=1 --nocapture ;;
    capture) step capture 120 "$bin/conformance_cuda" capture --test-threads=1 --nocapture ;;
    lib) step lib 300 "$bin/cuvmm-lib" driver::cuda --nocapture ;;
    streams) step streams 300 "$bin/cuda_streams" --test-threads=1 --nocapture ;;
    graphs) step graphs 300 "$bin/cuda_graphs" --test-threads=1 --nocapture ;;
    service) step service 300 "$bin/service" --backend cuda ;;
    driver-bench)
        step driver-bench 300 "$bin/cuvmm" driver-bench --backend cuda
        step driver-bench 300 "$bin/cuvmm" driver-bench --backend cuda --format json ;;
    workloads) step workloads 540 "$bin/cuvmm" compare --backend cuda --touch --quiet --format json ;;
    traces)
        for trace in "$bin"/traces/*.pickle "$bin"/traces/*.gz; do
            [ -e "$trace" ] || continue
            step traces 240 "$bin/cuvmm" compare --backend cuda --touch --quiet --format json --trace "$trace"
            # The same replay on the simulator (its peak reserved should be the GPU's: docs/gpu.md, step 3).
            step traces 240 "$bin/cuvmm" compare --quiet --format json --trace "$trace"
        done ;;
    torch)
        cpp_layer
        for trace in "$bin"/traces/*.trace; do
            [ -e "$trace" ] || continue
            for allocator in native expandable cuvmm; do
                # Each in its own process: PyTorch picks its allocator once per process.
                step torch 240 python3 tools/torch_replay.py --allocator "$allocator" "$trace"
            done
        done ;;
    train)
        cpp_layer
        export PYTHONUNBUFFERED=1
        for allocator in ${TRAIN_ALLOCATORS:-native expandable cuvmm}; do
            step train "${TRAIN_LIMIT:-540}" python3 tools/train_gpt.py --allocator "$allocator" --search ${TRAIN_ARGS:-}
        done ;;
    hot)
        cpp_layer
        for allocator in native expandable cuvmm; do
            step hot 120 python3 tools/hot_path.py --allocator "$allocator"
        done
        CUVMM_ALLOC_CONF=stream_cache_eager:True step hot 120 python3 tools/hot_path.py --allocator cuvmm ;;
    torch-suite)
        # The suite's budget leaves it time to print its table before the step's limit; TORCH_SUITE_ARGS picks
        # cases or allocators (--case, --allocator: tools/gpu/torch_suite.py --list).
        cpp_layer
        export PYTHONUNBUFFERED=1
        local limit
        limit=$(clip "${TORCH_SUITE_LIMIT:-540}")
        step torch-suite "$limit" python3 tools/gpu/torch_suite.py --budget $((limit > 60 ? limit - 30 : limit / 2)) \
            --json "$out/torch-suite.jsonl" ${TORCH_SUITE_ARGS:-} ;;
    wheel) wheel_step ;;
    mempools)
        cpp_layer
        export PYTHONUNBUFFERED=1
        local limit
        limit=$(clip "${MEMPOOLS_LIMIT:-540}")
        step mempools "$limit" python3 tools/gpu/torch_suite.py --budget $((limit > 60 ? limit - 30 : limit / 2)) \
            --json "$out/mempools.jsonl" --case mempool,mempool_own_allocator,compile_train_two_shapes \
            --case ipc_cuvmm_to_pytorch,ipc_pytorch_to_cuvmm,ipc_many_tensors,sleep_mode_pool ;;
    *) echo "run.sh: unknown step $1"; return 2 ;;
    esac
}

for name in "$@"; do
    run_step "$name"
done
if [ -n "${ARCHIVE:-}" ]; then
    pack && echo "run.sh: every output in $ARCHIVE"
fi
