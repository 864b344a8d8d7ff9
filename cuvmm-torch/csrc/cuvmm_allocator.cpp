// cuvmm as PyTorch's CUDA allocator: a c10::cuda::CUDACachingAllocator::CUDAAllocator whose every method
// forwards to libcuvmm_torch.so's C ABI (cuvmm_torch.h). No allocation logic lives here: this file turns
// PyTorch's types into the C ABI's and cuvmm's failures into PyTorch's exceptions.
//
// Built against the user's PyTorch by python/cuvmm_torch/ (torch.utils.cpp_extension.load); see
// docs/pytorch.md, "The C++ layer". The library is opened with dlopen and its functions looked up by name,
// so a library older than this file fails at install with the names it lacks, and the same library
// (one registry of allocators) serves this layer and cuvmm_torch's ctypes calls.
//
// Every virtual method of CUDAAllocator and its bases in the PyTorch it is built against is overridden
// (python/test_cpp_layer.py reads the installed headers and names any that is not; PyTorch 2.11 to 2.15,
// by TORCH_VERSION_*). Nothing PyTorch reaches from a destructor or a deleter throws (releasePool,
// setUseOnOOM, emptyCache, raw_delete, the IPC deleter): a failure there is a warning.

#include <c10/core/Allocator.h>
#include <c10/cuda/CUDAAllocatorConfig.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGraphsC10Utils.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/ApproximateClock.h>
#include <c10/util/Exception.h>
#include <c10/util/env.h>
#include <torch/csrc/cuda/CUDAPluggableAllocator.h>
#include <torch/extension.h>
#include <torch/version.h>

#include <cuda_runtime_api.h>
#include <dlfcn.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cstring>
#include <functional>
#include <cstdlib>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <tuple>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "cuvmm_torch.h"

// The header's layout, as tests/abi.rs checks it on the Rust side.
static_assert(sizeof(cuvmm_device_stats) == 984, "cuvmm_device_stats: header and Rust disagree");
static_assert(sizeof(cuvmm_segment_info) == 88, "cuvmm_segment_info: header and Rust disagree");
static_assert(sizeof(cuvmm_block_info) == 32 && sizeof(cuvmm_trace_entry) == 56, "block/trace layout");
static_assert(sizeof(cuvmm_oom_info) == 56 && sizeof(cuvmm_snapshot) == 48, "oom/snapshot layout");
static_assert(sizeof(cuvmm_private_pool_stat) == 112, "cuvmm_private_pool_stat layout");

namespace cuvmm_torch {

namespace CCA = c10::cuda::CUDACachingAllocator;
namespace CDA = c10::CachingDeviceAllocator;
using c10::DeviceIndex;
using c10::MempoolId_t;

// The C functions, required ones then those a library may lack (peers, IPC: PyTorch's calls that need
// them fail with a clear error there).
#define CUVMM_REQUIRED(X)                                                                        \
  X(cuvmm_malloc) X(cuvmm_free_any) X(cuvmm_record_stream) X(cuvmm_empty_cache)                 \
  X(cuvmm_get_device_stats) X(cuvmm_private_pool_stats) X(cuvmm_reset_peak_stats)                  \
  X(cuvmm_reset_accumulated_stats)                                                               \
  X(cuvmm_set_memory_fraction) X(cuvmm_memory_fraction) X(cuvmm_record_history)                 \
  X(cuvmm_snapshot_take) X(cuvmm_snapshot_free) X(cuvmm_last_oom) X(cuvmm_last_error)             \
  X(cuvmm_pool_use_count) X(cuvmm_set_use_on_oom) X(cuvmm_set_no_split) X(cuvmm_pool_blocks)         \
  X(cuvmm_pool_restore) X(cuvmm_empty_pool_cache) X(cuvmm_malloc_at) X(cuvmm_foreign_malloc)         \
  X(cuvmm_foreign_add_segment) X(cuvmm_foreign_release) X(cuvmm_foreign_segments_free)               \
  X(cuvmm_foreign_segment_count)                                                                 \
  X(cuvmm_set_torch_version) X(cuvmm_begin_allocate_to_pool) X(cuvmm_end_allocate_to_pool)          \
  X(cuvmm_release_pool) X(cuvmm_incref_pool) X(cuvmm_mark_captures) X(cuvmm_mark_capture)          \
  X(cuvmm_device_count)
#define CUVMM_OPTIONAL(X)                                                                        \
  X(cuvmm_add_peer) X(cuvmm_ipc_share) X(cuvmm_bytes_free) X(cuvmm_ipc_open) X(cuvmm_ipc_close)        \
  X(cuvmm_recovered_oom) X(cuvmm_attach_trace_tracker)

struct Api {
#define CUVMM_FIELD(name) decltype(&::name) name = nullptr;
  CUVMM_REQUIRED(CUVMM_FIELD)
  CUVMM_OPTIONAL(CUVMM_FIELD)
#undef CUVMM_FIELD

  static Api open(const std::string& path) {
    void* lib = dlopen(path.c_str(), RTLD_NOW | RTLD_GLOBAL);  // kept open for the process's life
    TORCH_CHECK(lib, "cuvmm: cannot load ", path, ": ", dlerror());
    Api api;
    std::string missing;
#define CUVMM_LOOKUP(name) api.name = reinterpret_cast<decltype(api.name)>(dlsym(lib, #name));
#define CUVMM_MISSING(name) \
  if (!api.name) missing += std::string(missing.empty() ? "" : ", ") + #name;
    CUVMM_REQUIRED(CUVMM_LOOKUP)
    CUVMM_OPTIONAL(CUVMM_LOOKUP)
    CUVMM_REQUIRED(CUVMM_MISSING)
#undef CUVMM_LOOKUP
#undef CUVMM_MISSING
    TORCH_CHECK(missing.empty(), "cuvmm: ", path, " lacks ", missing,
                ": rebuild it (cargo build --release -p cuvmm-torch)");
    return api;
  }
};

// PyTorch's own handle strings (CUDACachingAllocator.cpp): a bare cudaIpcMemHandle_t from an old PyTorch,
// or a version byte (2 up to PyTorch 2.12, 3 from 2.13), a type byte ('c': cudaIpcMemHandle_t follows; 'e':
// an expandable segment's descriptors, which the library opens, as it opens cuvmm's own) and the rest.
constexpr size_t kCudaIpcHandleSize = 64;
constexpr char kNewestTorchHandleVersion = 3;

// Whether `handle` holds a cudaMalloc block's cudaIpcMemHandle_t (from a process on PyTorch's allocator
// without expandable segments); sets `raw` to it.
bool cuda_malloc_handle(const std::string& handle, cudaIpcMemHandle_t* raw) {
  size_t at = 0;
  if (handle.size() != kCudaIpcHandleSize) {
    if (handle.size() < 2 || handle[0] < 1 || handle[0] > kNewestTorchHandleVersion || handle[1] != 'c') {
      return false;  // an expandable segment's, or cuvmm's own ("CUVMMIPC")
    }
    at = 2;
  }
  TORCH_CHECK(handle.size() >= at + kCudaIpcHandleSize, "cuvmm: a truncated CUDA IPC handle");
  std::memcpy(raw, handle.data() + at, kCudaIpcHandleSize);
  return true;
}

// A filter of beginAllocateToPool, kept on the heap until endAllocateToPool returns (the C ABI's rule).
struct Filter {
  std::function<bool(cudaStream_t)> accepts;
  static int call(void* self, cudaStream_t stream) noexcept {
    try {
      return static_cast<Filter*>(self)->accepts(stream) ? 1 : 0;
    } catch (...) {
      return 0;  // nothing may unwind into cuvmm
    }
  }
};

// A pool's live blocks at a checkpoint (cudagraph trees' getCheckpointState).
struct Checkpoint : CCA::AllocatorState {
  DeviceIndex device;
  MempoolId_t pool;
  std::vector<cuvmm_pool_block> blocks;
};

// A pool being allocated to (beginAllocateToPool .. endAllocateToPool), in the order begun; `own` is the
// pool's own allocator, for a MemPool made with one (its allocations go there, in segments cuvmm carves).
struct Underway {
  DeviceIndex device;
  MempoolId_t pool;
  Filter* filter;
  std::shared_ptr<CCA::CUDAAllocator> own;
};

// Runs `f`, turning an exception into a warning: for what PyTorch calls from a destructor or a deleter.
template <typename F>
void without_throwing(const char* what, F f) noexcept {
  try {
    f();
  } catch (const std::exception& e) {
    try {
      TORCH_WARN("cuvmm: ", what, ": ", e.what());
    } catch (...) {
    }
  } catch (...) {
  }
}

// A snapshot from the C ABI, freed when it goes out of scope.
using Snapshot = std::unique_ptr<cuvmm_snapshot, void (*)(cuvmm_snapshot*)>;

c10::CachingAllocator::Stat to_stat(const cuvmm_stat& s) {
  c10::CachingAllocator::Stat out;
  out.current = s.current;
  out.peak = s.peak;
  out.allocated = s.allocated;
  out.freed = s.freed;
  return out;
}

c10::CachingAllocator::StatArray to_array(const cuvmm_stat_array& a) {
  return {to_stat(a.all), to_stat(a.small_pool), to_stat(a.large_pool)};
}

class CuvmmAllocator final : public CCA::CUDAAllocator {
 public:
  explicit CuvmmAllocator(Api api) : api_(api) {
    if (force_uncached_) {
      TORCH_WARN("cuvmm: PYTORCH_NO_CUDA_MEMORY_CACHING=1: every CUDA allocation goes to cudaMalloc and cudaFree, "
                 "as under PyTorch's own allocator; cuvmm holds none of it");
    }
  }

