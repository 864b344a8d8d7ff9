"""torch_memory_saver's API over cuvmm's tags: code that imports ``torch_memory_saver`` (SGLang, verl,
slime) switches by changing its import, ``import cuvmm_torch.memory_saver as torch_memory_saver`` for
``import torch_memory_saver`` (the module, with ``torch_memory_saver.torch_memory_saver`` and
``configure_subprocess`` in it, as torch_memory_saver's)::

    from cuvmm_torch.memory_saver import torch_memory_saver

    with torch_memory_saver.region(tag="kv_cache"):
        kv = torch.empty(..., device="cuda")
    with torch_memory_saver.region(tag="weights", enable_cpu_backup=True):
        model = build_model()
    torch_memory_saver.pause("kv_cache")      # or pause(): every tag
    ...
    torch_memory_saver.resume("kv_cache")

cuvmm must be PyTorch's allocator: the first ``region`` of a program that imported torch installs it
(``cuvmm_torch.install()``) if nothing did before, and raises if it can no longer be (a CUDA call came
first); there is no ``LD_PRELOAD`` and no ``MemPool`` of its own. Each call is a thin function over cuvmm's
tags: a region is ``cuvmm_torch.region``, ``pause`` is ``cuvmm_torch.sleep``, ``resume`` is
``cuvmm_torch.wake``, on every device where the tag has memory. A torch_memory_saver tag made with
``enable_cpu_backup=True`` and without are two cuvmm tags (``tms-backup:TAG`` and ``tms:TAG``), so that
``pause(TAG)`` keeps the bytes of the first and drops the second's, as torch_memory_saver does per
allocation. Every ``TorchMemorySaver()`` drives the same tags, as each of torch_memory_saver's drives its one
process-wide state. A pause or resume goes on through every tag when one is refused (a CUDA graph capture
underway, say), then raises the first error; torch_memory_saver ends the process there.

What differs, or cannot apply:

- ``hook_mode`` ("preload" or "torch") is accepted and changes nothing: cuvmm is the allocator already.
- ``cpu_backup_backend``: cuvmm keeps bytes in page-locked memory; ``"mmap"`` is served by it too.
- ``prepare_pause(tag)`` is cuvmm's own: it pins the memory the first pause copies into ahead of it, so
  that the first pause pins nothing (torch_memory_saver pins at the first pause).
- ``retain_cpu_backup`` is True unless set False, or ``TMS_RETAIN_CPU_BACKUP`` says false at import
  (torch_memory_saver's default is False): cuvmm keeps a tag's page-locked memory across cycles, so a second
  pause pins nothing. Set False, each later resume frees it (as torch_memory_saver's, not at once).
- ``enable_disk_backup`` and ``set_disk_backup_dir`` are not offered (``NotImplementedError``): cuvmm keeps
  no bytes on disk.
- ``get_cpu_backup(x, zero_copy)`` returns a copy whatever ``zero_copy`` says (cuvmm's host memory is in
  pieces, not a buffer per tensor), the caller's to keep; ``None`` once the tag is resumed, whether or not
  the backup is retained (the tensor holds the bytes then, and they may have changed since).
- ``memory_margin_bytes`` (set only, as torch_memory_saver's) keeps that much of the device free, as
  ``cuvmm_torch.set_device_margin``: for every allocation of the process, where torch_memory_saver keeps it
  for those inside a region; a resume is exempt in both.
- ``cuda_graph`` works in either hook mode: the graph's private pool's memory is allocated under the tag
  and sleeps and wakes with it; do not replay the graph while the tag is paused.
- Allocating under a paused tag is refused (cuvmm's ``TagAsleep``: its addresses are reserved, its memory is
  given back); torch_memory_saver allocates such memory, which stays mapped through the pause.
- ``configure_subprocess`` sets ``CUVMM_TORCH_AUTOINSTALL=1`` (where torch_memory_saver sets ``LD_PRELOAD``),
  so that a process started inside it installs cuvmm when it imports torch.
"""

import contextlib
import functools
import os
import threading

import cuvmm_torch as _cuvmm

__all__ = ["TorchMemorySaver", "torch_memory_saver", "configure_subprocess"]

