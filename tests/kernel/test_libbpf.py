"""The loader's error paths: verifier rejections carry the program name and the log."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from aiproxy.kernel.libbpf import BPFError, BPFLoadError, BpfObject, BPFUnavailable, object_path

from .conftest import load

BPF_DIR = Path(__file__).resolve().parents[2] / "bpf"

BAD = r"""
#include <linux/bpf.h>
#include <bpf/bpf_helpers.h>
SEC("xdp")
int reads_past_the_end(struct xdp_md *ctx)
{
	unsigned char *data = (void *)(long)ctx->data;
	return data[100]; /* no bounds check: the verifier must refuse */
}
char _license[] SEC("license") = "GPL";
"""


def test_verifier_rejection_names_program_and_has_log(bpf_ok, tmp_path):
    clang = shutil.which("clang")
    if clang is None:
        pytest.skip("clang not installed")
    src, obj = tmp_path / "bad.c", tmp_path / "bad.bpf.o"
    src.write_text(BAD)
    subprocess.run([clang, "-target", "bpf", "-O2", "-g", "-I/usr/include/x86_64-linux-gnu",
                    "-c", str(src), "-o", str(obj)], check=True, capture_output=True)
    with pytest.raises(BPFLoadError) as info:
        BpfObject(obj)
    err = info.value
    assert err.program == "reads_past_the_end"
    assert "invalid access to packet" in err.verifier_log
    assert "reads_past_the_end" in str(err) and "verifier log" in str(err)


def test_missing_object_is_unavailable(monkeypatch, tmp_path):
    monkeypatch.setenv("AIPROXY_BPF_OBJECTS", str(tmp_path))
    with pytest.raises(BPFUnavailable, match="not built"):
        object_path("xdp_guard")


def test_unknown_rodata_and_maps(bpf_ok):
    with pytest.raises(BPFError, match="no const volatile global named 'nope'"):
        BpfObject(object_path("xdp_guard"), rodata={"nope": 1})
    obj = load("xdp_guard")
    try:
        with pytest.raises(BPFError, match="no map named"):
            obj.map("nope")
        with pytest.raises(BPFError, match="expected 8 bytes"):
            obj.map("guard_v4_summary").update(b"\0\0\0\0", b"\0")
    finally:
        obj.close()


def test_objects_build_with_the_makefile(tmp_path):
    if shutil.which("clang") is None or shutil.which("make") is None:
        pytest.skip("clang/make not installed")
    res = subprocess.run(["make", "-s", "-C", str(BPF_DIR), f"OUT={tmp_path}"],
                         capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "sk_splice.bpf.o", "tc_classify.bpf.o", "xdp_guard.bpf.o"]


def test_makefile_without_clang_says_why(tmp_path):
    if shutil.which("make") is None:
        pytest.skip("make not installed")
    res = subprocess.run(["make", "-C", str(BPF_DIR), f"OUT={tmp_path}",
                          "CLANG=clang-does-not-exist"], capture_output=True, text=True)
    assert res.returncode == 0
    assert "skipping the kernel fast paths" in res.stderr
    assert list(tmp_path.iterdir()) == []
