//! `cuvmm bench`: medians per trace and allocator, the ratio to classic, and bad input exiting 2.

mod common;

use common::{cuvmm, stderr};
use std::path::Path;

fn json(out: &std::process::Output) -> serde_json::Value {
    assert!(out.status.success(), "{}", stderr(out));
    serde_json::from_slice(&out.stdout).expect("bench prints JSON")
}

#[test]
fn bench_reports_each_trace_and_allocator_with_the_ratio_to_classic() {
    let out = cuvmm(&[
        "bench",
        "--workload",
        "moe",
        "--allocator",
        "cuvmm",
        "--allocator",
        "classic",
        "--repetitions",
        "3",
        "--format",
        "json",
    ]);
    let results = json(&out)["results"].as_array().unwrap().clone();
    let names: Vec<(&str, &str)> = results
        .iter()
        .map(|r| {
            (
                r["trace"].as_str().unwrap(),
                r["allocator"].as_str().unwrap(),
            )
        })
        .collect();
    assert_eq!(names, [("moe", "cuvmm"), ("moe", "classic")]);
    for r in &results {
        assert_eq!(r["repetitions"], 3);
        assert!(r["events"].as_u64().unwrap() > 10_000, "{r}");
        let rate = r["median_events_per_second"].as_f64().unwrap();
        let seconds = r["median_replay_seconds"].as_f64().unwrap();
        assert!(rate > 0.0 && seconds > 0.0, "{r}");
        assert!(r["median_wall_seconds"].as_f64().unwrap() >= seconds, "{r}");
        assert!(r["driver_calls"].as_u64().unwrap() > 0, "{r}");
        assert_eq!(r["ooms"], 0);
    }
    assert_eq!(results[1]["ratio_to_classic"].as_f64(), Some(1.0));
    let ratio = results[0]["ratio_to_classic"].as_f64().unwrap();
    let rates: Vec<f64> = results
        .iter()
        .map(|r| r["median_events_per_second"].as_f64().unwrap())
        .collect();
    assert!((ratio - rates[0] / rates[1]).abs() < 1e-9 * ratio);
}

#[test]
fn without_classic_there_is_no_ratio_and_the_table_has_a_row_per_result() {
    let out = cuvmm(&[
        "bench",
        "--workload",
        "llm-serving",
        "--allocator",
        "cuvmm",
        "--repetitions",
        "1",
        "--format",
        "json",
    ]);
    assert!(json(&out)["results"][0]["ratio_to_classic"].is_null());
    let out = cuvmm(&["bench", "--workload", "moe", "--repetitions", "1"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let table = String::from_utf8(out.stdout).unwrap();
    assert_eq!(table.lines().count(), 4, "{table}");
    assert!(
        table.lines().skip(1).all(|l| l.starts_with("moe ")),
        "{table}"
    );
}

#[test]
fn bad_bench_input_exits_2_with_one_line_naming_it() {
    let missing = std::env::temp_dir().join("cuvmm-bench-no-such-trace.pickle");
    let missing = missing.to_str().unwrap();
    for (args, named) in [
        (&["bench", "--allocator", "bogus"][..], "bogus"),
        (&["bench", "--workload", "nope"][..], "nope"),
        (&["bench", "--repetitions", "0"][..], "--repetitions"),
        (&["bench", "--trace", missing][..], missing),
    ] {
        let out = cuvmm(args);
        assert_eq!(out.status.code(), Some(2), "{args:?}");
        let err = stderr(&out);
        assert!(err.contains(named), "{err}");
        assert_eq!(err.lines().count(), 1, "{err}");
        assert!(out.stdout.is_empty());
    }
}

#[test]
fn a_recorded_snapshot_is_benched_per_device() {
    let file = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../shared/traces/bert_large_inference.pickle");
    if !file.exists() {
        println!("skipped: {} is absent", file.display());
        return;
    }
    let out = cuvmm(&[
        "bench",
        "--trace",
        file.to_str().unwrap(),
        "--allocator",
        "cuvmm",
        "--repetitions",
        "1",
        "--format",
        "json",
    ]);
    let results = json(&out)["results"].as_array().unwrap().clone();
    assert_eq!(results.len(), 1);
    assert_eq!(results[0]["trace"], "bert_large_inference.pickle");
    assert!(results[0]["events"].as_u64().unwrap() > 1_000);
}

#[test]
fn bench_threads_reports_pairs_per_thread_count_and_cached_allocation_latency() {
    let out = cuvmm(&[
        "bench-threads",
        "--millis",
        "20",
        "--repetitions",
        "1",
        "--format",
        "json",
    ]);
    let report = json(&out);
    let threads = report["threads"].as_array().unwrap();
    for entry in ["DeviceBuffer", "alloc_raw/free_raw"] {
        let series: Vec<_> = threads.iter().filter(|t| t["entry"] == entry).collect();
        let scenarios: Vec<(u64, u64)> = series
            .iter()
            .map(|t| {
                (
                    t["threads"].as_u64().unwrap(),
                    t["streams"].as_u64().unwrap(),
                )
            })
            .collect();
        assert_eq!(
            scenarios,
            [(1, 1), (2, 2), (4, 4), (8, 8), (8, 2)],
            "{entry}"
        );
        let one = series[0]["pairs_per_second"].as_f64().unwrap();
        for t in series {
            let rate = t["pairs_per_second"].as_f64().unwrap();
            assert!(rate > 0.0, "{t}");
            let speedup = t["speedup"].as_f64().unwrap();
            assert!((speedup - rate / one).abs() < 1e-9 * speedup, "{t}");
            assert_eq!(t["size_bytes"], 65536, "{t}");
        }
    }
    assert_eq!(report["backend"], "sim");
    for when in ["during_growth", "idle"] {
        let from_arrival = report[format!("cached_alloc_p99_ns_{when}")]
            .as_u64()
            .unwrap();
        let call = report[format!("cached_alloc_call_p99_ns_{when}")]
            .as_u64()
            .unwrap();
        // Each request's latency from its arrival includes its call's duration.
        assert!(call > 0 && from_arrival >= call, "{when}: {report}");
    }
    assert!(
        report["arrival_p99_ns_floor"].as_u64().is_some(),
        "{report}"
    );
    // The growing stream made driver calls (slept) while the latency was measured.
    assert!(report["growth_steps"].as_u64().unwrap() > 0, "{report}");
    assert_eq!(report["size_bytes"], 64 * 1024);
}

#[test]
fn bench_threads_refuses_a_bad_configuration_with_status_2() {
    let out = cuvmm(&["bench-threads", "--alloc-conf", "stream_cache_mb:lots"]);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(stderr(&out).contains("stream_cache_mb"), "{}", stderr(&out));
}
