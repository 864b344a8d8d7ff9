//! A thin result layer over `cudarc::driver::sys` for the calls cuvmm makes, in cudarc's own style:
//! each function makes one driver call and turns its `CUresult` into a `Result`.
//!
//! cudarc has no wrappers for the virtual-memory calls, so they are here. A function is `unsafe` when a
//! wrong argument could break memory that someone else owns (another allocation's mapping, a handle already
//! released, a pointer freed twice); its `# Safety` list says what the caller must guarantee. Functions whose
//! arguments the driver fully validates, or that only create something new, are safe.
//!
//! Every call here requires a current CUDA context on the calling thread (`CudaDriver` binds its context
//! before each call); without one the driver returns `CUDA_ERROR_INVALID_CONTEXT`, which is an error, not
//! undefined behaviour. None of these may be called before [`culib_present`] has said that libcuda can be
//! loaded and [`missing_symbols`] found nothing missing: with `dynamic-loading`, cudarc panics on a call it
//! cannot resolve.

use cudarc::driver::DriverError as CuError;
use cudarc::driver::sys;
use std::mem::MaybeUninit;
use std::os::fd::{AsRawFd, BorrowedFd};

/// The driver entry points cuvmm uses, directly or through cudarc's safe types. [`missing_symbols`] checks
/// them all before the first call, so an old driver is an error and not a panic.
pub(super) const SYMBOLS: &[&str] = &[
    "cuInit",
    "cuDeviceGet",
    "cuDeviceGetCount",
    "cuDeviceGetName",
    "cuDeviceGetAttribute",
    "cuDeviceCanAccessPeer",
    "cuDevicePrimaryCtxRetain",
    "cuDevicePrimaryCtxRelease_v2",
    "cuCtxGetCurrent",
    "cuCtxSetCurrent",
    "cuCtxSynchronize",
    "cuMemGetAllocationGranularity",
    "cuMemAddressReserve",
    "cuMemAddressFree",
    "cuMemCreate",
    "cuMemRelease",
    "cuMemExportToShareableHandle",
    "cuMemImportFromShareableHandle",
    "cuMemGetAllocationPropertiesFromHandle",
    "cuPointerGetAttribute",
    "cuMemMap",
    "cuMemUnmap",
    "cuMemSetAccess",
    "cuMemGetInfo_v2",
    "cuMemAlloc_v2",
    "cuMemFree_v2",
    "cuMemAllocAsync",
    "cuMemFreeAsync",
    "cuDeviceGetDefaultMemPool",
    "cuMemPoolSetAttribute",
    "cuMemPoolGetAttribute",
    "cuMemPoolTrimTo",
    "cuMemsetD8_v2",
    "cuMemcpyDtoH_v2",
    "cuMemHostAlloc",
    "cuMemFreeHost",
    "cuMemHostRegister_v2",
    "cuMemHostUnregister",
    "cuMemcpyHtoD_v2",
    "cuMemcpyDtoHAsync_v2",
    "cuMemcpyHtoDAsync_v2",
    "cuStreamCreate",
    "cuStreamSynchronize",
    "cuStreamDestroy_v2",
    "cuStreamGetCaptureInfo_v2",
    "cuStreamBeginCapture_v2",
    "cuStreamEndCapture",
    "cuGraphDestroy",
    "cuEventCreate",
    "cuEventRecord",
    "cuEventQuery",
    "cuEventSynchronize",
    "cuEventDestroy_v2",
];

/// The calling thread's current context (null when it has none).
///
/// See [cuCtxGetCurrent() docs](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__CTX.html#group__CUDA__CTX_1g8f13165846b73750693640fb3e8380d0)
pub(super) fn ctx_get_current() -> Result<sys::CUcontext, CuError> {
    let mut ctx = MaybeUninit::uninit();
    // SAFETY: `ctx` is valid for the call; the driver writes it (possibly null) before returning success.
    unsafe {
        sys::cuCtxGetCurrent(ctx.as_mut_ptr()).result()?;
        Ok(ctx.assume_init())
    }
}

