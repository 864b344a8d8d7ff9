//! `cuvmm capacity` and `cuvmm compare --plot` from the outside: results on stdout, nothing on stderr when
//! it is not a terminal (no progress bar), bad input is status 2 with one line naming it.

mod common;

use common::{cuvmm, stderr};
use cuvmm::size::MIB;
use serde_pickle::{HashableValue as K, SerOptions, Value as V};
use std::collections::BTreeMap;
use std::path::PathBuf;

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("cuvmm-cli-capplot-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir.join(name)
}

fn dict(entries: Vec<(&str, V)>) -> V {
    V::Dict(
        entries
            .into_iter()
            .map(|(k, v)| (K::String(k.to_string()), v))
            .collect::<BTreeMap<_, _>>(),
    )
}

fn entry(action: &str, addr: u64, size: u64) -> V {
    dict(vec![
        ("action", V::String(action.into())),
        ("addr", V::I64(addr as i64)),
        ("size", V::I64(size as i64)),
        ("stream", V::I64(0)),
        ("frames", V::List(vec![])),
    ])
}

/// A PyTorch snapshot of one device: a 1.5 MiB and a 3 MiB allocation live together, then the first is
/// freed and a 4 MiB one made. Peak live 7 MiB, so the lower bound is 8 MiB with 2 MiB pages.
fn tiny_snapshot(test: &str) -> PathBuf {
    let base = 0x7f00_0000_0000u64;
    let events = vec![
        entry("alloc", base, 3 * MIB / 2),
        entry("alloc", base + 2 * MIB, 3 * MIB),
        entry("free_requested", base, 3 * MIB / 2),
        entry("free_completed", base, 3 * MIB / 2),
        entry("alloc", base + 8 * MIB, 4 * MIB),
    ];
    let snapshot = dict(vec![
        ("segments", V::List(vec![])),
        ("device_traces", V::List(vec![V::List(events)])),
    ]);
    // A directory per test: the tests run in parallel, and rewriting one file while another's run reads it
    // made that run read an empty file.
    let dir = scratch(test);
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("tiny.pickle");
    let mut bytes = Vec::new();
    serde_pickle::value_to_writer(&mut bytes, &snapshot, SerOptions::new()).unwrap();
    std::fs::write(&path, bytes).unwrap();
    path
}

