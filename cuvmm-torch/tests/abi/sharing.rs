//! Sharing memory between processes through the exported functions (PyTorch's `shareIpcHandle` and
//! `getIpcDevPtr`), on a simulated device: the importer is this process, which fetches the descriptors from
//! its own server over the Unix socket as another process would.

use super::*;
use cuvmm_torch::sharing::{HandleString, pending_exports};
use cuvmm_torch::torch_handle::TorchHandle;

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

/// The handle string of a sharing: PyTorch's layout with cuvmm's own string after it.
fn decode(handle: &[u8]) -> (TorchHandle, HandleString) {
    let torch = TorchHandle::decode(handle).unwrap_or_else(|e| panic!("{e}"));
    let own = HandleString::decode(&torch.rest).unwrap();
    (torch, own)
}

/// A shared allocation's handle is in PyTorch's layout (what a process on PyTorch's allocator reads: this
/// process's pid and descriptors, whole handles of one size) with cuvmm's string after it; it opens with
/// `pidfd_getfd`, as often as asked while the allocation lives, and sharing again gives the same handle.
#[test]
fn a_shared_allocation_opens_in_pytorchs_layout_while_it_lives() {
    setup();
    let device = 11;
    let ptr = cuvmm_malloc(3 << 20, device, stream(0x61));
    assert!(!ptr.is_null(), "{:?}", last_error());
    let (handle, offset) = share(device, ptr).unwrap_or_else(|| panic!("{:?}", last_error()));
    let (torch, own) = decode(&handle);
    assert!(matches!(torch.version, 2 | 3), "{torch:?}");
    assert_eq!(torch.pid, std::process::id() as i32);
    assert_eq!(torch.segment_size, 20 << 20, "the large pool's chunks");
    assert_eq!(torch.fds.len(), own.parts.len());
    let range: u64 = own.parts.iter().map(|p| p.size).sum();
    assert!(
        offset + (3 << 20) <= range,
        "the range covers the allocation"
    );
    assert_eq!(HandleString::decode(&own.encode()).unwrap(), own);
    assert_eq!(TorchHandle::decode(&torch.encode()).unwrap(), torch);
    assert_eq!(
        share(device, ptr).unwrap(),
        (handle.clone(), offset),
        "shared again: the same"
    );

    let base = open(device, &handle);
    assert!(!base.is_null(), "{:?}", last_error());
    assert_ne!(base, ptr, "mapped at addresses of its own");
    check_invariants(device);
    let again = open(device, &handle);
    assert!(!again.is_null(), "opens again: {:?}", last_error());
    assert_ne!(again, base);
    for mapped in [base, again] {
        assert_eq!(cuvmm_ipc_close(device, mapped), 0, "{:?}", last_error());
    }
    assert_eq!(cuvmm_ipc_close(device, base), -1);
    assert_failed("second close", "not open");
    cuvmm_free(ptr, 0, device, stream(0x61));
    cuvmm_empty_cache(device);
    assert!(
        open(device, &handle).is_null(),
        "freed and its chunk released: its descriptors are gone"
    );
    check_invariants(device);
}

