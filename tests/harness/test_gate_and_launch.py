"""The gate's arithmetic and the launcher's pure helpers (environment, CPU binding, allowlist)."""

from pathlib import Path

import pytest

from moe_eval.gates.accuracy import GateResult
from moe_eval.launch import allowlisted_env, cpu_bind_per_rank, server_environment
from moe_eval.serve.server_log import speed_warnings, vllm_moe_backends


@pytest.mark.parametrize(
    "accuracy, passed", [(0.80, True), (0.7999999999999999, True), (0.79, False), (0.95, True)]
)
def test_gate_is_threshold_minus_tolerance(accuracy, passed):
    gate = GateResult(accuracy=accuracy, stderr=0.01, threshold=0.88, tolerance=0.08)
    assert gate.passed is passed
    assert gate.floor == pytest.approx(0.80)


def test_margin_in_standard_errors():
    gate = GateResult(accuracy=0.83, stderr=0.01, threshold=0.88, tolerance=0.08)
    assert gate.margin_in_stderr == pytest.approx(3.0)
    assert GateResult(accuracy=0.0, stderr=0.0, threshold=0.0, tolerance=0.08).margin_in_stderr is None
    assert "FAIL" in GateResult(accuracy=0.5, stderr=0.01, threshold=0.88, tolerance=0.08).describe()


@pytest.mark.parametrize(
    "cores, ranks, expected",
    [
        ([0, 1], 2, "0|1"),
        (list(range(8)), 2, "0-3|4-7"),
        ([0], 2, "0|0"),
        (list(range(6)), 3, "0-1|2-3|4-5"),
        ([1], 1, "1"),  # a packed TP1 server on the second core (run --jobs 2)
        ([2, 3, 6, 7], 2, "2-3|6-7"),
        ([1, 3], 1, "1,3"),  # cores this process may use need not be contiguous
    ],
)
def test_cpu_bind_per_rank(cores, ranks, expected):
    assert cpu_bind_per_rank(cores, ranks) == expected


def test_server_environment_defaults_and_config_wins(tmp_path: Path):
    base = {"PATH": "/bin"}
    env = server_environment(base, {}, on_cpu=True, world_size=2, run_dir=tmp_path)
    assert env["VLLM_WORKER_MULTIPROC_METHOD"] == "spawn" and env["VLLM_CPU_KVCACHE_SPACE"]
    assert "VLLM_CPU_OMP_THREADS_BIND" in env and env["MOE_EVAL_RUN_DIR"] == str(tmp_path)
    env = server_environment(
        base, {"VLLM_CPU_KVCACHE_SPACE": "7"}, on_cpu=True, world_size=1, run_dir=tmp_path
    )
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "7" and "VLLM_CPU_OMP_THREADS_BIND" not in env
    gpu_env = server_environment(base, {}, on_cpu=False, world_size=2, run_dir=tmp_path)
    assert "VLLM_CPU_KVCACHE_SPACE" not in gpu_env and "CUDA_VISIBLE_DEVICES" not in gpu_env
    # Packed servers (run --jobs): each gets its own GPUs, or its own cores even at TP1.
    assert (
        server_environment(base, {}, on_cpu=False, world_size=2, run_dir=tmp_path, devices=(2, 3))[
            "CUDA_VISIBLE_DEVICES"
        ]
        == "2,3"
    )
    assert (
        server_environment(base, {}, on_cpu=True, world_size=1, run_dir=tmp_path, devices=(1,))[
            "VLLM_CPU_OMP_THREADS_BIND"
        ]
        == "1"
    )
    assert base == {"PATH": "/bin"}  # the caller's environment is not modified


