"""Tests of running a program under cuvmm with no change to it, without PyTorch or a GPU: ``python -m
cuvmm_torch SCRIPT.py ARGS`` (and ``-m MODULE``, and ``build``), and ``CUVMM_TORCH_AUTOINSTALL=1`` (the
wheel's ``.pth`` hook), each in a fresh interpreter with a stand-in ``torch`` package that records what
cuvmm_torch.install() does to it and when. ``test_cpp_layer.py`` runs the same against a real PyTorch
(and under torchrun).

    python3 -m unittest discover -s python -p test_run.py -v

With ``CUVMM_TORCH_TEST_INSTALLED=1`` (``tools/wheel_check.sh``) they run against the installed package: its
``.pth`` file runs at start-up as the interpreter runs it, rather than its line being run by the test.
"""

import json
import os
import subprocess
import sys
import sysconfig
import tempfile
import textwrap
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
INSTALLED = os.environ.get("CUVMM_TORCH_TEST_INSTALLED") == "1"
PTH = "cuvmm_torch_autoinstall.pth"
VARIABLE = "CUVMM_TORCH_AUTOINSTALL"

# A stand-in for PyTorch: what install() touches (the C++ layer's build and install, or the pluggable
# allocator), each call appended to `torch.events`, and a note that torch was imported.
FAKE_TORCH = {
    "torch/__init__.py": """
        import os, sys, types
        if os.environ.get("FAKE_TORCH_BROKEN"):
            raise ImportError("this torch is broken on purpose")
        events = [["imported"]]
        __version__ = "2.11.0+fake"
        def _pluggable(path, malloc, free):
            events.append(["pluggable", os.path.basename(path), malloc, free])
            return "allocator"
        def _swap(what):
            # PyTorch's refusal once its allocator has served (FAKE_TORCH_USED: a CUDA call came first).
            if os.environ.get("FAKE_TORCH_USED"):
                raise RuntimeError("Can't swap an already initialized allocator")
            events.append(what)
        cuda = types.ModuleType("torch.cuda")
        cuda.memory = types.SimpleNamespace(
            CUDAPluggableAllocator=_pluggable,
            change_current_allocator=lambda allocator: _swap(["changed", allocator]))
        cuda.is_initialized = lambda: False
        cuda.is_available = lambda: True
        sys.modules["torch.cuda"] = cuda
    """,
    "torch/utils/__init__.py": "",
    "torch/utils/cpp_extension.py": """
        import os, types, torch
        CUDA_HOME = os.environ["FAKE_CUDA_HOME"]
        def load(name, sources, build_directory, **options):
            torch.events.append(["built", name, [os.path.basename(s) for s in sources]])
            return types.SimpleNamespace(
                __file__=os.path.join(build_directory, name + ".so"),
                install=lambda path: torch._swap(["cpp installed", os.path.basename(path)]))
    """,
}

# Prints, as JSON, what a script sees of itself and of torch when it starts.
REPORT = """
    import json, os, sys, torch
    print(json.dumps({"argv": sys.argv, "name": __name__, "file": __file__, "path0": sys.path[0],
                      "events": list(torch.events), "variable": os.environ.get("CUVMM_TORCH_AUTOINSTALL")}))
"""


def write_files(root, files):
    for name, text in files.items():
        path = os.path.join(root, name)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as file:
            file.write(textwrap.dedent(text))


def pth_line():
    """The line the interpreter runs at start-up: the installed file's, or the checkout's."""
    path = os.path.join(sysconfig.get_path("purelib"), PTH) if INSTALLED else os.path.join(HERE, PTH)
    with open(path) as file:
        (line,) = file.read().splitlines()
    return line


