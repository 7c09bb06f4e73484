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
        '  --query-gpu=index,uuid) printf "0, GPU-1111\\n1, GPU-2222\\n" ;;\n'
        "  *) exit 2 ;;\n"
        "esac\n",
    )
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert gpu_names() == ["NVIDIA H100 80GB HBM3"] * 2
    assert gpu_uuids() == ["GPU-1111", "GPU-2222"]
    # the cards a row's server may use: run --jobs's devices (nvidia-smi indices), else CUDA_VISIBLE_DEVICES
    assert gpu_uuids([1]) == ["GPU-2222"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    assert gpu_uuids() == ["GPU-1111"] and gpu_uuids([1]) == ["GPU-2222"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-2222")
    assert gpu_uuids() == ["GPU-2222"]


def test_a_row_records_the_cards_its_server_could_use_and_none_on_the_cpu(tmp_path, monkeypatch):
    from moe_eval.runner import RunOptions, _cards

    _fake_nvidia_smi(tmp_path, monkeypatch, 'printf "0, GPU-1111\\n1, GPU-2222\\n"\n')
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    gpus = ("NVIDIA H100 80GB HBM3",) * 2

    def options(hw: str, **more) -> RunOptions:
        return RunOptions(hw=hw, run_root=tmp_path, data=None, **more)  # type: ignore[arg-type]

    assert _cards(options("h100", gpus=gpus, devices=(1,))) == ["GPU-2222"]
    assert _cards(options("h100", gpus=gpus)) == ["GPU-1111", "GPU-2222"]
    assert _cards(options("cpu", gpus=gpus)) is None  # --hw cpu on a GPU host: no cards
    assert _cards(options("cpu")) is None


def test_no_nvidia_smi_or_a_failing_one_is_no_gpu(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    assert gpu_uuids() == [] and gpu_names() == []
    _fake_nvidia_smi(tmp_path, monkeypatch, "exit 9\n")
    assert gpu_uuids() == [] and gpu_names() == []
