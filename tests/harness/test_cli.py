"""The CLI as users and CI see it: real processes, exit codes, messages. No server is started here."""

import socket
from pathlib import Path

from tests.conftest import run_cli

CONFIG = """model_name: "builtin:tiny-qwen3-moe"
accuracy_threshold: 0.5
num_questions: 5
num_fewshot: 5
"""


def _config(tmp_path: Path, text: str = CONFIG, name: str = "c.yaml") -> Path:
    path = tmp_path / "configs" / "fam" / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_validate_passes_on_the_repository(repo_root):
    result = run_cli(["validate"], cwd=repo_root)
    assert result.returncode == 0, result.stderr
    assert "ok:" in result.stdout


def test_validate_fails_with_4_on_unknown_key_and_reports_every_problem(tmp_path):
    _config(tmp_path, CONFIG + "colour: blue\n", "a.yaml")
    _config(tmp_path, CONFIG.replace("0.5", "7"), "b.yaml")
    _config(tmp_path, CONFIG + "moe_backend: torch\n", "Tiny-BF16-triton.yaml")  # name and content disagree
    result = run_cli(["validate", "--root", str(tmp_path)])
    assert result.returncode == 4
    assert "a.yaml: unknown key 'colour' (value 'blue')" in result.stderr
    assert "b.yaml: key 'accuracy_threshold': value 7" in result.stderr
    assert "disagrees with the file name" in result.stderr
    assert "3 problem(s)" in result.stderr


def test_list_b200_shows_exactly_the_b200_configs_with_layouts(repo_root):
    result = run_cli(["list", "--hw", "b200"], cwd=repo_root)
    assert result.returncode == 0, result.stderr
    rows = [line.split("\t") for line in result.stdout.splitlines()[2:]]
    listed = {(r[0], r[2], r[3], r[-1]) for r in rows}
    # The gates column is the table's (moe_eval.gates.table), as the run judges them: every row is judged
    # by what it served, its accuracy and its answers' garbage limits; every bundled row besides by the
    # comparisons with its incumbent, its kernel counters, the layer check and (a GPU: b200) the speed gate.
    incumbent = "served,accuracy,garbage"
    golden = "served,accuracy,garbage,paired,divergence,golden,kernel_calls,layer_check,speed"
    assert listed == {
        ("moe-refactor/Llama-4-Scout-BF16-vllm-tp2.yaml", "TP (TP2)", "2", incumbent),
        ("moe-refactor/Llama-4-Scout-BF16-triton.yaml", "TP (TP2)", "2", golden),
        ("moe-refactor/Llama-4-Scout-BF16-vllm-tep2.yaml", "TEP (TP2 EP2)", "2", incumbent),
        ("moe-refactor/Llama-4-Scout-BF16-fi-cutlass.yaml", "TEP (TP2 EP2)", "2", golden),
        ("moe-refactor-dp-ep/Qwen3-30B-A3B-BF16-vllm.yaml", "DEP (TP1 DP2 EP2)", "2", incumbent),
        ("moe-refactor-dp-ep/Qwen3-30B-A3B-BF16-triton.yaml", "DEP (TP1 DP2 EP2)", "2", golden),
    }


def test_h100_and_b200_lists_split_the_seed_configs(repo_root):
    from moe_eval.configs.selection import read_list

    b200 = set(read_list(repo_root / "config-b200.txt"))
    h100 = set(read_list(repo_root / "config-h100.txt"))
    seeds = set((repo_root / "configs" / "moe-refactor").glob("*.yaml")) | set(
        (repo_root / "configs" / "moe-refactor-dp-ep").glob("*.yaml")
    )
    assert b200 | h100 == {p.resolve() for p in seeds} and not (b200 & h100)
    assert not any("Llama-4-Scout" in p.name for p in h100)  # ~108B params do not fit two H100s


