use super::*;
use crate::base::size::{GIB, KIB};
use proptest::prelude::*;

fn parse(s: &str) -> Config {
    Config::from_alloc_conf(s).unwrap_or_else(|e| panic!("{s:?}: {e}"))
}

/// The key a rejected string is blamed on, and asserts the error is a `BadValue`.
fn bad_key(s: &str) -> String {
    match Config::from_alloc_conf(s) {
        Err(ConfigError::BadValue { key, .. }) => key,
        other => panic!("{s:?}: expected BadValue, got {other:?}"),
    }
}

fn intervals(v: &[(usize, u64)]) -> RoundupDivisions {
    let mut out = vec![0; RoundupDivisions::INTERVALS];
    for &(i, d) in v {
        out[i] = d;
    }
    RoundupDivisions::PerInterval(out)
}

#[test]
fn empty_and_blank_strings_give_the_defaults() {
    assert_eq!(parse(""), Config::default());
    assert_eq!(parse("  \t "), Config::default());
    assert_eq!(
        Config::from_env_value(Err(std::env::VarError::NotPresent)),
        Ok(Config::default())
    );
    assert_eq!(
        Config::from_env_value(Ok("va_factor:3".into())),
        Ok(Config::default().with_va_factor(3))
    );
    assert_eq!(Config::default().validate(), Ok(()));
}

#[test]
fn max_split_size_mb_is_stored_in_bytes_and_at_least_20() {
    assert_eq!(parse("max_split_size_mb:20").max_split_size, Some(20 * MIB));
    assert_eq!(
        parse("max_split_size_mb:512").max_split_size,
        Some(512 * MIB)
    );
    // PyTorch caps huge values at SIZE_MAX / kMB MiB instead of overflowing.
    let huge = parse(&format!("max_split_size_mb:{}", u64::MAX)).max_split_size;
    assert_eq!(huge, Some(u64::MAX / MIB * MIB));
    for value in [
        "19",
        "0",
        "-1",
        "",
        "2.5",
        "abc",
        "1e3",
        "99999999999999999999999",
    ] {
        assert_eq!(
            bad_key(&format!("max_split_size_mb:{value}")),
            "max_split_size_mb"
        );
    }
}

#[test]
fn max_non_split_rounding_mb_is_stored_in_bytes_and_at_least_20() {
    assert_eq!(
        parse("max_non_split_rounding_mb:64").max_non_split_rounding,
        64 * MIB
    );
    assert_eq!(
        bad_key("max_non_split_rounding_mb:10"),
        "max_non_split_rounding_mb"
    );
}

#[test]
fn garbage_collection_threshold_is_a_fraction() {
    assert_eq!(
        parse("garbage_collection_threshold:0.6").garbage_collection_threshold,
        Some(0.6)
    );
    assert_eq!(
        parse("garbage_collection_threshold:5e-1").garbage_collection_threshold,
        Some(0.5)
    );
    for value in ["0", "1", "1.5", "-0.5", "NaN", "inf", "x", ""] {
        let s = format!("garbage_collection_threshold:{value}");
        assert_eq!(bad_key(&s), "garbage_collection_threshold", "{s}");
    }
}

#[test]
fn roundup_single_value_must_be_a_power_of_two() {
    assert_eq!(
        parse("roundup_power2_divisions:4").roundup_power2_divisions,
        RoundupDivisions::Uniform(4)
    );
    assert_eq!(
        parse("roundup_power2_divisions:1").roundup_power2_divisions,
        RoundupDivisions::Uniform(1)
    );
    for value in ["0", "3", "6", "-4", "[", "]", "[[1:1]]", "[1:1"] {
        assert_eq!(
            bad_key(&format!("roundup_power2_divisions:{value}")),
            "roundup_power2_divisions"
        );
    }
}

#[test]
fn roundup_list_follows_pytorch_documented_example() {
    // PyTorch's docs: roundup_power2_divisions:[256:1,512:2,1024:4,>:8]. The first entry also fills every
    // interval below it; `>` fills every interval above the last one set.
    let got = parse("roundup_power2_divisions:[256:1,512:2,1024:4,>:8]").roundup_power2_divisions;
    let mut want: Vec<(usize, u64)> = (0..=8).map(|i| (i, 1)).collect();
    want.extend([(9, 2), (10, 4)]);
    want.extend((11..16).map(|i| (i, 8)));
    assert_eq!(got, intervals(&want));
}

