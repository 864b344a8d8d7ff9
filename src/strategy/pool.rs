//! Which pool a request belongs to: what the strategies, the statistics and the snapshots all sort blocks
//! and segments by, so it lives below all of them.

/// Which pool a request belongs to: small requests get segments of their own so that tiny long-lived
/// blocks do not pin pages that large blocks would free.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Pool {
    /// Requests of at most `Config::small_size` bytes.
    Small,
    /// Everything larger.
    Large,
}

impl Pool {
    /// The pool's index in per-pool arrays: 0 small, 1 large.
    #[inline]
    pub fn index(self) -> usize {
        match self {
            Pool::Small => 0,
            Pool::Large => 1,
        }
    }
}
