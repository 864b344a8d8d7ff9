//! Unit tests of the page map (the property tests are `tests/page_map.rs`).

use super::*;

#[test]
fn pages_touched_covers_partial_pages() {
    let map = PageMap::new(8, 100);
    assert_eq!(map.pages_touched(0, 100), 0..1);
    assert_eq!(map.pages_touched(50, 100), 0..2);
    assert_eq!(map.pages_touched(100, 1), 1..2);
    assert_eq!(map.pages_touched(199, 2), 1..3);
    assert_eq!(map.pages_touched(10, 0), 0..0);
}

#[test]
fn idle_follows_users_and_mapping() {
    let mut map = PageMap::new(4, 1);
    map.add_user(1..3);
    map.map(1, PhysHandle(7));
    map.map(3, PhysHandle(8));
    assert!(!map.is_idle(1));
    assert!(map.is_idle(3));
    assert_eq!(map.idle_count(), 1);
    assert_eq!(map.touched_count(), 2);
    map.remove_user(1..3);
    assert_eq!(map.touched_count(), 0);
    assert!(map.is_idle(1));
    assert_eq!(map.idle_runs(), vec![1..2, 3..4]);
    assert_eq!(map.unmapped_runs(0..4), vec![0..1, 2..3]);
    assert_eq!(map.unmap(1), PhysHandle(7));
    assert_eq!(map.idle_count(), 1);
    assert_eq!(map.mapped_count(), 1);
}

#[test]
fn runs_cross_word_boundaries() {
    let mut map = PageMap::new(200, 1);
    for page in (60..70).chain(127..130).chain(190..200) {
        map.map(page, PhysHandle(page as u64));
    }
    assert_eq!(
        map.mapped_runs_lazy(0..200).take(2).collect::<Vec<_>>(),
        vec![60..70, 127..130]
    );
    assert_eq!(map.mapped_runs(65..195), vec![65..70, 127..130, 190..195]);
    assert_eq!(map.unmapped_runs(125..192), vec![125..127, 130..190]);
    assert_eq!(map.idle_runs_in(128..200), vec![128..130, 190..200]);
    assert_eq!(map.mapped_runs(70..127), Vec::<Range<usize>>::new());
}

#[test]
fn unmap_run_takes_the_handles_in_order() {
    let mut map = PageMap::new(8, 1);
    for page in 1..6 {
        map.map(page, PhysHandle(page as u64));
    }
    map.add_user(2..3);
    let mut out = Vec::new();
    map.unmap_run(3..6, &mut out);
    assert_eq!(out, [PhysHandle(3), PhysHandle(4), PhysHandle(5)]);
    assert_eq!((map.mapped_count(), map.idle_count()), (2, 1));
    assert_eq!(map.idle_runs(), vec![1..2]);
    assert_eq!(map.unmapped_runs(0..8), vec![0..1, 3..8]);
}

#[test]
#[should_panic(expected = "unmapping page 2 that 1 live blocks touch")]
fn unmap_run_over_a_used_page_panics() {
    let mut map = PageMap::new(8, 1);
    for page in 1..6 {
        map.map(page, PhysHandle(page as u64));
    }
    map.add_user(2..3);
    map.unmap_run(1..4, &mut Vec::new());
}

#[test]
fn inaccessible_runs_skip_unmapped_and_accessible_pages() {
    let mut map = PageMap::new(6, 1);
    for page in [0, 1, 2, 4, 5] {
        map.map(page, PhysHandle(page as u64));
    }
    map.set_accessible(1..2);
    assert_eq!(map.inaccessible_runs(0..6), vec![0..1, 2..3, 4..6]);
    assert_eq!(map.accessible_runs(0..6), vec![1..2]);
}

#[test]
#[should_panic(expected = "live blocks touch")]
fn unmapping_a_used_page_panics() {
    let mut map = PageMap::new(2, 1);
    map.map(0, PhysHandle(1));
    map.add_user(0..1);
    map.unmap(0);
}