class Stand(unittest.TestCase):
    """A scratch folder with the stand-in torch, a CUDA toolkit's two headers, and a library of the right
    name (install() loads it with ctypes: the real one, which loads without a GPU)."""

    def setUp(self):
        self.scratch = tempfile.TemporaryDirectory()
        self.dir = self.scratch.name
        write_files(self.dir, FAKE_TORCH)
        self.toolkit = os.path.join(self.dir, "toolkit")
        for header in ("include/cuda_runtime_api.h", "include/crt/host_config.h"):
            os.makedirs(os.path.dirname(os.path.join(self.toolkit, header)), exist_ok=True)
            open(os.path.join(self.toolkit, header), "w").close()
        os.makedirs(os.path.join(self.toolkit, "lib64"))

    def tearDown(self):
        self.scratch.cleanup()

    def run_python(self, *args, code=None, cwd=None, **env):
        """Runs the interpreter in a fresh environment: the stand-in torch first on the path, then (from a
        checkout) the checkout's cuvmm_torch."""
        environment = {k: v for k, v in os.environ.items()
                       if not k.startswith(("CUVMM_", "FAKE_")) and k != "PYTHONPATH"}
        paths = [self.dir] + ([] if INSTALLED else [HERE])
        environment.update(PYTHONPATH=os.pathsep.join(paths), FAKE_CUDA_HOME=self.toolkit,
                           CUVMM_TORCH_BUILD=os.path.join(self.dir, "build"), CUVMM_BACKEND="sim")
        if not INSTALLED and "CUVMM_TORCH_LIB" in os.environ:
            environment["CUVMM_TORCH_LIB"] = os.environ["CUVMM_TORCH_LIB"]
        environment.update(env)
        command = [sys.executable, *(["-c", code] if code is not None else args)]
        done = subprocess.run(command, env=environment, cwd=cwd or self.dir, capture_output=True, text=True,
                              timeout=120, check=False)
        return done.returncode, done.stdout, done.stderr

    def report(self, *args, **env):
        status, out, err = self.run_python(*args, **env)
        self.assertEqual(status, 0, err)
        return json.loads(out.strip().splitlines()[-1])


CPP_INSTALLED = [["imported"], ["built", "cuvmm_torch_ext", ["cuvmm_allocator.cpp"]],
                 ["cpp installed", "libcuvmm_torch.so"]]


