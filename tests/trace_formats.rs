//! The trace file readers: RMM `logging_resource_adaptor` logs (`trace::rmm`), cuvmm's own format
//! (`trace::text`, with its writer) and the dispatch by format (`trace::load`).
//!
//! Properties checked: every trace a reader returns passes `Trace::validate`; `text::write` then
//! `text::parse` gives back exactly the trace written, for any valid trace, and for any other trace either
//! that or a typed error; every bad line is a typed error naming the file, the line and the problem.
#![cfg(feature = "lab")]

use cuvmm::StreamId;
use cuvmm::lab::trace::Event;
use cuvmm::lab::trace::Trace;
use cuvmm::lab::trace::TraceError;
use cuvmm::lab::trace::event::MAX_SIZE;
use cuvmm::lab::trace::load::{self, LoadError};
use cuvmm::lab::trace::rmm::{self, RmmError, RowProblem};
use cuvmm::lab::trace::text::{self, LineProblem, TextError};
use cuvmm::lab::workload;
use proptest::prelude::*;
use std::path::Path;

const LOG: &str = "run.csv";

/// A bad file, the line its error names, and a test of the problem reported.
type Case<P> = (String, usize, fn(&P) -> bool);

fn rmm_log(rows: &[&str]) -> String {
    let mut text = format!("{}\n", rmm::HEADER);
    for row in rows {
        text.push_str(row);
        text.push('\n');
    }
    text
}

fn read_rmm(text: &str) -> rmm::RmmLog {
    let log = rmm::parse(Path::new(LOG), text.as_bytes()).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(log.trace.validate(), Ok(()));
    log
}

fn alloc(id: u64, size: u64, stream: u64) -> Event {
    Event::Alloc {
        id,
        size,
        stream: StreamId(stream),
    }
}

#[test]
fn rmm_allocations_and_frees_pair_by_pointer() {
    let log = read_rmm(&rmm_log(&[
        "7,10:00:00.000001,allocate,0x7f0000000000,1048576,0x0",
        "7,10:00:00.000002,allocate,0x7f0000100000,512,0x5a",
        "7,10:00:00.000003,free,0x7f0000000000,1048576,0x0",
        // The pointer is reused once freed.
        "8,10:00:00.000004,allocate,0x7f0000000000,300,0x0",
        "8,10:00:00.000005,free,0x7f0000100000,512,0x5a",
    ]));
    assert_eq!(
        log.trace.events,
        vec![
            alloc(0, 1 << 20, 0),
            alloc(1, 512, 0x5a),
            Event::Free { id: 0 },
            alloc(2, 300, 0),
            Event::Free { id: 1 },
        ]
    );
    assert_eq!(log.trace.name, LOG);
    assert_eq!((log.allocate_failures, log.seeded, log.skipped), (0, 0, 0));
}

#[test]
fn rmm_both_pointer_styles_read_the_same() {
    // fmt (`fmt::ptr`) builds write 0x-prefixed hexadecimal; printf (`%llx`) builds write bare hexadecimal.
    let fmt = rmm_log(&[
        "1,10:00:00.000001,allocate,0x7f00aa000000,4096,0x0",
        "1,10:00:00.000002,allocate,0x7f00aa001000,8192,0x7f00bb00",
        "1,10:00:00.000003,allocate failure,0x0,99999999999,0x0",
        "1,10:00:00.000004,free,0x7f00aa000000,4096,0x0",
    ]);
    let printf = rmm_log(&[
        "1,10:00:00.000001,allocate,7f00aa000000,4096,0",
        "1,10:00:00.000002,allocate,7F00AA001000,8192,7f00bb00",
        "1,10:00:00.000003,allocate failure,0,99999999999,0",
        "1,10:00:00.000004,free,7f00aa000000,4096,0",
    ]);
    let (a, b) = (read_rmm(&fmt), read_rmm(&printf));
    assert_eq!(a, b);
    assert_eq!(a.trace.events[1], alloc(1, 8192, 0x7f00_bb00));
    assert_eq!(a.allocate_failures, 1);
    assert_eq!(a.trace.alloc_count(), 2);
}