#[test]
fn roundup_list_leaves_gaps_between_entries_as_pytorch_does() {
    // The example in PyTorch's AllocatorConfig.h: intervals 7 and 9 lie between entries and keep 0.
    let got = parse("roundup_power2_divisions:[64:8,256:4,1024:4,>:1]").roundup_power2_divisions;
    let mut want: Vec<(usize, u64)> = (0..=6).map(|i| (i, 8)).collect();
    want.extend([(8, 4), (10, 4)]);
    want.extend((11..16).map(|i| (i, 1)));
    assert_eq!(got, intervals(&want));
}

#[test]
fn roundup_list_edge_cases() {
    let rd = |s: &str| parse(&format!("roundup_power2_divisions:{s}")).roundup_power2_divisions;
    // `>` alone fills from interval 1 (PyTorch's last_index starts at 0).
    assert_eq!(
        rd("[>:2]"),
        intervals(&(1..16).map(|i| (i, 2)).collect::<Vec<_>>())
    );
    // Bounds past 32 GiB clamp to the last interval; 0 disables rounding; whitespace and a trailing comma.
    assert_eq!(rd("[ 1 : 2 , 65536 : 0 ,]"), intervals(&[(0, 2)]));
    assert_eq!(
        rd("[1048576:4]"),
        intervals(&(0..16).map(|i| (i, 4)).collect::<Vec<_>>())
    );
    assert_eq!(rd("[]"), RoundupDivisions::PerInterval(vec![0; 16]));
    for value in [
        "[3:1]",
        "[0:1]",
        "[256:3]",
        "[256]",
        "[256:]",
        "[:4]",
        "[256:1,,512:2]",
        "[x:1]",
    ] {
        assert_eq!(
            bad_key(&format!("roundup_power2_divisions:{value}")),
            "roundup_power2_divisions"
        );
    }
}

#[test]
fn repeated_keys_take_the_last_value() {
    let c = parse("max_split_size_mb:100,expandable_segments:True,max_split_size_mb:200");
    assert_eq!(c.max_split_size, Some(200 * MIB));
    assert!(c.expandable_segments);
    assert_eq!(
        parse("roundup_power2_divisions:[>:2],roundup_power2_divisions:4").roundup_power2_divisions,
        RoundupDivisions::Uniform(4)
    );
    // A second list updates the first one's intervals, as PyTorch's parser does.
    let layered = parse("roundup_power2_divisions:2,roundup_power2_divisions:[4:8]");
    let mut want = vec![8; 16];
    want[3..].fill(2);
    assert_eq!(
        layered.roundup_power2_divisions,
        RoundupDivisions::PerInterval(want)
    );
}

#[test]
fn booleans_are_spelled_as_pytorch_spells_them() {
    assert!(parse("expandable_segments:True").expandable_segments);
    assert!(!parse("expandable_segments:False").expandable_segments);
    for value in ["true", "1", "yes", ""] {
        assert_eq!(
            bad_key(&format!("expandable_segments:{value}")),
            "expandable_segments"
        );
    }
}

#[test]
fn backend_native_only() {
    assert_eq!(parse("backend:native"), Config::default());
    let err = Config::from_alloc_conf("backend:cudaMallocAsync").unwrap_err();
    assert!(err.to_string().contains("cudaMallocAsync"), "{err}");
    assert_eq!(bad_key("backend:cudaMallocAsync"), "backend");
    assert_eq!(bad_key("backend:other"), "backend");
}

