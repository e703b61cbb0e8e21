"""Build of aiproxy's Cython extensions.

Knobs from the environment:
  AIPROXY_ANNOTATE=1   write Cython HTML annotation next to each .pyx
  AIPROXY_DEBUG=1      build with -O0 -g and Cython line tracing off
  AIPROXY_PGO=generate:DIR | use:DIR
                       a profile-guided build (GCC), driven by scripts/pgo_build.sh:
                       counters written to DIR by a training run, then built with them
  CFLAGS               passed through by setuptools as usual
"""

import glob
import os
import subprocess
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext
from setuptools.command.build_py import build_py

try:
    from Cython.Build import cythonize
except ImportError as exc:  # pragma: no cover - build requirement
    raise SystemExit("aiproxy needs Cython to build its extensions: pip install Cython") from exc

DEBUG = os.environ.get("AIPROXY_DEBUG") == "1"
extra_compile_args = ["-O0", "-g"] if DEBUG else ["-O3"]

FAST_MODULES = ["h1", "intent", "intent_head", "bufpool", "histogram", "chat_json", "clock",
                "sendnow", "freelist"]

NUMPY_MODULES = {"intent_head"}  # cimport numpy (its C API)

# target_clones makes ifunc resolvers, which the loader runs while it relocates the
# module; instrumented, they crashed it there (SIGSEGV in the resolver, seen under gdb).
# These modules build without counters, and so without a profile.
PGO_SKIP = {"aiproxy._fast.intent_head"}


def _pgo(module: str) -> tuple[list[str], list[str]]:
    """(compile, link) flags for AIPROXY_PGO."""
    setting = os.environ.get("AIPROXY_PGO", "")
    mode, _, directory = setting.partition(":")
    if not setting or module in PGO_SKIP:
        return [], []
    if mode == "generate" and directory:
        flags = [f"-fprofile-generate={directory}", "-fprofile-update=single"]
        return flags, flags
    if mode == "use" and directory:
        # partial-training: code the training run never reached keeps its -O3 build
        # rather than being optimized for size as if it were cold.
        return [f"-fprofile-use={directory}", "-fprofile-partial-training",
                "-Wno-missing-profile", "-Wno-error=coverage-mismatch"], []
    raise SystemExit(f"AIPROXY_PGO: expected generate:DIR or use:DIR, got {setting!r}")


def _extension(module: str, sources: list[str], **kw) -> Extension:
    compile_pgo, link_pgo = _pgo(module)
    return Extension(module, sources, extra_compile_args=extra_compile_args + compile_pgo,
                     extra_link_args=link_pgo, **kw)


def _include_dirs(name: str) -> list[str]:
    if name not in NUMPY_MODULES:
        return []
    import numpy

    return [numpy.get_include()]


extensions = [
    _extension(
        f"aiproxy._fast.{name}",
        [f"aiproxy/_fast/{name}.pyx"],
        include_dirs=_include_dirs(name),
        define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")]
        if name in NUMPY_MODULES else [],
    )
    for name in FAST_MODULES
]
# Hot-path modules written in Python and compiled in Cython's pure-Python mode: a .py
# with a .pxd beside it is the source of an extension module, the .pxd declares its
# classes' fields (and hot methods) as C. They keep Python's semantics (negative indices,
# bounds checks, Python division). scripts/bootstrap.sh and tests/conftest.py use the
# same rule.
COMPILED_PY = sorted(
    pxd[:-4].replace("/", ".")
    for pxd in glob.glob("aiproxy/**/*.pxd", recursive=True)
    if os.path.exists(pxd[:-4] + ".py")
)
compiled_py = [_extension(name, [name.replace(".", "/") + ".py"]) for name in COMPILED_PY]



# BPF objects for the kernel fast paths (bpf/*.c -> aiproxy/kernel/objects/*.bpf.o).
# Optional: without clang/libbpf-dev (or make) the package builds and runs without them,
# and the build says why. AIPROXY_BPF=0 skips them; AIPROXY_BPF=strict fails the build
# when they do not compile.
def _build_bpf() -> None:
    mode = os.environ.get("AIPROXY_BPF", "1")
    if mode == "0" or getattr(_build_bpf, "done", False):
        return
    _build_bpf.done = True
    here = os.path.dirname(os.path.abspath(__file__))
    out = os.path.join(here, "aiproxy", "kernel", "objects")
    try:
        res = subprocess.run(["make", "-s", "-C", os.path.join(here, "bpf"), f"OUT={out}"])
    except FileNotFoundError:
        print("aiproxy: 'make' not found: building without kernel fast paths", file=sys.stderr)
        return
    if res.returncode != 0:
        message = "aiproxy: BPF objects failed to build: the kernel fast paths will be off"
        if mode == "strict":
            raise SystemExit(message)
        print(message, file=sys.stderr)


class BuildPyWithBpf(build_py):
    def run(self):
        _build_bpf()
        super().run()


class BuildExtWithBpf(build_ext):
    def run(self):
        _build_bpf()  # editable installs run build_ext, not build_py
        super().run()


setup(
    cmdclass={"build_py": BuildPyWithBpf, "build_ext": BuildExtWithBpf},
    ext_modules=cythonize(
        extensions,
        language_level=3,
        annotate=os.environ.get("AIPROXY_ANNOTATE") == "1",
        compiler_directives={
            "boundscheck": False,
            "wraparound": False,
            "cdivision": True,
            "initializedcheck": False,
            "embedsignature": True,
        },
    ) + cythonize(
        compiled_py,
        language_level=3,
        annotate=os.environ.get("AIPROXY_ANNOTATE") == "1",
        # Type hints there are for readers and ruff: `data: bytes` may be a memoryview.
        compiler_directives={"annotation_typing": False},
    ),
)
