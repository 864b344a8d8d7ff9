//! Random sequences of the exported C functions, as a program reaches them through PyTorch: allocations and
//! frees on several streams (bad and second frees among them), `allocateWithAddress`, `record_stream`, graph
//! pools begun, ended, checkpointed and put back, pools with an allocator of their own, tags put to sleep and
//! woken, resets, memory fractions and `empty_cache`. After every call no panic was caught at the boundary,
//! the allocator's invariants hold, its statistics and snapshot agree with a model of what the program
//! holds, and the recorded history tells each block's story as PyTorch's does (alloc, free_requested,
//! free_completed, each with the bytes requested).
//!
//! Each case runs on a simulated device of its own (the registry is the process's), and ends by giving
//! everything back, which the statistics must then show.
//!
//! Unsafe here only calls the exported functions as C does, each call with its `// SAFETY:` comment.
#![allow(unsafe_code)]

use cuvmm_torch::ffi::*;
use cuvmm_torch::last_error;
use cuvmm_torch::registry::{Settings, global};
use cuvmm_torch::structs::{
    BLOCK_ACTIVE_ALLOCATED, BLOCK_ACTIVE_PENDING_FREE, CDeviceStats, CForeignSegment, CPoolBlock,
    CTraceEntry,
};
use proptest::prelude::*;
use proptest::sample::Index;
use std::collections::BTreeMap;
use std::ffi::{CStr, CString, c_int, c_void};
use std::ptr;
use std::sync::atomic::{AtomicI32, Ordering};

const MIB: isize = 1 << 20;
/// Devices are built as first named, so each case, and each step of shrinking, takes a fresh one.
const DEVICES: i32 = 1 << 16;
/// Graph pools `{0, 1}` and `{0, 2}`, each begun on a stream of its own (`POOL_STREAM + i`), which also
/// allocates outside the pool while the pool is not begun.
const POOLS: usize = 2;
const POOL_STREAM: usize = 0x12;
/// Pools with an allocator of their own, `{0, 50}` and `{0, 51}`.
const FOREIGN: usize = 2;
const TAGS: [&str; 2] = ["weights", "kv_cache"];

fn stream(n: usize) -> *mut c_void {
    ptr::with_exposed_provenance_mut(n)
}

fn pool_id(i: usize) -> (u64, u64) {
    (0, 1 + i as u64)
}

fn foreign_id(i: usize) -> (u64, u64) {
    (0, 50 + i as u64)
}

unsafe extern "C" fn only_stream(context: *mut c_void, stream: *mut c_void) -> c_int {
    (context == stream) as c_int
}

#[derive(Clone, Debug)]
enum Op {
    Malloc {
        size: isize,
        stream: usize,
    },
    Free {
        pick: Index,
        any: bool,
    },
    /// `allocateWithAddress` at an address freed before (PyTorch 2.13's checkpoints): served where that
    /// memory is free, on its segment's stream and tag.
    MallocAt {
        pick: Index,
        size: isize,
    },
    /// A pointer inside a live block, or one already freed: an error, nothing freed.
    BadFree {
        pick: Index,
        interior: bool,
    },
    RecordStream {
        pick: Index,
        stream: usize,
    },
    EmptyCache,
    ReleaseStranded,
    SetTag(Option<usize>),
    Sleep {
        tag: usize,
        keep: bool,
    },
    Wake {
        tag: usize,
    },
    ReleaseHostBuffers,
    /// `cuvmm_prepare_sleep` of a tag.
    PrepareSleep(usize),
    Incref(usize),
    Begin(usize),
    End(usize),
    Release(usize),
    Checkpoint(usize),
    Restore(usize),
    EmptyPoolCache(usize),
    ForeignIncref(usize),
    ForeignMalloc {
        pool: usize,
        size: isize,
        stream: usize,
    },
    ForeignRelease {
        pool: usize,
        all: bool,
    },
    ForeignReleasePool(usize),
    ResetPeaks,
    ResetAccumulated,
    Fraction(f64),
}

fn size() -> impl Strategy<Value = isize> {
    prop_oneof![
        4 => 1..=4096isize,
        3 => (MIB / 2)..=(2 * MIB),
        3 => (2 * MIB)..=(30 * MIB),
        1 => (100 * MIB)..=(400 * MIB),
        1 => prop_oneof![Just(0isize), Just(-1), Just(isize::MAX)],
    ]
}

