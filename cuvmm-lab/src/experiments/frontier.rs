//! The cost of fitting: what `cuvmm frontier` answers ("what does each allocator cost on a device of each
//! size?").
//!
//! For one trace, every allocator replays at a handful of device capacities: the trace's lower bound (its
//! peak of live bytes rounded up to a page), each allocator's min capacity ([`capacity::search`]), a few
//! steps between, and 80 GiB (or only those above the lower bound when it is larger). On a CUDA device the
//! capacities are made by a ballast ([`capacity::ballast`]) and the top one is at most what the device has
//! free. Each point says
//! whether the replay hit out-of-memory, its peak reserved bytes, its driver calls, its synchronizations and
//! its estimated driver time under both calibrations of the latency model
//! ([`ByModel`]: an estimate, not a measurement).

use super::capacity::device::{self, CapacityDevice};
use super::capacity::{self, CapacityError, CapacityOptions, lower_bound};
use crate::replay::ByModel;
use crate::replay::observe::NoObserver;
use crate::trace::event::Trace;
use cuvmm::size::{GIB, format_size, round_up};
use serde::Serialize;
use std::fmt::Write;

/// The largest capacity of a frontier: an 80 GiB device (A100 80GB, H100 80GB).
pub const TOP_CAPACITY: u64 = 80 * GIB;

/// Multiples of the lower bound replayed between it and [`TOP_CAPACITY`].
const STEPS: [f64; 3] = [1.05, 1.25, 2.0];

/// One allocator at one capacity. Its JSON field names are stable: later versions only add fields.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct FrontierPoint {
    /// The trace's name.
    pub trace: String,
    /// The allocator's name.
    pub allocator: String,
    /// The device's capacity: the simulated device's size, or what a ballast left free on a CUDA device.
    pub capacity_bytes: u64,
    /// Whether this is the allocator's min capacity (the smallest found that replays with no OOM).
    pub min_capacity: bool,
    /// Allocations that failed with out-of-memory.
    pub ooms: u64,
    /// Peak reserved bytes.
    pub peak_reserved_bytes: u64,
    /// Driver calls (memory management: create, map, set_access, unmap, release, malloc, free).
    pub driver_calls: u64,
    /// Stream synchronizations.
    pub synchronizations: u64,
    /// The simulator's estimate of the driver time, in microseconds (the per-byte calibration, with events).
    pub estimated_driver_us: f64,
    /// The estimated time of `driver_calls` under both calibrations, in microseconds.
    pub estimated_driver_us_by_model: ByModel,
}

/// The capacities replayed for a trace whose lower bound is `lower`, given each allocator's min capacity,
/// on a device that offers at most `ceiling` (`None`: any size): sorted, distinct, whole pages.
pub fn capacities(lower: u64, page: u64, ceiling: Option<u64>, min_capacities: &[u64]) -> Vec<u64> {
    let top = ceiling
        .map_or(TOP_CAPACITY, |c| c.min(TOP_CAPACITY))
        .max(lower);
    let mut out = vec![lower, top];
    out.extend(min_capacities.iter().copied());
    for step in STEPS {
        let c = round_up((lower as f64 * step) as u64, page).unwrap_or(top);
        if c < top {
            out.push(c);
        }
    }
    out.sort_unstable();
    out.dedup();
    out
}

/// Every allocator of `allocators` at each capacity of [`capacities`] for `trace`.
///
/// # Errors
/// [`CapacityError`]: a bad configuration, an unknown allocator, or a replay that failed other than by OOM.
pub fn frontier(
    trace: &Trace,
    allocators: &[String],
    options: &CapacityOptions,
) -> Result<Vec<FrontierPoint>, CapacityError> {
    let mut device = device::for_options(options)?;
    let page = options.page_size;
    let mut mins = Vec::new();
    for allocator in allocators {
        let found = capacity::search_on(trace, allocator, options, &mut device, &mut NoObserver)?;
        mins.push(found.min_capacity_bytes);
    }
    let caps = capacities(
        lower_bound(trace, page),
        page,
        device.ceiling()?,
        &mins.iter().flatten().copied().collect::<Vec<_>>(),
    );
    let mut points = Vec::new();
    for (allocator, min) in allocators.iter().zip(&mins) {
        for &capacity in &caps {
            let r = (device.replay(trace, allocator, capacity, &mut NoObserver)?).result;
            points.push(FrontierPoint {
                trace: trace.name.clone(),
                allocator: allocator.clone(),
                capacity_bytes: capacity,
                min_capacity: *min == Some(capacity),
                ooms: r.ooms,
                peak_reserved_bytes: r.peak_reserved_bytes,
                driver_calls: r.driver_calls.total(),
                synchronizations: r.synchronizations,
                estimated_driver_us: r.estimated_driver_us,
                estimated_driver_us_by_model: r.estimated_driver_us_by_model,
            });
        }
    }
    Ok(points)
}

