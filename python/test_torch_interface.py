"""The C++ layer overrides every virtual method of PyTorch's ``CUDAAllocator`` and of the classes it derives
from (``c10::DeviceAllocator``, ``c10::Allocator``), as the PyTorch it is checked against declares them: a
method PyTorch adds (2.15 added ``attachOomRejectionObserver``, ``allocateWithAddress``, ...) and the layer
leaves to PyTorch's default fails here, by name, before a program meets the default's "does not yet
support" error.

The headers are ``$CUVMM_TORCH_INCLUDE`` (a ``torch/include`` directory, as ``tools/torch_headers.sh``
extracts from a wheel without installing PyTorch), else the installed PyTorch's; without either the test
skips. The layer's source is read with its ``#if TORCH_VERSION_*`` branches resolved for those headers'
version, so a method overridden only for another version counts as missing. No compiler is needed::

    CUVMM_TORCH_INCLUDE=target/torch-headers/2.15.0/torch/include python3 -m unittest python/test_torch_interface.py
"""

import importlib.util
import os
import re
import unittest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAYER = os.path.join(ROOT, "cuvmm-torch", "csrc", "cuvmm_allocator.cpp")
INCLUDE_ENV = "CUVMM_TORCH_INCLUDE"

# (header under torch/include, the class's opening as written there)
CLASSES = [
    ("c10/cuda/CUDACachingAllocator.h", r"class\s+CUDAAllocator\s*:\s*public\s+DeviceAllocator\s*\{"),
    ("c10/core/CachingDeviceAllocator.h", r"struct\s+C10_API\s+DeviceAllocator\s*:\s*public\s+c10::Allocator\s*\{"),
    ("c10/core/Allocator.h", r"struct\s+C10_API\s+Allocator\s*\{"),
]


def include_dir():
    """The torch/include directory to check against, or None."""
    if os.environ.get(INCLUDE_ENV):
        return os.environ[INCLUDE_ENV]
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return None
    candidate = os.path.join(list(spec.submodule_search_locations)[0], "include")
    return candidate if os.path.isdir(candidate) else None


def strip_comments(code):
    code = re.sub(r"/\*.*?\*/", " ", code, flags=re.S)
    return re.sub(r"//[^\n]*", " ", code)


def class_body(code, opening):
    """The text between a class's opening brace and its closing one."""
    match = re.search(opening, code)
    if match is None:
        raise AssertionError(f"class not found: {opening}")
    depth, start = 1, match.end()
    for i in range(start, len(code)):
        if code[i] == "{":
            depth += 1
        elif code[i] == "}":
            depth -= 1
            if depth == 0:
                return code[start:i]
    raise AssertionError(f"class not closed: {opening}")


def virtual_methods(body):
    """The names of the methods `body` declares virtual (destructors left out)."""
    names = set()
    for declaration in re.finditer(r"\bvirtual\b([^;{]*?)\(", body):
        name = re.findall(r"(~?\w+)\s*$", declaration.group(1))
        if name and not name[0].startswith("~"):
            names.add(name[0])
    return names


def torch_version(include):
    with open(os.path.join(include, "torch", "headeronly", "version.h")) as header:
        text = header.read()
    major = int(re.search(r"#define\s+TORCH_VERSION_MAJOR\s+(\d+)", text).group(1))
    minor = int(re.search(r"#define\s+TORCH_VERSION_MINOR\s+(\d+)", text).group(1))
    return major, minor


