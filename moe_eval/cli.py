"""moe-eval command line: `run`, `list`, `validate`.

stdout carries results (tables); stderr carries progress. Exit codes are in moe_eval.errors:
0 all passed, 1 a gate failed, 3 infrastructure error, 4 config/usage error, 5 nothing selected.
"""

from __future__ import annotations

import signal
import sys
import time
from pathlib import Path

import click

from moe_eval.config import EvalConfig, load_config
from moe_eval.errors import ExitCode, MoeEvalError
from moe_eval.selection import HARDWARE, list_for_hardware, parse_shard, read_list, require_some, shard

REPO_ROOT = Path(__file__).resolve().parent.parent


def progress(message: str) -> None:
    click.echo(f"[moe-eval {time.strftime('%H:%M:%S')}] {message}", err=True)


def find_root(root_option: str | None, hw: str) -> Path:
    """Where config-<hw>.txt lives: --root, else the current folder, else the moe-eval checkout."""
    if root_option:
        return Path(root_option).resolve()
    cwd = Path.cwd()
    if (cwd / f"config-{hw}.txt").exists() or not (REPO_ROOT / f"config-{hw}.txt").exists():
        return cwd
    return REPO_ROOT


def resolve_hw(hw: str, gpus: list[str] | None = None) -> str:
    """`gpus`: gpu_names()'s answer when the caller has it (saves a second nvidia-smi)."""
    if hw != "auto":
        return hw
    from moe_eval.hardware import detect_hardware

    return detect_hardware(gpus)


def select_configs(hw: str, config_paths: tuple[str, ...], shard_text: str | None,
                   root_option: str | None) -> tuple[list[EvalConfig], str]:
    """Load (and so validate) every selected config before anything launches."""
    if config_paths:
        paths = [Path(p).resolve() for p in config_paths]
        source = "the configs given on the command line"
    else:
        list_path = list_for_hardware(hw, find_root(root_option, hw))
        paths = read_list(list_path)
        source = str(list_path)
    if shard_text:
        index, count = parse_shard(shard_text)
        paths = shard(paths, index, count)
        source += f" (shard {index}/{count})"
    require_some(paths, source)
    return [load_config(p) for p in paths], source


hw_option = click.option("--hw", type=click.Choice(("auto", *HARDWARE)), default="auto", show_default=True,
                         help="Hardware list to run: config-<hw>.txt. auto detects the GPU (none -> cpu).")
root_option = click.option("--root", type=click.Path(file_okay=False), default=None,
                           help="Folder holding config-<hw>.txt (default: current folder, else the checkout).")


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="moe-eval")
def cli() -> None:
    """Accuracy-regression harness for BF16 MoE kernels: serve with vLLM, run GSM8K, gate."""


@cli.command()
@hw_option
@root_option
@click.argument("configs", nargs=-1, type=click.Path(dir_okay=False))
@click.option("--shard", "shard_text", default=None, help="Run shard i of n of the list (i/n, 0-based).")
@click.option("--gsm8k-dir", envvar="MOE_EVAL_GSM8K_DIR", default=None,
              help="Folder with GSM8K train.jsonl and test.jsonl; offline. Default: the hub.")
@click.option("--output-dir", default="moe-eval-results", show_default=True,
              help="Each run writes a new timestamped folder here.")
@click.option("--port", type=click.IntRange(1, 65535), default=None, help="Server port (default: a free one).")
@click.option("--limit", type=click.IntRange(1, 1319), default=None,
              help="Evaluate at most this many questions per config (overrides num_questions; recorded).")
@click.option("--junit", "junit_path", type=click.Path(dir_okay=False), default=None,
              help="Also write JUnit XML here (one testcase per config, named after its file stem).")
@click.option("--mutate", "mutation", default=None, metavar="NAME",
              help="Run the bundled kernel with a deliberate bug (swap_gate_up, ignore_routing_weights, "
                   "shift_expert_ids, ignore_expert_map) to check that the gate catches it.")
