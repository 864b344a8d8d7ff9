//! What PyTorch's `MemPool` and cudagraph trees ask of a private pool beyond capturing into it, through
//! the [`Allocator`] of cuvmm's own strategy (`expandable/pools.rs`): use counts, `use_on_oom`, `no_split`,
//! checkpoints, and one pool's `empty_cache`.

use crate::driver::Driver;
use crate::expandable::Expandable;
use crate::facade::allocator::Allocator;
use crate::strategy::error::Error;
use crate::strategy::graph_pool::{GraphPool, PoolBlock};
use crate::strategy::stats::StatArray;

impl<D: Driver> Allocator<Expandable<D>> {
    /// How many users `pool` has (begins and increfs not yet released); 0 if it is not live.
    pub fn pool_use_count(&self, pool: GraphPool) -> usize {
        self.with_strategy(|strategy| strategy.pool_use_count(pool))
    }

    /// The reserved bytes of each private pool (PyTorch's `reserved_bytes_by_private_pools`,
    /// [`Expandable::reserved_by_private_pool`]).
    pub fn reserved_by_private_pool(&self) -> Vec<(GraphPool, StatArray)> {
        self.with_strategy(|strategy| strategy.reserved_by_private_pool())
    }

    /// Says whether `pool`'s free memory may serve an allocation outside every pool that would otherwise
    /// run out of memory ([`Expandable::set_pool_use_on_oom`]).
    pub fn set_pool_use_on_oom(&self, pool: GraphPool, on: bool) {
        self.with_strategy(|strategy| strategy.set_pool_use_on_oom(pool, on));
    }

    /// From now on, each allocation in `pool` takes whole pages ([`Expandable::set_pool_no_split`]).
    pub fn set_pool_no_split(&self, pool: GraphPool) {
        self.with_strategy(|strategy| strategy.set_pool_no_split(pool));
    }

    /// The live blocks of `pool`: a checkpoint of it, for [`restore_pool`](Self::restore_pool).
    pub fn pool_blocks(&self, pool: GraphPool) -> Vec<PoolBlock> {
        self.drain_caches_deferring();
        self.with_strategy(|strategy| strategy.pool_blocks(pool))
    }

    /// Puts the live `pool` back as `checkpoint` found it; returns the addresses of the blocks live in it
    /// when called ([`Expandable::restore_pool`]).
    pub fn restore_pool(
        &self,
        pool: GraphPool,
        checkpoint: &[PoolBlock],
    ) -> Result<Vec<u64>, Error> {
        self.drain_caches()?;
        self.with_strategy(|strategy| strategy.restore_pool(pool, checkpoint))
    }

    /// Allocates `size` bytes at `addr`, in the free memory of a segment ([`Expandable::alloc_at`]).
    pub fn alloc_at(&self, addr: u64, size: u64) -> Result<u64, Error> {
        self.drain_caches()?;
        self.with_strategy(|strategy| strategy.alloc_at(addr, size))
    }

    /// Gives back the cached memory of the released `pool` ([`Expandable::empty_pool_cache`]); returns the
    /// bytes given back.
    pub fn empty_pool_cache(&self, pool: GraphPool) -> Result<u64, Error> {
        self.drain_caches()?;
        self.with_strategy(|strategy| strategy.empty_pool_cache(pool))
    }
}