#[test]
fn ignored_pytorch_keys_are_validated() {
    let ok = [
        "release_lock_on_cudamalloc:True",
        "release_lock_on_hipmalloc:False",
        "graph_capture_record_stream_reuse:True",
        "pinned_use_hip_host_register:False",
        "pinned_use_background_threads:True",
        "pinned_reserve_segment_size_mb:64",
        "large_segment_size_mb:20",
    ];
    for s in ok {
        assert_eq!(parse(s), Config::default(), "{s}");
    }
    let bad = [
        (
            "release_lock_on_cudamalloc:yes",
            "release_lock_on_cudamalloc",
        ),
        (
            "pinned_use_cuda_host_register:1",
            "pinned_use_cuda_host_register",
        ),
        (
            "pinned_use_background_threads:",
            "pinned_use_background_threads",
        ),
        (
            "pinned_num_register_threads:3",
            "pinned_num_register_threads",
        ),
        (
            "pinned_num_register_threads:256",
            "pinned_num_register_threads",
        ),
        (
            "pinned_num_register_threads:0",
            "pinned_num_register_threads",
        ),
        (
            "pinned_reserve_segment_size_mb:0",
            "pinned_reserve_segment_size_mb",
        ),
        ("large_segment_size_mb:12", "large_segment_size_mb"),
    ];
    for (s, key) in bad {
        assert_eq!(bad_key(s), key, "{s}");
    }
}

#[test]
fn pytorch_pinning_keys_choose_how_a_sleep_pins() {
    let default = Config::default().host_pinning;
    assert!(default.register, "registered memory unless told otherwise");
    assert_eq!(default.threads, HostPinning::DEFAULT_THREADS);
    let c = parse("pinned_use_cuda_host_register:False,pinned_num_register_threads:128");
    assert_eq!(
        c.host_pinning,
        HostPinning {
            register: false,
            threads: 128
        }
    );
    assert_eq!(
        parse("pinned_num_register_threads:1").host_pinning,
        HostPinning {
            register: true,
            threads: 1
        }
    );
    assert_eq!(
        parse("pinned_use_cuda_host_register:True,pinned_num_register_threads:8"),
        Config::default()
    );
}

#[test]
fn cuvmm_keys() {
    let c = parse("page_size_mb:2, max_idle_mb:512, va_factor:4, small_size_kb:256");
    assert_eq!(c.page_size, Some(2 * MIB));
    assert_eq!(c.max_idle_bytes, 512 * MIB);
    assert_eq!(c.va_factor, 4);
    assert_eq!(c.small_size, 256 * KIB);
    assert_eq!(parse("max_idle_mb:0").max_idle_bytes, 0);
    assert!(parse("cross_stream_reuse:True").cross_stream_reuse);
    assert!(!parse("cross_stream_reuse:False").cross_stream_reuse);
    assert!(parse("").lend_chunk_pages);
    assert!(!parse("lend_chunk_pages:False").lend_chunk_pages);
    assert!(parse("").capture_detection);
    assert!(!parse("capture_detection:False").capture_detection);
    assert_eq!(
        parse("max_idle_mb:7,max_idle_mb:unlimited").max_idle_bytes,
        u64::MAX
    );
    let bad = [
        ("page_size_mb:0", "page_size_mb"),
        ("page_size_mb:17592186044416", "page_size_mb"),
        ("max_idle_mb:-1", "max_idle_mb"),
        ("max_idle_mb:17592186044416", "max_idle_mb"),
        ("va_factor:0", "va_factor"),
        ("va_factor:17", "va_factor"),
        ("va_factor:1841615", "va_factor"),
        ("small_size_kb:0", "small_size_kb"),
        ("small_size_kb:1.5", "small_size_kb"),
        ("cross_stream_reuse:true", "cross_stream_reuse"),
        ("cross_stream_reuse:1", "cross_stream_reuse"),
        ("capture_detection:no", "capture_detection"),
    ];
    for (s, key) in bad {
        assert_eq!(bad_key(s), key, "{s}");
    }
}

#[test]
fn whitespace_is_ignored_everywhere() {
    let c = parse("  expandable_segments : True ,\n max_split_size_mb:1 28 ,  ");
    assert!(c.expandable_segments);
    assert_eq!(c.max_split_size, Some(128 * MIB));
}

