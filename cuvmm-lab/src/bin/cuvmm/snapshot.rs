//! `cuvmm snapshot`: replays a trace with history recording on and writes the allocator's snapshot as the
//! pickle PyTorch's memory viewer reads.

use crate::output::emit;
use crate::source::{Failure, SourceArgs, first_line, report_oom};
use clap::Args;
use cuvmm_lab::replay::{ReplayOptions, replay};
use cuvmm_lab::trace::pytorch::writer;
use std::path::PathBuf;
use std::process::ExitCode;

/// Options of `snapshot`.
#[derive(Debug, Args)]
pub struct SnapshotArgs {
    /// What to replay, and through which allocator.
    #[command(flatten)]
    pub source: SourceArgs,
    /// Where to write the snapshot (a pickle for https://pytorch.org/memory_viz).
    #[arg(short = 'o', long = "output", value_name = "OUT.pickle")]
    pub output: PathBuf,
    /// Keep only the last N events of the history (PyTorch's `max_entries`); default: all.
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..))]
    pub max_entries: Option<u64>,
}

/// `cuvmm snapshot`.
pub fn run_snapshot(args: SnapshotArgs) -> ExitCode {
    match write_snapshot(&args) {
        Ok(text) => emit(&text),
        Err(Failure { message, status }) => {
            eprintln!("cuvmm: {message}");
            ExitCode::from(status)
        }
    }
}

fn write_snapshot(args: &SnapshotArgs) -> Result<String, Failure> {
    let trace = args.source.trace("snapshot")?;
    let mut strategy = args.source.strategy()?;
    let failed = |message: String| Failure { message, status: 1 };
    let max_entries = args
        .max_entries
        .map_or(usize::MAX, |n| usize::try_from(n).unwrap_or(usize::MAX));
    let unsupported = strategy.unsupported("snapshot");
    (strategy.snapshots().ok_or(unsupported))
        .and_then(|snapshots| snapshots.record_history(Some(max_entries)))
        .map_err(|e| failed(first_line(&e)))?;
    let result = replay(strategy.as_mut(), &trace, &ReplayOptions::default()).map_err(|e| {
        failed(format!(
            "replaying `{}` through {}: {e}",
            trace.name, args.source.allocator
        ))
    })?;
    report_oom(&result);
    let unsupported = strategy.unsupported("snapshot");
    let snapshot = (strategy.snapshots().ok_or(unsupported))
        .and_then(|snapshots| snapshots.snapshot())
        .map_err(|e| failed(first_line(&e)))?;
    // An output path that cannot be written is the user's to fix: status 2.
    writer::write_file(&args.output, &snapshot).map_err(|e| Failure {
        message: first_line(&e),
        status: crate::output::USAGE,
    })?;
    let blocks: usize = snapshot.segments.iter().map(|s| s.blocks.len()).sum();
    let entries: usize = snapshot.device_traces.iter().map(Vec::len).sum();
    Ok(format!(
        "{}: `{}` through {}: {} segments, {} blocks, {} trace entries\n",
        args.output.display(),
        trace.name,
        result.allocator,
        snapshot.segments.len(),
        blocks,
        entries,
    ))
}
