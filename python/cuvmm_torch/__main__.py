"""Runs a program with cuvmm as PyTorch's CUDA allocator, with no change to the program::

    python -m cuvmm_torch SCRIPT.py [ARGS...]     as `python SCRIPT.py ARGS...`
    python -m cuvmm_torch -m MODULE [ARGS...]     as `python -m MODULE ARGS...`
    python -m cuvmm_torch build                   builds the C++ layer ahead of time (it is cached)
    torchrun --nproc-per-node=N -m cuvmm_torch SCRIPT.py [ARGS...]   every rank

cuvmm is installed (:func:`cuvmm_torch.install`) before the program runs, so before its first CUDA
allocation; installing touches no device (each torchrun rank allocates on the device its script picks). The
program then runs as the interpreter would run it: ``sys.argv``, ``__name__ == "__main__"``, ``__file__``
and ``sys.path[0]`` are the script's (``runpy``). ``CUVMM_ALLOC_CONF`` configures cuvmm as
``PYTORCH_CUDA_ALLOC_CONF`` configures PyTorch's allocator; ``CUVMM_TORCH_AUTOINSTALL=1`` is set for the
processes the program starts (see :mod:`cuvmm_torch.autoinstall`). If cuvmm cannot be installed, nothing
runs: status 1 and one line on stderr saying why (a mistake on the command line: status 2).
"""

import os
import runpy
import sys
import zipfile

USAGE = """usage: python -m cuvmm_torch SCRIPT.py [ARGS...]   run a script with cuvmm as PyTorch's CUDA allocator
       python -m cuvmm_torch -m MODULE [ARGS...]    the same for a module
       python -m cuvmm_torch build                  build the C++ layer ahead of time"""


def install():
    """Installs cuvmm into PyTorch, or ends the process with status 1 and the reason."""
    import cuvmm_torch  # noqa: PLC0415
    from cuvmm_torch import autoinstall  # noqa: PLC0415

    try:
        import torch  # noqa: F401, PLC0415
    except ImportError as error:
        sys.exit(f"cuvmm_torch: PyTorch is not importable ({error}): nothing to install cuvmm into")
    try:
        cuvmm_torch.install()
    except Exception as error:  # noqa: BLE001 (the program must not run without the allocator it asked for)
        sys.exit(f"cuvmm_torch: cuvmm could not be installed as PyTorch's CUDA allocator: "
                 f"{cuvmm_torch._summary(error)}")
    os.environ[autoinstall.VARIABLE] = "1"


def usage_error(message):
    """A mistake on the command line: status 2, as python's own."""
    print(f"cuvmm_torch: {message}", file=sys.stderr)
    sys.exit(2)


def run_script(path, args):
    if not os.path.exists(path):
        usage_error(f"can't open file {path!r}: no such file")
    install()
    sys.argv = [path, *args]
    plain_file = os.path.isfile(path) and not zipfile.is_zipfile(path)
    if not sys.flags.safe_path and sys.path:
        # `python -m cuvmm_torch` put the working directory first; `python SCRIPT.py` puts the script's
        # directory (runpy adds a directory or zip archive itself).
        if plain_file:
            sys.path[0] = os.path.dirname(os.path.realpath(path))
        else:
            del sys.path[0]
    runpy.run_path(path, run_name="__main__")


def run_module(name, args):
    install()
    sys.argv = [name, *args]  # runpy puts the module's file first, as `python -m` does
    runpy.run_module(name, run_name="__main__", alter_sys=True)


def build():
    from cuvmm_torch import build_extension  # noqa: PLC0415

    extension = build_extension(verbose=True)
    print(f"built {extension.__file__}")


def main(argv):
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE, file=sys.stdout if argv else sys.stderr)
        sys.exit(0 if argv else 2)
    if argv == ["build"]:
        build()
    elif argv[0] == "-m":
        if len(argv) < 2:
            usage_error(f"-m needs a module name\n{USAGE}")
        run_module(argv[1], argv[2:])
    elif argv[0].startswith("-"):
        usage_error(f"unknown option {argv[0]}\n{USAGE}")
    else:
        run_script(argv[0], argv[1:])


if __name__ == "__main__":
    main(sys.argv[1:])