/// Makes `ctx` the calling thread's current context (null: none).
///
/// See [cuCtxSetCurrent() docs](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__CTX.html#group__CUDA__CTX_1gbe562ee6258b4fcc272ca6478ca2a2f7)
///
/// # Safety
/// 1. `ctx` is null or a context that is alive (retained by someone) for as long as it stays current.
pub(super) unsafe fn ctx_set_current(ctx: sys::CUcontext) -> Result<(), CuError> {
    // SAFETY: the caller guarantees the context is null or alive (point 1).
    unsafe { sys::cuCtxSetCurrent(ctx).result() }
}

/// Creates an event without timing (the cheapest kind to record and query), in the current context.
///
/// See [cuEventCreate() docs](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__EVENT.html#group__CUDA__EVENT_1g450687e75f3ff992fe01662a43d9d3db)
pub(super) fn event_create() -> Result<sys::CUevent, CuError> {
    let mut event = MaybeUninit::uninit();
    let flags = sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32;
    // SAFETY: `event` is valid for the call; a new event affects nothing that exists.
    unsafe {
        sys::cuEventCreate(event.as_mut_ptr(), flags).result()?;
        Ok(event.assume_init())
    }
}

/// Records `event` at the current end of `stream`'s work.
///
/// See [cuEventRecord() docs](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__EVENT.html#group__CUDA__EVENT_1g95424d3be52c4eb95d83861b70fb89d1)
///
/// # Safety
/// 1. `event` was returned by [`event_create`] and has not been destroyed.
/// 2. `stream` is null, `CU_STREAM_LEGACY`, `CU_STREAM_PER_THREAD`, or a stream that is alive.
pub(super) unsafe fn event_record(
    event: sys::CUevent,
    stream: sys::CUstream,
) -> Result<(), CuError> {
    // SAFETY: the event and the stream are alive (points 1-2).
    unsafe { sys::cuEventRecord(event, stream).result() }
}

/// Whether all work recorded before `event` has completed: `Ok(false)` for `CUDA_ERROR_NOT_READY`.
///
/// See [cuEventQuery() docs](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__EVENT.html#group__CUDA__EVENT_1g6f0704d755066b0ee705749ae911deef)
///
/// # Safety
/// 1. `event` was returned by [`event_create`] and has not been destroyed.
pub(super) unsafe fn event_query(event: sys::CUevent) -> Result<bool, CuError> {
    // SAFETY: the event is alive (point 1).
    match unsafe { sys::cuEventQuery(event) } {
        sys::CUresult::CUDA_SUCCESS => Ok(true),
        sys::CUresult::CUDA_ERROR_NOT_READY => Ok(false),
        err => Err(CuError(err)),
    }
}

/// Waits until all work recorded before `event` has completed.
///
/// See [cuEventSynchronize() docs](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__EVENT.html#group__CUDA__EVENT_1g9e520d34e51af7f5375610bca4add99c)
///
/// # Safety
/// 1. `event` was returned by [`event_create`] and has not been destroyed.
pub(super) unsafe fn event_synchronize(event: sys::CUevent) -> Result<(), CuError> {
    // SAFETY: the event is alive (point 1).
    unsafe { sys::cuEventSynchronize(event).result() }
}

/// Creates a stream that does not synchronize with the legacy default stream, in the current context.
///
/// See [cuStreamCreate() docs](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__STREAM.html#group__CUDA__STREAM_1ga581f0c5833e21ded8b5a56594e243f4)
pub(super) fn stream_create_non_blocking() -> Result<sys::CUstream, CuError> {
    let mut stream = MaybeUninit::uninit();
    let flags = sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32;
    // SAFETY: `stream` is valid for the call; a new stream affects nothing that exists.
    unsafe {
        sys::cuStreamCreate(stream.as_mut_ptr(), flags).result()?;
        Ok(stream.assume_init())
    }
}

