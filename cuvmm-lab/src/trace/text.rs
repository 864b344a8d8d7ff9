//! cuvmm's own trace format: one line per event, what `cuvmm workload NAME -o FILE` writes and
//! `--trace FILE` reads. `docs/trace-format.md` is its specification; in short:
//!
//! ```text
//! # cuvmm-trace v1
//! name moe
//! alloc 0 4096 0
//! alloc 1 1048576 7
//! record_stream 1 0
//! free 0
//! empty_cache
//! ```
//!
//! [`write`](fn@write) then [`parse`] gives back the same [`Trace`], name included. [`parse`] refuses what no program
//! could have produced (a free of an id that is not live, a zero-byte allocation, ...), naming the line.

use super::event::{Event, MAX_SIZE, Trace, TraceError};
use super::excerpt;
use cuvmm::driver::StreamId;
use std::io::Write;
use std::path::{Path, PathBuf};

/// The first line of every file, with the format's version.
pub const HEADER: &str = "# cuvmm-trace v1";

/// The header's start, shared by every version.
const HEADER_PREFIX: &str = "# cuvmm-trace ";

/// Writes `trace` to `out` in this format, buffered.
///
/// # Errors
/// What `out` returns.
pub fn write(trace: &Trace, out: impl Write) -> std::io::Result<()> {
    let mut out = std::io::BufWriter::new(out);
    writeln!(out, "{HEADER}")?;
    writeln!(out, "name {}", escape(&trace.name))?;
    for event in &trace.events {
        match *event {
            Event::Alloc { id, size, stream } => writeln!(out, "alloc {id} {size} {}", stream.0)?,
            Event::Free { id } => writeln!(out, "free {id}")?,
            Event::RecordStream { id, stream } => writeln!(out, "record_stream {id} {}", stream.0)?,
            Event::EmptyCache => writeln!(out, "empty_cache")?,
        }
    }
    out.flush()
}

/// `trace` in this format.
pub fn to_string(trace: &Trace) -> String {
    let mut bytes = Vec::new();
    write(trace, &mut bytes).expect("writing to memory cannot fail");
    String::from_utf8(bytes).expect("the format is UTF-8")
}

/// Why a cuvmm trace cannot be read. Every message names the file, and the line for a bad line.
#[derive(Debug, thiserror::Error)]
pub enum TextError {
    /// The file cannot be read.
    #[error("{path}: cannot read: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// A line is wrong.
    #[error("{path}:{line}: {problem}")]
    Line {
        /// The file.
        path: PathBuf,
        /// The line, counting from 1.
        line: usize,
        /// What is wrong with it.
        problem: LineProblem,
    },
}

/// What is wrong with one line of a cuvmm trace.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum LineProblem {
    /// The first line is not a cuvmm trace header.
    #[error("not a cuvmm trace: expected `{HEADER}`, found {found:?}")]
    Header {
        /// The line found (cut short).
        found: String,
    },
    /// A header of another version of the format.
    #[error("cuvmm trace version {version:?} is not supported (this build reads v1)")]
    Version {
        /// The version named.
        version: String,
    },
    /// Bytes that are not UTF-8.
    #[error("not UTF-8 text")]
    NotUtf8,
    /// A line that is no record this format has.
    #[error("unknown record {word:?} (expected name, alloc, free, record_stream or empty_cache)")]
    UnknownRecord {
        /// Its first word (cut short).
        word: String,
    },
    /// A record with too few or too many fields.
    #[error("`{record}` takes {expected} numbers, found {found}")]
    Fields {
        /// The record.
        record: &'static str,
        /// Numbers it takes.
        expected: usize,
        /// Numbers found.
        found: usize,
    },
    /// A field that is not a decimal number.
    #[error("{field} {text:?} is not a decimal number below 2^64")]
    BadNumber {
        /// The field.
        field: &'static str,
        /// What it holds (cut short).
        text: String,
    },
    /// A size no device has.
    #[error("size {size} is beyond any device (more than 2^50 bytes)")]
    AbsurdSize {
        /// The size.
        size: u64,
    },
    /// A backslash in a name not followed by `\`, `n` or `r`.
    #[error("bad escape in the name (only \\\\, \\n and \\r)")]
    BadEscape,
    /// A second `name` line, or one after the first event.
    #[error("`name` must come once, before the first event")]
    MisplacedName,
    /// An event no program could have made (a free of an id that is not live, ...).
    #[error(transparent)]
    Invalid(TraceError),
}

