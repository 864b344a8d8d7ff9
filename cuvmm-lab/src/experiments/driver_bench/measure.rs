//! The measurements of `driver-bench` ([`super`]): each call timed alone, medians per page size.

use cuvmm::driver::{Driver, DriverCounters, DriverError, PhysHandle};
use serde::Serialize;

/// Median costs for one page size, in microseconds.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct PageBench {
    /// The physical page size in bytes.
    pub page_bytes: u64,
    /// `cuMemCreate`.
    pub create_us: f64,
    /// `cuMemMap`.
    pub map_us: f64,
    /// `cuMemSetAccess`.
    pub set_access_us: f64,
    /// `cuMemUnmap`.
    pub unmap_us: f64,
    /// `cuMemRelease`.
    pub release_us: f64,
    /// Growing by one page with a new handle: create + map + set_access.
    pub grow_fresh_us: f64,
    /// Growing by one page with a handle moved from elsewhere: unmap + map + set_access.
    pub grow_reused_us: f64,
    /// Granularity-sized handles in a run of `page_bytes`.
    pub run_pages: u64,
    /// `cuMemSetAccess` once per handle of the run, summed.
    pub set_access_per_page_us: f64,
    /// One `cuMemSetAccess` over the whole run.
    pub set_access_run_us: f64,
    /// `cuMemUnmap` once per handle of the run, summed.
    pub unmap_per_page_us: f64,
    /// One `cuMemUnmap` over the whole run.
    pub unmap_run_us: f64,
    /// `cuMemAlloc` of `page_bytes` (what PyTorch's default allocator calls).
    pub malloc_us: f64,
    /// `cuMemFree` of it.
    pub free_us: f64,
}

/// Median costs of stream calls on the default stream, in microseconds.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct StreamBench {
    /// `cuStreamSynchronize` with nothing queued.
    pub synchronize_idle_us: f64,
    /// `cuEventRecord` (with the event's creation).
    pub record_event_us: f64,
    /// `cuEventQuery` right after.
    pub query_event_us: f64,
}

/// Per-call times in nanoseconds, one entry per sample.
#[derive(Debug, Default)]
pub(super) struct Samples {
    create: Vec<u64>,
    map: Vec<u64>,
    set_access: Vec<u64>,
    unmap: Vec<u64>,
    release: Vec<u64>,
    grow_fresh: Vec<u64>,
    grow_reused: Vec<u64>,
}

impl Samples {
    pub(super) fn medians(mut self, page: u64) -> PageBench {
        PageBench {
            page_bytes: page,
            create_us: median_us(&mut self.create),
            map_us: median_us(&mut self.map),
            set_access_us: median_us(&mut self.set_access),
            unmap_us: median_us(&mut self.unmap),
            release_us: median_us(&mut self.release),
            grow_fresh_us: median_us(&mut self.grow_fresh),
            grow_reused_us: median_us(&mut self.grow_reused),
            run_pages: 0,
            set_access_per_page_us: 0.0,
            set_access_run_us: 0.0,
            unmap_per_page_us: 0.0,
            unmap_run_us: 0.0,
            malloc_us: 0.0,
            free_us: 0.0,
        }
    }
}

/// The median of `ns`, in microseconds (0 if empty).
fn median_us(ns: &mut [u64]) -> f64 {
    if ns.is_empty() {
        return 0.0;
    }
    ns.sort_unstable();
    let mid = ns.len() / 2;
    let median = if ns.len() % 2 == 0 {
        (ns[mid - 1] as f64 + ns[mid] as f64) / 2.0
    } else {
        ns[mid] as f64
    };
    median / 1_000.0
}

/// The driver time one call costs: the change in the counters' time across it.
fn timed<T, D: Driver>(
    driver: &mut D,
    call: impl FnOnce(&mut D) -> Result<T, DriverError>,
) -> Result<(T, u64), DriverError> {
    let before: DriverCounters = driver.counters();
    let value = call(driver)?;
    Ok((value, driver.counters().time_ns - before.time_ns))
}

/// The times of the calls of one repetition, in nanoseconds.
#[derive(Clone, Copy, Debug, Default)]
struct Rep {
    create: u64,
    map_a: u64,
    access_a: u64,
    unmap_a: u64,
    map_b: u64,
    access_b: u64,
    unmap_b: u64,
    release: u64,
}

