/*
 * cuvmm_torch.h: the C interface of libcuvmm_torch.so, cuvmm as PyTorch's CUDA allocator.
 *
 * Build: cargo build --release -p cuvmm-torch   (gives target/release/libcuvmm_torch.so)
 *
 * PyTorch loads the first two functions:
 *
 *   alloc = torch.cuda.memory.CUDAPluggableAllocator(
 *       "target/release/libcuvmm_torch.so", "cuvmm_malloc", "cuvmm_free")
 *   torch.cuda.memory.change_current_allocator(alloc)   # before the first CUDA allocation
 *
 * python/cuvmm_torch.py does this (install()) and wraps the rest with ctypes.
 *
 * Environment, read on first use:
 *   CUVMM_BACKEND       cuda (the default) or sim: simulated devices, no GPU needed, addresses never
 *                       dereferenced, a stream argument is only an identity (equal pointers, same stream).
 *   CUVMM_SIM_CAPACITY  memory of each simulated device, a size such as 80GiB (the default).
 *   CUVMM_SIM_DEVICES   number of simulated devices (default 1; the CUDA backend accepts devices 0 to 63
 *                       and fails to open one the machine does not have).
 *   CUVMM_ALLOC_CONF    the allocator's configuration, in PYTORCH_CUDA_ALLOC_CONF's key:value,... syntax.
 *   CUVMM_LOG           a tracing filter (warn, debug, cuvmm=trace, ...): when set, logs go to stderr.
 *
 * One allocator per device, built the first time the device is named; a failure to build it (bad
 * configuration, no CUDA driver) is kept and reported by every later call on that device.
 *
 * Errors: no function aborts or unwinds into the caller. A failure returns NULL, -1 or nothing, is logged,
 * and is recorded for cuvmm_last_error(); the allocator stays usable. All functions may be called from any
 * thread at once.
 */
#ifndef CUVMM_TORCH_H
#define CUVMM_TORCH_H

#include <stddef.h>
#include <sys/types.h> /* ssize_t */