def test_list_shows_a_builtin_twin_for_each_shipped_gpu_config(repo_root):
    """`moe-eval list --list config-gpu-twins.txt`: every config of the B200 and H100 lists has a twin row of
    the
    same layout, backend and baseline layout, on a builtin: twin model, its answers not gated (accuracy
    n/a)."""
    from moe_eval.configs.selection import read_list

    result = run_cli(["list", "--hw", "b200", "--list", "config-gpu-twins.txt"], cwd=repo_root)
    assert result.returncode == 0, result.stderr
    rows = {r[0]: r for r in (line.split("\t") for line in result.stdout.splitlines()[2:])}
    shipped = read_list(repo_root / "config-b200.txt") + read_list(repo_root / "config-h100.txt")
    assert len(shipped) == 14 and sum(1 for p in shipped if "vllm" not in p.stem) == 7
    for path in shipped:
        twin = rows.pop(f"twins-{path.parent.name}/{path.name}")
        assert twin[1].startswith("builtin:twin-") and twin[5] == "n/a", twin
        gates = twin[-1].split(",")
        if "vllm" in path.stem:
            assert twin[4] == "vllm-default" and twin[7] == "-"
        else:
            assert {"golden", "divergence", "jit", "kernel_calls", "layer_check"} <= set(gates)
            assert "accuracy" not in gates
            assert twin[7].startswith(f"twins-{path.parent.name}/")
    # Left: one CUDA-graph pair per model (TP1, no --enforce-eager).
    assert sorted(rows) == sorted(
        f"twins-cuda-graph/{m}-BF16-{b}.yaml"
        for m in ("Qwen3-30B-A3B", "Mixtral-8x7B", "Llama-4-Scout")
        for b in ("vllm", "triton")
    )
    assert {r[2] for r in rows.values()} == {"TP (TP1)"}


def test_malformed_yaml_exits_4_naming_the_file(tmp_path):
    path = _config(tmp_path, "model_name: [oops\n")
    result = run_cli(["run", "--hw", "cpu", str(path)])
    assert result.returncode == 4
    assert str(path) in result.stderr and "malformed YAML" in result.stderr


def test_a_config_or_list_that_is_not_utf8_exits_4_naming_the_file(tmp_path):
    path = _config(tmp_path)
    path.write_bytes(path.read_bytes() + b"# caf\xe9 (latin-1)\n")
    result = run_cli(["run", "--hw", "cpu", str(path)])
    assert result.returncode == 4, result.stderr
    assert f"{path}: not UTF-8 text" in result.stderr and "Traceback" not in result.stderr
    listing = tmp_path / "config-cpu.txt"
    listing.write_bytes(b"configs/fam/c.yaml # \xff\n")
    result = run_cli(["list", "--hw", "cpu", "--root", str(tmp_path)])
    assert result.returncode == 4 and f"{listing}: not UTF-8 text" in result.stderr, result.stderr
    result = run_cli(["run", "--hw", "cpu", str(tmp_path)])  # a folder where a config file should be
    assert result.returncode == 4 and f"{tmp_path}' is a directory" in result.stderr, result.stderr


def test_list_naming_a_missing_file_exits_4(tmp_path):
    (tmp_path / "config-cpu.txt").write_text("configs/fam/missing.yaml\n")
    result = run_cli(["run", "--hw", "cpu", "--root", str(tmp_path)])
    assert result.returncode == 4
    assert "config-cpu.txt:1: listed config 'configs/fam/missing.yaml' does not exist" in result.stderr


def test_empty_selection_exits_5(tmp_path):
    (tmp_path / "config-cpu.txt").write_text("# nothing yet\n")
    result = run_cli(["run", "--hw", "cpu", "--root", str(tmp_path)])
    assert result.returncode == 5 and "nothing selected" in result.stderr


def test_empty_shard_exits_5(tmp_path):
    _config(tmp_path)
    (tmp_path / "config-cpu.txt").write_text("configs/fam/c.yaml\n")
    result = run_cli(["list", "--hw", "cpu", "--root", str(tmp_path), "--shard", "1/2"])
    assert result.returncode == 5


def test_usage_errors_exit_4(tmp_path):
    assert run_cli(["run", "--hw", "a100"]).returncode == 4
    assert run_cli(["run", "--hw", "cpu", "--shard", "2/2"]).returncode == 4
    assert (
        run_cli(["run", "--hw", "cpu", "--gsm8k-dir", str(tmp_path), str(_config(tmp_path))]).returncode == 4
    )