#[test]
fn rmm_memory_live_before_the_log_is_seeded_first_in_address_order() {
    let log = read_rmm(&rmm_log(&[
        "1,t,allocate,0x1000,100,0x0",
        "1,t,free,0x9000,7000,0x3",
        "1,t,free,0x5000,2000,0x0",
        "1,t,free,0x1000,100,0x0",
        // Freed before the log began, then allocated again.
        "1,t,allocate,0x9000,64,0x0",
    ]));
    assert_eq!(log.seeded, 2);
    let (ids, body) = log.trace.events.split_at(2);
    // 0x5000 sorts before 0x9000: its free is the third row, the seed ids are the order of discovery.
    assert_eq!(ids, [alloc(2, 2000, 0), alloc(1, 7000, 3)]);
    assert_eq!(
        body,
        [
            alloc(0, 100, 0),
            Event::Free { id: 1 },
            Event::Free { id: 2 },
            Event::Free { id: 0 },
            alloc(3, 64, 0)
        ]
    );
    assert_eq!(log.trace.peak_live_bytes(), 9100);
}

#[test]
fn rmm_rows_that_request_nothing_are_skipped_and_counted() {
    let log = read_rmm(&rmm_log(&[
        "1,t,allocate,0x0,0,0x0",
        "1,t,free,0x0,0,0x0",
        "1,t,allocate,0x2000,0,0x0",
        "1,t,free,0x2000,0,0x0",
        "1,t,free,0x0,4096,0x0",
        "1,t,allocate,0x2000,10,0x0",
    ]));
    assert_eq!(log.skipped, 5);
    assert_eq!(log.trace.events, vec![alloc(0, 10, 0)]);
}

#[test]
fn rmm_crlf_bom_blank_lines_and_a_missing_final_newline_are_tolerated() {
    let plain = rmm_log(&["1,t,allocate,0x100,8,0x0", "1,t,free,0x100,8,0x0"]);
    let windows = format!(
        "\u{feff}{}\r\n\r\n1,t,allocate,0x100,8,0x0\r\n1,t,free,0x100,8,0x0",
        rmm::HEADER
    );
    assert_eq!(read_rmm(&plain), read_rmm(&windows));
}

/// The first bad line of `text` as an RMM log: (line, problem), checking that the message names both.
fn rmm_error(text: &str) -> (usize, RowProblem) {
    match rmm::parse(Path::new(LOG), text.as_bytes()) {
        Err(e @ RmmError::Line { .. }) => {
            let message = e.to_string();
            let RmmError::Line { line, problem, .. } = e else {
                unreachable!()
            };
            assert!(message.starts_with(&format!("{LOG}:{line}: ")), "{message}");
            assert!(!message.contains('\n'), "{message}");
            (line, problem)
        }
        other => panic!("{text:?} gave {other:?}"),
    }
}

