//! A *ballast*: one plain allocation (cuMemAlloc, the driver's [`Driver::malloc`]) that takes all of a
//! device's free memory but a capacity C, so that an allocator built afterwards on the same device has
//! about C bytes to grow into. This is how `cuvmm capacity --backend cuda` makes a capacity real on a GPU
//! whose size it cannot choose.
//!
//! What the allocator under test sees, with a ballast of `free - C` bytes (rounded down to
//! [`BALLAST_GRANULE`]) in place:
//! - `mem_info`: `free` is C (up to a granule more), `total` is the whole device's. cuvmm's budget comes
//!   from `free`; the models of PyTorch take the device's size from `total`, as PyTorch does, and learn
//!   the limit only when the driver refuses memory, as PyTorch would on a GPU whose memory another
//!   allocation holds.
//! - Every physical allocation (cuMemCreate, cuMemAlloc, and cuMemAllocAsync growing the pool of
//!   `cuda-async`) fails with out-of-memory once the device is full: the same limit for every allocator.
//!
//! What a ballast cannot model: memory other processes take or give back while the replay runs (free is
//! measured once, just before the ballast is placed); the driver's own reservations (contexts, page tables,
//! a pool's bookkeeping), which come out of the allocator's C as they would on a real device of that size;
//! and the ballast's granularity: it is rounded down to [`BALLAST_GRANULE`], so the allocator sees between
//! C and C + 2 MiB, and what it saw is reported ([`Ballast::free_seen`]).
//!
//! The same code places a ballast on the simulated device ([`SimDriver`](cuvmm::driver::sim::SimDriver),
//! whose `malloc` and `create` share one capacity), which is how the tests check it without a GPU.

use cuvmm::driver::{Driver, DriverError};
use cuvmm::size::MIB;

/// The ballast is a whole number of these: cuMemAlloc hands out large allocations in 2 MiB pages.
pub const BALLAST_GRANULE: u64 = 2 * MIB;

/// Why a ballast could not be placed.
#[derive(Debug, thiserror::Error)]
pub enum BallastError {
    /// The device has less free memory than the capacity asked for.
    #[error(
        "a capacity of {capacity} bytes is above what the device has free ({free} bytes): \
         a ballast can only take memory away"
    )]
    AboveFree {
        /// The capacity asked for.
        capacity: u64,
        /// What the device had free.
        free: u64,
    },
    /// A driver call failed (mem_info, or the allocation of the ballast itself).
    #[error("placing a ballast: {0}")]
    Driver(#[from] DriverError),
}

/// A ballast in place: release it with [`release`](Self::release) on the driver it was placed with.
#[derive(Debug)]
#[must_use = "a ballast holds device memory until it is released"]
pub struct Ballast {
    ptr: Option<u64>,
    bytes: u64,
    free_seen: u64,
}

impl Ballast {
    /// Takes all but `capacity` bytes of what `driver`'s device has free now, rounded down to
    /// [`BALLAST_GRANULE`] (nothing when less than a granule would be taken).
    ///
    /// # Errors
    /// [`BallastError::AboveFree`] if less than `capacity` is free; [`BallastError::Driver`] if mem_info or
    /// the allocation fails.
    pub fn place<D: Driver + ?Sized>(driver: &mut D, capacity: u64) -> Result<Self, BallastError> {
        let free = driver.mem_info()?.free;
        if free < capacity {
            return Err(BallastError::AboveFree { capacity, free });
        }
        let bytes = (free - capacity) / BALLAST_GRANULE * BALLAST_GRANULE;
        let ptr = match bytes {
            0 => None,
            _ => Some(driver.malloc(bytes)?),
        };
        let free_seen = match driver.mem_info() {
            Ok(info) => info.free,
            Err(e) => {
                // Give the memory back before reporting the failure.
                if let Some(ptr) = ptr {
                    driver.free(ptr)?;
                }
                return Err(e.into());
            }
        };
        Ok(Self {
            ptr,
            bytes,
            free_seen,
        })
    }

    /// The ballast's size in bytes.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// What the device had free once the ballast was in place: what the allocator under test starts with.
    pub fn free_seen(&self) -> u64 {
        self.free_seen
    }

    /// Frees the ballast.
    ///
    /// # Errors
    /// The driver's failure to free it.
    pub fn release<D: Driver + ?Sized>(self, driver: &mut D) -> Result<(), DriverError> {
        match self.ptr {
            Some(ptr) => driver.free(ptr),
            None => Ok(()),
        }
    }
}

/// Places a ballast leaving `capacity` bytes free on `driver`, runs `run` (which may use `driver` for the
/// allocator under test, or another handle on the same device), then releases the ballast, whatever `run`
/// returned. `run`'s error comes first; a failure to release the ballast is reported when `run` succeeded.
///
/// # Errors
/// [`BallastError`] converted into `E`, or `run`'s error.
pub fn with_ballast<D, T, E>(
    driver: &mut D,
    capacity: u64,
    run: impl FnOnce(&mut D, &Ballast) -> Result<T, E>,
) -> Result<T, E>
where
    D: Driver + ?Sized,
    E: From<BallastError>,
{
    let ballast = Ballast::place(driver, capacity)?;
    let result = run(driver, &ballast);
    let released = ballast.release(driver);
    let value = result?;
    released.map_err(BallastError::from)?;
    Ok(value)
}
