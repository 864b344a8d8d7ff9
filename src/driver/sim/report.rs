//! The leak report: what a simulated device still holds.

use crate::base::size::format_size;
use crate::driver::{PhysHandle, VaRange};
use std::fmt;

/// How many entries of each kind [`LeakReport`]'s `Display` lists before it summarises the rest.
const SHOWN: usize = 16;

/// Everything a simulated device still holds.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LeakReport {
    /// Handles created or imported and not released: (handle, size). An imported handle is listed with its
    /// allocation's size, so the total counts memory shared by several handles once per handle.
    pub handles: Vec<(PhysHandle, u64)>,
    /// Mappings not unmapped.
    pub mappings: Vec<VaRange>,
    /// Reservations not freed.
    pub reservations: Vec<VaRange>,
    /// `malloc`s not freed.
    pub allocations: Vec<VaRange>,
}

impl LeakReport {
    /// Whether nothing is held.
    pub fn is_empty(&self) -> bool {
        self.handles.is_empty()
            && self.mappings.is_empty()
            && self.reservations.is_empty()
            && self.allocations.is_empty()
    }
}

impl fmt::Display for LeakReport {
    /// "no leaks", or one line per kind of leak with its count, total size and the first entries.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.is_empty() {
            return f.write_str("no leaks");
        }
        let mut first = true;
        let handles: Vec<String> = self
            .handles
            .iter()
            .map(|(h, size)| format!("{h} ({})", format_size(*size)))
            .collect();
        let handle_bytes = self.handles.iter().map(|(_, s)| s).sum();
        section(
            f,
            &mut first,
            "handles not released",
            handle_bytes,
            &handles,
        )?;
        for (what, ranges) in [
            ("mappings not unmapped", &self.mappings),
            ("reservations not freed", &self.reservations),
            ("allocations not freed", &self.allocations),
        ] {
            let items: Vec<String> = ranges
                .iter()
                .map(|r| format!("{:#x}+{}", r.start, format_size(r.size)))
                .collect();
            let bytes = ranges.iter().map(|r| r.size).sum();
            section(f, &mut first, what, bytes, &items)?;
        }
        Ok(())
    }
}

/// One line: "3 handles not released (6.00 MiB): a, b, c".
fn section(
    f: &mut fmt::Formatter<'_>,
    first: &mut bool,
    what: &str,
    bytes: u64,
    items: &[String],
) -> fmt::Result {
    if items.is_empty() {
        return Ok(());
    }
    if !*first {
        writeln!(f)?;
    }
    *first = false;
    write!(f, "{} {what} ({}): ", items.len(), format_size(bytes))?;
    let shown = items.len().min(SHOWN);
    f.write_str(&items[..shown].join(", "))?;
    if items.len() > shown {
        write!(f, ", ... and {} more", items.len() - shown)?;
    }
    Ok(())
}
