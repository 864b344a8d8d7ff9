//! Configuration: built in code, or parsed from `CUVMM_ALLOC_CONF` in PyTorch's `key:value,key:value` syntax.
//!
//! [`Config::from_alloc_conf`] accepts the keys of PyTorch's `PYTORCH_CUDA_ALLOC_CONF` with PyTorch's rules
//! for their values, plus cuvmm's own keys; the parser and the list of keys live in `config/parse.rs`.

use crate::base::size::MIB;
use crate::driver::HostPinning;

mod parse;
#[cfg(test)]
mod tests;

/// The default of [`Config::cross_stream_reuse`], chosen by the measurements in `docs/allocator.md`, "Streams".
pub const DEFAULT_CROSS_STREAM_REUSE: bool = true;

/// The default of [`Config::large_handle`]: PyTorch's expandable segments map 20 MiB handles in the
/// large pool (`docs/allocator.md`, "Handle size").
pub const DEFAULT_LARGE_HANDLE: u64 = 20 * MIB;

/// The default of [`Config::stream_cache`]: bytes of freed buffers each stream cache shard of the facade
/// (one per thread) may keep back (docs/library.md, "Locking"); enough for one 20 MiB buffer, PyTorch's large
/// handle, so that a loop of large requests is served without the strategy's lock too.
pub const DEFAULT_STREAM_CACHE: u64 = 32 * MIB;
/// The default of [`Config::large_handle_headroom`]: chunks up to the budget, so that a job makes PyTorch's
/// driver calls on any device it fits in easily (measured in `docs/allocator.md`, "Handle size").
pub const DEFAULT_LARGE_HANDLE_HEADROOM: f64 = 0.0;

/// The environment variable [`Config::from_env`] reads.
pub const ENV_VAR: &str = "CUVMM_ALLOC_CONF";

/// The largest `va_factor`: a segment's page map is dense (about 24 bytes of host address space per page,
/// touched as pages are used), so a reservation of 16x an 80 GiB device costs about 16 MB per segment; more
/// buys nothing.
pub const MAX_VA_FACTOR: u64 = 16;

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
    /// `[2^(20+i), 2^(21+i))`; 0 means no power-of-two rounding in that interval. As in PyTorch there are
    /// [`RoundupDivisions::INTERVALS`] entries: sizes below 1 MiB use entry 0 and sizes of 32 GiB or more
    /// use the last one.
    PerInterval(Vec<u64>),
}

impl RoundupDivisions {
    /// Number of power-of-two intervals, 1 MiB to 64 GiB (PyTorch's `kRoundUpPowerOfTwoIntervals`).
    pub const INTERVALS: usize = 16;

    /// The number of divisions that applies to a request of `size` bytes (0: no power-of-two rounding),
    /// as PyTorch's `roundup_power2_divisions(size)` picks it: the interval of `floor(log2(size))`,
    /// clamped to the first and last interval.
    pub fn divisions(&self, size: u64) -> u64 {
        match self {
            Self::None => 0,
            Self::Uniform(n) => *n,
            Self::PerInterval(v) => {
                let log = size.checked_ilog2().unwrap_or(0) as usize;
                let index = log.saturating_sub(20).min(Self::INTERVALS - 1);
                v.get(index).copied().unwrap_or(0)
            }
        }
    }

    /// The divisions of every interval, [`RoundupDivisions::INTERVALS`] entries.
    pub fn per_interval(&self) -> Vec<u64> {
        match self {
            Self::None => vec![0; Self::INTERVALS],
            Self::Uniform(n) => vec![*n; Self::INTERVALS],
            Self::PerInterval(v) => {
                let mut v = v.clone();
                v.resize(Self::INTERVALS, 0);
                v
            }
        }
    }
}

