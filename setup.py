"""Build of aiproxy's Cython extensions.

Knobs from the environment:
  AIPROXY_ANNOTATE=1   write Cython HTML annotation next to each .pyx
  AIPROXY_DEBUG=1      build with -O0 -g and Cython line tracing off
  CFLAGS               passed through by setuptools as usual
"""

import os

from setuptools import Extension, setup

try:
    from Cython.Build import cythonize
except ImportError as exc:  # pragma: no cover - build requirement
    raise SystemExit("aiproxy needs Cython to build its extensions: pip install Cython") from exc

DEBUG = os.environ.get("AIPROXY_DEBUG") == "1"
extra_compile_args = ["-O0", "-g"] if DEBUG else ["-O3"]

FAST_MODULES = ["h1"]

extensions = [
    Extension(
        f"aiproxy._fast.{name}",
        [f"aiproxy/_fast/{name}.pyx"],
        extra_compile_args=extra_compile_args,
    )
    for name in FAST_MODULES
]

setup(
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
    ),
)
