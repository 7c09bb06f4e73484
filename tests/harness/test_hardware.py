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


def _alive(pid: int) -> bool:
    import os

    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _wait_for(path, seconds: float = 5.0) -> None:
    import time

    deadline = time.monotonic() + seconds
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert path.exists(), f"the stand-in nvidia-smi never wrote {path}"


def test_the_clock_sampler_summarises_the_sm_clock_and_leaves_no_process(tmp_path, monkeypatch):
    """evaluate/gpu_clocks.py beside a row's timed requests: nvidia-smi's loop of samples, stopped on the way
    out, also when the block raises (here a stand-in that prints a GPU's clock every 20 ms and records its
    arguments and pid)."""
    import time

    import pytest

    from moe_eval.evaluate.gpu_clocks import ClockSampler

    _fake_nvidia_smi(
        tmp_path,
        monkeypatch,
        f'echo "$@" > {tmp_path}/argv; echo $$ > {tmp_path}/pid.part; mv {tmp_path}/pid.part {tmp_path}/pid\n'
        'i=0; while true; do i=$((i+1)); printf "1, %d\\n" $((1400 + i % 3 * 100)); sleep 0.02; done\n',
    )
    monkeypatch.setenv("PATH", f"{tmp_path}:/usr/bin:/bin")  # the loop needs sleep
    with ClockSampler((1,), interval_ms=20) as clocks:
        time.sleep(0.5)
    summary = clocks.summary()
    assert summary is not None and summary["samples"] >= 5, summary
    assert (summary["sm_mhz_min"], summary["sm_mhz_max"]) == (1400.0, 1600.0)
    assert summary["devices"] == [1] and summary["interval_ms"] == 20
    assert "--id=1" in (tmp_path / "argv").read_text() and "--loop-ms=20" in (tmp_path / "argv").read_text()
    assert not _alive(int((tmp_path / "pid").read_text())), "the sampler outlived its row"

    # The timed requests raise (a server died mid-sweep): the sampler stops all the same.
    (tmp_path / "pid").unlink()
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-2222")
    with pytest.raises(RuntimeError), ClockSampler(None, interval_ms=20):
        _wait_for(tmp_path / "pid")
        raise RuntimeError("the server died")
    assert not _alive(int((tmp_path / "pid").read_text()))
    assert "--id=GPU-2222" in (tmp_path / "argv").read_text()  # CUDA_VISIBLE_DEVICES's cards only


def test_no_nvidia_smi_samples_nothing_and_a_failing_one_says_why(tmp_path, monkeypatch):
    from moe_eval.evaluate.gpu_clocks import ClockSampler

    monkeypatch.setenv("PATH", str(tmp_path))
    with ClockSampler(None) as clocks:
        pass
    assert clocks.summary() is None
    said = tmp_path / "said"
    _fake_nvidia_smi(tmp_path, monkeypatch, f'echo "Field clocks.sm is not valid."; : > {said}; exit 2\n')
    with ClockSampler(None) as clocks:
        _wait_for(said)  # the timed requests: nvidia-smi has said its piece meanwhile
    assert clocks.summary() == {
        "error": "nvidia-smi gave no SM clock sample (it said: Field clocks.sm is not valid.)"
    }