#[test]
fn capacity_prints_json_per_trace_and_allocator() {
    let trace = tiny_snapshot("capacity_prints_json_per_trace_and_allocator");
    let out = cuvmm(&[
        "capacity",
        "--trace",
        trace.to_str().unwrap(),
        "--format",
        "json",
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(out.stderr.is_empty(), "{}", stderr(&out));
    let value: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON on stdout");
    let results = value["results"].as_array().expect("results");
    let allocators: Vec<&str> = results
        .iter()
        .map(|r| r["allocator"].as_str().unwrap())
        .collect();
    assert_eq!(allocators, cuvmm_lab::replay::allocators::ALLOCATORS);
    for r in results {
        assert_eq!(r["trace"], "tiny.pickle");
        assert_eq!(r["peak_live_bytes"], 7 * MIB);
        assert_eq!(r["lower_bound_bytes"], 8 * MIB);
        let capacity = r["min_capacity_bytes"].as_u64().expect("a capacity");
        assert!(capacity >= 8 * MIB && capacity % (2 * MIB) == 0, "{r}");
    }
    // cuvmm: the 3 MiB block spans pages 0-2 (it starts at 1.5 MiB, after the freed 1.5 MiB hole, which
    // is too small for the 4 MiB block), and the 4 MiB block after it spans pages 2-4: 5 pages.
    assert_eq!(results[0]["min_capacity_bytes"], 10 * MIB);
    // PyTorch serves each request between 1 and 10 MiB from a 20 MiB segment (all three fit in one).
    assert_eq!(results[1]["min_capacity_bytes"], 20 * MIB);
}

#[test]
fn capacity_table_has_a_row_per_allocator_asked_for() {
    let trace = tiny_snapshot("capacity_table_has_a_row_per_allocator_asked_for");
    let out = cuvmm(&[
        "capacity",
        "--trace",
        trace.to_str().unwrap(),
        "--allocator",
        "classic",
        "--allocator",
        "cuvmm",
        "--quiet",
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    let stdout = String::from_utf8(out.stdout).unwrap();
    let lines: Vec<&str> = stdout.lines().collect();
    assert_eq!(lines.len(), 3, "{stdout}");
    assert!(lines[0].starts_with("trace") && lines[0].contains("min capacity"));
    assert!(lines[1].starts_with("tiny.pickle  classic"), "{stdout}");
    assert!(lines[2].starts_with("tiny.pickle  cuvmm"), "{stdout}");
    assert!(lines[2].contains("7.00 MiB"), "{stdout}");
}

#[test]
fn capacity_bad_input_exits_2_with_one_line_naming_it() {
    let missing = scratch("no-such-trace.pickle");
    let not_a_trace = scratch("hello.txt");
    std::fs::write(&not_a_trace, "hello").unwrap();
    let trace = tiny_snapshot("capacity_bad_input_exits_2_with_one_line_naming_it");
    let cases: Vec<(Vec<&str>, &str)> = vec![
        (
            vec!["--trace", missing.to_str().unwrap()],
            "no-such-trace.pickle",
        ),
        (vec!["--trace", not_a_trace.to_str().unwrap()], "hello.txt"),
        (vec!["--allocator", "bogus"], "bogus"),
        (vec!["--workload", "no-such-workload"], "no-such-workload"),
        (vec!["--page-size", "0"], "--page-size"),
        (
            vec![
                "--trace",
                trace.to_str().unwrap(),
                "--alloc-conf",
                "no_such_key:1",
            ],
            "no_such_key",
        ),
        (
            vec![
                "--trace",
                trace.to_str().unwrap(),
                "--page-size",
                "4MiB",
                "--allocator",
                "pytorch-expandable",
            ],
            "pytorch-expandable",
        ),
    ];
    for (args, named) in cases {
        let mut all = vec!["capacity"];
        all.extend(&args);
        let out = cuvmm(&all);
        let err = stderr(&out);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
        assert!(err.contains(named), "{args:?}: {err}");
        assert_eq!(err.lines().count(), 1, "{args:?}: {err}");
        assert!(!err.contains("panicked"), "{err}");
        assert!(out.stdout.is_empty(), "{args:?}");
    }
    // Both sources at once is clap's usage error: status 2, no panic.
    let out = cuvmm(&[
        "capacity",
        "--trace",
        trace.to_str().unwrap(),
        "--workload",
        "moe",
    ]);
    assert_eq!(out.status.code(), Some(2));
    assert!(stderr(&out).contains("--workload"), "{}", stderr(&out));
}

#[test]
fn compare_plot_writes_an_svg_and_keeps_stdout_for_results() {
    let plot = scratch("moe.svg");
    let _ = std::fs::remove_file(&plot);
    let out = cuvmm(&[
        "compare",
        "--workload",
        "moe",
        "--plot",
        plot.to_str().unwrap(),
        "--format",
        "json",
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    // stderr is a pipe here, not a terminal: no progress bar, nothing at all.
    assert!(out.stderr.is_empty(), "{}", stderr(&out));
    let value: serde_json::Value =
        serde_json::from_slice(&out.stdout).expect("only JSON on stdout");
    assert_eq!(value["results"].as_array().unwrap().len(), 3);
    let svg = std::fs::read_to_string(&plot).expect("plot written");
    let doc = roxmltree::Document::parse(&svg).expect("well-formed");
    let panels: Vec<_> = doc
        .descendants()
        .filter(|n| n.attribute("class") == Some("panel"))
        .collect();
    assert_eq!(panels.len(), 1);
    assert_eq!(panels[0].attribute("data-trace"), Some("moe"));
    let paths = panels[0]
        .descendants()
        .filter(|n| n.tag_name().name() == "path")
        .count();
    assert_eq!(paths, 6, "allocated and reserved for each of 3 allocators");
}

#[test]
fn compare_plot_to_an_unwritable_path_exits_2_before_replaying() {
    let plot = scratch("no-such-dir").join("out.svg");
    let out = cuvmm(&["compare", "--plot", plot.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(2));
    let err = stderr(&out);
    assert!(err.contains("--plot") && err.contains("out.svg"), "{err}");
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(out.stdout.is_empty());
}
