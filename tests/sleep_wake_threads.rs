//! Sleep and wake through the facade while other threads use the allocator (issue 44): the copies of a
//! tag's bytes run without the allocator's lock, so other threads keep allocating and freeing, while what
//! concerns the tag is refused (an allocation under it: `TagAsleep`; a sleep, a wake or a release of its
//! host memory: `TagBusy`; a free of its memory waits for the wake, `tests/sleep_wake.rs`), and nothing unmaps its pages (compaction and
//! `empty_cache` leave them, and the driver refuses an `unmap` of a range a copy job copies).
//!
//! A gate in the driver's copy job holds a sleep in its copies for as long as the test needs; every step
//! the test takes meanwhile runs on another thread with a time limit, so an implementation that held the
//! lock through the copies fails here rather than hanging. The same gate can hold the free of a piece of
//! host memory (`cuMemFreeHost` may wait for the device): that too happens without the lock.

use cuvmm::driver::sim::{COPY_STREAM, SimConfig, SimDriver};
use cuvmm::driver::{
    CopyDirection, CopyJob, CopyPlan, CopyRun, Driver, DriverError, Forward, HostBytes, HostCopy,
    HostMemory,
};
use cuvmm::expandable::Expandable;
use cuvmm::strategy::GraphPools as _;
use cuvmm::{Allocator, Config, Error, GraphPool, StreamFilter, StreamId};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::channel;
use std::sync::{Arc, Barrier};
use std::thread::JoinHandle;
use std::time::Duration;

const PAGE: u64 = 4096;
const PAGES: u64 = 64;

/// Holds the first copy job it is armed for at its first step until the test releases it; with
/// `hold_free`, the first free of a piece of host memory the jobs allocated.
#[derive(Debug)]
struct Gate {
    armed: AtomicBool,
    hold_free: AtomicBool,
    reached: Barrier,
    release: Barrier,
}

impl Gate {
    fn new(armed: bool) -> Arc<Self> {
        Arc::new(Gate {
            armed: AtomicBool::new(armed),
            hold_free: AtomicBool::new(false),
            reached: Barrier::new(2),
            release: Barrier::new(2),
        })
    }
}

/// The simulator, with its copy jobs behind a [`Gate`].
struct Gated {
    sim: SimDriver,
    gate: Arc<Gate>,
}

impl Forward for Gated {
    type Inner = SimDriver;
    fn inner(&self) -> &SimDriver {
        &self.sim
    }
    fn inner_mut(&mut self) -> &mut SimDriver {
        &mut self.sim
    }
    fn start_copies(&mut self, plan: CopyPlan) -> Result<CopyJob, DriverError> {
        let job = Driver::start_copies(&mut self.sim, plan)?;
        let armed = self.gate.armed.swap(false, Ordering::SeqCst);
        let gate = Arc::clone(&self.gate);
        Ok(job.wrap(|inner| Box::new(GatedRun { inner, gate, armed })))
    }
}

struct GatedRun {
    inner: Box<dyn CopyRun>,
    gate: Arc<Gate>,
    /// Whether the next step waits at the gate.
    armed: bool,
}

impl GatedRun {
    fn pass(&mut self) {
        if std::mem::take(&mut self.armed) {
            self.gate.reached.wait();
            self.gate.release.wait();
        }
    }
}

/// A piece of host memory whose free waits at the gate when it holds frees.
struct GatedPiece {
    inner: HostMemory,
    gate: Arc<Gate>,
}

impl HostBytes for GatedPiece {
    fn bytes(&self) -> &[u8] {
        self.inner.as_slice()
    }
    fn bytes_mut(&mut self) -> &mut [u8] {
        self.inner.as_mut_slice()
    }
    fn pinned(&self) -> bool {
        self.inner.is_pinned()
    }
    fn as_any_mut(&mut self) -> &mut dyn std::any::Any {
        self
    }
}

impl Drop for GatedPiece {
    fn drop(&mut self) {
        if self.gate.hold_free.swap(false, Ordering::SeqCst) {
            self.gate.reached.wait();
            self.gate.release.wait();
        }
    }
}

impl CopyRun for GatedRun {
    fn alloc(&mut self, len: u64) -> Result<HostMemory, DriverError> {
        self.pass();
        let inner = self.inner.alloc(len)?;
        let gate = Arc::clone(&self.gate);
        Ok(HostMemory::new(GatedPiece { inner, gate }))
    }
    fn copy(
        &mut self,
        copy: &HostCopy,
        direction: CopyDirection,
        host: &mut HostMemory,
    ) -> Result<(), DriverError> {
        self.pass();
        self.inner.copy(copy, direction, host)
    }
    fn record(&mut self) -> Result<(), DriverError> {
        self.pass();
        self.inner.record()
    }
    fn wait(&mut self, recorded: bool) -> Result<(), DriverError> {
        self.inner.wait(recorded)
    }
    fn finish(&mut self) {
        self.inner.finish();
    }
}