#[test]
fn rmm_each_bad_line_is_a_typed_error_naming_its_line() {
    let ok = "1,t,allocate,0x100,8,0x0";
    let cases: Vec<Case<RowProblem>> = vec![
        (String::new(), 1, |p| matches!(p, RowProblem::Header { .. })),
        (
            "Thread,Time,Action\n".into(),
            1,
            |p| matches!(p, RowProblem::Header { found } if found == "Thread,Time,Action"),
        ),
        (rmm_log(&[ok, "1,t,allocate,0x200,8"]), 3, |p| {
            *p == RowProblem::Columns { found: 5 }
        }),
        (rmm_log(&["1,t,allocate,0x200,8,0,extra"]), 2, |p| {
            *p == RowProblem::Columns { found: 7 }
        }),
        (
            rmm_log(&["1,t,alloc,0x200,8,0"]),
            2,
            |p| matches!(p, RowProblem::UnknownAction { action } if action == "alloc"),
        ),
        (rmm_log(&["x,t,allocate,0x200,8,0"]), 2, |p| {
            matches!(
                p,
                RowProblem::BadNumber {
                    column: "Thread",
                    ..
                }
            )
        }),
        (rmm_log(&["1,t,allocate,0xzz,8,0"]), 2, |p| {
            matches!(
                p,
                RowProblem::BadNumber {
                    column: "Pointer",
                    ..
                }
            )
        }),
        (rmm_log(&["1,t,allocate,0x,8,0"]), 2, |p| {
            matches!(
                p,
                RowProblem::BadNumber {
                    column: "Pointer",
                    ..
                }
            )
        }),
        (rmm_log(&["1,t,allocate,0x11112222333344445,8,0"]), 2, |p| {
            matches!(
                p,
                RowProblem::BadNumber {
                    column: "Pointer",
                    ..
                }
            )
        }),
        (rmm_log(&["1,t,allocate,0x200,8,stream"]), 2, |p| {
            matches!(
                p,
                RowProblem::BadNumber {
                    column: "Stream",
                    ..
                }
            )
        }),
        (rmm_log(&["1,t,allocate,0x200,8.5,0"]), 2, |p| {
            matches!(p, RowProblem::BadNumber { column: "Size", .. })
        }),
        (rmm_log(&["1,t,allocate,0x200,+8,0"]), 2, |p| {
            matches!(p, RowProblem::BadNumber { column: "Size", .. })
        }),
        (
            rmm_log(&[ok, "1,t,allocate,0x200,-4096,0"]),
            3,
            |p| matches!(p, RowProblem::NegativeSize { text } if text == "-4096"),
        ),
        (rmm_log(&["1,t,free,0x200,-1,0"]), 2, |p| {
            matches!(p, RowProblem::NegativeSize { .. })
        }),
        (
            rmm_log(&["1,t,allocate,0x200,1125899906842625,0"]),
            2,
            |p| *p == RowProblem::AbsurdSize { size: MAX_SIZE + 1 },
        ),
        (
            rmm_log(&["1,t,allocate,0x200,99999999999999999999,0"]),
            2,
            |p| matches!(p, RowProblem::BadNumber { column: "Size", .. }),
        ),
        (rmm_log(&["1,t,allocate,0x0,8,0"]), 2, |p| {
            *p == RowProblem::NullAllocate { size: 8 }
        }),
        (rmm_log(&[ok, ok]), 3, |p| {
            *p == RowProblem::AllocateLive {
                ptr: 0x100,
                since: 2,
            }
        }),
        (
            rmm_log(&[ok, "1,t,free,0x100,8,0x0", "1,t,free,0x100,8,0x0"]),
            4,
            |p| {
                *p == RowProblem::DoubleFree {
                    ptr: 0x100,
                    freed: 3,
                }
            },
        ),
    ];
    for (text, line, expected) in cases {
        let (found_line, problem) = rmm_error(&text);
        assert_eq!(found_line, line, "{text:?}: {problem}");
        assert!(expected(&problem), "{text:?}: {problem:?}");
    }
    // A long field is cut short in the message.
    let long = "y".repeat(10_000);
    let (_, problem) = rmm_error(&rmm_log(&[&format!("1,t,{long},0x1,1,0")]));
    assert!(problem.to_string().len() < 120, "{problem}");
}