fn op() -> impl Strategy<Value = Op> {
    let pool = 0..POOLS;
    prop_oneof![
        12 => (size(), 0x10..0x14usize).prop_map(|(size, stream)| Op::Malloc { size, stream }),
        10 => (any::<Index>(), any::<bool>()).prop_map(|(pick, any)| Op::Free { pick, any }),
        2 => (any::<Index>(), 1..=(MIB / 8)).prop_map(|(pick, size)| Op::MallocAt { pick, size }),
        1 => (any::<Index>(), any::<bool>()).prop_map(|(pick, interior)| Op::BadFree { pick, interior }),
        2 => (any::<Index>(), 0x10..0x16usize).prop_map(|(pick, stream)| Op::RecordStream { pick, stream }),
        1 => Just(Op::EmptyCache),
        1 => Just(Op::ReleaseStranded),
        2 => prop::option::of(0..TAGS.len()).prop_map(Op::SetTag),
        2 => (0..TAGS.len(), any::<bool>()).prop_map(|(tag, keep)| Op::Sleep { tag, keep }),
        2 => (0..TAGS.len()).prop_map(|tag| Op::Wake { tag }),
        1 => Just(Op::ReleaseHostBuffers),
        1 => (0..TAGS.len()).prop_map(Op::PrepareSleep),
        1 => pool.clone().prop_map(Op::Incref),
        2 => pool.clone().prop_map(Op::Begin),
        2 => pool.clone().prop_map(Op::End),
        1 => pool.clone().prop_map(Op::Release),
        1 => pool.clone().prop_map(Op::Checkpoint),
        1 => pool.clone().prop_map(Op::Restore),
        1 => pool.prop_map(Op::EmptyPoolCache),
        1 => (0..FOREIGN).prop_map(Op::ForeignIncref),
        3 => (0..FOREIGN, size(), 0x10..0x12usize)
            .prop_map(|(pool, size, stream)| Op::ForeignMalloc { pool, size, stream }),
        1 => (0..FOREIGN, any::<bool>()).prop_map(|(pool, all)| Op::ForeignRelease { pool, all }),
        1 => (0..FOREIGN).prop_map(Op::ForeignReleasePool),
        1 => Just(Op::ResetPeaks),
        1 => Just(Op::ResetAccumulated),
        1 => prop_oneof![3 => 0.3f64..=1.0, 1 => -1.0f64..=2.0].prop_map(Op::Fraction),
    ]
}

/// A block the program holds.
#[derive(Clone, Copy, Debug)]
struct Held {
    requested: u64,
    tag: Option<usize>,
    /// In a pool with an allocator of its own.
    foreign: bool,
}

/// A pool's live blocks as `cuvmm_pool_blocks` gave them, each with the tag it was allocated under.
type Checkpoint = Vec<(CPoolBlock, Option<usize>)>;

/// What the program holds, and what it asked of pools and tags.
#[derive(Debug, Default)]
struct Model {
    device: i32,
    live: BTreeMap<u64, Held>,
    /// Addresses freed and not handed out again, with the tag of the block freed there.
    freed: Vec<(u64, Option<usize>)>,
    asleep: [bool; TAGS.len()],
    tag: Option<usize>,
    begun: [bool; POOLS],
    uses: [i64; POOLS],
    /// A checkpoint of each pool, with the tag of each of its blocks.
    checkpoints: [Option<Checkpoint>; POOLS],
    foreign_uses: [i64; FOREIGN],
    /// Segments given to pools with an allocator of their own: (start, size).
    segments: Vec<(u64, u64)>,
    next_segment: u64,
}

/// The last error, which must not be a panic caught at the boundary.
fn no_panic(what: &str) -> Option<String> {
    let error = last_error();
    if let Some(text) = &error {
        assert!(!text.contains("panic"), "{what}: {text}");
    }
    error
}

fn device_stats(device: i32) -> CDeviceStats {
    let mut out = CDeviceStats::default();
    // SAFETY: `out` is valid for one write of the struct.
    let got = unsafe { cuvmm_get_device_stats(device, &mut out) };
    assert_eq!(got, 0, "{:?}", last_error());
    out
}

