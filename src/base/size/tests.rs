use super::*;
use proptest::prelude::*;

fn ok(s: &str) -> u64 {
    parse_size(s).unwrap_or_else(|e| panic!("{s:?}: {e}"))
}

#[test]
fn parses_every_documented_form() {
    assert_eq!(ok("512"), 512);
    assert_eq!(ok("512B"), 512);
    assert_eq!(ok("64KiB"), 64 * KIB);
    assert_eq!(ok("2M"), 2 * MIB);
    assert_eq!(ok("2MiB"), 2 * MIB);
    assert_eq!(ok("80G"), 80 * GIB);
    assert_eq!(ok("80GB"), 80 * GIB);
    assert_eq!(ok("80GiB"), 80 * GIB);
    assert_eq!(ok("2TiB"), 2048 * GIB);
    assert_eq!(ok("1PiB"), 1 << 50);
    assert_eq!(ok("0"), 0);
}

#[test]
fn units_are_case_insensitive_and_may_follow_a_space() {
    for s in ["80gib", "80GIB", "80 GiB", " 80  gb ", "80\tg"] {
        assert_eq!(ok(s), 80 * GIB, "{s}");
    }
    assert_eq!(ok("4 kb"), 4 * KIB);
    assert_eq!(ok("7 b"), 7);
}

#[test]
fn fractions_truncate_to_whole_bytes() {
    assert_eq!(ok("1.5GiB"), 3 * GIB / 2);
    assert_eq!(ok("1.5KiB"), 1536);
    assert_eq!(ok(".5K"), 512);
    assert_eq!(ok("5."), 5);
    assert_eq!(ok("0.3B"), 0);
    assert_eq!(ok("1.9"), 1);
    assert_eq!(ok("0.001KiB"), 1); // 1.024 bytes
    assert_eq!(ok("0.0009765625KiB"), 1); // exactly 1 byte: no float rounding down to 0
    assert_eq!(ok("0.00097656249KiB"), 0);
    assert_eq!(ok("2.999999999999999999999999MiB"), 3 * MIB - 1);
}

#[test]
fn rejects_bad_input_naming_it() {
    assert_eq!(parse_size(""), Err(SizeError::Empty));
    assert_eq!(parse_size("   "), Err(SizeError::Empty));
    let err = parse_size("12XB").unwrap_err();
    assert_eq!(
        err,
        SizeError::UnknownUnit {
            input: "12XB".into(),
            unit: "XB".into()
        }
    );
    let cases = [
        ("-1", "Negative"),
        ("-0.5GiB", "Negative"),
        ("NaN", "BadNumber"),
        ("inf", "BadNumber"),
        ("GiB", "BadNumber"),
        (".", "BadNumber"),
        ("1.2.3", "BadNumber"),
        ("+5", "BadNumber"),
        ("12XB", "UnknownUnit"),
        ("1e9", "UnknownUnit"),
        ("16EiB", "UnknownUnit"),
        ("18446744073709551616", "Overflow"),
    ];
    for (input, expected) in cases {
        let err = parse_size(input).expect_err(input);
        assert!(format!("{err:?}").starts_with(expected), "{input}: {err:?}");
        assert!(
            err.to_string().contains(input.trim()),
            "{input}: message `{err}` does not name it"
        );
    }
}

#[test]
fn overflow_is_detected_after_the_unit() {
    assert_eq!(ok("18446744073709551615"), u64::MAX);
    assert_eq!(
        ok("16383.999PiB"),
        16383 * (1 << 50) + 999 * (1 << 50) / 1000
    );
    assert!(matches!(
        parse_size("16384PiB"),
        Err(SizeError::Overflow { .. })
    ));
    assert!(matches!(
        parse_size("17179869184GiB"),
        Err(SizeError::Overflow { .. })
    ));
    assert!(matches!(parse_size("18446744073709551615.5"), Ok(u64::MAX)));
}

#[test]
fn round_trips_with_format_size_for_exact_values() {
    for bytes in [
        0,
        1,
        512,
        1023,
        KIB,
        3 * KIB / 2,
        2 * MIB,
        80 * GIB,
        3 * GIB / 2,
        5 * GIB / 4,
        2048 * GIB,
    ] {
        assert_eq!(ok(&format_size(bytes)), bytes, "{}", format_size(bytes));
    }
    assert_eq!(format_size(ok("1.5GiB")), "1.50 GiB");
}

proptest! {
    /// Property: a size of whole quarters of a unit prints exactly and parses back to itself.
    #[test]
    fn quarters_of_a_unit_round_trip(quarters in 4u64..4096, shift in prop::sample::select(vec![10u32, 20, 30])) {
        let bytes = quarters * (1u64 << shift) / 4;
        prop_assert_eq!(parse_size(&format_size(bytes)), Ok(bytes));
    }

    /// Property: no input string makes `parse_size` panic.
    #[test]
    fn arbitrary_strings_never_panic(s in "\\PC*") {
        let _ = parse_size(&s);
    }

    /// Property: a whole number with any unit parses to that number times the unit, or overflows.
    #[test]
    fn whole_numbers_scale_by_their_unit(n in any::<u64>(), unit in prop::sample::select(vec![("", 0u32), ("k", 10), ("MB", 20), ("GiB", 30), ("t", 40)])) {
        let got = parse_size(&format!("{n}{}", unit.0));
        match n.checked_mul(1 << unit.1) {
            Some(bytes) => prop_assert_eq!(got, Ok(bytes)),
            None => prop_assert!(matches!(got, Err(SizeError::Overflow { .. })), "expected overflow"),
        }
    }
}
