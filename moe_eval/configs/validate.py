"""`moe-eval validate`: every config and hardware list in the repository, all problems reported."""

from __future__ import annotations

from pathlib import Path

from moe_eval.configs.config import backend_named_by, load_config
from moe_eval.configs.selection import read_list
from moe_eval.core.errors import ConfigError


def validate_repository(root: Path) -> tuple[list[str], int]:
    """Every problem of every config and list under `root`."""
    problems: list[str] = []
    checked = 0
    for path in sorted((root / "configs").rglob("*.yaml")):
        checked += 1
        try:
            config = load_config(path)
        except ConfigError as exc:
            problems.append(str(exc))
            continue
        named = backend_named_by(path.stem).bundled  # the backend the config must ask for
        if named and config.moe_backend not in (None, named):
            problems.append(
                f"{path}: key 'moe_backend': value '{config.moe_backend}' disagrees with the file "
                f"name, which says '{named}'"
            )
    configs_dir = (root / "configs").resolve()
    for list_path in sorted(root.glob("config-*.txt")):
        checked += 1
        try:
            for config_path in read_list(list_path):
                if configs_dir not in config_path.parents:  # those under configs/ were checked above
                    load_config(config_path)
        except ConfigError as exc:
            problems.append(str(exc))
    return problems, checked