  static CuvmmAllocator* instance;  // for the raw deleter, which gets only the pointer

  // Shared memory's handles are written in the layout of the PyTorch this layer is built against.
  void set_torch_version() { api_.cuvmm_set_torch_version(TORCH_VERSION_MAJOR, TORCH_VERSION_MINOR); }

  // ---- allocation ----
  c10::DataPtr allocate(size_t n) override {
    DeviceIndex device = c10::cuda::current_device();
    if (uncached()) {
      void* p = uncached_allocate(n);
      return {p, p, &uncached_delete_fn, c10::Device(c10::DeviceType::CUDA, device)};
    }
    void* p = n == 0 ? nullptr : malloc_on(n, device, c10::cuda::getCurrentCUDAStream(device));
    return {p, p, &delete_fn, c10::Device(c10::DeviceType::CUDA, device)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &delete_fn; }  // any of ours, cached or not
  bool is_simple_data_ptr(const c10::DataPtr& ptr) const override { return ptr.get() == ptr.get_context(); }
  void* raw_alloc(size_t n) override {
    if (uncached()) return uncached_allocate(n);
    DeviceIndex device = c10::cuda::current_device();
    return n == 0 ? nullptr : malloc_on(n, device, c10::cuda::getCurrentCUDAStream(device));
  }
  void* raw_alloc_with_stream(size_t n, cudaStream_t stream) override {
    if (uncached()) return uncached_allocate(n);
    return n == 0 ? nullptr : malloc_on(n, c10::cuda::current_device(), stream);
  }
  // A deleter: it must not throw. Memory allocated while caching was off goes back to cudaFree, whenever
  // it is freed.
  void raw_delete(void* p) override {
    if (p == nullptr) return;
    if (uncached_count_.load(std::memory_order_acquire) > 0 && uncached_free(p)) return;
    if (cross_device_count_.load(std::memory_order_acquire) > 0) wait_for_other_devices(p);
    api_.cuvmm_free_any(p);
    if (const char* error = api_.cuvmm_last_error()) {
      without_throwing("raw_delete", [&] {
        std::string text = error;  // before anything else can call cuvmm on this thread
        TORCH_WARN("cuvmm: ", text);
      });
    }
  }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    C10_CUDA_CHECK(cudaMemcpy(dest, src, count, cudaMemcpyDeviceToDevice));
  }

  // ---- set-up and settings ----
  void init(int device_count) override {
    device_count_ = device_count;
    initialized_ = true;
  }
  bool initialized() override { return initialized_; }
  std::string name() override { return "cuvmm"; }
  // torch.cuda.caching_allocator_enable(False), as PyTorch's own allocator takes it: what is allocated while
  // caching is off bypasses the allocator (cudaMalloc, and cudaFree when it is freed, even after caching is
  // back on), in no statistic and no snapshot; memory allocated before stays cuvmm's.
  void enable(bool value) override { enabled_.store(value, std::memory_order_release); }
  bool isEnabled() const override { return enabled_.load(std::memory_order_acquire); }
  // Whether an allocation now bypasses cuvmm: caching turned off, or PYTORCH_NO_CUDA_MEMORY_CACHING=1
  // (which, as in PyTorch, no caching_allocator_enable(True) overrides).
  bool uncached() const { return force_uncached_ || !isEnabled(); }
  double getMemoryFraction(DeviceIndex device) override {
    double fraction = api_.cuvmm_memory_fraction(device);
    check(fraction >= 0, "getMemoryFraction");
    return fraction;
  }
  void setMemoryFraction(double fraction, DeviceIndex device) override {
    TORCH_CHECK(fraction >= 0 && fraction <= 1, "invalid fraction: ", fraction, ". Please set within [0, 1].");
    use(device);
    check(api_.cuvmm_set_memory_fraction(device, fraction) == 0, "setMemoryFraction");
  }
  // torch.cuda.empty_cache() ({0, 0}: every device's cache, and the free segments of released pools with
  // an allocator of their own) or MemPool's destructor (one pool's). ~MemPool calls it: it never throws; a
  // failure (a capture underway) is a warning, and the memory stays cached, as PyTorch leaves it then.
  void emptyCache(MempoolId_t pool) override {
    without_throwing("emptyCache", [&] {
      bool all = pool == MempoolId_t{0, 0};
      for_each_used([&](DeviceIndex d) {
        if (all) {
          api_.cuvmm_empty_cache(d);
        } else {
          api_.cuvmm_empty_pool_cache(d, pool.first, pool.second);
        }
        if (const char* error = api_.cuvmm_last_error()) TORCH_WARN("cuvmm: emptyCache: ", error);
        give_back_segments(d, pool, all);
      });
    });
  }
  std::pair<size_t, size_t> getMemoryInfo(DeviceIndex device) override {
    c10::cuda::CUDAGuard guard(device);
    size_t free = 0, total = 0;
    C10_CUDA_CHECK(cudaMemGetInfo(&free, &total));
    return {free, total};
  }
  // cuDNN sizes its workspaces by it (a 0 passed in: "guess"): as PyTorch's, the device's free memory when
  // asked with 0, or cuvmm's largest free block if larger. Answering the free block alone would leave a
  // fresh process with no workspace at all, and cudnn.benchmark to the slowest algorithms.
  void cacheInfo(DeviceIndex device, size_t* largest) override {
    if (*largest == 0) {
      c10::cuda::CUDAGuard guard(device);
      size_t total = 0;
      C10_CUDA_CHECK(cudaMemGetInfo(largest, &total));
    }
    *largest = std::max(*largest, static_cast<size_t>(stats(device).largest_free_block));
  }
  // The live allocation `ptr` lies in, and its size, on whichever device holds it (each of cuvmm's
  // allocations is its own block; PyTorch answers with the cudaMalloc'd segment, which cuvmm does not have).
  void* getBaseAllocation(void* ptr, size_t* size) override {
    auto at = reinterpret_cast<uint64_t>(ptr);
    void* base = nullptr;
    for_each_used([&](DeviceIndex device) {
      if (base) return;
      Snapshot s = take(device);
      for (size_t i = 0; i < s->num_blocks && !base; ++i) {
        const cuvmm_block_info& b = s->blocks[i];
        if (b.state == 1 && b.address <= at && at < b.address + b.size) {
          base = reinterpret_cast<void*>(b.address);
          if (size) *size = b.size;
        }
      }
    });
    TORCH_CHECK(base, "cuvmm: invalid device pointer: ", ptr, " is not live memory of cuvmm's");
    return base;
  }
  // One entry per segment as PyTorch's expandable segments have them (one per stream, pool size and private
  // pool), with its mapped bytes: the snapshot's runs of mapped pages summed by that key.
  std::vector<CCA::StreamSegmentSize> getExpandableSegmentSizes(DeviceIndex device) override {
    std::map<std::tuple<cudaStream_t, bool, unsigned long long, unsigned long long>, size_t> sizes;
    Snapshot s = take(device);
    for (size_t i = 0; i < s->num_segments; ++i) {
      const cuvmm_segment_info& seg = s->segments[i];
      sizes[{seg.stream, !seg.is_large, seg.pool_a, seg.pool_b}] += seg.total_size;
    }
    std::vector<CCA::StreamSegmentSize> out;
    for (const auto& [key, size] : sizes) out.emplace_back(std::get<0>(key), std::get<1>(key), size);
    return out;
  }

