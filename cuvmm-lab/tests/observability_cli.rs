//! The observability commands from the outside: `summary`, `snapshot`, `-v` logging, and the first
//! out-of-memory diagnosis of a replay on stderr.

mod common;

use common::{cuvmm, stderr};
use std::path::Path;

fn stdout(output: &std::process::Output) -> String {
    String::from_utf8_lossy(&output.stdout).into_owned()
}

#[test]
fn verbose_logs_segment_events_on_stderr_and_keeps_stdout_clean() {
    for args in [
        &["-v", "summary", "--workload", "moe"][..],
        &["summary", "-v", "--workload", "moe"][..],
    ] {
        let out = cuvmm(args);
        assert!(out.status.success(), "{args:?}: {}", stderr(&out));
        let (text, log) = (stdout(&out), stderr(&out));
        assert!(log.contains("reserved segment"), "{args:?}: {log}");
        assert!(!log.contains("DEBUG"), "-v is info only: {log}");
        assert!(
            !text.contains("INFO") && !text.contains("cuvmm: reserved segment"),
            "{text}"
        );
        for line in text.lines().filter(|l| l.starts_with('|')) {
            assert_eq!(line.chars().count(), 77, "{line:?}");
        }
        assert_eq!(
            text.matches("CUDA memory summary, device ID 0").count(),
            2,
            "{text}"
        );
    }
    let debug = cuvmm(&["-vv", "summary", "--workload", "moe"]);
    assert!(
        stderr(&debug).contains("mapping pages"),
        "{}",
        stderr(&debug)
    );
    let quiet = cuvmm(&["summary", "--workload", "moe", "--allocator", "classic"]);
    assert!(quiet.status.success());
    assert_eq!(stderr(&quiet), "", "nothing is logged without -v");
}

#[test]
fn summary_at_the_peak_shows_current_reserved_at_its_peak() {
    let out = cuvmm(&[
        "summary",
        "--workload",
        "llm-serving",
        "--allocator",
        "classic",
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    let text = stdout(&out);
    let reserved: Vec<&str> = text
        .lines()
        .filter(|l| l.starts_with("| GPU reserved memory"))
        .collect();
    assert_eq!(reserved.len(), 2, "{text}");
    let cells =
        |line: &str| -> Vec<String> { line.split('|').map(|c| c.trim().to_string()).collect() };
    let at_peak = cells(reserved[0]);
    assert_eq!(
        at_peak[2], at_peak[3],
        "current == peak at the peak: {}",
        reserved[0]
    );
    let at_end = cells(reserved[1]);
    assert_eq!(at_end[3], at_peak[3], "the peak does not move after it");
}

#[test]
fn an_out_of_memory_replay_prints_one_diagnosis_on_stderr() {
    let out = cuvmm(&["compare", "--workload", "moe", "--capacity", "20GiB"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let (text, log) = (stdout(&out), stderr(&out));
    assert_eq!(
        log.matches("CUDA out of memory. Tried to allocate").count(),
        1,
        "{log}"
    );
    assert_eq!(log.lines().count(), 1, "{log}");
    assert!(
        log.contains("is reserved by cuvmm but unallocated"),
        "{log}"
    );
    assert!(!text.contains("CUDA out of memory"), "{text}");
    assert!(text.contains("moe"), "{text}");

    let out = cuvmm(&[
        "summary",
        "--workload",
        "moe",
        "--capacity",
        "20GiB",
        "--allocator",
        "classic",
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    let log = stderr(&out);
    assert_eq!(log.lines().count(), 1, "{log}");
    assert!(log.contains("allocated by classic"), "{log}");
    assert!(
        !stdout(&out).contains("CUDA OOMs: 0 "),
        "the summary counts the OOMs"
    );
}

#[test]
fn snapshot_writes_a_pickle_that_cuvmm_reads_back() {
    let dir = std::env::temp_dir().join(format!("cuvmm-cli-snapshot-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("moe.pickle");
    let out = cuvmm(&[
        "snapshot",
        "--workload",
        "moe",
        "--allocator",
        "pytorch-expandable",
        "--max-entries",
        "500",
        "-o",
        path.to_str().unwrap(),
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(
        stdout(&out).contains("500 trace entries"),
        "{}",
        stdout(&out)
    );
    let raw = cuvmm_lab::trace::pytorch::snapshot::read(&path).unwrap();
    assert_eq!(raw.device_traces[0].as_ref().unwrap().len(), 500);
    for seg in &raw.segments {
        let end: u64 = seg.blocks.iter().map(|b| b.size).sum::<u64>() + seg.address;
        assert_eq!(end, seg.address + seg.total_size);
    }
}

#[test]
fn bad_input_is_one_line_and_status_2() {
    let missing = Path::new("/nonexistent/cuvmm-trace.pickle");
    let unwritable = "/nonexistent/dir/out.pickle";
    for (args, needle) in [
        (vec!["summary"], "--trace FILE or --workload NAME"),
        (
            vec!["summary", "--workload", "moe", "--trace", "x"],
            "not both",
        ),
        (
            vec!["summary", "--trace", missing.to_str().unwrap()],
            "cuvmm-trace.pickle",
        ),
        (
            vec!["summary", "--workload", "moe", "--allocator", "bogus"],
            "bogus",
        ),
        (vec!["summary", "--workload", "nope"], "nope"),
        (
            vec!["snapshot", "--workload", "moe", "-o", unwritable],
            "/nonexistent/dir/out.pickle",
        ),
    ] {
        let out = cuvmm(&args);
        let log = stderr(&out);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {log}");
        assert_eq!(log.lines().count(), 1, "{args:?}: {log}");
        assert!(log.contains(needle), "{args:?}: {log}");
        assert!(out.stdout.is_empty(), "{args:?}");
    }
}

#[test]
fn summary_of_a_real_pytorch_snapshot() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../shared/traces");
    let file = dir.join("bert_large_inference.pickle");
    if !file.exists() {
        println!("skipped: {} is absent", file.display());
        return;
    }
    let out = cuvmm(&[
        "summary",
        "--trace",
        file.to_str().unwrap(),
        "--allocator",
        "classic",
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    let text = stdout(&out);
    assert!(text.contains("bert_large_inference.pickle"), "{text}");
    assert_eq!(text.matches("| Allocated memory").count(), 2, "{text}");
}
