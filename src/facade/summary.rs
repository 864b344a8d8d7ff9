//! `memory_summary()`: the statistics as the table PyTorch's `torch.cuda.memory_summary()` prints, followed
//! by the rows cuvmm adds (idle memory, handle reuse, largest free block, driver calls and time).
//!
//! The table is PyTorch's, cell for cell: 75 columns framed by `|`, one row per statistic with its
//! "from large pool" and "from small pool" rows, sizes in the unit PyTorch picks from the "all" row
//! (`_format_size`: the largest unit in which that value is still at least 768 of it), counts in K or M
//! from 750,000 up (`_format_count`), whole numbers rounded down. A person who reads PyTorch's summary
//! reads this one; a script that parses it keeps working.

use crate::base::size::format_size;
use crate::strategy::Strategy;
use crate::strategy::stats::{Stat, Stats};

/// Width of every line, frame excluded.
const WIDTH: usize = 75;

/// The summary of `strategy` now: [`memory_summary`] of its statistics, its device and its name.
pub fn summary_of(strategy: &dyn Strategy) -> String {
    let asleep = (strategy.tags()).map_or_else(Vec::new, |tags| tags.asleep_tags());
    memory_summary_asleep(
        &strategy.stats(),
        strategy.ordinal(),
        strategy.name(),
        &asleep,
    )
}

/// The summary table of `stats` for device `device` of the allocator named `allocator`.
pub fn memory_summary(stats: &Stats, device: usize, allocator: &str) -> String {
    memory_summary_asleep(stats, device, allocator, &[])
}

/// [`memory_summary`] with a row per sleeping tag (`(tag, bytes given back)`) when there are any.
pub fn memory_summary_asleep(
    stats: &Stats,
    device: usize,
    allocator: &str,
    asleep: &[(String, u64)],
) -> String {
    let mut lines: Vec<String> = Vec::new();
    let rule = |c: &str| c.repeat(WIDTH);
    lines.push(rule("="));
    lines.push(format!(
        " {:16} cuvmm CUDA memory summary, device ID {device:<19} ",
        ""
    ));
    lines.push(rule("-"));
    lines.push(format!(
        "  {:9} CUDA OOMs: {:<12} | {:6} cudaMalloc retries: {:<8}  ",
        "", stats.num_ooms, "", stats.num_alloc_retries
    ));
    lines.push(rule("="));
    lines.push(
        "        Metric         | Cur Usage  | Peak Usage | Tot Alloc  | Tot Freed  ".to_string(),
    );
    let names = [
        ("Allocated memory", true),
        ("Active memory", true),
        ("Requested memory", true),
        ("GPU reserved memory", true),
        ("Non-releasable memory", true),
        ("Allocations", false),
        ("Active allocs", false),
        ("GPU reserved segments", false),
        ("Non-releasable allocs", false),
    ];
    for ((name, bytes), (_, all, large, small)) in names.into_iter().zip(stats.pool_rows()) {
        lines.push(rule("-"));
        let format: fn(u64, u64) -> String = if bytes { format_bytes } else { format_count };
        for (label, stat) in [
            (name, all),
            ("      from large pool", large),
            ("      from small pool", small),
        ] {
            lines.push(row(label, &stat, &all, format));
        }
    }
    for (name, stat) in [
        ("Oversize allocations", stats.oversize_allocations),
        ("Oversize GPU segments", stats.oversize_segments),
    ] {
        lines.push(rule("-"));
        lines.push(row(name, &stat, &stat, format_count));
    }
    lines.push(rule("="));
    lines.extend(own_rows(stats, allocator));
    lines.extend(asleep_rows(stats, asleep));
    lines.push(rule("="));
    let mut out = String::with_capacity(lines.len() * (WIDTH + 3));
    for line in lines {
        out.push('|');
        out.push_str(&line);
        out.push_str("|\n");
    }
    out
}