_TAG_DEFAULT = "default"
# Two prefixes, so that no torch_memory_saver tag of one kind is named as a tag of the other.
_PREFIX = "tms:"
_PREFIX_BACKUP = "tms-backup:"


def _retain_default():
    """``TMS_RETAIN_CPU_BACKUP`` as torch_memory_saver reads it, True (cuvmm's default) unless it says false."""
    return os.environ.get("TMS_RETAIN_CPU_BACKUP") not in ("0", "false", "FALSE", "no", "NO")


class TorchMemorySaver:
    """torch_memory_saver's ``TorchMemorySaver`` over cuvmm's tags (use the module's
    :data:`torch_memory_saver`). The tags and the retention policy are the class's, shared by every
    instance, as torch_memory_saver's are its process-wide library's."""

    _lock = threading.Lock()
    # cuvmm tag -> whether its bytes are kept at a pause
    _tags = {}
    _retain = _retain_default()
    # torch_memory_saver's own implementation object, made at its first use; code that looks at it (slime
    # does) finds none, and _ensure_initialized has nothing to make.
    _impl = None

    def __init__(self):
        self._hook_mode = "preload"

    def _ensure_initialized(self):
        """torch_memory_saver loads its library here; cuvmm's is loaded by its first call."""

    @staticmethod
    def _name(tag, backup):
        if not isinstance(tag, str):
            raise TypeError(f"tag must be a string, not {tag!r}")
        return f"{_PREFIX_BACKUP if backup else _PREFIX}{tag}"

    def _named(self, tag):
        """The cuvmm tags of torch_memory_saver tag ``tag`` (every tag's for None or "", as
        torch_memory_saver's), with whether their bytes are kept and the devices where they have memory."""
        with self._lock:
            items = list(self._tags.items())
        if tag:
            names = (self._name(tag, False), self._name(tag, True))
            items = [(name, backup) for name, backup in items if name in names]
        return [(name, backup, _cuvmm._tag_devices(name)) for name, backup in items]

    @contextlib.contextmanager
    def region(self, tag=_TAG_DEFAULT, enable_cpu_backup=False, enable_disk_backup=False,
               cpu_backup_backend=None):
        """Allocations made inside are under ``tag``: :meth:`pause` gives their memory back, keeping their
        bytes if ``enable_cpu_backup``, and :meth:`resume` maps it again at the same addresses."""
        if enable_disk_backup:
            raise NotImplementedError("cuvmm keeps a paused tag's bytes in page-locked host memory, not on disk: "
                                      "use enable_cpu_backup=True")
        if cpu_backup_backend is not None and not enable_cpu_backup:
            raise ValueError("cpu_backup_backend requires enable_cpu_backup=True")
        if cpu_backup_backend not in (None, "pinned", "mmap"):
            raise ValueError(f"cpu_backup_backend: {cpu_backup_backend!r} is not 'pinned' or 'mmap'")
        name = self._name(tag, enable_cpu_backup)
        _cuvmm._ensure_installed("torch_memory_saver's region")
        with self._lock:
            self._tags[name] = enable_cpu_backup
        with _cuvmm.region(name):
            yield

    @contextlib.contextmanager
    def cuda_graph(self, cuda_graph, pool=None, stream=None, capture_error_mode="global", tag=_TAG_DEFAULT,
                   enable_cpu_backup=False, cpu_backup_backend=None):
        """``torch.cuda.graph`` whose memory (the graph's private pool) is allocated under ``tag``: it is
        paused and resumed with the tag, and the graph replays correctly after the resume."""
        import torch  # noqa: PLC0415 (only graphs need PyTorch here)

        with torch.cuda.graph(cuda_graph, pool=pool, stream=stream, capture_error_mode=capture_error_mode):
            with self.region(tag=tag, enable_cpu_backup=enable_cpu_backup,
                             cpu_backup_backend=cpu_backup_backend):
                yield

    @contextlib.contextmanager
    def disable(self):
        """Allocations made inside are under no tag, inside a region or not."""
        with _cuvmm.region(None):
            yield

    def pause(self, tag=None):
        """Gives back the memory of ``tag`` (of every tag for None), keeping the bytes of what was allocated
        with ``enable_cpu_backup=True``."""
        _cuvmm._each(functools.partial(_cuvmm.sleep, name, keep=backup, device=device)
                     for name, backup, devices in self._named(tag) for device in devices)

    def prepare_pause(self, tag=None):
        """cuvmm's own, not torch_memory_saver's: pins now the page-locked memory the first :meth:`pause` of
        ``tag`` (every tag's for None) copies its backed-up bytes into, so that pause pins nothing and copies
        at the link's speed (``cuvmm_torch.prepare_sleep``). Call it after the ``enable_cpu_backup=True``
        region that loads the weights, never during a CUDA graph capture. Tags without a backup have nothing
        to pin. Returns the bytes pinned."""
        pinned = 0
        for name, backup, devices in self._named(tag):
            if backup:
                pinned += sum(_cuvmm.prepare_sleep(name, device=device) for device in devices)
        return pinned

    def resume(self, tag=None):
        """Maps the memory of ``tag`` (of every tag for None) again at the same addresses, with the bytes
        kept."""
        def wake(name, device):
            _cuvmm.wake(name, device=device)
            if not TorchMemorySaver._retain:
                _cuvmm.release_host_buffers(name, device=device)

        _cuvmm._each(functools.partial(wake, name, device)
                     for name, _, devices in self._named(tag) for device in devices)

    @property
    def enabled(self):
        return True

    @property
    def hook_mode(self):
        return self._hook_mode

    @hook_mode.setter
    def hook_mode(self, hook_mode):
        if hook_mode not in ("preload", "torch"):
            raise ValueError(f"hook_mode: {hook_mode!r} is not 'preload' or 'torch'")
        self._hook_mode = hook_mode

    @property
    def memory_margin_bytes(self):
        raise NotImplementedError("Only setter is supported")

    @memory_margin_bytes.setter
    def memory_margin_bytes(self, value):
        # As torch_memory_saver's, for the whole process; cuvmm keeps it for every allocation.
        _cuvmm.set_device_margin(value)

    @property
    def retain_cpu_backup(self):
        return self._retain

    @retain_cpu_backup.setter
    def retain_cpu_backup(self, value):
        # As torch_memory_saver's: the policy is read at each resume; nothing is freed now.
        TorchMemorySaver._retain = bool(value)

    def get_cpu_backup(self, x, zero_copy=False):
        """The bytes of CUDA tensor ``x`` that its paused tag kept (``enable_cpu_backup=True``), as a new CPU
        tensor of its shape and dtype, read without resuming it; ``None`` where ``x``'s tag is not paused
        (or ``x`` is under no tag): ``x`` itself holds the bytes. Raises where the tag was paused without
        a backup, as torch_memory_saver does. ``zero_copy`` is accepted: the tensor is always a copy, the
        caller's, valid after the resume (cuvmm's host memory is in pieces, not a buffer per tensor)."""
        if not getattr(x, "is_cuda", False):
            raise ValueError(f"get_cpu_backup: a CUDA tensor is needed, not {x!r}")
        if not x.is_contiguous():
            raise ValueError("get_cpu_backup: the tensor must be contiguous")
        out = x.new_empty(x.shape, device="cpu")
        found = _cuvmm._read_kept_into(x.device.index, x.data_ptr(), out.data_ptr(), x.nbytes)
        return out if found else None

    def set_disk_backup_dir(self, path):
        raise NotImplementedError("cuvmm keeps no bytes on disk")


@contextlib.contextmanager
def configure_subprocess():
    """Processes started inside install cuvmm as PyTorch's allocator when they import torch
    (``CUVMM_TORCH_AUTOINSTALL=1`` while inside; torch_memory_saver sets ``LD_PRELOAD`` here), so that their
    regions, pauses and resumes work as this process's."""
    from cuvmm_torch import autoinstall  # noqa: PLC0415

    previous = os.environ.get(autoinstall.VARIABLE)
    os.environ[autoinstall.VARIABLE] = "1"
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(autoinstall.VARIABLE, None)
        else:
            os.environ[autoinstall.VARIABLE] = previous


# The singleton, as torch_memory_saver names it.
torch_memory_saver = TorchMemorySaver()
