"""vLLM's ``CuMemAllocator`` (``vllm/device_allocator/cumem.py``) over cuvmm's tags: code that uses vLLM's
sleep mode API switches by changing its import::

    from cuvmm_torch.cumem import CuMemAllocator

    allocator = CuMemAllocator.get_instance()
    with allocator.use_memory_pool(tag="weights"):
        load_model()
    with allocator.use_memory_pool(tag="kv_cache"):
        allocate_kv_cache()
    with allocator.cudagraph_pool() as pool:
        with torch.cuda.graph(graph, pool=pool):
            ...
    allocator.sleep(offload_tags=("weights",))   # weights kept on the host, the rest discarded
    allocator.wake_up(tags=["weights"])          # and every tag but kv_cache (vLLM's deferrable tags)
    allocator.wake_up(tags=["kv_cache"])

cuvmm must be PyTorch's allocator: the first ``use_memory_pool`` of a program that imported torch installs
it (``cuvmm_torch.install()``) if nothing did before, and raises if it can no longer be (a CUDA call came
first); there is no pluggable ``MemPool`` of its own. Each call is a thin function over cuvmm's tags
(``vllm:TAG``): ``use_memory_pool`` is ``cuvmm_torch.region``, ``sleep`` is ``cuvmm_torch.sleep`` of every tag
used (keeping the bytes of ``offload_tags``), ``discard`` its ``keep=False``, ``wake_up`` is
``cuvmm_torch.wake``, on every device where the tag has memory. As vLLM's, ``wake_up(tags)`` also wakes every
tag but the deferrable ones (``weights``, ``kv_cache``) not named, a second sleep or wake of a tag changes
nothing, and ``cudagraph_pool`` yields a graph pool whose memory is under the tag ``cudagraph``. A sleep goes
on through every tag when one is refused (a CUDA graph capture underway, say), then raises the first error.

What differs from vLLM's: the bytes go to page-locked memory kept across cycles (vLLM pins a new buffer per
allocation at each sleep), copied asynchronously on a stream of cuvmm's own, and cuvmm's own
``prepare_sleep(offload_tags)`` pins it ahead of the first sleep; CUDA graphs captured inside
``use_memory_pool`` sleep and wake with the tag too (vLLM's only through ``cudagraph_pool``); ``pointer_to_data`` and
``allocator_and_pools`` do not exist (cuvmm keeps that state), and ``release_pools``/``close`` have nothing to
release; expandable segments need no turning off; ``get_current_usage`` counts the bytes of live tensors,
where vLLM's counts its pool's segments (cached free blocks included).
"""

import contextlib
import functools
import gc
import threading

import cuvmm_torch as _cuvmm

__all__ = ["CuMemAllocator", "cumem_available"]

_PREFIX = "vllm:"
# vLLM's tags that a wake_up naming other tags leaves asleep (vllm/device_allocator/__init__.py); a wake_up
# wakes every other tag.
DEFERRABLE_TAGS = ("weights", "kv_cache")
# The tag of the memory of CUDA graphs captured into cudagraph_pool(), as vLLM's.
_GRAPH_TAG = "cudagraph"
# vLLM's module says whether its allocator can be used; cuvmm's always can once installed.
cumem_available = True