impl Samples {
    fn push(&mut self, r: Rep) {
        self.create.push(r.create);
        self.map.extend([r.map_a, r.map_b]);
        self.set_access.extend([r.access_a, r.access_b]);
        self.unmap.extend([r.unmap_a, r.unmap_b]);
        self.release.push(r.release);
        self.grow_fresh.push(r.create + r.map_a + r.access_a);
        self.grow_reused.push(r.unmap_a + r.map_b + r.access_b);
    }
}

/// Runs one warm-up and `repetitions` measured repetitions for one page size.
pub(super) fn measure<D: Driver>(
    driver: &mut D,
    page: u64,
    repetitions: usize,
) -> Result<Samples, DriverError> {
    let range = driver.reserve(2 * page)?;
    let (a, b) = (range.start, range.start + page);
    let mut samples = Samples::default();
    let mut outcome = Ok(());
    for rep in 0..=repetitions {
        match repetition(driver, page, a, b) {
            Ok(times) if rep > 0 => samples.push(times),
            Ok(_) => {}
            Err(e) => {
                outcome = Err(e);
                break;
            }
        }
    }
    let freed = driver.free_reservation(range);
    outcome?;
    freed?;
    Ok(samples)
}

/// One repetition: fresh growth at `a`, reused growth at `b`, teardown. On failure, gives back what it
/// holds (logging what cannot be) and returns the first error.
fn repetition<D: Driver>(driver: &mut D, page: u64, a: u64, b: u64) -> Result<Rep, DriverError> {
    let (handle, create) = timed(driver, |d| d.create(page))?;
    let mut mapped_at = None;
    match grow_and_move(driver, page, a, b, handle, &mut mapped_at) {
        Ok(rep) => {
            let (_, release) = timed(driver, |d| d.release(handle))?;
            Ok(Rep {
                create,
                release,
                ..rep
            })
        }
        Err(err) => {
            let unmapped = mapped_at.map_or(Ok(()), |at| driver.unmap(at, page));
            for cleanup in [unmapped, driver.release(handle)] {
                if let Err(e) = cleanup {
                    tracing::warn!(%e, "driver-bench: cleanup after a failed call failed too");
                }
            }
            Err(err)
        }
    }
}

/// Maps `handle` at `a` (fresh growth), moves it to `b` (reused growth), and unmaps it. `mapped_at` says
/// where it is mapped, for cleanup after a failure.
fn grow_and_move<D: Driver>(
    driver: &mut D,
    page: u64,
    a: u64,
    b: u64,
    handle: PhysHandle,
    mapped_at: &mut Option<u64>,
) -> Result<Rep, DriverError> {
    let (_, map_a) = timed(driver, |d| d.map(a, page, handle))?;
    *mapped_at = Some(a);
    let (_, access_a) = timed(driver, |d| d.set_access(a, page))?;
    let (_, unmap_a) = timed(driver, |d| d.unmap(a, page))?;
    *mapped_at = None;
    let (_, map_b) = timed(driver, |d| d.map(b, page, handle))?;
    *mapped_at = Some(b);
    let (_, access_b) = timed(driver, |d| d.set_access(b, page))?;
    let (_, unmap_b) = timed(driver, |d| d.unmap(b, page))?;
    *mapped_at = None;
    Ok(Rep {
        map_a,
        access_a,
        unmap_a,
        map_b,
        access_b,
        unmap_b,
        ..Rep::default()
    })
}

/// The same size as a run of granularity-sized handles: `set_access` and `unmap` per handle (summed) and
/// over the whole run, one warm-up and `repetitions` measured repetitions, medians into `bench`.
pub(super) fn measure_run<D: Driver>(
    driver: &mut D,
    page: u64,
    repetitions: usize,
    bench: &mut PageBench,
) -> Result<(), DriverError> {
    let g = driver.granularity();
    let count = (page / g) as usize;
    let range = driver.reserve(page)?;
    let mut handles = Vec::with_capacity(count);
    let mut mapped = 0;
    let outcome = run_repetitions(
        driver,
        range.start,
        g,
        repetitions,
        count,
        &mut handles,
        &mut mapped,
    );
    // Cleanup after a failure: what is mapped, then every handle, then the reservation.
    for i in 0..mapped {
        if let Err(e) = driver.unmap(range.start + i as u64 * g, g) {
            tracing::warn!(%e, "driver-bench: cleanup unmap failed");
        }
    }
    for handle in handles {
        if let Err(e) = driver.release(handle) {
            tracing::warn!(%e, "driver-bench: cleanup release failed");
        }
    }
    let freed = driver.free_reservation(range);
    let [
        mut per_page_access,
        mut run_access,
        mut per_page_unmap,
        mut run_unmap,
    ] = outcome?;
    freed?;
    bench.run_pages = count as u64;
    bench.set_access_per_page_us = median_us(&mut per_page_access);
    bench.set_access_run_us = median_us(&mut run_access);
    bench.unmap_per_page_us = median_us(&mut per_page_unmap);
    bench.unmap_run_us = median_us(&mut run_unmap);
    Ok(())
}

