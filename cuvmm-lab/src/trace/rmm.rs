//! RMM `logging_resource_adaptor` CSV logs as traces.
//!
//! RMM (RAPIDS Memory Manager) writes one header line, `Thread,Time,Action,Pointer,Size,Stream`, then one
//! row per request, with spdlog's pattern `%t,%H:%M:%S.%f,%v`:
//!
//! ```text
//! Thread,Time,Action,Pointer,Size,Stream
//! 140212,10:21:03.123456,allocate,0x7f2a40000000,1048576,0x0
//! 140212,10:21:03.123470,allocate failure,0x0,85899345920,0x0
//! 140212,10:21:03.124001,free,0x7f2a40000000,1048576,0x0
//! ```
//!
//! `Action` is `allocate`, `allocate failure` (the upstream resource refused; the pointer is null) or
//! `free`. Pointers and streams are hexadecimal: with `0x` from RMM builds that format with fmt
//! (`fmt::ptr`), without it from builds that format with printf (`%llx`); both are read. Sizes are
//! decimal bytes. The thread must be a decimal number; the time is not used: rows replay in file order,
//! which RMM's own replay benchmark (`benchmarks/replay/replay.cpp`) also relies on. A stream is only an
//! identity here, so a log that wrote streams in decimal still gets one distinct stream per value.
//!
//! Building the [`Trace`]: each `allocate` is an allocation with a fresh id, and a `free` frees the live
//! allocation at its pointer. A `free` of a pointer that no earlier row allocated is memory that was live
//! before logging began: it is seeded as an allocation (of the free's size, on its stream) at the start of
//! the trace, in address order, as the PyTorch snapshot reader does. `allocate failure` rows are not
//! replayed but counted ([`RmmLog::allocate_failures`]); zero-byte allocations, their frees and frees of
//! the null pointer request nothing and are counted as [`RmmLog::skipped`].

use super::event::{Event, MAX_SIZE, Trace};
use super::excerpt;
use cuvmm::driver::StreamId;
use std::collections::HashMap;
use std::path::{Path, PathBuf};

/// The header line RMM writes first.
pub const HEADER: &str = "Thread,Time,Action,Pointer,Size,Stream";

/// An RMM log read as a trace.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RmmLog {
    /// The requests, named after the file.
    pub trace: Trace,
    /// `allocate failure` rows: requests the logged resource could not serve, left out of the trace.
    pub allocate_failures: usize,
    /// Allocations live before logging began (frees of pointers the log never allocated), seeded at the
    /// start of the trace.
    pub seeded: usize,
    /// Rows that request nothing: zero-byte allocations, their frees, frees of the null pointer.
    pub skipped: usize,
}

/// Why an RMM log cannot be read. Every message names the file, and the line for a bad row.
#[derive(Debug, thiserror::Error)]
pub enum RmmError {
    /// The file cannot be read.
    #[error("{path}: cannot read: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// A line of the log is wrong.
    #[error("{path}:{line}: {problem}")]
    Line {
        /// The file.
        path: PathBuf,
        /// The line, counting from 1.
        line: usize,
        /// What is wrong with it.
        problem: RowProblem,
    },
}

