//! `cuvmm summary`: replays a trace and prints `memory_summary()` at the peak and at the end.

use crate::output::emit;
use crate::source::{Failure, SourceArgs, report_oom};
use clap::Args;
use cuvmm::size::format_size;
use cuvmm::strategy::Strategy;
use cuvmm::summary::summary_of;
use cuvmm_lab::replay::ReplayOptions;
use cuvmm_lab::replay::peak::{find_peak, replay_capturing};
use std::process::ExitCode;

/// Options of `summary`.
#[derive(Debug, Args)]
pub struct SummaryArgs {
    /// What to replay, and through which allocator.
    #[command(flatten)]
    pub source: SourceArgs,
}

/// `cuvmm summary`.
pub fn run_summary(args: SummaryArgs) -> ExitCode {
    match summarize(&args.source) {
        Ok(text) => emit(&text),
        Err(Failure { message, status }) => {
            eprintln!("cuvmm: {message}");
            ExitCode::from(status)
        }
    }
}

/// Two replays on identical allocators: the first finds the operation after which reserved memory first
/// peaked, the second prints the summary right after it, and at the end.
fn summarize(source: &SourceArgs) -> Result<String, Failure> {
    let trace = source.trace("summary")?;
    let options = ReplayOptions::default();
    let failed = |e: &dyn std::fmt::Display| Failure {
        message: format!(
            "replaying `{}` through {}: {e}",
            trace.name, source.allocator
        ),
        status: 1,
    };
    let mut first = source.strategy()?;
    let (_, peak) = find_peak(first.as_mut(), &trace, &options).map_err(|e| failed(&e))?;
    drop(first);
    let mut at_peak = String::new();
    let mut capture = |s: &dyn Strategy| at_peak = summary_of(s);
    let mut strategy = source.strategy()?;
    let result = replay_capturing(
        strategy.as_mut(),
        &trace,
        &options,
        peak.operation,
        &mut capture,
    )
    .map_err(|e| failed(&e))?;
    report_oom(&result);
    Ok(format!(
        "`{}` through {}: peak of {} reserved after operation {} of {} events\n\n{at_peak}\n\
         `{}` through {}: end of the replay\n\n{}",
        trace.name,
        result.allocator,
        format_size(peak.reserved),
        peak.operation,
        result.events,
        trace.name,
        result.allocator,
        summary_of(strategy.as_ref()),
    ))
}
