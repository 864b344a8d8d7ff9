//! `cuvmm frontier` from the outside: JSON with a row per allocator and capacity from the lower bound to
//! 80 GiB, each allocator's min capacity among them and free of out-of-memory; the table; `--plot`; and
//! bad input as status 2 with one line.

mod common;

use common::{cuvmm, stderr};
use std::path::PathBuf;

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("cuvmm-cli-frontier-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir.join(name)
}

/// A small trace in cuvmm's format whose frees leave holes: 60 MiB live at the peak. Each test writes its
/// own copy (`test`): the tests run in parallel, and rewriting one file while another's run reads it
/// made that run read an empty file.
fn trace(test: &str) -> PathBuf {
    let mut text = String::from("# cuvmm-trace v1\nname holes\n");
    let mib = 1 << 20;
    for i in 0..6 {
        text.push_str(&format!("alloc {i} {} 0\n", (7 + i) * mib));
    }
    for i in [1, 3] {
        text.push_str(&format!("free {i}\n"));
    }
    text.push_str(&format!("alloc 10 {} 0\nfree 10\n", 22 * mib));
    let path = scratch(&format!("holes-{test}.trace"));
    std::fs::write(&path, text).unwrap();
    path
}

#[test]
fn json_has_every_allocator_from_the_lower_bound_to_80_gib() {
    let path = trace("json_has_every_allocator_from_the_lower_bound_to_80_gib");
    let out = cuvmm(&[
        "frontier",
        "--trace",
        path.to_str().unwrap(),
        "--format",
        "json",
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    let value: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let results = value["results"].as_array().unwrap();
    for allocator in ["cuvmm", "classic", "pytorch-expandable"] {
        let rows: Vec<&serde_json::Value> = results
            .iter()
            .filter(|r| r["allocator"] == allocator)
            .collect();
        assert!(rows.len() >= 2, "{allocator}: {rows:?}");
        let caps: Vec<u64> = rows
            .iter()
            .map(|r| r["capacity_bytes"].as_u64().unwrap())
            .collect();
        assert_eq!(*caps.last().unwrap(), 80 << 30);
        assert!(caps.windows(2).all(|w| w[0] < w[1]));
        let min = rows
            .iter()
            .find(|r| r["min_capacity"] == true)
            .expect("the min capacity is a point");
        let min_cap = min["capacity_bytes"].as_u64().unwrap();
        for r in &rows {
            for key in [
                "trace",
                "ooms",
                "peak_reserved_bytes",
                "driver_calls",
                "synchronizations",
            ] {
                assert!(!r[key].is_null(), "{key} missing");
            }
            assert!(r["estimated_driver_us"].is_number());
            assert!(r["estimated_driver_us_by_model"]["per_call"].is_number());
            assert!(r["estimated_driver_us_by_model"]["per_byte"].is_number());
            if r["capacity_bytes"].as_u64().unwrap() >= min_cap && allocator == "cuvmm" {
                assert_eq!(r["ooms"], 0, "{r}");
            }
        }
    }
    // 60 MiB live at most, in 2 MiB pages: the lower bound is the first capacity.
    let first = results[0]["capacity_bytes"].as_u64().unwrap();
    assert!(first <= 64 << 20, "{first}");
    assert!(
        value["latency_model"]
            .as_str()
            .unwrap()
            .contains("per_call")
    );
}

#[test]
fn table_and_plot() {
    let path = trace("table_and_plot");
    let svg = scratch("frontier.svg");
    let out = cuvmm(&[
        "frontier",
        "--trace",
        path.to_str().unwrap(),
        "--allocator",
        "cuvmm",
        "--plot",
        svg.to_str().unwrap(),
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    let table = String::from_utf8(out.stdout).unwrap();
    assert!(table.starts_with("trace"), "{table}");
    assert!(table.contains("80.00 GiB"), "{table}");
    assert!(table.contains(" *"), "{table}");
    let picture = std::fs::read_to_string(&svg).unwrap();
    assert!(picture.starts_with("<svg"));
    assert!(picture.contains("data-allocator=\"cuvmm\""));
    assert!(picture.matches("class=\"point\"").count() >= 2);
}

#[test]
fn bad_input_is_status_2_with_one_line() {
    let out = cuvmm(&["frontier", "--workload", "no-such-workload"]);
    assert_eq!(out.status.code(), Some(2));
    let out = cuvmm(&["frontier", "--trace", "/nonexistent/x.trace"]);
    assert_eq!(out.status.code(), Some(2));
    assert_eq!(stderr(&out).lines().count(), 1, "{}", stderr(&out));
    let path = trace("bad_input_is_status_2_with_one_line");
    let out = cuvmm(&[
        "frontier",
        "--trace",
        path.to_str().unwrap(),
        "--alloc-conf",
        "compaction:sometimes",
    ]);
    assert_eq!(out.status.code(), Some(2));
    assert!(stderr(&out).contains("compaction"), "{}", stderr(&out));
}