  // ---- streams ----
  void recordStream(const c10::DataPtr& ptr, c10::cuda::CUDAStream stream) override {
    if (!ptr.get() || ptr.get_deleter() != &delete_fn) return;  // not ours (from_blob, ...): as PyTorch
    DeviceIndex device = ptr.device().index();
    if (stream.device_index() != device) {
      // cuvmm's events are its device's, and CUDA records an event only on a stream of its own device: the
      // use is kept here until the free (wait_for_other_devices), as PyTorch's allocator records its events
      // on the stream's device.
      std::lock_guard<std::mutex> lock(mutex_);
      auto& uses = cross_device_uses_[ptr.get()];
      uses.first = device;
      // Each stream once: a loop that records the same stream every step must not grow the list.
      if (std::find(uses.second.begin(), uses.second.end(), stream) == uses.second.end()) {
        uses.second.push_back(stream);
      }
      cross_device_count_.store(cross_device_uses_.size(), std::memory_order_release);
      return;
    }
    api_.cuvmm_record_stream(ptr.get(), device, stream.stream());
    check(true, "recordStream");
  }
  void recordStream(const c10::DataPtr& ptr, c10::Stream stream) override {
    recordStream(ptr, c10::cuda::CUDAStream(stream));
  }

  // ---- statistics ----
  CDA::DeviceStats getDeviceStats(DeviceIndex device) override {
    cuvmm_device_stats s = stats(device);
    CDA::DeviceStats out;
    out.allocation = to_array(s.allocation);
    out.segment = to_array(s.segment);
    out.active = to_array(s.active);
    out.inactive_split = to_array(s.inactive_split);
    out.allocated_bytes = to_array(s.allocated_bytes);
    out.reserved_bytes = to_array(s.reserved_bytes);
    out.active_bytes = to_array(s.active_bytes);
    out.inactive_split_bytes = to_array(s.inactive_split_bytes);
    out.requested_bytes = to_array(s.requested_bytes);
    out.num_alloc_retries = s.num_alloc_retries;
    out.num_ooms = s.num_ooms;
    out.oversize_allocations = to_stat(s.oversize_allocations);
    out.oversize_segments = to_stat(s.oversize_segments);
    out.num_sync_all_streams = s.num_sync_all_streams;
    out.num_device_alloc = s.num_device_alloc;
    out.num_device_free = s.num_device_free;
    out.max_split_size = s.max_split_size;
#if TORCH_VERSION_MAJOR > 2 || TORCH_VERSION_MINOR >= 13
    // memory_stats()["reserved_bytes_by_private_pools"]: each graph pool's and MemPool's reserved bytes.
    std::vector<cuvmm_private_pool_stat> pools(8);
    long long n = api_.cuvmm_private_pool_stats(device, pools.data(), pools.size());
    if (n > static_cast<long long>(pools.size())) {
      pools.resize(n);
      n = api_.cuvmm_private_pool_stats(device, pools.data(), pools.size());
    }
    check(n >= 0, "getDeviceStats");
    for (long long i = 0; i < std::min<long long>(n, pools.size()); ++i) {
      const cuvmm_private_pool_stat& pool = pools[i];
      out.reserved_bytes_by_private_pools[MempoolId_t{pool.pool_a, pool.pool_b}] = to_array(pool.reserved_bytes);
    }
#endif
    return out;
  }
  void resetAccumulatedStats(DeviceIndex device) override {
    check(api_.cuvmm_reset_accumulated_stats(device) == 0, "resetAccumulatedStats");
  }
  void resetPeakStats(DeviceIndex device) override {
    check(api_.cuvmm_reset_peak_stats(device) == 0, "resetPeakStats");
  }

  // ---- snapshots and history ----
  CCA::SnapshotInfo snapshot(MempoolId_t pool, bool include_traces) override {
    CCA::SnapshotInfo info{};  // every setting cuvmm does not have reads 0, never an indeterminate value
    info.config_metadata.expandable_segments = true;
    info.config_metadata.max_split_size = SIZE_MAX;
    // PyTorch's pinned host memory is still PyTorch's allocator's, under PYTORCH_CUDA_ALLOC_CONF.
    info.config_metadata.pinned_num_register_threads = CCA::CUDAAllocatorConfig::pinned_num_register_threads();
    info.config_metadata.pinned_use_host_register = CCA::CUDAAllocatorConfig::pinned_use_cuda_host_register();
    const char* conf = std::getenv("CUVMM_ALLOC_CONF");
    info.config_metadata.last_allocator_settings = conf ? conf : "";
    info.device_traces.resize(std::max(device_count_, 1));
    std::vector<int> skipped;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      info.external_annotations.assign(annotations_.begin(), annotations_.end());
      skipped = skipped_actions_;
    }
    for_each_used([&](DeviceIndex device) {
      Snapshot s = take(device);
      for (size_t i = 0; i < s->num_segments; ++i) {
        const cuvmm_segment_info& seg = s->segments[i];
        if (pool != MempoolId_t{0, 0} && MempoolId_t{seg.pool_a, seg.pool_b} != pool) continue;
        info.segments.push_back(segment_info(device, seg, s->blocks));
      }
      if (include_traces && device < static_cast<DeviceIndex>(info.device_traces.size())) {
        for (size_t i = 0; i < s->num_traces; ++i) {
          if (std::find(skipped.begin(), skipped.end(), s->traces[i].action) != skipped.end()) continue;
          auto& entry = info.device_traces[device].emplace_back(trace_entry(device, s->traces[i]));
          entry.time_.t_ = s->traces[i].time_us;  // what PyTorch's snapshot reports: microseconds since the epoch
        }
      }
    });
    return info;
  }
  bool isHistoryEnabled() override { return history_entries_ > 0; }
  // record_function's annotations, kept while history is recorded and shown in snapshots.
  void recordAnnotation(const std::vector<std::pair<std::string, std::string>>& md) override {
    if (history_entries_ == 0) return;
    CDA::AnnotationEntry entry(c10::cuda::current_device(), c10::getApproximateTime());
    entry.time_.t_ = now_us();  // what PyTorch's snapshot reports: microseconds since the epoch
    for (const auto& [name, value] : md) entry.recordUserMetadata(name, value);
    std::lock_guard<std::mutex> lock(mutex_);
    while (annotations_.size() >= history_entries_) annotations_.pop_front();  // the last max_entries kept
    annotations_.push_back(std::move(entry));
  }
  // cuvmm records no stack traces or contexts with its events (`context` is not kept), so a compile
  // context, a pointer's context and user metadata have nothing to attach to.
  void pushCompileContext(std::string& /*md*/) override {}
  void popCompileContext() override {}
#if TORCH_VERSION_MAJOR > 2 || TORCH_VERSION_MINOR >= 14
  bool supportsUserMetadata() override { return false; }
  void setUserMetadata(const std::string& /*metadata*/) override {
    TORCH_WARN_ONCE("cuvmm does not record user metadata in its snapshots; the value set via "
                    "torch.cuda.memory._set_memory_metadata is ignored");
  }
  std::string getUserMetadata() override { return ""; }
  void annotateMemory(const void* /*ptr*/, const std::string& /*metadata*/) override {
    TORCH_WARN_ONCE("cuvmm does not record memory annotations in its snapshots; the value passed to "
                    "torch.cuda.memory._annotate_memory is ignored");
  }
#else
  // The metadata of the calling thread (PyTorch keeps it per thread, to attach to its events).
  void setUserMetadata(const std::string& metadata) override { user_metadata() = metadata; }
  std::string getUserMetadata() override { return user_metadata(); }
#endif
#if TORCH_VERSION_MAJOR > 2 || TORCH_VERSION_MINOR >= 13
  // This PyTorch marks every capture it makes (`use` has cuvmm expect the marks): after beginAllocateToPool
  // and cudaStreamBeginCapture, and after cudaStreamEndCapture. A pool begun with no capture marked
  // (use_mem_pool, cudagraph trees' warm-up) is then no capture to cuvmm, as to PyTorch's own allocator.
  // A capture left unmarked would be broken by what cuvmm then does: a failed mark throws.
  void markCaptureBegin(DeviceIndex device) override {
    use(device);
    check(api_.cuvmm_mark_capture(device, 1) == 0, "markCaptureBegin");
  }
  // Called on the way out of a failed capture too: it never throws.
  void markCaptureEnd(DeviceIndex device) override {
    if (api_.cuvmm_mark_capture(device, 0) != 0) {
      without_throwing("markCaptureEnd", [&] { TORCH_WARN(last_error("markCaptureEnd")); });
    }
  }
  // A block at `addr`, which must lie in free memory of one of cuvmm's segments on the current device.
  c10::DataPtr allocateWithAddress(size_t size, void* addr) override {
    DeviceIndex device = c10::cuda::current_device();
    use(device);
    void* p = api_.cuvmm_malloc_at(device, addr, static_cast<ssize_t>(size));
    TORCH_CHECK(p, last_error("allocateWithAddress"));
    return {p, p, &delete_fn, c10::Device(c10::DeviceType::CUDA, device)};
  }
#endif
#if TORCH_VERSION_MAJOR > 2 || TORCH_VERSION_MINOR >= 12
  std::shared_ptr<c10::GatheredContext> getContextForPointer(const void* /*ptr*/) override { return nullptr; }
  // cuvmm rejects no allocation ahead of an out-of-memory (no throw_on_cudamalloc_oom policy): the
  // observers are kept and never called.
  void attachOomRejectionObserver(CCA::OomRejectionObserver observer) override {
    std::lock_guard<std::mutex> lock(mutex_);
    oom_rejection_observers_.push_back(std::move(observer));
  }
#endif
  void recordHistory(bool enabled, CCA::CreateContextFn /*stack traces: not kept*/, size_t max_entries,
                     CCA::RecordContext /*when*/, bool clear, const std::vector<std::string>& skip) override {
    // _record_memory_history(skip_actions=[...]): the actions snapshots leave out of the history (trackers
    // see every event, as PyTorch's); an unknown name raises, as PyTorch's.
    std::vector<int> skipped;
    for (const std::string& name : skip) skipped.push_back(trace_action(name));
    size_t entries = enabled ? std::max<size_t>(max_entries, 1) : 0;
    history_entries_ = entries;
    {
      // As PyTorch's annotation buffer: emptied when recording stops or is cleared, cut to the new size.
      std::lock_guard<std::mutex> lock(mutex_);
      skipped_actions_ = std::move(skipped);
      if (entries == 0 || clear) annotations_.clear();
      while (annotations_.size() > entries) annotations_.pop_front();
    }
    for_each_used([&](DeviceIndex d) {
      if (clear && entries > 0) api_.cuvmm_record_history(d, 0);
      check(api_.cuvmm_record_history(d, entries) == 0, "recordHistory");
    });
  }
  void attachOutOfMemoryObserver(CCA::OutOfMemoryObserver observer) override {
    std::lock_guard<std::mutex> lock(mutex_);
    oom_observers_.push_back(std::move(observer));
  }
  // Called with each event of every device, as PyTorch calls them: on the thread of the event, under cuvmm's
  // lock of the device (so a tracker must not call the allocator, as PyTorch's comment on this method says),
  // with the approximate time PyTorch's own entries carry. A tracker's exception is a warning.
  void attachAllocatorTraceTracker(CCA::AllocatorTraceTracker tracker) override {
    if (!api_.cuvmm_attach_trace_tracker) {
      TORCH_WARN_ONCE("cuvmm: this libcuvmm_torch.so cannot call allocator trace trackers: rebuild it");
      return;
    }
    {
      std::lock_guard<std::mutex> lock(trackers_mutex_);
      auto more = std::make_shared<Trackers>(*trackers_);
      more->push_back(std::move(tracker));
      trackers_ = std::move(more);
    }
    tracking_.store(true);
    for_each_used([&](DeviceIndex d) { track(d); });
  }