#[test]
fn text_format_reads_what_the_docs_show() {
    let file = "\u{feff}# cuvmm-trace v1\r\n# a comment\r\nname moe \\\\ and\\nmore\r\n\r\n  alloc 7 4096 0\r\nalloc 8 1048576 3\nrecord_stream 8 0\nfree 7\n empty_cache \n# done";
    let trace = text::parse(Path::new("x.trace"), file.as_bytes()).unwrap();
    assert_eq!(trace.name, "moe \\ and\nmore");
    assert_eq!(
        trace.events,
        vec![
            alloc(7, 4096, 0),
            alloc(8, 1 << 20, 3),
            Event::RecordStream {
                id: 8,
                stream: StreamId(0)
            },
            Event::Free { id: 7 },
            Event::EmptyCache,
        ]
    );
    // No name line: the trace is named after the file.
    let unnamed = text::parse(
        Path::new("dir/run.trace"),
        b"# cuvmm-trace v1\nalloc 1 2 3\n",
    );
    assert_eq!(unnamed.unwrap().name, "run.trace");
    // The writer's output, byte for byte.
    let written = text::to_string(&trace);
    assert_eq!(
        written,
        "# cuvmm-trace v1\nname moe \\\\ and\\nmore\nalloc 7 4096 0\nalloc 8 1048576 3\nrecord_stream 8 0\nfree 7\nempty_cache\n"
    );
}

/// The first bad line of `file` as a cuvmm trace: (line, problem), checking that the message names both.
fn text_error(file: &str) -> (usize, LineProblem) {
    match text::parse(Path::new("t.trace"), file.as_bytes()) {
        Err(e @ TextError::Line { .. }) => {
            let message = e.to_string();
            let TextError::Line { line, problem, .. } = e else {
                unreachable!()
            };
            assert!(
                message.starts_with(&format!("t.trace:{line}: ")),
                "{message}"
            );
            assert!(!message.contains('\n'), "{message}");
            (line, problem)
        }
        other => panic!("{file:?} gave {other:?}"),
    }
}

#[test]
fn text_each_bad_line_is_a_typed_error_naming_its_line() {
    let h = "# cuvmm-trace v1\n";
    let cases: Vec<Case<LineProblem>> = vec![
        (String::new(), 1, |p| {
            matches!(p, LineProblem::Header { .. })
        }),
        (
            "alloc 1 2 3\n".into(),
            1,
            |p| matches!(p, LineProblem::Header { found } if found == "alloc 1 2 3"),
        ),
        (
            "# cuvmm-trace v2\n".into(),
            1,
            |p| matches!(p, LineProblem::Version { version } if version == "v2"),
        ),
        (
            format!("{h}alloc 1 2 3\nmalloc 4 5\n"),
            3,
            |p| matches!(p, LineProblem::UnknownRecord { word } if word == "malloc"),
        ),
        (format!("{h}alloc 1 2\n"), 2, |p| {
            *p == LineProblem::Fields {
                record: "alloc",
                expected: 3,
                found: 2,
            }
        }),
        (format!("{h}alloc 1 2 3\nfree 1 1\n"), 3, |p| {
            matches!(p, LineProblem::Fields { record: "free", .. })
        }),
        (format!("{h}empty_cache 0\n"), 2, |p| {
            *p == LineProblem::Fields {
                record: "empty_cache",
                expected: 0,
                found: 1,
            }
        }),
        (
            format!("{h}alloc 1 -2 3\n"),
            2,
            |p| matches!(p, LineProblem::BadNumber { field: "size", text } if text == "-2"),
        ),
        (format!("{h}alloc x 2 3\n"), 2, |p| {
            matches!(p, LineProblem::BadNumber { field: "id", .. })
        }),
        (format!("{h}alloc 1 2 18446744073709551616\n"), 2, |p| {
            matches!(
                p,
                LineProblem::BadNumber {
                    field: "stream",
                    ..
                }
            )
        }),
        (format!("{h}alloc 1 1125899906842625 0\n"), 2, |p| {
            *p == LineProblem::AbsurdSize { size: MAX_SIZE + 1 }
        }),
        (format!("{h}alloc 1 0 0\n"), 2, |p| {
            matches!(p, LineProblem::Invalid(TraceError::ZeroSize { .. }))
        }),
        (format!("{h}alloc 1 8 0\n\n# c\nfree 2\n"), 5, |p| {
            matches!(
                p,
                LineProblem::Invalid(TraceError::UnknownFree { id: 2, .. })
            )
        }),
        (format!("{h}alloc 1 8 0\nalloc 1 8 0\n"), 3, |p| {
            matches!(
                p,
                LineProblem::Invalid(TraceError::DuplicateId { id: 1, .. })
            )
        }),
        (format!("{h}alloc 1 8 0\nfree 1\nfree 1\n"), 4, |p| {
            matches!(
                p,
                LineProblem::Invalid(TraceError::DoubleFree { id: 1, .. })
            )
        }),
        (format!("{h}record_stream 1 2\n"), 2, |p| {
            matches!(
                p,
                LineProblem::Invalid(TraceError::RecordStreamNotLive { .. })
            )
        }),
        (format!("{h}name a\\tb\n"), 2, |p| {
            *p == LineProblem::BadEscape
        }),
        (format!("{h}name a\\\n"), 2, |p| {
            *p == LineProblem::BadEscape
        }),
        (format!("{h}name a\nname b\n"), 3, |p| {
            *p == LineProblem::MisplacedName
        }),
        (format!("{h}alloc 1 2 3\nname b\n"), 3, |p| {
            *p == LineProblem::MisplacedName
        }),
    ];
    for (file, line, expected) in cases {
        let (found_line, problem) = text_error(&file);
        assert_eq!(found_line, line, "{file:?}: {problem}");
        assert!(expected(&problem), "{file:?}: {problem:?}");
    }
    let not_utf8 = text::parse(Path::new("t.trace"), b"# cuvmm-trace v1\nname \xff\n");
    assert!(
        matches!(
            not_utf8,
            Err(TextError::Line {
                line: 2,
                problem: LineProblem::NotUtf8,
                ..
            })
        ),
        "{not_utf8:?}"
    );
}

