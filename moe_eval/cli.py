"""moe-eval command line: `run`, `list`, `validate`, `compare`.

stdout carries results (tables); stderr carries progress. Exit codes are in moe_eval.core.errors:
0 all passed, 1 a gate failed, 3 infrastructure error, 4 config/usage error, 5 nothing selected,
130 cancelled (SIGTERM or Ctrl-C; servers torn down, partial results kept).
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import click

from moe_eval.configs.config import EvalConfig
from moe_eval.configs.selection import HARDWARE
from moe_eval.core.errors import ConfigError, ExitCode, InfraError, MoeEvalError
from moe_eval.core.status import progress_line
from moe_eval.gates.registry import gate_names
from moe_eval.run_plan import REPO_ROOT, make_plan, select_configs
from moe_eval.serve import cancel
from moe_eval.serve.cancel import EXIT_CANCELLED


def progress(message: str) -> None:
    click.echo(progress_line(message), err=True)


def resolve_hw(hw: str, gpus: list[str] | None = None) -> str:
    """`gpus`: gpu_names()'s answer when the caller has it (saves a second nvidia-smi)."""
    if hw != "auto":
        return hw
    from moe_eval.configs.hardware import detect_hardware

    return detect_hardware(gpus)


hw_option = click.option(
    "--hw",
    type=click.Choice(("auto", *HARDWARE)),
    default="auto",
    show_default=True,
    help="Hardware list to run: config-<hw>.txt. auto detects the GPU (none -> cpu).",
)
list_option = click.option(
    "--list",
    "list_path",
    type=click.Path(dir_okay=False),
    default=None,
    help="A list file of configs to use instead of config-<hw>.txt (e.g. config-gpu-canary.txt).",
)
golden_cache_option = click.option(
    "--golden-cache",
    "golden_cache",
    envvar="MOE_EVAL_GOLDEN_CACHE",
    type=click.Path(file_okay=False),
    default=None,
    help="Folder of golden references (kept between CI runs); default ~/.cache/moe-eval/goldens.",
)
# Options `run` and `list` share: the same values give the same gate plan in both.
gsm8k_dir_option = click.option(
    "--gsm8k-dir",
    envvar="MOE_EVAL_GSM8K_DIR",
    default=None,
    help="Folder with GSM8K train.jsonl and test.jsonl; offline. Default: the hub.",
)
baseline_option = click.option(
    "--baseline",
    "baseline_path",
    type=click.Path(exists=True),
    default=None,
    help="A run folder (or results.json) of the same model and questions: adds the paired gate.",
)
optional_gate_option = click.option(
    "--optional-gate",
    "optional_gates",
    multiple=True,
    type=click.Choice(gate_names()),
    metavar="GATE",
    help="A gate (as `moe-eval list` names it) that may end 'not run' without making the run incomplete "
    "(exit 6); repeatable. Configs declare theirs with the optional_gates key.",
)

root_option = click.option(
    "--root",
    type=click.Path(file_okay=False),
    default=None,
    help="Folder holding config-<hw>.txt (default: current folder, else the checkout).",
)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="moe-eval")
def cli() -> None:
    """Accuracy-regression harness for BF16 MoE kernels: serve with vLLM, run GSM8K, gate."""


def jobs_value(text: str) -> int | None:
    """--jobs: a positive integer, or auto (None: as many as the free devices allow)."""
    if text == "auto":
        return None
    if not text.isdigit() or int(text) < 1:
        raise ConfigError(f"--jobs: value '{text}' must be a positive integer or auto")
    return int(text)


def shard_from_environment(shard_text: str | None) -> str | None:
    """--shard, else Buildkite's parallel job index and count (BUILDKITE_PARALLEL_JOB[_COUNT])."""
    if shard_text:
        return shard_text
    index, count = os.environ.get("BUILDKITE_PARALLEL_JOB"), os.environ.get("BUILDKITE_PARALLEL_JOB_COUNT")
    if index is None and count is None:
        return None
    if index is None or count is None:
        raise ConfigError(
            "BUILDKITE_PARALLEL_JOB and BUILDKITE_PARALLEL_JOB_COUNT must be set together "
            f"(got {index!r} and {count!r})"
        )
    return f"{index}/{count}"


