//! Drawing sampled replays as an SVG: what `cuvmm compare --plot FILE.svg` writes.
//!
//! One panel per trace, stacked; in each, one solid line of reserved bytes and one dashed line of
//! allocated bytes per allocator, over the events replayed, in GiB. Hand-written SVG 1.1: no dependency,
//! and every element a test needs to find says what it is (`class`, `data-*`).

use super::sample::Series;
use cuvmm::size::{GIB, format_size};
use std::fmt::Write;

/// Width of the picture, in pixels.
pub const WIDTH: f64 = 960.0;
const LEFT: f64 = 76.0;
const RIGHT: f64 = 24.0;
const HEADER: f64 = 84.0;
const PANEL_TITLE: f64 = 44.0;
const PLOT_HEIGHT: f64 = 220.0;
const PANEL_FOOTER: f64 = 52.0;
const PANEL: f64 = PANEL_TITLE + PLOT_HEIGHT + PANEL_FOOTER;
/// Okabe-Ito: told apart by people with any kind of colour blindness.
const COLOURS: [&str; 7] = [
    "#0072B2", "#D55E00", "#009E73", "#CC79A7", "#E69F00", "#56B4E9", "#000000",
];
const FONT: &str = "font-family=\"DejaVu Sans, Helvetica, Arial, sans-serif\"";

/// The traces of `series` in the order they first appear, each with its series.
fn panels(series: &[Series]) -> Vec<(&str, Vec<&Series>)> {
    let mut panels: Vec<(&str, Vec<&Series>)> = Vec::new();
    for s in series {
        match panels.iter_mut().find(|(t, _)| *t == s.trace) {
            Some((_, members)) => members.push(s),
            None => panels.push((&s.trace, vec![s])),
        }
    }
    panels
}

/// The allocators of `series` in the order they first appear: the legend, and each one's colour.
fn allocators(series: &[Series]) -> Vec<&str> {
    let mut names: Vec<&str> = Vec::new();
    for s in series {
        if !names.contains(&s.allocator.as_str()) {
            names.push(&s.allocator);
        }
    }
    names
}

/// A round step (1, 2 or 5 times a power of ten) that cuts `range` into at most about `ticks` parts.
fn nice_step(range: f64, ticks: f64) -> f64 {
    let raw = (range / ticks).max(f64::MIN_POSITIVE);
    let power = 10f64.powf(raw.log10().floor());
    [1.0, 2.0, 5.0, 10.0]
        .into_iter()
        .map(|m| m * power)
        .find(|&s| s >= raw)
        .unwrap_or(10.0 * power)
}

/// `value` with as many decimals as `step` needs.
fn tick_label(value: f64, step: f64) -> String {
    let decimals = if step >= 1.0 {
        0
    } else {
        (-step.log10().floor()) as usize
    };
    format!("{value:.decimals$}")
}

/// An event count for an axis: 12000 -> "12k", 1500000 -> "1.5M".
fn events_label(value: f64) -> String {
    let (scaled, suffix) = if value >= 1e6 {
        (value / 1e6, "M")
    } else if value >= 1e3 {
        (value / 1e3, "k")
    } else {
        (value, "")
    };
    let text = format!("{scaled:.1}");
    format!("{}{suffix}", text.trim_end_matches(".0"))
}

/// `value` with a comma between each group of three digits: 47030 -> "47,030".
fn thousands(value: u64) -> String {
    let digits = value.to_string();
    let mut out = String::new();
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i) % 3 == 0 {
            out.push(',');
        }
        out.push(c);
    }
    out
}

/// `text` escaped for XML character data and attribute values.
fn escape(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&apos;"),
            c if c.is_control() => out.push(' '),
            c => out.push(c),
        }
    }
    out
}

