//! Probes: what a driver answers where CUDA leaves the behaviour to the implementation, recorded rather than
//! asserted.

use super::*;
use std::os::fd::AsFd;

/// What a probe found.
#[derive(Debug)]
pub struct Probe {
    /// What was tried.
    pub name: &'static str,
    /// `Err` with the error if the driver rejected it, `Ok` if it accepted it.
    pub outcome: Result<(), DriverError>,
}

/// Tries what the simulator rejects but CUDA's documentation does not clearly forbid, cleaning up after
/// each. Returns what happened, for the caller to assert (simulator) or print (GPU).
pub fn probes<D: Subject>(make: impl Fn() -> D) -> Vec<Probe> {
    let mut found = Vec::new();
    // cuMemAddressReserve asks for a multiple of the host page size; the simulator asks for the granularity.
    {
        let mut d = make();
        let g = d.granularity();
        let outcome = d.reserve(g + 4096).map(|r| {
            d.free_reservation(r).expect("free the probe's reservation");
        });
        found.push(Probe {
            name: "reserve of a host-page multiple that is not a granularity multiple",
            outcome,
        });
    }
    // One unmap / set_access over two mappings with an unmapped page between them.
    for (name, set_access) in [
        ("unmap of a range with a hole between two mappings", false),
        (
            "set_access on a range with a hole between two mappings",
            true,
        ),
    ] {
        let mut d = make();
        let g = d.granularity();
        let (r, hs) = setup(&mut d, 3, 2);
        d.map(r.start, g, hs[0]).expect("map");
        d.map(r.start + 2 * g, g, hs[1]).expect("map");
        let outcome = if set_access {
            d.set_access(r.start, 3 * g)
        } else {
            d.unmap(r.start, 3 * g)
        };
        for va in [r.start, r.start + 2 * g] {
            // Already gone if the probe's unmap was accepted.
            let _ = d.unmap(va, g);
        }
        teardown(&mut d, r, &hs);
        found.push(Probe { name, outcome });
    }
    // cuMemImportFromShareableHandle of a descriptor that is no export (the simulator: NotExported).
    {
        let mut d = make();
        let null = std::fs::File::open("/dev/null").expect("open /dev/null");
        let outcome = (d.import_handle(null.as_fd(), d.granularity())).map(|h| {
            d.release(h).expect("release the probe's import");
        });
        found.push(Probe {
            name: "import of a descriptor that no export made",
            outcome,
        });
    }
    // An import that names a size other than the exported handle's: CUDA is not told the size, and the
    // simulator checks it (ImportSizeMismatch).
    let mut d = make();
    if d.exports_handles() {
        let g = d.granularity();
        let h = d.create(2 * g).expect("create");
        let fd = d.export_handle(h).expect("export");
        let outcome = d.import_handle(fd.as_fd(), g).map(|import| {
            d.release(import).expect("release the probe's import");
        });
        d.release(h).expect("release");
        found.push(Probe {
            name: "import naming a size other than the exported handle's",
            outcome,
        });
    }
    found
}
