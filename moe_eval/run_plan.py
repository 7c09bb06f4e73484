"""One plan for `moe-eval list` and `moe-eval run`: which configs, in which order, with which incumbent,
which data, and each gate as it will run (or not run, or be skipped, and why).

`list` prints the plan; `run` makes the same plan from the same options, writes it beside its results
(plan.tsv), follows it, and with `--dry-run` prints it and stops. Nothing here starts a server: what can be
known before one starts (the selection, the baselines, the dataset's availability) is known here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from moe_eval.configs.config import EvalConfig, effective_config, load_config
from moe_eval.configs.selection import (
    list_for_hardware,
    parse_shard,
    read_list,
    require_some,
    shard,
    with_baselines,
)
from moe_eval.core.errors import ConfigError
from moe_eval.evaluate.gsm8k import Gsm8kData, gsm8k_data, hub_preflight
from moe_eval.evaluate.incumbent import find_incumbent
from moe_eval.gates.registry import describe_plan
from moe_eval.kernels.mutations import check_mutation, check_target, parse_mutation
from moe_eval.models.builtin import moe_shape

REPO_ROOT = Path(__file__).resolve().parent.parent


def find_root(root_option: str | None, hw: str) -> Path:
    """Where config-<hw>.txt lives: --root, else the current folder, else the moe-eval checkout."""
    if root_option:
        return Path(root_option).resolve()
    cwd = Path.cwd()
    if (cwd / f"config-{hw}.txt").exists() or not (REPO_ROOT / f"config-{hw}.txt").exists():
        return cwd
    return REPO_ROOT


def select_configs(
    hw: str,
    config_paths: tuple[str, ...],
    shard_text: str | None,
    root_option: str | None,
    list_path: str | None = None,
) -> tuple[list[EvalConfig], str]:
    """Load (and so validate) every selected config before anything launches."""
    if config_paths and list_path:
        raise ConfigError(
            f"--list: value '{list_path}' given together with config files; give one or the other"
        )
    if config_paths:
        paths = [Path(p).resolve() for p in config_paths]
        source = "the configs given on the command line"
    elif list_path:
        paths = read_list(Path(list_path).resolve())
        source = str(Path(list_path).resolve())
    else:
        list_path = list_for_hardware(hw, find_root(root_option, hw))
        paths = read_list(list_path)
        source = str(list_path)
    configs = {p: load_config(p) for p in paths}
    if shard_text:
        index, count = parse_shard(shard_text)
        paths = shard(
            paths,
            index,
            count,
            {p: c.baseline_config_path for p, c in configs.items() if c.baseline_config_path is not None},
        )
        source += f" (shard {index}/{count})"
    require_some(paths, source)
    return [configs[p] for p in paths], source


@dataclass
class RunPlan:
    hw: str
    source: str
    configs: list[EvalConfig]
    dependencies: dict[int, int]  # config index -> its incumbent's index (baseline_config in the list)
    notes: list[str]
    data: Gsm8kData
    baseline_path: str | None  # --baseline: an earlier run stands as every config's incumbent
    optional_gates: tuple[str, ...]  # --optional-gate
    mutations: list[str | None] = field(default_factory=list)  # per config, the --mutate it runs (or None)
    hub_configs: list[EvalConfig] = field(default_factory=list)  # configs that need GSM8K from the hub
    hub_problem: str | None = None  # why the hub cannot give it (None: it can, nothing needs it, not probed)

    def probe_hub(self) -> None:
        """Whether the hub can give GSM8K to the configs that need it (seconds where it is unreachable, so
        the commands call it after their usage checks)."""
        self.hub_problem = hub_preflight() if self.hub_configs else None

    def has_incumbent(self, i: int) -> bool:
        return i in self.dependencies or self.baseline_path is not None

    def gates(self, i: int) -> list[str]:
        config = self.configs[i]
        optional = frozenset(config.optional_gates) | set(self.optional_gates)
        return describe_plan(config, self.has_incumbent(i), optional)

    def data_stop(self) -> str | None:
        """Why the run stops before any server starts (exit 3), or None."""
        if not self.hub_problem:
            return None
        return (
            f"GSM8K for {self.hub_configs[0].path} ({len(self.hub_configs)} config(s)) cannot be had: "
            f"{self.hub_problem}. Pass --gsm8k-dir DIR (a folder with GSM8K's train.jsonl and test.jsonl) "
            "or run where the hub is reachable"
        )

    def table(self) -> list[str]:
        """The plan as `list` prints it: the list and its notes as comments, a header and one tab-separated
        line per config."""
        devices = "cpu_ranks" if self.hw == "cpu" else "gpus"
        lines = [f"# {self.source}", *(f"# {note}" for note in self.notes)]
        lines += [f"config\tmodel\tlayout\t{devices}\tmoe_backend\tthreshold\tquestions\tbaseline\tgates"]
        for i, c in enumerate(self.configs):
            incumbent = self.configs[self.dependencies[i]] if i in self.dependencies else None
            baseline = (
                f"{incumbent.path.parent.name}/{incumbent.path.name}"
                if incumbent
                else self.baseline_path or "-"
            )
            lines.append(
                f"{c.path.parent.name}/{c.path.name}\t{c.model_name}\t{c.layout.describe()}\t"
                f"{c.layout.world_size}\t{c.moe_backend or 'vllm-default'}\t"
                f"{c.accuracy_threshold if c.answers_gated else 'n/a'}\t{c.num_questions}\t{baseline}\t"
                f"{','.join(self.gates(i))}"
            )
        return lines


def make_plan(
    hw: str,
    config_paths: tuple[str, ...],
    list_path: str | None,
    shard_text: str | None,
    root_option: str | None,
    gsm8k_dir: str | None,
    baseline_path: str | None,
    optional_gates: tuple[str, ...],
    limit: int | None = None,
    mutation: str | None = None,
) -> RunPlan:
    """The plan both commands make from their shared options (hw already resolved); `run`'s --limit and
    --mutate apply to the configs as they will run (the baseline check compares the limited question
    counts). The hub is not probed yet: RunPlan.probe_hub."""
    selected, source = select_configs(hw, config_paths, shard_text, root_option, list_path)
    # --baseline (an earlier run) replaces the configs' baseline_config: nothing more to run.
    selected, dependencies, notes = with_baselines(selected) if not baseline_path else (selected, {}, [])
    if mutation is not None:
        parse_mutation(mutation)  # an unknown name or parameter: exit 4 before anything is planned
    effective = [effective_config(c, limit, mutation, hw) for c in selected]  # (config, its mutation)
    selected = [config for config, _ in effective]
    if baseline_path:  # refused now, before anything launches, when a config has no row there
        for config in selected:
            find_incumbent(Path(baseline_path).resolve(), config)
    for config, config_mutation in effective:
        if config_mutation is not None:  # refused now, for `list` and `run --dry-run` as for the run
            check_mutation(config_mutation, config)
            shape = moe_shape(config.model_name)
            if shape is not None:
                check_target(config_mutation, shape.layers, shape.experts, config.model_name)
    data = gsm8k_data(gsm8k_dir)
    plan = RunPlan(hw, source, selected, dependencies, notes, data, baseline_path, tuple(optional_gates))
    plan.mutations = [config_mutation for _, config_mutation in effective]
    plan.hub_configs = [c for c in selected if c.task != "canary"] if data.dir is None else []
    return plan
