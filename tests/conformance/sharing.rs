//! The rule for sharing a handle between processes (`Driver::export_handle`, `Driver::import_handle`),
//! tried within one process: an import is another handle to the same memory.

use super::*;
use std::os::fd::AsFd;

/// A handle exported as a file descriptor and imported again is a second handle to the same memory: mapped
/// at another address it shows the bytes written through the first mapping; the import takes no more
/// device memory; closing the descriptor changes nothing; the memory stays while any handle to it is
/// unreleased or mapped, and returns once all are released and unmapped. A driver that does not export
/// its handles (`Driver::exports_handles` false) must refuse the export and keep nothing.
pub(super) fn export_and_import<D: Subject>(d: &mut D) {
    let g = d.granularity();
    let free0 = free_bytes(d);
    let h = d.create(2 * g).expect("create two pages");
    if !d.exports_handles() {
        rejected(
            "export where handles are not exportable",
            d.export_handle(h),
            |e| matches!(e, DriverError::Unsupported { .. }),
        );
        d.release(h).expect("release");
        return;
    }
    let created = free_bytes(d);
    let before = d.counters();
    let fd = d.export_handle(h).expect("export");
    let import = d
        .import_handle(fd.as_fd(), 2 * g)
        .expect("import in the same process");
    drop(fd);
    let after = d.counters();
    assert_eq!(after.get(Op::Export), before.get(Op::Export) + 1);
    assert_eq!(after.get(Op::Import), before.get(Op::Import) + 1);
    assert_ne!(import, h, "an import is a new handle");
    let imported = free_bytes(d);
    assert!(
        imported + g / 2 >= created,
        "the import took device memory: {created} -> {imported}"
    );
    let r = d.reserve(4 * g).expect("reserve");
    let (first, second) = (r.start, r.start + 2 * g);
    d.map(first, 2 * g, h).expect("map the created handle");
    d.map(second, 2 * g, import).expect("map the import");
    d.set_access(r.start, 4 * g).expect("set_access on both");
    d.memset_d8(first, 2 * g, 0x3C)
        .expect("memset through the first mapping");
    expect_bytes(d, second, 2 * g as usize, 0x3C, "the import's mapping");
    d.release(h)
        .expect("release the created handle while mapped");
    d.unmap(first, 2 * g).expect("unmap the first mapping");
    expect_bytes(d, second, 4096, 0x3C, "the import, its creator gone");
    d.unmap(second, 2 * g).expect("unmap the import");
    let held = free_bytes(d);
    assert!(
        held + g / 2 <= free0,
        "memory was freed while the import was unreleased: {free0} -> {held}"
    );
    d.release(import).expect("release the import");
    let back = free_bytes(d);
    assert!(
        back + g / 2 >= free0,
        "memory was not freed with the last handle: {free0} -> {back}"
    );
    d.free_reservation(r).expect("free_reservation");
}
