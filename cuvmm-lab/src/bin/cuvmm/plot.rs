//! `compare --plot FILE.svg`: the file is created before the replays start, so a path that cannot be
//! written is reported at once (status 2), and the picture written once they are done.

use crate::output::USAGE;
use cuvmm_lab::reports::plot::render_svg;
use cuvmm_lab::reports::sample::Series;
use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

/// The file a plot goes to.
#[derive(Debug)]
pub struct PlotFile {
    path: PathBuf,
    file: File,
}

impl PlotFile {
    /// Creates (or truncates) `path`; on failure, says so in one line naming the flag and the file, and
    /// gives the exit status.
    pub fn create(path: &Path) -> Result<Self, ExitCode> {
        match File::create(path) {
            Ok(file) => Ok(Self {
                path: path.to_path_buf(),
                file,
            }),
            Err(e) => {
                eprintln!("cuvmm: --plot {}: cannot create: {e}", path.display());
                Err(ExitCode::from(USAGE))
            }
        }
    }

    /// Draws `series` into the file; a failure is one line on stderr and status 1.
    pub fn write(mut self, series: &[Series]) -> Result<(), ExitCode> {
        let svg = render_svg(series);
        self.file
            .write_all(svg.as_bytes())
            .and_then(|()| self.file.flush())
            .map_err(|e| {
                eprintln!("cuvmm: --plot {}: cannot write: {e}", self.path.display());
                ExitCode::FAILURE
            })
    }
}
