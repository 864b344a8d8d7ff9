//! What every subcommand prints with: results to stdout, diagnostics to stderr, and the exit statuses.

use cuvmm::driver::DriverError;
use cuvmm::driver::device::DeviceError;
use std::io::Write;
use std::process::ExitCode;

/// Exit status for a request that cannot be served as asked (bad name, bad size).
pub const USAGE: u8 = 2;

/// `message` on one line: a message quoting a user's file could hold a line break.
pub fn one_line(message: &str) -> String {
    message.replace(['\n', '\r'], " ")
}

/// Writes results to stdout. A reader that went away (`cuvmm | head`) ends the program quietly, as it
/// would any Unix filter; another write error is reported on stderr.
pub fn emit(text: &str) -> ExitCode {
    let mut stdout = std::io::stdout().lock();
    match stdout
        .write_all(text.as_bytes())
        .and_then(|()| stdout.flush())
    {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("cuvmm: cannot write results: {e}");
            ExitCode::FAILURE
        }
    }
}

/// The exit status for a device that cannot be opened: 2 when this build or this machine has no CUDA
/// (the request cannot be served as asked), 1 when the driver is there but failed.
pub fn device_error_status(e: &DeviceError) -> u8 {
    match e {
        DeviceError::Driver(DriverError::NoDriver { .. }) | DeviceError::NoCudaSupport => USAGE,
        DeviceError::Driver(_) => 1,
    }
}