/// Everything that can be set about an allocator.
///
/// Keys shared with PyTorch mean what they mean in PyTorch; the classic split allocator uses them, and
/// cuvmm's expandable allocator uses those that apply to it (see `docs/library.md`, "Configuration").
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
    /// Virtual bytes reserved for each segment, as a multiple of the device's total memory, from 1 to
    /// [`MAX_VA_FACTOR`]. Each segment's page map reserves about 24 bytes of host address space per page
    /// it spans, touched as pages are used.
    pub va_factor: u64,
    /// Whether a request on stream B that finds no free block with all its pages mapped in B's own segments
    /// may take one from another stream A's segment of the same pool, once an event recorded on A at that
    /// moment has completed (as RMM's pool and openvm's VMM pool do; PyTorch never does). The borrowed block
    /// counts B as a user, so its free waits for an event on B before A may reuse it. See
    /// `docs/allocator.md`, "Streams", for the measurements behind the default.
    pub cross_stream_reuse: bool,
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
    /// How hard cuvmm works to keep reserved memory at the live limit (`compaction`).
    pub compaction: Compaction,
    /// Reserved memory under which growth creates new handles instead of reclaiming idle pages
    /// (`reserve_budget_mb` / `reserve_budget_fraction`); `None`: what the device has free when the
    /// allocator is made. Only [`Compaction::Pressure`] reads it.
    pub reserve_budget: Option<Budget>,
    /// The most memory the allocator may reserve (`per_process_memory_fraction`, PyTorch's
    /// `torch.cuda.set_per_process_memory_fraction`, which does not reach a pluggable allocator): a request
    /// that would take reserved memory past it is served from idle memory or fails with out-of-memory, as
    /// if the device were that small. `None` (the default): the device's memory.
    pub memory_limit: Option<Budget>,
    /// Bytes per physical handle of the large pool under [`Compaction::Pressure`] (`large_handle_mb`;
    /// default 20 MiB as PyTorch's expandable segments), rounded down to whole pages; one page or less
    /// turns multi-page handles off. [`Compaction::Eager`] always uses one page per handle.
    pub large_handle: u64,
    /// Bytes of freed buffers that each of the facade's stream cache shards (one per thread) may keep back
    /// for reuse on their stream (`stream_cache_mb`; default 32 MiB, 0 turns the caches off); a buffer larger
    /// than this is never kept. Only [`Allocator`](crate::Allocator) reads it; replays do not.
    pub stream_cache: u64,
    /// When the stream caches start keeping frees back (`stream_cache_eager`): `Some(true)`, from the first
    /// free, so that a repeated request is served without the strategy's lock even on one thread, at the cost
    /// of statistics' peaks that may count buffers sitting in a cache and addresses that may differ from the
    /// strategy's own choice; `Some(false)`, only once threads have contended for the strategy's lock, so that
    /// a program that never contends sees exactly the strategy. `None` (the default) lets the embedder
    /// choose: [`Allocator::expandable`](crate::Allocator::expandable) takes `true`, the PyTorch backend
    /// `false` (its statistics and reserved memory match PyTorch's to the byte).
    pub stream_cache_eager: Option<bool>,
    /// The fraction of the budget, in [0, 1], that [`Compaction::Pressure`] keeps free of new large-pool
    /// chunks (`large_handle_headroom`, default 0): past `(1 - headroom) x budget` reserved, growth takes
    /// single pages, which a job near its limit can move where they are needed; 0 makes chunks up to the
    /// budget, as PyTorch's expandable segments do.
    pub large_handle_headroom: f64,
    /// Whether [`Compaction::Pressure`] may lend the idle pages of a chunk that a live block still touches
    /// (`lend_chunk_pages`, default true): map them a second time, from their offset in the chunk, where a
    /// request needs pages, instead of running out of memory with them stranded. Only on a driver that maps
    /// part of a handle ([`Driver::maps_parts_of_handles`](crate::driver::Driver::maps_parts_of_handles)):
    /// CUDA does not (`CUDA_ERROR_NOT_SUPPORTED` on an H100 and an H200), so on a GPU this changes nothing.
    pub lend_chunk_pages: bool,
    /// Whether [`Allocator::expandable`](crate::Allocator::expandable) finds captures nobody announced
    /// (`capture_detection`, default true): it asks the driver whether a request's stream is being captured
    /// into a CUDA graph (`cuStreamGetCaptureInfo`) at every allocation that reaches the strategy, and at
    /// every one an active stream cache would serve, and gives such a capture a pool of its own. Off, only
    /// captures announced with `begin_allocate_to_pool` are safe, as in PyTorch's own allocator (PyTorch's
    /// `torch.cuda.graph` announces every capture); it saves that driver call. Replays, which use the
    /// strategy directly, never detect.
    pub capture_detection: bool,
    /// Whether a tag keeps its page-locked host memory after its wake (`keep_host_buffers`, default true),
    /// so that its next sleep copies into memory pinned once instead of pinning as much again (pinning is
    /// what made a first sleep slow). The bytes show in `host_kept_bytes`; `release_host_buffers` gives
    /// them back. Off, a wake frees them (torch_memory_saver's default).
    pub keep_host_buffers: bool,
    /// The most bytes one copy of a sleep or a wake moves, and the size of the pieces a tag's host memory
    /// is pinned and kept in (`sleep_copy_mb`, default 64 MiB; a multiple of 4 KiB set in code). Large
    /// enough that a copy runs at the link's speed, small enough that a piece is copied into while the next
    /// is pinned.
    pub sleep_copy: u64,
    /// How a sleep pins the host memory it copies into (`pinned_use_cuda_host_register`, default True here,
    /// False in PyTorch; `pinned_num_register_threads`, default 8 here, 1 in PyTorch): ordinary memory
    /// faulted in by that many threads and registered, or `cuMemHostAlloc` from that many threads. The keys
    /// are PyTorch's, which its own pinned-memory allocator reads from the same variable with the same
    /// meaning.
    pub host_pinning: HostPinning,
    /// Bytes of the device that growth leaves free (`device_margin_mb`, default 0: none;
    /// torch_memory_saver's `memory_margin_bytes`): a request whose new physical memory would leave less
    /// free on the device, counting other processes' use, is served from idle memory or fails with
    /// out-of-memory, as on a device that much smaller. A wake, which maps what its tag had, is exempt.
    /// Changed at run time by [`Allocator::set_device_margin`](crate::Allocator::set_device_margin).
    pub device_margin: u64,
}

