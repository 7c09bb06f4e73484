"""Which configs a run covers: hardware lists (config-<hw>.txt), shards and explicit paths.

A list holds one config path per line, relative to the list file; `#` comments and blank
lines are ignored. A listed file that does not exist is an error: a list that silently runs
nothing would keep CI green while testing nothing.
"""

from __future__ import annotations

import re
from pathlib import Path

from moe_eval.errors import ConfigError, NothingSelected

HARDWARE = ("b200", "h100", "h200", "cpu")
_SHARD = re.compile(r"^(\d+)/(\d+)$")


def read_list(list_path: Path) -> list[Path]:
    try:
        lines = list_path.read_text().splitlines()
    except FileNotFoundError:
        raise ConfigError(f"{list_path}: hardware list does not exist") from None
    paths: list[Path] = []
    for lineno, raw in enumerate(lines, start=1):
        entry = raw.split("#", 1)[0].strip()
        if not entry:
            continue
        path = (list_path.parent / entry).resolve()
        if not path.is_file():
            raise ConfigError(f"{list_path}:{lineno}: listed config '{entry}' does not exist ({path})")
        paths.append(path)
    return paths


def list_for_hardware(hw: str, root: Path) -> Path:
    """The list file for a hardware name; an H200 uses the H100 list unless config-h200.txt exists."""
    if hw not in HARDWARE:
        raise ConfigError(f"--hw: value '{hw}' is not one of auto, {', '.join(HARDWARE)}")
    path = root / f"config-{hw}.txt"
    if hw == "h200" and not path.exists():
        path = root / "config-h100.txt"
    return path


def parse_shard(text: str) -> tuple[int, int]:
    """'i/n' with 0 <= i < n: this agent's index and the number of agents."""
    match = _SHARD.match(text.strip())
    if not match:
        raise ConfigError(f"--shard: value '{text}' must look like i/n, e.g. 0/4")
    index, count = int(match[1]), int(match[2])
    if count < 1 or index >= count:
        raise ConfigError(f"--shard: value '{text}' needs 0 <= i < n")
    return index, count


def shard(paths: list[Path], index: int, count: int) -> list[Path]:
    """Round-robin over the list order: deterministic, and every config lands on exactly one agent."""
    return [p for i, p in enumerate(paths) if i % count == index]


def require_some(paths: list[Path], what: str) -> list[Path]:
    if not paths:
        raise NothingSelected(f"nothing selected: {what} holds no config")
    return paths
