//! Loading any file: the format told by its first bytes, and snapshot pickles refused before they exhaust the
//! decoder.

use super::*;

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
    use cuvmm_lab::trace::pytorch::{self, SnapshotError};
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
    let ok = b"\x80\x02}(X\x08\x00\x00\x00segments](Neq\x01X\x01\x00\x00\x00b](h\x01h\x01eu.";
    let err = pytorch::parse_devices(Path::new("ok.pickle"), ok, None).unwrap_err();
    assert!(matches!(err, SnapshotError::Decode { .. }), "{err}");
}

/// The real snapshots in `../shared/traces` are far inside the pickle guard's limits: they nest 7 levels,
/// and decoding walks at most 2.8 value nodes per byte (`-- --nocapture` prints each).
#[test]
fn shared_snapshots_are_far_inside_the_pickle_guard() {
    use cuvmm_lab::trace::pytorch::guard::{self, MAX_DEPTH};
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../shared/traces");
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