class CuMemAllocator:
    """vLLM's sleep-mode allocator: a singleton (:meth:`get_instance`) whose memory allocated inside
    :meth:`use_memory_pool` can be offloaded or discarded by :meth:`sleep` and brought back by
    :meth:`wake_up`."""

    instance = None
    default_tag = "default"

    @staticmethod
    def get_instance():
        """The allocator (a singleton, as vLLM's)."""
        if CuMemAllocator.instance is None:
            CuMemAllocator.instance = CuMemAllocator()
        return CuMemAllocator.instance

    def __init__(self):
        self.current_tag = CuMemAllocator.default_tag
        self._lock = threading.Lock()
        # the vLLM tags used
        self._tags = set()
        # the pool cudagraph_pool() yields, made at its first use
        self._graph_pool = None

    @contextlib.contextmanager
    def use_memory_pool(self, tag=None):
        """Allocations made inside are under ``tag`` (the default tag for None)."""
        if tag is None:
            tag = CuMemAllocator.default_tag
        assert isinstance(tag, str)
        _cuvmm._ensure_installed("vLLM's CuMemAllocator.use_memory_pool")
        with self._lock:
            self._tags.add(tag)
        old_tag, self.current_tag = self.current_tag, tag
        try:
            with _cuvmm.region(_PREFIX + tag):
                yield
        finally:
            self.current_tag = old_tag

    def _known(self, tags=None):
        """The tags used (those of ``tags``, every one for None), with the devices where they have memory."""
        with self._lock:
            known = sorted(tag for tag in self._tags if tags is None or tag in tags)
        return [(tag, _cuvmm._tag_devices(_PREFIX + tag)) for tag in known]

    def sleep(self, offload_tags=None):
        """Every tag's memory is given back: the bytes of ``offload_tags`` (the default tag for None) are
        kept on the host, the others' discarded."""
        if offload_tags is None:
            offload_tags = (CuMemAllocator.default_tag,)
        elif isinstance(offload_tags, str):
            offload_tags = (offload_tags,)
        assert isinstance(offload_tags, tuple)
        known = self._known()
        try:
            _cuvmm._each(functools.partial(_cuvmm.sleep, _PREFIX + tag, keep=tag in offload_tags, device=device)
                         for tag, devices in known for device in devices)
        finally:
            gc.collect()
            for device in sorted({d for _, devices in known for d in devices}):
                _cuvmm.empty_cache(device)

    def prepare_sleep(self, offload_tags=None):
        """cuvmm's own, not vLLM's: pins now the page-locked memory the first :meth:`sleep` with the same
        ``offload_tags`` copies their bytes into, so that sleep pins nothing and copies at the link's speed
        (``cuvmm_torch.prepare_sleep``). Call it once the weights are loaded, never during a CUDA graph
        capture. Returns the bytes pinned."""
        if offload_tags is None:
            offload_tags = (CuMemAllocator.default_tag,)
        elif isinstance(offload_tags, str):
            offload_tags = (offload_tags,)
        return sum(_cuvmm.prepare_sleep(_PREFIX + tag, device=device)
                   for tag, devices in self._known(offload_tags) for device in devices)

    def discard(self, tags):
        """Gives back the memory of ``tags`` (a tag or a tuple of them) without keeping its bytes; a tag
        already asleep stays as it sleeps."""
        if isinstance(tags, str):
            tags = (tags,)
        _cuvmm._each(functools.partial(_cuvmm.sleep, _PREFIX + tag, keep=False, device=device)
                     for tag, devices in self._known(tags) for device in devices)

    def wake_up(self, tags=None):
        """Maps the memory of ``tags`` again (every tag for None; when tags are named, every tag but the
        deferrable ``weights`` and ``kv_cache`` too, as vLLM's): what was offloaded has its bytes back, the
        rest is memory with no bytes kept."""
        _cuvmm._each(functools.partial(_cuvmm.wake, _PREFIX + tag, device=device)
                     for tag, devices in self._known()
                     if tags is None or tag in tags or tag not in DEFERRABLE_TAGS
                     for device in devices)

    @contextlib.contextmanager
    def cudagraph_pool(self):
        """Yields the pool to capture CUDA graphs into (``torch.cuda.graph(g, pool=...)``), the same one at
        each use, as vLLM's: the memory the graphs allocate is under the tag ``cudagraph``, which sleeps (its
        bytes discarded unless offloaded) and wakes with the others."""
        import torch  # noqa: PLC0415 (only graphs need PyTorch here)

        with self.use_memory_pool(_GRAPH_TAG):
            if self._graph_pool is None:
                self._graph_pool = torch.cuda.graph_pool_handle()
            yield self._graph_pool

    def release_pools(self):
        """vLLM's drops its pools before the interpreter ends; cuvmm's tags hold no Python objects to drop."""

    close = release_pools

    def get_current_usage(self):
        """Bytes of the live tensors in the allocator's tags, on every device where they have memory."""
        known = self._known()
        names = {_PREFIX + tag for tag, _ in known}
        devices = sorted({d for _, devices in known for d in devices})
        return sum(t["live_bytes"] for device in devices for t in _cuvmm.tags(device) if t["name"] in names)
