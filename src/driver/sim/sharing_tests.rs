//! Tests of handles exported as file descriptors and imported (`sharing.rs`).

use super::{SimConfig, SimDriver};
use crate::driver::{Driver, DriverError, Op, PhysHandle, VaRange};
use std::os::fd::{AsFd, OwnedFd};

const PAGE: u64 = 2 << 20;

fn device() -> SimDriver {
    SimDriver::new(
        SimConfig::default()
            .with_capacity(8 * PAGE)
            .with_backing_store(true),
    )
}

/// Maps `handle` (of `size` bytes) at the start of a new reservation, with access set.
fn mapped(d: &mut SimDriver, handle: PhysHandle, size: u64) -> VaRange {
    let va = d.reserve(size).unwrap();
    d.map(va.start, size, handle).unwrap();
    d.set_access(va.start, size).unwrap();
    va
}

/// A handle of `size` bytes, exported, and a second handle imported from the export.
fn shared(d: &mut SimDriver, size: u64) -> (PhysHandle, OwnedFd, PhysHandle) {
    let handle = d.create(size).unwrap();
    let fd = d.export_handle(handle).unwrap();
    let import = d.import_handle(fd.as_fd(), size).unwrap();
    (handle, fd, import)
}

#[test]
fn an_import_mapped_elsewhere_shows_the_same_bytes() {
    let mut d = device();
    let (handle, _fd, import) = shared(&mut d, 2 * PAGE);
    assert_ne!(handle, import, "an import is a new handle");
    let first = mapped(&mut d, handle, 2 * PAGE);
    let second = mapped(&mut d, import, 2 * PAGE);
    d.memset_d8(first.start, 2 * PAGE, 0x5A).unwrap();
    let mut out = vec![0; 4096];
    d.copy_to_host(second.start + PAGE + 100, &mut out).unwrap();
    assert!(out.iter().all(|&b| b == 0x5A));
    d.copy_from_host(second.start + 7, &[1, 2, 3]).unwrap();
    let mut back = [0; 5];
    d.copy_to_host(first.start + 6, &mut back).unwrap();
    assert_eq!(back, [0x5A, 1, 2, 3, 0x5A]);
}

#[test]
fn an_import_charges_no_capacity_and_memory_goes_with_the_last_handle() {
    let mut d = device();
    let handle = d.create(PAGE).unwrap();
    let free = d.mem_info().unwrap().free;
    let fd = d.export_handle(handle).unwrap();
    let import = d.import_handle(fd.as_fd(), PAGE).unwrap();
    assert_eq!(d.mem_info().unwrap().free, free, "capacity is charged once");
    assert_eq!(d.handle_count(), 2);
    let va = mapped(&mut d, import, PAGE);
    d.write(va.start, b"kept").unwrap();
    // The creating handle goes first: the import, mapped, keeps the memory and its bytes.
    d.release(handle).unwrap();
    assert_eq!(d.mem_info().unwrap().free, free);
    assert_eq!(d.read(va.start, 4).unwrap(), b"kept");
    d.unmap(va.start, PAGE).unwrap();
    assert_eq!(
        d.mem_info().unwrap().free,
        free,
        "the import is not released"
    );
    d.release(import).unwrap();
    assert_eq!(d.mem_info().unwrap().free, 8 * PAGE);
    d.free_reservation(va).unwrap();
    assert!(d.leak_report().is_empty());
}

#[test]
fn releasing_the_import_first_keeps_the_mapped_original() {
    let mut d = device();
    let (handle, _fd, import) = shared(&mut d, PAGE);
    let va = mapped(&mut d, handle, PAGE);
    d.write(va.start, b"abc").unwrap();
    d.release(import).unwrap();
    d.release(handle).unwrap();
    assert_eq!(d.used_bytes(), PAGE, "still mapped");
    assert_eq!(d.read(va.start, 3).unwrap(), b"abc");
    d.unmap(va.start, PAGE).unwrap();
    assert_eq!(d.used_bytes(), 0);
    // The same memory, mapped again through a new handle, starts from zeros: the bytes went with it.
    let fresh = d.create(PAGE).unwrap();
    d.map(va.start, PAGE, fresh).unwrap();
    d.set_access(va.start, PAGE).unwrap();
    assert_eq!(d.read(va.start, 3).unwrap(), [0, 0, 0]);
    d.unmap(va.start, PAGE).unwrap();
    d.release(fresh).unwrap();
    d.free_reservation(va).unwrap();
}

#[test]
fn a_duplicated_descriptor_names_the_same_export() {
    let mut d = device();
    let handle = d.create(PAGE).unwrap();
    let fd = d.export_handle(handle).unwrap();
    let dup = fd.try_clone().unwrap();
    drop(fd);
    let import = d.import_handle(dup.as_fd(), PAGE).unwrap();
    let va = mapped(&mut d, handle, PAGE);
    let vb = mapped(&mut d, import, PAGE);
    d.write(va.start, &[9; 16]).unwrap();
    assert_eq!(d.read(vb.start, 16).unwrap(), [9; 16]);
    // Exporting again makes a new descriptor of the same memory.
    let again = d.export_handle(import).unwrap();
    let third = d.import_handle(again.as_fd(), PAGE).unwrap();
    let vc = mapped(&mut d, third, PAGE);
    assert_eq!(d.read(vc.start, 16).unwrap(), [9; 16]);
    assert_eq!(d.used_bytes(), PAGE);
}

