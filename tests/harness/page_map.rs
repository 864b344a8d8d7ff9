//! The `page_map` harness: fuzzer bytes decoded into page-map operations, applied to a [`PageMap`] and to
//! a model with one plain struct per page (the idea of `tests/page_map.rs`, driven by bytes). Only valid
//! operations are applied: each one picks among the candidates valid at that moment. The fuzz target and
//! `tests/fuzz_corpus.rs` both run [`run`].
//!
//! Properties checked after every operation:
//! - every per-page query (`is_mapped`, `is_accessible`, `is_idle`, `handle`, `users`) agrees with the
//!   model; a page is idle exactly when it is mapped and no block uses it;
//! - `mapped_count`, `idle_count` and `touched_count` equal the model's counts;
//! - `unmap` returns the handle `map` put there, and clears access;
//! - `unmapped_runs`, `mapped_runs`, `inaccessible_runs` and `accessible_runs` over a probed sub-range,
//!   and `idle_runs` over the whole map, are the model's maximal runs in address order;
//! - `idle_pages_rev` yields the idle pages from the highest down;
//! - `pages_touched` of a probed byte range is the model's first..=last page.
//!
//! Input layout: byte 0 picks the page count (1, 63, 64, 65 or 200: around the bit vectors' 64-bit
//! words), byte 1 the page size (1, 7, 4096 or 2 MiB); then per step an opcode byte, two argument bytes
//! and four probe bytes, at most [`MAX_STEPS`] steps.

use crate::input::Input;
use cuvmm::driver::PhysHandle;
use cuvmm::page_map::PageMap;
use std::ops::Range;

/// Page ranges in address order.
type Runs = Vec<Range<usize>>;

/// Steps decoded from one input at most.
pub const MAX_STEPS: usize = 400;

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

/// The page map, the model, and the user ranges added so far.
struct State {
    map: PageMap,
    model: Vec<Page>,
    added: Vec<Range<usize>>,
    next_handle: u64,
}

/// Decodes `data`, applies every step and checks the properties listed in the module docs. Returns the
/// number of steps applied.
pub fn run(data: &[u8]) -> Result<usize, String> {
    let mut input = Input::new(data);
    let pages = [1, 63, 64, 65, 200][usize::from(input.below(5))];
    let page_size = [1, 7, 4096, 2 << 20][usize::from(input.below(4))];
    let mut state = State {
        map: PageMap::new(pages, page_size),
        model: vec![Page::default(); pages],
        added: Vec::new(),
        next_handle: 0,
    };
    let mut steps = 0;
    while !input.is_empty() && steps < MAX_STEPS {
        let (op, a, b) = (input.below(5), input.byte(), input.byte());
        let what = state
            .apply(op, usize::from(a), usize::from(b))
            .map_err(|e| format!("pages {pages} of {page_size} B, step {steps}: {e}"))?;
        state
            .check(&mut input, page_size)
            .map_err(|e| format!("pages {pages} of {page_size} B, step {steps} ({what}): {e}"))?;
        steps += 1;
    }
    Ok(steps)
}

/// `x..y` inside `0..len` from two numbers; may be empty.
fn range(len: usize, a: usize, b: usize) -> Range<usize> {
    let (x, y) = (a % (len + 1), b % (len + 1));
    x.min(y)..x.max(y)
}

impl State {
    fn pages_where(&self, f: impl Fn(&Page) -> bool) -> Vec<usize> {
        (0..self.model.len())
            .filter(|&p| f(&self.model[p]))
            .collect()
    }