/// What a snapshot says of the blocks: the allocated ones (address, requested bytes), the requested bytes of
/// those freed whose memory still waits (which count in `requested_bytes` until then, as PyTorch's), and the
/// last action recorded at each address with its bytes.
struct Shown {
    allocated: BTreeMap<u64, u64>,
    pending: u64,
    pending_blocks: usize,
    traced: BTreeMap<u64, (c_int, u64)>,
}

/// PyTorch's `TraceEntry::Action` values for a block's events.
const ALLOC: c_int = 0;
const FREE_REQUESTED: c_int = 1;
const FREE_COMPLETED: c_int = 2;

fn snapshot_blocks(device: i32) -> Shown {
    let taken = cuvmm_snapshot_take(device);
    assert!(!taken.is_null(), "{:?}", last_error());
    // SAFETY: a non-null snapshot's arrays hold their lengths until freed.
    let (blocks, traces) = unsafe {
        let snap = &*taken;
        (
            std::slice::from_raw_parts(snap.blocks, snap.num_blocks).to_vec(),
            std::slice::from_raw_parts(snap.traces, snap.num_traces).to_vec(),
        )
    };
    // SAFETY: freed once.
    unsafe { cuvmm_snapshot_free(taken) };
    let allocated = (blocks.iter())
        .filter(|b| b.state == BLOCK_ACTIVE_ALLOCATED)
        .map(|b| (b.address, b.requested_size))
        .collect();
    let pending_blocks = || (blocks.iter()).filter(|b| b.state == BLOCK_ACTIVE_PENDING_FREE);
    Shown {
        allocated,
        pending: pending_blocks().map(|b| b.requested_size).sum(),
        pending_blocks: pending_blocks().count(),
        traced: block_stories(&traces),
    }
}

/// Checks that the events recorded (all of them: the history is large enough) tell each block's story as
/// PyTorch's do: at an address, `alloc` of the bytes requested, `free_requested` of the same bytes, then
/// `free_completed` of the same bytes, before the next `alloc` there. Returns each address's last action
/// and bytes.
fn block_stories(traces: &[CTraceEntry]) -> BTreeMap<u64, (c_int, u64)> {
    let mut last: BTreeMap<u64, (c_int, u64)> = BTreeMap::new();
    for t in traces.iter().filter(|t| t.action <= FREE_COMPLETED) {
        let before = last.insert(t.addr, (t.action, t.size));
        let follows = match t.action {
            ALLOC => before.is_none_or(|(action, _)| action == FREE_COMPLETED),
            FREE_REQUESTED => before == Some((ALLOC, t.size)),
            _ => before == Some((FREE_REQUESTED, t.size)),
        };
        assert!(
            follows,
            "action {} of {} B at {:#x} after {before:?}",
            t.action, t.size, t.addr
        );
    }
    last
}

fn tag_states(device: i32) -> BTreeMap<String, String> {
    let text = cuvmm_tags_json(device);
    assert!(!text.is_null(), "{:?}", last_error());
    // SAFETY: a non-null string is NUL-terminated until freed, and is freed once, below.
    let json = unsafe { CStr::from_ptr(text) }
        .to_str()
        .unwrap()
        .to_string();
    // SAFETY: as above.
    unsafe { cuvmm_string_free(text) };
    let tags: Vec<serde_json::Value> = serde_json::from_str(&json).unwrap();
    (tags.iter())
        .map(|t| {
            let field = |k: &str| t[k].as_str().unwrap().to_string();
            (field("name"), field("state"))
        })
        .collect()
}

fn pool_blocks(device: i32, pool: (u64, u64)) -> Option<Vec<CPoolBlock>> {
    // SAFETY: a null `out` with `cap` 0 only counts.
    let n = unsafe { cuvmm_pool_blocks(device, pool.0, pool.1, ptr::null_mut(), 0) };
    let n = usize::try_from(n).ok()?;
    let mut out = vec![CPoolBlock::default(); n];
    // SAFETY: `out` has room for `n` blocks.
    let again = unsafe { cuvmm_pool_blocks(device, pool.0, pool.1, out.as_mut_ptr(), n) };
    assert_eq!(again, n as i64);
    Some(out)
}

impl Model {
    fn pick(&self, index: &Index) -> Option<u64> {
        (!self.live.is_empty())
            .then(|| *self.live.keys().nth(index.index(self.live.len())).unwrap())
    }