/// The SVG of `series` (each a replay of one trace through one allocator, as a
/// [`Sampler`](super::sample::Sampler) gives them): a title, a legend, and one panel per trace.
pub fn render_svg(series: &[Series]) -> String {
    let panels = panels(series);
    let names = allocators(series);
    let colour = |name: &str| {
        let i = names.iter().position(|n| *n == name).unwrap_or(0);
        COLOURS[i % COLOURS.len()]
    };
    let height = HEADER + PANEL * panels.len().max(1) as f64;
    let mut svg = String::new();
    let _ = write!(
        svg,
        "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<svg xmlns=\"http://www.w3.org/2000/svg\" \
         width=\"{WIDTH}\" height=\"{height}\" viewBox=\"0 0 {WIDTH} {height}\" {FONT}>\n\
         <rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n\
         <text class=\"title\" x=\"{LEFT}\" y=\"30\" font-size=\"20\" font-weight=\"bold\">\
         Memory over each trace: reserved (solid) and allocated (dashed)</text>\n"
    );
    legend(&mut svg, &names, colour);
    for (i, (trace, members)) in panels.iter().enumerate() {
        panel(&mut svg, HEADER + PANEL * i as f64, trace, members, colour);
    }
    svg.push_str("</svg>\n");
    svg
}

/// One entry per allocator (its colour), then the key to the two line styles.
fn legend<'a>(svg: &mut String, names: &[&'a str], colour: impl Fn(&'a str) -> &'static str) {
    let y = 60.0;
    let mut x = LEFT;
    svg.push_str("<g class=\"legend\">\n");
    for &name in names {
        let _ = writeln!(
            svg,
            "<line x1=\"{x}\" y1=\"{y}\" x2=\"{}\" y2=\"{y}\" stroke=\"{}\" stroke-width=\"4\"/>\
             <text class=\"legend-entry\" x=\"{}\" y=\"{}\" font-size=\"14\">{}</text>",
            x + 28.0,
            colour(name),
            x + 36.0,
            y + 5.0,
            escape(name)
        );
        x += 36.0 + 8.5 * name.chars().count() as f64 + 28.0;
    }
    let x = x.max(WIDTH - RIGHT - 300.0);
    let _ = writeln!(
        svg,
        "<line x1=\"{x}\" y1=\"{y}\" x2=\"{}\" y2=\"{y}\" stroke=\"#444\" stroke-width=\"2.5\"/>\
         <text x=\"{}\" y=\"{}\" font-size=\"14\" fill=\"#444\">reserved</text>\
         <line x1=\"{}\" y1=\"{y}\" x2=\"{}\" y2=\"{y}\" stroke=\"#444\" stroke-width=\"1.8\" \
         stroke-dasharray=\"6 4\"/><text x=\"{}\" y=\"{}\" font-size=\"14\" fill=\"#444\">allocated</text>",
        x + 28.0,
        x + 34.0,
        y + 5.0,
        x + 120.0,
        x + 148.0,
        x + 154.0,
        y + 5.0
    );
    svg.push_str("</g>\n");
}