/// What is wrong with one line of an RMM log.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum RowProblem {
    /// The first line is not RMM's header (an empty file has none).
    #[error("not an RMM log: expected the header `{HEADER}`, found {found:?}")]
    Header {
        /// The line found (cut short).
        found: String,
    },
    /// A row without exactly six comma-separated columns.
    #[error("expected 6 columns ({HEADER}), found {found}")]
    Columns {
        /// Columns found.
        found: usize,
    },
    /// An `Action` other than `allocate`, `allocate failure` and `free`.
    #[error("unknown action {action:?} (expected allocate, allocate failure or free)")]
    UnknownAction {
        /// The action found (cut short).
        action: String,
    },
    /// A column that does not hold a number of the expected base.
    #[error("{column} {text:?} is not a {base} number below 2^64")]
    BadNumber {
        /// The column's name.
        column: &'static str,
        /// What it holds (cut short).
        text: String,
        /// "decimal" or "hexadecimal".
        base: &'static str,
    },
    /// A negative size.
    #[error("negative size {text}")]
    NegativeSize {
        /// The size as written (cut short).
        text: String,
    },
    /// A size no device has.
    #[error("size {size} is beyond any device (more than 2^50 bytes)")]
    AbsurdSize {
        /// The size.
        size: u64,
    },
    /// A successful allocation of at least one byte at the null pointer.
    #[error("allocate of {size} bytes returned the null pointer")]
    NullAllocate {
        /// The size.
        size: u64,
    },
    /// An allocation at a pointer that is still live.
    #[error("allocate at {ptr:#x}, which is live since line {since}")]
    AllocateLive {
        /// The pointer.
        ptr: u64,
        /// The line that allocated it.
        since: usize,
    },
    /// A second free of a pointer without an allocation between them.
    #[error("free of {ptr:#x}, which line {freed} freed already")]
    DoubleFree {
        /// The pointer.
        ptr: u64,
        /// The line of the first free.
        freed: usize,
    },
}

/// Reads the RMM log at `path`.
///
/// # Errors
/// [`RmmError`], naming the file (and the line, for a bad line).
pub fn read(path: &Path) -> Result<RmmLog, RmmError> {
    let bytes = std::fs::read(path).map_err(|source| RmmError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    parse(path, &bytes)
}

/// Reads an RMM log from `bytes`; `path` names it in the trace and in errors.
///
/// # Errors
/// [`RmmError::Line`] for the first bad line.
pub fn parse(path: &Path, bytes: &[u8]) -> Result<RmmLog, RmmError> {
    let bytes = bytes.strip_prefix(b"\xEF\xBB\xBF").unwrap_or(bytes);
    let mut builder = Builder::default();
    let mut header_seen = false;
    let mut last = 0;
    for (index, raw) in bytes.split(|&b| b == b'\n').enumerate() {
        let line = index + 1;
        last = line;
        let text = String::from_utf8_lossy(raw);
        let text = text.trim();
        if text.is_empty() {
            continue;
        }
        let at = |problem| RmmError::Line {
            path: path.to_path_buf(),
            line,
            problem,
        };
        if !header_seen {
            if text != HEADER {
                return Err(at(RowProblem::Header {
                    found: excerpt(text),
                }));
            }
            header_seen = true;
            continue;
        }
        let row = parse_row(text).map_err(at)?;
        builder.apply(row, line).map_err(at)?;
    }
    if !header_seen {
        return Err(RmmError::Line {
            path: path.to_path_buf(),
            line: last.max(1),
            problem: RowProblem::Header {
                found: String::new(),
            },
        });
    }
    Ok(builder.finish(file_name(path)))
}

/// The file's name without its directory, as traces are named.
fn file_name(path: &Path) -> String {
    path.file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| path.display().to_string())
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Action {
    Allocate,
    AllocateFailure,
    Free,
}

#[derive(Clone, Copy, Debug)]
struct Row {
    action: Action,
    ptr: u64,
    size: u64,
    stream: u64,
}

fn parse_row(text: &str) -> Result<Row, RowProblem> {
    let columns: Vec<&str> = text.split(',').map(str::trim).collect();
    let [thread, _time, action, ptr, size, stream] = columns[..] else {
        return Err(RowProblem::Columns {
            found: columns.len(),
        });
    };
    let action = match action {
        "allocate" => Action::Allocate,
        "allocate failure" => Action::AllocateFailure,
        "free" => Action::Free,
        other => {
            return Err(RowProblem::UnknownAction {
                action: excerpt(other),
            });
        }
    };
    decimal(thread).ok_or_else(|| bad("Thread", thread, "decimal"))?;
    let ptr = hexadecimal(ptr).ok_or_else(|| bad("Pointer", ptr, "hexadecimal"))?;
    let stream = hexadecimal(stream).ok_or_else(|| bad("Stream", stream, "hexadecimal"))?;
    let size = match decimal(size) {
        Some(size) if size > MAX_SIZE => return Err(RowProblem::AbsurdSize { size }),
        Some(size) => size,
        None if size.strip_prefix('-').and_then(decimal).is_some() => {
            return Err(RowProblem::NegativeSize {
                text: excerpt(size),
            });
        }
        None => return Err(bad("Size", size, "decimal")),
    };
    Ok(Row {
        action,
        ptr,
        size,
        stream,
    })
}

fn bad(column: &'static str, text: &str, base: &'static str) -> RowProblem {
    RowProblem::BadNumber {
        column,
        text: excerpt(text),
        base,
    }
}

/// Decimal digits only (no sign), below 2^64.
fn decimal(text: &str) -> Option<u64> {
    if text.is_empty() || !text.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    text.parse().ok()
}

/// Hexadecimal digits, with or without `0x`, below 2^64.
fn hexadecimal(text: &str) -> Option<u64> {
    let digits = text
        .strip_prefix("0x")
        .or_else(|| text.strip_prefix("0X"))
        .unwrap_or(text);
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_hexdigit()) {
        return None;
    }
    u64::from_str_radix(digits, 16).ok()
}