/// Reads the cuvmm trace at `path`.
///
/// # Errors
/// [`TextError`], naming the file (and the line, for a bad line).
pub fn read(path: &Path) -> Result<Trace, TextError> {
    let bytes = std::fs::read(path).map_err(|source| TextError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    parse(path, &bytes)
}

/// Reads a cuvmm trace from `bytes`; `path` names it in errors, and names the trace if it has no `name`
/// line.
///
/// # Errors
/// [`TextError::Line`] for the first bad line.
pub fn parse(path: &Path, bytes: &[u8]) -> Result<Trace, TextError> {
    let error = |line, problem| TextError::Line {
        path: path.to_path_buf(),
        line,
        problem,
    };
    let bytes = bytes.strip_prefix(b"\xEF\xBB\xBF").unwrap_or(bytes);
    let mut lines = bytes.split(|&b| b == b'\n').enumerate().map(|(i, raw)| {
        let raw = raw.strip_suffix(b"\r").unwrap_or(raw);
        let text = std::str::from_utf8(raw).map_err(|_| error(i + 1, LineProblem::NotUtf8));
        (i + 1, text)
    });
    let first = lines.next().map_or(Ok(""), |(_, text)| text)?;
    check_header(first).map_err(|problem| error(1, problem))?;
    let mut name = None;
    let mut events = Vec::new();
    let mut event_lines = Vec::new();
    for (line, text) in lines {
        let text = text?;
        let record = text.trim_start();
        if record.is_empty() || record.starts_with('#') {
            continue;
        }
        if let Some(rest) = name_text(record) {
            if name.is_some() || !events.is_empty() {
                return Err(error(line, LineProblem::MisplacedName));
            }
            name = Some(unescape(rest).ok_or_else(|| error(line, LineProblem::BadEscape))?);
            continue;
        }
        events.push(parse_event(record).map_err(|problem| error(line, problem))?);
        event_lines.push(line);
    }
    let name = name.unwrap_or_else(|| {
        path.file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default()
    });
    let trace = Trace { name, events };
    trace.validate().map_err(|e| {
        let index = match e {
            TraceError::ZeroSize { index, .. }
            | TraceError::DuplicateId { index, .. }
            | TraceError::UnknownFree { index, .. }
            | TraceError::DoubleFree { index, .. }
            | TraceError::RecordStreamNotLive { index, .. } => index,
        };
        error(event_lines[index], LineProblem::Invalid(e))
    })?;
    Ok(trace)
}

fn check_header(first: &str) -> Result<(), LineProblem> {
    if first == HEADER {
        return Ok(());
    }
    match first.strip_prefix(HEADER_PREFIX) {
        Some(version) => Err(LineProblem::Version {
            version: excerpt(version),
        }),
        None => Err(LineProblem::Header {
            found: excerpt(first),
        }),
    }
}

/// The text of a `name` record (after `name` and one space or tab), or `None` if it is another record.
fn name_text(record: &str) -> Option<&str> {
    let rest = record.strip_prefix("name")?;
    if rest.is_empty() {
        return Some(rest);
    }
    rest.strip_prefix([' ', '\t'])
}

fn parse_event(record: &str) -> Result<Event, LineProblem> {
    let mut words = record.split_ascii_whitespace();
    let word = words.next().unwrap_or_default();
    let fields: Vec<&str> = words.collect();
    let (record, expected) = match word {
        "alloc" => ("alloc", 3),
        "free" => ("free", 1),
        "record_stream" => ("record_stream", 2),
        "empty_cache" => ("empty_cache", 0),
        _ => {
            return Err(LineProblem::UnknownRecord {
                word: excerpt(word),
            });
        }
    };
    if fields.len() != expected {
        return Err(LineProblem::Fields {
            record,
            expected,
            found: fields.len(),
        });
    }
    if record == "empty_cache" {
        return Ok(Event::EmptyCache);
    }
    let id = number("id", fields[0])?;
    Ok(match record {
        "alloc" => {
            let size = number("size", fields[1])?;
            if size > MAX_SIZE {
                return Err(LineProblem::AbsurdSize { size });
            }
            let stream = StreamId(number("stream", fields[2])?);
            Event::Alloc { id, size, stream }
        }
        "free" => Event::Free { id },
        _ => Event::RecordStream {
            id,
            stream: StreamId(number("stream", fields[1])?),
        },
    })
}

/// Decimal digits only (no sign), below 2^64.
fn number(field: &'static str, text: &str) -> Result<u64, LineProblem> {
    let bad = || LineProblem::BadNumber {
        field,
        text: excerpt(text),
    };
    if text.is_empty() || !text.bytes().all(|b| b.is_ascii_digit()) {
        return Err(bad());
    }
    text.parse().map_err(|_| bad())
}

/// A name on one line: `\` as `\\`, line feed as `\n`, carriage return as `\r`.
fn escape(name: &str) -> String {
    let mut out = String::with_capacity(name.len());
    for c in name.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            c => out.push(c),
        }
    }
    out
}

/// The inverse of [`escape`]; `None` for a backslash followed by anything else.
fn unescape(text: &str) -> Option<String> {
    let mut out = String::with_capacity(text.len());
    let mut chars = text.chars();
    while let Some(c) = chars.next() {
        if c != '\\' {
            out.push(c);
            continue;
        }
        out.push(match chars.next()? {
            '\\' => '\\',
            'n' => '\n',
            'r' => '\r',
            _ => return None,
        });
    }
    Some(out)
}