/// The repetitions of [`measure_run`] on a run of `count` handles: samples of set_access per page, over
/// the run, unmap per page, over the run. `handles` and `mapped` (how many handles are mapped, from
/// `start`) say what to clean up.
fn run_repetitions<D: Driver>(
    driver: &mut D,
    start: u64,
    g: u64,
    repetitions: usize,
    count: usize,
    handles: &mut Vec<PhysHandle>,
    mapped: &mut usize,
) -> Result<[Vec<u64>; 4], DriverError> {
    let mut samples: [Vec<u64>; 4] = Default::default();
    for rep in 0..=repetitions {
        let (mut per_page_access, mut per_page_unmap) = (0, 0);
        let (mut run_access, mut run_unmap) = (0, 0);
        for pass in [false, true] {
            for i in 0..count {
                if handles.len() == i {
                    handles.push(driver.create(g)?);
                }
                driver.map(start + i as u64 * g, g, handles[i])?;
                *mapped = i + 1;
            }
            if pass {
                run_access = timed(driver, |d| d.set_access(start, count as u64 * g))?.1;
                run_unmap = timed(driver, |d| d.unmap(start, count as u64 * g))?.1;
            } else {
                for i in 0..count {
                    let va = start + i as u64 * g;
                    per_page_access += timed(driver, |d| d.set_access(va, g))?.1;
                }
                for i in (0..count).rev() {
                    let va = start + i as u64 * g;
                    per_page_unmap += timed(driver, |d| d.unmap(va, g))?.1;
                    *mapped = i;
                }
            }
            *mapped = 0;
        }
        if rep > 0 {
            for (list, value) in
                samples
                    .iter_mut()
                    .zip([per_page_access, run_access, per_page_unmap, run_unmap])
            {
                list.push(value);
            }
        }
    }
    Ok(samples)
}

/// `cuMemAlloc` and `cuMemFree` of `page` bytes: one warm-up and `repetitions` measured pairs.
pub(super) fn measure_malloc<D: Driver>(
    driver: &mut D,
    page: u64,
    repetitions: usize,
    bench: &mut PageBench,
) -> Result<(), DriverError> {
    let (mut malloc, mut free) = (Vec::new(), Vec::new());
    for rep in 0..=repetitions {
        let (ptr, m) = timed(driver, |d| d.malloc(page))?;
        let ((), f) = timed(driver, |d| d.free(ptr))?;
        if rep > 0 {
            malloc.push(m);
            free.push(f);
        }
    }
    bench.malloc_us = median_us(&mut malloc);
    bench.free_us = median_us(&mut free);
    Ok(())
}

/// A synchronization of the idle default stream, an event record on it and a query of that event.
pub(super) fn measure_stream<D: Driver>(
    driver: &mut D,
    repetitions: usize,
) -> Result<StreamBench, DriverError> {
    let stream = cuvmm::driver::StreamId::DEFAULT;
    let (mut sync, mut record, mut query) = (Vec::new(), Vec::new(), Vec::new());
    for rep in 0..=repetitions {
        let ((), s) = timed(driver, |d| d.synchronize(stream))?;
        let (event, r) = timed(driver, |d| d.record_event(stream))?;
        let queried = timed(driver, |d| d.event_complete(event));
        driver.destroy_event(event)?;
        let (_, q) = queried?;
        if rep > 0 {
            sync.push(s);
            record.push(r);
            query.push(q);
        }
    }
    Ok(StreamBench {
        synchronize_idle_us: median_us(&mut sync),
        record_event_us: median_us(&mut record),
        query_event_us: median_us(&mut query),
    })
}
