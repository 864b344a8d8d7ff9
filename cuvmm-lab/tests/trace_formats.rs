//! The trace file readers: RMM `logging_resource_adaptor` logs (`trace::rmm`), cuvmm's own format
//! (`trace::text`, with its writer) and the dispatch by format (`trace::load`).
//!
//! Properties checked: every trace a reader returns passes `Trace::validate`; `text::write` then
//! `text::parse` gives back exactly the trace written, for any valid trace, and for any other trace either
//! that or a typed error; every bad line is a typed error naming the file, the line and the problem.

#[path = "trace_formats/loading.rs"]
mod loading;
#[path = "trace_formats/rmm_logs.rs"]
mod rmm_logs;
#[path = "trace_formats/text_traces.rs"]
mod text_traces;

use cuvmm::StreamId;
use cuvmm_lab::trace::Event;
use cuvmm_lab::trace::Trace;
use cuvmm_lab::trace::TraceError;
use cuvmm_lab::trace::event::MAX_SIZE;
use cuvmm_lab::trace::load::{self, LoadError};
use cuvmm_lab::trace::rmm::{self, RmmError, RowProblem};
use cuvmm_lab::trace::text::{self, LineProblem, TextError};
use cuvmm_lab::workload;
use proptest::prelude::*;
use std::path::Path;

const LOG: &str = "run.csv";

/// A bad file, the line its error names, and a test of the problem reported.
type Case<P> = (String, usize, fn(&P) -> bool);

fn rmm_log(rows: &[&str]) -> String {
    let mut text = format!("{}\n", rmm::HEADER);
    for row in rows {
        text.push_str(row);
        text.push('\n');
    }
    text
}

fn read_rmm(text: &str) -> rmm::RmmLog {
    let log = rmm::parse(Path::new(LOG), text.as_bytes()).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(log.trace.validate(), Ok(()));
    log
}

fn alloc(id: u64, size: u64, stream: u64) -> Event {
    Event::Alloc {
        id,
        size,
        stream: StreamId(stream),
    }
}
