//! `cuvmm compare --trace` and `cuvmm workload -o` on the command line.
//!
//! Every bad input (an empty, truncated, corrupt or mistyped file, a bad row, a size no device has, a
//! missing file, a device the snapshot lacks, an unknown flag) exits with status 2 and exactly one line on
//! stderr naming the file or flag and the problem, nothing on stdout, never a panic. Good files replay
//! through every allocator, and the JSON results name the trace.

mod common;

use common::snapshot::{dict, pickle, s};
use common::{cuvmm, stderr};
use cuvmm_lab::replay::allocators::ALLOCATORS;
use cuvmm_lab::trace::rmm;
use cuvmm_lab::trace::text;
use cuvmm_lab::workload;
use serde_pickle::Value as V;
use std::path::{Path, PathBuf};

fn scratch() -> PathBuf {
    let dir = std::env::temp_dir().join(format!("cuvmm-cli-traces-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn file(name: &str, bytes: impl AsRef<[u8]>) -> PathBuf {
    let path = scratch().join(name);
    std::fs::write(&path, bytes).unwrap();
    path
}

/// Runs `args` and checks: status 2, nothing on stdout, exactly one line on stderr containing each of
/// `needles`, no panic.
fn refused(args: &[&str], needles: &[&str]) {
    let out = cuvmm(args);
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
    assert!(out.stdout.is_empty(), "{args:?}: output on stdout");
    assert_eq!(err.lines().count(), 1, "{args:?}: {err}");
    assert!(!err.contains("panicked"), "{args:?}: {err}");
    for needle in needles {
        assert!(
            err.contains(needle),
            "{args:?}: {needle:?} missing from {err}"
        );
    }
}

/// `compare --trace path` is refused with one line naming the file and containing `problem`.
fn trace_refused(path: &Path, problem: &str) {
    let p = path.to_str().unwrap();
    refused(&["compare", "--trace", p], &[p, problem]);
}

fn entry(action: &str, addr: i64, size: V) -> V {
    dict(vec![
        ("action", s(action)),
        ("addr", V::I64(addr)),
        ("size", size),
        ("stream", V::I64(0)),
    ])
}

/// A snapshot without segments whose device `d` allocates and frees `sizes[d]` bytes.
fn snapshot(sizes: &[i64]) -> V {
    let traces = sizes
        .iter()
        .enumerate()
        .map(|(d, &size)| {
            let addr = 0x7f00_0000_0000 + d as i64 * 0x1_0000_0000;
            V::List(vec![
                entry("alloc", addr, V::I64(size)),
                entry("free_completed", addr, V::I64(size)),
            ])
        })
        .collect();
    dict(vec![
        ("segments", V::List(vec![])),
        ("device_traces", V::List(traces)),
    ])
}

/// Bytes from a seeded SplitMix64: the same every run.
fn random_bytes(seed: u64, len: usize) -> Vec<u8> {
    let mut state = seed;
    (0..len)
        .map(|_| {
            state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = state;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            (z ^ (z >> 31)) as u8
        })
        .collect()
}

fn json(args: &[&str]) -> Vec<serde_json::Value> {
    let out = cuvmm(args);
    assert_eq!(out.status.code(), Some(0), "{args:?}: {}", stderr(&out));
    let value: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON on stdout");
    value["results"].as_array().expect("results").clone()
}

#[test]
fn unreadable_and_corrupt_files_exit_2_naming_the_file() {
    trace_refused(&file("empty.pickle", b""), "empty file");
    trace_refused(Path::new("/no/such/trace.pickle"), "cannot read");
    let full = pickle(&snapshot(&[4096]));
    trace_refused(
        &file("truncated.pickle", &full[..full.len() / 2]),
        "not a PyTorch memory snapshot",
    );
    for seed in 0..4 {
        let mut bytes = random_bytes(seed, 2000);
        trace_refused(&file(&format!("random{seed}.bin"), &bytes), "not a trace");
        // Random bytes after a pickle's first byte go to the pickle decoder.
        bytes[0] = 0x80;
        trace_refused(
            &file(&format!("random{seed}.pickle"), &bytes),
            "not a PyTorch memory snapshot",
        );
    }
    trace_refused(
        &file("kineto.json", b"{\"traceEvents\": []}"),
        "no CUDA memory events",
    );
    // fidelity needs what only a snapshot records, and says so of another kind of trace.
    let kineto = file("kineto_for_fidelity.json", b"{\"traceEvents\": []}");
    let p = kineto.to_str().unwrap();
    refused(
        &["fidelity", "--trace", p],
        &[p, "a PyTorch profiler trace, not a PyTorch memory snapshot"],
    );
    refused(
        &["fidelity", "--trace", "/no/such/trace.pickle"],
        &["/no/such/trace.pickle", "cannot read"],
    );
    trace_refused(
        &file(
            "truncated.json",
            b"{\"traceEvents\": [{\"name\": \"[memory]\"",
        ),
        "not a PyTorch profiler trace",
    );
    trace_refused(
        &file("corrupt.json.gz", [0x1f, 0x8b, 8, 0, 1, 2, 3]),
        "cannot decompress",
    );
    trace_refused(
        &file(
            "zero.json",
            b"{\"traceEvents\": [{\"name\": \"[memory]\", \"ts\": 1, \"args\": {\"Device Type\": 1, \"Device Id\": 0, \"Bytes\": 0}}]}",
        ),
        "`Bytes` is missing, not an integer, 0 or beyond any device",
    );
}

/// A gzipped trace replays as the plain file does, whatever its format; `fidelity` reads a gzipped snapshot.
#[test]
fn gzipped_traces_replay_as_the_plain_ones() {
    use std::io::Write;
    let gzip = |bytes: &[u8]| {
        let mut encoder = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
        encoder.write_all(bytes).unwrap();
        encoder.finish().unwrap()
    };
    let own = text::to_string(&workload::generate("moe", 3).unwrap());
    let files = [
        ("gz_two.pickle", pickle(&snapshot(&[4096, 3 << 20]))),
        ("gz_moe.trace", own.into_bytes()),
    ];
    for (name, bytes) in files {
        let plain = file(name, &bytes);
        let zipped = file(&format!("{name}.gz"), gzip(&bytes));
        let results = |path: &Path| -> Vec<serde_json::Value> {
            json(&[
                "compare",
                "--trace",
                path.to_str().unwrap(),
                "--format",
                "json",
            ])
            .into_iter()
            .map(|mut r| {
                let object = r.as_object_mut().unwrap();
                object.remove("replay_seconds");
                let workload = object.remove("workload").unwrap();
                let workload = workload.as_str().unwrap().replace(".gz", "");
                object.insert("workload".into(), workload.into());
                r
            })
            .collect()
        };
        let expected = results(&plain);
        assert!(!expected.is_empty(), "{name}");
        assert_eq!(results(&zipped), expected, "{name}");
    }
    let zipped = scratch().join("gz_two.pickle.gz");
    let out = cuvmm(&["fidelity", "--trace", zipped.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
}

/// A 0-byte allocation, which PyTorch never records, is read as one byte by every command.
#[test]
fn a_zero_byte_allocation_is_read_as_one_byte() {
    let path = file("zero.pickle", pickle(&snapshot(&[0])));
    let p = path.to_str().unwrap();
    let results = json(&["compare", "--trace", p, "--format", "json"]);
    assert!(!results.is_empty());
    for r in &results {
        assert_eq!(r["peak_live_bytes"], 1, "{r}");
    }
    let out = cuvmm(&["fidelity", "--trace", p]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
}

#[test]
fn snapshots_with_missing_or_mistyped_fields_exit_2() {
    let cases = [
        // An entry without its action.
        (
            "no_action.pickle",
            dict(vec![(
                "device_traces",
                V::List(vec![V::List(vec![dict(vec![("addr", V::I64(0x1000))])])]),
            )]),
            "trace entry 0 (?): `action` is missing",
        ),
        // A size that is text.
        (
            "text_size.pickle",
            dict(vec![(
                "device_traces",
                V::List(vec![V::List(vec![entry("alloc", 0x1000, s("big"))])]),
            )]),
            "trace entry 0 (alloc): `size` is not a non-negative integer",
        ),
        // A negative size.
        (
            "negative.pickle",
            dict(vec![(
                "device_traces",
                V::List(vec![V::List(vec![entry("alloc", 0x1000, V::I64(-4096))])]),
            )]),
            "trace entry 0 (alloc): `size` is not a non-negative integer",
        ),
        // A size beyond any device.
        (
            "absurd.pickle",
            dict(vec![(
                "device_traces",
                V::List(vec![V::List(vec![entry("alloc", 0x1000, V::I64(1 << 60))])]),
            )]),
            "beyond any device",
        ),
        // device_traces that is not a list.
        (
            "mistyped.pickle",
            dict(vec![("device_traces", s("none"))]),
            "invalid type",
        ),
        // A list, as torch.cuda.memory_snapshot() returns: told apart, with how to record a snapshot.
        (
            "list.pickle",
            V::List(vec![V::I64(1)]),
            "_record_memory_history()",
        ),
        // No trace entries: _dump_snapshot without _record_memory_history.
        (
            "no_history.pickle",
            dict(vec![
                ("segments", V::List(vec![])),
                ("device_traces", V::List(vec![V::List(vec![])])),
            ]),
            "device 0 has no allocation history",
        ),
    ];
    for (name, value, problem) in cases {
        trace_refused(&file(name, pickle(&value)), problem);
    }
}

/// Every field an entry's action needs is checked: an `alloc` or a free without its address, size or
/// stream, a segment event without its address or size, exits 2 with one line naming the device, the
/// entry's index, its action and the field. Fields an action does not need may be missing.
#[test]
fn snapshot_entries_lacking_a_field_their_action_needs_exit_2() {
    let without = |action: &str, field: &str| {
        let mut e = vec![
            ("action", s(action)),
            ("addr", V::I64(0x7f00_0000_0000)),
            ("size", V::I64(4096)),
            ("stream", V::I64(0)),
        ];
        e.retain(|(k, _)| *k != field);
        dict(e)
    };
    let cases = [
        ("alloc", "addr"),
        ("alloc", "size"),
        ("alloc", "stream"),
        ("free_requested", "addr"),
        ("free_completed", "size"),
        ("free_completed", "stream"),
        ("segment_alloc", "addr"),
        ("segment_free", "size"),
        ("segment_map", "size"),
        ("segment_unmap", "addr"),
    ];
    for (action, field) in cases {
        // The bad entry comes second, after a good allocation.
        let value = dict(vec![
            ("segments", V::List(vec![])),
            (
                "device_traces",
                V::List(vec![V::List(vec![
                    entry("alloc", 0x7f00_0010_0000, V::I64(512)),
                    without(action, field),
                ])]),
            ),
        ]);
        let path = file(&format!("no_{field}_{action}.pickle"), pickle(&value));
        let needle = format!("device 0 trace entry 1 ({action}): `{field}` is missing");
        trace_refused(&path, &needle);
        let p = path.to_str().unwrap();
        refused(&["fidelity", "--trace", p], &[p, &needle]);
        refused(&["capacity", "--trace", p], &[p, &needle]);
    }
    // An `oom` entry needs none of them, and a stream may be left out of a segment event.
    let value = dict(vec![
        ("segments", V::List(vec![])),
        (
            "device_traces",
            V::List(vec![V::List(vec![
                entry("alloc", 0x7f00_0010_0000, V::I64(512)),
                dict(vec![("action", s("oom"))]),
                without("segment_free", "stream"),
            ])]),
        ),
    ]);
    let path = file("oom_bare.pickle", pickle(&value));
    let out = cuvmm(&["compare", "--trace", path.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
}

#[test]
fn bad_csv_rows_exit_2_naming_the_file_and_line() {
    let cases = [
        ("1,t,allocate,0x100,8", "expected 6 columns"),
        ("1,t,malloc,0x100,8,0x0", "unknown action \"malloc\""),
        (
            "1,t,allocate,0xgg,8,0x0",
            "Pointer \"0xgg\" is not a hexadecimal number",
        ),
        (
            "1,t,allocate,0x100,eight,0x0",
            "Size \"eight\" is not a decimal number",
        ),
        ("1,t,allocate,0x100,-4096,0x0", "negative size -4096"),
        (
            "1,t,allocate,0x100,4611686018427387904,0x0",
            "size 4611686018427387904 is beyond any device",
        ),
    ];
    for (i, (row, problem)) in cases.into_iter().enumerate() {
        let text = format!("{}\n1,t,allocate,0x9000,16,0x0\n{row}\n", rmm::HEADER);
        let path = file(&format!("bad{i}.csv"), text);
        trace_refused(&path, &format!("{}:3: {problem}", path.display()));
    }
}

#[test]
fn bad_cuvmm_traces_exit_2_naming_the_file_and_line() {
    let cases = [
        ("alloc 1 -8 0", "size \"-8\" is not a decimal number"),
        ("alloc 1 2251799813685248 0", "beyond any device"),
        ("free 9", "free of 9, which was never allocated"),
        ("allocate 1 2 3", "unknown record"),
    ];
    for (i, (line, problem)) in cases.into_iter().enumerate() {
        let path = file(
            &format!("bad{i}.trace"),
            format!("{}\n{line}\n", text::HEADER),
        );
        trace_refused(&path, &format!("{}:2: ", path.display()));
        trace_refused(&path, problem);
    }
}

#[test]
fn a_device_the_trace_lacks_exits_2() {
    let one = file("one.pickle", pickle(&snapshot(&[4096])));
    let p = one.to_str().unwrap();
    refused(
        &["compare", "--trace", p, "--device", "7"],
        &[p, "no device 7"],
    );
    let csv = file(
        "one.csv",
        format!("{}\n1,t,allocate,0x100,8,0x0\n", rmm::HEADER),
    );
    let c = csv.to_str().unwrap();
    refused(
        &["compare", "--trace", c, "--device", "1"],
        &[c, "no device 1"],
    );
    // A device index without a trace file, or that is not a number.
    refused(&["compare", "--device", "1"], &["--trace"]);
    refused(&["compare", "--trace", p, "--device=-1"], &["--device"]);
    refused(
        &["compare", "--trace", p, "--device", "x"],
        &["--device", "'x'"],
    );
}

#[test]
fn unknown_flags_exit_2_with_one_line() {
    refused(
        &["compare", "--trace", "x.pickle", "--no-such"],
        &["--no-such"],
    );
    refused(&["workload", "moe", "-o", "x", "--bogus"], &["--bogus"]);
    refused(&["workload", "moe"], &["--output"]);
    refused(&["workload", "no-such", "-o", "x"], &["no-such"]);
    refused(&["compare", "--trace"], &["--trace"]);
    let missing = scratch().join("no/such/dir/moe.trace");
    let m = missing.to_str().unwrap();
    refused(&["workload", "moe", "-o", m], &[m, "cannot create"]);
}

#[test]
fn a_bad_file_stops_compare_before_any_replay() {
    let good = file(
        "good.csv",
        format!("{}\n1,t,allocate,0x100,8,0x0\n", rmm::HEADER),
    );
    let bad = file("bad.csv", format!("{}\n1,t,allocate,0x100\n", rmm::HEADER));
    let (g, b) = (good.to_str().unwrap(), bad.to_str().unwrap());
    refused(
        &["compare", "--workload", "moe", "--trace", g, "--trace", b],
        &[b, ":2: expected 6 columns"],
    );
}

#[test]
fn compare_replays_an_rmm_log_through_every_allocator() {
    // 4 KiB live before the log began, then 1 MiB + 512 B; a failed 1 TiB request is not replayed.
    let log = [
        rmm::HEADER,
        "11,09:30:00.000001,allocate,0x7f3a00000000,1049088,0x0",
        "11,09:30:00.000002,allocate failure,0x0,1099511627776,0x0",
        "11,09:30:00.000003,free,0x7f3a00200000,4096,0x0",
        "11,09:30:00.000004,free,0x7f3a00000000,1049088,0x0",
    ]
    .join("\r\n");
    let path = file("run.csv", log);
    let results = json(&[
        "compare",
        "--trace",
        path.to_str().unwrap(),
        "--format",
        "json",
    ]);
    assert_eq!(results.len(), ALLOCATORS.len());
    for (result, allocator) in results.iter().zip(ALLOCATORS) {
        assert_eq!(result["workload"], "run.csv");
        assert_eq!(result["allocator"], *allocator);
        assert_eq!(result["events"], 4);
        assert_eq!(result["peak_live_bytes"], 4096 + 1_049_088);
        assert_eq!(result["ooms"], 0);
        assert!(result["peak_reserved_bytes"].as_u64().unwrap() >= 4096 + 1_049_088);
    }
}

#[test]
fn compare_replays_a_cuvmm_trace_after_the_workloads() {
    let trace = workload::generate("moe", 5).unwrap();
    let path = file("moe5.trace", text::to_string(&trace));
    let p = path.to_str().unwrap();
    let args = [
        "compare",
        "--workload",
        "moe",
        "--seed",
        "5",
        "--trace",
        p,
        "--format",
        "json",
    ];
    let results = json(&args);
    assert_eq!(results.len(), 2 * ALLOCATORS.len());
    let (generated, read) = results.split_at(ALLOCATORS.len());
    for (g, r) in generated.iter().zip(read) {
        assert_eq!(g["workload"], "moe");
        assert_eq!(r["workload"], "moe5.trace");
        assert_eq!(r["events"], trace.events.len());
        // The same requests: the same allocation figures.
        for key in [
            "allocator",
            "peak_live_bytes",
            "peak_allocated_bytes",
            "peak_reserved_bytes",
            "driver_calls",
            "ooms",
        ] {
            assert_eq!(g[key], r[key], "{key}");
        }
    }
}

#[test]
fn compare_replays_each_device_of_a_snapshot_or_the_one_asked_for() {
    let path = file("two.pickle", pickle(&snapshot(&[4096, 3 << 20])));
    let p = path.to_str().unwrap();
    let names = |results: &[serde_json::Value]| -> Vec<(String, u64)> {
        results
            .iter()
            .filter(|r| r["allocator"] == "cuvmm")
            .map(|r| {
                let name = r["workload"].as_str().unwrap().to_string();
                (name, r["peak_live_bytes"].as_u64().unwrap())
            })
            .collect()
    };
    let all = json(&["compare", "--trace", p, "--format", "json"]);
    assert_eq!(
        names(&all),
        [
            ("two.pickle".to_string(), 4096),
            ("two.pickle:1".to_string(), 3 << 20)
        ]
    );
    let one = json(&["compare", "--trace", p, "--device", "1", "--format", "json"]);
    assert_eq!(names(&one), [("two.pickle:1".to_string(), 3 << 20)]);
}

#[test]
fn compare_replays_a_shared_pytorch_snapshot() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../shared/traces/cs336_small_ctx256_bs32_fwdbwd.pickle");
    if !path.exists() {
        println!("skipped: {} is absent", path.display());
        return;
    }
    let loaded = cuvmm_lab::trace::load::load(&path, None).unwrap();
    assert_eq!(loaded.len(), 1);
    let results = json(&[
        "compare",
        "--trace",
        path.to_str().unwrap(),
        "--format",
        "json",
    ]);
    assert_eq!(results.len(), ALLOCATORS.len());
    for result in &results {
        assert_eq!(result["workload"], "cs336_small_ctx256_bs32_fwdbwd.pickle");
        assert_eq!(result["events"], loaded[0].events.len());
        assert_eq!(result["peak_live_bytes"], loaded[0].peak_live_bytes());
        assert_eq!(result["ooms"], 0);
        let utilization = result["utilization"].as_f64().unwrap();
        assert!(utilization > 0.5 && utilization <= 1.0, "{result}");
    }
}

#[test]
fn workload_output_reads_back_as_the_generated_trace() {
    let path = scratch().join("llm.trace");
    let p = path.to_str().unwrap();
    let out = cuvmm(&["workload", "llm-serving", "-o", p, "--seed", "9"]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    assert!(out.stdout.is_empty() && out.stderr.is_empty());
    let read = text::read(&path).unwrap();
    assert!(read == workload::generate("llm-serving", 9).unwrap());
    assert!(read != workload::generate("llm-serving", 10).unwrap());
    // `-o -` writes the same bytes to stdout.
    let out = cuvmm(&["workload", "llm-serving", "--seed", "9", "-o", "-"]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    assert!(out.stdout == std::fs::read(&path).unwrap());
}

#[test]
fn workload_converts_a_trace_file_to_cuvmms_format() {
    // A two-device snapshot: `--device` picks one, and the converted file reads back as what `load` gives.
    let path = file("convert-two.pickle", pickle(&snapshot(&[4096, 1 << 20])));
    let p = path.to_str().unwrap();
    for device in [0usize, 1] {
        let out_path = scratch().join(format!("convert-two-{device}.trace"));
        let o = out_path.to_str().unwrap();
        let d = device.to_string();
        let out = cuvmm(&["workload", "--trace", p, "--device", &d, "-o", o]);
        assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
        assert!(
            out.stdout.is_empty() && out.stderr.is_empty(),
            "{}",
            stderr(&out)
        );
        let loaded = cuvmm_lab::trace::load::load(&path, Some(device)).unwrap();
        assert!(text::read(&out_path).unwrap() == loaded[0]);
    }
    // Without `--device`: the first device with events, and a note naming the choice.
    let out = cuvmm(&["workload", "--trace", p, "-o", "-"]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("converting `convert-two.pickle`"),
        "{}",
        stderr(&out)
    );
    let first = std::fs::read(scratch().join("convert-two-0.trace")).unwrap();
    assert!(out.stdout == first);

    // A trace from the shared set, when it is there: the same events and the same replay as the snapshot.
    let shared = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../shared/traces/cs336_small_ctx256_bs32_fwdbwd.pickle");
    if !shared.exists() {
        println!(
            "skipped the shared snapshot: {} is absent",
            shared.display()
        );
        return;
    }
    let converted = scratch().join("convert-small.trace");
    let c = converted.to_str().unwrap();
    let out = cuvmm(&["workload", "--trace", shared.to_str().unwrap(), "-o", c]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let loaded = cuvmm_lab::trace::load::load(&shared, None).unwrap();
    let read = text::read(&converted).unwrap();
    assert!(read.events == loaded[0].events);
    assert_eq!(read.name, loaded[0].name);
    let replay = |trace: &str| -> Vec<(String, u64, u64)> {
        json(&["compare", "--trace", trace, "--format", "json"])
            .iter()
            .map(|r| {
                let n = |key: &str| r[key].as_u64().unwrap();
                (
                    r["allocator"].to_string(),
                    n("peak_reserved_bytes"),
                    n("ooms"),
                )
            })
            .collect()
    };
    assert_eq!(replay(c), replay(shared.to_str().unwrap()));
}

#[test]
fn workload_refuses_a_name_and_a_trace_together_and_a_stray_device() {
    let path = file("convert-one.pickle", pickle(&snapshot(&[4096])));
    let p = path.to_str().unwrap();
    let out_path = scratch().join("convert-refused.trace");
    let o = out_path.to_str().unwrap();
    refused(&["workload", "moe", "--trace", p, "-o", o], &["--trace"]);
    refused(
        &["workload", "moe", "--device", "0", "-o", o],
        &["--device"],
    );
    refused(&["workload", "-o", o], &["NAME"]);
    refused(&["workload", "--trace", p, "--device", "3", "-o", o], &[p]);
    let missing = scratch().join("absent.pickle");
    let m = missing.to_str().unwrap();
    refused(&["workload", "--trace", m, "-o", o], &[m]);
    assert!(!out_path.exists(), "a refused conversion wrote its output");
}
