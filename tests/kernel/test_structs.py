"""The ctypes mirrors in aiproxy/kernel/structs.py match the C headers in bpf/include/.

Compiles a small C program against the headers that prints sizeof/offsetof of every
mirrored struct and field, and the mirrored constants. No root needed.
"""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from pathlib import Path

import pytest

from aiproxy.kernel.structs import CONSTANTS, MIRRORS

INCLUDE = Path(__file__).resolve().parents[2] / "bpf" / "include"


@pytest.fixture(scope="module")
def c_layout(tmp_path_factory) -> dict[str, int]:
    cc = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if cc is None:
        pytest.skip("no C compiler to check the struct mirrors with")
    headers = sorted({header for header, _ in MIRRORS.values()} |
                     {header for header, _ in CONSTANTS.values()})
    lines = ["#include <stddef.h>", "#include <stdio.h>"]
    lines += [f'#include "{h}"' for h in headers]
    lines.append("int main(void) {")
    for cname, (_, mirror) in MIRRORS.items():
        lines.append(f'printf("{cname} %zu\\n", sizeof(struct {cname}));')
        for field in mirror._fields_:
            fname = field[0]
            lines.append(f'printf("{cname}.{fname} %zu\\n", offsetof(struct {cname}, {fname}));')
    for const in CONSTANTS:
        lines.append(f'printf("{const} %llu\\n", (unsigned long long)({const}));')
    lines.append("return 0; }")
    tmp = tmp_path_factory.mktemp("layout")
    src, exe = tmp / "layout.c", tmp / "layout"
    src.write_text("\n".join(lines))
    res = subprocess.run([cc, f"-I{INCLUDE}", str(src), "-o", str(exe)], capture_output=True,
                         text=True)
    if res.returncode:
        pytest.fail(f"layout program does not compile:\n{res.stderr}")
    out = subprocess.run([str(exe)], capture_output=True, text=True, check=True).stdout
    return {name: int(value) for name, value in (line.split() for line in out.splitlines())}


@pytest.mark.parametrize("cname", sorted(MIRRORS))
def test_struct_mirror(c_layout, cname):
    _, mirror = MIRRORS[cname]
    assert c_layout[cname] == ctypes.sizeof(mirror), f"sizeof(struct {cname})"
    for field in mirror._fields_:
        fname = field[0]
        assert c_layout[f"{cname}.{fname}"] == getattr(mirror, fname).offset, f"{cname}.{fname}"


@pytest.mark.parametrize("const", sorted(CONSTANTS))
def test_constants(c_layout, const):
    assert c_layout[const] == CONSTANTS[const][1]
