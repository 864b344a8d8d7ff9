//! The `cuvmm` binary: exit statuses, messages on stderr, results on stdout.

use cuvmm_lab::replay::allocators::ALLOCATORS;
use cuvmm_lab::workload::BUILTIN;
mod common;

use common::{cuvmm, stderr};

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

fn compare_prints_one_json_result_per_workload_and_allocator() {
    let out = cuvmm(&["compare", "--format", "json"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let value: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON on stdout");
    let results = value["results"].as_array().expect("results array");
    assert_eq!(results.len(), BUILTIN.len() * ALLOCATORS.len());
    let expected = BUILTIN
        .iter()
        .flat_map(|w| ALLOCATORS.iter().map(move |a| (w, a)));
    for (result, (name, allocator)) in results.iter().zip(expected) {
        assert_eq!(result["workload"], **name);
        assert_eq!(result["allocator"], **allocator);
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
fn a_closed_stdout_ends_the_program_quietly() {
    use std::process::{Command, Stdio};
    let mut child = Command::new(env!("CARGO_BIN_EXE_cuvmm"))
        .args(["compare", "--workload", "moe"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Close the reading end before the replay finishes, as `cuvmm | head -0` would.
    drop(child.stdout.take());
    let output = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert!(
        output.status.success(),
        "status {:?}: {stderr}",
        output.status
    );
}

#[test]
fn fidelity_of_a_bad_file_exits_2_with_one_line_naming_it() {
    let dir = std::env::temp_dir().join(format!("cuvmm-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let bad = dir.join("not-a-snapshot.pickle");
    std::fs::write(&bad, b"garbage").unwrap();
    for path in [bad.to_str().unwrap(), "/no/such/trace.pickle"] {
        let out = cuvmm(&["fidelity", "--trace", path, "--format", "json"]);
        assert_eq!(out.status.code(), Some(2), "{path}");
        let err = stderr(&out);
        assert_eq!(err.lines().count(), 1, "{err}");
        assert!(err.contains(path), "{err}");
        assert!(!err.contains("panicked"), "{err}");
        assert!(out.stdout.is_empty());
    }
}

#[test]
fn fidelity_json_has_exactly_the_specified_fields() {
    let trace = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../shared/traces/bert_large_inference.pickle");
    if !trace.exists() {
        println!("skipped: {} is absent", trace.display());
        return;
    }
    let out = cuvmm(&[
        "fidelity",
        "--trace",
        trace.to_str().unwrap(),
        "--format",
        "json",
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    let value: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON on stdout");
    let keys: Vec<&str> = value
        .as_object()
        .unwrap()
        .keys()
        .map(String::as_str)
        .collect();
    let mut expected = vec![
        "trace",
        "device",
        "mode",
        "ground_truth",
        "model",
        "segment_event_match",
        "peak_reserved_error",
    ];
    expected.sort_unstable();
    let mut keys = keys;
    keys.sort_unstable();
    assert_eq!(keys, expected);
    for side in ["ground_truth", "model"] {
        let mut k: Vec<&str> = value[side]
            .as_object()
            .unwrap()
            .keys()
            .map(String::as_str)
            .collect();
        k.sort_unstable();
        assert_eq!(k, vec!["peak_reserved_bytes", "segment_events"]);
    }
    assert_eq!(value["mode"], "classic");
    assert_eq!(value["device"], 0);
    assert_eq!(value["segment_event_match"], 1.0);
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
    // Under `compaction:pressure` an 80 GiB device never borrows (memory is plentiful); eager compaction
    // shows what borrowing saves.
    let on = json("compaction:eager,cross_stream_reuse:True");
    let off = json("compaction:eager,cross_stream_reuse:False");
    assert_eq!(
        (on["ooms"].as_u64(), off["ooms"].as_u64()),
        (Some(0), Some(0))
    );
    assert!(
        on["synchronizations"].as_u64() < off["synchronizations"].as_u64(),
        "borrowing cached blocks should move fewer pages: {on} / {off}"
    );
}

#[test]
fn capacity_names_stranded_pages_and_the_setting_in_a_second_table() {
    let table = |conf: &str| {
        let mut args = vec![
            "capacity",
            "--workload",
            "moe",
            "--allocator",
            "cuvmm",
            "--quiet",
        ];
        if !conf.is_empty() {
            args.extend(["--alloc-conf", conf]);
        }
        let out = cuvmm(&args);
        assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
        String::from_utf8(out.stdout).unwrap()
    };
    let default = table("");
    let (first, second) = default
        .split_once("\n\n")
        .unwrap_or_else(|| panic!("one table only:\n{default}"));
    assert_eq!(first.lines().count(), 2, "{default}");
    let row = (second.lines())
        .find(|l| l.starts_with("moe"))
        .unwrap_or_else(|| panic!("no row for moe:\n{default}"));
    let cells: Vec<&str> = row.split_whitespace().collect();
    assert_eq!(
        (cells[1], cells[4]),
        ("cuvmm", "compaction:split"),
        "{default}"
    );
    // Its min capacity is the one the setting finds, below the default's.
    let with_split = table("compaction:split");
    assert!(!with_split.contains("\n\n"), "{with_split}");
    let split_row: Vec<&str> = with_split
        .lines()
        .nth(1)
        .unwrap()
        .split_whitespace()
        .collect();
    assert_eq!(cells[5..7], split_row[4..6], "{default}\n{with_split}");
    assert_ne!(
        first.lines().nth(1).unwrap(),
        with_split.lines().nth(1).unwrap()
    );
}
