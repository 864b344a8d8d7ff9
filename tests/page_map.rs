//! Property tests of [`PageMap`] against a model: a `Vec` with one plain struct per page.
//!
//! A weighted random sequence of actions (map an unmapped page with a fresh handle, unmap a mapped page that
//! no block touches, add a user over a random range, remove a user over a range added earlier, set access
//! over a range of mapped pages) is applied to the page map and to the model, for page counts around the
//! 64-bit word boundaries of the bit vectors (1, 63, 64, 65, 200) and several page sizes. After every
//! action these properties are checked:
//!
//! - every per-page query (`is_mapped`, `is_accessible`, `is_idle`, `handle`, `users`) agrees with the
//!   model, and `len`, `is_empty`, `page_size` are unchanged;
//! - `mapped_count` and `idle_count` equal the model's counts (the counters never drift from the bits);
//! - a page is idle exactly when it is mapped and has no user, including after `add_user` on an unmapped
//!   page that is mapped later;
//! - `unmap` returns the handle that `map` put there, and clears access;
//! - `unmapped_runs` and `inaccessible_runs` over a random sub-range, and `idle_runs` over the whole map,
//!   are the model's maximal runs, in address order;
//! - `idle_pages_rev` yields exactly the idle pages, from the highest down;
//! - `pages_touched` of a random byte range is the model's first..=last page.
//!
//! Separate tests check each documented panic.

use cuvmm::driver::PhysHandle;
use cuvmm::page_map::PageMap;
use proptest::prelude::*;
use std::ops::Range;

/// One page of the model.
#[derive(Debug, Clone, Copy, Default)]
struct Page {
    handle: Option<u64>,
    accessible: bool,
    users: u32,
}

impl Page {
    fn idle(&self) -> bool {
        self.handle.is_some() && self.users == 0
    }
}

/// The action to apply. Each `usize` picks among the candidates that are valid at that moment (modulo
/// their number), so every generated sequence is valid whatever the state.
#[derive(Debug, Clone)]
enum Action {
    Map(usize),
    Unmap(usize),
    AddUser(usize, usize),
    RemoveUser(usize),
    SetAccessible(usize, usize, usize),
}

/// Random numbers for the range queries made after an action.
#[derive(Debug, Clone)]
struct Probe {
    range: (usize, usize),
    bytes: (u64, u64),
}

fn action() -> impl Strategy<Value = Action> {
    prop_oneof![
        4 => any::<usize>().prop_map(Action::Map),
        2 => any::<usize>().prop_map(Action::Unmap),
        3 => (any::<usize>(), any::<usize>()).prop_map(|(a, b)| Action::AddUser(a, b)),
        2 => any::<usize>().prop_map(Action::RemoveUser),
        2 => (any::<usize>(), any::<usize>(), any::<usize>()).prop_map(|(a, b, c)| Action::SetAccessible(a, b, c)),
    ]
}

fn probe() -> impl Strategy<Value = Probe> {
    (any::<(usize, usize)>(), any::<(u64, u64)>()).prop_map(|(range, bytes)| Probe { range, bytes })
}

/// The page map, the model, and what the model needs to pick valid actions.
struct Harness {
    map: PageMap,
    model: Vec<Page>,
    added: Vec<Range<usize>>,
    next_handle: u64,
}

impl Harness {
    fn new(pages: usize, page_size: u64) -> Self {
        Self {
            map: PageMap::new(pages, page_size),
            model: vec![Page::default(); pages],
            added: Vec::new(),
            next_handle: 0,
        }
    }

    fn pages_where(&self, f: impl Fn(&Page) -> bool) -> Vec<usize> {
        (0..self.model.len())
            .filter(|&p| f(&self.model[p]))
            .collect()
    }

    /// `a..b` inside `0..len`, from two random numbers; may be empty.
    fn range(len: usize, a: usize, b: usize) -> Range<usize> {
        let x = a % (len + 1);
        let y = b % (len + 1);
        x.min(y)..x.max(y)
    }