@cli.command()
@hw_option
@root_option
@click.argument("configs", nargs=-1, type=click.Path(dir_okay=False))
@list_option
@click.option(
    "--shard",
    "shard_text",
    default=None,
    help="Run shard i of n of the list (i/n, 0-based); default: Buildkite's BUILDKITE_PARALLEL_JOB/_COUNT.",
)
@gsm8k_dir_option
@click.option(
    "--output-dir",
    default="moe-eval-results",
    show_default=True,
    help="Each run writes a new timestamped folder here.",
)
@click.option(
    "--port",
    type=click.IntRange(1, 65535),
    default=None,
    help="Server port (default: a free one); with --jobs > 1, config i of the list uses port + i.",
)
@click.option(
    "--limit",
    type=click.IntRange(1, 1319),
    default=None,
    help="Evaluate at most this many questions per config (overrides num_questions; recorded).",
)
@click.option(
    "--junit",
    "junit_path",
    type=click.Path(dir_okay=False),
    default=None,
    help="Also write JUnit XML here (one testcase per config, named after its file stem).",
)
@click.option(
    "--mutate",
    "mutation",
    default=None,
    metavar="NAME",
    help="Run the bundled kernel with a deliberate bug (see README) to check that the gates catch it.",
)
@baseline_option
@click.option(
    "--jobs",
    "jobs_text",
    default="1",
    show_default=True,
    metavar="N|auto",
    help="Configs served at once, each on its own GPUs (or CPU cores); auto: as many as the free "
    "devices allow. 1 gives each server the whole machine.",
)
@click.option(
    "--retries",
    type=click.IntRange(0, 10),
    default=0,
    show_default=True,
    help="Run a config that ended in an infrastructure error again, with a fresh server, up to N times.",
)
@golden_cache_option
@optional_gate_option
@click.option(
    "--resume",
    "resume_dir",
    type=click.Path(file_okay=False, exists=True),
    default=None,
    help="Finish this run folder: configs whose results there passed or failed with the same config, "
    "versions and questions are kept; the rest run; one summary covers all.",
)
@click.option(
    "--dry-run",
    is_flag=True,
    default=False,
    help="Print the plan (what `moe-eval list` prints for the same options) and stop: no server starts, "
    "and this machine's devices and ports are not checked.",
)
def run(
    hw: str,
    root: str | None,
    configs: tuple[str, ...],
    list_path: str | None,
    shard_text: str | None,
    gsm8k_dir: str | None,
    output_dir: str,
    port: int | None,
    limit: int | None,
    junit_path: str | None,
    mutation: str | None,
    baseline_path: str | None,
    jobs_text: str,
    retries: int,
    golden_cache: str | None,
    optional_gates: tuple[str, ...],
    resume_dir: str | None,
    dry_run: bool,
) -> None:
    """Serve each selected config with vLLM, run GSM8K through lm-eval, gate, report."""
    from moe_eval.configs.devices import cpu_pool, gpu_pool
    from moe_eval.configs.hardware import gpu_names
    from moe_eval.core.results import append_text, atomic_write_text
    from moe_eval.report.progress_view import ProgressView
    from moe_eval.report.table import print_table
    from moe_eval.runner import preflight
    from moe_eval.scheduler import Planned, Scheduler, SchedulerOptions
    from moe_eval.worker import Job

    jobs = jobs_value(jobs_text)
    gpu_list = gpu_names()  # read once: it picks the hardware list, then preflight and the records use it
    hw = resolve_hw(hw, gpu_list)
    plan = make_plan(
        hw, configs, list_path, shard_from_environment(shard_text), root, gsm8k_dir, baseline_path,
        optional_gates, limit, mutation,
    )  # fmt: skip
    dependencies, data, selected, source = plan.dependencies, plan.data, plan.configs, plan.source
    if mutation is not None and all(config_mutation is None for config_mutation in plan.mutations):
        raise ConfigError(
            f"--mutate {mutation}: no selected config runs a bundled kernel (moe_backend); "
            "mutations apply to the bundled kernels only"
        )
    if dry_run:  # the planning step alone: what `moe-eval list` prints for the same options
        plan.probe_hub()
        print_plan(plan)
        return
    for config, config_mutation in zip(selected, plan.mutations, strict=True):
        preflight(config, hw, len(gpu_list), config_mutation)
    pool = cpu_pool() if hw == "cpu" else gpu_pool()
    planned = [
        Planned(i, c, pool.units_for(c.layout.world_size, jobs), dependencies.get(i))
        for i, c in enumerate(selected)
    ]
    if jobs != 1:
        check_fits(planned, pool)
    # After the usage checks (exit 4); known now, not after a server has started and lm-eval has retried.
    plan.probe_hub()
    if plan.data_stop():
        raise InfraError(plan.data_stop())
    run_root = Path(resume_dir).resolve() if resume_dir else new_run_root(Path(output_dir).resolve())
    mutations = plan.mutations
    resumed = resumable_outcomes(run_root, selected, data, mutations, dependencies) if resume_dir else None
    kept = resumed.kept if resumed else {}
    append_text(run_root / "command.txt", " ".join(sys.argv) + "\n")
    atomic_write_text(run_root / "plan.tsv", "\n".join(plan.table()) + "\n")
    for note in plan.notes:
        progress(note)
    for i, why in (resumed.rerun if resumed else {}).items():
        progress(f"--resume: runs {selected[i].name}: {why}")
    progress(
        f"{len(selected)} config(s) from {source} on {hw}; results in {run_root}"
        + (f"; {len(kept)} kept from the earlier run" if kept else "")
        + (
            f"; up to {jobs or 'auto'} at once on {pool.kind} {','.join(map(str, pool.ids))}"
            if jobs != 1
            else ""
        )
    )
    job = Job(
        config_path="",
        run_root=str(run_root),
        hw=hw,
        parent_pid=os.getpid(),
        limit=limit,
        gsm8k_dir=str(data.dir) if data.dir is not None else None,
        mutation=mutation,
        baseline=str(Path(baseline_path).resolve()) if baseline_path else None,
        gpus=list(gpu_list),
        golden_cache=str(Path(golden_cache).resolve()) if golden_cache else None,
        optional_gates=list(optional_gates),
    )
    view = ProgressView(len(selected), pool.kind)
    scheduler = Scheduler(
        [p for p in planned if p.index not in kept],
        SchedulerOptions(job=job, pool=pool, jobs=jobs, retries=retries, port_base=port),
        view,
    )
    try:
        done = scheduler.run()
    finally:
        view.close()
    outcomes = {**kept, **done}
    ordered = [outcomes[i] for i in range(len(selected)) if i in outcomes]
    not_started = [selected[i] for i in range(len(selected)) if i not in outcomes]
    write_run_reports(
        run_root,
        ordered,
        not_started,
        hw=hw,
        source=source,
        junit_path=junit_path,
        gpus=gpu_list,
        cancelled_by=scheduler.cancelled_by,
    )
    print_table(ordered, rich_output=sys.stdout.isatty())
    progress(f"results: {run_root}")
    if scheduler.cancelled_by is not None:
        progress(f"cancelled by {scheduler.cancelled_by}: servers torn down, partial results kept")
        sys.exit(EXIT_CANCELLED)
    if any(o.status in ("error", "cancelled") for o in ordered) or not_started:
        sys.exit(ExitCode.INFRA)
    if any(o.status == "failed" for o in ordered):
        sys.exit(ExitCode.GATE_FAILED)
    if any(o.status == "incomplete" for o in ordered):
        sys.exit(ExitCode.GATE_NOT_RUN)


