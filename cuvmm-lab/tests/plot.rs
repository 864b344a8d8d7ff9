//! `compare --plot`: the replay hook tells an observer every event; the sampler keeps every new peak; the
//! SVG is well-formed XML with one panel per trace, one path per allocator and statistic, labelled axes,
//! and every point inside its plot area at the height its value gives on the GiB axis.

use cuvmm::size::GIB;
use cuvmm::{Strategy, StreamId};
use cuvmm_lab::replay::ReplayOptions;
use cuvmm_lab::replay::allocators::{self, ALLOCATORS};
use cuvmm_lab::replay::observe::ReplayObserver;
use cuvmm_lab::replay::replay_observed;
use cuvmm_lab::reports::plot::render_svg;
use cuvmm_lab::reports::sample::{Sample, Sampler, Series};
use cuvmm_lab::trace::Trace;
use cuvmm_lab::workload;
use roxmltree::{Document, Node};

/// Records what it is told.
#[derive(Default)]
struct Recorder {
    starts: Vec<(String, String)>,
    indices: Vec<usize>,
}

impl ReplayObserver for Recorder {
    fn start(&mut self, trace: &Trace, strategy: &dyn Strategy) {
        self.starts
            .push((trace.name.clone(), strategy.name().to_string()));
    }

    fn after_event(&mut self, index: usize, strategy: &dyn Strategy) {
        strategy.check_invariants().unwrap();
        self.indices.push(index);
    }
}

fn small_trace() -> Trace {
    let mut b = cuvmm_lab::trace::TraceBuilder::new("small");
    let mut ids = Vec::new();
    for i in 0..40u64 {
        ids.push(b.alloc((i % 7 + 1) << 20, StreamId::DEFAULT));
        if i % 3 == 2 {
            b.free(ids.remove(0));
        }
    }
    b.finish()
}

#[test]
fn the_observer_is_told_the_start_and_every_event_in_order() {
    let trace = small_trace();
    let mut strategy = allocators::build("cuvmm", 4 * GIB, 2 << 20).unwrap();
    let mut recorder = Recorder::default();
    replay_observed(
        strategy.as_mut(),
        &trace,
        &ReplayOptions::default(),
        &mut recorder,
    )
    .unwrap();
    assert_eq!(
        recorder.starts,
        [("small".to_string(), "cuvmm".to_string())]
    );
    let expected: Vec<usize> = (0..trace.events.len()).collect();
    assert_eq!(recorder.indices, expected);
}

#[test]
fn samples_are_bounded_in_number_and_keep_the_replays_peaks() {
    let trace = workload::generate("llm-serving", workload::DEFAULT_SEED).unwrap();
    for allocator in ALLOCATORS {
        let mut strategy = allocators::build(allocator, 80 * GIB, 2 << 20).unwrap();
        let mut sampler = Sampler::new(300);
        let result = replay_observed(
            strategy.as_mut(),
            &trace,
            &ReplayOptions::default(),
            &mut sampler,
        )
        .unwrap();
        let series = sampler.into_series();
        assert_eq!(series.len(), 1);
        let s = &series[0];
        assert_eq!(
            (s.trace.as_str(), s.allocator.as_str()),
            ("llm-serving", *allocator)
        );
        assert_eq!(s.events, trace.events.len());
        assert!(s.samples.len() <= 302, "{} samples", s.samples.len());
        assert!(s.samples.len() >= 250, "{} samples", s.samples.len());
        assert_eq!(s.samples[0].events, 0);
        assert_eq!(s.samples.last().unwrap().events, trace.events.len());
        assert!(s.samples.windows(2).all(|w| w[0].events < w[1].events));
        // Every rise to a new peak is kept, so the highest sample is the replay's peak, though a peak
        // seldom falls on a sampled event.
        let max = |f: fn(&Sample) -> u64| s.samples.iter().map(f).max().unwrap();
        assert_eq!(max(|p| p.reserved_bytes), result.peak_reserved_bytes);
        assert_eq!(max(|p| p.allocated_bytes), result.peak_allocated_bytes);
    }
}

/// Numbers in a path's `d` (`M x,y L x,y ...`) as points.
fn points(d: &str) -> Vec<(f64, f64)> {
    d.split(['M', 'L'])
        .filter(|p| !p.trim().is_empty())
        .map(|p| {
            let (x, y) = p.trim().split_once(',').expect("x,y");
            (x.parse().unwrap(), y.parse().unwrap())
        })
        .collect()
}

fn attr(node: Node, name: &str) -> f64 {
    node.attribute(name)
        .unwrap_or_else(|| panic!("no {name}"))
        .parse()
        .unwrap()
}

fn has_class(node: &Node, class: &str) -> bool {
    node.attribute("class") == Some(class)
}

fn text_of_class<'a>(node: Node<'a, 'a>, class: &str) -> Vec<&'a str> {
    node.descendants()
        .filter(|n| has_class(n, class))
        .filter_map(|n| n.text())
        .collect()
}

/// A series of `trace` through `allocator` whose reserved bytes go 0, `gib` GiB, then half of that.
fn series(trace: &str, allocator: &str, gib: u64, events: usize) -> Series {
    let point = |events, bytes| Sample {
        events,
        allocated_bytes: bytes * 3 / 4,
        reserved_bytes: bytes,
    };
    Series {
        trace: trace.into(),
        allocator: allocator.into(),
        events,
        samples: vec![
            point(0, 0),
            point(events / 2, gib * GIB),
            point(events, gib * GIB / 2),
        ],
    }
}