    fn apply(&mut self, action: &Action) {
        match *action {
            Action::Map(pick) => {
                let candidates = self.pages_where(|p| p.handle.is_none());
                if let Some(&page) = candidates.get(pick % candidates.len().max(1)) {
                    self.next_handle += 1;
                    self.map.map(page, PhysHandle(self.next_handle));
                    self.model[page].handle = Some(self.next_handle);
                }
            }
            Action::Unmap(pick) => {
                let candidates = self.pages_where(|p| p.handle.is_some() && p.users == 0);
                if let Some(&page) = candidates.get(pick % candidates.len().max(1)) {
                    let got = self.map.unmap(page);
                    let want = self.model[page].handle.take();
                    assert_eq!(Some(got.0), want, "unmap({page}) returned the wrong handle");
                    self.model[page].accessible = false;
                }
            }
            Action::AddUser(a, b) => {
                let range = Self::range(self.model.len(), a, b);
                self.map.add_user(range.clone());
                self.model[range.clone()]
                    .iter_mut()
                    .for_each(|p| p.users += 1);
                self.added.push(range);
            }
            Action::RemoveUser(pick) => {
                if !self.added.is_empty() {
                    let range = self.added.swap_remove(pick % self.added.len());
                    self.map.remove_user(range.clone());
                    self.model[range].iter_mut().for_each(|p| p.users -= 1);
                }
            }
            Action::SetAccessible(pick, a, b) => {
                let runs = model_runs(&self.model, 0..self.model.len(), |p| p.handle.is_some());
                if let Some(run) = runs.get(pick % runs.len().max(1)) {
                    let sub = Self::range(run.len(), a, b);
                    let range = run.start + sub.start..run.start + sub.end;
                    self.map.set_accessible(range.clone());
                    self.model[range]
                        .iter_mut()
                        .for_each(|p| p.accessible = true);
                }
            }
        }
    }

    fn check(&self, probe: &Probe, page_size: u64) {
        let (map, model) = (&self.map, &self.model);
        assert_eq!(map.len(), model.len());
        assert_eq!(map.is_empty(), model.is_empty());
        assert_eq!(map.page_size(), page_size);
        for (i, page) in model.iter().enumerate() {
            assert_eq!(map.is_mapped(i), page.handle.is_some(), "is_mapped({i})");
            assert_eq!(map.is_accessible(i), page.accessible, "is_accessible({i})");
            assert_eq!(map.is_idle(i), page.idle(), "is_idle({i})");
            assert_eq!(map.handle(i).map(|h| h.0), page.handle, "handle({i})");
            assert_eq!(map.users(i), page.users, "users({i})");
        }
        assert_eq!(
            map.mapped_count(),
            model.iter().filter(|p| p.handle.is_some()).count()
        );
        assert_eq!(map.idle_count(), model.iter().filter(|p| p.idle()).count());

        let sub = Self::range(model.len(), probe.range.0, probe.range.1);
        let unmapped = model_runs(model, sub.clone(), |p| p.handle.is_none());
        assert_eq!(
            map.unmapped_runs(sub.clone()),
            unmapped,
            "unmapped_runs({sub:?})"
        );
        let inaccessible = model_runs(model, sub.clone(), |p| p.handle.is_some() && !p.accessible);
        assert_eq!(
            map.inaccessible_runs(sub.clone()),
            inaccessible,
            "inaccessible_runs({sub:?})"
        );
        assert_eq!(
            map.unmapped_runs(0..model.len()),
            model_runs(model, 0..model.len(), |p| p.handle.is_none())
        );
        assert_eq!(
            map.idle_runs(),
            model_runs(model, 0..model.len(), Page::idle)
        );
        let idle_rev: Vec<usize> = (0..model.len())
            .rev()
            .filter(|&i| model[i].idle())
            .collect();
        assert_eq!(map.idle_pages_rev().collect::<Vec<_>>(), idle_rev);

        let total = model.len() as u64 * page_size;
        let offset = probe.bytes.0 % (total + 1);
        let size = probe.bytes.1 % (total - offset + 1);
        let want = if size == 0 {
            0..0
        } else {
            (offset / page_size) as usize..((offset + size - 1) / page_size) as usize + 1
        };
        assert_eq!(
            map.pages_touched(offset, size),
            want,
            "pages_touched({offset}, {size})"
        );
    }
}