type Alloc = Allocator<Expandable<Gated>>;

fn allocator(gate: &Arc<Gate>) -> Alloc {
    let sim = SimDriver::new(
        SimConfig::default()
            .with_capacity(PAGES * PAGE)
            .with_granularity(PAGE)
            .with_backing_store(true),
    );
    let config = Config {
        small_size: 1024,
        ..Config::default()
    }
    .with_sleep_copy(2 * PAGE);
    let driver = Gated {
        sim,
        gate: Arc::clone(gate),
    };
    Allocator::expandable(driver, config).unwrap()
}

/// Runs `f` with a handle of `a` on another thread.
fn spawn_with<T: Send + 'static>(
    a: &Alloc,
    f: impl FnOnce(Alloc) -> T + Send + 'static,
) -> JoinHandle<T> {
    let a = a.clone();
    std::thread::spawn(move || f(a))
}

/// Runs `f` on another thread and waits at most ten seconds for it.
fn within<T: Send + 'static>(what: &str, f: impl FnOnce() -> T + Send + 'static) -> T {
    let (send, receive) = channel();
    std::thread::spawn(move || send.send(f()));
    receive
        .recv_timeout(Duration::from_secs(10))
        .unwrap_or_else(|_| panic!("{what} waited for the lock, held through the copies or a free"))
}

fn bytes(n: u64, value: u8) -> Vec<u8> {
    vec![value; n as usize]
}

#[test]
fn other_threads_allocate_while_a_sleep_copies_and_what_concerns_the_tag_is_refused() {
    let gate = Gate::new(true);
    let a = allocator(&gate);
    let s = StreamId(1);
    let kv = a.alloc_tagged_raw(8 * PAGE, s, "kv").unwrap();
    a.with_strategy(|st| st.driver_mut().sim.write(kv, &bytes(8 * PAGE, 7)))
        .unwrap();
    let before = a.stats();

    let sleeper = spawn_with(&a, |a| a.sleep("kv", true));
    gate.reached.wait();

    // The sleep is in its copies, holding no lock.
    let b = a.clone();
    within("an allocation on another stream", move || {
        let p = b.alloc_raw(6 * PAGE, StreamId(2)).unwrap();
        b.free_raw(p).unwrap();
        let q = b.alloc_tagged_raw(2 * PAGE, StreamId(2), "other").unwrap();
        b.free_raw(q).unwrap();
    });
    let b = a.clone();
    within("what concerns the tag", move || {
        assert!(matches!(
            b.alloc_tagged_raw(PAGE, s, "kv"),
            Err(Error::TagAsleep { .. })
        ));
        assert!(matches!(b.sleep("kv", true), Err(Error::TagBusy { .. })));
        assert!(matches!(b.wake("kv"), Err(Error::TagBusy { .. })));
        assert!(matches!(
            b.release_host_buffers(Some("kv")),
            Err(Error::TagBusy { .. })
        ));
        // Giving every idle page back takes none of the tag's.
        b.empty_cache().unwrap();
        b.trim(u64::MAX).unwrap();
        let stats = b.stats();
        assert_eq!(stats.reserved_bytes.current, 8 * PAGE);
        assert_eq!(
            stats.host_kept_bytes,
            8 * PAGE,
            "the pieces the copies hold"
        );
        assert_eq!(b.tags()[0].state, "copying");
        b.check_invariants().unwrap();
        b.with_strategy(|st| {
            let sim = &mut st.driver_mut().sim;
            assert!(sim.is_accessible(kv));
            assert_eq!(
                Driver::unmap(sim, kv, PAGE),
                Err(DriverError::UnmapWhileInUse {
                    va: kv,
                    stream: COPY_STREAM
                }),
                "the driver keeps the copies' pages mapped"
            );
        });
    });
    gate.release.wait();
    assert_eq!(sleeper.join().unwrap().unwrap(), 8 * PAGE);
    assert_eq!(a.stats().asleep_bytes, 8 * PAGE);
    a.check_invariants().unwrap();

    // Memory the tag gave back serves others, then the wake puts the bytes back.
    let hog = a.alloc_raw((PAGES - 2) * PAGE, StreamId(2)).unwrap();
    a.with_strategy(|st| st.driver_mut().sim.write(hog, &bytes(PAGE, 9)))
        .unwrap();
    a.free_raw(hog).unwrap();
    a.wake("kv").unwrap();
    let read = a.with_strategy(|st| st.driver().sim.read(kv, (8 * PAGE) as usize));
    assert_eq!(read.unwrap(), bytes(8 * PAGE, 7));
    assert_eq!(a.stats().num_ooms, before.num_ooms);
    a.free_raw(kv).unwrap();
    a.check_invariants().unwrap();
}

