//! Configuration: built in code, or parsed from `CUVMM_ALLOC_CONF` in PyTorch's `key:value,key:value` syntax.

use crate::size::MIB;

/// How request sizes round up, as PyTorch's `roundup_power2_divisions` says.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum RoundupDivisions {
    /// Round to 512 bytes only (PyTorch's default).
    #[default]
    None,
    /// The same number of divisions for every power-of-two interval (`roundup_power2_divisions:4`).
    Uniform(u64),
    /// Divisions per power-of-two interval, from 1 MiB up to 64 GiB, as PyTorch's
    /// `roundup_power2_divisions:[256:1,512:2,1024:4,>:8]` sets them. Index `i` covers sizes in
    /// `[2^(20+i), 2^(21+i))`; 0 means no power-of-two rounding in that interval.
    PerInterval(Vec<u64>),
}

/// Everything that can be set about an allocator.
///
/// Keys shared with PyTorch mean what they mean in PyTorch; the classic split allocator uses them, and
/// cuvmm's expandable allocator uses those that apply to it (see `docs/DESIGN.md`).
#[derive(Debug, Clone, PartialEq)]
pub struct Config {
    /// Size of one physical page of the expandable allocator; a multiple of the driver's granularity.
    /// `None` uses the granularity itself.
    pub page_size: Option<u64>,
    /// Requests of at most this many bytes go to the small pool (PyTorch: 1 MiB).
    pub small_size: u64,
    /// Physical bytes the expandable allocator keeps while no live block touches them (idle mapped pages
    /// and unmapped handles) before it releases the excess to the driver. `u64::MAX` keeps all of it,
    /// as PyTorch's caching allocator does, until `empty_cache` or `trim`.
    pub max_idle_bytes: u64,
    /// Virtual bytes reserved for each segment, as a multiple of the device's total memory.
    pub va_factor: u64,
    /// PyTorch's `expandable_segments`: whether its own allocator would use expandable segments. Selects
    /// the `pytorch-expandable` model over the classic one when replaying PyTorch's allocators.
    pub expandable_segments: bool,
    /// PyTorch's `max_split_size_mb`, in bytes: cached blocks larger than this are never split.
    /// `None` means unlimited.
    pub max_split_size: Option<u64>,
    /// PyTorch's `max_non_split_rounding_mb`, in bytes: an oversize request may take a cached block up to
    /// this much larger than itself.
    pub max_non_split_rounding: u64,
    /// PyTorch's `roundup_power2_divisions`.
    pub roundup_power2_divisions: RoundupDivisions,
    /// PyTorch's `garbage_collection_threshold`: a fraction of memory in (0, 1) above which cached blocks
    /// are freed before growing. `None` disables it.
    pub garbage_collection_threshold: Option<f64>,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            page_size: None,
            small_size: MIB,
            max_idle_bytes: u64::MAX,
            va_factor: 2,
            expandable_segments: false,
            max_split_size: None,
            max_non_split_rounding: 20 * MIB,
            roundup_power2_divisions: RoundupDivisions::None,
            garbage_collection_threshold: None,
        }
    }
}

impl Config {
    /// Sets the physical page size.
    pub fn with_page_size(mut self, bytes: u64) -> Self {
        self.page_size = Some(bytes);
        self
    }

    /// Sets the idle-memory limit (hysteresis).
    pub fn with_max_idle_bytes(mut self, bytes: u64) -> Self {
        self.max_idle_bytes = bytes;
        self
    }

    /// Sets the virtual reservation per segment, as a multiple of device memory.
    pub fn with_va_factor(mut self, factor: u64) -> Self {
        self.va_factor = factor;
        self
    }
}

/// A configuration string or value that cuvmm cannot accept. Each names the key at fault.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConfigError {
    /// A key that neither cuvmm nor PyTorch defines.
    #[error("unknown configuration key `{key}`")]
    UnknownKey {
        /// The key.
        key: String,
    },
    /// A value that does not parse or is out of range for its key.
    #[error("bad value `{value}` for `{key}`: expected {expected}")]
    BadValue {
        /// The key.
        key: String,
        /// The value given.
        value: String,
        /// What the key accepts.
        expected: &'static str,
    },
    /// An entry that is not of the form `key:value`.
    #[error("bad entry `{entry}`: expected key:value")]
    Syntax {
        /// The entry.
        entry: String,
    },
}
