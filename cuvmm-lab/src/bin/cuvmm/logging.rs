//! Logging to stderr through `tracing`: `-v` info, `-vv` debug, `-vvv` trace; without `-v`, `RUST_LOG`;
//! by default errors only. Results stay alone on stdout.

use std::ffi::OsString;
use tracing_subscriber::EnvFilter;

/// Installs the subscriber for `verbose` (the count of `-v`).
pub fn init(verbose: u8) {
    let filter = match verbose {
        0 => match std::env::var(EnvFilter::DEFAULT_ENV) {
            Ok(spec) => EnvFilter::try_new(&spec).unwrap_or_else(|e| {
                eprintln!("cuvmm: ignoring RUST_LOG `{spec}`: {e}");
                EnvFilter::new("error")
            }),
            Err(_) => EnvFilter::new("error"),
        },
        1 => EnvFilter::new("info"),
        2 => EnvFilter::new("debug"),
        _ => EnvFilter::new("trace"),
    };
    // Fails only if a subscriber is already installed, which nothing else in the program does.
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(false)
        .try_init();
}

/// Takes the `-v` flags that come first (`cuvmm -vv summary ...`) out of `args` and counts them. clap
/// refuses a flag before a subcommand here (the top-level options are `compare`'s and conflict with
/// subcommands), so these are counted by hand; after the subcommand, clap reads `-v` itself.
pub fn leading_verbosity(args: Vec<OsString>) -> (u8, Vec<OsString>) {
    let mut count = 0u8;
    let mut rest = Vec::with_capacity(args.len());
    let mut leading = true;
    for (i, arg) in args.into_iter().enumerate() {
        if i > 0 && leading {
            let text = arg.to_string_lossy();
            if text == "--verbose" {
                count = count.saturating_add(1);
                continue;
            }
            if let Some(vs) = text.strip_prefix('-')
                && !vs.is_empty()
                && vs.bytes().all(|b| b == b'v')
            {
                count = count.saturating_add(u8::try_from(vs.len()).unwrap_or(u8::MAX));
                continue;
            }
            leading = false;
        }
        rest.push(arg);
    }
    (count, rest)
}
