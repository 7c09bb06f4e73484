"""What the server's own log says about the MoE kernel it used."""

from __future__ import annotations

import re
from pathlib import Path

# vLLM 0.32.0: "Using CPU Unquantized MoE backend out of potential backends: ['CPU']."
_VLLM_CHOICE = re.compile(r"Using (?P<backend>\S+) Unquantized MoE backend out of potential backends: "
                          r"\[(?P<candidates>[^\]]*)\]")


def vllm_moe_backends(log_text: str) -> list[str]:
    """Every distinct backend vLLM's own MoE selection logged, in order of first appearance."""
    seen: list[str] = []
    for match in _VLLM_CHOICE.finditer(log_text):
        if match["backend"] not in seen:
            seen.append(match["backend"])
    return seen


def read_log(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except FileNotFoundError:
        return ""