    fn set_tag(&mut self, tag: Option<usize>) {
        let name = tag.map(|t| CString::new(TAGS[t]).unwrap());
        let raw = name.as_ref().map_or(ptr::null(), |n| n.as_ptr());
        // SAFETY: `raw` is null or a NUL-terminated string valid for the call.
        assert_eq!(unsafe { cuvmm_set_tag(raw) }, 0, "{:?}", last_error());
        self.tag = tag;
    }

    fn took(&mut self, p: *mut c_void, held: Held) {
        let addr = p.addr() as u64;
        assert!(!self.live.contains_key(&addr), "{addr:#x} handed out twice");
        self.freed.retain(|&(f, _)| f != addr);
        self.live.insert(addr, held);
    }

    fn free(&mut self, addr: u64) {
        // A free is a free at once, as PyTorch counts it, even when its memory waits: for the events of
        // other streams, deferred during a capture, or for its tag's wake.
        let held = self.live.remove(&addr).unwrap();
        self.freed.push((addr, held.tag));
    }

    /// The tags' states as cuvmm reports them; a wake gives back what was freed while asleep.
    fn read_tags(&mut self) {
        let states = tag_states(self.device);
        for (t, name) in TAGS.iter().enumerate() {
            let state = states.get(*name).map_or("awake", String::as_str);
            // "sleeping": a wake (or sleep) that failed half way, treated as asleep.
            assert!(
                matches!(state, "awake" | "asleep" | "sleeping"),
                "{name}: {state}"
            );
            self.asleep[t] = state != "awake";
        }
    }

