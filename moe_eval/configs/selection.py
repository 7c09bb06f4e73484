"""Which configs a run covers: hardware lists (config-<hw>.txt), shards and explicit paths, and the
baseline configs they name.

A list holds one config path per line, relative to the list file; `#` comments and blank
lines are ignored. A listed file that does not exist is an error: a list that silently runs
nothing would keep CI green while testing nothing. A config whose `baseline_config` is not
selected (another shard, or configs given one by one) brings its baseline into the run, ahead of
it: a divergence gate without its baseline would prove nothing.
"""

from __future__ import annotations

import re
from pathlib import Path

from moe_eval.configs.config import EvalConfig, load_config, read_text
from moe_eval.core.errors import ConfigError, NothingSelected

HARDWARE = ("b200", "h100", "h200", "cpu")
_SHARD = re.compile(r"^(\d+)/(\d+)$")


def read_list(list_path: Path) -> list[Path]:
    lines = read_text(list_path, "hardware list", "the list").splitlines()
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


def shard(
    paths: list[Path], index: int, count: int, baseline_of: dict[Path, Path] | None = None
) -> list[Path]:
    """Round-robin over the list order: deterministic, and every config lands on exactly one agent.

    With `baseline_of` (a config -> the baseline_config it names), a listed baseline and the configs
    comparing with it form one group and go to one agent together: split, every agent would serve the
    incumbent (vLLM's own kernel) again for its share of the bundled rows."""
    baseline_of = baseline_of or {}
    listed = set(paths)
    groups: dict[Path, list[Path]] = {}
    for path in paths:
        root = baseline_of.get(path)
        groups.setdefault(root if root in listed else path, []).append(path)
    chosen = {p for i, members in enumerate(groups.values()) if i % count == index for p in members}
    return [p for p in paths if p in chosen]


def require_some(paths: list[Path], what: str) -> list[Path]:
    if not paths:
        raise NothingSelected(f"nothing selected: {what} holds no config")
    return paths


# Keys a config and its baseline_config must share: the same model answering the same questions, and the
# same scored texts and continuations, or neither the paired gate, the divergence gate nor the golden
# gate compares like with like.
BASELINE_MUST_MATCH = (
    "model_name",
    "task",
    "num_fewshot",
    "num_questions",
    "logprob_texts",
    "decode_texts",
    "decode_tokens",
)


def with_baselines(configs: list[EvalConfig]) -> tuple[list[EvalConfig], dict[int, int], list[str]]:
    """The configs plus every baseline_config they name (each added once, just before its first user),
    {index of a config: index of its baseline}, and a note per added baseline."""
    ordered = list(configs)
    notes = []
    i = 0
    while i < len(ordered):  # baselines may name baselines: added ones are visited too
        config = ordered[i]
        path = config.baseline_config_path
        if path is not None and all(c.path != path for c in ordered):
            if not path.is_file():
                raise ConfigError(
                    f"{config.path}: key 'baseline_config': value '{config.baseline_config}' does not "
                    f"exist ({path})"
                )
            baseline = load_config(path)
            ordered.insert(i, baseline)
            notes.append(f"{baseline.path} runs first: it is the baseline_config of {config.path}")
            continue  # look at the inserted baseline's own baseline next
        i += 1
    dependencies = {}
    for i, config in enumerate(ordered):
        path = config.baseline_config_path
        if path is None:
            continue
        j = next(k for k, c in enumerate(ordered) if c.path == path)
        if j == i:
            raise ConfigError(
                f"{config.path}: key 'baseline_config': value '{config.baseline_config}' names the "
                "config itself"
            )
        for key in BASELINE_MUST_MATCH:
            if getattr(config, key) != getattr(ordered[j], key):
                raise ConfigError(
                    f"{config.path}: key 'baseline_config': value '{config.baseline_config}' has "
                    f"{key} {getattr(ordered[j], key)!r}, this config {getattr(config, key)!r}; "
                    "a baseline must answer the same questions with the same model"
                )
        dependencies[i] = j
    _refuse_cycles(ordered, dependencies)
    return ordered, dependencies, notes


def _refuse_cycles(configs: list[EvalConfig], dependencies: dict[int, int]) -> None:
    for start, first in dependencies.items():
        seen, node = {start}, first
        while node in dependencies:
            node = dependencies[node]
            if node in seen:
                raise ConfigError(f"{configs[start].path}: key 'baseline_config': the baselines form a cycle")
            seen.add(node)