/// Destroys a stream from [`stream_create_non_blocking`] (its queued work still completes).
///
/// See [cuStreamDestroy() docs](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__STREAM.html#group__CUDA__STREAM_1g244c8833de4596bcd31a06cdf21ee758)
///
/// # Safety
/// 1. `stream` was returned by [`stream_create_non_blocking`] and has not been destroyed.
/// 2. No one will use `stream` afterwards.
pub(super) unsafe fn stream_destroy(stream: sys::CUstream) -> Result<(), CuError> {
    // SAFETY: the stream is alive and not used again (points 1-2).
    unsafe { sys::cuStreamDestroy_v2(stream).result() }
}

/// Destroys an event from [`event_create`].
///
/// See [cuEventDestroy() docs](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__EVENT.html#group__CUDA__EVENT_1g593ec73a8ec5a5fc031311d3e4dca1ef)
///
/// # Safety
/// 1. `event` was returned by [`event_create`] and has not been destroyed.
/// 2. No one will use `event` afterwards.
pub(super) unsafe fn event_destroy(event: sys::CUevent) -> Result<(), CuError> {
    // SAFETY: the event is alive and not used again (points 1-2).
    unsafe { sys::cuEventDestroy_v2(event).result() }
}

/// Waits until all work queued on `stream` has completed.
///
/// See [cuStreamSynchronize() docs](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__STREAM.html#group__CUDA__STREAM_1g15e49dd91ec15991eb7c0a741beb7dad)
///
/// # Safety
/// 1. `stream` is null, `CU_STREAM_LEGACY`, `CU_STREAM_PER_THREAD`, or a stream that is alive.
pub(super) unsafe fn stream_synchronize(stream: sys::CUstream) -> Result<(), CuError> {
    // SAFETY: the stream is alive (point 1).
    unsafe { sys::cuStreamSynchronize(stream).result() }
}

/// Waits for all work queued in the current context, on every stream (`cuCtxSynchronize`).
///
/// See [cuCtxSynchronize() docs](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__CTX.html#group__CUDA__CTX_1g7a54725f28d34b8c6299f0c6ca579616)
pub(super) fn ctx_synchronize() -> Result<(), CuError> {
    // SAFETY: the call takes no argument; without a current context the driver returns an error.
    unsafe { sys::cuCtxSynchronize().result() }
}

/// Whether the CUDA driver library (libcuda.so / nvcuda.dll) can be loaded.
///
/// See cudarc's `sys::is_culib_present`.
pub(super) fn culib_present() -> bool {
    // SAFETY: `is_culib_present` only tries `dlopen` on libcuda's names and closes what it opened; loading
    // libcuda runs its initialisers, which the NVIDIA driver supports in any process.
    unsafe { sys::is_culib_present() }
}

/// The names in [`SYMBOLS`] that the loaded libcuda does not export. Call only after [`culib_present`]
/// returned true (otherwise cudarc panics when it cannot load the library).
pub(super) fn missing_symbols() -> Vec<&'static str> {
    // SAFETY: `culib` loads libcuda once for the whole process (the same handle every sys call uses); the
    // caller has checked that it loads, so it does not panic.
    let lib = unsafe { sys::culib() };
    SYMBOLS
        .iter()
        .copied()
        .filter(|name| {
            // SAFETY: the symbol is only looked up, never called, so the function type given to `get` does
            // not need to match its real signature.
            let found = unsafe { lib.get::<unsafe extern "C" fn()>(name.as_bytes()) };
            found.is_err()
        })
        .collect()
}