def check_fits(planned: list, pool) -> None:
    """With shared devices, every config must fit the free ones (else it would wait forever)."""
    for p in planned:
        if p.units > len(pool.ids):
            busy = f"; busy (another process uses them): {','.join(map(str, pool.busy))}" if pool.busy else ""
            raise ConfigError(
                f"{p.config.path}: layout {p.config.layout.describe()} needs {p.units} "
                f"{'GPUs' if pool.kind == 'gpu' else 'CPU cores'}; free here: "
                f"{','.join(map(str, pool.ids)) or 'none'}{busy}"
            )


def new_run_root(output_dir: Path) -> Path:
    run_root = output_dir / time.strftime("%Y%m%d-%H%M%S")
    suffix = 1
    while run_root.exists():
        run_root = run_root.with_name(f"{run_root.name.split('.')[0]}.{suffix}")
        suffix += 1
    run_root.mkdir(parents=True)
    return run_root


@dataclass(frozen=True)
class Resumed:
    """What --resume does with each selected config: kept (index -> its outcome from the earlier run) or run
    again (index -> why, said before anything starts: a user who resumed expects a row to be kept)."""

    kept: dict[int, object]
    rerun: dict[int, str]


def resumable_outcomes(
    run_root: Path,
    selected: list[EvalConfig],
    data,
    mutations: list[str | None] | None = None,
    dependencies: dict[int, int] | None = None,
) -> Resumed:
    """Configs of `selected` whose results.json in run_root holds a verdict for the same config file
    (sha256), the same versions, the same questions and the same mutation (vLLM's own kernel is never
    mutated, so its rows carry over into a `--mutate` run), and whose baseline_config (dependencies:
    index -> its baseline's index, baselines first) is kept too: a row compared with a baseline that runs
    again would keep a verdict against numbers that no longer exist. The others' old files move to
    attempts/. mutations: each selected config's own mutation, as effective_config gave it."""
    from moe_eval.core.record import RESULTS_FILE, RunRecord
    from moe_eval.runner import ConfigOutcome, config_run_dir
    from moe_eval.scheduler import ATTEMPTS_DIR, move_run_files

    kept, rerun = {}, {}
    for i, config in enumerate(selected):
        run_dir = config_run_dir(run_root, config)
        record = RunRecord.read_if_any(run_dir / RESULTS_FILE)
        baseline = (dependencies or {}).get(i)
        why = _why_not_kept(record, config, data, mutations[i] if mutations else None)
        if why is None and baseline is not None and baseline not in kept:
            why = f"its baseline_config {selected[baseline].name} runs again"
        if why is None:
            outcome = ConfigOutcome.from_record(config, run_dir, record)
            outcome.resumed = True
            kept[i] = outcome
            continue
        rerun[i] = why
        if run_dir.is_dir() and any(e.name != ATTEMPTS_DIR for e in run_dir.iterdir()):
            earlier = sorted(int(p.name) for p in (run_dir / ATTEMPTS_DIR).glob("*") if p.name.isdigit())
            move_run_files(run_dir, run_dir / ATTEMPTS_DIR / str((earlier[-1] if earlier else 0) + 1))
    return Resumed(kept, rerun)