/// Tensors on one chunk, shared one by one (a model's parameters sent to another process), hold the chunk's
/// one descriptor, not one each, and get one handle string, each with its own offset, so an importer maps
/// the chunk once for all of them; it stays open while any of them is live.
#[test]
fn allocations_on_one_chunk_share_one_descriptor() {
    setup();
    let device = 24;
    let s = stream(0x66);
    let ptrs: Vec<*mut c_void> = (0..12).map(|_| cuvmm_malloc(3 << 19, device, s)).collect();
    assert!(ptrs.iter().all(|p| !p.is_null()), "{:?}", last_error());
    let shared: Vec<(Vec<u8>, u64)> = (ptrs.iter())
        .map(|&p| share(device, p).unwrap_or_else(|| panic!("{:?}", last_error())))
        .collect();
    let handles: Vec<(TorchHandle, HandleString)> = shared.iter().map(|(h, _)| decode(h)).collect();
    for ((a, offset_a), (b, offset_b)) in shared.iter().zip(&shared[1..]) {
        let same_range = decode(a).1.parts.len() == 1 && decode(a).0.fds == decode(b).0.fds;
        assert_eq!(a == b, same_range, "one handle string per range");
        assert!(
            !same_range || offset_b > offset_a,
            "each allocation at its own offset"
        );
    }
    let on_first: Vec<&TorchHandle> = (handles.iter())
        .filter(|(torch, _)| torch.fds == handles[0].0.fds)
        .map(|(torch, _)| torch)
        .collect();
    assert!(
        on_first.len() >= 6,
        "a 20 MiB chunk holds six of 1.5 MiB: {handles:?}"
    );
    let distinct: std::collections::HashSet<i32> = handles
        .iter()
        .flat_map(|(torch, _)| torch.fds.clone())
        .collect();
    assert!(
        distinct.len() <= 2,
        "one descriptor per chunk: {distinct:?}"
    );
    // All but the last freed: its handle string still opens through the same descriptor.
    for &p in &ptrs[..ptrs.len() - 1] {
        cuvmm_free(p, 0, device, s);
    }
    let last = share(device, ptrs[ptrs.len() - 1]).unwrap().0;
    let base = open(device, &last);
    assert!(!base.is_null(), "{:?}", last_error());
    assert_eq!(cuvmm_ipc_close(device, base), 0, "{:?}", last_error());
    cuvmm_free(ptrs[ptrs.len() - 1], 0, device, s);
    check_invariants(device);
}

/// Where `pidfd_getfd` is refused (here: a pid no process has), a cuvmm importer fetches the same
/// descriptors over the exporter's socket; a handle in PyTorch's layout without cuvmm's string (from
/// PyTorch's own allocator) then fails, saying what to do.
#[test]
fn a_refused_pidfd_falls_back_to_the_exporters_socket() {
    setup();
    let device = 16;
    let ptr = cuvmm_malloc(1 << 20, device, stream(0x64));
    let (handle, _) = share(device, ptr).unwrap_or_else(|| panic!("{:?}", last_error()));
    let (mut torch, _) = decode(&handle);
    assert_eq!(torch.segment_size, 2 << 20, "a small pool's page");
    torch.pid = i32::MAX;
    let base = open(device, &torch.encode());
    assert!(!base.is_null(), "{:?}", last_error());
    assert_eq!(cuvmm_ipc_close(device, base), 0, "{:?}", last_error());
    torch.rest.clear();
    assert!(open(device, &torch.encode()).is_null());
    assert_failed("PyTorch's layout, pidfd refused", "ptrace");
    cuvmm_free(ptr, 0, device, stream(0x64));
    check_invariants(device);
}

/// PyTorch 2.13 and later write a longer header (version 3, with a handle type): cuvmm writes it when the
/// C++ layer says it runs under such a PyTorch, and reads both.
#[test]
fn the_version_3_layout_opens_too() {
    setup();
    let device = 17;
    let ptr = cuvmm_malloc(1 << 20, device, stream(0x65));
    let (handle, _) = share(device, ptr).unwrap_or_else(|| panic!("{:?}", last_error()));
    let (mut torch, _) = decode(&handle);
    torch.version = 3;
    let v3 = torch.encode();
    assert_eq!(v3.len(), handle.len() + 8, "a handle type and padding more");
    assert_eq!(&v3[26..30], &1i32.to_le_bytes(), "POSIX descriptors");
    let base = open(device, &v3);
    assert!(!base.is_null(), "{:?}", last_error());
    assert_eq!(cuvmm_ipc_close(device, base), 0, "{:?}", last_error());
    let mut fabric = v3.clone();
    fabric[26] = 2;
    assert!(open(device, &fabric).is_null());
    assert_failed("fabric handles", "fabric");
    cuvmm_free(ptr, 0, device, stream(0x65));
}