/// Properties of pinned device memory on `device`: what `cuMemCreate` and `cuMemGetAllocationGranularity`
/// are asked for. `exportable` asks for handles that can be exported as POSIX file descriptors
/// ([`export_fd`]); otherwise no shareable handle type.
fn device_memory(device: sys::CUdevice, exportable: bool) -> sys::CUmemAllocationProp {
    let handle_types = if exportable {
        sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
    } else {
        sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_NONE
    };
    sys::CUmemAllocationProp {
        type_: sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED,
        requestedHandleTypes: handle_types,
        location: sys::CUmemLocation {
            type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
            id: device,
        },
        win32HandleMetaData: std::ptr::null_mut(),
        allocFlags: sys::CUmemAllocationProp_st__bindgen_ty_1 {
            compressionType: 0,
            gpuDirectRDMACapable: 0,
            usage: 0,
            reserved: [0; 4],
        },
    }
}

/// Which granularity [`granularity`] asks for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Granularity {
    /// The granularity the driver requires (`CU_MEM_ALLOC_GRANULARITY_MINIMUM`).
    Minimum,
    /// The granularity the driver recommends for performance (`CU_MEM_ALLOC_GRANULARITY_RECOMMENDED`).
    Recommended,
}

/// The allocation granularity of device memory on `device`, in bytes.
///
/// See [cuMemGetAllocationGranularity() docs](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__VA.html#group__CUDA__VA_1g30ee906c2cf66a0347b3dfec3d7eb31a)
pub(super) fn granularity(device: sys::CUdevice, which: Granularity) -> Result<usize, CuError> {
    let prop = device_memory(device, false);
    let option = match which {
        Granularity::Minimum => {
            sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_MINIMUM
        }
        Granularity::Recommended => {
            sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_RECOMMENDED
        }
    };
    let mut out = MaybeUninit::uninit();
    // SAFETY: `out` and `prop` are valid for the call; the driver writes `out` before returning success.
    unsafe {
        sys::cuMemGetAllocationGranularity(out.as_mut_ptr(), &prop, option).result()?;
        Ok(out.assume_init())
    }
}

/// Reserves `size` bytes of virtual address space, at an address the driver picks, with the default
/// alignment.
///
/// See [cuMemAddressReserve() docs](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__VA.html#group__CUDA__VA_1ge489256c107df2a07ddf96d80c86cd9b)
pub(super) fn address_reserve(size: usize) -> Result<sys::CUdeviceptr, CuError> {
    let mut ptr = MaybeUninit::uninit();
    // SAFETY: `ptr` is valid for the call; a hint of 0 lets the driver choose a range no one else holds, so
    // nothing existing is affected.
    unsafe {
        sys::cuMemAddressReserve(ptr.as_mut_ptr(), size, 0, 0, 0).result()?;
        Ok(ptr.assume_init())
    }
}

/// Frees a virtual address range reserved by [`address_reserve`].
///
/// See [cuMemAddressFree() docs](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__VA.html#group__CUDA__VA_1g6993ecea2ea03e1b802b8255edc2da5b)
///
/// # Safety
/// 1. `ptr .. ptr + size` is exactly a range returned by [`address_reserve`] and not yet freed.
/// 2. Nothing is mapped inside it.
/// 3. No one will use an address inside it afterwards.
pub(super) unsafe fn address_free(ptr: sys::CUdeviceptr, size: usize) -> Result<(), CuError> {
    // SAFETY: the caller guarantees the range is its own, empty and no longer used (points 1-3).
    unsafe { sys::cuMemAddressFree(ptr, size).result() }
}

/// Creates `size` bytes of physical memory on `device`; with `exportable`, a handle that [`export_fd`] can
/// export (the device must support POSIX file descriptor handles).
///
/// See [cuMemCreate() docs](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__VA.html#group__CUDA__VA_1g899d69a862bba36449789c64b430dc7c)
pub(super) fn create(
    device: sys::CUdevice,
    size: usize,
    exportable: bool,
) -> Result<sys::CUmemGenericAllocationHandle, CuError> {
    let prop = device_memory(device, exportable);
    let mut handle = MaybeUninit::uninit();
    // SAFETY: `handle` and `prop` are valid for the call; a new handle affects nothing that exists.
    unsafe {
        sys::cuMemCreate(handle.as_mut_ptr(), size, &prop, 0).result()?;
        Ok(handle.assume_init())
    }
}