def test_dep_on_cpu_is_refused_before_launch(tmp_path):
    path = _config(tmp_path, CONFIG + 'server_args: "--data-parallel-size 2 --enable-expert-parallel"\n')
    result = run_cli(["run", "--hw", "cpu", str(path)])
    assert result.returncode == 4
    assert "DEP" in result.stderr and "all_gatherv" in result.stderr


def test_port_taken_exits_3_and_keeps_a_results_file(tmp_path, gsm8k_dir):
    path = _config(tmp_path)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        args = ["run", "--hw", "cpu", "--port", str(port), "--output-dir", str(tmp_path / "out"), str(path)]
        if gsm8k_dir:
            args += ["--gsm8k-dir", gsm8k_dir]
        result = run_cli(args)
    assert result.returncode == 3
    assert f"port {port}" in result.stderr and "already in use" in result.stderr
    results = list((tmp_path / "out").rglob("results.json"))
    assert len(results) == 1 and '"status": "error"' in results[0].read_text()


def test_gsm8k_that_cannot_be_had_ends_the_run_before_any_server_starts(tmp_path):
    """Issue 41: a GSM8K config run offline without --gsm8k-dir started its server and failed after 61 s at
    593f15d. Known before launch: exit 3 in seconds, naming the config and the fix, and no run folder."""
    import time

    path = _config(tmp_path)
    offline = {"HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1"}
    started = time.monotonic()
    result = run_cli(
        ["run", "--hw", "cpu", "--output-dir", str(tmp_path / "out"), str(path)],
        env=offline,
        unset=("MOE_EVAL_GSM8K_DIR",),
    )
    assert result.returncode == 3, result.stderr
    assert time.monotonic() - started < 30
    assert str(path) in result.stderr and "HF_HUB_OFFLINE is set" in result.stderr
    assert "--gsm8k-dir" in result.stderr and not (tmp_path / "out").exists()


def test_buildkite_parallel_job_selects_the_shard(repo_root):
    """A Buildkite step with `parallelism: 2` sets these on each agent; --shard is not needed."""
    env = {"BUILDKITE_PARALLEL_JOB": "1", "BUILDKITE_PARALLEL_JOB_COUNT": "2"}
    result = run_cli(["list", "--hw", "h100"], cwd=repo_root, env=env)
    assert result.returncode == 0, result.stderr
    assert "(shard 1/2)" in result.stdout
    listed = [line.split("\t")[0] for line in result.stdout.splitlines()[2:]]
    full = [
        line.split("\t")[0]
        for line in run_cli(["list", "--hw", "h100"], cwd=repo_root).stdout.splitlines()[2:]
    ]
    # Each incumbent travels with the bundled rows that compare with it: groups of two, every other group.
    assert listed == full[2:4] + full[6:8] and all("-vllm-" in name for name in listed[::2])
    half = run_cli(["list", "--hw", "h100"], cwd=repo_root, env={"BUILDKITE_PARALLEL_JOB": "1"})
    assert half.returncode == 4 and "must be set together" in half.stderr


def test_jobs_and_list_options_are_checked(tmp_path, repo_root):
    config = _config(tmp_path)
    bad = run_cli(["run", "--hw", "cpu", "--jobs", "0", str(config)])
    assert bad.returncode == 4 and "--jobs: value '0' must be a positive integer or auto" in bad.stderr
    both = run_cli(["run", "--hw", "cpu", "--list", str(repo_root / "config-cpu.txt"), str(config)])
    assert both.returncode == 4 and "given together with config files" in both.stderr
    listed = run_cli(["list", "--hw", "h200", "--list", "config-gpu-canary.txt"], cwd=repo_root)
    assert (
        listed.returncode == 0
        and sum(line.startswith("canary-gpu-") for line in listed.stdout.splitlines()) == 7
    )


def test_a_config_too_large_for_the_free_devices_is_refused_before_launch(tmp_path):
    tep = _config(tmp_path, CONFIG + 'server_args: "--tensor-parallel-size 4 --enable-expert-parallel"\n')
    result = run_cli(["run", "--hw", "cpu", "--jobs", "2", str(tep)])
    assert result.returncode == 4, result.stderr
    assert "needs 4 CPU cores; free here:" in result.stderr and "TEP (TP4 EP4)" in result.stderr