const HEADERS: [&str; 9] = [
    "trace",
    "allocator",
    "capacity",
    "OOMs",
    "peak reserved",
    "driver calls",
    "syncs",
    "est. per call",
    "est. per byte",
];

/// An aligned table, one row per point; an allocator's min capacity is marked `*`.
pub fn render_table(points: &[FrontierPoint]) -> String {
    let rows: Vec<[String; 9]> = points
        .iter()
        .map(|p| {
            let mark = if p.min_capacity { " *" } else { "" };
            [
                p.trace.clone(),
                p.allocator.clone(),
                format!("{}{mark}", format_size(p.capacity_bytes)),
                p.ooms.to_string(),
                format_size(p.peak_reserved_bytes),
                p.driver_calls.to_string(),
                p.synchronizations.to_string(),
                format!("{:.1} ms", p.estimated_driver_us_by_model.per_call / 1e3),
                format!("{:.1} ms", p.estimated_driver_us_by_model.per_byte / 1e3),
            ]
        })
        .collect();
    crate::reports::table::aligned(HEADERS, &rows)
}

/// Okabe-Ito colours, as `plot.rs`.
const COLOURS: [&str; 4] = ["#0072B2", "#D55E00", "#009E73", "#CC79A7"];
const WIDTH: f64 = 960.0;
const PANEL: f64 = 300.0;
const LEFT: f64 = 80.0;
const TOP: f64 = 50.0;
const PLOT_W: f64 = 840.0;
const PLOT_H: f64 = 200.0;

