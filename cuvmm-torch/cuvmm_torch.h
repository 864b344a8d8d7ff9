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
 * python/cuvmm_torch/ does this (install()) and wraps the rest with ctypes. The C++ layer in csrc/
 * (cuvmm_torch.install() builds it against the user's PyTorch) calls the rest, from "The C++ layer" on, to
 * be PyTorch's whole CUDA allocator (statistics, streams, graph pools, snapshots, OOM errors).
 *
 * Environment, read on first use:
 *   CUVMM_BACKEND       cuda (the default) or sim: simulated devices, no GPU needed, addresses never
 *                       dereferenced, a stream argument is only an identity (equal pointers, same stream).
 *   CUVMM_SIM_CAPACITY  memory of each simulated device, a size such as 80GiB (the default).
 *   CUVMM_SIM_DEVICES   number of simulated devices (default 1; the CUDA backend accepts devices 0 to 63
 *                       and fails to open one the machine does not have).
 *   CUVMM_ALLOC_CONF    the allocator's configuration, in PYTORCH_CUDA_ALLOC_CONF's key:value,... syntax.
 *   CUVMM_LOG           a tracing filter (warn, debug, cuvmm=trace, ...): when set, logs go to stderr.
 *   CUVMM_IPC_HANDLES   0 makes the CUDA backend create handles that cannot be shared with other processes
 *                       (by default they are created exportable where the device supports it).
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
#include <stdint.h>
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

/* Gives back the idle pages of `device` stranded in 20 MiB handles (large_handle_mb) that live allocations
 * still touch: each such handle's live part is re-created as single pages at the same addresses, its bytes
 * moved through host memory after one device synchronization (what compaction:split does under pressure,
 * done once, now). The caller says no other thread launches work on cuvmm memory until it returns.
 * Returns the bytes given back, or -1 (a capture underway, a driver failure). */
long long cuvmm_release_stranded(int device);

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
 * allocated to (a capture is underway; once captures are marked, cuvmm_mark_captures, while a marked
 * capture runs), cuvmm makes no call CUDA refuses during capture: no event query, no synchronization, no
 * unmap; frees of blocks recorded on other streams wait until no capture is underway. A pool lives until
 * cuvmm_release_pool has been called as many times as begin (PyTorch calls it when the graph is
 * destroyed); its memory then goes back once its last block is freed.
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

/* From now on the caller marks every capture of the device with cuvmm_mark_capture (PyTorch 2.13 on calls
 * markCaptureBegin/End around every capture it makes). A pool begun with no capture marked (use_mem_pool,
 * cudagraph trees' warm-up) is then no capture: its allocations wait for events, release the cache and
 * compact when memory runs short, and cuvmm_empty_cache gives memory back. A pool begun with
 * cuvmm_begin_allocate_to_pool_capture stays a capture. A sleep or a wake is refused while any pool is being
 * allocated to, marked or not. Until this is called, every pool begun counts as a capture. */
int cuvmm_mark_captures(int device);

/* A capture of the device begins (begun nonzero: after its pool was begun and cudaStreamBeginCapture) or
 * ends (begun 0: after cudaStreamEndCapture, before cuvmm_end_allocate_to_pool). Marks captures from now on.
 * The mark of a capture abandoned before its end goes once its pool ends; an end with none marked is
 * ignored. */
int cuvmm_mark_capture(int device, int begun);

/* The graph that used the pool is gone (one call per begin): once no graph uses it, its memory goes back
 * to the device's common segments as its blocks are freed. A pool released while still being allocated to
 * goes at its cuvmm_end_allocate_to_pool. */
int cuvmm_release_pool(int device, unsigned long long pool_a, unsigned long long pool_b);

/* One more user of the pool without allocating to it (PyTorch's createOrIncrefPool, which a MemPool calls
 * when made): it stays live until cuvmm_release_pool is called once more. */
int cuvmm_incref_pool(int device, unsigned long long pool_a, unsigned long long pool_b);

/* ---- What PyTorch's MemPool and cudagraph trees ask beyond a capture ---- */

/* How many users the pool has: increfs and begins not yet released (MemPool.use_count()); 0 for a pool
 * that is not live; -1 on failure. */
int cuvmm_pool_use_count(int device, unsigned long long pool_a, unsigned long long pool_b);

/* MemPool(use_on_oom=True): while the pool lives, its free memory on the request's stream may serve an
 * allocation outside every pool that would otherwise run out of memory (no out-of-memory is counted then);
 * the block is the pool's once freed. 0 turns it off (~MemPool does). 0 or -1. */
int cuvmm_set_use_on_oom(int device, unsigned long long pool_a, unsigned long long pool_b, int on);

/* MemPool(no_split=True): from now on each allocation in the pool takes whole pages (2 MiB on NVIDIA GPUs),
 * so no two share a page. 0 or -1. */
int cuvmm_set_no_split(int device, unsigned long long pool_a, unsigned long long pool_b);

/* A live block of a pool, as a checkpoint keeps it (size as cuvmm rounded it). */
typedef struct {
    uint64_t address, size, requested_size;
} cuvmm_pool_block;

/* A checkpoint of the pool (cudagraph trees' getCheckpointState): writes up to `cap` of its live blocks to
 * `out` (NULL with cap 0 only counts) and returns how many there are (call again with more room if above
 * cap), or -1. */
long long cuvmm_pool_blocks(int device, unsigned long long pool_a, unsigned long long pool_b,
                            cuvmm_pool_block *out, size_t cap);

/* Puts the live pool back as a checkpoint found it (setCheckpointPoolState): its blocks allocated since are
 * freed, and the checkpoint's `n` blocks are live again at their addresses (the pool's memory stays mapped
 * while it lives, so nothing is mapped). Refused (-1, nothing freed) for a pool that is not live, a block
 * outside the pool, or a block of the pool still used on another stream. 0 or -1. */
int cuvmm_pool_restore(int device, unsigned long long pool_a, unsigned long long pool_b,
                       const cuvmm_pool_block *blocks, size_t n);

/* emptyCache(pool), which ~MemPool calls: once the pool is released, its idle pages and empty segments go
 * back to the driver (nothing of the rest of the device's cache); a live pool keeps its memory. Returns the
 * bytes given back, or -1 (a capture underway, a driver failure). */
long long cuvmm_empty_pool_cache(int device, unsigned long long pool_a, unsigned long long pool_b);

/* allocateWithAddress (PyTorch 2.13 on): `size` bytes at `ptr`, which must be 512-byte aligned and lie in the
 * free memory of one of `device`'s segments (its stream and pool are the segment's). `ptr`, or NULL. */
void *cuvmm_malloc_at(int device, void *ptr, ssize_t size);

/* ---- Pools with an allocator of their own (MemPool(allocator=...): vLLM's sleep mode, NCCL pools) ----
 *
 * The pool's memory comes from its allocator, in segments of PyTorch's sizes (2 MiB for a request up to
 * 1 MiB, 20 MiB up to 10 MiB, else the request rounded up to 2 MiB); cuvmm carves blocks in them by best
 * fit on the request's stream and merges them when freed, as PyTorch's caching allocator does, and counts
 * them in the device's statistics and snapshot. cuvmm_free, cuvmm_free_any and cuvmm_record_stream take
 * their blocks too. The pool's use count is cuvmm's (cuvmm_incref_pool, begin, release as for any pool). */

/* A block of `size` bytes in the pool for `stream` (no_split nonzero: the free block found is handed out
 * whole); or NULL with *grow the bytes of a segment to get from the pool's allocator (then call
 * cuvmm_foreign_add_segment and ask again); or NULL with *grow 0 on failure. */
void *cuvmm_foreign_malloc(int device, unsigned long long pool_a, unsigned long long pool_b, ssize_t size,
                           cudaStream_t stream, int no_split, size_t *grow);

/* A segment of `size` bytes at `ptr` that the pool's allocator made, for `stream`'s requests. 0 or -1. */
int cuvmm_foreign_add_segment(int device, unsigned long long pool_a, unsigned long long pool_b,
                              cudaStream_t stream, void *ptr, size_t size);

typedef struct {
    unsigned long long pool_a, pool_b;
    uint64_t address, size;
} cuvmm_foreign_segment;

/* Takes out the wholly free segments of the released pool (of every released pool of `device` when `all`
 * is nonzero), waiting for the device first if blocks freed on other streams are pending, and returns them
 * (*len of them; free the array with cuvmm_foreign_segments_free) for the caller to give back to the pools'
 * allocators. NULL with *len 0 when there is none, or on failure. */
cuvmm_foreign_segment *cuvmm_foreign_release(int device, unsigned long long pool_a, unsigned long long pool_b,
                                             int all, size_t *len);
void cuvmm_foreign_segments_free(cuvmm_foreign_segment *segments, size_t len);
/* How many segments the pool holds from its allocator, free or not; -1 on failure. Once the pool is
 * released and holds none, its allocator is asked for nothing more. */
ssize_t cuvmm_foreign_segment_count(int device, unsigned long long pool_a, unsigned long long pool_b);

/* ---- Peers ---- */

/* Device `peer` may read and write every range of `device` mapped now and every one mapped later
 * (PyTorch's enablePeerAccess for expandable segments). */
int cuvmm_add_peer(int device, int peer);

/* Sharing memory with another process (PyTorch's shareIpcHandle / getIpcDevPtr, torch.multiprocessing).
 * cuvmm_ipc_share: the handle string of the live allocation at ptr (bytes to free with cuvmm_bytes_free),
 * its length in *len, and the allocation's offset in the range an importer maps in *offset; NULL on failure
 * (a device whose handles are not exportable, an unknown address). Where the memory under the allocation is
 * whole handles of one size (the usual case) the string is in the layout of PyTorch's expandable segments
 * (the pid and descriptor numbers, which a process on PyTorch's allocator takes with pidfd_getfd; the
 * layout of the PyTorch named by cuvmm_set_torch_version), followed by cuvmm's own string (a Unix socket the
 * exporting process serves, for where pidfd_getfd is refused); otherwise cuvmm's own string alone. The
 * exporting process lets its descendants take its descriptors (PR_SET_PTRACER; CUVMM_IPC_PTRACER=any for
 * any process of the user, none for none). The export is held until the allocation is freed (or its tag
 * sleeps); sharing it again gives the same string. The allocation must stay live while cuvmm_ipc_share
 * runs (PyTorch holds the storage).
 * cuvmm_ipc_open: maps that memory on device (in another process of the same user, or this one), or
 * memory PyTorch's expandable segments shared (PyTorch 2.4 to 2.15 layouts; taken with pidfd_getfd);
 * returns the start of the range (the allocation is at the exporter's offset); NULL on failure.
 * cuvmm_ipc_close: unmaps it once all work on it is done; 0 or -1. */
uint8_t *cuvmm_ipc_share(int device, void *ptr, size_t *len, uint64_t *offset);
void cuvmm_bytes_free(uint8_t *bytes, size_t len);
void *cuvmm_ipc_open(int device, const uint8_t *bytes, size_t len);
int cuvmm_ipc_close(int device, void *ptr);

/* The PyTorch this process runs under (the C++ layer calls it when installed): handle strings are written
 * in its layout (version 2 up to PyTorch 2.12, version 3 from 2.13; version 2 until called). */
void cuvmm_set_torch_version(int major, int minor);

/* ---- Sleep and wake: memory given back while its addresses stay reserved ---- */

/* Allocations made by cuvmm_malloc on this thread, on any device, are made under `tag` from now on (NULL:
 * untagged again). A tag's memory shares no page with other memory. Returns 0, or -1 for a tag that is not
 * UTF-8. (Python: `with cuvmm_torch.region("kv_cache"): ...`.) */
int cuvmm_set_tag(const char *tag);

/* Puts `tag` of `device` to sleep: waits for the streams that used its memory (an event query, a
 * synchronization only of a stream still busy), copies its bytes to host memory if `keep` is nonzero, then
 * unmaps its pages and gives their physical memory back. Its addresses stay reserved: pointers and captured
 * CUDA graphs that use them (graphs captured inside the tag's region included) work again after
 * cuvmm_wake. Until then its memory must not be used (nor a graph using it replayed), and allocating under
 * the tag fails; freeing it succeeds and takes effect at the wake (a tensor dropped meanwhile is not lost,
 * and counts as allocated until then). The bytes are copied asynchronously on a stream of cuvmm's own into
 * page-locked host memory the tag keeps for its next sleep (CUVMM_ALLOC_CONF keep_host_buffers:False frees
 * it at the wake; sleep_copy_mb sets the size of each copy), without the allocator's lock: other threads
 * allocate meanwhile. Returns the bytes given back (0 if already asleep), or -1 (a capture underway, a NULL
 * tag, another thread's sleep or wake of the tag under way, a failed copy: the tag is awake with its bytes;
 * a sleep that failed half way is finished by the next). */
long long cuvmm_sleep(int device, const char *tag, int keep);

/* Wakes `tag` of `device`: maps memory at the same addresses and puts back the bytes its sleep kept. A tag
 * awake (or never used) is left as it is. Returns 0, or -1 (out of memory, a capture underway, a failed
 * copy: the tag stays asleep with its bytes kept and a later wake finishes). */
int cuvmm_wake(int device, const char *tag);

/* Pins now the page-locked host memory the next cuvmm_sleep of `tag` of `device` with its bytes kept
 * copies into, so that sleep pins nothing and copies at the link's speed from its first cycle (a wake keeps
 * the memory for the next sleep anyway). Call it once the tag's memory is allocated (a model loaded). The
 * pinning runs without the allocator's lock: other threads allocate meanwhile and the tag stays awake. Returns
 * the bytes pinned: 0 for a tag asleep, never used, with nothing live or holding enough already, another
 * thread's preparation of it under way, a device cuvmm never allocated on (not opened); -1 (a capture
 * underway, a NULL tag, host memory that could not be pinned: what was pinned is kept). */
long long cuvmm_prepare_sleep(int device, const char *tag);

/* Frees the page-locked host memory `device`'s tags keep for their next sleep (`tag`'s, or every tag's for
 * NULL); never the bytes a sleeping tag keeps. Returns the bytes freed, or -1 (a tag being copied, a
 * capture underway). */
long long cuvmm_release_host_buffers(int device, const char *tag);

/* Copies into `out` the `len` bytes at `ptr` of `device` that a sleeping tag kept in host memory (what that
 * memory holds again at its wake; torch_memory_saver's `get_cpu_backup`). Returns 1; 0 for memory of no
 * sleeping tag (awake, untagged, not cuvmm's: its bytes are on the device), `out` untouched; -1 (the
 * sleep kept no bytes there, or the range is not inside the blocks live at the sleep; another thread's
 * sleep or wake of the tag under way; a null `out`). The bytes are copied under the allocator's lock. */
int cuvmm_read_kept(int device, void *ptr, void *out, size_t len);

/* `device`'s tags as a JSON array of {"name", "state" (awake, asleep, sleeping: half way, copying),
 * "live_bytes", "asleep_bytes" (what its wake maps), "bytes_kept", "host_kept_bytes"}; free it with
 * cuvmm_string_free. "[]" for a device cuvmm never allocated on, without opening it. NULL on failure. */
char *cuvmm_tags_json(int device);

/* The number of devices cuvmm serves (devices 0 to count - 1), or -1 (no CUDA driver, a bad setting). */
int cuvmm_device_count(void);

/* ---- The C++ layer: what PyTorch's CUDAAllocator interface needs beyond the above ---- */

/* PyTorch's raw_delete, which names no device: frees `ptr` on whichever device's allocator (or pool with an
 * allocator of its own) handed it out
 * (on the simulated backend two devices may hand out the same address: use cuvmm_free there). NULL is
 * ignored; an address no device handed out is an error. */
void cuvmm_free_any(void *ptr);

/* PyTorch's Stat, StatArray (all, small pool, large pool) and DeviceStats, field for field, then cuvmm's
 * largest free block. The pools' reserved_bytes leave out pooled unmapped handles, which belong to no
 * pool, so they add up to less than all.reserved_bytes. max_split_size is -1 when unset. */
typedef struct {
    int64_t current, peak, allocated, freed;
} cuvmm_stat;

typedef struct {
    cuvmm_stat all, small_pool, large_pool;
} cuvmm_stat_array;

typedef struct {
    cuvmm_stat_array allocation, segment, active, inactive_split;
    cuvmm_stat_array allocated_bytes, reserved_bytes, active_bytes, inactive_split_bytes, requested_bytes;
    int64_t num_alloc_retries, num_ooms;
    cuvmm_stat oversize_allocations, oversize_segments;
    int64_t num_sync_all_streams, num_device_alloc, num_device_free, max_split_size;
    int64_t largest_free_block;
} cuvmm_device_stats;

/* Writes `device`'s statistics to *out (getDeviceStats). 0 on success, -1 on failure (NULL out). A device
 * never named gets zeros, and its allocator is not built by asking (on CUDA that would make a context
 * there); so do the two resets below, which do nothing there. */
int cuvmm_get_device_stats(int device, cuvmm_device_stats *out);

/* torch.cuda.reset_peak_memory_stats: every peak becomes the current value. 0 or -1. */
int cuvmm_reset_peak_stats(int device);

/* torch.cuda.reset_accumulated_memory_stats: every allocated / freed total and every count (retries,
 * OOMs, device allocations and frees, synchronizations) becomes 0. 0 or -1. */
int cuvmm_reset_accumulated_stats(int device);

/* One private pool's reserved bytes: an entry of PyTorch's DeviceStats::reserved_bytes_by_private_pools (2.13
 * on), by pool id. */
typedef struct {
    unsigned long long pool_a, pool_b;
    cuvmm_stat_array reserved_bytes;
} cuvmm_private_pool_stat;

/* Writes up to `cap` of `device`'s private pools' reserved bytes to `out` (out may be NULL when cap is 0):
 * each pool that ever had memory, cuvmm's own and those with an allocator of their own, its current bytes 0
 * once its memory is gone, listed until both statistics resets have cleared it. Returns how many pools there
 * are (call again with more room if that is above cap), or -1. */
long long cuvmm_private_pool_stats(int device, cuvmm_private_pool_stat *out, size_t cap);

/* The last out-of-memory on `device` was recovered from: the caller freed memory of its own (PyTorch's
 * free-memory callbacks) and the request then succeeded. The statistics count it as a retry (num_alloc_retries),
 * not an out-of-memory, as PyTorch's would. 0 or -1. */
int cuvmm_recovered_oom(int device);

/* torch_memory_saver's `memory_margin_bytes`: from now on, on every device (those opened later too), a
 * request whose new memory would leave fewer than `bytes` free on the device, counting other processes' use,
 * is served from idle memory or fails with out-of-memory naming the margin; a wake is exempt. 0 keeps no
 * margin. Returns 0, or -1 when the library could not be set up. */
int cuvmm_set_device_margin(unsigned long long bytes);

/* torch.cuda.set_per_process_memory_fraction: from now on `device`'s allocator reserves at most `fraction`
 * (0 to 1) of the device's memory; a request past it fails with out-of-memory. Memory reserved above it
 * already is not taken back. 0, or -1 for a fraction outside [0, 1]. */
int cuvmm_set_memory_fraction(int device, double fraction);

/* The memory limit as a fraction of `device`'s memory: 1 when none is set; -1 on failure. */
double cuvmm_memory_fraction(int device);

/* torch.cuda.memory._record_memory_history: keep `device`'s last `max_entries` events for snapshots;
 * 0 stops recording and forgets them. 0 or -1. */
int cuvmm_record_history(int device, size_t max_entries);

/* The numbers of an out-of-memory failure. allowed is 0 when no memory fraction is set. A request larger than
 * the device is one too, as PyTorch reports it; device_free is then the bytes cuvmm does not hold. */
typedef struct {
    uint64_t requested, alloc_size, device_total, device_free, allowed, allocated, reserved;
} cuvmm_oom_info;

/* 1 if the last cuvmm call on this thread failed with out-of-memory (cuvmm_last_error() is then the
 * diagnosis), with its numbers written to *out when out is not NULL; else 0. Reads the record only, as
 * cuvmm_last_error does. */
int cuvmm_last_oom(cuvmm_oom_info *out);

/* A snapshot (torch.cuda.memory._snapshot): segments in address order; segment i's blocks are
 * blocks[segments[i].first_block .. + num_blocks], tiling it; the device's recorded events, oldest first.
 * Block state: 0 inactive, 1 active_allocated, 2 active_pending_free. Trace action: PyTorch's
 * TraceEntry::Action (alloc 0, free_requested 1, free_completed 2, segment_alloc 3, segment_free 4,
 * segment_map 5, segment_unmap 6, snapshot 7, oom 8; for oom, addr is the bytes the device had free).
 * pool_a / pool_b: the private pool that owns the segment, {0, 0} for none. */
typedef struct {
    uint64_t address, total_size, allocated_size, active_size, requested_size;
    cudaStream_t stream;
    int is_large, is_expandable;
    unsigned long long pool_a, pool_b;
    size_t first_block, num_blocks;
} cuvmm_segment_info;

typedef struct {
    uint64_t address, size, requested_size;
    int state;
} cuvmm_block_info;

typedef struct {
    int action;
    uint64_t addr, size;
    cudaStream_t stream;
    int64_t time_us; /* when it happened: microseconds since the Unix epoch (PyTorch's time_us) */
    unsigned long long pool_a, pool_b; /* the private pool of the memory (PyTorch's mempool_), {0, 0} for none */
} cuvmm_trace_entry;

typedef struct {
    const cuvmm_segment_info *segments;
    size_t num_segments;
    const cuvmm_block_info *blocks;
    size_t num_blocks;
    const cuvmm_trace_entry *traces;
    size_t num_traces;
} cuvmm_snapshot;

/* torch's attachAllocatorTraceTracker: call `tracker(context, device, entry)` with each of `device`'s events
 * from now on, recording or not, on the thread of the event and under cuvmm's lock of the device (as PyTorch
 * calls its trackers): it must not call cuvmm, nor let an exception out; `entry` is valid for the call only.
 * Trackers stay attached for the life of the process. 0 or -1. */
typedef void (*cuvmm_trace_tracker_fn)(void *context, int device, const cuvmm_trace_entry *entry);
int cuvmm_attach_trace_tracker(int device, cuvmm_trace_tracker_fn tracker, void *context);

/* `device`'s snapshot; free it with cuvmm_snapshot_free. NULL on failure. */
cuvmm_snapshot *cuvmm_snapshot_take(int device);

/* Frees a snapshot from cuvmm_snapshot_take. NULL is ignored. */
void cuvmm_snapshot_free(cuvmm_snapshot *snapshot);

/* The error of the last cuvmm call on this thread, or NULL if it succeeded. The text stays valid until
 * the next cuvmm call on this thread. */
const char *cuvmm_last_error(void);

#ifdef __cplusplus
}
#endif

#endif /* CUVMM_TORCH_H */