class RunAScript(Stand):
    def script(self, text, name="train.py", folder="scripts"):
        path = os.path.join(self.dir, folder, name)
        write_files(self.dir, {os.path.join(folder, name): text})
        return path

    def test_it_runs_as_python_runs_it_with_cuvmm_installed_before_its_first_line(self):
        path = self.script(REPORT)
        seen = self.report("-m", "cuvmm_torch", path, "--lr", "3e-4", "data dir")
        self.assertEqual(seen["argv"], [path, "--lr", "3e-4", "data dir"])
        self.assertEqual((seen["name"], seen["file"]), ("__main__", path))
        self.assertEqual(seen["path0"], os.path.dirname(os.path.realpath(path)), "the script's folder, as python's")
        self.assertEqual(seen["events"], CPP_INSTALLED, "installed through the C++ layer before the script ran")
        self.assertEqual(seen["variable"], "1", "the processes it starts install cuvmm too")

    def test_it_imports_modules_beside_it_as_python_does(self):
        self.script("import helper\nprint(helper.VALUE)\n")
        self.script("VALUE = 'beside'\n", name="helper.py")
        status, out, err = self.run_python("-m", "cuvmm_torch", os.path.join("scripts", "train.py"))
        self.assertEqual((status, out.strip()), (0, "beside"), err)

    def test_its_status_and_exceptions_are_the_scripts(self):
        status, _, _ = self.run_python("-m", "cuvmm_torch", self.script("import sys\nsys.exit(3)\n"))
        self.assertEqual(status, 3)
        status, _, err = self.run_python("-m", "cuvmm_torch", self.script("raise ValueError('bad batch')\n"))
        self.assertEqual(status, 1)
        self.assertIn("ValueError: bad batch", err)

    def test_a_module_runs_as_python_m_runs_it(self):
        write_files(self.dir, {"trainer/__init__.py": "", "trainer/__main__.py": REPORT})
        seen = self.report("-m", "cuvmm_torch", "-m", "trainer", "--epochs", "2")
        self.assertEqual(seen["argv"], [os.path.join(self.dir, "trainer", "__main__.py"), "--epochs", "2"])
        self.assertEqual(seen["name"], "__main__")
        self.assertEqual(seen["events"], CPP_INSTALLED)

    def test_the_ctypes_path_when_the_cpp_layer_is_turned_off(self):
        seen = self.report("-m", "cuvmm_torch", self.script(REPORT), CUVMM_TORCH_CPP="0")
        self.assertEqual(seen["events"], [["imported"], ["pluggable", "libcuvmm_torch.so", "cuvmm_malloc", "cuvmm_free"],
                                          ["changed", "allocator"]])

    def test_a_script_that_installs_cuvmm_itself_is_not_refused(self):
        path = self.script("import cuvmm_torch, torch\nprint(cuvmm_torch.install(), len(torch.events))\n")
        status, out, err = self.run_python("-m", "cuvmm_torch", path)
        self.assertEqual((status, out.strip()), (0, "cpp 3"), err)

    def test_installing_after_pytorchs_allocator_served_is_refused_in_words_with_no_fallback(self):
        for cpp in ("", "0"):
            status, _, err = self.run_python(code="import cuvmm_torch\ncuvmm_torch.install()\n", FAKE_TORCH_USED="1",
                                             CUVMM_TORCH_CPP=cpp)
            self.assertEqual(status, 1, cpp)
            self.assertIn("cuvmm_torch.install() came too late", err)
            self.assertNotIn("the C++ layer is not in use", err, "no fallback to a path refused the same way")

    def test_the_frameworks_first_region_installs_cuvmm_or_says_why_not(self):
        code = ("import torch, cuvmm_torch\nfrom cuvmm_torch.memory_saver import torch_memory_saver as tms\n"
                "with tms.region(tag='kv'):\n    pass\nprint(torch.events, cuvmm_torch.active_layer())\n")
        status, out, err = self.run_python(code=code)
        self.assertEqual((status, out.strip()), (0, f"{CPP_INSTALLED} cpp"), err)
        status, _, err = self.run_python(code=code, FAKE_TORCH_USED="1")
        self.assertEqual(status, 1)
        self.assertIn("CuvmmError: torch_memory_saver's region over cuvmm needs cuvmm as PyTorch's CUDA allocator", err)
        self.assertIn("came too late", err)

    def test_nothing_runs_when_cuvmm_cannot_be_installed(self):
        marker = os.path.join(self.dir, "ran")
        path = self.script(f"open({marker!r}, 'w').close()\n")
        status, _, err = self.run_python("-m", "cuvmm_torch", path, FAKE_TORCH_BROKEN="1")
        self.assertEqual(status, 1)
        self.assertIn("PyTorch is not importable (this torch is broken on purpose)", err)
        status, _, err = self.run_python("-m", "cuvmm_torch", path,
                                         CUVMM_TORCH_LIB=os.path.join(self.dir, "missing", "libcuvmm_torch.so"))
        self.assertEqual(status, 1)
        self.assertIn("cuvmm could not be installed as PyTorch's CUDA allocator: OSError", err)
        self.assertFalse(os.path.exists(marker), "the script did not run")

    def test_usage_and_mistakes(self):
        status, out, _ = self.run_python("-m", "cuvmm_torch", "--help")
        self.assertEqual(status, 0)
        self.assertIn("python -m cuvmm_torch SCRIPT.py [ARGS...]", out)
        for args, message in [([], "usage:"), (["-m"], "-m needs a module name"),
                              (["--frobnicate"], "unknown option --frobnicate"),
                              (["no_such_script.py"], "can't open file 'no_such_script.py'")]:
            status, _, err = self.run_python("-m", "cuvmm_torch", *args)
            self.assertEqual(status, 2, args)
            self.assertIn(message, err)

    def test_it_runs_in_the_processs_own_main_module(self):
        # What pickle and multiprocessing look up by module name, during the script and after its last line
        # (an atexit function, a pool's feeder thread): the process's `__main__` holds the script's globals,
        # and none of the runner's.
        path = self.script("""
            import atexit, pickle, sys
            def work():
                return 7
            def at_exit():
                print(pickle.loads(pickle.dumps(work))(), flush=True)
            atexit.register(at_exit)
            print(globals() is sys.modules["__main__"].__dict__, "USAGE" in globals(), __file__, flush=True)
        """)
        status, out, err = self.run_python("-m", "cuvmm_torch", os.path.relpath(path, self.dir))
        self.assertEqual((status, out.splitlines()), (0, [f"True False {path}", "7"]), err)

    def test_a_directory_or_archive_runs_as_python_runs_it(self):
        write_files(self.dir, {"app/__main__.py": REPORT})
        app = os.path.join(self.dir, "app")
        seen = self.report("-m", "cuvmm_torch", app, "--fast")
        self.assertEqual((seen["argv"], seen["name"], seen["path0"]), ([app, "--fast"], "__main__", app))
        self.assertEqual(seen["events"], CPP_INSTALLED)

    def test_an_autoinstall_variable_set_already_does_not_tell_a_failure_twice(self):
        # The .pth line armed (as the installed wheel's does at start-up), then the runner, whose own
        # install fails: one line, the runner's.
        path = self.script("print('ran')\n")
        code = (f"exec({pth_line()!r})\nimport runpy, sys\nsys.argv = ['cuvmm_torch', {path!r}]\n"
                "runpy.run_module('cuvmm_torch', run_name='__main__', alter_sys=True)\n")
        status, out, err = self.run_python(code=code, CUVMM_TORCH_LIB=os.path.join(self.dir, "missing.so"),
                                           **{VARIABLE: "1"})
        self.assertEqual((status, out), (1, ""))
        (line,) = err.strip().splitlines()
        self.assertIn("cuvmm could not be installed as PyTorch's CUDA allocator: OSError", line)

    def test_a_build_that_fails_says_why_in_one_line(self):
        status, _, err = self.run_python("-m", "cuvmm_torch", "build", FAKE_TORCH_BROKEN="1")
        self.assertEqual(status, 1)
        self.assertEqual(err.strip().splitlines()[-1],
                         "cuvmm_torch: the C++ layer could not be built: ImportError: this torch is broken on purpose")
        self.assertNotIn("Traceback", err)

    def test_build_still_builds_the_cpp_layer(self):
        status, out, err = self.run_python("-m", "cuvmm_torch", "build")
        self.assertEqual(status, 0, err)
        self.assertEqual(out.strip(), f"built {os.path.join(self.dir, 'build', 'cuvmm_torch_ext.so')}")