def _why_not_kept(record, config: EvalConfig, data, mutation: str | None) -> str | None:
    """Why the earlier run's row of `config` cannot stand for this run (None: it can)."""
    from moe_eval.core.check import FAILED, PASSED
    from moe_eval.core.results import rules_digest, versions
    from moe_eval.evaluate.gsm8k import questions_difference
    from moe_eval.runner import task_data

    if record is None:
        return "the earlier run has no results of it"
    # An incomplete row runs again: what kept a gate from running (the hub, an incumbent) may be mended since.
    if record.status not in (PASSED, FAILED):
        return f"it ended {record.status}"
    if record.identity.config_sha256 != config.sha256:
        return "its config file changed"
    now = versions()
    if record.environment.versions != now:
        was = record.environment.versions or {}
        moved = sorted(k for k in set(was) | set(now) if was.get(k) != now.get(k))
        return "versions differ: " + ", ".join(f"{k} {was.get(k)} -> {now.get(k)}" for k in moved)
    if record.environment.rules != rules_digest():
        # Judged by other gates than this moe-eval's (its version does not move with them): judged again.
        then = record.environment.rules or "not recorded"
        return f"judged by other rules (the judging code's digest {then} then, {rules_digest()} now)"
    if record.evaluation.num_questions_evaluated != config.num_questions:
        return f"{record.evaluation.num_questions_evaluated} questions then, {config.num_questions} now"
    questions = questions_difference(record.environment.gsm8k, task_data(config, data).describe())
    if questions is not None:
        return questions
    if record.mutation != mutation:
        return f"mutation {record.mutation} then, {mutation} now"
    # The same file can ask for other concurrency when the default moved (16 -> 256 on GPUs, 2026-12-05):
    # a kept row beside a new one would pair answers made in other batches.
    then = (record.identity.config or {}).get("max_concurrency")
    if then is not None and then != config.max_concurrency:
        return f"max_concurrency {then} then, {config.max_concurrency} now"
    return None