@click.option("--baseline", "baseline_path", type=click.Path(exists=True), default=None,
              help="A run folder (or results.json) of the same model and questions: adds the paired gate.")
def run(hw: str, root: str | None, configs: tuple[str, ...], shard_text: str | None, gsm8k_dir: str | None,
        output_dir: str, port: int | None, limit: int | None, junit_path: str | None, mutation: str | None,
        baseline_path: str | None) -> None:
    """Serve each selected config with vLLM, run GSM8K through lm-eval, gate, report."""
    from moe_eval.checks import find_baseline
    from moe_eval.gsm8k import gsm8k_data
    from moe_eval.hardware import gpu_names
    from moe_eval.report import print_table
    from moe_eval.results import atomic_write_text
    from moe_eval.runner import RunOptions, preflight, run_config

    gpu_list = gpu_names()  # read once: it picks the hardware list, then preflight and the records use it
    hw = resolve_hw(hw, gpu_list)
    selected, source = select_configs(hw, configs, shard_text, root)
    if limit is not None:
        import dataclasses

        selected = [dataclasses.replace(c, num_questions=min(limit, c.num_questions)) for c in selected]
    data = gsm8k_data(gsm8k_dir)
    for config in selected:
        preflight(config, hw, len(gpu_list), mutation)
    baselines = {c.path: find_baseline(Path(baseline_path).resolve(), c) for c in selected} if baseline_path else {}
    run_root = Path(output_dir).resolve() / time.strftime("%Y%m%d-%H%M%S")
    suffix = 1
    while run_root.exists():
        run_root = run_root.with_name(f"{run_root.name.split('.')[0]}.{suffix}")
        suffix += 1
    run_root.mkdir(parents=True)
    atomic_write_text(run_root / "command.txt", " ".join(sys.argv) + "\n")
    progress(f"{len(selected)} config(s) from {source} on {hw}; results in {run_root}")

    options = RunOptions(hw=hw, run_root=run_root, data=data, port=port, progress=progress, baselines=baselines,
                         mutation=mutation, gpus=tuple(gpu_list))
    outcomes = []
    try:
        for i, config in enumerate(selected, start=1):
            progress(f"[{i}/{len(selected)}] {config.path}")
            outcome = run_config(config, options)
            outcomes.append(outcome)
            if outcome.error:
                progress(f"  ERROR: {outcome.error}")
            for check in outcome.checks:
                progress(f"  {check.name}: {check.detail}")
    finally:  # also on Ctrl-C and errors: what finished is reported
        write_run_reports(run_root, outcomes, complete=len(outcomes) == len(selected), hw=hw, source=source,
                          junit_path=junit_path, gpus=gpu_list)
    print_table(outcomes, rich_output=sys.stdout.isatty())
    progress(f"results: {run_root}")
    if any(o.status == "error" for o in outcomes):
        sys.exit(ExitCode.INFRA)
    if any(o.status == "failed" for o in outcomes):
        sys.exit(ExitCode.GATE_FAILED)


def write_run_reports(run_root: Path, outcomes: list, *, complete: bool, hw: str, source: str,
                      junit_path: str | None, gpus: list[str]) -> None:
    """summary.json and summary.md in the run folder, the JUnit file, GitHub's step summary."""
    import os

    from moe_eval.report import markdown
    from moe_eval.results import atomic_write_json, atomic_write_text

    summary = {"hw": hw, "source": source, "run_root": str(run_root), "complete": complete,
               "configs": [{"config": str(o.config.path), "status": o.status, "run_dir": str(o.run_dir),
                            "error": o.error, "gate": o.gate.as_dict() if o.gate else None,
                            "checks": [c.as_dict() for c in o.checks], "moe_backend_used": o.moe_backend_used}
                           for o in outcomes]}
    atomic_write_json(run_root / "summary.json", summary)
    if not outcomes:
        return
    table = markdown(outcomes)
    atomic_write_text(run_root / "summary.md", table)
    if junit_path:
        from moe_eval.junit import write_junit

        write_junit(Path(junit_path), outcomes, hw, gpus)
    step_summary = os.environ.get("GITHUB_STEP_SUMMARY")
    if step_summary:  # GitHub Actions renders this file on the job's page
        with open(step_summary, "a") as fh:
            fh.write(f"## moe-eval GSM8K ({hw})\n\n{table}\n")