#[test]
fn every_builtin_workload_round_trips_through_the_text_format() {
    for name in workload::BUILTIN {
        let trace = workload::generate(name, 3).unwrap();
        let read = text::parse(Path::new("w.trace"), text::to_string(&trace).as_bytes()).unwrap();
        assert!(read == trace, "{name} changed on the way");
    }
}

/// Valid traces: allocations under arbitrary ids (unique among live ones), frees and record_streams of
/// live allocations, cache releases, any name.
fn valid_trace() -> impl Strategy<Value = Trace> {
    let name = prop_oneof![any::<String>(), "[a-z\\\\\n\r \t#]{0,12}"];
    let ops = prop::collection::vec((0u8..5, any::<u64>(), 1..=MAX_SIZE, any::<u64>()), 0..60);
    (name, ops).prop_map(|(name, ops)| {
        let mut live: Vec<u64> = Vec::new();
        let mut events = Vec::new();
        for (kind, a, size, stream) in ops {
            match kind {
                0 | 1 if !live.contains(&a) => {
                    live.push(a);
                    events.push(alloc(a, size, stream));
                }
                2 if !live.is_empty() => {
                    let id = live.swap_remove((a % live.len() as u64) as usize);
                    events.push(Event::Free { id });
                }
                3 if !live.is_empty() => {
                    let id = live[(a % live.len() as u64) as usize];
                    events.push(Event::RecordStream {
                        id,
                        stream: StreamId(stream),
                    });
                }
                4 => events.push(Event::EmptyCache),
                _ => {}
            }
        }
        Trace { name, events }
    })
}

/// Any events at all, over few ids so that frees and reuses of live ids are common.
fn any_trace() -> impl Strategy<Value = Trace> {
    let event = prop_oneof![
        (
            0u64..6,
            prop_oneof![Just(0), 1..=MAX_SIZE, any::<u64>()],
            any::<u64>()
        )
            .prop_map(|(id, size, s)| alloc(id, size, s)),
        (0u64..6).prop_map(|id| Event::Free { id }),
        (0u64..6, any::<u64>()).prop_map(|(id, s)| Event::RecordStream {
            id,
            stream: StreamId(s)
        }),
        Just(Event::EmptyCache),
    ];
    (any::<String>(), prop::collection::vec(event, 0..30))
        .prop_map(|(name, events)| Trace { name, events })
}

