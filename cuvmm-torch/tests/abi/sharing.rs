//! Sharing memory between processes through the exported functions (PyTorch's `shareIpcHandle` and
//! `getIpcDevPtr`), on a simulated device: the importer is this process, which fetches the descriptors from
//! its own server over the Unix socket as another process would.

use super::*;
use cuvmm_torch::sharing::{HandleString, pending_exports};

/// `cuvmm_ipc_share`'s handle string and offset.
fn share(device: i32, ptr: *mut c_void) -> Option<(Vec<u8>, u64)> {
    let (mut len, mut offset) = (0usize, 0u64);
    // SAFETY: `len` and `offset` are valid for one write each.
    let bytes = unsafe { cuvmm_ipc_share(device, ptr, &mut len, &mut offset) };
    if bytes.is_null() {
        return None;
    }
    // SAFETY: a non-null result points to `len` bytes until cuvmm_bytes_free.
    let handle = unsafe { std::slice::from_raw_parts(bytes, len) }.to_vec();
    // SAFETY: `bytes` came from cuvmm_ipc_share with this `len`, and is freed once.
    unsafe { cuvmm_bytes_free(bytes, len) };
    Some((handle, offset))
}

fn open(device: i32, handle: &[u8]) -> *mut c_void {
    // SAFETY: `handle` is valid for reads of its length during the call.
    unsafe { cuvmm_ipc_open(device, handle.as_ptr(), handle.len()) }
}

#[test]
fn a_shared_allocation_opens_once_and_closes() {
    setup();
    let device = 11;
    let ptr = cuvmm_malloc(3 << 20, device, stream(0x61));
    assert!(!ptr.is_null(), "{:?}", last_error());
    let (handle, offset) = share(device, ptr).unwrap_or_else(|| panic!("{:?}", last_error()));
    let decoded = HandleString::decode(&handle).unwrap();
    assert_eq!(decoded.offset, offset);
    assert!(decoded.size >= 3 << 20);
    let range: u64 = decoded.parts.iter().map(|p| p.size).sum();
    assert!(
        offset + decoded.size <= range,
        "the range covers the allocation"
    );
    assert_eq!(HandleString::decode(&decoded.encode()).unwrap(), decoded);

    let base = open(device, &handle);
    assert!(!base.is_null(), "{:?}", last_error());
    assert_ne!(base, ptr, "mapped at addresses of its own");
    check_invariants(device);
    assert!(open(device, &handle).is_null(), "an export opens once");
    assert_failed("second open", "no such export");
    assert_eq!(cuvmm_ipc_close(device, base), 0, "{:?}", last_error());
    assert_eq!(cuvmm_ipc_close(device, base), -1);
    assert_failed("second close", "not open");
    cuvmm_free(ptr, 0, device, stream(0x61));
    check_invariants(device);
}

#[test]
fn an_export_not_opened_is_forgotten_when_its_memory_is_freed() {
    setup();
    let device = 12;
    let ptr = cuvmm_malloc(1 << 20, device, stream(0x62));
    let (handle, _) = share(device, ptr).unwrap_or_else(|| panic!("{:?}", last_error()));
    assert!(pending_exports() >= 1);
    cuvmm_free(ptr, 0, device, stream(0x62));
    assert!(open(device, &handle).is_null());
    assert_failed("open after free", "no such export");
    check_invariants(device);
}

#[test]
fn bad_handles_and_addresses_are_refused() {
    setup();
    let device = 14;
    let ptr = cuvmm_malloc(4096, device, stream(0x63));
    let (handle, _) = share(device, ptr).unwrap_or_else(|| panic!("{:?}", last_error()));
    for (bytes, expected) in [
        (&handle[..10], "cut short"),
        (
            &b"\x02c0123456789012345678901234567890123456789012345678901234567890123"[..],
            "not a cuvmm handle",
        ),
        (&[&handle[..], &[0u8][..]].concat()[..], "length"),
    ] {
        assert!(open(device, bytes).is_null());
        assert_failed("open of a bad handle", expected);
    }
    // SAFETY: a null handle is refused before it is read.
    assert!(unsafe { cuvmm_ipc_open(device, ptr::null(), 4) }.is_null());
    assert_failed("null handle", "null");
    assert!(share(device, ptr.wrapping_byte_add(8)).is_none());
    assert_failed(
        "share inside an allocation",
        "not an address this allocator handed out",
    );
    // SAFETY: null out-pointers are refused before anything is written.
    let refused = unsafe { cuvmm_ipc_share(device, ptr, ptr::null_mut(), ptr::null_mut()) };
    assert!(refused.is_null());
    assert_failed("null out-pointers", "null");
    let base = open(device, &handle);
    assert!(
        !base.is_null(),
        "the good handle still opens: {:?}",
        last_error()
    );
    assert_eq!(cuvmm_ipc_close(device, base), 0, "{:?}", last_error());
    cuvmm_free(ptr, 0, device, stream(0x63));
    check_invariants(device);
}