#[test]
fn a_descriptor_this_device_did_not_export_is_refused() {
    let mut d = device();
    let (file, _other) = std::os::unix::net::UnixStream::pair().unwrap();
    let err = d.import_handle(file.as_fd(), PAGE).unwrap_err();
    assert!(matches!(err, DriverError::NotExported { .. }), "{err}");
    let null = std::fs::File::open("/dev/null").unwrap();
    let err = d.import_handle(null.as_fd(), PAGE).unwrap_err();
    assert!(matches!(err, DriverError::NotExported { .. }), "{err}");
    // Another device's export is not this device's.
    let mut other = device();
    let theirs = other.create(PAGE).unwrap();
    let fd = other.export_handle(theirs).unwrap();
    let err = d.import_handle(fd.as_fd(), PAGE).unwrap_err();
    assert!(matches!(err, DriverError::NotExported { .. }), "{err}");
    other.release(theirs).unwrap();
    assert_eq!(d.handle_count(), 0);
}

#[test]
fn an_import_of_another_size_is_refused() {
    let mut d = device();
    let handle = d.create(2 * PAGE).unwrap();
    let fd = d.export_handle(handle).unwrap();
    let err = d.import_handle(fd.as_fd(), PAGE).unwrap_err();
    assert!(
        matches!(
            err,
            DriverError::ImportSizeMismatch {
                exported,
                size,
                ..
            } if exported == 2 * PAGE && size == PAGE
        ),
        "{err}"
    );
    assert_eq!(d.handle_count(), 1, "nothing imported");
}

#[test]
fn an_unknown_or_released_handle_is_not_exported() {
    let mut d = device();
    let err = d.export_handle(PhysHandle(42)).unwrap_err();
    assert_eq!(
        err,
        DriverError::UnknownHandle {
            op: Op::Export,
            handle: PhysHandle(42)
        }
    );
    let handle = d.create(PAGE).unwrap();
    let va = mapped(&mut d, handle, PAGE);
    d.release(handle).unwrap();
    let err = d.export_handle(handle).unwrap_err();
    assert!(
        matches!(err, DriverError::UnknownHandle { op: Op::Export, .. }),
        "released, even while mapped: {err}"
    );
    d.unmap(va.start, PAGE).unwrap();
}

#[test]
fn an_export_whose_memory_is_freed_cannot_be_imported() {
    let mut d = device();
    let handle = d.create(PAGE).unwrap();
    let fd = d.export_handle(handle).unwrap();
    let va = mapped(&mut d, handle, PAGE);
    d.release(handle).unwrap();
    // Released but still mapped: the memory is alive, so the import is allowed.
    let import = d.import_handle(fd.as_fd(), PAGE).unwrap();
    d.unmap(va.start, PAGE).unwrap();
    d.release(import).unwrap();
    let err = d.import_handle(fd.as_fd(), PAGE).unwrap_err();
    assert!(matches!(err, DriverError::ExportFreed { .. }), "{err}");
    assert!(d.leak_report().handles.is_empty());
}

#[test]
fn an_import_not_released_is_a_leaked_handle() {
    let mut d = device();
    let (handle, _fd, import) = shared(&mut d, PAGE);
    d.release(handle).unwrap();
    assert_eq!(d.leak_report().handles, [(import, PAGE)]);
    d.release(import).unwrap();
    assert!(d.leak_report().is_empty());
    assert_eq!(d.used_bytes(), 0);
}

#[test]
fn exports_and_imports_are_counted_and_fail_on_demand() {
    let mut d = device();
    let handle = d.create(PAGE).unwrap();
    assert!(d.export_handle(PhysHandle(9)).is_err());
    let fd = d.export_handle(handle).unwrap();
    let import = d.import_handle(fd.as_fd(), PAGE).unwrap();
    assert!(d.import_handle(fd.as_fd(), 2 * PAGE).is_err());
    assert_eq!(d.counters().get(Op::Export), 2);
    assert_eq!(d.counters().get(Op::Import), 2);
    d.fail_nth(Op::Export, 1, super::FaultKind::Error);
    d.fail_nth(Op::Import, 1, super::FaultKind::Error);
    assert!(matches!(
        d.export_handle(handle),
        Err(DriverError::Injected {
            op: Op::Export,
            call: 3
        })
    ));
    assert!(matches!(
        d.import_handle(fd.as_fd(), PAGE),
        Err(DriverError::Injected {
            op: Op::Import,
            call: 3
        })
    ));
    assert_eq!(d.handle_count(), 2, "a failed import makes no handle");
    d.release(import).unwrap();
    d.release(handle).unwrap();
}

#[test]
fn a_device_without_exportable_handles_refuses_both_calls() {
    let mut d = SimDriver::new(SimConfig::default().with_exportable_handles(false));
    assert!(!d.exports_handles());
    let handle = d.create(PAGE).unwrap();
    assert_eq!(
        d.export_handle(handle).unwrap_err(),
        DriverError::Unsupported { op: Op::Export }
    );
    let (file, _other) = std::os::unix::net::UnixStream::pair().unwrap();
    assert_eq!(
        d.import_handle(file.as_fd(), PAGE).unwrap_err(),
        DriverError::Unsupported { op: Op::Import }
    );
    assert_eq!(d.counters().get(Op::Export), 1);
    assert_eq!(d.counters().get(Op::Import), 1);
    d.release(handle).unwrap();
    assert!(device().exports_handles(), "on by default");
}