def write_run_reports(
    run_root: Path,
    outcomes: list,
    not_started: list,
    *,
    hw: str,
    source: str,
    junit_path: str | None,
    gpus: list[str],
    cancelled_by: str | None = None,
) -> None:
    """summary.json and summary.md in the run folder, the JUnit file, GitHub's step summary."""
    from moe_eval.core.record import RunSummary, SummaryEntry
    from moe_eval.core.results import atomic_write_text
    from moe_eval.report.table import markdown

    RunSummary(
        hw=hw,
        source=source,
        run_root=str(run_root),
        complete=not not_started and all(o.status != "cancelled" for o in outcomes),
        cancelled_by=cancelled_by,
        configs=[
            SummaryEntry(
                config=str(o.config.path),
                status=o.status,
                run_dir=str(o.run_dir),
                error=o.error,
                gate=o.section("gate"),
                checks=o.checks,
                moe_backend_used=o.moe_backend_used,
                attempts=len(o.attempts) + 1,
                resumed=o.resumed,
            )
            for o in outcomes
        ]
        + [SummaryEntry(config=str(c.path), status="not_started") for c in not_started],
    ).write(run_root)
    if not outcomes:
        return
    table = markdown(outcomes)
    atomic_write_text(run_root / "summary.md", table)
    if junit_path:
        from moe_eval.report.junit import write_junit

        write_junit(Path(junit_path), outcomes, hw, gpus)
    step_summary = os.environ.get("GITHUB_STEP_SUMMARY")
    if step_summary:  # GitHub Actions renders this file on the job's page
        with open(step_summary, "a") as fh:
            fh.write(f"## moe-eval GSM8K ({hw})\n\n{table}\n")


@cli.command()
@hw_option
@root_option
@click.argument("configs", nargs=-1, type=click.Path(dir_okay=False))
@list_option
@click.option(
    "--gsm8k-dir",
    envvar="MOE_EVAL_GSM8K_DIR",
    default=None,
    help="Folder with GSM8K train.jsonl and test.jsonl (the texts the goldens score).",
)
@golden_cache_option
@click.option("--refresh", is_flag=True, help="Make the goldens anew even where the cache holds them.")
@click.option(
    "--output-dir",
    default="moe-eval-results",
    show_default=True,
    help="The golden servers' logs go to <output-dir>/goldens-<timestamp>/.",
)
def golden(
    hw: str,
    root: str | None,
    configs: tuple[str, ...],
    list_path: str | None,
    gsm8k_dir: str | None,
    golden_cache: str | None,
    refresh: bool,
    output_dir: str,
) -> None:
    """Make the golden references the selected configs' golden gate needs (ahead of `run`, e.g. in CI's
    cache step); each is made once per key and kept in the golden cache."""
    from moe_eval.configs.hardware import gpu_names
    from moe_eval.evaluate.golden import GoldenStore, ServerPlace, cache_dir, ensure_golden
    from moe_eval.evaluate.golden_for_row import golden_spec_on
    from moe_eval.evaluate.gsm8k import gsm8k_data
    from moe_eval.models.builtin import resolve_model
    from moe_eval.runner import task_data

    gpu_list = gpu_names()
    hw = resolve_hw(hw, gpu_list)
    selected, source = select_configs(hw, configs, None, root, list_path)
    gated = [c for c in selected if c.golden_gated]
    if not gated:
        raise ConfigError(
            f"no config of {source} has the golden gate (a moe_backend, logprob_texts > 0, golden on)"
        )
    data = gsm8k_data(gsm8k_dir)
    store = GoldenStore(cache_dir(golden_cache))
    logs = new_run_root(Path(output_dir).resolve())
    specs = {}
    for config in gated:
        model = resolve_model(config.model_name)
        spec = golden_spec_on(config, task_data(config, data), model, hw, tuple(gpu_list), store)
        specs.setdefault(spec.key.digest, (spec, config, []))[2].append(config)
    progress(f"{len(specs)} golden reference(s) for {len(gated)} config(s) of {source}; cache {store.root}")
    click.echo("golden	made	seconds	model	server_args	configs	path")
    for digest, (spec, config, users) in specs.items():
        place = ServerPlace(hw=hw, devices=None, gpus=len(gpu_list), log_dir=logs / digest, progress=progress)
        started = time.monotonic()
        found, made = ensure_golden(spec, config, place, store, refresh=refresh)
        click.echo(
            "\t".join(
                [
                    digest,
                    "made" if made else "cached",
                    f"{time.monotonic() - started:.0f}",
                    config.model_name,
                    " ".join(spec.server_argv),
                    ",".join(c.path.stem for c in users),
                    str(found.path),
                ]
            )
        )


