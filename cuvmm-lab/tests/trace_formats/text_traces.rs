//! cuvmm's text format: what the docs show, each bad line a typed error, and every trace round-tripping.

use super::*;

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
