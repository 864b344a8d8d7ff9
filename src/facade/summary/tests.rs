use super::*;
use crate::base::size::{GIB, KIB, MIB};

#[test]
fn sizes_take_the_unit_of_the_all_row() {
    // 768 KiB is the first value shown in KiB; below it PyTorch stays in bytes.
    assert_eq!(format_bytes(768 * KIB - 1, 768 * KIB - 1), "786431 B  ");
    assert_eq!(format_bytes(768 * KIB, 768 * KIB), "   768 KiB");
    assert_eq!(format_bytes(3 * GIB / 2, 3 * GIB / 2), "  1536 MiB");
    // GiB only from 768 GiB up: 80 GiB is shown in MiB.
    assert_eq!(format_bytes(80 * GIB, 80 * GIB), " 81920 MiB");
    assert_eq!(format_bytes(768 * GIB, 768 * GIB), "   768 GiB");
    // A pool row uses the unit of its "all" row, rounding down.
    assert_eq!(format_bytes(MIB + 1, 3 * GIB / 2), "     1 MiB");
    assert_eq!(format_bytes(0, 3 * GIB / 2), "     0 MiB");
}

#[test]
fn counts_switch_to_thousands_at_750_000() {
    assert_eq!(format_count(749_999, 749_999), " 749999   ");
    assert_eq!(format_count(750_000, 750_000), "    750 K ");
    assert_eq!(format_count(12, 750_000), "      0 K ");
    assert_eq!(format_count(2_000_000_000, 2_000_000_000), "   2000 M ");
}

fn sample() -> Stats {
    let mut stats = Stats::default();
    stats.allocated_bytes.add(3 * GIB / 2);
    stats.large_pool.allocated_bytes.add(3 * GIB / 2 - MIB);
    stats.small_pool.allocated_bytes.add(MIB);
    stats.allocation.add(3);
    stats.num_ooms = 2;
    stats.num_alloc_retries = 5;
    stats.handles_reused = 77;
    stats
}

#[test]
fn every_line_is_framed_and_75_wide() {
    let text = memory_summary(&sample(), 3, "cuvmm");
    let lines: Vec<&str> = text.lines().collect();
    // Header (6 lines), 9 metrics x 4 lines, 2 oversize x 2, a rule, 8 own rows, a rule.
    assert_eq!(lines.len(), 6 + 9 * 4 + 2 * 2 + 1 + 8 + 1, "{text}");
    for line in &lines {
        assert_eq!(line.chars().count(), WIDTH + 2, "{line:?}");
        assert!(line.starts_with('|') && line.ends_with('|'), "{line:?}");
    }
    assert!(
        lines[1].contains("memory summary, device ID 3 "),
        "{}",
        lines[1]
    );
    assert!(lines[3].contains("CUDA OOMs: 2 "), "{}", lines[3]);
    assert!(lines[3].contains("cudaMalloc retries: 5 "), "{}", lines[3]);
}

#[test]
fn rows_follow_pytorch_order_with_pool_rows() {
    let text = memory_summary(&sample(), 0, "classic");
    let row = |label: &str| {
        text.lines()
            .find(|l| l.starts_with(&format!("| {label}")))
            .unwrap_or_else(|| panic!("no row {label} in\n{text}"))
            .to_string()
    };
    let allocated = row("Allocated memory");
    assert!(
        allocated.contains("|   1536 MiB |   1536 MiB |   1536 MiB |      0 B   |"),
        "{allocated}"
    );
    let position = |label: &str| text.find(&format!("| {label}")).unwrap();
    let order = [
        "Allocated memory",
        "Active memory",
        "Requested memory",
        "GPU reserved memory",
        "Non-releasable memory",
        "Allocations",
        "Active allocs",
        "GPU reserved segments",
        "Non-releasable allocs",
        "Oversize allocations",
        "Oversize GPU segments",
        "Idle mapped memory",
        "Handles reused",
    ];
    for pair in order.windows(2) {
        assert!(position(pair[0]) < position(pair[1]), "{pair:?}\n{text}");
    }
    // The large-pool row under "Allocated memory" is in the all row's unit (MiB), rounded down.
    let large = text
        .lines()
        .skip_while(|l| !l.starts_with("| Allocated memory"))
        .nth(1)
        .unwrap();
    assert!(
        large.starts_with("|       from large pool |   1535 MiB |"),
        "{large}"
    );
    assert!(
        row("Allocations").contains("|       3    |"),
        "{}",
        row("Allocations")
    );
    assert!(
        row("Handles reused").contains("| 77 "),
        "{}",
        row("Handles reused")
    );
    assert!(
        row("Allocator").contains("| classic "),
        "{}",
        row("Allocator")
    );
}

#[test]
fn a_pool_value_above_its_total_keeps_the_column_width() {
    // cuvmm: pages unmapped from the large pool (freed there) were never released (not freed in all).
    let mut stats = Stats::default();
    stats.reserved_bytes.add(GIB);
    stats.large_pool.reserved_bytes.add(4 * GIB);
    stats.large_pool.reserved_bytes.sub(3 * GIB);
    let text = memory_summary(&stats, 0, "cuvmm");
    for line in text.lines() {
        assert_eq!(line.chars().count(), WIDTH + 2, "{line:?}");
    }
    assert!(
        text.contains(
            "|       from large pool |   1024 MiB |   4096 MiB |   4096 MiB |   3072 MiB |"
        ),
        "{text}"
    );
}
