"""Every name a Python file of this repository reads as a global is defined in that file or is a builtin.

Most of the Python here runs only on a GPU machine (tools/gpu/torch_cases, tools/train_gpt.py, ...), where a
helper left behind when a file was split would surface as a NameError in a session with little GPU time. The
compiler's own symbol tables (``symtable``, stdlib) find such names without running anything.

    python3 -m unittest discover -s python -v
"""

import builtins
import os
import subprocess
import symtable
import unittest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODULE_NAMES = {"__file__", "__name__", "__doc__", "__spec__", "__loader__", "__package__", "__path__",
                "__builtins__", "__annotations__"}


def python_files():
    listed = subprocess.run(["git", "ls-files", "*.py"], cwd=ROOT, capture_output=True, text=True, check=False)
    if listed.returncode == 0 and listed.stdout.strip():
        return sorted(listed.stdout.split())
    return sorted(
        os.path.relpath(os.path.join(folder, name), ROOT)
        for top in ("python", "tools")
        for folder, _, names in os.walk(os.path.join(ROOT, top))
        for name in names
        if name.endswith(".py")
    )


def scopes(table):
    yield table
    for child in table.get_children():
        yield from scopes(child)


def undefined_globals(source, filename):
    """``(scope, name)`` for each name read as a global in `source` that nothing in it defines."""
    top = symtable.symtable(source, filename, "exec")
    defined = set(dir(builtins)) | MODULE_NAMES
    defined |= {s.get_name() for s in top.get_symbols() if s.is_assigned() or s.is_imported()}
    for scope in scopes(top):
        if any(s.get_name() == "*" for s in scope.get_symbols()):
            return []  # `from m import *`: the names it brings are not in the source
        defined |= {s.get_name() for s in scope.get_symbols() if s.is_declared_global() and s.is_assigned()}
    return sorted(
        {
            (scope.get_name(), s.get_name())
            for scope in scopes(top)
            for s in scope.get_symbols()
            if s.is_referenced() and (s.is_global() or scope is top) and s.get_name() not in defined
        }
    )


class NamesTest(unittest.TestCase):
    def test_every_global_a_file_reads_is_defined_there(self):
        files = python_files()
        self.assertGreater(len(files), 10, files)
        problems = {}
        for path in files:
            with open(os.path.join(ROOT, path), encoding="utf-8") as source:
                found = undefined_globals(source.read(), path)
            if found:
                problems[path] = found
        self.assertEqual(problems, {}, "names read as globals but defined nowhere in their file")

    def test_it_finds_a_helper_left_in_another_file(self):
        source = "from . import case\n\n\n@case\ndef run(ctx):\n    x = helper(ctx)\n    return x + LIMIT\n"
        self.assertEqual(undefined_globals(source, "cases.py"), [("run", "LIMIT"), ("run", "helper")])

    def test_definitions_of_every_kind_count(self):
        source = (
            "import os\nfrom sys import argv as args\nLIMIT = 3\n"
            "def f():\n    global later\n    later = 1\n    return os, args, LIMIT, len, g, C, __file__\n"
            "def g():\n    return later\n"
            "class C:\n    pass\n"
            "for item in []:\n    pass\n"
            "with open(__file__) as handle:\n    pass\n"
            "print(item, handle)\n"
        )
        self.assertEqual(undefined_globals(source, "ok.py"), [])


if __name__ == "__main__":
    unittest.main()