/// With `job` (a sleep or a preparation on another thread) held at the gate: a pool may not begin now, and
/// one announced on a third thread begins only once the gate lets the job go on; then the pool is ended
/// and released. Returns the job's result.
fn a_pool_waits_for(a: &Alloc, gate: &Gate, job: JoinHandle<Result<u64, Error>>) -> u64 {
    assert!(matches!(
        a.with_strategy(|st| st.ready_to_begin_pool()),
        Err(Error::TagBusy {
            operation: "begin_allocate_to_pool",
            ..
        })
    ));
    let (send, begun) = channel();
    let capturer = spawn_with(a, move |a| {
        let filter = StreamFilter::Streams(vec![StreamId(5)]);
        send.send(a.begin_allocate_to_pool(GraphPool(1, 0), filter))
    });
    assert!(
        begun.recv_timeout(Duration::from_millis(300)).is_err(),
        "the pool began while the job pinned or copied"
    );
    gate.release.wait();
    let out = job.join().unwrap().unwrap();
    let began = begun.recv_timeout(Duration::from_secs(10));
    assert!(matches!(began, Ok(Ok(()))), "{began:?}");
    capturer.join().unwrap().expect("the test still listens");
    a.end_allocate_to_pool(GraphPool(1, 0)).unwrap();
    a.release_pool(GraphPool(1, 0)).unwrap();
    out
}

/// A capture announced while another thread's sleep copies its bytes begins only once the copies are over:
/// they pin host memory, which a global-mode capture forbids on every thread.
#[test]
fn a_pool_begun_while_a_sleep_copies_waits_for_the_copies() {
    let gate = Gate::new(true);
    let a = allocator(&gate);
    let kv = a.alloc_tagged_raw(8 * PAGE, StreamId(1), "kv").unwrap();
    let sleeper = spawn_with(&a, |a| a.sleep("kv", true));
    gate.reached.wait();
    assert_eq!(a_pool_waits_for(&a, &gate, sleeper), 8 * PAGE);
    a.wake("kv").unwrap();
    a.free_raw(kv).unwrap();
    a.check_invariants().unwrap();
}

/// `prepare_sleep` pins without the lock: meanwhile other threads allocate, under the tag too, the tag
/// stays awake and counts the memory being pinned, a second preparation has nothing to do, and a capture
/// waits for the pinning to end (a global-mode capture forbids pinning on every thread). The first sleep
/// after it pins nothing.
#[test]
fn a_preparation_pins_without_the_lock_and_a_capture_waits_for_it() {
    let gate = Gate::new(true);
    let a = allocator(&gate);
    let kv = a.alloc_tagged_raw(8 * PAGE, StreamId(1), "kv").unwrap();
    a.with_strategy(|st| st.driver_mut().sim.write(kv, &bytes(8 * PAGE, 7)))
        .unwrap();
    let preparer = spawn_with(&a, |a| a.prepare_sleep("kv"));
    gate.reached.wait();

    let b = a.clone();
    within("allocations while a preparation pins", move || {
        let p = b.alloc_tagged_raw(PAGE, StreamId(2), "kv").unwrap();
        b.free_raw(p).unwrap();
        let q = b.alloc_raw(4 * PAGE, StreamId(2)).unwrap();
        b.free_raw(q).unwrap();
        assert_eq!(b.prepare_sleep("kv").unwrap(), 0, "one is underway");
        assert_eq!(b.tags()[0].state, "awake");
        assert_eq!(b.stats().host_kept_bytes, 8 * PAGE, "counted while pinned");
        b.check_invariants().unwrap();
    });
    assert_eq!(a_pool_waits_for(&a, &gate, preparer), 8 * PAGE);

    let pinned = |a: &Alloc| a.with_strategy(|st| st.driver().sim.pinned_host_bytes());
    assert_eq!(pinned(&a), 8 * PAGE);
    a.sleep("kv", true).unwrap();
    assert_eq!(pinned(&a), 8 * PAGE, "the sleep pinned nothing");
    a.wake("kv").unwrap();
    let read = a.with_strategy(|st| st.driver().sim.read(kv, (8 * PAGE) as usize));
    assert_eq!(read.unwrap(), bytes(8 * PAGE, 7));
    a.free_raw(kv).unwrap();
    a.check_invariants().unwrap();
}

