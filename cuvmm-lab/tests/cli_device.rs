//! `--backend`, `--touch` and `driver-bench` on the command line: exit statuses, one-line messages, JSON.
//!
//! What `--backend cuda` does depends on the build and the machine: without CUDA support in the library it
//! is refused (status 2, one line saying to rebuild with `--features cuda`); with it, on a machine without a
//! CUDA driver, it is refused too (status 2, one line saying no CUDA driver was found). On a GPU machine that
//! test has nothing to check and says so. The library's support decides, not this crate's `cuda` feature:
//! `cargo test --workspace` gives the library its CUDA backend through cuvmm-torch.

mod common;

use common::{cuvmm, stderr};
use cuvmm::driver::device::DeviceSpec;
use cuvmm::driver::sim::SimConfig;

/// Runs `args` and checks: status 2, nothing on stdout, exactly one line on stderr containing `needle`.
fn refused(args: &[&str], needle: &str) {
    let out = cuvmm(args);
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
    assert!(out.stdout.is_empty(), "{args:?}: output on stdout");
    assert_eq!(err.lines().count(), 1, "{args:?}: {err}");
    assert!(err.contains(needle), "{args:?}: {err}");
    assert!(!err.contains("panicked"), "{args:?}: {err}");
}

const CUDA_COMMANDS: [&[&str]; 7] = [
    &["compare", "--backend", "cuda"],
    &[
        "compare",
        "--backend",
        "cuda:1",
        "--workload",
        "moe",
        "--touch",
    ],
    &["--backend", "cuda"],
    &["driver-bench", "--backend", "cuda"],
    &["capacity", "--backend", "cuda", "--workload", "moe"],
    &[
        "capacity",
        "--backend",
        "cuda:1",
        "--workload",
        "moe",
        "--allocator",
        "cuvmm",
        "--allocator",
        "cuda-async",
        "--format",
        "json",
    ],
    &["frontier", "--backend", "cuda", "--workload", "moe"],
];

#[test]
fn cuda_without_the_support_or_a_driver_exits_2_saying_which() {
    let cuda = DeviceSpec::Cuda { ordinal: 0 };
    let needle = if cuda.check_supported().is_err() {
        "no CUDA driver found: cuvmm was built without CUDA support; rebuild with --features cuda"
    } else if cuda.open(SimConfig::default()).is_ok() {
        eprintln!("skipped: this machine has a CUDA device, so `--backend cuda` is not refused");
        return;
    } else {
        "no CUDA driver found"
    };
    for args in CUDA_COMMANDS {
        refused(args, needle);
    }
}

#[test]
fn a_bad_backend_exits_2_naming_it() {
    for bad in ["gpu", "cuda:", "cuda:x", "sim:0"] {
        refused(&["compare", "--backend", bad], bad);
        for command in ["driver-bench", "capacity", "frontier"] {
            refused(&[command, "--backend", bad], "expected sim, cuda or cuda:N");
        }
    }
}

#[test]
fn the_old_device_flag_points_to_backend() {
    // `--device` is now a trace's device index; a backend given to it says where it went.
    for backend in ["cuda", "sim", "cuda:1"] {
        refused(
            &["compare", "--trace", "x.trace", "--device", backend],
            &format!("use --backend {backend}"),
        );
    }
    refused(&["driver-bench", "--device", "cuda"], "--device");
}

#[test]
fn touch_on_the_simulator_changes_no_allocation_figure() {
    let run = |touch: bool| {
        let mut args = vec![
            "compare",
            "--backend",
            "sim",
            "--workload",
            "moe",
            "--format",
            "json",
        ];
        if touch {
            args.push("--touch");
        }
        let out = cuvmm(&args);
        assert!(out.status.success(), "{}", stderr(&out));
        let value: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON");
        value["results"][0].clone()
    };
    let (plain, touched) = (run(false), run(true));
    for key in [
        "events",
        "peak_allocated_bytes",
        "peak_reserved_bytes",
        "utilization",
        "ooms",
        "driver_calls",
    ] {
        assert_eq!(plain[key], touched[key], "{key}");
    }
    assert!(plain["peak_allocated_bytes"].as_u64().unwrap() > 0);
}

