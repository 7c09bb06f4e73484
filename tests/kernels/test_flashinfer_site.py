"""benchmarks/device/fi_site.sh: where the H200 scripts find FlashInfer and its BF16 module.

A `.fi-lite/fi-lite.tar.xz` built with no GPU (benchmarks/fi_module_cpu.sh) is unpacked into `.fi-site/`
on the first WITH_FI=1 call, so FlashInfer's rows need neither the wheels nor the ~430 s build there.
Here a stand-in archive (a two-file tree; the real one holds FlashInfer and the 14 MB module) checks
the placement and the error that names both remedies.
"""

from __future__ import annotations

import shutil
import subprocess
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MODULE = "flashinfer/data/aot/fused_moe_90/fused_moe_90.so"
TUNER_MODULE = "flashinfer/data/aot/trtllm_utils/trtllm_utils.so"  # the autotuner's delay kernel


def source_fi_site(cwd: Path, call: str) -> subprocess.CompletedProcess:
    script = f"source {ROOT / 'benchmarks/device/fi_site.sh'} && {call} && echo ready"
    return subprocess.run(["bash", "-c", script], cwd=cwd, capture_output=True, text=True, check=False)


def write_lite_archive(cwd: Path, module_bytes: bytes) -> None:
    tree = cwd / "tree"
    shutil.rmtree(tree, ignore_errors=True)
    for path, content in ((MODULE, module_bytes), (TUNER_MODULE, b"tuner"), ("flashinfer/__init__.py", b"")):
        (tree / path).parent.mkdir(parents=True, exist_ok=True)
        (tree / path).write_bytes(content)
    (cwd / ".fi-lite").mkdir(exist_ok=True)
    with tarfile.open(cwd / ".fi-lite/fi-lite.tar.xz", "w:xz") as archive:
        archive.add(tree, arcname=".")
    (cwd / ".fi-lite/BUILD.txt").write_text(
        "fused_moe_90.so md5 0123abcd, 6 bytes; needs: libc.so.6\ntrtllm_utils.so md5 4567ef01, 9 bytes\n"
    )


def test_a_carried_light_site_is_unpacked_where_the_rows_look(tmp_path):
    write_lite_archive(tmp_path, b"module")
    run = source_fi_site(tmp_path, "require_fi_site")
    assert run.returncode == 0, run.stdout + run.stderr
    assert (tmp_path / ".fi-site" / MODULE).read_bytes() == b"module"
    assert (tmp_path / ".fi-site" / TUNER_MODULE).read_bytes() == b"tuner"
    assert "placed from .fi-lite/fi-lite.tar.xz (fused_moe_90.so md5 0123abcd)" in run.stdout


def test_a_light_site_from_another_archive_is_replaced_and_the_same_one_kept(tmp_path):
    """A warm machine keeps .fi-site/ between calls: one unpacked from an older archive (which lacked the
    autotuner's module) must not stand in for the archive carried now."""
    write_lite_archive(tmp_path, b"older")
    assert source_fi_site(tmp_path, "require_fi_site").returncode == 0
    write_lite_archive(tmp_path, b"newer")
    run = source_fi_site(tmp_path, "require_fi_site")
    assert run.returncode == 0 and "placed from" in run.stdout
    assert (tmp_path / ".fi-site" / MODULE).read_bytes() == b"newer"
    again = source_fi_site(tmp_path, "require_fi_site")
    assert again.returncode == 0 and "placed from" not in again.stdout


def test_an_archive_that_does_not_unpack_exits_2_and_leaves_no_half_site(tmp_path):
    (tmp_path / ".fi-lite").mkdir()
    (tmp_path / ".fi-lite/fi-lite.tar.xz").write_bytes(b"cut short")
    run = source_fi_site(tmp_path, "require_fi_site")
    assert run.returncode == 2 and "ready" not in run.stdout
    assert "did not unpack" in run.stdout
    assert not (tmp_path / ".fi-site").exists() and not (tmp_path / ".fi-site.part").exists()


def test_a_wheel_installed_module_is_kept_and_the_archive_not_unpacked(tmp_path):
    placed = tmp_path / ".fi-site" / MODULE
    placed.parent.mkdir(parents=True)
    placed.write_bytes(b"built on this machine")
    write_lite_archive(tmp_path, b"carried")
    run = source_fi_site(tmp_path, "require_fi_site")
    assert run.returncode == 0, run.stdout + run.stderr
    assert placed.read_bytes() == b"built on this machine"
    assert "placed from" not in run.stdout


def test_without_module_or_archive_it_exits_2_naming_both_remedies(tmp_path):
    run = source_fi_site(tmp_path, "require_fi_site")
    assert run.returncode == 2
    assert "ready" not in run.stdout
    assert "carry .fi-lite/ (benchmarks/fi_module_cpu.sh)" in run.stdout
    assert "kernel_bench.sh STAGES=fi-build" in run.stdout