def resolve_version_branches(code, major, minor):
    """`code` with its `#if` / `#elif` / `#else` / `#endif` on TORCH_VERSION_MAJOR and _MINOR resolved.
    Other conditionals (`#ifdef`, ...) keep every branch: the check reads more, never less."""
    def holds(condition):
        expression = (condition.replace("TORCH_VERSION_MAJOR", str(major))
                      .replace("TORCH_VERSION_MINOR", str(minor))
                      .replace("&&", " and ").replace("||", " or "))
        expression = re.sub(r"!(?!=)", " not ", expression)
        return bool(eval(expression, {"__builtins__": {}}))  # noqa: S307 (digits and operators only)

    out, stack = [], []  # per open conditional: [this branch taken, a branch taken, on the version]
    for line in code.splitlines():
        directive = re.match(r"\s*#\s*(ifdef|ifndef|if|elif|else|endif)\b(.*)", line)
        if directive is None:
            if all(entry[0] for entry in stack):
                out.append(line)
            continue
        kind, condition = directive.groups()
        if kind in ("ifdef", "ifndef") or (kind == "if" and "TORCH_VERSION" not in condition):
            stack.append([True, True, False])
        elif kind == "if":
            taken = holds(condition)
            stack.append([taken, taken, True])
        elif kind == "endif":
            stack.pop()
        elif stack[-1][2]:
            taken = not stack[-1][1] and (kind == "else" or holds(condition))
            stack[-1] = [taken, stack[-1][1] or taken, True]
    return "\n".join(out)


def overridden(code):
    """The names of the methods `code` marks `override`."""
    return set(re.findall(r"(\w+)\s*\([^;{}]*?\)\s*(?:const\s*)?(?:noexcept\s*)?override\b", code))


def missing_overrides(include):
    """The virtual methods of CUDAAllocator and its bases that the layer does not override, sorted."""
    declared = set()
    for header, opening in CLASSES:
        with open(os.path.join(include, header)) as file:
            declared |= virtual_methods(class_body(strip_comments(file.read()), opening))
    with open(LAYER) as file:
        layer = resolve_version_branches(strip_comments(file.read()), *torch_version(include))
    return sorted(declared - overridden(layer))


@unittest.skipIf(include_dir() is None, f"no PyTorch headers: install torch or set {INCLUDE_ENV}")
class EveryVirtualMethodIsOverridden(unittest.TestCase):
    def test_the_layer_overrides_every_virtual_method_of_the_headers(self):
        include = include_dir()
        missing = missing_overrides(include)
        version = "%d.%d" % torch_version(include)
        self.assertEqual(missing, [], f"the C++ layer does not override, for PyTorch {version}: {missing}")


class TheCheckItself(unittest.TestCase):
    """The reading of headers and of the layer, on small texts (no PyTorch needed)."""

    def test_virtual_methods_are_read_across_lines_and_destructors_left_out(self):
        body = """
          virtual ~A() = default;
          virtual void* raw_alloc(size_t n) = 0;
          virtual std::vector<StreamSegmentSize> getExpandableSegmentSizes(
              c10::DeviceIndex device) = 0;
          void recordStream(const DataPtr& p, c10::Stream s) override {}
          virtual bool isEnabled() const = 0;
        """
        self.assertEqual(virtual_methods(body), {"raw_alloc", "getExpandableSegmentSizes", "isEnabled"})

    def test_version_branches_count_for_the_headers_version_only(self):
        code = "\n".join([
            "void a() override {}",
            "#if TORCH_VERSION_MAJOR > 2 || TORCH_VERSION_MINOR >= 15",
            "void b() override {}",
            "#else",
            "void c() override {}",
            "#endif",
            "#ifndef SOMETHING",
            "void d() override {}",
            "#endif",
        ])
        self.assertEqual(overridden(resolve_version_branches(code, 2, 15)), {"a", "b", "d"})
        self.assertEqual(overridden(resolve_version_branches(code, 2, 11)), {"a", "c", "d"})

    def test_a_method_left_to_pytorch_is_named(self):
        layer = "void raw_delete(void* p) override {}\nbool isEnabled() const override { return true; }"
        self.assertEqual(overridden(layer), {"raw_delete", "isEnabled"})
        declared = virtual_methods("virtual void raw_delete(void*) = 0; virtual void setNoSplit(int d) {}")
        self.assertEqual(sorted(declared - overridden(layer)), ["setNoSplit"])


if __name__ == "__main__":
    unittest.main()