#[test]
fn unknown_keys_and_syntax_errors() {
    assert_eq!(
        Config::from_alloc_conf("expandable_segments:True,max_split_mb:100"),
        Err(ConfigError::UnknownKey {
            key: "max_split_mb".into()
        })
    );
    assert_eq!(
        Config::from_alloc_conf("expandable_segments"),
        Err(ConfigError::Syntax {
            entry: "expandable_segments".into()
        })
    );
    assert_eq!(
        Config::from_alloc_conf("va_factor:2,,va_factor:3"),
        Err(ConfigError::Syntax {
            entry: String::new()
        })
    );
    assert_eq!(
        Config::from_alloc_conf(",va_factor:2"),
        Err(ConfigError::Syntax {
            entry: String::new()
        })
    );
    assert!(matches!(
        Config::from_alloc_conf(":1"),
        Err(ConfigError::UnknownKey { .. })
    ));
    let err = Config::from_alloc_conf("max_split_size_mb:5").unwrap_err();
    assert!(err.to_string().contains("max_split_size_mb"), "{err}");
}

#[test]
fn validate_names_the_key_of_the_field_at_fault() {
    let base = Config::default;
    let key = |c: Config| match c.validate() {
        Err(ConfigError::BadValue { key, .. }) => key,
        other => panic!("{c:?}: {other:?}"),
    };
    assert_eq!(key(base().with_page_size(0)), "page_size_mb");
    assert_eq!(key(base().with_va_factor(0)), "va_factor");
    assert_eq!(
        key(Config {
            small_size: 0,
            ..base()
        }),
        "small_size_kb"
    );
    assert_eq!(
        key(Config {
            max_split_size: Some(MIB),
            ..base()
        }),
        "max_split_size_mb"
    );
    assert_eq!(
        key(Config {
            max_non_split_rounding: 0,
            ..base()
        }),
        "max_non_split_rounding_mb"
    );
    assert_eq!(
        key(Config {
            garbage_collection_threshold: Some(f64::NAN),
            ..base()
        }),
        "garbage_collection_threshold"
    );
    let rd = |r| Config {
        roundup_power2_divisions: r,
        ..base()
    };
    assert_eq!(
        key(rd(RoundupDivisions::Uniform(3))),
        "roundup_power2_divisions"
    );
    assert_eq!(
        key(rd(RoundupDivisions::PerInterval(vec![1; 3]))),
        "roundup_power2_divisions"
    );
    assert_eq!(
        rd(RoundupDivisions::PerInterval(vec![0; 16])).validate(),
        Ok(())
    );
    assert_eq!(
        base()
            .with_page_size(2 * MIB)
            .with_max_idle_bytes(0)
            .validate(),
        Ok(())
    );
}

#[test]
fn divisions_pick_the_interval_of_the_size() {
    let r = parse("roundup_power2_divisions:[256:1,512:2,1024:4,>:8]").roundup_power2_divisions;
    assert_eq!(r.divisions(0), 1);
    assert_eq!(r.divisions(512), 1);
    assert_eq!(r.divisions(256 * MIB), 1);
    assert_eq!(r.divisions(512 * MIB), 2);
    assert_eq!(r.divisions(1024 * MIB - 1), 2);
    assert_eq!(r.divisions(GIB), 4);
    assert_eq!(r.divisions(u64::MAX), 8);
    assert_eq!(RoundupDivisions::None.divisions(GIB), 0);
    assert_eq!(RoundupDivisions::Uniform(4).divisions(1), 4);
}

#[test]
fn compaction_defaults_to_pressure_and_parses_both_policies() {
    assert_eq!(Config::default().compaction, Compaction::Pressure);
    let eager = Config::from_alloc_conf("compaction:eager").unwrap();
    assert_eq!(eager.compaction, Compaction::Eager);
    let pressure = Config::from_alloc_conf("compaction:pressure").unwrap();
    assert_eq!(pressure.compaction, Compaction::Pressure);
    let err = Config::from_alloc_conf("compaction:lazy").unwrap_err();
    assert!(
        matches!(&err, ConfigError::BadValue { key, .. } if key == "compaction"),
        "{err}"
    );
}

