"""Runs a program with cuvmm as PyTorch's CUDA allocator, with no change to the program::

    python -m cuvmm_torch SCRIPT.py [ARGS...]     as `python SCRIPT.py ARGS...`
    python -m cuvmm_torch -m MODULE [ARGS...]     as `python -m MODULE ARGS...`
    python -m cuvmm_torch build                   builds the C++ layer ahead of time (it is cached)
    torchrun --nproc-per-node=N -m cuvmm_torch SCRIPT.py [ARGS...]   every rank

cuvmm is installed (:func:`cuvmm_torch.install`) before the program runs, so before its first CUDA
allocation; installing touches no device (each torchrun rank allocates on the device its script picks). The
program then runs as the interpreter would run it, in the process's own ``__main__`` module (what pickle and
multiprocessing look up): ``sys.argv``, ``__name__ == "__main__"``, ``__file__`` (absolute) and
``sys.path[0]`` are the script's; a module, a directory or a zip archive runs as ``python -m`` and
``python DIR`` run it. ``CUVMM_ALLOC_CONF`` configures cuvmm as
``PYTORCH_CUDA_ALLOC_CONF`` configures PyTorch's allocator; ``CUVMM_TORCH_AUTOINSTALL=1`` is set for the
processes the program starts (see :mod:`cuvmm_torch.autoinstall`). If cuvmm cannot be installed, nothing
runs: status 1 and one line on stderr saying why (a mistake on the command line: status 2).
"""

import builtins
import importlib.machinery
import io
import os
import pkgutil
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

    # With CUVMM_TORCH_AUTOINSTALL=1 set already, importing torch would try too and tell its own failure.
    autoinstall.disarm()
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


def fresh_main():
    """The process's ``__main__`` module, emptied as the interpreter starts it: the program's globals go
    there, where pickle finds the program's functions and classes by module name. (This file runs as
    ``cuvmm_torch.__main__``, whose globals are its own: see the end of it.)"""
    main = sys.modules["__main__"]
    main.__dict__.clear()
    main.__dict__.update(__name__="__main__", __doc__=None, __package__=None, __loader__=None, __spec__=None,
                         __builtins__=builtins)
    return main.__dict__


def run_script(path, args):
    if not os.path.exists(path):
        usage_error(f"can't open file {path!r}: no such file")
    install()
    sys.argv = [path, *args]
    # -P (Python 3.11 on): no directory of the program's first on sys.path.
    safe_path = getattr(sys.flags, "safe_path", False)
    if os.path.isfile(path) and not zipfile.is_zipfile(path):
        # `python -m cuvmm_torch` put the working directory first; `python SCRIPT.py` puts the script's.
        if not safe_path and sys.path:
            sys.path[0] = os.path.dirname(os.path.realpath(path))
        absolute = os.path.abspath(path)
        with io.open_code(absolute) as source:
            code = pkgutil.read_code(source)  # a .pyc, as python runs one; None for source
        if code is None:
            with io.open_code(absolute) as source:
                code = compile(source.read(), absolute, "exec")
        main_globals = fresh_main()
        main_globals.update(__file__=absolute,
                            __loader__=importlib.machinery.SourceFileLoader("__main__", absolute))
        exec(code, main_globals)  # noqa: S102 (running the user's program is the point)
    else:
        # A directory or zip archive holding __main__.py: first on sys.path, its __main__ run as a module.
        if not safe_path and sys.path:
            sys.path[0] = path
        else:
            sys.path.insert(0, path)
        fresh_main()
        runpy._run_module_as_main("__main__", alter_argv=False)


def run_module(name, args):
    install()
    sys.argv = [name, *args]  # runpy puts the module's file first, as `python -m` does
    fresh_main()
    runpy._run_module_as_main(name, alter_argv=True)


def build():
    from cuvmm_torch import build_extension  # noqa: PLC0415

    try:
        extension = build_extension(verbose=True)
    except Exception as error:  # noqa: BLE001 (the compiler's log is above; the reason in one line)
        import cuvmm_torch  # noqa: PLC0415

        sys.exit(f"cuvmm_torch: the C++ layer could not be built: {cuvmm_torch._summary(error)}")
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
    # As pdb does: the functions above run from the module `cuvmm_torch.__main__`, with globals of their own,
    # so that the process's `__main__` can be emptied and given to the program.
    from cuvmm_torch import __main__ as runner

    runner.main(sys.argv[1:])