/// Releases a handle from [`create`] or [`import_fd`]. Its memory is freed once every handle to it is
/// released and every mapping of it is unmapped.
///
/// See [cuMemRelease() docs](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__VA.html#group__CUDA__VA_1g3014f0759f43a8d82db951b8e4b91d68)
///
/// # Safety
/// 1. `handle` was returned by [`create`] or [`import_fd`] and has not been released.
/// 2. No one will use `handle` afterwards.
pub(super) unsafe fn release(handle: sys::CUmemGenericAllocationHandle) -> Result<(), CuError> {
    // SAFETY: the caller guarantees the handle is live and not used again (points 1-2).
    unsafe { sys::cuMemRelease(handle).result() }
}

/// Exports `handle` as a new POSIX file descriptor, which the caller owns and must close; another process
/// (or this one) imports it with [`import_fd`]. Closing it neither releases the handle nor frees memory.
///
/// See [cuMemExportToShareableHandle() docs](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__VA.html)
///
/// # Safety
/// 1. `handle` was returned by [`create`] (with `exportable`) or [`import_fd`] and has not been released:
///    the descriptor gives whoever holds it the memory, so it must be the caller's own.
pub(super) unsafe fn export_fd(handle: sys::CUmemGenericAllocationHandle) -> Result<i32, CuError> {
    let mut fd: i32 = -1;
    let kind = sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    // SAFETY: for a POSIX file descriptor the driver writes an `int` at the pointer, and `fd` is valid for
    // that during the call; the handle is the caller's own and live (point 1); flags must be 0.
    unsafe { sys::cuMemExportToShareableHandle((&raw mut fd).cast(), handle, kind, 0).result()? };
    Ok(fd)
}

/// A new handle to the memory behind `fd`, a descriptor from [`export_fd`] in this or another process. The
/// descriptor stays the caller's. The handle is released with [`release`], like one from [`create`].
///
/// See [cuMemImportFromShareableHandle() docs](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__VA.html)
pub(super) fn import_fd(fd: BorrowedFd<'_>) -> Result<sys::CUmemGenericAllocationHandle, CuError> {
    let kind = sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    // For a POSIX file descriptor CUDA takes the descriptor itself, cast to a pointer, not a pointer to it.
    let os_handle = fd.as_raw_fd() as isize as *mut std::ffi::c_void;
    let mut handle = MaybeUninit::uninit();
    // SAFETY: `handle` is valid for the call and written before success; the descriptor is open for the
    // whole call (borrowed), the driver only reads the file behind it and does not take ownership of it;
    // a new handle affects nothing that exists.
    unsafe {
        sys::cuMemImportFromShareableHandle(handle.as_mut_ptr(), os_handle, kind).result()?;
        Ok(handle.assume_init())
    }
}

/// Whether the driver still knows `handle`: `Ok(false)` when `cuMemGetAllocationPropertiesFromHandle`
/// answers `CUDA_ERROR_INVALID_VALUE` or `_INVALID_HANDLE` (a released handle), an error when the query
/// failed otherwise. A query only: the handle is read, nothing changes.
///
/// See [cuMemGetAllocationPropertiesFromHandle() docs](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__VA.html)
pub(super) fn handle_live(handle: sys::CUmemGenericAllocationHandle) -> Result<bool, CuError> {
    let mut prop = MaybeUninit::<sys::CUmemAllocationProp>::uninit();
    // SAFETY: `prop` is valid for the call; the driver validates the handle and only reads it.
    let outcome = unsafe { sys::cuMemGetAllocationPropertiesFromHandle(prop.as_mut_ptr(), handle) };
    unknown_is_false(outcome)
}