/// Bytes per copy of a sleep or a wake, and per piece of kept host memory, unless configured.
pub const DEFAULT_SLEEP_COPY: u64 = 64 * MIB;

/// When idle physical pages are reclaimed to serve growth (`compaction` in `CUVMM_ALLOC_CONF`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Compaction {
    /// Grow with new handles while reserved memory is under the budget; reclaim idle pages only beyond it:
    /// first those whose last use an event query shows complete, oldest first, then, as the last step before
    /// out-of-memory, after one synchronization per stream. No synchronization while memory is plentiful.
    #[default]
    Pressure,
    /// Reclaim idle pages before creating any (synchronizing their streams): reserved memory stays at the
    /// pages live blocks touch, at the cost of remapping and synchronizing on every run.
    Eager,
    /// [`Pressure`](Self::Pressure), and, as the last step before out-of-memory, the chunks (multi-page
    /// handles) that live blocks still touch are re-created as single pages at the same addresses (after a
    /// device synchronization; the live pages' bytes staged through host memory), so their idle pages can be
    /// given back. The program says by choosing it that no other thread launches work on cuvmm memory while
    /// an allocation is being served. Where memory is plentiful it does exactly what `Pressure` does.
    Split,
}

/// The reserved-memory budget of [`Compaction::Pressure`], or the memory limit.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Budget {
    /// A number of bytes.
    Bytes(u64),
    /// A fraction in (0, 1] of the device's total memory.
    Fraction(f64),
}

impl Budget {
    /// In bytes, on a device of `device_total` bytes.
    pub fn bytes(self, device_total: u64) -> u64 {
        match self {
            Budget::Bytes(b) => b,
            Budget::Fraction(f) => (device_total as f64 * f) as u64,
        }
    }
}

