//! Rendering replay results: an aligned table for people, JSON for programs.

use crate::replay::ReplayResult;
use cuvmm::driver::sim::LATENCY_SOURCES;
use cuvmm::size::format_size;
use serde::Serialize;

const HEADERS: [&str; 9] = [
    "workload",
    "allocator",
    "peak allocated",
    "peak reserved",
    "utilization",
    "OOMs",
    "driver calls",
    "est. driver time",
    "replay time",
];

/// One row of cells per result.
fn row(r: &ReplayResult) -> [String; 9] {
    [
        r.workload.clone(),
        r.allocator.clone(),
        format_size(r.peak_allocated_bytes),
        format_size(r.peak_reserved_bytes),
        format!("{:.3}", r.utilization),
        r.ooms.to_string(),
        r.driver_calls.total().to_string(),
        format!("{:.2} ms", r.estimated_driver_us / 1_000.0),
        format!("{:.3} s", r.replay_seconds),
    ]
}

/// The results as a table: a header and one row per workload and allocator, names left-aligned and
/// numbers right-aligned, each line ending in a newline.
pub fn render_table(results: &[ReplayResult]) -> String {
    let rows: Vec<[String; 9]> = results.iter().map(row).collect();
    aligned(HEADERS, &rows)
}

/// `headers` and `rows` as aligned text columns two spaces apart, the first two (names) left-aligned and the
/// rest (numbers) right-aligned, each line ending in a newline. Shared by every table the CLI prints.
pub fn aligned<const N: usize>(headers: [&str; N], rows: &[[String; N]]) -> String {
    let mut widths = headers.map(str::len);
    for cells in rows {
        for (width, cell) in widths.iter_mut().zip(cells) {
            *width = (*width).max(cell.chars().count());
        }
    }
    let line = |cells: &[String]| {
        let padded: Vec<String> = cells
            .iter()
            .zip(widths)
            .enumerate()
            .map(|(i, (cell, w))| {
                if i < 2 {
                    format!("{cell:<w$}")
                } else {
                    format!("{cell:>w$}")
                }
            })
            .collect();
        format!("{}\n", padded.join("  ").trim_end())
    };
    let mut out = line(&headers.map(String::from));
    for cells in rows {
        out.push_str(&line(cells));
    }
    out
}

/// One line on what the estimated driver times are, for tables.
pub const LATENCY_NOTE: &str = "estimated driver time of the driver calls from the latency model, \
     per call: each published 2 MiB figure a fixed cost per call; per byte: a cost per 2 MiB; an estimate";

#[derive(Serialize)]
struct Report<'a> {
    results: &'a [ReplayResult],
    /// What `estimated_driver_us_by_model` rests on.
    latency_model: LatencyNote,
}

/// The calibrations of `estimated_driver_us_by_model` and their sources.
#[derive(Serialize)]
struct LatencyNote {
    calibrations: [&'static str; 2],
    sources: &'static str,
}

/// The results as pretty-printed JSON: `{"results": [...], "latency_model": {...}}`.
pub fn render_json(results: &[ReplayResult]) -> serde_json::Result<String> {
    serde_json::to_string_pretty(&Report {
        results,
        latency_model: LatencyNote {
            calibrations: ["per_call", "per_byte"],
            sources: LATENCY_SOURCES,
        },
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::replay::DriverCalls;

    fn result(workload: &str, reserved: u64) -> ReplayResult {
        ReplayResult {
            first_oom: None,
            workload: workload.into(),
            allocator: "cuvmm".into(),
            events: 10,
            peak_live_bytes: 1 << 20,
            peak_allocated_bytes: 1 << 30,
            peak_reserved_bytes: reserved,
            utilization: (1u64 << 30) as f64 / reserved as f64,
            ooms: 3,
            driver_calls: DriverCalls {
                create: 5,
                map: 7,
                ..DriverCalls::default()
            },
            estimated_driver_us: 2_500.0,
            estimated_driver_us_by_model: Default::default(),
            event_calls: 0,
            synchronizations: 0,
            replay_seconds: 0.25,
        }
    }

    #[test]
    fn table_has_aligned_columns_and_formatted_cells() {
        let table = render_table(&[result("moe", 2 << 30), result("llm-serving", 3 << 30)]);
        let lines: Vec<&str> = table.lines().collect();
        assert_eq!(lines.len(), 3);
        assert!(lines[0].starts_with("workload"));
        assert!(lines[1].starts_with("moe "), "{table}");
        for cell in ["1.00 GiB", "2.00 GiB", "0.500", "12", "2.50 ms", "0.250 s"] {
            assert!(lines[1].contains(cell), "{cell} missing from {}", lines[1]);
        }
        assert!(lines[2].contains("0.333"));
        // Right-aligned numbers: every line ends at the same column.
        assert!(lines.iter().all(|l| l.len() == lines[0].len()), "{table}");
    }

    #[test]
    fn json_wraps_results() {
        let json = render_json(&[result("moe", 2 << 30)]).unwrap();
        let value: serde_json::Value = serde_json::from_str(&json).unwrap();
        let results = value["results"].as_array().unwrap();
        assert_eq!(results.len(), 1);
        assert_eq!(results[0]["workload"], "moe");
        assert_eq!(results[0]["driver_calls"]["map"], 7);
        assert!(results[0]["estimated_driver_us_by_model"]["per_call"].is_number());
        assert!(results[0]["estimated_driver_us_by_model"]["per_byte"].is_number());
        assert_eq!(value["latency_model"]["sources"], LATENCY_SOURCES);
    }
}