/// Whether `ptr` lies in an address range mapped to memory (`CU_POINTER_ATTRIBUTE_MAPPED`: a `cuMemMap`
/// mapping, or a live `cuMemAlloc` allocation): `Ok(false)` also when the driver knows no such pointer
/// (`CUDA_ERROR_INVALID_VALUE`), an error when the query failed otherwise. A query only.
///
/// See [cuPointerGetAttribute() docs](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__UNIFIED.html)
pub(super) fn pointer_mapped(ptr: sys::CUdeviceptr) -> Result<bool, CuError> {
    let mut mapped: u32 = 0;
    let attribute = sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_MAPPED;
    // SAFETY: `mapped` is valid for the call and the attribute is a 4-byte boolean; the address is only
    // looked up, never dereferenced.
    let outcome = unsafe { sys::cuPointerGetAttribute((&raw mut mapped).cast(), attribute, ptr) };
    Ok(unknown_is_false(outcome)? && mapped != 0)
}

/// A query's `CUresult`: success is `true`, "no such resource" (`CUDA_ERROR_INVALID_VALUE`,
/// `_INVALID_HANDLE`) is `false`, anything else an error.
fn unknown_is_false(outcome: sys::CUresult) -> Result<bool, CuError> {
    match outcome {
        sys::CUresult::CUDA_SUCCESS => Ok(true),
        sys::CUresult::CUDA_ERROR_INVALID_VALUE | sys::CUresult::CUDA_ERROR_INVALID_HANDLE => {
            Ok(false)
        }
        err => Err(CuError(err)),
    }
}

/// Maps `size` bytes of `handle` from byte `offset` at `ptr`.
///
/// See [cuMemMap() docs](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__VA.html#group__CUDA__VA_1gff1d395423af5c5c75375516959dae56)
///
/// # Safety
/// 1. `handle` was returned by [`create`] and has not been released.
/// 2. `ptr .. ptr + size` lies inside a range the caller reserved with [`address_reserve`], so no one
///    else's addresses are mapped.
pub(super) unsafe fn map(
    ptr: sys::CUdeviceptr,
    size: usize,
    offset: usize,
    handle: sys::CUmemGenericAllocationHandle,
) -> Result<(), CuError> {
    // SAFETY: the handle is live and the range is the caller's own (points 1-2); the driver checks the
    // offset against the handle's size and granularity itself, and flags of 0 are what it requires.
    unsafe { sys::cuMemMap(ptr, size, offset, handle, 0).result() }
}

/// Unmaps `ptr .. ptr + size`, which must consist of whole mappings.
///
/// See [cuMemUnmap() docs](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__VA.html#group__CUDA__VA_1gfb50aac00c848fd7087e858f59bf7e2a)
///
/// # Safety
/// 1. `ptr .. ptr + size` lies inside a range the caller reserved with [`address_reserve`].
/// 2. No work still queued on the device reads or writes the range, and no one will use it afterwards.
pub(super) unsafe fn unmap(ptr: sys::CUdeviceptr, size: usize) -> Result<(), CuError> {
    // SAFETY: the range is the caller's own and no longer in use (points 1-2).
    unsafe { sys::cuMemUnmap(ptr, size).result() }
}

/// Makes `ptr .. ptr + size` readable and writable from each device in `devices`.
///
/// See [cuMemSetAccess() docs](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__VA.html#group__CUDA__VA_1g1b6b12b10e8324bf462ecab4e7ef30e1)
///
/// # Safety
/// 1. `ptr .. ptr + size` lies inside a range the caller reserved with [`address_reserve`], so no one
///    else's protections change.
pub(super) unsafe fn set_access(
    ptr: sys::CUdeviceptr,
    size: usize,
    devices: &[sys::CUdevice],
) -> Result<(), CuError> {
    let descs: Vec<sys::CUmemAccessDesc> = devices
        .iter()
        .map(|&id| sys::CUmemAccessDesc {
            location: sys::CUmemLocation {
                type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
                id,
            },
            flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
        })
        .collect();
    // SAFETY: `descs` is valid for `descs.len()` elements during the call; the range is the caller's own
    // (point 1).
    unsafe { sys::cuMemSetAccess(ptr, size, descs.as_ptr(), descs.len()).result() }
}