impl Default for Config {
    fn default() -> Self {
        Self {
            page_size: None,
            small_size: MIB,
            max_idle_bytes: u64::MAX,
            va_factor: 2,
            cross_stream_reuse: DEFAULT_CROSS_STREAM_REUSE,
            expandable_segments: false,
            max_split_size: None,
            max_non_split_rounding: 20 * MIB,
            roundup_power2_divisions: RoundupDivisions::None,
            garbage_collection_threshold: None,
            compaction: Compaction::Pressure,
            reserve_budget: None,
            memory_limit: None,
            large_handle: DEFAULT_LARGE_HANDLE,
            stream_cache: DEFAULT_STREAM_CACHE,
            stream_cache_eager: None,
            large_handle_headroom: DEFAULT_LARGE_HANDLE_HEADROOM,
            lend_chunk_pages: true,
            capture_detection: true,
            keep_host_buffers: true,
            sleep_copy: DEFAULT_SLEEP_COPY,
            host_pinning: HostPinning::default(),
            device_margin: 0,
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

    /// Sets whether free blocks of one stream may serve another stream's requests.
    pub fn with_cross_stream_reuse(mut self, on: bool) -> Self {
        self.cross_stream_reuse = on;
        self
    }

    /// This configuration with `compaction`.
    pub fn with_compaction(mut self, compaction: Compaction) -> Self {
        self.compaction = compaction;
        self
    }

    /// The reserved memory under which [`Compaction::Pressure`] grows without reclaiming, on a device of
    /// `device_total` bytes of which `device_free` were free when the allocator started, under the memory
    /// limit `limit` (bytes; `None`: the whole device): the configured budget (or `device_free`), lowered to
    /// `garbage_collection_threshold` x the memory the limit allows when that is set (PyTorch starts
    /// collecting cached blocks above that fraction of its `allowed_memory_maximum`), and to the limit.
    /// The limit is [`limit_bytes`](Self::limit_bytes) until the program sets another
    /// (`set_per_process_memory_fraction`), which replaces it.
    pub fn budget_bytes(&self, device_total: u64, device_free: u64, limit: Option<u64>) -> u64 {
        let allowed = limit.unwrap_or(device_total);
        let budget = match self.reserve_budget {
            None => device_free,
            Some(b) => b.bytes(device_total),
        };
        let budget = match self.garbage_collection_threshold {
            Some(t) => budget.min((allowed as f64 * t) as u64),
            None => budget,
        };
        budget.min(allowed)
    }

    /// [`memory_limit`](Self::memory_limit) in bytes on a device of `device_total` bytes.
    pub fn limit_bytes(&self, device_total: u64) -> Option<u64> {
        self.memory_limit.map(|b| b.bytes(device_total))
    }

    /// Sets whether a tag keeps its host memory after its wake ([`keep_host_buffers`](Self::keep_host_buffers)).
    pub fn with_keep_host_buffers(mut self, on: bool) -> Self {
        self.keep_host_buffers = on;
        self
    }

    /// Sets the bytes per copy of a sleep or a wake and per piece of kept host memory
    /// ([`sleep_copy`](Self::sleep_copy)).
    pub fn with_sleep_copy(mut self, bytes: u64) -> Self {
        self.sleep_copy = bytes;
        self
    }

    /// Sets the bytes of the device that growth leaves free ([`device_margin`](Self::device_margin)).
    pub fn with_device_margin(mut self, bytes: u64) -> Self {
        self.device_margin = bytes;
        self
    }

    /// Sets how a sleep pins its host memory ([`host_pinning`](Self::host_pinning)).
    pub fn with_host_pinning(mut self, pinning: HostPinning) -> Self {
        self.host_pinning = pinning;
        self
    }

    /// Sets the virtual reservation per segment, as a multiple of device memory.
    pub fn with_va_factor(mut self, factor: u64) -> Self {
        self.va_factor = factor;
        self
    }

    /// Parses a configuration in PyTorch's `PYTORCH_CUDA_ALLOC_CONF` syntax, starting from
    /// [`Config::default`]: `key:value` entries separated by commas, whitespace ignored (as PyTorch
    /// ignores it), the empty string giving the defaults. A repeated key takes its last value (a repeated
    /// `roundup_power2_divisions` list updates the intervals the earlier one set, as in PyTorch).
    ///
    /// PyTorch's keys: `max_split_size_mb`, `max_non_split_rounding_mb`, `garbage_collection_threshold`,
    /// `roundup_power2_divisions`, `expandable_segments`, `backend` (`native` only). Keys that change
    /// nothing cuvmm models (pinned host memory, `release_lock_on_cudamalloc`,
    /// `graph_capture_record_stream_reuse`) are validated and then ignored with a warning. cuvmm's own
    /// keys: `page_size_mb`, `max_idle_mb` (or `unlimited`), `va_factor`, `small_size_kb`,
    /// `cross_stream_reuse`, `lend_chunk_pages`, `capture_detection`, `stream_cache_eager` and
    /// `keep_host_buffers` (`True`/`False`), `compaction`, `reserve_budget_mb`,
    /// `reserve_budget_fraction`, `per_process_memory_fraction`, `large_handle_mb`, `large_handle_headroom`,
    /// `stream_cache_mb`, `sleep_copy_mb`, `device_margin_mb`.
    ///
    /// # Errors
    /// [`ConfigError::Syntax`] for an entry without a colon, [`ConfigError::UnknownKey`] for a key
    /// neither cuvmm nor PyTorch defines, [`ConfigError::BadValue`] for a value its key does not accept.
    pub fn from_alloc_conf(s: &str) -> Result<Config, ConfigError> {
        parse::parse(s)
    }

    /// Parses the `CUVMM_ALLOC_CONF` environment variable with [`Config::from_alloc_conf`]; the defaults
    /// when it is not set.
    ///
    /// # Errors
    /// As [`Config::from_alloc_conf`]; [`ConfigError::BadValue`] if the variable is not valid UTF-8.
    pub fn from_env() -> Result<Config, ConfigError> {
        Self::from_env_value(std::env::var(ENV_VAR))
    }

    fn from_env_value(value: Result<String, std::env::VarError>) -> Result<Config, ConfigError> {
        match value {
            Ok(s) => Self::from_alloc_conf(&s),
            Err(std::env::VarError::NotPresent) => Ok(Config::default()),
            Err(std::env::VarError::NotUnicode(raw)) => Err(ConfigError::BadValue {
                key: ENV_VAR.to_string(),
                value: raw.to_string_lossy().into_owned(),
                expected: "valid UTF-8",
            }),
        }
    }

    /// Checks what can be checked without a device: non-zero sizes and factors, PyTorch's ranges.
    /// Whether `page_size` is a multiple of the driver's granularity is checked when an allocator is
    /// built. Errors name the configuration key that sets the field.
    ///
    /// # Errors
    /// [`ConfigError::BadValue`] for the first field out of range.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let bad = |key: &str, value: String, expected| {
            Err(ConfigError::BadValue {
                key: key.to_string(),
                value,
                expected,
            })
        };
        if self.page_size == Some(0) {
            return bad("page_size_mb", "0 bytes".into(), parse::EXPECT_POSITIVE);
        }
        if self.small_size == 0 {
            return bad("small_size_kb", "0 bytes".into(), parse::EXPECT_POSITIVE);
        }
        if self.sleep_copy == 0 || self.sleep_copy % 4096 != 0 {
            let value = format!("{} bytes", self.sleep_copy);
            return bad("sleep_copy_mb", value, parse::EXPECT_SLEEP_COPY);
        }
        if self.va_factor == 0 || self.va_factor > MAX_VA_FACTOR {
            return bad(
                "va_factor",
                self.va_factor.to_string(),
                parse::EXPECT_VA_FACTOR,
            );
        }
        if let Some(bytes) = self.max_split_size.filter(|&b| b < parse::LARGE_BUFFER) {
            return bad(
                "max_split_size_mb",
                format!("{bytes} bytes"),
                parse::EXPECT_AT_LEAST_20,
            );
        }
        if self.max_non_split_rounding < parse::LARGE_BUFFER {
            let value = format!("{} bytes", self.max_non_split_rounding);
            return bad(
                "max_non_split_rounding_mb",
                value,
                parse::EXPECT_AT_LEAST_20,
            );
        }
        for (key, budget) in [
            ("reserve_budget_fraction", self.reserve_budget),
            ("per_process_memory_fraction", self.memory_limit),
        ] {
            match budget {
                Some(Budget::Fraction(f)) if !(f > 0.0 && f <= 1.0) => {
                    return bad(key, f.to_string(), parse::EXPECT_BUDGET_FRACTION);
                }
                _ => {}
            }
        }
        if self.large_handle == 0 {
            return bad("large_handle_mb", "0 bytes".into(), parse::EXPECT_POSITIVE);
        }
        if !(0.0..=1.0).contains(&self.large_handle_headroom) {
            let value = self.large_handle_headroom.to_string();
            return bad("large_handle_headroom", value, parse::EXPECT_HEADROOM);
        }
        if let Some(t) = self
            .garbage_collection_threshold
            .filter(|t| !(*t > 0.0 && *t < 1.0))
        {
            return bad(
                "garbage_collection_threshold",
                t.to_string(),
                parse::EXPECT_FRACTION,
            );
        }
        match &self.roundup_power2_divisions {
            RoundupDivisions::None => {}
            RoundupDivisions::Uniform(n) if n.is_power_of_two() => {}
            RoundupDivisions::Uniform(n) => {
                return bad(
                    "roundup_power2_divisions",
                    n.to_string(),
                    parse::EXPECT_ROUNDUP,
                );
            }
            RoundupDivisions::PerInterval(v) => {
                let ok = |d: &u64| *d == 0 || d.is_power_of_two();
                if v.len() != RoundupDivisions::INTERVALS || !v.iter().all(ok) {
                    return bad(
                        "roundup_power2_divisions",
                        format!("{v:?}"),
                        parse::EXPECT_ROUNDUP,
                    );
                }
            }
        }
        Ok(())
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
