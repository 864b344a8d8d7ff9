"""``python3 -m cuvmm_torch build``: builds the C++ layer against the installed PyTorch, once (it is cached;
``install()`` would build it on first use otherwise)."""

import sys

from cuvmm_torch import build_extension


def main(argv):
    if argv != ["build"]:
        sys.exit("usage: python3 -m cuvmm_torch build")
    extension = build_extension(verbose=True)
    print(f"built {extension.__file__}")


if __name__ == "__main__":
    main(sys.argv[1:])