/// Free and total memory of the current context's device, in bytes.
///
/// See [cuMemGetInfo() docs](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__MEM.html#group__CUDA__MEM_1g808f555540d0143a331cc42aa98835c0)
pub(super) fn mem_get_info() -> Result<(usize, usize), CuError> {
    let mut free = MaybeUninit::uninit();
    let mut total = MaybeUninit::uninit();
    // SAFETY: both pointers are valid for the call; the driver writes both before returning success.
    unsafe {
        sys::cuMemGetInfo_v2(free.as_mut_ptr(), total.as_mut_ptr()).result()?;
        Ok((free.assume_init(), total.assume_init()))
    }
}

/// Allocates `size` bytes of device memory (`cuMemAlloc`).
///
/// See [cuMemAlloc() docs](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__MEM.html#group__CUDA__MEM_1gb82d2a09844a58dd9e744dc31e8aa467)
pub(super) fn alloc(size: usize) -> Result<sys::CUdeviceptr, CuError> {
    let mut ptr = MaybeUninit::uninit();
    // SAFETY: `ptr` is valid for the call; new memory affects nothing that exists.
    unsafe {
        sys::cuMemAlloc_v2(ptr.as_mut_ptr(), size).result()?;
        Ok(ptr.assume_init())
    }
}

/// Frees memory from [`alloc`].
///
/// See [cuMemFree() docs](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__MEM.html#group__CUDA__MEM_1g89b3f154e17cc89b6eea277dbdf5c93a)
///
/// # Safety
/// 1. `ptr` was returned by [`alloc`] and has not been freed.
/// 2. No one will use the memory afterwards.
pub(super) unsafe fn free(ptr: sys::CUdeviceptr) -> Result<(), CuError> {
    // SAFETY: the pointer is live and no longer used (points 1-2).
    unsafe { sys::cuMemFree_v2(ptr).result() }
}

/// Sets `size` bytes from `ptr` to `value`, on the legacy default stream.
///
/// See [cuMemsetD8() docs](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__MEM.html#group__CUDA__MEM_1g6e582bf866e9e2fb014297bfaf354d7b)
///
/// # Safety
/// 1. `ptr .. ptr + size` is device memory the caller owns: mapped with read-write access for the current
///    context's device, or inside one [`alloc`] allocation. Writing elsewhere faults the context.
/// 2. Nothing else reads or writes the range until the write has completed.
pub(super) unsafe fn memset_d8(
    ptr: sys::CUdeviceptr,
    value: u8,
    size: usize,
) -> Result<(), CuError> {
    // SAFETY: the range is the caller's own accessible memory, not in use elsewhere (points 1-2).
    unsafe { sys::cuMemsetD8_v2(ptr, value, size).result() }
}

/// Copies `out.len()` bytes from device address `ptr` to `out`, after the legacy default stream's earlier
/// work; returns once the bytes are in `out`.
///
/// See [cuMemcpyDtoH() docs](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__MEM.html#group__CUDA__MEM_1g3480368ee0208a98f75019c9a8450893)
///
/// # Safety
/// 1. `ptr .. ptr + out.len()` is device memory the caller owns, mapped with read-write access for the
///    current context's device or inside one [`alloc`] allocation. Reading elsewhere faults the context.
pub(super) unsafe fn memcpy_dtoh(out: &mut [u8], ptr: sys::CUdeviceptr) -> Result<(), CuError> {
    // SAFETY: `out` is valid for writes of `out.len()` bytes for the whole (synchronous) call; the source
    // is the caller's own readable memory (point 1).
    unsafe { sys::cuMemcpyDtoH_v2(out.as_mut_ptr().cast(), ptr, out.len()).result() }
}