    /// Applies operation `op` (0 map, 1 unmap, 2 add a user, 3 remove a user, 4 set access) with the
    /// arguments `a` and `b`; returns what it did, for messages.
    fn apply(&mut self, op: u8, a: usize, b: usize) -> Result<String, String> {
        match op {
            0 => {
                let candidates = self.pages_where(|p| p.handle.is_none());
                let Some(&page) = candidates.get(a % candidates.len().max(1)) else {
                    return Ok("map: none unmapped".into());
                };
                self.next_handle += 1;
                self.map.map(page, PhysHandle(self.next_handle));
                self.model[page].handle = Some(self.next_handle);
                Ok(format!("map({page})"))
            }
            1 => {
                let candidates = self.pages_where(Page::idle);
                let Some(&page) = candidates.get(a % candidates.len().max(1)) else {
                    return Ok("unmap: none idle".into());
                };
                let got = self.map.unmap(page).0;
                let want = self.model[page].handle.take();
                self.model[page].accessible = false;
                if Some(got) != want {
                    return Err(format!(
                        "unmap({page}) returned handle {got}, mapped was {want:?}"
                    ));
                }
                Ok(format!("unmap({page})"))
            }
            2 => {
                let r = range(self.model.len(), a * 7, b * 7);
                self.map.add_user(r.clone());
                self.model[r.clone()].iter_mut().for_each(|p| p.users += 1);
                self.added.push(r.clone());
                Ok(format!("add_user({r:?})"))
            }
            3 => {
                if self.added.is_empty() {
                    return Ok("remove_user: none added".into());
                }
                let r = self.added.swap_remove(a % self.added.len());
                self.map.remove_user(r.clone());
                self.model[r.clone()].iter_mut().for_each(|p| p.users -= 1);
                Ok(format!("remove_user({r:?})"))
            }
            _ => {
                let runs = model_runs(&self.model, 0..self.model.len(), |p| p.handle.is_some());
                let Some(run) = runs.get(a % runs.len().max(1)) else {
                    return Ok("set_accessible: none mapped".into());
                };
                let sub = range(run.len(), b, b / 3 + a);
                let r = run.start + sub.start..run.start + sub.end;
                self.map.set_accessible(r.clone());
                self.model[r.clone()]
                    .iter_mut()
                    .for_each(|p| p.accessible = true);
                Ok(format!("set_accessible({r:?})"))
            }
        }
    }

    /// Compares every query with the model; probes ranges with the next four bytes of `input`.
    fn check(&self, input: &mut Input<'_>, page_size: u64) -> Result<(), String> {
        let (map, model) = (&self.map, &self.model);
        let n = model.len();
        for (i, page) in model.iter().enumerate() {
            let got = (
                map.is_mapped(i),
                map.is_accessible(i),
                map.is_idle(i),
                map.handle(i).map(|h| h.0),
                map.users(i),
            );
            let want = (
                page.handle.is_some(),
                page.accessible,
                page.idle(),
                page.handle,
                page.users,
            );
            if got != want {
                return Err(format!(
                    "page {i}: (mapped, accessible, idle, handle, users) = {got:?}, model {want:?}"
                ));
            }
        }
        let counts = (map.mapped_count(), map.idle_count(), map.touched_count());
        let want = (
            model.iter().filter(|p| p.handle.is_some()).count(),
            model.iter().filter(|p| p.idle()).count(),
            model.iter().filter(|p| p.users > 0).count(),
        );
        if counts != want {
            return Err(format!(
                "(mapped, idle, touched) counts {counts:?}, model {want:?}"
            ));
        }
        let sub = range(n, usize::from(input.byte()), usize::from(input.byte()) * 3);
        let queries: [(&str, Runs, Runs); 5] = [
            (
                "unmapped_runs",
                map.unmapped_runs(sub.clone()),
                model_runs(model, sub.clone(), |p| p.handle.is_none()),
            ),
            (
                "mapped_runs",
                map.mapped_runs(sub.clone()),
                model_runs(model, sub.clone(), |p| p.handle.is_some()),
            ),
            (
                "inaccessible_runs",
                map.inaccessible_runs(sub.clone()),
                model_runs(model, sub.clone(), |p| p.handle.is_some() && !p.accessible),
            ),
            (
                "accessible_runs",
                map.accessible_runs(sub.clone()),
                model_runs(model, sub.clone(), |p| p.accessible),
            ),
            (
                "idle_runs",
                map.idle_runs(),
                model_runs(model, 0..n, Page::idle),
            ),
        ];
        for (name, got, want) in queries {
            if got != want {
                return Err(format!("{name}({sub:?}) = {got:?}, model {want:?}"));
            }
        }
        let idle_rev: Vec<usize> = (0..n).rev().filter(|&i| model[i].idle()).collect();
        if map.idle_pages_rev().collect::<Vec<_>>() != idle_rev {
            return Err("idle_pages_rev differs from the model".into());
        }
        let total = n as u64 * page_size;
        let offset = u64::from(input.u16()) * page_size / 97 % (total + 1);
        let size = u64::from(input.byte()) * page_size / 31 % (total - offset + 1);
        let want = if size == 0 {
            0..0
        } else {
            (offset / page_size) as usize..((offset + size - 1) / page_size) as usize + 1
        };
        let got = map.pages_touched(offset, size);
        if got != want {
            return Err(format!(
                "pages_touched({offset}, {size}) = {got:?}, want {want:?}"
            ));
        }
        Ok(())
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