#[test]
fn reserve_budget_is_bytes_or_a_fraction_and_gc_threshold_lowers_it() {
    let mb = Config::from_alloc_conf("reserve_budget_mb:1024").unwrap();
    assert_eq!(mb.reserve_budget, Some(Budget::Bytes(1024 * MIB)));
    assert_eq!(mb.budget_bytes(8192 * MIB, 4096 * MIB, None), 1024 * MIB);
    let frac = Config::from_alloc_conf("reserve_budget_fraction:0.5").unwrap();
    assert_eq!(frac.budget_bytes(8192 * MIB, 100, None), 4096 * MIB);
    // Unset: what the device has free.
    assert_eq!(
        Config::default().budget_bytes(8192 * MIB, 3000 * MIB, None),
        3000 * MIB
    );
    let gc = Config::from_alloc_conf("garbage_collection_threshold:0.25").unwrap();
    assert_eq!(gc.budget_bytes(8192 * MIB, 8192 * MIB, None), 2048 * MIB);
    for (conf, key) in [
        ("reserve_budget_fraction:0", "reserve_budget_fraction"),
        ("reserve_budget_fraction:1.5", "reserve_budget_fraction"),
        ("reserve_budget_fraction:x", "reserve_budget_fraction"),
        ("reserve_budget_mb:0", "reserve_budget_mb"),
        ("large_handle_mb:0", "large_handle_mb"),
        ("stream_cache_mb:-1", "stream_cache_mb"),
        ("stream_cache_mb:99999999999999999", "stream_cache_mb"),
        ("large_handle_headroom:1.5", "large_handle_headroom"),
        ("large_handle_headroom:-0.1", "large_handle_headroom"),
        ("large_handle_headroom:x", "large_handle_headroom"),
    ] {
        let err = Config::from_alloc_conf(conf).unwrap_err();
        assert!(
            matches!(&err, ConfigError::BadValue { key: k, .. } if k == key),
            "{conf}: {err}"
        );
    }
    assert_eq!(
        Config::from_alloc_conf("large_handle_mb:4")
            .unwrap()
            .large_handle,
        4 * MIB
    );
    assert_eq!(Config::default().stream_cache, 32 * MIB);
    assert_eq!(Config::default().stream_cache_eager, None);
    for (conf, eager) in [
        ("stream_cache_eager:True", true),
        ("stream_cache_eager:False", false),
    ] {
        let config = Config::from_alloc_conf(conf).unwrap();
        assert_eq!(config.stream_cache_eager, Some(eager), "{conf}");
    }
    assert!(Config::from_alloc_conf("stream_cache_eager:true").is_err());
    for (conf, bytes) in [("stream_cache_mb:0", 0), ("stream_cache_mb:32", 32 * MIB)] {
        assert_eq!(
            Config::from_alloc_conf(conf).unwrap().stream_cache,
            bytes,
            "{conf}"
        );
    }
    let headroom = |conf: &str| Config::from_alloc_conf(conf).unwrap().large_handle_headroom;
    assert_eq!(headroom(""), 0.0);
    assert_eq!(headroom("large_handle_headroom:0.3"), 0.3);
    assert_eq!(headroom("large_handle_headroom:0"), 0.0);
    assert_eq!(headroom("large_handle_headroom:1"), 1.0);
}

proptest! {
    /// Property: no input string makes the parser panic, and whatever it accepts passes `validate`.
    #[test]
    fn arbitrary_strings_never_panic(s in "\\PC*") {
        if let Ok(c) = Config::from_alloc_conf(&s) {
            prop_assert_eq!(c.validate(), Ok(()));
        }
    }

    /// Property: strings built from the parser's own alphabet (keys, digits, separators) never panic.
    #[test]
    fn config_like_strings_never_panic(
        parts in prop::collection::vec(
            prop_oneof![
                Just("roundup_power2_divisions".to_string()), Just("max_split_size_mb".to_string()),
                Just("max_idle_mb".to_string()), Just("page_size_mb".to_string()),
                Just(":".to_string()), Just(",".to_string()), Just("[".to_string()),
                Just("]".to_string()), Just(">".to_string()), "[0-9]{1,25}", Just(" ".to_string()),
            ],
            0..24,
        )
    ) {
        let s = parts.concat();
        if let Ok(c) = Config::from_alloc_conf(&s) {
            prop_assert_eq!(c.validate(), Ok(()));
        }
    }
}
