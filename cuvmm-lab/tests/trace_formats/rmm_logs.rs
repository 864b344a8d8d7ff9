//! RMM logs: allocations and frees paired by pointer, and each bad line a typed error naming it.

use super::*;

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
