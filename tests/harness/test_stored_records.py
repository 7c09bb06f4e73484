"""Behaviour kept: the committed records of real GPU runs, judged again by today's code, get the verdicts they
were given. The layer check is re-judged from each row's own tables (docs/data/layer_cells_h200/*/layer-check,
H200, CUDA vLLM), with the row's keys and the registry's floors; the speed records are re-judged in
tests/speed (their changed verdicts are the speed gate's new rule, named there)."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest

from moe_eval.configs.config import EvalConfig
from moe_eval.core import layer_cells
from moe_eval.core.check import Check
from moe_eval.core.layout import layout_from_server_args
from moe_eval.core.record import RunRecord
from moe_eval.gates.judge import on_floor
from moe_eval.gates.layer_gate import GATE, LayerCheckKeys, layer_check_limits, layer_checks, summarize

REPO = Path(__file__).resolve().parents[2]
ROWS = sorted(
    p.parent for p in (REPO / "docs/data").rglob("results.json") if (p.parent / "layer-check").is_dir()
)


def _config(stored: dict) -> EvalConfig:
    """The row's layer-check keys as it ran them (a key it predates: today's default)."""
    keys = {key: stored[key] for key in LayerCheckKeys.__pydantic_fields__ if key in stored}
    base = EvalConfig(
        path=Path("stored.yaml"), sha256="0" * 64, model_name="stored", num_questions=1, num_fewshot=0,
        random_weights=True, server_args=stored.get("server_args", ""), moe_backend=stored.get("moe_backend"),
    )  # fmt: skip
    return base.with_keys(**keys)


def test_the_stored_rows_with_layer_check_tables_are_there():
    assert len(ROWS) >= 13, (
        ROWS
    )  # the one-layer and one-expert bugs, the SiLU slope runs, the twins, the canary


@pytest.mark.parametrize("row", ROWS, ids=[str(r.relative_to(REPO / "docs/data")) for r in ROWS])
def test_a_stored_rows_layer_check_is_judged_as_it_was(row):
    record = json.loads((row / "results.json").read_text())
    assert record["schema_version"] < 10  # written before a check's status: read from passed and ran
    stored = {c.name: c for c in RunRecord.read(row / "results.json").verdict.checks}
    config = _config(record["config"])
    limits = layer_check_limits(config)
    files, problems = layer_cells.read_folder(row)
    world = layout_from_server_args(shlex.split(config.server_args)).world_size
    checks: list[Check] = [
        on_floor(config, GATE, check)
        for check in layer_checks(summarize(files, limits, world, problems), limits)
    ]
    assert [c.name for c in checks] == list(GATE.checks)
    for check in checks:
        assert check.status == stored[check.name].status, (
            check.name,
            check.detail,
            stored[check.name].detail,
        )