proptest! {
    /// write then parse gives back exactly the trace written.
    #[test]
    fn text_write_then_read_round_trips(trace in valid_trace()) {
        prop_assert_eq!(trace.validate(), Ok(()));
        let read = text::parse(Path::new("p.trace"), text::to_string(&trace).as_bytes());
        prop_assert_eq!(read.map_err(|e| e.to_string()), Ok(trace));
    }

    /// For any trace, parse gives back the trace written or refuses it as invalid, never another trace.
    #[test]
    fn text_read_refuses_what_it_cannot_give_back(trace in any_trace()) {
        match text::parse(Path::new("p.trace"), text::to_string(&trace).as_bytes()) {
            Ok(read) => prop_assert_eq!(read, trace),
            Err(TextError::Line { problem: LineProblem::Invalid(e), .. }) => {
                prop_assert_eq!(trace.validate(), Err(e));
            }
            Err(TextError::Line { problem: LineProblem::AbsurdSize { size }, .. }) => {
                prop_assert!(size > MAX_SIZE);
            }
            Err(other) => prop_assert!(false, "{}", other),
        }
    }
}

#[test]
fn load_reads_each_format_and_names_the_trace_after_the_file() {
    let dir = std::env::temp_dir().join(format!("cuvmm-formats-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let csv = dir.join("log.csv");
    std::fs::write(&csv, rmm_log(&["1,t,allocate,0x100,8,0x0"])).unwrap();
    let own = dir.join("own.trace");
    let mut trace = Trace::new("inner name");
    trace.events.push(alloc(4, 16, 2));
    std::fs::write(&own, text::to_string(&trace)).unwrap();

    for (path, events) in [(&csv, vec![alloc(0, 8, 0)]), (&own, trace.events.clone())] {
        for device in [None, Some(0)] {
            let traces = load::load(path, device).unwrap();
            let name = path.file_name().unwrap().to_str().unwrap();
            assert_eq!(
                traces,
                vec![Trace {
                    name: name.into(),
                    events: events.clone()
                }]
            );
        }
        let err = load::load(path, Some(7)).unwrap_err();
        assert!(
            matches!(err, LoadError::NoSuchDevice { device: 7, .. }),
            "{err}"
        );
        assert!(err.to_string().contains(path.to_str().unwrap()), "{err}");
    }
    // Errors of each reader come through, naming the file.
    std::fs::write(&csv, rmm_log(&["1,t,allocate,0x100,-8,0x0"])).unwrap();
    let err = load::load(&csv, None).unwrap_err();
    assert!(matches!(err, LoadError::Rmm(_)), "{err}");
    assert!(
        err.to_string()
            .contains(&format!("{}:2: negative size", csv.display())),
        "{err}"
    );
    std::fs::write(&own, "# cuvmm-trace v1\nfree 3\n").unwrap();
    let err = load::load(&own, None).unwrap_err();
    assert!(matches!(err, LoadError::Text(_)), "{err}");
    let empty = dir.join("empty.csv");
    std::fs::write(&empty, "").unwrap();
    assert!(matches!(
        load::load(&empty, None),
        Err(LoadError::Empty { .. })
    ));
}

/// Pickles whose decoding would exhaust memory, time or the stack: each is refused by the pass before
/// serde-pickle (`trace/pytorch/guard.rs`), with the file named and the opcode's offset.
#[test]
fn snapshot_pickles_that_would_exhaust_the_decoder_are_refused() {
    use cuvmm::lab::trace::pytorch::{self, SnapshotError};
    let nested = |levels: usize| {
        let mut b = b"\x80\x02".to_vec();
        b.extend(std::iter::repeat_n(*b"](", levels).flatten());
        b.extend(std::iter::repeat_n(b'e', levels));
        b.push(b'.');
        b
    };
    // A 100,000-element list, memoized, then referenced 300 times: 3e7 nodes walked for 100 kB.
    let mut shared = b"\x80\x02](".to_vec();
    shared.extend(std::iter::repeat_n(b'N', 100_000));
    shared.extend(b"eq\x01]q\x02(");
    shared.extend(std::iter::repeat_n(*b"h\x01", 300).flatten());
    shared.extend(b"e.");
    let cases: Vec<(&str, Vec<u8>, &str)> = vec![
        // An 84-byte list that doubles forty times: out of memory before the guard.
        (
            "dup.pickle",
            [&b"\x80\x02]"[..], &b"2a".repeat(40), b"."].concat(),
            "DUP",
        ),
        (
            "deep.pickle",
            nested(1000),
            "nesting deeper than 100 levels",
        ),
        // Deep enough to overflow the stack in the decoder's walk or drop.
        (
            "deeper.pickle",
            nested(1_000_000),
            "nesting deeper than 100 levels",
        ),
        (
            "global.pickle",
            b"\x80\x02c__builtin__\nlist\n)R.".to_vec(),
            "object construction",
        ),
        (
            "memo_copy.pickle",
            b"\x80\x02]q\x01h\x01q\x02.".to_vec(),
            "stored again",
        ),
        (
            "memo_twice.pickle",
            b"\x80\x02]q\x01]q\x01.".to_vec(),
            "set twice",
        ),
        // A list that contains itself: changed after it was referenced.
        (
            "recursive.pickle",
            b"\x80\x02]q\x00h\x00a.".to_vec(),
            "changed after",
        ),
        (
            "shared.pickle",
            shared,
            "walked more than 64 times per byte",
        ),
    ];
    for (name, bytes, what) in cases {
        let err = pytorch::parse_devices(Path::new(name), &bytes, None).unwrap_err();
        assert!(
            matches!(err, SnapshotError::Refused { .. }),
            "{name}: {err}"
        );
        let message = err.to_string();
        assert!(
            message.starts_with(name) && message.contains(what),
            "{message}"
        );
    }
    // What is left: a shallow pickle that shares values a few times decodes (and is not a snapshot).
    let ok = b"\x80\x02](Neq\x01](h\x01h\x01e.";
    let err = pytorch::parse_devices(Path::new("ok.pickle"), ok, None).unwrap_err();
    assert!(matches!(err, SnapshotError::Decode { .. }), "{err}");
}

/// The real snapshots in `../shared/traces` are far inside the pickle guard's limits: they nest 7 levels,
/// and decoding walks at most 2.8 value nodes per byte (`-- --nocapture` prints each).
#[test]
fn shared_snapshots_are_far_inside_the_pickle_guard() {
    use cuvmm::lab::trace::pytorch::guard::{self, MAX_DEPTH};
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../shared/traces");
    let Ok(entries) = std::fs::read_dir(&dir) else {
        println!("skipped: {} is absent", dir.display());
        return;
    };
    let mut files: Vec<_> = entries
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "pickle"))
        .collect();
    files.sort();
    for path in files {
        let bytes = std::fs::read(&path).unwrap();
        let cost = guard::check(&bytes).unwrap_or_else(|r| panic!("{}: {r:?}", path.display()));
        let per_byte = cost.walked as f64 / bytes.len() as f64;
        println!(
            "{}: depth {}, {} nodes walked, {per_byte:.2} per byte",
            path.file_name().unwrap().to_string_lossy(),
            cost.depth,
            cost.walked
        );
        assert!(cost.complete);
        assert!(cost.depth <= MAX_DEPTH / 10, "{cost:?}");
        assert!(per_byte < 4.0, "{cost:?}");
    }
}