/// Tagged memory is shared too; a sleep forgets its exports (their pages are given back), while what an
/// importer opened stays mapped.
#[test]
fn tagged_memory_is_shared_until_it_sleeps() {
    setup();
    let device = 18;
    let tag = CString::new("weights").unwrap();
    // SAFETY: `tag` is a NUL-terminated string valid during the call.
    assert_eq!(unsafe { cuvmm_set_tag(tag.as_ptr()) }, 0);
    let ptr = cuvmm_malloc(3 << 20, device, stream(0x66));
    // SAFETY: a null tag makes the thread's allocations untagged again.
    assert_eq!(unsafe { cuvmm_set_tag(ptr::null()) }, 0);
    assert!(!ptr.is_null(), "{:?}", last_error());
    let (handle, _) = share(device, ptr).unwrap_or_else(|| panic!("{:?}", last_error()));
    let base = open(device, &handle);
    assert!(!base.is_null(), "{:?}", last_error());
    // SAFETY: as above.
    let slept = unsafe { cuvmm_sleep(device, tag.as_ptr(), 0) };
    assert!(slept > 0, "{:?}", last_error());
    assert!(open(device, &handle).is_null(), "its exports are forgotten");
    check_invariants(device);
    assert_eq!(cuvmm_ipc_close(device, base), 0, "{:?}", last_error());
    // SAFETY: as above.
    let woken = unsafe { cuvmm_wake(device, tag.as_ptr()) };
    assert_eq!(woken, 0, "{:?}", last_error());
    cuvmm_free(ptr, 0, device, stream(0x66));
    check_invariants(device);
}

/// An export is held until its allocation is freed, then forgotten: its descriptors closed, its handle
/// string opening nothing.
#[test]
fn an_export_is_forgotten_when_its_memory_is_freed() {
    setup();
    let device = 12;
    let ptr = cuvmm_malloc(1 << 20, device, stream(0x62));
    let (handle, _) = share(device, ptr).unwrap_or_else(|| panic!("{:?}", last_error()));
    assert!(pending_exports() >= 1);
    cuvmm_free(ptr, 0, device, stream(0x62));
    let (mut torch, _) = decode(&handle);
    torch.pid = i32::MAX;
    assert!(open(device, &torch.encode()).is_null());
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
        (&b"CUVMMIPX"[..], "not a cuvmm handle"),
        (
            &b"\x02c0123456789012345678901234567890123456789012345678901234567890123"[..],
            "cudaIpcOpenMemHandle",
        ),
        (&[&handle[..], &[0u8][..]].concat()[..], "length"),
        (&decode(&handle).1.encode()[..10], "cut short"),
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

/// A checkpoint put back (cudagraph trees' `setCheckpointPoolState`) frees the pool's live blocks and makes
/// the checkpoint's again: their exports are forgotten as a free forgets them. A block made again is shared
/// afresh, one allocated since cannot be shared, and its old handle string no longer opens once its chunk
/// is released.
#[test]
fn a_checkpoint_put_back_forgets_the_exports_of_the_blocks_it_frees() {
    use super::mem_pools::{begin, blocks, restore};
    setup();
    let device = 25;
    let (pool, s) = ((0, 43), stream(0x67));
    begin(device, pool, s);
    let x = cuvmm_malloc(3 << 20, device, s);
    let checkpoint = blocks(device, pool);
    let y = cuvmm_malloc(30 << 20, device, s);
    let (hx, _) = share(device, x).unwrap_or_else(|| panic!("{:?}", last_error()));
    let (hy, _) = share(device, y).unwrap_or_else(|| panic!("{:?}", last_error()));
    assert_eq!(restore(device, pool, &checkpoint), 0, "{:?}", last_error());
    let (again, _) = share(device, x).unwrap_or_else(|| panic!("{:?}", last_error()));
    assert_ne!(
        decode(&again).1.id,
        decode(&hx).1.id,
        "x made again is a new export"
    );
    assert!(share(device, y).is_none(), "y was freed by the checkpoint");
    cuvmm_free(x, 0, device, s);
    assert_eq!(cuvmm_end_allocate_to_pool(device, pool.0, pool.1), 0);
    assert_eq!(cuvmm_release_pool(device, pool.0, pool.1), 0);
    assert!(cuvmm_empty_pool_cache(device, pool.0, pool.1) > 0);
    assert!(open(device, &hy).is_null(), "y's chunks are released");
    check_invariants(device);
}