/// Copies `data` to device address `ptr`, after the legacy default stream's earlier work; returns once the
/// bytes have left `data` (a copy from pageable host memory is staged and complete for the host on return).
///
/// See [cuMemcpyHtoD() docs](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__MEM.html#group__CUDA__MEM_1g4d32266788c440b0220b1a9ba5795169)
///
/// # Safety
/// 1. `ptr .. ptr + data.len()` is device memory the caller owns, mapped with read-write access for the
///    current context's device or inside one [`alloc`] allocation. Writing elsewhere faults the context.
pub(super) unsafe fn memcpy_htod(ptr: sys::CUdeviceptr, data: &[u8]) -> Result<(), CuError> {
    // SAFETY: `data` is valid for reads of `data.len()` bytes for the whole (synchronous) call; the
    // destination is the caller's own writable memory (point 1).
    unsafe { sys::cuMemcpyHtoD_v2(ptr, data.as_ptr().cast(), data.len()).result() }
}

/// Enqueues a copy of `len` bytes from device address `ptr` to host address `dst` on `stream`. Into
/// page-locked memory the copy runs after the call returns; into pageable memory CUDA returns only once the
/// copy has completed.
///
/// See [cuMemcpyDtoHAsync() docs](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__MEM.html#group__CUDA__MEM_1g56f30236c7c5247f8e061b59d3268362)
///
/// # Safety
/// 1. `ptr .. ptr + len` is device memory the caller owns, mapped with read-write access for the current
///    context's device, and stays so until the copy has completed. Reading elsewhere faults the context.
/// 2. `dst .. dst + len` is host memory valid for writes, which nothing reads, writes or frees until the
///    copy has completed.
/// 3. `stream` is a stream of the current context that is alive.
pub(super) unsafe fn memcpy_dtoh_async(
    dst: *mut u8,
    ptr: sys::CUdeviceptr,
    len: usize,
    stream: sys::CUstream,
) -> Result<(), CuError> {
    // SAFETY: the source is the caller's readable memory, the destination its writable host memory, both
    // left alone until the copy completes, on a live stream (points 1-3).
    unsafe { sys::cuMemcpyDtoHAsync_v2(dst.cast(), ptr, len, stream).result() }
}

/// Enqueues a copy of `len` bytes from host address `src` to device address `ptr` on `stream`. From
/// page-locked memory the copy runs after the call returns; from pageable memory CUDA returns once the
/// bytes have been staged, so `src` may be reused at once.
///
/// See [cuMemcpyHtoDAsync() docs](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__MEM.html#group__CUDA__MEM_1g1572263fe2597d7ba4f6964597a354a3)
///
/// # Safety
/// 1. `ptr .. ptr + len` is device memory the caller owns, mapped with read-write access for the current
///    context's device, which nothing else uses until the copy has completed.
/// 2. `src .. src + len` is host memory valid for reads, which nothing writes or frees until the copy has
///    completed.
/// 3. `stream` is a stream of the current context that is alive.
pub(super) unsafe fn memcpy_htod_async(
    ptr: sys::CUdeviceptr,
    src: *const u8,
    len: usize,
    stream: sys::CUstream,
) -> Result<(), CuError> {
    // SAFETY: the destination is the caller's writable memory, the source its readable host memory, both
    // left alone until the copy completes, on a live stream (points 1-3).
    unsafe { sys::cuMemcpyHtoDAsync_v2(ptr, src.cast(), len, stream).result() }
}

/// Whether `device` can access memory of `peer`.
///
/// See [cuDeviceCanAccessPeer() docs](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__PEER__ACCESS.html#group__CUDA__PEER__ACCESS_1g496bdaae1f632ebfb695b99d2c40f19e)
pub(super) fn can_access_peer(device: sys::CUdevice, peer: sys::CUdevice) -> Result<bool, CuError> {
    let mut can = MaybeUninit::uninit();
    // SAFETY: `can` is valid for the call; the driver writes it before returning success.
    unsafe {
        sys::cuDeviceCanAccessPeer(can.as_mut_ptr(), device, peer).result()?;
        Ok(can.assume_init() != 0)
    }
}