@cli.command(name="list")
@hw_option
@root_option
@list_option
@click.option("--shard", "shard_text", default=None, help="Show shard i of n (i/n, 0-based).")
@gsm8k_dir_option
@baseline_option
@optional_gate_option
def list_configs(
    hw: str,
    root: str | None,
    list_path: str | None,
    shard_text: str | None,
    gsm8k_dir: str | None,
    baseline_path: str | None,
    optional_gates: tuple[str, ...],
) -> None:
    """Show what `run` would run, with the same options: config, model, layout, devices (GPUs, or CPU
    ranks) needed, backend, and each gate as it would run (not run or skipped, and why)."""
    plan = make_plan(
        resolve_hw(hw), (), list_path, shard_from_environment(shard_text), root, gsm8k_dir, baseline_path,
        optional_gates,
    )  # fmt: skip
    plan.probe_hub()
    print_plan(plan)


def print_plan(plan) -> None:
    """The plan on stdout (tab-separated), the run's stop before any server on stderr: `list`, `run
    --dry-run`."""
    if plan.hub_problem:
        click.echo(
            f"# run would stop before any server starts (exit 3): GSM8K cannot be had: {plan.hub_problem}",
            err=True,
        )
    for line in plan.table():
        click.echo(line)


@cli.command()
@root_option
def validate(root: str | None) -> None:
    """Check every config under configs/ and every config-*.txt list; print all problems."""
    from moe_eval.configs.validate import validate_repository

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
@click.option(
    "--format",
    "fmt",
    type=click.Choice(("auto", "markdown", "rich")),
    default="auto",
    show_default=True,
    help="auto: rich on a terminal, Markdown (ready to paste into a pull request) otherwise.",
)
@click.option(
    "--reference",
    default="vllm",
    show_default=True,
    metavar="vllm|first|N|TEXT",
    help="The column the flips, Δ log p and golden-error ratios are against: vllm (the first "
    "column running vLLM's own MoE kernel, else the first), first, a 1-based column number, "
    "or a part of exactly one column's label.",
)
def compare(results: tuple[str, ...], fmt: str, reference: str) -> None:
    """Side-by-side accuracy of run folders or results.json files, one table per model."""
    from moe_eval.report import compare as cmp

    groups = cmp.group_runs([Path(r) for r in results])
    if fmt == "rich" or (fmt == "auto" and sys.stdout.isatty()):
        cmp.print_rich(groups, reference)
    else:
        click.echo(cmp.markdown(groups, reference), nl=False)


def main(argv: list[str] | None = None) -> None:
    # SIGTERM and Ctrl-C alike: cancel, tear down, exit 130 (the scheduler takes over while it runs).
    cancel.install()
    try:
        cli.main(args=argv, prog_name="moe-eval", standalone_mode=False)
    except click.exceptions.Exit as exc:
        sys.exit(exc.exit_code)
    except click.exceptions.Abort:
        click.echo("moe-eval: interrupted", err=True)
        sys.exit(EXIT_CANCELLED)
    except click.ClickException as exc:  # usage errors: clicks says 2, we say 4 (config/usage)
        exc.show()
        sys.exit(ExitCode.CONFIG)
    except MoeEvalError as exc:
        click.echo(f"moe-eval: error: {exc}", err=True)
        sys.exit(exc.exit_code)
    except KeyboardInterrupt as exc:  # before the scheduler started anything, or the reports: nothing is left
        name = exc.signal_name if isinstance(exc, cancel.Cancelled) else "SIGINT"
        click.echo(f"moe-eval: cancelled by {name}; nothing was left running", err=True)
        sys.exit(EXIT_CANCELLED)
    except Exception:  # noqa: BLE001  a bug of ours must never read as exit 1 ("accuracy gate failed")
        import traceback

        traceback.print_exc()
        click.echo(
            "moe-eval: internal error (see the traceback above); reported as an infrastructure error",
            err=True,
        )
        sys.exit(ExitCode.INFRA)
