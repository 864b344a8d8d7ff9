//! The `config_parse` harness: `Config::from_alloc_conf` on arbitrary text. The fuzz target and
//! `tests/fuzz_corpus.rs` both run [`run`].
//!
//! Properties checked:
//! - parsing never panics, whatever the bytes (read as UTF-8, invalid sequences replaced);
//! - parsing is deterministic: the same text gives the same result twice;
//! - an error has a non-empty message;
//! - a configuration that parses passes `validate()`;
//! - an allocator built from it on a small simulated device either refuses the configuration with a typed
//!   error or serves (or refuses with a typed error) a small and a large request, and gives everything
//!   back: no panic, no leak.
//!
//! The fuzzer once found `va_factor:1841615` (a 113 TiB reservation whose dense page map took 1.2 GB of host
//! memory); `va_factor` is now capped at `cuvmm::config::MAX_VA_FACTOR` and that seed must be refused.

use cuvmm::driver::sim::{SimConfig, SimDriver};
use cuvmm::expandable::Expandable;
use cuvmm::size::MIB;
use cuvmm::{Config, Strategy as _, StreamId};

/// What one input did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// The text was refused.
    Refused,
    /// The text parsed, but an allocator refused the configuration.
    AllocatorRefused,
    /// The text parsed and an allocator was built from it.
    Used,
}

/// Parses `data` and checks the properties listed in the module docs.
pub fn run(data: &[u8]) -> Result<Outcome, String> {
    let text = String::from_utf8_lossy(data);
    let parsed = Config::from_alloc_conf(&text);
    let again = Config::from_alloc_conf(&text);
    if format!("{parsed:?}") != format!("{again:?}") {
        return Err(format!("{text:?} parsed twice: {parsed:?} then {again:?}"));
    }
    let config = match parsed {
        Ok(config) => config,
        Err(err) if err.to_string().is_empty() => {
            return Err(format!("{text:?}: error with an empty message: {err:?}"));
        }
        Err(_) => return Ok(Outcome::Refused),
    };
    config
        .validate()
        .map_err(|e| format!("{text:?} parsed to {config:?}, which fails validate(): {e}"))?;
    use_config(config).map_err(|e| format!("{text:?}: {e}"))
}

/// Builds an allocator from `config` on a 64 MiB device and makes a small and a large request.
fn use_config(config: Config) -> Result<Outcome, String> {
    let sim = SimDriver::new(
        SimConfig::default()
            .with_capacity(64 * MIB)
            .with_granularity(2 * MIB),
    );
    let Ok(mut alloc) = Expandable::new(sim, config) else {
        return Ok(Outcome::AllocatorRefused);
    };
    let live: Vec<u64> = [4096, 3 * MIB + 1]
        .into_iter()
        .filter_map(|size| alloc.alloc(size, StreamId::DEFAULT).ok())
        .collect();
    alloc
        .check_invariants()
        .map_err(|v| format!("invariant broken: {v}"))?;
    for addr in live {
        alloc.free(addr).map_err(|e| format!("free: {e}"))?;
    }
    alloc
        .empty_cache()
        .map_err(|e| format!("empty_cache: {e}"))?;
    let leaks = alloc.driver().leak_report();
    if !leaks.is_empty() {
        return Err(format!("leaks after empty_cache: {leaks}"));
    }
    Ok(Outcome::Used)
}