    fn apply(&mut self, op: &Op) {
        let d = self.device;
        match *op {
            Op::Malloc { size, stream: s } => {
                let p = cuvmm_malloc(size, d, stream(s));
                no_panic("malloc");
                if size <= 0 {
                    assert!(p.is_null(), "{size} bytes");
                } else if !p.is_null() {
                    assert_eq!(p.addr() % 512, 0);
                    assert!(
                        self.tag.is_none_or(|t| !self.asleep[t]),
                        "allocated under a sleeping tag"
                    );
                    let held = Held {
                        requested: size as u64,
                        tag: self.tag,
                        foreign: false,
                    };
                    self.took(p, held);
                }
            }
            Op::Free { ref pick, any } => {
                let Some(addr) = self.pick(pick) else { return };
                let p = ptr::with_exposed_provenance_mut(addr as usize);
                // Simulated devices hand out the same addresses, so a free naming no device is only for
                // blocks of pools with an allocator of their own, whose segments are at addresses of this
                // case's own.
                if any && self.live[&addr].foreign {
                    cuvmm_free_any(p);
                } else {
                    cuvmm_free(p, 0, d, stream(0x10));
                }
                assert!(no_panic("free").is_none(), "{:?}", last_error());
                self.free(addr);
            }
            Op::MallocAt { ref pick, size } => {
                let Some(&(addr, tag)) = self.freed.get(pick.index(self.freed.len().max(1))) else {
                    return;
                };
                let p = cuvmm_malloc_at(d, ptr::with_exposed_provenance_mut(addr as usize), size);
                no_panic("malloc_at");
                if !p.is_null() {
                    assert_eq!(p.addr() as u64, addr);
                    assert!(
                        tag.is_none_or(|t| !self.asleep[t]),
                        "allocated in a sleeping tag"
                    );
                    self.took(
                        p,
                        Held {
                            requested: size as u64,
                            tag,
                            foreign: false,
                        },
                    );
                }
            }
            Op::BadFree { ref pick, interior } => {
                let addr = if interior {
                    let Some(addr) = self.pick(pick) else { return };
                    addr + 512
                } else {
                    let Some(&(addr, _)) = self.freed.get(pick.index(self.freed.len().max(1)))
                    else {
                        return;
                    };
                    addr
                };
                if self.live.contains_key(&addr) {
                    return; // the interior of one block is the start of another
                }
                cuvmm_free(
                    ptr::with_exposed_provenance_mut(addr as usize),
                    0,
                    d,
                    stream(0x10),
                );
                assert!(
                    no_panic("bad free").is_some(),
                    "{addr:#x}: freed without an error"
                );
            }
            Op::RecordStream {
                ref pick,
                stream: s,
            } => {
                let Some(addr) = self.pick(pick) else { return };
                cuvmm_record_stream(
                    ptr::with_exposed_provenance_mut(addr as usize),
                    d,
                    stream(s),
                );
                assert!(no_panic("record_stream").is_none(), "{:?}", last_error());
            }
            Op::EmptyCache => {
                cuvmm_empty_cache(d);
                no_panic("empty_cache");
            }
            Op::ReleaseStranded => {
                cuvmm_release_stranded(d);
                no_panic("release_stranded");
            }
            Op::SetTag(tag) => self.set_tag(tag),
            Op::Sleep { tag, keep } => {
                let name = CString::new(TAGS[tag]).unwrap();
                // SAFETY: `name` is NUL-terminated and valid for the call.
                let slept = unsafe { cuvmm_sleep(d, name.as_ptr(), keep as c_int) };
                no_panic("sleep");
                assert_eq!(
                    slept < 0,
                    self.begun.contains(&true),
                    "refused only during a capture"
                );
                self.read_tags();
            }
            Op::Wake { tag } => {
                let name = CString::new(TAGS[tag]).unwrap();
                // SAFETY: `name` is NUL-terminated and valid for the call.
                unsafe { cuvmm_wake(d, name.as_ptr()) };
                no_panic("wake");
                self.read_tags();
            }
            Op::ReleaseHostBuffers => {
                // SAFETY: a null tag names every tag.
                unsafe { cuvmm_release_host_buffers(d, ptr::null()) };
                no_panic("release_host_buffers");
            }
            Op::PrepareSleep(tag) => {
                let name = CString::new(TAGS[tag]).unwrap();
                // SAFETY: `name` is NUL-terminated and valid for the call.
                let pinned = unsafe { cuvmm_prepare_sleep(d, name.as_ptr()) };
                no_panic("prepare_sleep");
                assert_eq!(
                    pinned < 0,
                    self.begun.contains(&true),
                    "refused only during a capture: {:?}",
                    last_error()
                );
            }
            Op::Incref(i) => {
                let (a, b) = pool_id(i);
                assert_eq!(cuvmm_incref_pool(d, a, b), 0, "{:?}", last_error());
                self.uses[i] += 1;
            }
            Op::Begin(i) => {
                let (a, b) = pool_id(i);
                let on = stream(POOL_STREAM + i);
                // SAFETY: `only_stream` compares pointers only, from any thread.
                let begun = unsafe { cuvmm_begin_allocate_to_pool(d, a, b, Some(only_stream), on) };
                no_panic("begin");
                assert_eq!(begun == 0, !self.begun[i], "{:?}", last_error());
                if begun == 0 {
                    self.begun[i] = true;
                    self.uses[i] += 1;
                }
            }
            Op::End(i) => {
                let (a, b) = pool_id(i);
                let ended = cuvmm_end_allocate_to_pool(d, a, b);
                no_panic("end");
                assert_eq!(ended == 0, self.begun[i], "{:?}", last_error());
                self.begun[i] = false;
            }
            Op::Release(i) => {
                let (a, b) = pool_id(i);
                let released = cuvmm_release_pool(d, a, b);
                no_panic("release");
                assert_eq!(released == 0, self.uses[i] > 0, "{:?}", last_error());
                if released == 0 {
                    self.uses[i] -= 1;
                }
            }
            Op::Checkpoint(i) => {
                self.checkpoints[i] = pool_blocks(d, pool_id(i)).map(|blocks| {
                    (blocks.into_iter())
                        .map(|b| (b, self.live.get(&b.address).and_then(|h| h.tag)))
                        .collect()
                });
            }
            Op::Restore(i) => self.restore(i),
            Op::EmptyPoolCache(i) => {
                let (a, b) = pool_id(i);
                cuvmm_empty_pool_cache(d, a, b);
                no_panic("empty_pool_cache");
            }
            Op::ForeignIncref(i) => {
                let (a, b) = foreign_id(i);
                assert_eq!(cuvmm_incref_pool(d, a, b), 0, "{:?}", last_error());
                self.foreign_uses[i] += 1;
            }
            Op::ForeignMalloc {
                pool,
                size,
                stream: s,
            } => self.foreign_malloc(pool, size, s),
            Op::ForeignRelease { pool, all } => {
                let (a, b) = foreign_id(pool);
                let mut len = 0usize;
                // SAFETY: `len` is valid for one write.
                let out = unsafe { cuvmm_foreign_release(d, a, b, all as c_int, &mut len) };
                no_panic("foreign_release");
                let given: Vec<CForeignSegment> = if out.is_null() {
                    Vec::new()
                } else {
                    // SAFETY: a non-null result holds `len` segments until freed, and is freed once.
                    let given = unsafe { std::slice::from_raw_parts(out, len) }.to_vec();
                    // SAFETY: as above.
                    unsafe { cuvmm_foreign_segments_free(out, len) };
                    given
                };
                for seg in given {
                    let range = seg.address..seg.address + seg.size;
                    assert!(
                        self.live.keys().all(|a| !range.contains(a)),
                        "a segment given back while a block in it lives"
                    );
                    let before = self.segments.len();
                    self.segments.retain(|&(start, _)| start != seg.address);
                    assert_eq!(
                        self.segments.len() + 1,
                        before,
                        "{:#x} not given",
                        seg.address
                    );
                }
            }
            Op::ForeignReleasePool(i) => {
                let (a, b) = foreign_id(i);
                let released = cuvmm_release_pool(d, a, b);
                no_panic("release");
                assert_eq!(
                    released == 0,
                    self.foreign_uses[i] > 0,
                    "{:?}",
                    last_error()
                );
                if released == 0 {
                    self.foreign_uses[i] -= 1;
                }
            }
            Op::ResetPeaks => assert_eq!(cuvmm_reset_peak_stats(d), 0, "{:?}", last_error()),
            Op::ResetAccumulated => {
                assert_eq!(cuvmm_reset_accumulated_stats(d), 0, "{:?}", last_error());
            }
            Op::Fraction(f) => {
                let set = cuvmm_set_memory_fraction(d, f);
                no_panic("set_memory_fraction");
                assert_eq!(
                    set == 0,
                    (0.0..=1.0).contains(&f),
                    "{f}: {:?}",
                    last_error()
                );
            }
        }
    }