class AutoInstall(Stand):
    """CUVMM_TORCH_AUTOINSTALL: the .pth line the interpreter runs at start-up."""

    def probe(self, code, **env):
        """Runs `code` after the .pth line, as the interpreter runs it at start-up (the installed package's
        own file, or the checkout's line run first); returns status, stdout, stderr."""
        prelude = "" if INSTALLED else f"exec({pth_line()!r})\n"
        return self.run_python(code=prelude + textwrap.dedent(code), **env)

    def test_unset_or_0_it_imports_nothing(self):
        for env in ({}, {VARIABLE: "0"}, {VARIABLE: ""}):
            status, out, err = self.probe("import sys; print('cuvmm_torch' in sys.modules, 'torch' in sys.modules)\n",
                                          **env)
            self.assertEqual((status, out.strip(), err), (0, "False False", ""), env)

    def test_set_cuvmm_is_installed_right_after_torch_is_imported(self):
        status, out, err = self.probe("""
            import sys
            before = ["torch" in sys.modules, "cuvmm_torch" in sys.modules]
            import torch, cuvmm_torch
            print(before, torch.events, cuvmm_torch.active_layer())
        """, **{VARIABLE: "1"})
        self.assertEqual(status, 0, err)
        self.assertEqual(out.strip(), f"[False, True] {CPP_INSTALLED} cpp")

    def test_asking_whether_torch_is_there_first_does_not_use_the_hook_up(self):
        # transformers' is_torch_available() looks torch up with find_spec before anything imports it.
        status, out, err = self.probe("""
            import importlib.util
            found = importlib.util.find_spec("torch") is not None
            import torch, cuvmm_torch
            print(found, torch.events, cuvmm_torch.active_layer())
        """, **{VARIABLE: "1"})
        self.assertEqual((status, out.strip()), (0, f"True {CPP_INSTALLED} cpp"), err)

    def test_torch_stays_torch(self):
        status, out, err = self.probe("""
            import sys, torch, importlib.machinery
            print(type(torch.__spec__.loader).__name__, "exec_module" in vars(torch.__spec__.loader),
                  [type(f).__name__ for f in sys.meta_path if "AfterTorch" in type(f).__name__])
        """, **{VARIABLE: "1"})
        self.assertEqual((status, out.strip()), (0, "SourceFileLoader False []"), err)

    def test_a_failure_is_told_on_stderr_and_the_program_goes_on(self):
        status, out, err = self.probe("import torch\nprint('still running', torch.events)\n",
                                      CUVMM_TORCH_LIB=os.path.join(self.dir, "missing.so"), **{VARIABLE: "1"})
        self.assertEqual((status, out.strip()), (0, "still running [['imported']]"), err)
        (line,) = err.strip().splitlines()
        self.assertTrue(line.startswith("cuvmm_torch: CUVMM_TORCH_AUTOINSTALL is set, but cuvmm was not installed "
                                        "(OSError: "), line)
        self.assertTrue(line.endswith("PyTorch's own CUDA allocator is in use"), line)

    def test_a_value_it_does_not_understand_is_told_and_does_nothing(self):
        status, out, err = self.probe("import torch\nprint(torch.events)\n", **{VARIABLE: "yes"})
        self.assertEqual((status, out.strip()), (0, "[['imported']]"))
        self.assertIn("CUVMM_TORCH_AUTOINSTALL='yes' is not understood", err)

    def test_a_program_without_torch_is_untouched(self):
        status, out, err = self.probe("import json\nprint('ok')\n", FAKE_TORCH_BROKEN="1", **{VARIABLE: "1"})
        self.assertEqual((status, out.strip(), err), (0, "ok", ""))


@unittest.skipUnless(INSTALLED, "CUVMM_TORCH_TEST_INSTALLED=1 tests an installed copy (tools/wheel_check.sh)")
class InstalledHook(unittest.TestCase):
    def test_the_pth_file_is_in_site_packages_and_is_the_checkouts(self):
        with open(os.path.join(HERE, PTH)) as file:
            self.assertEqual(pth_line(), file.read().strip())


if __name__ == "__main__":
    unittest.main()
