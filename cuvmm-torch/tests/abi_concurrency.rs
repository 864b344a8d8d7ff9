//! The exported C functions called from several threads at once on one simulated device, as a PyTorch
//! program's threads, its data loader's pinned-memory thread and a monitoring thread call them: four workers
//! allocate, free (by device and by pointer alone), `record_stream`, one allocates into a graph pool it begins
//! and ends, two put their own tags to sleep and wake them; a fifth thread empties the cache, gives stranded
//! pages back, resets the peaks, moves the memory fraction, reads the statistics, the snapshot and the tags,
//! and checks the invariants. No call may panic, no address may be handed out while it is held, and at the
//! end, everything freed, the statistics show nothing allocated and the invariants hold.
//!
//! Unsafe here only calls the exported functions as C does, each call with its `// SAFETY:` comment.
#![allow(unsafe_code)]

use cuvmm_torch::ffi::*;
use cuvmm_torch::last_error;
use cuvmm_torch::registry::{Settings, global};
use cuvmm_torch::structs::CDeviceStats;
use std::collections::BTreeMap;
use std::ffi::{CString, c_int, c_void};
use std::ptr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

const DEVICE: i32 = 0;
const WORKERS: usize = 4;
const STEPS: usize = 3000;

fn stream(n: usize) -> *mut c_void {
    ptr::with_exposed_provenance_mut(n)
}

/// The last error, which must not be a panic caught at the boundary.
fn no_panic(what: &str) -> Option<String> {
    let error = last_error();
    if let Some(text) = &error {
        assert!(!text.contains("panic"), "{what}: {text}");
    }
    error
}

unsafe extern "C" fn only_stream(context: *mut c_void, stream: *mut c_void) -> c_int {
    (context == stream) as c_int
}

/// A small deterministic generator (xorshift), one per thread.
struct Rng(u64);

impl Rng {
    fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0 % n
    }
}

/// The blocks every thread holds, by address: an address handed out while held is a bug.
type Held = Arc<Mutex<BTreeMap<u64, u64>>>;

fn hold(held: &Held, addr: u64, size: u64) {
    let mut held = held.lock().unwrap();
    let rounded = size.next_multiple_of(512);
    if let Some((&start, &len)) = held.range(..addr + rounded).next_back() {
        assert!(
            start + len <= addr,
            "{addr:#x}+{rounded} handed out inside {start:#x}+{len}"
        );
    }
    held.insert(addr, rounded);
}

fn set_tag(tag: Option<&CString>) {
    let raw = tag.map_or(ptr::null(), |t| t.as_ptr());
    // SAFETY: `raw` is null or a NUL-terminated string valid for the call.
    assert_eq!(unsafe { cuvmm_set_tag(raw) }, 0, "{:?}", last_error());
}

/// Worker `t`: its own streams; worker 1 allocates into a graph pool it begins and ends, workers 2 and 3
/// under a tag of their own, which they put to sleep and wake (the test wakes it at the end, the memory
/// fraction back at 1: a wake under the monitor's lower fraction may run out of memory).
/// What a worker did: allocations served, pools begun, sleeps done.
#[derive(Debug, Default)]
struct Done {
    allocated: usize,
    begun: usize,
    slept: usize,
}

fn worker(t: usize, held: Held) -> Done {
    let mut did = Done::default();
    let mut rng = Rng(0x9E37_79B9_7F4A_7C15 ^ (t as u64 + 1));
    let own = stream(0x10 + t);
    let tag = (t >= 2).then(|| CString::new(format!("worker{t}")).unwrap());
    let pool = (0, 1);
    let mut live: Vec<(u64, u64)> = Vec::new();
    let mut asleep = false;
    let mut begun = false;
    set_tag(tag.as_ref());
    for _ in 0..STEPS {
        match rng.below(20) {
            0..=6 => {
                let size = match rng.below(4) {
                    0 => 1 + rng.below(4096),
                    1 => 1 + rng.below(2 << 20),
                    _ => 1 + rng.below(24 << 20),
                };
                let p = cuvmm_malloc(size as isize, DEVICE, own);
                no_panic("malloc");
                if !p.is_null() {
                    assert!(!asleep, "allocated under a sleeping tag");
                    hold(&held, p.addr() as u64, size);
                    live.push((p.addr() as u64, size));
                    did.allocated += 1;
                }
            }
            7..=14 if !live.is_empty() => {
                let (addr, size) = live.swap_remove(rng.below(live.len() as u64) as usize);
                held.lock().unwrap().remove(&addr);
                let p = ptr::with_exposed_provenance_mut(addr as usize);
                if rng.below(2) == 0 {
                    cuvmm_free(p, size as isize, DEVICE, own);
                } else {
                    cuvmm_free_any(p);
                }
                assert!(no_panic("free").is_none(), "{:?}", last_error());
            }
            15 if !live.is_empty() => {
                let (addr, _) = live[rng.below(live.len() as u64) as usize];
                let other = stream(0x20 + rng.below(3) as usize);
                cuvmm_record_stream(
                    ptr::with_exposed_provenance_mut(addr as usize),
                    DEVICE,
                    other,
                );
                assert!(no_panic("record_stream").is_none(), "{:?}", last_error());
            }
            16 if t == 1 && !begun => {
                // SAFETY: `only_stream` compares pointers only, from any thread.
                let begin = unsafe {
                    cuvmm_begin_allocate_to_pool(DEVICE, pool.0, pool.1, Some(only_stream), own)
                };
                no_panic("begin"); // refused while a tag's bytes are being copied
                begun = begin == 0;
                did.begun += usize::from(begun);
            }
            16 if t == 1 => {
                let end = cuvmm_end_allocate_to_pool(DEVICE, pool.0, pool.1);
                assert_eq!(end, 0, "{:?}", no_panic("end"));
                assert_eq!(cuvmm_release_pool(DEVICE, pool.0, pool.1), 0);
                begun = false;
            }
            17 | 18 if tag.is_some() => {
                let name = tag.as_ref().unwrap();
                if asleep {
                    // SAFETY: `name` is NUL-terminated and valid for the call.
                    let woke = unsafe { cuvmm_wake(DEVICE, name.as_ptr()) };
                    no_panic("wake");
                    asleep = woke != 0;
                } else {
                    // SAFETY: as above.
                    let slept =
                        unsafe { cuvmm_sleep(DEVICE, name.as_ptr(), rng.below(2) as c_int) };
                    no_panic("sleep"); // refused while worker 1's pool is begun
                    asleep = slept >= 0;
                    did.slept += usize::from(asleep);
                }
            }
            _ => {}
        }
    }
    if begun {
        assert_eq!(cuvmm_end_allocate_to_pool(DEVICE, pool.0, pool.1), 0);
        assert_eq!(cuvmm_release_pool(DEVICE, pool.0, pool.1), 0);
    }
    for (addr, size) in live {
        held.lock().unwrap().remove(&addr);
        cuvmm_free(
            ptr::with_exposed_provenance_mut(addr as usize),
            size as isize,
            DEVICE,
            own,
        );
        assert!(no_panic("free").is_none(), "{:?}", last_error());
    }
    set_tag(None);
    did
}