/// The trace being built, row by row.
#[derive(Default)]
struct Builder {
    events: Vec<Event>,
    /// Live pointers: (id, line of the allocate).
    live: HashMap<u64, (u64, usize)>,
    /// Pointers whose last row is a free: the line of that free.
    freed: HashMap<u64, usize>,
    /// Allocations live before the log began: (pointer, size, stream, id).
    seeds: Vec<(u64, u64, StreamId, u64)>,
    next_id: u64,
    allocate_failures: usize,
    skipped: usize,
}

impl Builder {
    fn fresh_id(&mut self) -> u64 {
        self.next_id += 1;
        self.next_id - 1
    }

    fn apply(&mut self, row: Row, line: usize) -> Result<(), RowProblem> {
        let Row {
            action,
            ptr,
            size,
            stream,
        } = row;
        match action {
            Action::AllocateFailure => self.allocate_failures += 1,
            Action::Allocate if size == 0 => self.skipped += 1,
            Action::Allocate => {
                if ptr == 0 {
                    return Err(RowProblem::NullAllocate { size });
                }
                if let Some(&(_, since)) = self.live.get(&ptr) {
                    return Err(RowProblem::AllocateLive { ptr, since });
                }
                let id = self.fresh_id();
                self.freed.remove(&ptr);
                self.live.insert(ptr, (id, line));
                self.events.push(Event::Alloc {
                    id,
                    size,
                    stream: StreamId(stream),
                });
            }
            Action::Free => {
                if let Some((id, _)) = self.live.remove(&ptr) {
                    self.events.push(Event::Free { id });
                } else if ptr == 0 || size == 0 {
                    self.skipped += 1;
                    return Ok(());
                } else if let Some(&freed) = self.freed.get(&ptr) {
                    return Err(RowProblem::DoubleFree { ptr, freed });
                } else {
                    let id = self.fresh_id();
                    self.seeds.push((ptr, size, StreamId(stream), id));
                    self.events.push(Event::Free { id });
                }
                self.freed.insert(ptr, line);
            }
        }
        Ok(())
    }

    fn finish(mut self, name: String) -> RmmLog {
        self.seeds.sort_unstable_by_key(|&(ptr, ..)| ptr);
        let mut events = Vec::with_capacity(self.seeds.len() + self.events.len());
        events.extend(
            self.seeds
                .iter()
                .map(|&(_, size, stream, id)| Event::Alloc { id, size, stream }),
        );
        events.append(&mut self.events);
        RmmLog {
            trace: Trace { name, events },
            allocate_failures: self.allocate_failures,
            seeded: self.seeds.len(),
            skipped: self.skipped,
        }
    }
}