#ifdef __cplusplus
extern "C" {
#endif

/* The runtime API's stream type (a CUstream), without requiring cuda_runtime.h. NULL is the legacy
 * default stream. */
typedef struct CUstream_st *cudaStream_t;

/* PyTorch's allocation function. Returns `size` bytes of `device` for work on `stream`, aligned to 512
 * bytes, or NULL: for size <= 0 (PyTorch asks for 0 bytes for an empty tensor; NULL is the answer it
 * expects), an absurd size, out of memory, a device out of range, or no CUDA driver. */
void *cuvmm_malloc(ssize_t size, int device, cudaStream_t stream);

/* PyTorch's free function. Frees `ptr`, which cuvmm_malloc returned for `device`; `size` and `stream` are
 * not needed (cuvmm knows them). NULL is ignored. A pointer cuvmm never gave, or a second free, is an
 * error (recorded, nothing freed). The memory is reused on another stream only after the work of every
 * stream recorded with cuvmm_record_stream has finished. */
void cuvmm_free(void *ptr, ssize_t size, int device, cudaStream_t stream);

/* Tensor.record_stream: work queued on `stream` also uses the live allocation `ptr` of `device`. Call it
 * before the free. (PyTorch's pluggable allocator does not forward record_stream to a library loaded from
 * Python; call this through cuvmm_torch.record_stream.) */
void cuvmm_record_stream(void *ptr, int device, cudaStream_t stream);

/* torch.cuda.memory_stats(device): a JSON object of integers with PyTorch's keys
 * (allocated_bytes.all.current, allocated_bytes.all.peak, reserved_bytes.all.current, reserved_bytes.all.peak,
 * active_bytes.*, requested_bytes.*, inactive_split_bytes.*, allocation.*, active.*, segment.*, each for
 * all / large_pool / small_pool and current / peak / allocated / freed; num_alloc_retries, num_ooms,
 * num_device_alloc, num_device_free, num_sync_all_streams, oversize_*) and cuvmm's own under "cuvmm."
 * (largest_free_block, idle_mapped_bytes, idle_handle_bytes, handles_reused, driver_calls, driver_time_ns).
 * Free it with cuvmm_string_free. NULL on failure. */
char *cuvmm_memory_stats_json(int device);

/* torch.cuda.memory_summary(device): PyTorch's table with cuvmm's rows. Free it with cuvmm_string_free.
 * NULL on failure. */
char *cuvmm_memory_summary(int device);

/* Frees a string from cuvmm_memory_stats_json or cuvmm_memory_summary. NULL is ignored. */
void cuvmm_string_free(char *text);

/* torch.cuda.empty_cache(): gives `device`'s cached memory back to the driver. */
void cuvmm_empty_cache(int device);

/* torch.cuda.memory._dump_snapshot(path): writes `device`'s segments and blocks as the pickle PyTorch's
 * memory viewer (pytorch.org/memory_viz) reads. 0 on success, -1 on failure (NULL path, a path that is
 * not UTF-8, a file that cannot be written). */
int cuvmm_dump_snapshot(int device, const char *path);

/* ---- CUDA graphs: private pools (PyTorch's beginAllocateToPool / endAllocateToPool / releasePool) ----
 *
 * A pool is PyTorch's MempoolId_t, a pair of integers (pool_a, pool_b); {0, 0} is no pool and is refused.
 * Between begin and end, every allocation on a stream the filter accepts comes from the pool's own
 * segments; memory freed in the pool is reused only by the pool; nothing of a live pool is unmapped, lent,
 * compacted or handed to another stream or pool, even under memory pressure. While any pool is being
 * allocated to (a capture is underway), cuvmm makes no call CUDA refuses during capture: no event query,
 * no synchronization, no unmap; frees of blocks recorded on other streams wait until no capture is
 * underway. A pool lives until cuvmm_release_pool has been called as many times as begin (PyTorch calls
 * it when the graph is destroyed); its memory then goes back once its last block is freed.
 *
 * The functions return 0 on success and -1 on failure (see cuvmm_last_error). */

/* Says whether allocations on `stream` go to the pool. Called with cuvmm's lock held, from the allocating
 * thread: it must not call cuvmm. Returns nonzero for yes. */
typedef int (*cuvmm_stream_filter)(void *context, cudaStream_t stream);

/* Allocations on the streams `filter` accepts go to the pool from now on. `context` is passed to the filter
 * and must stay valid until cuvmm_end_allocate_to_pool(pool) returns. Beginning a pool already begun, or a
 * NULL filter, is an error. */
int cuvmm_begin_allocate_to_pool(int device, unsigned long long pool_a, unsigned long long pool_b,
                                 cuvmm_stream_filter filter, void *context);

/* The same, for the streams capturing with capture id `capture_id` (cudaStreamGetCaptureInfo's id): what
 * PyTorch's CUDAGraph passes as its filter. */
int cuvmm_begin_allocate_to_pool_capture(int device, unsigned long long pool_a, unsigned long long pool_b,
                                         unsigned long long capture_id);

/* Allocations stop going to the pool (its memory stays the pool's). Deferred frees run at the next
 * allocation once no capture is underway. */
int cuvmm_end_allocate_to_pool(int device, unsigned long long pool_a, unsigned long long pool_b);

/* The graph that used the pool is gone (one call per begin): once no graph uses it, its memory goes back
 * to the device's common segments as its blocks are freed. */
int cuvmm_release_pool(int device, unsigned long long pool_a, unsigned long long pool_b);

/* ---- Peers ---- */

/* Device `peer` may read and write every range of `device` mapped now and every one mapped later
 * (PyTorch's enablePeerAccess for expandable segments). */
int cuvmm_add_peer(int device, int peer);

/* The error of the last cuvmm call on this thread, or NULL if it succeeded. The text stays valid until
 * the next cuvmm call on this thread. */
const char *cuvmm_last_error(void);

#ifdef __cplusplus
}
#endif

#endif /* CUVMM_TORCH_H */
