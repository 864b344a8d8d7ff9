//! `cuda-async`: CUDA's own stream-ordered allocator as a comparison allocator, on a GPU only
//! (`--allocator cuda-async --backend cuda`). Allocations are cuMemAllocAsync / cuMemFreeAsync on the
//! device's default memory pool, its release threshold at the maximum so that it keeps what it reserved,
//! which is cudarc's default allocation with the pool tuned as a caching allocator would be
//! ([`AsyncPool`]). Reserved memory is the pool's (`CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT`), its peak the
//! pool's high watermark (`CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH`, reset when the allocator is built).
//!
//! The pool's blocks are the driver's secret: this allocator has no snapshot, no invariants to walk beyond
//! its own books, and counts no driver calls (cuvmm's counters see only the calls it makes itself).

use cuvmm::driver::cuda::AsyncPool;
use cuvmm::driver::{DriverCounters, DriverError, StreamId};
use cuvmm::strategy::Strategy;
use cuvmm::strategy::error::{Error, InvariantViolation};
use cuvmm::strategy::oom::OutOfMemory;
use cuvmm::strategy::stats::{Stat, Stats};

/// The name it reports, and `--allocator` takes (`allocators::CUDA_ASYNC`, which the tools know without
/// the `cuda` feature).
pub const NAME: &str = "cuda-async";

/// CUDA's stream-ordered allocator on one device.
#[derive(Debug)]
pub struct CudaAsync {
    pool: AsyncPool,
    ordinal: usize,
    /// Live allocations and bytes, with their peaks and totals.
    allocation: Stat,
    allocated_bytes: Stat,
    num_ooms: u64,
}

impl CudaAsync {
    /// The default pool of CUDA device `ordinal`, kept whole.
    ///
    /// # Errors
    /// No driver or device, or a failing driver call.
    pub fn new(ordinal: usize) -> Result<Self, Error> {
        Ok(Self {
            pool: AsyncPool::new(ordinal)?,
            ordinal,
            allocation: Stat::default(),
            allocated_bytes: Stat::default(),
            num_ooms: 0,
        })
    }

    fn out_of_memory(&mut self, size: u64, stream: StreamId, free: u64) -> Error {
        self.num_ooms += 1;
        let (reserved, _) = self.pool.reserved().unwrap_or((0, 0));
        Error::OutOfMemory(Box::new(OutOfMemory {
            allocator: NAME,
            device: self.ordinal,
            requested: size,
            alloc_size: size,
            stream,
            device_free: free,
            allocated: self.allocated_bytes.current,
            reserved,
            ..OutOfMemory::default()
        }))
    }
}

impl Strategy for CudaAsync {
    fn name(&self) -> &'static str {
        NAME
    }

    fn alloc(&mut self, size: u64, stream: StreamId) -> Result<u64, Error> {
        match self.pool.alloc(size, stream) {
            Ok(ptr) => {
                self.allocation.add(1);
                self.allocated_bytes.add(size);
                Ok(ptr)
            }
            Err(DriverError::OutOfMemory { free, .. }) => {
                Err(self.out_of_memory(size, stream, free))
            }
            Err(e) => Err(e.into()),
        }
    }

    fn free(&mut self, addr: u64) -> Result<(), Error> {
        let size = self.pool.size_of(addr);
        self.pool.free(addr)?;
        self.allocation.sub(1);
        self.allocated_bytes.sub(size.unwrap_or(0));
        Ok(())
    }

    fn empty_cache(&mut self) -> Result<(), Error> {
        Ok(self.pool.trim_to(0)?)
    }

    fn trim(&mut self, bytes: u64) -> Result<u64, Error> {
        let (before, _) = self.pool.reserved()?;
        self.pool.trim_to(before.saturating_sub(bytes))?;
        let (after, _) = self.pool.reserved()?;
        Ok(before.saturating_sub(after))
    }

    fn stats(&self) -> Stats {
        let (current, high) = self.pool.reserved().unwrap_or((0, 0));
        Stats {
            allocated_bytes: self.allocated_bytes,
            active_bytes: self.allocated_bytes,
            requested_bytes: self.allocated_bytes,
            allocation: self.allocation,
            reserved_bytes: Stat {
                current,
                peak: high,
                ..Stat::default()
            },
            num_ooms: self.num_ooms,
            ..Stats::default()
        }
    }

    fn reserved_bytes(&self) -> u64 {
        self.pool.reserved().map_or(0, |(current, _)| current)
    }

    fn check_invariants(&self) -> Result<(), InvariantViolation> {
        let (n, bytes) = self.pool.allocated();
        InvariantViolation::check_stats(&[
            ("allocation", self.allocation.current, n as u64),
            ("allocated_bytes", self.allocated_bytes.current, bytes),
        ])
    }

    fn driver_counters(&self) -> DriverCounters {
        DriverCounters::default()
    }

    fn ordinal(&self) -> usize {
        self.ordinal
    }
}
