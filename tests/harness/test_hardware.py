"""What moe-eval records of the machine's GPUs, read from nvidia-smi (a script of that name on PATH here:
this machine has no GPU)."""

from __future__ import annotations

import stat

from moe_eval.configs.hardware import gpu_names, gpu_uuids


def _fake_nvidia_smi(tmp_path, monkeypatch, body: str) -> None:
    script = tmp_path / "nvidia-smi"
    script.write_text("#!/bin/sh\n" + body)
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{tmp_path}")


def test_names_and_uuids_come_from_nvidia_smi_one_per_card(tmp_path, monkeypatch):
    _fake_nvidia_smi(
        tmp_path,
        monkeypatch,
        'case "$1" in\n'
        '  --query-gpu=name) printf "NVIDIA H100 80GB HBM3\\nNVIDIA H100 80GB HBM3\\n" ;;\n'
        '  --query-gpu=uuid) printf "GPU-1111\\nGPU-2222\\n" ;;\n'
        "  *) exit 2 ;;\n"
        "esac\n",
    )
    assert gpu_names() == ["NVIDIA H100 80GB HBM3"] * 2
    assert gpu_uuids() == ["GPU-1111", "GPU-2222"]


def test_no_nvidia_smi_or_a_failing_one_is_no_gpu(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    assert gpu_uuids() == [] and gpu_names() == []
    _fake_nvidia_smi(tmp_path, monkeypatch, "exit 9\n")
    assert gpu_uuids() == [] and gpu_names() == []