#[test]
fn driver_bench_on_the_simulator_reports_the_latency_model() {
    let out = cuvmm(&["driver-bench", "--format", "json", "--repetitions", "3"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON");
    assert_eq!(v["schema"], "cuvmm-driver-bench/1");
    assert_eq!(v["timing"], "modeled");
    assert_eq!(v["device"]["kind"], "sim");
    assert_eq!(v["repetitions"], 3);
    assert_eq!(v["latency_model_ns"]["create"], 193_000);
    let pages = v["pages"].as_array().expect("pages");
    let sizes: Vec<u64> = pages
        .iter()
        .map(|p| p["page_bytes"].as_u64().unwrap())
        .collect();
    assert_eq!(sizes, [2 << 20, 20 << 20, 64 << 20, 512 << 20, 1 << 30]);
    // The model: 2 MiB costs one unit, 20 MiB ten units.
    assert_eq!(pages[0]["create_us"], 193.0);
    assert_eq!(pages[1]["create_us"], 1930.0);
    for p in pages {
        let us = |k: &str| p[k].as_f64().unwrap();
        assert_eq!(
            us("grow_fresh_us"),
            us("create_us") + us("map_us") + us("set_access_us")
        );
        assert_eq!(
            us("grow_reused_us"),
            us("unmap_us") + us("map_us") + us("set_access_us")
        );
        assert!(us("grow_reused_us") < us("grow_fresh_us"), "{p}");
        // A run of single pages: the A100 model charges per 2 MiB, so per page and per run agree.
        let pages_in_run = p["run_pages"].as_u64().unwrap();
        assert_eq!(pages_in_run, p["page_bytes"].as_u64().unwrap() >> 21);
        assert_eq!(us("set_access_run_us"), 36.0 * pages_in_run as f64);
        assert_eq!(us("set_access_per_page_us"), us("set_access_run_us"));
        assert_eq!(us("unmap_run_us"), us("unmap_per_page_us"));
        assert!(us("malloc_us") > 0.0 && us("free_us") > 0.0, "{p}");
    }
    assert_eq!(v["stream"]["synchronize_idle_us"], 5.0);
    assert_eq!(v["latency_model"], "a100");

    // The measured H100 model: a fixed part per call, paid per mapping by set_access over a run.
    let out = cuvmm(&[
        "driver-bench",
        "--format",
        "json",
        "--repetitions",
        "1",
        "--latency-model",
        "h100",
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    let h: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON");
    assert_eq!(h["latency_model"], "h100");
    assert_eq!(h["latency_model_parts_ns"]["set_access"][0], 36_189);
    let run = &h["pages"][1];
    assert_eq!(run["run_pages"], 10);
    let single = run["set_access_us"].as_f64().unwrap();
    let over_run = run["set_access_run_us"].as_f64().unwrap();
    assert!(
        over_run > 9.0 * single,
        "ten mappings cost about ten calls: {run}"
    );
    let bad = cuvmm(&["driver-bench", "--latency-model", "v100"]);
    assert_eq!(bad.status.code(), Some(2));
    assert!(
        stderr(&bad).contains("unknown latency model `v100`"),
        "{}",
        stderr(&bad)
    );

    let table = cuvmm(&["driver-bench", "--repetitions", "1"]);
    assert!(table.status.success(), "{}", stderr(&table));
    let text = String::from_utf8(table.stdout).unwrap();
    assert!(text.contains("not measured"), "{text}");
    assert!(text.contains("latency model"), "{text}");
    assert!(text.contains("193000"), "{text}");
}

#[test]
fn driver_bench_rejects_zero_repetitions() {
    let out = cuvmm(&["driver-bench", "--repetitions", "0"]);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert_eq!(stderr(&out).lines().count(), 1, "{}", stderr(&out));
}

/// `cuda-async`, CUDA's own pool, is a comparison on a GPU only: on the simulated device (the default
/// backend) it is refused before anything runs, in compare, capacity and frontier alike.
#[test]
fn cuda_async_on_the_simulator_is_one_line_and_status_2() {
    for args in [
        &["compare", "--allocator", "cuda-async", "--workload", "moe"][..],
        &[
            "compare",
            "--allocator",
            "cuvmm",
            "--allocator",
            "cuda-async",
        ],
        &["capacity", "--allocator", "cuda-async", "--workload", "moe"],
        &[
            "capacity",
            "--backend",
            "sim",
            "--allocator",
            "cuvmm",
            "--allocator",
            "cuda-async",
        ],
        &["frontier", "--allocator", "cuda-async", "--workload", "moe"],
    ] {
        refused(args, "cuda-async");
        refused(args, "runs only on a GPU (--backend cuda)");
    }
}

/// `--allocator` picks what compare replays; an unknown name lists the known ones, GPU-only included.
#[test]
fn compare_replays_the_allocators_named() {
    let out = cuvmm(&[
        "compare",
        "--allocator",
        "classic",
        "--workload",
        "moe",
        "--format",
        "json",
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(
        text.contains("\"classic\"") && !text.contains("\"cuvmm\""),
        "{text}"
    );
    let out = cuvmm(&["compare", "--allocator", "bogus"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(stderr(&out).contains("cuda-async"), "{}", stderr(&out));
}