/// One metric row: its four views, each in the unit its "all" row (`pref`) picks. In PyTorch a pool's
/// value never exceeds the total; in cuvmm a pool's reserved bytes can (pages unmapped from one pool and
/// mapped in the other are not released), so the unit comes from the larger of the two and the column
/// keeps its width.
fn row(label: &str, stat: &Stat, pref: &Stat, format: fn(u64, u64) -> String) -> String {
    format!(
        " {label:<21} | {} | {} | {} | {} ",
        format(stat.current, pref.current.max(stat.current)),
        format(stat.peak, pref.peak.max(stat.peak)),
        format(stat.allocated, pref.allocated.max(stat.allocated)),
        format(stat.freed, pref.freed.max(stat.freed)),
    )
}

/// cuvmm's rows, one value each.
fn own_rows(stats: &Stats, allocator: &str) -> Vec<String> {
    let size = |bytes: u64| format!("{} ({bytes} bytes)", format_size(bytes));
    let rows = [
        ("Allocator", allocator.to_string()),
        ("Idle mapped memory", size(stats.idle_mapped_bytes)),
        ("Idle handles", size(stats.idle_handle_bytes)),
        ("Handles reused", stats.handles_reused.to_string()),
        (
            "CUDA graph pools",
            format!("{} ({})", stats.graph_pools, size(stats.graph_pool_bytes)),
        ),
        ("Largest free block", size(stats.largest_free_block)),
        ("Driver calls", stats.driver.total().to_string()),
        (
            "Est. driver time",
            format!("{:.2} ms", stats.driver.time_ns as f64 / 1e6),
        ),
    ];
    rows.into_iter()
        .map(|(name, value)| format!(" {name:<21} | {value:<49} "))
        .collect()
}

/// A row with the bytes asleep and one per sleeping tag, when a tag sleeps; a row with the host memory
/// tags keep (their bytes, or buffers for their next sleep), when they keep some.
fn asleep_rows(stats: &Stats, asleep: &[(String, u64)]) -> Vec<String> {
    let size = |bytes: u64| format!("{} ({bytes} bytes)", format_size(bytes));
    let mut rows = Vec::new();
    if !asleep.is_empty() {
        rows.push(("Asleep (tags)".to_string(), size(stats.asleep_bytes)));
        for (tag, bytes) in asleep {
            let label: String = format!("  tag {tag}").chars().take(21).collect();
            rows.push((label, size(*bytes)));
        }
    }
    if stats.host_kept_bytes > 0 {
        rows.push(("Host memory kept".to_string(), size(stats.host_kept_bytes)));
    }
    rows.into_iter()
        .map(|(name, value)| format!(" {name:<21} | {value:<49} "))
        .collect()
}

/// PyTorch's `_format_size`: `bytes` in the unit picked by `pref` (the largest in which `pref` is at least
/// 768 of it), rounded down, right-aligned in 6 columns, then the unit padded to 3.
pub fn format_bytes(bytes: u64, pref: u64) -> String {
    const PREFIXES: [&str; 6] = ["B  ", "KiB", "MiB", "GiB", "TiB", "PiB"];
    let (mut value, mut pref) = (bytes, pref as f64);
    let mut prefix = PREFIXES[0];
    for next in &PREFIXES[1..] {
        if pref < 768.0 * 1024.0 {
            break;
        }
        prefix = next;
        value /= 1024;
        pref /= 1024.0;
    }
    format!("{value:6} {prefix}")
}

/// PyTorch's `_format_count`: `count` in thousands (K) or millions (M) as `pref` reaches 750,000 of the
/// smaller unit, rounded down, right-aligned in 7 columns, then the unit and a space.
pub fn format_count(count: u64, pref: u64) -> String {
    const PREFIXES: [&str; 3] = [" ", "K", "M"];
    let (mut value, mut pref) = (count, pref as f64);
    let mut prefix = PREFIXES[0];
    for next in &PREFIXES[1..] {
        if pref < 750.0 * 1000.0 {
            break;
        }
        prefix = next;
        value /= 1000;
        pref /= 1000.0;
    }
    format!("{value:7} {prefix} ")
}

#[cfg(test)]
mod tests;
