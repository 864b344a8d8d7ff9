//! The search on its own, against made-up answers: what it returns is verified, and it never loops.

use super::*;
use std::collections::HashSet;

const PAGE: u64 = 4;

/// A probe that fits exactly at the capacities `fits` says, reporting `reserved(c)` as its peak.
fn oracle(
    fits: impl Fn(u64) -> bool,
    reserved: impl Fn(u64) -> u64,
) -> impl FnMut(u64, Bracket) -> Result<Probe, ()> {
    move |c, _| {
        Ok(Probe {
            fits: fits(c),
            peak_reserved_bytes: reserved(c),
        })
    }
}

/// What the search promises: the capacity found fits, and one page less does not or is below the bound.
fn check_promise(b: &Bisection, lower: u64, fits: impl Fn(u64) -> bool) -> u64 {
    let (c, probe) = b.found.expect("found");
    assert!(probe.fits && fits(c), "{c} does not fit");
    assert_eq!(c % PAGE, 0);
    assert!(c >= lower);
    if c > lower {
        assert!(!fits(c - PAGE), "{} fits too", c - PAGE);
        assert!(b.probes.iter().any(|&(p, r)| p == c - PAGE && !r.fits));
    }
    let distinct: HashSet<u64> = b.probes.iter().map(|&(c, _)| c).collect();
    assert_eq!(distinct.len(), b.probes.len(), "a capacity probed twice");
    c
}

#[test]
fn a_monotone_answer_is_found_exactly() {
    let lower = 40;
    for threshold in (lower..lower + 400).step_by(PAGE as usize) {
        let fits = |c: u64| c >= threshold;
        // Reporting the whole capacity as reserved gives no useful guess: plain bisection.
        let b = bisect(lower, PAGE, lower * 16, oracle(fits, |c| c)).unwrap();
        assert_eq!(check_promise(&b, lower, fits), threshold);
        assert!(b.probes.len() <= 2 + 2 * 8, "{} probes", b.probes.len());
    }
}

#[test]
fn a_good_guess_from_peak_reserved_cuts_the_search_short() {
    let (lower, threshold) = (4000, 4040);
    let fits = |c: u64| c >= threshold;
    // An allocator that reserves the same at any capacity where it fits.
    let b = bisect(lower, PAGE, lower * 16, oracle(fits, |_| threshold - 3)).unwrap();
    assert_eq!(check_promise(&b, lower, fits), threshold);
    let capacities: Vec<u64> = b.probes.iter().map(|&(c, _)| c).collect();
    assert_eq!(capacities[..3], [lower, 2 * lower, threshold]);
    // Without the guess, bisecting 4000..8000 by 4 takes 10 more replays.
    assert!(b.probes.len() < 8, "{capacities:?}");
}

#[test]
fn a_wrong_guess_still_ends_with_the_promise_kept() {
    let lower = 400;
    let fits = |c: u64| c >= 520;
    // Claims to reserve less than it needs.
    let b = bisect(lower, PAGE, lower * 16, oracle(fits, |_| 404)).unwrap();
    assert_eq!(check_promise(&b, lower, fits), 520);
}

#[test]
fn a_fit_at_the_lower_bound_is_one_replay() {
    let b = bisect(64, PAGE, 1024, oracle(|_| true, |c| c)).unwrap();
    assert_eq!(b.found.map(|(c, _)| c), Some(64));
    assert_eq!(b.probes.len(), 1);
}

#[test]
fn non_monotone_answers_give_a_capacity_that_fits_with_one_page_less_failing() {
    // Fits at a few scattered capacities and from 900 on: several local minima.
    for pattern in [
        &[412u64, 420, 600, 604][..],
        &[404, 700, 704, 708],
        &[],
        &[896],
    ] {
        let fits = |c: u64| c >= 900 || pattern.contains(&c);
        let b = bisect(400, PAGE, 400 * 16, oracle(fits, |c| c)).unwrap();
        check_promise(&b, 400, fits);
    }
}

#[test]
fn an_allocator_that_never_fits_is_reported_after_bounded_doubling() {
    let b = bisect(100, PAGE, 1600, oracle(|_| false, |c| c)).unwrap();
    assert_eq!(b.found, None);
    assert_eq!(b.searched_up_to(), 1600);
    let capacities: Vec<u64> = b.probes.iter().map(|&(c, _)| c).collect();
    assert_eq!(capacities, [100, 200, 400, 800, 1600]);
    // A limit that is not a power-of-two multiple is still probed, rounded up to a page.
    let b = bisect(100, PAGE, 1001, oracle(|_| false, |c| c)).unwrap();
    assert_eq!(b.searched_up_to(), 1004);
}

#[test]
fn the_bracket_told_to_the_probe_holds_what_was_learnt() {
    let fits = |c: u64| c >= 300;
    let mut seen = Vec::new();
    bisect(100, PAGE, 1600, |c, bracket: Bracket| {
        if let Some(f) = bracket.fails {
            assert!(!fits(f) && f < c);
        }
        if let Some(f) = bracket.fits {
            assert!(fits(f) && c < f);
        }
        seen.push(c);
        Ok::<_, ()>(Probe {
            fits: fits(c),
            peak_reserved_bytes: c,
        })
    })
    .unwrap();
    assert!(seen.len() > 3);
}

#[test]
fn a_probe_error_stops_the_search() {
    let err = bisect(100, PAGE, 1600, |c, _| {
        if c > 100 {
            Err(c)
        } else {
            Ok(Probe {
                fits: false,
                peak_reserved_bytes: 0,
            })
        }
    });
    assert_eq!(err, Err(200));
}