  // ---- CUDA graphs and MemPool: private pools ----
  void beginAllocateToPool(DeviceIndex device, MempoolId_t pool, std::function<bool(cudaStream_t)> filter) override {
    use(device);
    auto box = std::make_unique<Filter>(Filter{std::move(filter)});
    Filter* raw = box.get();
    {
      std::lock_guard<std::mutex> lock(mutex_);
      // The filter of a pool already begun is in use by cuvmm: it stays, and the second begin is refused.
      TORCH_CHECK(!filters_.count({device, pool.first, pool.second}), "cuvmm: beginAllocateToPool: pool (",
                  pool.first, ", ", pool.second, ") is already being allocated to");
      filters_[{device, pool.first, pool.second}] = std::move(box);
      auto own = own_allocators_.find({device, pool});
      underway_.push_back({device, pool, raw, own == own_allocators_.end() ? nullptr : own->second});
      if (underway_.back().own) ++own_underway_;
    }
    if (api_.cuvmm_begin_allocate_to_pool(device, pool.first, pool.second, &Filter::call, raw) != 0) {
      std::string error = last_error("beginAllocateToPool");
      forget_underway(device, pool);
      TORCH_CHECK(false, error);
    }
  }
  void endAllocateToPool(DeviceIndex device, MempoolId_t pool) override {
    int status = api_.cuvmm_end_allocate_to_pool(device, pool.first, pool.second);
    std::string error = status == 0 ? "" : last_error("endAllocateToPool");
    forget_underway(device, pool);  // the filter is no longer called once end returned
    forget_spent_pools(device);     // a pool released during its use goes now
    TORCH_CHECK(status == 0, error);
  }
  // Called from ~CUDAGraph and ~MemPool: it must not throw. A pool cuvmm does not know as live (released
  // more often than begun and increfed) is a warning.
  void releasePool(DeviceIndex device, MempoolId_t pool) override {
    if (api_.cuvmm_release_pool(device, pool.first, pool.second) != 0) {
      without_throwing("releasePool", [&] { TORCH_WARN(last_error("releasePool")); });
    }
    forget_spent_pools(device);
  }
  int getPoolUseCount(DeviceIndex device, MempoolId_t pool) override {
    int count = api_.cuvmm_pool_use_count(device, pool.first, pool.second);
    check(count >= 0, "getPoolUseCount");
    return count;
  }
  // A MemPool made (or a graph sharing its pool): one more user. With an allocator of its own, the pool's
  // allocations go to that allocator, in segments cuvmm carves (cuvmm-torch/src/foreign.rs).
  void createOrIncrefPool(DeviceIndex device, MempoolId_t pool,
                          std::shared_ptr<CCA::CUDAAllocator> allocator) override {
    use(device);
    if (allocator && allocator.get() != this) {
      std::lock_guard<std::mutex> lock(mutex_);
      own_allocators_[{device, pool}] = std::move(allocator);
    }
    check(api_.cuvmm_incref_pool(device, pool.first, pool.second) == 0, "createOrIncrefPool");
  }
  // ~MemPool calls it with false: it never throws.
  void setUseOnOOM(DeviceIndex device, MempoolId_t pool, bool use_on_oom) override {
    if (api_.cuvmm_set_use_on_oom(device, pool.first, pool.second, use_on_oom ? 1 : 0) != 0) {
      without_throwing("setUseOnOOM", [&] { TORCH_WARN(last_error("setUseOnOOM")); });
    }
  }
  void setNoSplit(DeviceIndex device, MempoolId_t pool) override {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      no_split_.insert({device, pool});
    }
    check(api_.cuvmm_set_no_split(device, pool.first, pool.second) == 0, "setNoSplit");
  }
  bool checkPoolLiveAllocations(DeviceIndex device, MempoolId_t pool,
                                const std::unordered_set<void*>& expected) override {
    std::vector<cuvmm_pool_block> blocks = pool_blocks(device, pool);
    if (blocks.size() != expected.size()) return false;
    for (const auto& b : blocks) {
      if (!expected.count(reinterpret_cast<void*>(b.address))) return false;
    }
    return true;
  }
  std::shared_ptr<CCA::AllocatorState> getCheckpointState(DeviceIndex device, MempoolId_t pool) override {
    auto state = std::make_shared<Checkpoint>();
    state->device = device;
    state->pool = pool;
    state->blocks = pool_blocks(device, pool);
    return state;
  }
  // Puts the pool back as the checkpoint found it: the blocks live then are live again at the same
  // addresses, those allocated since are gone. As PyTorch's: every block live before the call counts as
  // freed, every block of the checkpoint as allocated, with a DataPtr whose deleter frees it.
  CCA::CheckpointDelta setCheckpointPoolState(DeviceIndex device,
                                              std::shared_ptr<CCA::AllocatorState> pps) override {
    auto* state = dynamic_cast<Checkpoint*>(pps.get());
    TORCH_CHECK(state && state->device == device, "cuvmm: not a checkpoint of cuvmm's for this device");
    std::vector<cuvmm_pool_block> before = pool_blocks(device, state->pool);
    check(api_.cuvmm_pool_restore(device, state->pool.first, state->pool.second, state->blocks.data(),
                                  state->blocks.size()) == 0,
          "setCheckpointPoolState");
    CCA::CheckpointDelta delta;
    for (const auto& b : before) delta.ptrs_freed.push_back(reinterpret_cast<void*>(b.address));
    forget_cross_device_uses(delta.ptrs_freed);
    for (const auto& b : state->blocks) {
      void* p = reinterpret_cast<void*>(b.address);
      delta.dataptrs_allocd.emplace_back(p, p, &delete_fn, c10::Device(c10::DeviceType::CUDA, device));
    }
    return delta;
  }

  // ---- peers, copies, IPC ----
  void enablePeerAccess(DeviceIndex dev, DeviceIndex dev_to_access) override {
    c10::cuda::CUDAGuard guard(dev);
    cudaError_t err = cudaDeviceEnablePeerAccess(dev_to_access, 0);
    if (err == cudaErrorPeerAccessAlreadyEnabled) {
      (void)cudaGetLastError();  // clear it
    } else {
      C10_CUDA_CHECK(err);
    }
    TORCH_CHECK(api_.cuvmm_add_peer, "cuvmm: this libcuvmm_torch.so cannot map memory for peers");
    use(dev_to_access);
    check(api_.cuvmm_add_peer(dev_to_access, dev) == 0, "enablePeerAccess");
  }
  cudaError_t memcpyAsync(void* dst, int dst_device, const void* src, int src_device, size_t count,
                          cudaStream_t stream, bool p2p_enabled) override {
    // cuMemMap'd memory needs the Peer copy between devices unless peer access is on (see the base class).
    if (p2p_enabled || dst_device == src_device) {
      return cudaMemcpyAsync(dst, src, count, cudaMemcpyDeviceToDevice, stream);
    }
    return cudaMemcpyPeerAsync(dst, dst_device, src, src_device, count, stream);
  }
  // IPC (torch.multiprocessing): PyTorch calls shareIpcHandle on the storage's device, sends the handle
  // string and offset, and the receiver calls getIpcDevPtr on the same device; see cuvmm-torch/src/sharing.rs.
  CCA::ShareableHandle shareIpcHandle(void* ptr) override {
    TORCH_CHECK(api_.cuvmm_ipc_share, "cuvmm: this libcuvmm_torch.so cannot share memory between processes: "
                "rebuild it from a newer cuvmm");
    DeviceIndex device = c10::cuda::current_device();
    size_t len = 0;
    uint64_t offset = 0;
    uint8_t* bytes = api_.cuvmm_ipc_share(device, ptr, &len, &offset);
    TORCH_CHECK(bytes, last_error("shareIpcHandle"));
    std::string handle(reinterpret_cast<const char*>(bytes), len);
    api_.cuvmm_bytes_free(bytes, len);
    return CCA::ShareableHandle{static_cast<ptrdiff_t>(offset), std::move(handle)};
  }
  // One mapping per handle string while it is in use, as PyTorch's allocator keeps (a storage received
  // twice maps once). A handle from a process on PyTorch's own allocator (cudaMalloc'd) opens too.
  std::shared_ptr<void> getIpcDevPtr(std::string handle) override {
    std::lock_guard<std::mutex> lock(ipc_mutex_);
    IpcLockHeld held;
    auto found = imports_.find(handle);
    if (found != imports_.end()) {
      if (auto open = found->second.lock()) return open;
    }
    DeviceIndex device = c10::cuda::current_device();
    void* base = nullptr;
    std::function<void(void*)> close;
    cudaIpcMemHandle_t raw;
    if (cuda_malloc_handle(handle, &raw)) {
      C10_CUDA_CHECK(cudaIpcOpenMemHandle(&base, raw, cudaIpcMemLazyEnablePeerAccess));
      close = [device](void* p) {
        c10::cuda::CUDAGuard guard(device);
        if (cudaIpcCloseMemHandle(p) != cudaSuccess) (void)cudaGetLastError();
      };
    } else {
      // An expandable segment's descriptors (from cuvmm, or from PyTorch's expandable segments), or cuvmm's own.
      TORCH_CHECK(api_.cuvmm_ipc_open, "cuvmm: this libcuvmm_torch.so cannot open shared memory: rebuild it");
      base = api_.cuvmm_ipc_open(device, reinterpret_cast<const uint8_t*>(handle.data()), handle.size());
      TORCH_CHECK(base, last_error("getIpcDevPtr"));
      Api api = api_;
      close = [api, device](void* p) {
        // The receiver's kernels may still read it: wait for the device, as PyTorch's own import does.
        c10::cuda::CUDAGuard guard(device);
        if (cudaDeviceSynchronize() != cudaSuccess) (void)cudaGetLastError();
        if (api.cuvmm_ipc_close(device, p) != 0) {
          const char* error = api.cuvmm_last_error();
          TORCH_WARN("cuvmm: ", error ? error : "closing shared memory failed");
        }
      };
    }
    // The deleter runs when the last storage using the mapping goes: it must not throw.
    std::shared_ptr<void> open(base, [this, handle, close](void* p) {
      try {
        // Run here under ipc_mutex_ only when making the pointer or its entry threw (the standard calls the
        // deleter then): the lock is not taken twice, and the expired entry is replaced at the next open.
        if (!IpcLockHeld::here()) {
          std::lock_guard<std::mutex> lock(ipc_mutex_);
          auto entry = imports_.find(handle);
          if (entry != imports_.end() && entry->second.expired()) imports_.erase(entry);
        }
        close(p);
      } catch (...) {
      }
    });
    imports_[handle] = open;
    return open;
  }

 private:
  // Marks the thread as holding ipc_mutex_ while it lives (getIpcDevPtr), for the deleter it may run.
  struct IpcLockHeld {
    IpcLockHeld() { flag() = true; }
    ~IpcLockHeld() { flag() = false; }
    IpcLockHeld(const IpcLockHeld&) = delete;
    IpcLockHeld& operator=(const IpcLockHeld&) = delete;
    static bool here() { return flag(); }
    static bool& flag() {
      static thread_local bool held = false;
      return held;
    }
  };

  // The blocks at `ptrs` were freed without their deleters (a checkpoint restored): the other devices' streams
  // recorded on them are forgotten, as PyTorch's restore forgets each block's stream uses. Never throws.
  void forget_cross_device_uses(const std::vector<void*>& ptrs) noexcept {
    if (cross_device_count_.load(std::memory_order_acquire) == 0) return;
    without_throwing("setCheckpointPoolState", [&] {
      std::lock_guard<std::mutex> lock(mutex_);
      for (void* p : ptrs) cross_device_uses_.erase(p);
      cross_device_count_.store(cross_device_uses_.size(), std::memory_order_release);
    });
  }

  // Before `p` is freed: each stream of another device recorded on it gets an event now, which a stream of
  // `p`'s device that cuvmm owns waits for (CUDA lets a stream wait for another device's event); that
  // stream is recorded on `p`, so cuvmm's free waits for it as for any stream, and the memory is reused
  // only after the other devices' work queued before the free. Where that fails, those streams are
  // synchronized (the host waits). A deleter: never throws.
  void wait_for_other_devices(void* p) noexcept {
    DeviceIndex device = -1;
    std::vector<c10::cuda::CUDAStream> streams;
    without_throwing("raw_delete", [&] {
      std::lock_guard<std::mutex> lock(mutex_);
      auto found = cross_device_uses_.find(p);
      if (found == cross_device_uses_.end()) return;
      device = found->second.first;
      streams = std::move(found->second.second);
      cross_device_uses_.erase(found);
      cross_device_count_.store(cross_device_uses_.size(), std::memory_order_release);
    });
    if (streams.empty()) return;
    bool waited = false;
    without_throwing("raw_delete: waiting for another device's stream", [&] {
      cudaStream_t proxy = proxy_stream(device);
      for (const auto& stream : streams) {
        c10::cuda::CUDAGuard on_stream(stream.device_index());
        cudaEvent_t event = nullptr;
        C10_CUDA_CHECK(cudaEventCreateWithFlags(&event, cudaEventDisableTiming));
        cudaError_t status = cudaEventRecord(event, stream.stream());
        if (status == cudaSuccess) status = cudaStreamWaitEvent(proxy, event, 0);
        (void)cudaEventDestroy(event);  // released once complete; the wait above keeps its place
        C10_CUDA_CHECK(status);
      }
      api_.cuvmm_record_stream(p, device, proxy);
      waited = api_.cuvmm_last_error() == nullptr;
    });
    if (waited) return;
    (void)cudaGetLastError();
    without_throwing("raw_delete: synchronizing another device's stream", [&] {
      for (const auto& stream : streams) {
        c10::cuda::CUDAGuard on_stream(stream.device_index());
        if (cudaStreamSynchronize(stream.stream()) != cudaSuccess) (void)cudaGetLastError();
      }
    });
  }
  // A stream of `device` that cuvmm's layer owns, made at first use and kept for the process's life.
  cudaStream_t proxy_stream(DeviceIndex device) {
    TORCH_CHECK(device >= 0 && device < 64, "cuvmm: device ", int(device), " out of range");
    std::lock_guard<std::mutex> lock(mutex_);
    cudaStream_t& stream = proxies_[device];
    if (stream == nullptr) {
      c10::cuda::CUDAGuard guard(device);
      C10_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    }
    return stream;
  }

  static void delete_fn(void* p) { instance->raw_delete(p); }
  // The deleter of a tensor allocated with caching off (recordStream ignores it, as PyTorch's does).
  static void uncached_delete_fn(void* p) {
    if (p != nullptr && !instance->uncached_free(p)) instance->raw_delete(p);
  }

  // Caching off: cudaMalloc, as PyTorch's allocator then (and, as there, refused during a graph capture).
  void* uncached_allocate(size_t n) {
    if (n == 0) return nullptr;
    void* p = nullptr;
    cudaError_t status = cudaMalloc(&p, n);
    if (status == cudaErrorMemoryAllocation) {
      (void)cudaGetLastError();
      TORCH_CHECK_WITH(OutOfMemoryError, false, "CUDA out of memory. Tried to allocate ", n,
                       " bytes with caching off (torch.cuda.caching_allocator_enable(False) or "
                       "PYTORCH_NO_CUDA_MEMORY_CACHING=1): cudaMalloc refused");
    }
    C10_CUDA_CHECK(status);
    std::lock_guard<std::mutex> lock(uncached_mutex_);
    uncached_.insert(p);
    uncached_count_.store(uncached_.size(), std::memory_order_release);
    return p;
  }
  // Gives back memory allocated with caching off; false for any other pointer. A deleter: never throws.
  bool uncached_free(void* p) noexcept {
    bool found = false;
    without_throwing("raw_delete", [&] {
      std::lock_guard<std::mutex> lock(uncached_mutex_);
      found = uncached_.erase(p) > 0;
      uncached_count_.store(uncached_.size(), std::memory_order_release);
    });
    if (!found) return false;
    cudaError_t status = cudaFree(p);
    if (status != cudaSuccess) {
      (void)cudaGetLastError();
      without_throwing("raw_delete", [&] {
        TORCH_CHECK(false, "cudaFree of memory allocated with caching off failed: ", cudaGetErrorString(status));
      });
    }
    return true;
  }

  void* malloc_on(size_t n, DeviceIndex device, cudaStream_t stream) {
    use(device);
    if (own_underway_.load(std::memory_order_acquire) > 0) {
      // The pool begun last whose filter accepts the stream gets the allocation, as in PyTorch.
      std::shared_ptr<CCA::CUDAAllocator> own;
      MempoolId_t pool;
      {
        std::lock_guard<std::mutex> lock(mutex_);
        for (auto it = underway_.rbegin(); it != underway_.rend(); ++it) {
          if (it->device == device && Filter::call(it->filter, stream)) {
            own = it->own;
            pool = it->pool;
            break;
          }
        }
      }
      if (own) return malloc_in_own_pool(n, device, stream, pool, own);
    }
    // The failure of the last try, read at once: what runs between tries calls cuvmm too.
    std::string error;
    cuvmm_oom_info oom{};
    bool out_of_memory = false;
    auto attempt = [&] {
      void* p = api_.cuvmm_malloc(static_cast<ssize_t>(n), device, stream);
      if (!p) {
        error = last_error("malloc");
        out_of_memory = api_.cuvmm_last_oom(&oom) != 0;
      }
      return p;
    };
    void* p = attempt();
    // Before an out-of-memory, as PyTorch's allocator: the callbacks' frees, and the free segments of
    // released pools with an allocator of their own (memory cuvmm does not reserve), then once more.
    if (!p && out_of_memory) {
      bool freed = free_memory_callbacks();
      freed = give_back_segments(device, MempoolId_t{0, 0}, true) > 0 || freed;
      if (freed) {
        p = attempt();
        // PyTorch counts a retry, not an out-of-memory, when room was made.
        if (p && api_.cuvmm_recovered_oom) api_.cuvmm_recovered_oom(device);
      }
    }
    if (p) return p;
    if (out_of_memory) {
      size_t limit = oom.allowed ? oom.allowed : oom.device_total;
      notify_oom(device, oom.alloc_size, limit, oom.device_free);
      TORCH_CHECK_WITH(OutOfMemoryError, false, error);
    }
    TORCH_CHECK(false, error);
  }
  // Calls the out-of-memory observers (torch.cuda.memory._record_memory_history's dump on OOM, ...), with
  // no lock held.
  void notify_oom(DeviceIndex device, size_t size, size_t limit, size_t free) {
    std::vector<CCA::OutOfMemoryObserver> observers;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      observers = oom_observers_;
    }
    for (const auto& observer : observers) observer(device, size, limit, free);
  }

  // A block in a pool with an allocator of its own: carved by cuvmm in segments that allocator makes.
  void* malloc_in_own_pool(size_t n, DeviceIndex device, cudaStream_t stream, MempoolId_t pool,
                           const std::shared_ptr<CCA::CUDAAllocator>& own) {
    bool no_split = false;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      no_split = no_split_.count({device, pool}) > 0;
    }
    for (int round = 0; round < 2; ++round) {
      size_t grow = 0;
      void* p = api_.cuvmm_foreign_malloc(device, pool.first, pool.second, static_cast<ssize_t>(n), stream,
                                          no_split ? 1 : 0, &grow);
      if (p) return p;
      TORCH_CHECK(grow > 0, last_error("malloc in a pool with an allocator of its own"));
      void* segment = own_segment(own, device, stream, grow);
      if (!segment) {
        // As PyTorch's allocator before an out-of-memory: what is cached goes back to the device (cuvmm's
        // idle pages, released pools' free segments), the callbacks free theirs, and the pool's allocator
        // is asked once more.
        api_.cuvmm_empty_cache(device);  // refused during a capture: then nothing is given back
        give_back_segments(device, MempoolId_t{0, 0}, true);
        free_memory_callbacks();
        segment = own_segment(own, device, stream, grow);
      }
      if (!segment) {
        size_t free = 0, total = 0;
        {
          c10::cuda::CUDAGuard guard(device);
          if (cudaMemGetInfo(&free, &total) != cudaSuccess) (void)cudaGetLastError();
        }
        notify_oom(device, n, total, free);
        TORCH_CHECK_WITH(OutOfMemoryError, false, "cuvmm: the allocator of pool (", pool.first, ", ",
                         pool.second, ") could not allocate a segment of ", grow, " bytes");
      }
      if (api_.cuvmm_foreign_add_segment(device, pool.first, pool.second, stream, segment, grow) != 0) {
        std::string error = last_error("a segment of a pool's allocator");
        own->raw_delete(segment);
        TORCH_CHECK(false, error);
      }
    }
    TORCH_CHECK(false, "cuvmm: a new segment of a pool's allocator did not hold its request");
  }
  // Microseconds since the epoch: the time PyTorch's snapshots report (PyTorch converts its clock to it).
  static int64_t now_us() {
    using namespace std::chrono;
    return duration_cast<microseconds>(system_clock::now().time_since_epoch()).count();
  }
  // A segment of `bytes` from a pool's own allocator, or null. As PyTorch calls a pool's allocator: on the
  // device, and allowed during a capture (relaxed mode).
  static void* own_segment(const std::shared_ptr<CCA::CUDAAllocator>& own, DeviceIndex device,
                           cudaStream_t stream, size_t bytes) {
    c10::cuda::CUDAGuard guard(device);
    c10::cuda::CUDAStreamCaptureModeGuard relaxed{cudaStreamCaptureModeRelaxed};
    return own->raw_alloc_with_stream(bytes, stream);
  }
  // PyTorch's FreeCudaMemoryCallbacksRegistry (libtorch registers "cuda_ipc_collect", which frees the
  // blocks this process sent to others and they have released): run before an out-of-memory is reported,
  // as PyTorch's allocator runs them before it grows. Whether any freed memory.
  static bool free_memory_callbacks() {
    bool freed = false;
    for (const auto& name : c10::FreeCudaMemoryCallbacksRegistry()->Keys()) {
      freed |= c10::FreeCudaMemoryCallbacksRegistry()->Create(name)->Execute();
    }
    return freed;
  }
  // Gives the wholly free segments of released pools with an allocator of their own (`pool`'s, or every
  // one's with `all`) back to their allocators; returns how many. From emptyCache, which ~MemPool calls,
  // and before an out-of-memory: one allocator's failure to take a segment back is a warning, and the
  // others still go back.
  size_t give_back_segments(DeviceIndex device, MempoolId_t pool, bool all) {
    size_t len = 0;
    cuvmm_foreign_segment* segments =
        api_.cuvmm_foreign_release(device, pool.first, pool.second, all ? 1 : 0, &len);
    if (const char* error = api_.cuvmm_last_error()) TORCH_WARN("cuvmm: emptyCache: ", error);
    for (size_t i = 0; i < len; ++i) {
      const cuvmm_foreign_segment& seg = segments[i];
      std::shared_ptr<CCA::CUDAAllocator> own;
      {
        std::lock_guard<std::mutex> lock(mutex_);
        auto found = own_allocators_.find({device, MempoolId_t{seg.pool_a, seg.pool_b}});
        if (found != own_allocators_.end()) own = found->second;
      }
      if (own) {
        auto address = reinterpret_cast<void*>(seg.address);
        without_throwing("emptyCache: giving a segment back to its pool's allocator", [&] {
          c10::cuda::CUDAGuard guard(device);
          own->raw_delete(address);
        });
      }
    }
    api_.cuvmm_foreign_segments_free(segments, len);
    forget_spent_pools(device);
    return len;
  }
  bool is_underway(DeviceIndex device, MempoolId_t pool) {
    std::lock_guard<std::mutex> lock(mutex_);
    return std::any_of(underway_.begin(), underway_.end(),
                       [&](const Underway& u) { return u.device == device && u.pool == pool; });
  }
  // Lets go of the allocators and no_split marks of `device`'s released pools that hold none of their
  // allocator's segments any more, as PyTorch frees a private pool then: a program making a MemPool per
  // step keeps none of them. A pool whose count cannot be read is kept.
  void forget_spent_pools(DeviceIndex device) noexcept {
    without_throwing("releasing a pool's allocator", [&] {
      std::vector<MempoolId_t> pools;
      {
        std::lock_guard<std::mutex> lock(mutex_);
        for (const auto& entry : own_allocators_) {
          if (entry.first.first == device) pools.push_back(entry.first.second);
        }
        for (const auto& key : no_split_) {
          if (key.first == device) pools.push_back(key.second);
        }
      }
      for (const auto& pool : pools) {
        // A pool released while still being allocated to (deleted inside its own use_mem_pool) stays.
        if (is_underway(device, pool)) continue;
        if (api_.cuvmm_pool_use_count(device, pool.first, pool.second) != 0) continue;
        if (api_.cuvmm_foreign_segment_count(device, pool.first, pool.second) != 0) continue;
        std::shared_ptr<CCA::CUDAAllocator> spent;  // let go of with no lock held
        std::lock_guard<std::mutex> lock(mutex_);
        auto found = own_allocators_.find({device, pool});
        if (found != own_allocators_.end()) {
          spent = std::move(found->second);
          own_allocators_.erase(found);
        }
        no_split_.erase({device, pool});
      }
    });
  }
  void forget_underway(DeviceIndex device, MempoolId_t pool) {
    std::lock_guard<std::mutex> lock(mutex_);
    for (auto it = underway_.begin(); it != underway_.end(); ++it) {
      if (it->device == device && it->pool == pool) {
        if (it->own) --own_underway_;
        underway_.erase(it);
        break;
      }
    }
    filters_.erase({device, pool.first, pool.second});
  }
  // The live blocks of `pool` on `device`.
  std::vector<cuvmm_pool_block> pool_blocks(DeviceIndex device, MempoolId_t pool) {
    std::vector<cuvmm_pool_block> blocks;
    for (;;) {
      long long n = api_.cuvmm_pool_blocks(device, pool.first, pool.second, blocks.data(), blocks.size());
      check(n >= 0, "pool blocks");
      if (static_cast<size_t>(n) <= blocks.size()) {
        blocks.resize(static_cast<size_t>(n));
        return blocks;
      }
      blocks.resize(static_cast<size_t>(n));
    }
  }