def test_the_layer_check_follows_the_config_not_the_caller(tmp_path: Path):
    """Only the config's `layer_check` decides: an inherited MOE_EVAL_LAYER_CHECK=0 never switches it off."""
    base = {"PATH": "/bin", "MOE_EVAL_LAYER_CHECK": "0"}
    on = server_environment(base, {}, on_cpu=True, world_size=1, run_dir=tmp_path, moe_backend="torch")
    off = server_environment(
        base, {}, on_cpu=True, world_size=1, run_dir=tmp_path, moe_backend="torch", layer_check=False
    )
    assert "MOE_EVAL_LAYER_CHECK" not in on and off["MOE_EVAL_LAYER_CHECK"] == "0"


def test_allowlisted_env_never_records_secrets():
    env = {
        "VLLM_X": "1",
        "HF_TOKEN": "s",
        "VLLM_API_KEY": "s",
        "HOME": "/root",
        "CUDA_VISIBLE_DEVICES": "0,1",
    }
    assert allowlisted_env(env) == {"CUDA_VISIBLE_DEVICES": "0,1", "VLLM_X": "1"}


def test_vllm_backend_line_is_parsed():
    log = (
        "(Worker pid=1) INFO [unquantized.py:364] Using CPU Unquantized MoE backend out of potential "
        "backends: ['CPU'].\n(Worker pid=2) INFO Using CPU Unquantized MoE backend out of potential "
        "backends: ['CPU'].\n"
    )
    assert vllm_moe_backends(log) == ["CPU"]
    assert vllm_moe_backends("nothing here") == []


def test_flashinfers_autotune_falling_back_is_read_from_the_log_once_with_its_count():
    # vLLM 0.26.0's words, two literals joined with no space between them (kernel_warmup.py)
    warning = (
        "WARNING [kernel_warmup.py:258] No FlashInfer autotune cache entries found."
        "Falling back to default tactics."
    )
    log = f"(Worker pid=1) {warning}\nINFO ready\n(Worker pid=2) {warning}\n"
    untuned = ["No FlashInfer autotune cache entries found.Falling back to default tactics. (2x)"]
    assert speed_warnings(log, "bundled:flashinfer_cutlass") == untuned
    assert speed_warnings(log, "vllm:FlashInfer CUTLASS") == untuned
    # A Triton row's server logs the same words (FlashInfer importable, nothing of it tuned): not its speed.
    assert speed_warnings(log, "vllm:TRITON") == speed_warnings(log, "bundled:triton") == []
    assert speed_warnings(log, None) == []
    loaded = "INFO FlashInfer autotune cache loaded on rank 0 from /c.json."
    assert speed_warnings(loaded, "bundled:flashinfer_cutlass") == []


def test_the_server_log_is_read_once_so_the_judge_and_the_record_hold_one_reading(tmp_path):
    from moe_eval.core.record import RunRecord
    from moe_eval.runner import _read_server_log

    warning = "No FlashInfer autotune cache entries found.Falling back to default tactics."
    log = tmp_path / "server.log"
    log.write_text(f"INFO Kernel JIT monitor activated\nWARNING {warning}\n")
    record = RunRecord()
    record.serving.moe_backend_used = "bundled:flashinfer_cutlass"
    _read_server_log(record, tmp_path, log)  # the runner's reading, after the server stopped
    assert record.serving.speed_warnings_logged == [f"{warning} (1x)"]
    assert record.serving.jit_while_serving["monitored_processes"] == 1
    log.write_text("")  # the finally's call keeps what the judge was given
    _read_server_log(record, tmp_path, log)
    assert record.serving.speed_warnings_logged == [f"{warning} (1x)"]
    fresh = RunRecord()  # a row that failed before the reading: the finally reads it
    _read_server_log(fresh, tmp_path, log)
    assert fresh.serving.jit_while_serving["monitored_processes"] == 0


def test_log_errors_surface_the_cause_before_the_shutdown_noise(tmp_path):
    from moe_eval.launch import describe_log

    log = tmp_path / "server.log"
    log.write_text(
        "INFO starting\n(Worker pid=3) moe_eval.kernels.oracle.MoeBackendUnavailable: requested MoE "
        "backend 'triton' cannot run: Triton kernels need a CUDA GPU\n"
        + "".join(f"INFO shutdown noise {i}\n" for i in range(100))
        + "RuntimeError: Engine core initialization failed.\n"
    )
    text = describe_log(log)
    assert text.index("MoeBackendUnavailable: requested MoE backend 'triton'") < text.index("last lines")
    assert "RuntimeError: Engine core initialization failed." in text.split("last lines")[0]