/// Freeing page-locked host memory may wait for the device (`cuMemFreeHost`), so the tags' buffers are
/// freed after the allocator's lock is let go of: a piece beyond what a tag that shrank needs (at its
/// sleep), and the buffers `release_host_buffers` gives back. Other threads allocate while a free waits.
#[test]
fn host_memory_is_freed_without_the_lock_while_other_threads_allocate() {
    let gate = Gate::new(false);
    let a = allocator(&gate);
    let s = StreamId(1);
    let kv = a.alloc_tagged_raw(8 * PAGE, s, "kv").unwrap();
    let tail = a.alloc_tagged_raw(2 * PAGE, s, "kv").unwrap();
    let pinned = |a: &Alloc| a.with_strategy(|st| st.driver().sim.pinned_host_bytes());
    a.sleep("kv", true).unwrap();
    a.wake("kv").unwrap();
    assert_eq!(pinned(&a), 10 * PAGE);
    a.free_raw(tail).unwrap();

    let held_free = |a: &Alloc, what: &'static str, f: fn(&Alloc) -> Result<u64, Error>| {
        gate.hold_free.store(true, Ordering::SeqCst);
        let call = spawn_with(a, move |a| f(&a));
        gate.reached.wait();
        // A piece's free waits: the lock must be free.
        let b = a.clone();
        within(what, move || {
            let p = b.alloc_raw(4 * PAGE, StreamId(2)).unwrap();
            b.free_raw(p).unwrap();
            b.check_invariants().unwrap();
        });
        gate.release.wait();
        call.join().unwrap().unwrap()
    };
    let slept = held_free(&a, "an allocation while a sleep frees a piece", |a| {
        a.sleep("kv", true)
    });
    assert_eq!(slept, 10 * PAGE, "the freed tail's pages are unmapped too");
    assert_eq!(pinned(&a), 8 * PAGE, "the piece beyond is freed");
    a.wake("kv").unwrap();
    let released = held_free(&a, "an allocation while buffers are released", |a| {
        a.release_host_buffers(None)
    });
    assert_eq!(released, 8 * PAGE);
    assert_eq!((pinned(&a), a.stats().host_kept_bytes), (0, 0));
    a.free_raw(kv).unwrap();
    a.check_invariants().unwrap();
}

/// Four threads allocate, write and free under other tags and untagged while a fifth sleeps and wakes a
/// tag twenty times with its bytes kept: every byte of every allocation survives, and the books balance.
#[test]
fn sleep_and_wake_cycles_race_allocations_on_other_threads() {
    let gate = Gate::new(false);
    let a = allocator(&gate);
    let kv = a.alloc_tagged_raw(12 * PAGE, StreamId(1), "kv").unwrap();
    a.with_strategy(|st| st.driver_mut().sim.write(kv, &bytes(12 * PAGE, 5)))
        .unwrap();
    std::thread::scope(|scope| {
        let cycles = scope.spawn(|| {
            for _ in 0..20 {
                a.sleep("kv", true).unwrap();
                a.wake("kv").unwrap();
            }
        });
        for t in 0..4u8 {
            let a = &a;
            scope.spawn(move || {
                let stream = StreamId(2 + u64::from(t));
                for i in 0..50u64 {
                    let size = (1 + (i + u64::from(t)) % 3) * PAGE;
                    let tag = ["", "a", "b"][(i % 3) as usize];
                    let allocated = match tag {
                        "" => a.alloc_raw(size, stream),
                        tag => a.alloc_tagged_raw(size, stream, tag),
                    };
                    // Four threads and a woken tag may fill the device: out of memory is an answer here.
                    let Ok(p) = allocated else { continue };
                    let value = 10 + t;
                    a.with_strategy(|st| st.driver_mut().sim.write(p, &bytes(size, value)))
                        .unwrap();
                    let read = a.with_strategy(|st| st.driver().sim.read(p, size as usize));
                    assert_eq!(read.unwrap(), bytes(size, value));
                    a.free_raw(p).unwrap();
                }
            });
        }
        cycles.join().unwrap();
    });
    let read = a.with_strategy(|st| st.driver().sim.read(kv, (12 * PAGE) as usize));
    assert_eq!(read.unwrap(), bytes(12 * PAGE, 5));
    a.free_raw(kv).unwrap();
    a.empty_cache().unwrap();
    a.check_invariants().unwrap();
    assert_eq!(a.stats().reserved_bytes.current, 0);
}