    /// Puts pool `i` back as its checkpoint found it, where cuvmm accepts: the pool's blocks now are freed,
    /// the checkpoint's are live again.
    fn restore(&mut self, i: usize) {
        let Some(checkpoint) = self.checkpoints[i].clone() else {
            return;
        };
        if self.asleep.contains(&true) {
            return; // which of the pool's blocks a sleeping tag holds is not modelled
        }
        let (d, (a, b)) = (self.device, pool_id(i));
        let now = pool_blocks(d, (a, b)).unwrap_or_default();
        let blocks: Vec<CPoolBlock> = checkpoint.iter().map(|&(b, _)| b).collect();
        // SAFETY: `blocks` holds its length of blocks.
        let put = unsafe { cuvmm_pool_restore(d, a, b, blocks.as_ptr(), blocks.len()) };
        no_panic("restore");
        if put != 0 {
            return;
        }
        for block in &now {
            if self.live.contains_key(&block.address) {
                self.free(block.address);
            }
        }
        for &(block, tag) in &checkpoint {
            let p = ptr::with_exposed_provenance_mut(block.address as usize);
            let held = Held {
                requested: block.requested_size,
                tag,
                foreign: false,
            };
            self.took(p, held);
        }
    }

    fn foreign_malloc(&mut self, pool: usize, size: isize, s: usize) {
        let (d, (a, b)) = (self.device, foreign_id(pool));
        for _ in 0..2 {
            let mut grow = 0usize;
            // SAFETY: `grow` is valid for one write.
            let p = unsafe { cuvmm_foreign_malloc(d, a, b, size, stream(s), 0, &mut grow) };
            no_panic("foreign_malloc");
            if !p.is_null() {
                assert!(size > 0);
                let held = Held {
                    requested: size as u64,
                    tag: None,
                    foreign: true,
                };
                self.took(p, held);
                return;
            }
            if grow == 0 {
                return; // refused: a bad size, say
            }
            if grow > 4 << 30 {
                return; // more than the pool's allocator has
            }
            // The pool's allocator: addresses no simulated device hands out, this case's own (64 GiB for
            // each device), never touched.
            let start = (1 << 48) + ((d as u64) << 36) + self.next_segment;
            self.next_segment += (grow as u64).next_multiple_of(1 << 30);
            let p = ptr::with_exposed_provenance_mut(start as usize);
            assert_eq!(
                cuvmm_foreign_add_segment(d, a, b, stream(s), p, grow),
                0,
                "{:?}",
                last_error()
            );
            self.segments.push((start, grow as u64));
        }
        panic!("a segment of the size asked for did not serve the request");
    }