def test_log_errors_name_a_segfault_by_its_frame_and_skip_errors_a_warning_only_quotes(tmp_path):
    """vLLM 0.32's CPU MoE kernel segfaulting under expert parallelism (seen here, 2026-12-06): the worker
    dies by SIGSEGV with no exception line, and a start-up WARNING quotes `OSError: ... Too many open files`.
    The cause named must be the crash and its frame, not the warning."""
    from moe_eval.launch import describe_log

    log = tmp_path / "server.log"
    log.write_text(
        "(APIServer pid=1) WARNING 12-06 23:10:58 [system_utils.py:255] Found ulimit of 20000 and failed to "
        "automatically increase with error current limit exceeds maximum limit. This can cause fd limit "
        "errors like `OSError: [Errno 24] Too many open files`. Consider increasing with ulimit -n\n"
        'INFO:     127.0.0.1:34522 - "GET /health HTTP/1.1" 200 OK\n'
        "!!!!!!! Segfault encountered !!!!!!!\n"
        '  File "./signal/../sysdeps/unix/sysv/linux/x86_64/libc_sigaction.c", line 0, in 0x7f0a3da5a04f\n'
        '  File "/tmp/vllm/csrc/cpu/cpu_fused_moe.cpp", line 242, in fused_moe_impl<c10::BFloat16>\n'
        '  File "/tmp/vllm/csrc/cpu/cpu_fused_moe.cpp", line 709, in operator()\n'
        "(EngineCore pid=2) ERROR 12-06 23:11:31 [multiproc_executor.py:315] Worker proc VllmWorker-0 died "
        "unexpectedly (exit code: -11), shutting down executor.\n"
        + "".join(f"INFO shutdown noise {i}\n" for i in range(100))
        + "(EngineCore pid=2) ERROR 12-06 23:11:31 [core.py:1512] RuntimeError: cancelled\n"
    )
    causes = describe_log(log).split("last lines")[0].splitlines()[1:]
    assert causes == [
        "  Segfault in /tmp/vllm/csrc/cpu/cpu_fused_moe.cpp line 242 (fused_moe_impl<c10::BFloat16>)",
        "  Worker proc VllmWorker-0 died unexpectedly (exit code: -11), shutting down executor.",
        "  RuntimeError: cancelled",
    ]


@pytest.mark.parametrize(
    ("between", "named"),
    [
        # the engine's traceback (Python frames) comes after the handler's few lines: not the crash site
        (
            ["(EngineCore pid=2) ERROR 12-06 23:11:31 [core.py:1512] Traceback (most recent call last):"] * 4
            + ['  File "/venv/vllm/v1/engine/core.py", line 691, in run_engine_core'],
            "Segfault (no native frame logged)",
        ),
        # another process's crash line between the handler and its frame: both named, the frame kept
        (
            ["(EngineCore pid=2) ERROR Worker proc VllmWorker-1 died unexpectedly (exit code: -11)"]
            + ['  File "/tmp/vllm/csrc/cpu/cpu_fused_moe.cpp", line 242, in fused_moe_impl'],
            "Segfault in /tmp/vllm/csrc/cpu/cpu_fused_moe.cpp line 242 (fused_moe_impl)",
        ),
    ],
)
def test_a_segfault_takes_its_frame_only_from_the_lines_right_under_it(tmp_path, between, named):
    from moe_eval.launch import log_errors

    log = tmp_path / "server.log"
    log.write_text("\x1b[33m!!!!!!! Segfault encountered !!!!!!!\x1b[0m\n" + "\n".join(between) + "\n")
    causes = log_errors(log)
    assert causes[0] == named
    assert not any("core.py" in c for c in causes)
