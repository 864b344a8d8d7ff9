use super::*;

#[test]
fn sizes_are_formatted_as_pytorch_formats_them() {
    assert_eq!(format_size_pytorch(0), "0 bytes");
    assert_eq!(format_size_pytorch(1024), "1024 bytes");
    assert_eq!(format_size_pytorch(1025), "1.00 KiB");
    assert_eq!(format_size_pytorch(MIB), "1024.00 KiB");
    assert_eq!(format_size_pytorch(MIB + MIB / 2), "1.50 MiB");
    assert_eq!(format_size_pytorch(GIB), "1024.00 MiB");
    assert_eq!(format_size_pytorch(80 * GIB), "80.00 GiB");
}

fn oom(allocator: &'static str) -> OutOfMemory {
    OutOfMemory {
        allocator,
        device: 1,
        requested: 30 * MIB,
        alloc_size: 30 * MIB,
        device_total: GIB,
        device_free: 0,
        allocated: 900 * MIB,
        reserved: GIB,
        idle: 124 * MIB,
        largest_free_block: 20 * MIB,
        retried: true,
        graph_pool_bytes: 0,
        capturing: false,
        asleep: Vec::new(),
        reclaim: vec![
            ReclaimStep::ReleaseCache { bytes: 4 * MIB },
            ReclaimStep::Retry,
        ],
        ..OutOfMemory::default()
    }
}

#[test]
fn the_message_starts_with_pytorchs_sentence_then_diagnoses() {
    let text = oom("classic").to_string();
    assert!(
        text.starts_with(
            "CUDA out of memory. Tried to allocate 30.00 MiB. GPU 1 has a total capacity of 1024.00 MiB of \
             which 0 bytes is free. Of the allocated memory 900.00 MiB is allocated by classic, and \
             124.00 MiB is reserved by classic but unallocated"
        ),
        "{text}"
    );
    assert!(text.contains("largest free block 20.00 MiB"), "{text}");
    assert!(
        text.contains("released 4.00 MiB of cache and retried the device allocation"),
        "{text}"
    );
    assert!(text.contains("expandable_segments:True"), "{text}");
    assert_eq!(text.matches("Tried to allocate").count(), 1);
}

#[test]
fn fragmentation_is_named_when_free_plus_unallocated_would_fit() {
    // 124 MiB reserved but unallocated, 30 MiB asked: the bytes are there, not in one piece.
    match oom("cuvmm").suggestion() {
        Suggestion::Fragmentation {
            unallocated,
            remedy,
        } => {
            assert_eq!(unallocated, 124 * MIB);
            assert!(remedy.contains("page_size_mb"), "{remedy}");
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn a_full_device_asks_for_exactly_the_missing_bytes() {
    let full = OutOfMemory {
        allocated: GIB - 10 * MIB,
        ..oom("cuvmm")
    };
    // 10 MiB unallocated, nothing free, 30 MiB asked: 20 MiB are missing.
    assert_eq!(
        full.suggestion(),
        Suggestion::ReduceUsage { need: 20 * MIB }
    );
    assert!(
        full.to_string().contains("free at least 20.00 MiB more"),
        "{full}"
    );
    // The same shortfall with 100 MiB held by another process points there instead.
    let shared = OutOfMemory {
        device_total: GIB + 100 * MIB,
        ..full
    };
    assert_eq!(
        shared.suggestion(),
        Suggestion::OtherUsers {
            outside: 100 * MIB,
            need: 20 * MIB
        }
    );
}

#[test]
fn a_memory_fraction_is_reported_as_pytorch_does() {
    let limited = OutOfMemory {
        device_total: 2 * GIB,
        device_free: GIB,
        allowed: Some(GIB),
        reclaim: Vec::new(),
        ..oom("classic")
    };
    let text = limited.to_string();
    assert!(
        text.contains("of which 1024.00 MiB is free. 1024.00 MiB allowed; Of the allocated"),
        "{text}"
    );
    assert!(text.contains("Nothing could be reclaimed."), "{text}");
    assert_eq!(
        limited.suggestion(),
        Suggestion::RaiseLimit {
            allowed: GIB,
            need: 30 * MIB
        }
    );
}

#[test]
fn a_device_margin_that_refused_the_request_is_named_with_what_to_lower() {
    // 40 MiB free, 30 MiB asked for, 16 MiB to keep free: the margin, not the device, refused it.
    let kept = OutOfMemory {
        device_free: 40 * MIB,
        margin: 16 * MIB,
        ..oom("cuvmm")
    };
    let text = kept.to_string();
    assert!(
        text.contains("of which 40.00 MiB is free. 16.00 MiB kept free (device margin); "),
        "{text}"
    );
    assert_eq!(
        kept.suggestion(),
        Suggestion::LowerMargin {
            margin: 16 * MIB,
            need: 6 * MIB
        }
    );
    let remedy =
        "lower device_margin_mb (torch_memory_saver's memory_margin_bytes) by at least 6.00 MiB.";
    assert!(text.ends_with(remedy), "{text}");
    // A device too full for the request even without the margin is not the margin's doing.
    let full = OutOfMemory {
        device_free: 20 * MIB,
        ..kept
    };
    assert!(!matches!(full.suggestion(), Suggestion::LowerMargin { .. }));
}

#[test]
fn a_stranded_remedy_sets_what_its_name_says() {
    for (remedy, conf) in [
        (StrandedRemedy::Split, "compaction:split"),
        (
            StrandedRemedy::SinglePages { page_size: 2 * MIB },
            "large_handle_mb:2",
        ),
    ] {
        assert_eq!(remedy.to_string(), conf);
        let mut applied = Config::default();
        remedy.apply_to(&mut applied);
        assert_ne!(applied, Config::default(), "{conf} changed nothing");
        assert_eq!(applied, Config::from_alloc_conf(conf).unwrap(), "{conf}");
    }
}