    /// The allocator's invariants, and its statistics and snapshot against the model.
    fn check(&mut self) {
        let allocator = global().unwrap().allocator(self.device).unwrap();
        allocator.check_invariants().unwrap();
        let stats = device_stats(self.device);
        let count = stats.allocation.all.current as u64;
        assert_eq!(count, self.live.len() as u64, "live blocks");
        let Shown {
            allocated: snapshot,
            pending,
            pending_blocks,
            traced,
        } = snapshot_blocks(self.device);
        // The history: each live block's last event is its allocation, each pending one's its free's request.
        for (addr, h) in &self.live {
            assert_eq!(
                traced.get(addr),
                Some(&(ALLOC, h.requested)),
                "{addr:#x}'s last event"
            );
        }
        let last = |action| traced.values().filter(|&&(a, _)| a == action).count();
        assert_eq!(
            last(ALLOC),
            self.live.len(),
            "blocks whose last event is alloc"
        );
        assert_eq!(
            last(FREE_REQUESTED),
            pending_blocks,
            "blocks whose free is not complete"
        );
        for (addr, h) in &self.live {
            assert_eq!(
                snapshot.get(addr),
                Some(&h.requested),
                "{addr:#x} in the snapshot"
            );
        }
        assert_eq!(
            snapshot.len() as u64,
            count,
            "the snapshot's allocated blocks"
        );
        let requested = snapshot.values().sum::<u64>() + pending;
        assert_eq!(
            stats.requested_bytes.all.current as u64, requested,
            "requested bytes"
        );
        let pools = (0..POOLS).map(|i| (pool_id(i), self.uses[i]));
        for ((a, b), uses) in
            pools.chain((0..FOREIGN).map(|i| (foreign_id(i), self.foreign_uses[i])))
        {
            assert_eq!(
                cuvmm_pool_use_count(self.device, a, b) as i64,
                uses,
                "uses of {b}"
            );
        }
    }

    /// Gives everything back: ends the pools, frees the blocks, wakes the tags (their blocks freed while
    /// asleep go then), releases the pools and empties the cache.
    fn finish(&mut self) {
        let d = self.device;
        self.set_tag(None);
        for i in 0..POOLS {
            if self.begun[i] {
                self.apply(&Op::End(i));
            }
        }
        for addr in self.live.keys().copied().collect::<Vec<_>>() {
            cuvmm_free(
                ptr::with_exposed_provenance_mut(addr as usize),
                0,
                d,
                stream(0x10),
            );
            assert!(no_panic("free").is_none(), "{:?}", last_error());
            self.free(addr);
        }
        assert_eq!(cuvmm_set_memory_fraction(d, 1.0), 0);
        cuvmm_empty_cache(d);
        for tag in 0..TAGS.len() {
            self.apply(&Op::Wake { tag });
        }
        assert!(!self.asleep.contains(&true), "woken");
        for i in 0..POOLS {
            while self.uses[i] > 0 {
                self.apply(&Op::Release(i));
            }
        }
        for i in 0..FOREIGN {
            while self.foreign_uses[i] > 0 {
                self.apply(&Op::ForeignReleasePool(i));
            }
        }
        cuvmm_empty_cache(d);
        self.apply(&Op::ForeignRelease { pool: 0, all: true });
        self.check();
        assert!(
            self.segments.is_empty(),
            "segments kept: {:x?}",
            self.segments
        );
        let stats = device_stats(d);
        assert_eq!(stats.allocated_bytes.all.current, 0);
        assert_eq!(stats.active_bytes.all.current, 0, "every pending free done");
    }
}

static NEXT_DEVICE: AtomicI32 = AtomicI32::new(0);

proptest! {
    #![proptest_config(ProptestConfig { cases: 96, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn any_sequence_of_calls_keeps_the_allocator_whole(ops in prop::collection::vec(op(), 1..80)) {
        cuvmm_torch::install(Settings::sim(1 << 30, DEVICES as usize));
        let device = NEXT_DEVICE.fetch_add(1, Ordering::Relaxed);
        assert!(device < DEVICES, "more cases than devices");
        let mut model = Model { device, ..Model::default() };
        assert_eq!(cuvmm_record_history(device, 1 << 20), 0, "{:?}", last_error());
        for op in &ops {
            model.apply(op);
            model.check();
        }
        model.finish();
    }
}