/// Maximal runs of pages inside `range` for which `f` holds, in address order.
fn model_runs(model: &[Page], range: Range<usize>, f: impl Fn(&Page) -> bool) -> Vec<Range<usize>> {
    let mut out: Vec<Range<usize>> = Vec::new();
    for i in range {
        if f(&model[i]) {
            match out.last_mut() {
                Some(run) if run.end == i => run.end += 1,
                _ => out.push(i..i + 1),
            }
        }
    }
    out
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    /// Properties: see the module docs.
    #[test]
    fn page_map_matches_model(
        pages in prop::sample::select(vec![1usize, 63, 64, 65, 200]),
        page_size in prop::sample::select(vec![1u64, 7, 4096, 2 << 20]),
        steps in prop::collection::vec((action(), probe()), 1..300),
    ) {
        let mut h = Harness::new(pages, page_size);
        for (action, probe) in &steps {
            h.apply(action);
            h.check(probe, page_size);
        }
        // Freeing every user and unmapping every page leaves nothing mapped or idle.
        while let Some(range) = h.added.pop() {
            h.map.remove_user(range.clone());
            h.model[range].iter_mut().for_each(|p| p.users -= 1);
        }
        // With no users left, `Unmap(0)` picks the lowest mapped page; once per mapped page unmaps them all.
        for _ in 0..h.map.mapped_count() {
            h.apply(&Action::Unmap(0));
        }
        prop_assert_eq!(h.map.mapped_count(), 0);
        prop_assert_eq!(h.map.idle_count(), 0);
        h.check(&steps[0].1, page_size);
    }
}

#[test]
fn empty_map_has_no_pages_and_no_runs() {
    let map = PageMap::new(0, 4096);
    assert!(map.is_empty());
    assert_eq!(map.unmapped_runs(0..0), Vec::<Range<usize>>::new());
    assert_eq!(map.inaccessible_runs(0..0), Vec::<Range<usize>>::new());
    assert_eq!(map.idle_runs(), Vec::<Range<usize>>::new());
    assert_eq!(map.idle_pages_rev().count(), 0);
}

#[test]
#[should_panic(expected = "page size must be non-zero")]
fn zero_page_size_panics() {
    PageMap::new(4, 0);
}

#[test]
#[should_panic(expected = "mapped twice")]
fn mapping_a_mapped_page_panics() {
    let mut map = PageMap::new(65, 1);
    map.map(64, PhysHandle(1));
    map.map(64, PhysHandle(2));
}

#[test]
#[should_panic(expected = "set_access on unmapped page 64")]
fn set_accessible_over_an_unmapped_page_panics() {
    let mut map = PageMap::new(65, 1);
    map.map(63, PhysHandle(1));
    map.set_accessible(63..65);
}

#[test]
#[should_panic(expected = "unmapping unmapped page")]
fn unmapping_an_unmapped_page_panics() {
    let mut map = PageMap::new(2, 1);
    map.unmap(1);
}

#[test]
#[should_panic(expected = "live blocks touch")]
fn unmapping_a_used_page_panics() {
    let mut map = PageMap::new(2, 1);
    map.map(1, PhysHandle(1));
    map.add_user(0..2);
    map.unmap(1);
}

#[test]
#[should_panic(expected = "has no user to remove")]
fn removing_a_missing_user_panics() {
    let mut map = PageMap::new(3, 1);
    map.add_user(0..1);
    map.remove_user(0..2);
}
