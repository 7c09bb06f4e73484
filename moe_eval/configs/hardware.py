"""Detect which hardware list applies to this machine (`--hw auto`)."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterable


def gpu_names() -> list[str]:
    """Names of the NVIDIA GPUs present, from nvidia-smi (no torch import: it is slow and may lack CUDA)."""
    return nvidia_smi(["--query-gpu=name", "--format=csv,noheader"])


def visible_devices() -> set[str] | None:
    """CUDA_VISIBLE_DEVICES's names (nvidia-smi indices or UUIDs); None where it is not set (every GPU)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return None if visible is None else {v.strip() for v in visible.split(",") if v.strip()}


def gpu_uuids(devices: Iterable[int] | None = None) -> list[str]:
    """The UUIDs of the GPUs a server may use: `devices` (nvidia-smi indices, as `run --jobs` hands them
    out), else those CUDA_VISIBLE_DEVICES names (indices or UUIDs), else every GPU present. Which physical
    cards: two H100s of one model differed in speed by a few % (docs/perf.md "The speed gate on a second
    H100")."""
    wanted = {str(d) for d in devices} if devices is not None else visible_devices()
    cards = []
    for line in nvidia_smi(["--query-gpu=index,uuid", "--format=csv,noheader"]):
        index, _, uuid = (part.strip() for part in line.partition(","))
        if wanted is None or index in wanted or uuid in wanted:
            cards.append(uuid)
    return cards


def nvidia_smi(args: list[str]) -> list[str]:
    """nvidia-smi's output lines for `args`, stripped, blank ones left out; none where it is missing or
    fails (a machine without GPUs)."""
    if shutil.which("nvidia-smi") is None:
        return []
    try:
        out = subprocess.run(
            ["nvidia-smi", *args],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        ).stdout
    except (subprocess.SubprocessError, OSError):
        return []
    return [line.strip() for line in out.splitlines() if line.strip()]


def hardware_from_gpu_name(name: str) -> str | None:
    upper = name.upper()
    for hw in ("B200", "H200", "H100"):
        if hw in upper:
            return hw.lower()
    return None


def detect_hardware(names: list[str] | None = None) -> str:
    """'b200', 'h200', 'h100' or 'cpu'. A GPU of another kind is an error for --hw auto.
    `names`: the GPUs as gpu_names() gave them, when the caller has read them already."""
    from moe_eval.core.errors import ConfigError

    if names is None:
        names = gpu_names()
    if not names:
        return "cpu"
    hw = hardware_from_gpu_name(names[0])
    if hw is None:
        raise ConfigError(f"--hw auto: GPU '{names[0]}' is not one of B200, H100, H200; pass --hw explicitly")
    return hw