#if !(TORCH_VERSION_MAJOR > 2 || TORCH_VERSION_MINOR >= 14)
  static std::string& user_metadata() {
    static thread_local std::string metadata;
    return metadata;
  }
#endif

  // The first use of a device turns on history recording there if it is on, and calls the trace trackers.
  // A device cuvmm does not serve is never used (the call naming it fails): snapshots and history, which
  // cover every device used, would fail with it.
  void use(DeviceIndex device) {
    if (device < 0 || device >= 64) return;
    uint64_t bit = uint64_t{1} << device;
    if (used_.load(std::memory_order_relaxed) & bit) return;
    if (device >= served_devices()) return;
    if (used_.fetch_or(bit) & bit) return;
#if TORCH_VERSION_MAJOR > 2 || TORCH_VERSION_MINOR >= 13
    api_.cuvmm_mark_captures(device);  // this PyTorch marks its captures (markCaptureBegin/End)
#endif
    if (history_entries_ > 0) api_.cuvmm_record_history(device, history_entries_);
    if (tracking_.load()) track(device);
  }
  // The number of devices cuvmm serves, asked once it answers (0 while it cannot: no driver).
  int served_devices() {
    int count = served_devices_.load(std::memory_order_relaxed);
    if (count >= 0) return count;
    count = api_.cuvmm_device_count();
    if (count < 0) return 0;
    served_devices_.store(count, std::memory_order_relaxed);
    return count;
  }
  // Has cuvmm call the trace trackers with `device`'s events, once per device: the device's first use and the
  // first tracker may race, and both come here.
  void track(DeviceIndex device) {
    uint64_t bit = uint64_t{1} << device;
    if (tracked_.fetch_or(bit) & bit) return;
    if (api_.cuvmm_attach_trace_tracker(device, &CuvmmAllocator::on_event, this) != 0) {
      std::string error = last_error("attachAllocatorTraceTracker");
      without_throwing("allocator trace trackers will not see a device", [&] {
        TORCH_CHECK(false, "device ", static_cast<int>(device), ": ", error);
      });
    }
  }
  // cuvmm's tracker: an event of `device` (no exception may leave it).
  static void on_event(void* self, int device, const cuvmm_trace_entry* entry) noexcept {
    without_throwing("an allocator trace tracker", [&] {
      auto d = static_cast<DeviceIndex>(device);
      static_cast<CuvmmAllocator*>(self)->call_trackers(trace_entry(d, *entry));
    });
  }
  // Calls each trace tracker with `entry`; one that throws is a warning, and the others are still called.
  void call_trackers(const CDA::TraceEntry& entry) noexcept {
    std::shared_ptr<const Trackers> trackers;
    {
      std::lock_guard<std::mutex> lock(trackers_mutex_);
      trackers = trackers_;
    }
    for (const auto& tracker : *trackers) without_throwing("an allocator trace tracker", [&] { tracker(entry); });
  }
  // The action named `name` in _record_memory_history's skip_actions (PyTorch's names); raises for another.
  static int trace_action(const std::string& name) {
    using A = CDA::TraceEntry::Action;
    static const std::pair<const char*, A> kActions[] = {
        {"alloc", A::ALLOC},
        {"free_requested", A::FREE_REQUESTED},
        {"free_completed", A::FREE_COMPLETED},
        {"segment_alloc", A::SEGMENT_ALLOC},
        {"segment_free", A::SEGMENT_FREE},
        {"segment_map", A::SEGMENT_MAP},
        {"segment_unmap", A::SEGMENT_UNMAP},
        {"snapshot", A::SNAPSHOT},
        {"oom", A::OOM},
    };
    int found = -1;
    for (const auto& [known, action] : kActions) {
      if (name == known) found = static_cast<int>(action);
    }
    TORCH_CHECK(found >= 0, "Unknown TraceEntry action: ", name);
    return found;
  }
  // PyTorch's entry for cuvmm's event `t` of `device`, at the approximate time PyTorch's own entries take.
  static CDA::TraceEntry trace_entry(DeviceIndex device, const cuvmm_trace_entry& t) {
    return CDA::TraceEntry(static_cast<CDA::TraceEntry::Action>(t.action), device, t.addr, t.size, t.stream,
                           MempoolId_t{t.pool_a, t.pool_b}, c10::getApproximateTime());
  }
  template <typename F>
  void for_each_used(F f) {
    uint64_t used = used_.load();
    for (DeviceIndex d = 0; d < 64; ++d) {
      if (used & (uint64_t{1} << d)) f(d);
    }
  }

  std::string last_error(const char* what) {
    const char* error = api_.cuvmm_last_error();
    return std::string("cuvmm: ") + (error ? error : std::string(what) + " failed");
  }
  // Throws cuvmm's error if `ok` is false or the call just made recorded one.
  void check(bool ok, const char* what) {
    const char* error = api_.cuvmm_last_error();
    TORCH_CHECK(ok && !error, "cuvmm: ", error ? error : (std::string(what) + " failed").c_str());
  }

  // Zeros for a device never named, which asking does not open (see cuvmm_get_device_stats). A device that
  // holds memory counts as used from then on, though it got it through the C ABI alone (cuvmm_torch's
  // ctypes calls): snapshots and history cover it.
  cuvmm_device_stats stats(DeviceIndex device) {
    cuvmm_device_stats s{};
    check(api_.cuvmm_get_device_stats(device, &s) == 0, "getDeviceStats");
    if (s.reserved_bytes.all.current > 0 || s.allocation.all.current > 0) use(device);
    return s;
  }
  Snapshot take(DeviceIndex device) {
    Snapshot s(api_.cuvmm_snapshot_take(device), api_.cuvmm_snapshot_free);
    check(s != nullptr, "snapshot");
    return s;
  }
  static CDA::SegmentInfo segment_info(DeviceIndex device, const cuvmm_segment_info& seg,
                                       const cuvmm_block_info* blocks) {
    CDA::SegmentInfo out;
    out.device = device;
    out.address = seg.address;
    out.total_size = seg.total_size;
    out.requested_size = seg.requested_size;
    out.allocated_size = seg.allocated_size;
    out.active_size = seg.active_size;
    out.stream = seg.stream;
    out.is_large = seg.is_large != 0;
    out.is_expandable = seg.is_expandable != 0;
    out.owner_private_pool_id = {seg.pool_a, seg.pool_b};
    for (size_t j = seg.first_block; j < seg.first_block + seg.num_blocks; ++j) {
      CDA::BlockInfo block;
      block.size = blocks[j].size;
      block.requested_size = blocks[j].requested_size;
      block.allocated = blocks[j].state == 1;
      block.active = blocks[j].state != 0;
      out.blocks.push_back(block);
    }
    return out;
  }
  Api api_;
  // PYTORCH_NO_CUDA_MEMORY_CACHING, read once as PyTorch's allocator reads it ("1" sets it; a value other
  // than 0 or 1 is warned about and ignored): a debugging setting, for compute-sanitizer and the like.
  const bool force_uncached_ = c10::utils::check_env("PYTORCH_NO_CUDA_MEMORY_CACHING") == true;
  std::atomic<bool> initialized_{false};
  int device_count_ = 0;
  std::atomic<uint64_t> used_{0};  // bit d: device d has been named
  std::atomic<int> served_devices_{-1};  // the devices cuvmm serves; -1 until it answers
  std::atomic<size_t> history_entries_{0};
  // The actions snapshots leave out of the history (recordHistory's skip_actions); guarded by mutex_.
  std::vector<int> skipped_actions_;
  std::atomic<bool> tracking_{false};  // a trace tracker is attached
  std::atomic<uint64_t> tracked_{0};   // bit d: cuvmm calls on_event with device d's events
  // The trackers, replaced whole when one is attached, so that an event copies a pointer, not the list.
  using Trackers = std::vector<CCA::AllocatorTraceTracker>;
  std::mutex trackers_mutex_;  // guards trackers_; taken under cuvmm's lock, never held calling cuvmm
  std::shared_ptr<const Trackers> trackers_ = std::make_shared<const Trackers>();
  std::mutex mutex_;  // guards what follows, to ipc_mutex_
  std::vector<CCA::OutOfMemoryObserver> oom_observers_;
  std::map<std::tuple<DeviceIndex, c10::CaptureId_t, c10::CaptureId_t>, std::unique_ptr<Filter>> filters_;
  std::vector<Underway> underway_;
  std::atomic<int> own_underway_{0};  // entries of underway_ with an allocator of their own
  std::map<std::pair<DeviceIndex, MempoolId_t>, std::shared_ptr<CCA::CUDAAllocator>> own_allocators_;
  std::set<std::pair<DeviceIndex, MempoolId_t>> no_split_;
  std::deque<CDA::AnnotationEntry> annotations_;
  // Streams of other devices recorded on live memory, with the memory's device (recordStream).
  std::unordered_map<void*, std::pair<DeviceIndex, std::vector<c10::cuda::CUDAStream>>> cross_device_uses_;
  std::atomic<size_t> cross_device_count_{0};  // its size, read without the lock on each free
  std::array<cudaStream_t, 64> proxies_{};     // proxy_stream's, by device