/// One trace's panel, its top at `top`: title, peaks, axes with ticks in GiB and events, and the lines.
fn panel<'a>(
    svg: &mut String,
    top: f64,
    trace: &str,
    members: &[&'a Series],
    colour: impl Fn(&'a str) -> &'static str,
) {
    let events = members.iter().map(|s| s.events).max().unwrap_or(0).max(1) as f64;
    let highest = members
        .iter()
        .flat_map(|s| &s.samples)
        .map(|p| p.reserved_bytes.max(p.allocated_bytes))
        .max()
        .unwrap_or(0) as f64
        / GIB as f64;
    let y_step = nice_step(highest.max(1e-3), 5.0);
    let y_max = ((highest / y_step).ceil() * y_step).max(y_step);
    let (x0, y0) = (LEFT, top + PANEL_TITLE);
    let (w, h) = (WIDTH - LEFT - RIGHT, PLOT_HEIGHT);
    let px = |event: f64| x0 + event / events * w;
    let py = |gib: f64| y0 + h - gib / y_max * h;

    let _ = writeln!(
        svg,
        "<g class=\"panel\" data-trace=\"{}\">\n<text class=\"panel-title\" x=\"{x0}\" y=\"{}\" \
         font-size=\"16\" font-weight=\"bold\">{}</text>",
        escape(trace),
        top + 18.0,
        escape(trace)
    );
    let peaks: Vec<String> = members
        .iter()
        .map(|s| {
            let peak = s
                .samples
                .iter()
                .map(|p| p.reserved_bytes)
                .max()
                .unwrap_or(0);
            format!("{} {}", s.allocator, format_size(peak))
        })
        .collect();
    let _ = writeln!(
        svg,
        "<text class=\"panel-peaks\" x=\"{x0}\" y=\"{}\" font-size=\"13\" fill=\"#333\">peak reserved: {}</text>",
        top + 36.0,
        escape(&peaks.join(", "))
    );
    let _ = writeln!(
        svg,
        "<rect class=\"plot-area\" x=\"{x0}\" y=\"{y0}\" width=\"{w}\" height=\"{h}\" fill=\"#fafafa\" \
         stroke=\"#999\"/>"
    );
    // Y axis: gridlines and labels in GiB.
    let mut tick = 0.0;
    while tick <= y_max + y_step / 2.0 {
        let y = py(tick);
        let _ = writeln!(
            svg,
            "<line x1=\"{x0}\" y1=\"{y:.1}\" x2=\"{:.1}\" y2=\"{y:.1}\" stroke=\"#ddd\"/>\
             <text class=\"y-tick\" x=\"{:.1}\" y=\"{:.1}\" font-size=\"12\" text-anchor=\"end\">{}</text>",
            x0 + w,
            x0 - 6.0,
            y + 4.0,
            tick_label(tick, y_step)
        );
        tick += y_step;
    }
    let _ = writeln!(
        svg,
        "<text class=\"y-label\" x=\"{0:.1}\" y=\"{1:.1}\" font-size=\"13\" text-anchor=\"middle\" \
         transform=\"rotate(-90 {0:.1} {1:.1})\">memory (GiB)</text>",
        x0 - 48.0,
        y0 + h / 2.0
    );
    // X axis: events replayed.
    let x_step = nice_step(events, 8.0).max(1.0);
    let mut tick = 0.0;
    while tick <= events + x_step * 1e-9 {
        let x = px(tick);
        let _ = writeln!(
            svg,
            "<line x1=\"{x:.1}\" y1=\"{:.1}\" x2=\"{x:.1}\" y2=\"{:.1}\" stroke=\"#999\"/>\
             <text class=\"x-tick\" x=\"{x:.1}\" y=\"{:.1}\" font-size=\"12\" text-anchor=\"middle\">{}</text>",
            y0 + h,
            y0 + h + 5.0,
            y0 + h + 19.0,
            events_label(tick)
        );
        tick += x_step;
    }
    let _ = writeln!(
        svg,
        "<text class=\"x-label\" x=\"{:.1}\" y=\"{:.1}\" font-size=\"13\" text-anchor=\"middle\">\
         events replayed (of {})</text>",
        x0 + w / 2.0,
        y0 + h + 38.0,
        thousands(events as u64)
    );
    // Allocated first, so the reserved lines are drawn over them. Lines that coincide must all stay
    // visible: allocated dashes of the n allocators interleave (each draws one dash in n), and reserved
    // lines narrow from the first allocator to the last, so each shows as a band around the next.
    let n = members.len() as f64;
    for stat in ["allocated", "reserved"] {
        for (i, s) in members.iter().enumerate() {
            let i = i as f64;
            let style = if stat == "allocated" {
                format!(
                    "stroke-width=\"1.8\" stroke-dasharray=\"5 {}\" stroke-dashoffset=\"{}\"",
                    5.0 * (n - 1.0) + 3.0 * n,
                    -8.0 * i
                )
            } else {
                format!("stroke-width=\"{}\"", 2.0 + 2.0 * (n - 1.0 - i))
            };
            let mut d = String::new();
            for (i, p) in s.samples.iter().enumerate() {
                let bytes = if stat == "reserved" {
                    p.reserved_bytes
                } else {
                    p.allocated_bytes
                };
                let command = if i == 0 { 'M' } else { 'L' };
                let _ = write!(
                    d,
                    "{command}{:.1},{:.1} ",
                    px(p.events as f64),
                    py(bytes as f64 / GIB as f64)
                );
            }
            let _ = writeln!(
                svg,
                "<path class=\"series\" data-allocator=\"{}\" data-stat=\"{stat}\" d=\"{}\" fill=\"none\" \
                 stroke=\"{}\" {style} stroke-linejoin=\"round\"/>",
                escape(&s.allocator),
                d.trim_end(),
                colour(&s.allocator)
            );
        }
    }
    svg.push_str("</g>\n");
}
