"""Hardware lists, shards and layout derivation."""

from pathlib import Path

import pytest

from moe_eval.configs.config import load_config
from moe_eval.configs.selection import (
    list_for_hardware,
    parse_shard,
    read_list,
    require_some,
    shard,
    with_baselines,
)
from moe_eval.core.errors import ConfigError, NothingSelected
from moe_eval.core.layout import LayoutKind, layout_from_server_args


def _write(path: Path, text: str = "") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_list_paths_are_relative_to_the_list_and_skip_comments(tmp_path):
    a = _write(tmp_path / "configs" / "a.yaml")
    b = _write(tmp_path / "configs" / "b.yaml")
    lst = _write(
        tmp_path / "config-cpu.txt", "# header\n\nconfigs/a.yaml   # trailing comment\n  configs/b.yaml\n"
    )
    assert read_list(lst) == [a.resolve(), b.resolve()]


def test_list_naming_a_missing_file_is_an_error_with_line_number(tmp_path):
    _write(tmp_path / "configs" / "a.yaml")
    lst = _write(tmp_path / "config-h100.txt", "configs/a.yaml\nconfigs/gone.yaml\n")
    with pytest.raises(
        ConfigError, match=r"config-h100.txt:2: listed config 'configs/gone.yaml' does not exist"
    ):
        read_list(lst)


def test_missing_list_is_an_error(tmp_path):
    with pytest.raises(ConfigError, match="hardware list does not exist"):
        read_list(tmp_path / "config-b200.txt")


def test_h200_uses_h100_list_unless_it_has_its_own(tmp_path):
    assert list_for_hardware("h200", tmp_path).name == "config-h100.txt"
    _write(tmp_path / "config-h200.txt")
    assert list_for_hardware("h200", tmp_path).name == "config-h200.txt"
    with pytest.raises(ConfigError, match="'a100'"):
        list_for_hardware("a100", tmp_path)


def test_shards_partition_the_list_deterministically():
    paths = [Path(f"c{i}.yaml") for i in range(7)]
    parts = [shard(paths, i, 3) for i in range(3)]
    assert sorted(p for part in parts for p in part) == sorted(paths)
    assert all(set(x).isdisjoint(y) for i, x in enumerate(parts) for y in parts[i + 1 :])
    assert parts == [shard(paths, i, 3) for i in range(3)]  # same answer every time


@pytest.mark.parametrize("text", ["3/3", "1", "a/b", "-1/2", "0/0"])
def test_bad_shards(text):
    with pytest.raises(ConfigError, match="--shard"):
        parse_shard(text)


def test_empty_selection_is_nothing_selected():
    with pytest.raises(NothingSelected):
        require_some([], "config-x.txt")


@pytest.mark.parametrize(
    "args, kind, world, ep_size",
    [
        ([], LayoutKind.TP, 1, 1),
        (["--tensor-parallel-size", "2"], LayoutKind.TP, 2, 1),
        (["--tensor-parallel-size=2", "--enable-expert-parallel"], LayoutKind.TEP, 2, 2),
        (["-tp", "4", "-ep"], LayoutKind.TEP, 4, 4),
        (["--data-parallel-size", "2", "--enable-expert-parallel"], LayoutKind.DEP, 2, 2),
        (
            ["--data-parallel-size", "2", "--tensor-parallel-size", "2", "--enable-expert-parallel"],
            LayoutKind.DEP,
            4,
            4,
        ),
        (["--enable-expert-parallel"], LayoutKind.TP, 1, 1),  # EP over one rank splits nothing
    ],
)
def test_layout_derivation(args, kind, world, ep_size):
    layout = layout_from_server_args(args)
    assert (layout.kind, layout.world_size, layout.expert_parallel_size) == (kind, world, ep_size)


def test_bad_parallel_size():
    with pytest.raises(ValueError):
        layout_from_server_args(["--tensor-parallel-size", "0"])


def test_shards_keep_a_listed_baseline_with_the_configs_that_compare_with_it():
    paths = [
        Path(f"/l/{n}.yaml") for n in ("vllm-tp", "triton-tp", "fi-tp", "vllm-tep", "triton-tep", "lone")
    ]
    baseline_of = {
        paths[1]: paths[0],
        paths[2]: paths[0],
        paths[4]: paths[3],
        paths[5]: Path("/elsewhere.yaml"),
    }
    parts = [shard(paths, i, 2, baseline_of) for i in range(2)]
    assert parts == [[paths[0], paths[1], paths[2], paths[5]], [paths[3], paths[4]]]


@pytest.mark.parametrize("key, value", [("num_questions", 20), ("logprob_texts", 32), ("decode_tokens", 16)])
def test_a_baseline_must_score_what_its_user_scores(tmp_path, key, value):
    common = (
        'model_name: "builtin:canary-qwen3-moe"\naccuracy_threshold: 0.5\nnum_questions: 10\nnum_fewshot: 5\n'
    )
    _write(
        tmp_path / "vllm.yaml",
        common + f"{key}: {value}\n"
        if key != "num_questions"
        else common.replace("num_questions: 10", f"num_questions: {value}"),
    )
    user = load_config(
        _write(tmp_path / "torch.yaml", common + "moe_backend: torch\nbaseline_config: vllm.yaml\n")
    )
    with pytest.raises(
        ConfigError, match=f"torch.yaml: key 'baseline_config': value 'vllm.yaml' has {key} {value}"
    ):
        with_baselines([user])
    _write(tmp_path / "vllm.yaml", common)
    ordered, dependencies, _ = with_baselines([user])
    assert [c.path.name for c in ordered] == ["vllm.yaml", "torch.yaml"] and dependencies == {1: 0}