/// An SVG with one panel per trace: the estimated driver time (per-byte calibration, ms) against the
/// capacity (GiB, log scale), one line per allocator; a point that hit out-of-memory is a hollow circle,
/// a min capacity a larger one.
pub fn render_svg(points: &[FrontierPoint]) -> String {
    let mut traces: Vec<&str> = Vec::new();
    let mut allocators: Vec<&str> = Vec::new();
    for p in points {
        if !traces.contains(&p.trace.as_str()) {
            traces.push(&p.trace);
        }
        if !allocators.contains(&p.allocator.as_str()) {
            allocators.push(&p.allocator);
        }
    }
    let height = PANEL * traces.len().max(1) as f64;
    let mut svg = format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{WIDTH}\" height=\"{height}\" \
         font-family=\"DejaVu Sans, Helvetica, Arial, sans-serif\" font-size=\"12\">\n"
    );
    for (t, trace) in traces.iter().enumerate() {
        let y0 = t as f64 * PANEL;
        let mine: Vec<&FrontierPoint> = points.iter().filter(|p| p.trace == *trace).collect();
        let (lo, hi) = mine.iter().fold((f64::MAX, f64::MIN), |(lo, hi), p| {
            let c = (p.capacity_bytes as f64).ln();
            (lo.min(c), hi.max(c))
        });
        let span = (hi - lo).max(1e-9);
        let y_max = mine
            .iter()
            .map(|p| p.estimated_driver_us_by_model.per_byte / 1e3)
            .fold(0.0, f64::max)
            .max(1e-9);
        let x = |bytes: u64| LEFT + ((bytes as f64).ln() - lo) / span * PLOT_W;
        let y = |ms: f64| y0 + TOP + PLOT_H - ms / y_max * PLOT_H;
        let _ = writeln!(
            svg,
            "<g class=\"panel\" data-trace=\"{}\"><text x=\"{LEFT}\" y=\"{}\" font-size=\"14\">{} \
             - est. driver time (per byte, ms; a model estimate) vs device capacity</text>\
             <rect x=\"{LEFT}\" y=\"{}\" width=\"{PLOT_W}\" height=\"{PLOT_H}\" fill=\"none\" \
             stroke=\"#999\"/><text x=\"4\" y=\"{}\">{y_max:.0} ms</text><text x=\"4\" y=\"{}\">0</text>",
            escape(trace),
            y0 + 24.0,
            escape(trace),
            y0 + TOP,
            y0 + TOP + 12.0,
            y0 + TOP + PLOT_H,
        );
        for (a, allocator) in allocators.iter().enumerate() {
            let colour = COLOURS[a % COLOURS.len()];
            let line: Vec<&&FrontierPoint> =
                mine.iter().filter(|p| p.allocator == *allocator).collect();
            let path: Vec<String> = line
                .iter()
                .map(|p| {
                    let ms = p.estimated_driver_us_by_model.per_byte / 1e3;
                    format!("{:.1},{:.1}", x(p.capacity_bytes), y(ms))
                })
                .collect();
            let _ = writeln!(
                svg,
                "<polyline class=\"allocator\" data-allocator=\"{}\" points=\"{}\" fill=\"none\" \
                 stroke=\"{colour}\" stroke-width=\"2\"/>",
                escape(allocator),
                path.join(" ")
            );
            for p in line {
                let ms = p.estimated_driver_us_by_model.per_byte / 1e3;
                let fill = if p.ooms > 0 { "white" } else { colour };
                let r = if p.min_capacity { 6.0 } else { 3.5 };
                let _ = writeln!(
                    svg,
                    "<circle class=\"point\" data-allocator=\"{}\" data-capacity=\"{}\" \
                     data-ooms=\"{}\" cx=\"{:.1}\" cy=\"{:.1}\" r=\"{r}\" fill=\"{fill}\" \
                     stroke=\"{colour}\"/>",
                    escape(allocator),
                    p.capacity_bytes,
                    p.ooms,
                    x(p.capacity_bytes),
                    y(ms)
                );
            }
            let _ = writeln!(
                svg,
                "<text x=\"{}\" y=\"{}\" fill=\"{colour}\">{}</text>",
                LEFT + 8.0 + a as f64 * 180.0,
                y0 + TOP + PLOT_H + 36.0,
                escape(allocator)
            );
        }
        let _ = writeln!(
            svg,
            "<text x=\"{LEFT}\" y=\"{}\">{}</text><text x=\"{}\" y=\"{}\" text-anchor=\"end\">{}</text></g>",
            y0 + TOP + PLOT_H + 16.0,
            format_size(lo.exp().round() as u64),
            LEFT + PLOT_W,
            y0 + TOP + PLOT_H + 16.0,
            format_size(hi.exp().round() as u64),
        );
    }
    svg.push_str("</svg>\n");
    svg
}

/// `text` escaped for XML.
fn escape(text: &str) -> String {
    text.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

#[cfg(test)]
mod tests {
    use super::*;
    use cuvmm::size::MIB;

    #[test]
    fn capacities_run_from_the_lower_bound_to_80_gib_with_each_min_capacity() {
        let page = 2 * MIB;
        let caps = capacities(GIB, page, None, &[GIB + 4 * MIB, GIB]);
        assert_eq!(caps.first(), Some(&GIB));
        assert_eq!(caps.last(), Some(&TOP_CAPACITY));
        assert!(caps.contains(&(GIB + 4 * MIB)));
        assert!(caps.windows(2).all(|w| w[0] < w[1]));
        assert!(caps.iter().all(|c| c % page == 0));
        // A trace larger than 80 GiB: only its own capacities.
        let big = capacities(100 * GIB, page, None, &[101 * GIB]);
        assert_eq!(big, vec![100 * GIB, 101 * GIB]);
        // A CUDA device with 40 GiB free: nothing above it.
        let cuda = capacities(GIB, page, Some(40 * GIB), &[GIB + 4 * MIB]);
        assert_eq!(cuda.last(), Some(&(40 * GIB)));
        assert!(cuda.contains(&(2 * GIB)));
    }
}