/// The monitoring thread: everything that reads or trims the whole device, until the workers are done.
fn monitor(done: &AtomicBool) -> usize {
    let mut rounds = 0;
    let allocator = global().unwrap().allocator(DEVICE).unwrap();
    while !done.load(Ordering::Acquire) {
        cuvmm_empty_cache(DEVICE);
        no_panic("empty_cache");
        cuvmm_release_stranded(DEVICE);
        no_panic("release_stranded");
        assert_eq!(cuvmm_reset_peak_stats(DEVICE), 0, "{:?}", last_error());
        let fraction = if rounds % 4 == 0 { 0.6 } else { 1.0 };
        assert_eq!(
            cuvmm_set_memory_fraction(DEVICE, fraction),
            0,
            "{:?}",
            last_error()
        );
        let mut stats = CDeviceStats::default();
        // SAFETY: `stats` is valid for one write of the struct.
        let got = unsafe { cuvmm_get_device_stats(DEVICE, &mut stats) };
        assert_eq!(got, 0, "{:?}", last_error());
        for text in [cuvmm_memory_stats_json(DEVICE), cuvmm_tags_json(DEVICE)] {
            assert!(!text.is_null(), "{:?}", last_error());
            // SAFETY: a string the library returned, freed once.
            unsafe { cuvmm_string_free(text) };
        }
        let snapshot = cuvmm_snapshot_take(DEVICE);
        assert!(!snapshot.is_null(), "{:?}", last_error());
        // SAFETY: a snapshot the library returned, freed once.
        unsafe { cuvmm_snapshot_free(snapshot) };
        allocator.check_invariants().unwrap();
        rounds += 1;
    }
    assert_eq!(cuvmm_set_memory_fraction(DEVICE, 1.0), 0);
    rounds
}

#[test]
fn threads_calling_every_kind_of_function_at_once_keep_the_allocator_whole() {
    cuvmm_torch::install(Settings::sim(1 << 30, 1));
    let held: Held = Arc::default();
    let done = AtomicBool::new(false);
    let rounds = std::thread::scope(|scope| {
        let monitor = scope.spawn(|| monitor(&done));
        let workers: Vec<_> = (0..WORKERS)
            .map(|t| {
                let held = held.clone();
                scope.spawn(move || worker(t, held))
            })
            .collect();
        let did: Vec<Done> = workers.into_iter().map(|w| w.join().unwrap()).collect();
        done.store(true, Ordering::Release);
        (did, monitor.join().unwrap())
    });
    let (did, rounds) = rounds;
    // A sleeping tag allocates nothing, a wake is refused while worker 1's pool is begun, and tagged memory
    // shares no page: the tagged workers are served less often.
    let allocated: usize = did.iter().map(|d| d.allocated).sum();
    assert!(allocated > STEPS / 2, "{did:?}");
    assert!(
        did[1].begun > 0 && did[2].slept + did[3].slept > 0,
        "{did:?}"
    );
    assert!(rounds > 0, "the monitor never ran");
    assert!(held.lock().unwrap().is_empty());
    for t in 2..WORKERS {
        let name = CString::new(format!("worker{t}")).unwrap();
        // SAFETY: `name` is NUL-terminated and valid for the call.
        let woke = unsafe { cuvmm_wake(DEVICE, name.as_ptr()) };
        assert_eq!(woke, 0, "{:?}", no_panic("wake"));
    }
    cuvmm_empty_cache(DEVICE);
    let allocator = global().unwrap().allocator(DEVICE).unwrap();
    allocator.check_invariants().unwrap();
    let mut stats = CDeviceStats::default();
    // SAFETY: `stats` is valid for one write of the struct.
    assert_eq!(unsafe { cuvmm_get_device_stats(DEVICE, &mut stats) }, 0);
    assert_eq!(
        (
            stats.allocation.all.current,
            stats.allocated_bytes.all.current
        ),
        (0, 0),
        "everything was freed"
    );
    assert_eq!(stats.active_bytes.all.current, 0, "every pending free done");
}