#if TORCH_VERSION_MAJOR > 2 || TORCH_VERSION_MINOR >= 12
  std::vector<CCA::OomRejectionObserver> oom_rejection_observers_;
#endif
  std::mutex ipc_mutex_;  // guards imports_
  std::unordered_map<std::string, std::weak_ptr<void>> imports_;
  std::atomic<bool> enabled_{true};  // caching on (torch.cuda.caching_allocator_enable)
  std::mutex uncached_mutex_;        // guards uncached_
  std::unordered_set<void*> uncached_;  // live memory allocated while caching was off
  std::atomic<size_t> uncached_count_{0};  // its size, read without the lock on each free
};

CuvmmAllocator* CuvmmAllocator::instance = nullptr;

// Makes cuvmm, from the library at `path`, PyTorch's CUDA allocator. PyTorch refuses once its current
// allocator has been used (the first CUDA tensor).
void install(const std::string& path) {
  TORCH_CHECK(CuvmmAllocator::instance == nullptr, "cuvmm: already installed");
  auto allocator = std::make_shared<CuvmmAllocator>(Api::open(path));
  allocator->set_torch_version();
  CuvmmAllocator::instance = allocator.get();
  try {
    torch::cuda::CUDAPluggableAllocator::changeCurrentAllocator(allocator);
  } catch (...) {
    CuvmmAllocator::instance = nullptr;
    throw;
  }
  // Never destroyed: a tensor freed on another thread while the process exits (PyTorch's own reference is
  // a static, destroyed at exit) still finds the allocator its deleter calls.
  static auto* kept = new std::shared_ptr<CuvmmAllocator>(std::move(allocator));
  (void)kept;
}

bool installed() { return CuvmmAllocator::instance != nullptr; }

}  // namespace cuvmm_torch

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "cuvmm as PyTorch's CUDA allocator (the C++ layer of cuvmm-torch)";
  m.def("install", &cuvmm_torch::install, "Makes cuvmm (libcuvmm_torch.so at `path`) PyTorch's CUDA allocator");
  m.def("installed", &cuvmm_torch::installed, "Whether install() succeeded in this process");
}
