"""``CUVMM_TORCH_AUTOINSTALL=1``: cuvmm becomes PyTorch's CUDA allocator as soon as a program imports torch,
with no change to the program.

The wheel puts ``cuvmm_torch_autoinstall.pth`` in site-packages; the interpreter runs its one line at
start-up, and that line imports this module only when the variable is set to something other than ``0``
(unset, nothing is imported: not this package, not torch). :func:`arm` then waits for ``import torch`` (a
finder on ``sys.meta_path`` that steps aside once torch is imported), and right after torch's own
``__init__`` has run, calls :func:`cuvmm_torch.install`, before the program can allocate CUDA memory. A process that
never imports torch pays for nothing more.

A failure (the library missing, a PyTorch without CUDA, an allocator already in use) does not stop the
program: it is written to stderr, one line naming what is missing, and PyTorch keeps its own allocator.
``python -m cuvmm_torch SCRIPT.py`` sets the variable for the processes a script starts, so that a
DataLoader's or ``torch.multiprocessing``'s spawned workers use cuvmm too.
"""

import os
import sys

VARIABLE = "CUVMM_TORCH_AUTOINSTALL"
PREFIX = "cuvmm_torch: "


def _say(message):
    sys.stderr.write(f"{PREFIX}{message}\n")
    sys.stderr.flush()


def install_now():
    """Installs cuvmm into the torch this process imported; a failure is told on stderr, not raised.
    Returns the layer in place (``"cpp"`` or ``"ctypes"``), or None."""
    import cuvmm_torch  # noqa: PLC0415 (imported only when the variable is set)

    try:
        return cuvmm_torch.install()
    except Exception as error:  # noqa: BLE001 (whatever it is, the program goes on with PyTorch's allocator)
        _say(f"{VARIABLE} is set, but cuvmm was not installed ({cuvmm_torch._summary(error)}); PyTorch's own "
             "CUDA allocator is in use")
        return None


class _AfterTorch:
    """A meta path finder that lets the others find ``torch``, and makes the loader it returns install cuvmm
    once torch's ``__init__`` has run. It stays on ``sys.meta_path`` until then: a lookup that only asks
    whether torch is there (``importlib.util.find_spec("torch")``, as transformers' ``is_torch_available``
    does) loads nothing, and the import that follows must still find it."""

    def find_spec(self, name, path=None, target=None):
        if name != "torch":
            return None
        # The other finders, asked directly: through importlib.util.find_spec this one would ask itself.
        spec = None
        for finder in list(sys.meta_path):
            find = getattr(finder, "find_spec", None)
            if finder is not self and find is not None:
                spec = find(name, path, target)
                if spec is not None:
                    break
        loader = getattr(spec, "loader", None)
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        run_torch_init = loader.exec_module
        finder = self

        def exec_module(module):
            # On this spec's loader instance only, and removed again: torch's spec and loader stay what they
            # were.
            vars(loader).pop("exec_module", None)
            run_torch_init(module)
            if finder in sys.meta_path:
                sys.meta_path.remove(finder)
            install_now()

        try:
            loader.exec_module = exec_module
        except (AttributeError, TypeError):  # a loader that takes no attribute: torch imports without cuvmm
            _say(f"{VARIABLE} is set, but torch's loader ({type(loader).__name__}) cannot be hooked: nothing "
                 "installed")
        return spec


def arm(environ=None):
    """What the ``.pth`` line calls when ``CUVMM_TORCH_AUTOINSTALL`` is set: installs cuvmm when torch is
    imported (at once if it already is). A value other than ``1`` (or ``0``, which the line skips) is told
    on stderr and does nothing. Returns whether it armed."""
    value = (os.environ if environ is None else environ).get(VARIABLE, "")
    if value in ("", "0"):
        return False
    if value != "1":
        _say(f"{VARIABLE}={value!r} is not understood (1 installs cuvmm when torch is imported, 0 or unset does "
             "nothing): nothing installed")
        return False
    if "torch" in sys.modules:
        install_now()
    elif not any(isinstance(finder, _AfterTorch) for finder in sys.meta_path):
        sys.meta_path.insert(0, _AfterTorch())
    return True


def disarm():
    """Takes :func:`arm`'s finder off ``sys.meta_path``: for ``python -m cuvmm_torch``, which installs cuvmm
    itself and says so when it cannot (once, and as an error)."""
    sys.meta_path[:] = [finder for finder in sys.meta_path if not isinstance(finder, _AfterTorch)]