#[test]
fn the_svg_has_a_panel_per_trace_and_a_path_per_allocator_and_statistic() {
    let all = vec![
        series("a & <b>", "cuvmm", 10, 1_000),
        series("a & <b>", "classic", 20, 1_000),
        series("second", "cuvmm", 3, 50_000),
        series("second", "classic", 4, 50_000),
    ];
    let svg = render_svg(&all);
    let doc = Document::parse(&svg).expect("well-formed XML");
    let root = doc.root_element();
    assert_eq!(root.tag_name().name(), "svg");
    assert_eq!(
        root.tag_name().namespace(),
        Some("http://www.w3.org/2000/svg")
    );
    let (width, height) = (attr(root, "width"), attr(root, "height"));
    assert!(root.attribute("viewBox").is_some());
    assert_eq!(text_of_class(root, "title").len(), 1);
    let legend = text_of_class(root, "legend-entry");
    assert_eq!(legend, ["cuvmm", "classic"]);

    let panels: Vec<Node> = root
        .descendants()
        .filter(|n| has_class(n, "panel"))
        .collect();
    let traces: Vec<&str> = panels
        .iter()
        .map(|p| p.attribute("data-trace").unwrap())
        .collect();
    assert_eq!(traces, ["a & <b>", "second"]);
    for (panel, expected_peak) in panels.iter().zip([20.0, 4.0]) {
        assert_eq!(text_of_class(*panel, "panel-title").len(), 1);
        assert_eq!(text_of_class(*panel, "y-label"), ["memory (GiB)"]);
        let x_label = text_of_class(*panel, "x-label");
        assert!(
            x_label.len() == 1 && x_label[0].starts_with("events replayed"),
            "{x_label:?}"
        );
        let area = panel
            .descendants()
            .find(|n| has_class(n, "plot-area"))
            .expect("plot area");
        let (x0, y0) = (attr(area, "x"), attr(area, "y"));
        let (x1, y1) = (x0 + attr(area, "width"), y0 + attr(area, "height"));
        assert!(x0 >= 0.0 && y0 >= 0.0 && x1 <= width && y1 <= height);

        // The y ticks: labels in GiB, evenly spaced, from 0 at the bottom of the area up to its top.
        let ticks: Vec<(f64, f64)> = panel
            .descendants()
            .filter(|n| has_class(n, "y-tick"))
            .map(|n| (n.text().unwrap().parse().unwrap(), attr(n, "y") - 4.0))
            .collect();
        assert!(ticks.len() >= 3, "{ticks:?}");
        assert_eq!(ticks[0].0, 0.0);
        assert!((ticks[0].1 - y1).abs() < 0.11);
        let (top_value, top_y) = *ticks.last().unwrap();
        assert!((top_y - y0).abs() < 0.11, "{ticks:?}");
        assert!(
            top_value >= expected_peak && top_value < expected_peak * 1.6,
            "{ticks:?}"
        );
        let y_of = |gib: f64| y1 - gib / top_value * (y1 - y0);

        let paths: Vec<Node> = panel
            .descendants()
            .filter(|n| n.tag_name().name() == "path")
            .collect();
        let mut keys: Vec<(&str, &str)> = paths
            .iter()
            .map(|p| {
                (
                    p.attribute("data-allocator").unwrap(),
                    p.attribute("data-stat").unwrap(),
                )
            })
            .collect();
        keys.sort();
        assert_eq!(
            keys,
            [
                ("classic", "allocated"),
                ("classic", "reserved"),
                ("cuvmm", "allocated"),
                ("cuvmm", "reserved"),
            ]
        );
        let colours: std::collections::HashSet<&str> = paths
            .iter()
            .map(|p| p.attribute("stroke").unwrap())
            .collect();
        assert_eq!(colours.len(), 2, "one colour per allocator");
        for path in &paths {
            let pts = points(path.attribute("d").unwrap());
            assert_eq!(pts.len(), 3);
            for &(x, y) in &pts {
                assert!(x >= x0 - 0.05 && x <= x1 + 0.05, "x {x} outside {x0}..{x1}");
                assert!(y >= y0 - 0.05 && y <= y1 + 0.05, "y {y} outside {y0}..{y1}");
            }
            // The series start at the left edge, end at the right, and peak where their value says.
            assert!((pts[0].0 - x0).abs() < 0.06 && (pts[2].0 - x1).abs() < 0.06);
            assert!((pts[0].1 - y1).abs() < 0.06);
            let input = all
                .iter()
                .find(|s| {
                    Some(s.trace.as_str()) == panel.attribute("data-trace")
                        && Some(s.allocator.as_str()) == path.attribute("data-allocator")
                })
                .unwrap();
            let bytes = if path.attribute("data-stat") == Some("allocated") {
                input.samples[1].allocated_bytes
            } else {
                input.samples[1].reserved_bytes
            };
            let peak = bytes as f64 / GIB as f64;
            assert!(
                (pts[1].1 - y_of(peak)).abs() < 0.2,
                "{peak} GiB at {}",
                pts[1].1
            );
        }
    }
}

#[test]
fn an_empty_or_flat_plot_is_still_valid() {
    for all in [
        vec![],
        vec![Series {
            trace: "idle".into(),
            allocator: "cuvmm".into(),
            events: 0,
            samples: vec![Sample {
                events: 0,
                allocated_bytes: 0,
                reserved_bytes: 0,
            }],
        }],
    ] {
        let svg = render_svg(&all);
        let doc = Document::parse(&svg).expect("well-formed XML");
        for path in doc.descendants().filter(|n| n.tag_name().name() == "path") {
            for (x, y) in points(path.attribute("d").unwrap()) {
                assert!(x.is_finite() && y.is_finite());
            }
        }
    }
}