@cli.command(name="list")
@hw_option
@root_option
@click.option("--shard", "shard_text", default=None, help="Show shard i of n (i/n, 0-based).")
def list_configs(hw: str, root: str | None, shard_text: str | None) -> None:
    """Show what `run` would run: config, model, layout, devices (GPUs, or CPU ranks) needed, backend, gate."""
    hw = resolve_hw(hw)
    selected, source = select_configs(hw, (), shard_text, root)
    click.echo(f"# {source}")
    click.echo(f"config\tmodel\tlayout\t{'cpu_ranks' if hw == 'cpu' else 'gpus'}\tmoe_backend\tthreshold\tquestions")
    for c in selected:
        click.echo(f"{c.path.parent.name}/{c.path.name}\t{c.model_name}\t{c.layout.describe()}\t{c.layout.world_size}\t"
                   f"{c.moe_backend or 'vllm-default'}\t{c.accuracy_threshold}\t{c.num_questions}")


@cli.command()
@root_option
def validate(root: str | None) -> None:
    """Check every config under configs/ and every config-*.txt list; print all problems."""
    from moe_eval.validate import validate_repository

    base = Path(root).resolve() if root else (Path.cwd() if (Path.cwd() / "configs").is_dir() else REPO_ROOT)
    problems, checked = validate_repository(base)
    for problem in problems:
        click.echo(f"error: {problem}", err=True)
    if problems:
        click.echo(f"{len(problems)} problem(s) in {checked} file(s)", err=True)
        sys.exit(ExitCode.CONFIG)
    click.echo(f"ok: {checked} file(s) valid")


@cli.command()
@click.argument("results", nargs=-1, required=True, type=click.Path())
@click.option("--format", "fmt", type=click.Choice(("auto", "markdown", "rich")), default="auto", show_default=True,
              help="auto: rich on a terminal, Markdown (ready to paste into a pull request) otherwise.")
def compare(results: tuple[str, ...], fmt: str) -> None:
    """Side-by-side accuracy of run folders or results.json files, one table per model."""
    from moe_eval import compare as cmp

    groups = cmp.group_runs([Path(r) for r in results])
    if fmt == "rich" or (fmt == "auto" and sys.stdout.isatty()):
        cmp.print_rich(groups)
    else:
        click.echo(cmp.markdown(groups), nl=False)


class _Terminated(Exception):
    """SIGTERM, turned into an exception so that every `finally` (server teardown) runs."""


def _on_sigterm(signum: int, frame: object) -> None:
    raise _Terminated()


def main(argv: list[str] | None = None) -> None:
    signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        cli.main(args=argv, prog_name="moe-eval", standalone_mode=False)
    except click.exceptions.Exit as exc:
        sys.exit(exc.exit_code)
    except click.exceptions.Abort:
        click.echo("moe-eval: interrupted", err=True)
        sys.exit(130)
    except click.ClickException as exc:  # usage errors: clicks says 2, we say 4 (config/usage)
        exc.show()
        sys.exit(ExitCode.CONFIG)
    except MoeEvalError as exc:
        click.echo(f"moe-eval: error: {exc}", err=True)
        sys.exit(exc.exit_code)
    except (KeyboardInterrupt, _Terminated):
        click.echo("moe-eval: interrupted; servers torn down, partial results kept", err=True)
        sys.exit(130)
    except Exception:  # noqa: BLE001  a bug of ours must never read as exit 1 ("accuracy gate failed")
        import traceback

        traceback.print_exc()
        click.echo("moe-eval: internal error (see the traceback above); reported as an infrastructure error",
                   err=True)
        sys.exit(ExitCode.INFRA)
