//! The `cuvmm` binary: exit statuses, messages on stderr, results on stdout.

use cuvmm::trace::workload::BUILTIN;
use std::process::{Command, Output};

fn cuvmm(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_cuvmm"))
        .args(args)
        .output()
        .expect("run cuvmm")
}

fn stderr(output: &Output) -> String {
    String::from_utf8_lossy(&output.stderr).into_owned()
}

#[test]
fn bad_flag_exits_2() {
    let out = cuvmm(&["--no-such-flag"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(stderr(&out).contains("--no-such-flag"), "{}", stderr(&out));
    assert!(out.stdout.is_empty());
}

#[test]
fn unknown_workload_exits_2_with_one_line_naming_it() {
    for args in [
        &["--workload", "no-such-workload"][..],
        &[
            "compare",
            "--workload",
            "moe",
            "--workload",
            "no-such-workload",
        ],
    ] {
        let out = cuvmm(args);
        assert_eq!(out.status.code(), Some(2), "{args:?}");
        let err = stderr(&out);
        assert!(err.contains("no-such-workload"), "{err}");
        assert_eq!(err.lines().count(), 1, "{err}");
        assert!(!err.contains("panicked"), "{err}");
        assert!(out.stdout.is_empty());
    }
}

#[test]
fn bad_sizes_exit_2_with_one_line_naming_them() {
    for (flag, value) in [
        ("--capacity", "80QiB"),
        ("--page-size", "0"),
        ("--capacity", "x"),
    ] {
        let out = cuvmm(&["compare", flag, value]);
        assert_eq!(out.status.code(), Some(2), "{flag} {value}");
        let err = stderr(&out);
        assert!(err.contains(flag) && err.contains(value), "{err}");
        assert_eq!(err.lines().count(), 1, "{err}");
    }
}

#[test]
fn workloads_lists_every_builtin_with_a_description() {
    let out = cuvmm(&["workloads"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let stdout = String::from_utf8(out.stdout).unwrap();
    let lines: Vec<&str> = stdout.lines().collect();
    assert_eq!(lines.len(), BUILTIN.len(), "{stdout}");
    for (line, name) in lines.iter().zip(BUILTIN) {
        assert!(line.starts_with(name), "{line}");
        assert!(line.len() > name.len() + 10, "no description: {line}");
    }
}

#[test]

fn compare_prints_one_json_result_per_workload() {
    let out = cuvmm(&["compare", "--format", "json"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let value: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON on stdout");
    let results = value["results"].as_array().expect("results array");
    assert_eq!(results.len(), BUILTIN.len());
    for (result, name) in results.iter().zip(BUILTIN) {
        assert_eq!(result["workload"], *name);
        assert_eq!(result["allocator"], "cuvmm");
        for key in [
            "events",
            "peak_allocated_bytes",
            "peak_reserved_bytes",
            "utilization",
            "ooms",
            "driver_calls",
            "estimated_driver_us",
            "replay_seconds",
        ] {
            assert!(result.get(key).is_some(), "{name}: missing {key}");
        }
        for key in [
            "create",
            "release",
            "map",
            "unmap",
            "set_access",
            "malloc",
            "free",
        ] {
            assert!(
                result["driver_calls"][key].is_u64(),
                "{name}: driver_calls.{key}"
            );
        }
        assert!(result["peak_allocated_bytes"].as_u64().unwrap() > 0);
    }
}

#[test]
fn alloc_conf_configures_the_allocators_and_a_bad_one_exits_2() {
    let out = cuvmm(&["compare", "--alloc-conf", "cross_stream_reuse:maybe"]);
    assert_eq!(out.status.code(), Some(2));
    let err = stderr(&out);
    assert!(err.contains("cross_stream_reuse"), "{err}");
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(out.stdout.is_empty());

    let json = |conf: &str| {
        let out = cuvmm(&[
            "compare",
            "--workload",
            "stream-producer-consumer",
            "--format",
            "json",
            "--alloc-conf",
            conf,
        ]);
        assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
        let value: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        value["results"][0].clone()
    };
    let on = json("cross_stream_reuse:True");
    let off = json("cross_stream_reuse:False");
    assert_eq!(
        (on["ooms"].as_u64(), off["ooms"].as_u64()),
        (Some(0), Some(0))
    );
    assert!(
        on["synchronizations"].as_u64() < off["synchronizations"].as_u64(),
        "borrowing cached blocks should move fewer pages: {on} / {off}"
    );
}
