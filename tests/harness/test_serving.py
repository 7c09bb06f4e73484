"""The one serve-and-capture path (evaluate/serving.py) in the two shapes its callers use: a config's own
server (moe_eval.runner) and the golden's exact-reference server (moe_eval.evaluate.golden)."""

from __future__ import annotations

from pathlib import Path

from moe_eval.configs.config import parse_config
from moe_eval.core.plugin_protocol import BACKEND_ENV, GOLDEN_PROBE_EXTENSION, MUTATION_ENV, RUN_DIR_ENV
from moe_eval.evaluate.golden import REFERENCE_BACKEND, golden_server_argv
from moe_eval.evaluate.serving import capture_continuations, scoring_inputs, server_launch

CONFIG = (
    "model_name: m\naccuracy_threshold: 0.5\nnum_questions: 4\nnum_fewshot: 2\nmoe_backend: torch\n"
    'server_args: "--enforce-eager --tensor-parallel-size 2 --enable-expert-parallel"\n'
    "env:\n  VLLM_CPU_KVCACHE_SPACE: '3'\nlogprob_texts: 8\ndecode_texts: 2\nseed: 7\n"
)


def test_a_configs_server_and_the_goldens_share_one_launch(tmp_path: Path):
    config = parse_config(tmp_path / "fam" / "M-BF16-torch.yaml", CONFIG)
    run = server_launch(
        config,
        "/models/m",
        hw="cpu",
        devices=None,
        run_dir=tmp_path / "run",
        log_path=tmp_path / "run" / "server.log",
        moe_backend=config.moe_backend,
        mutation="scale_one_expert",
        port=8123,
    )
    assert run.spec.server_args == config.server_argv and run.spec.seed == 7 and run.spec.port == 8123
    assert run.env[BACKEND_ENV] == "torch" and run.env[MUTATION_ENV] == "scale_one_expert"
    assert run.env["VLLM_CPU_KVCACHE_SPACE"] == "3" and "VLLM_CPU_OMP_THREADS_BIND" in run.env  # TP=2 ranks
    described = run.describe()
    assert described.port == 8123 and described.argv == run.spec.argv and described.devices is None
    assert described.log == str(tmp_path / "run" / "server.log")

    argv = [*golden_server_argv(config), "--worker-extension-cls", GOLDEN_PROBE_EXTENSION]
    gold = server_launch(
        config,
        "/models/m",
        hw="cpu",
        devices=None,
        run_dir=tmp_path / "golden",
        log_path=tmp_path / "golden" / "golden-server.log",
        moe_backend=REFERENCE_BACKEND,
        server_args=argv,
        extra_env={"VLLM_SERVER_DEV_MODE": "1"},
    )
    # The exact reference, never a mutation, the config's env and seed, one rank (no parallel flags).
    assert gold.env[BACKEND_ENV] == REFERENCE_BACKEND and MUTATION_ENV not in gold.env
    assert gold.env["VLLM_SERVER_DEV_MODE"] == "1" and gold.env["VLLM_CPU_KVCACHE_SPACE"] == "3"
    assert gold.env[RUN_DIR_ENV] == str(tmp_path / "golden") and "VLLM_CPU_OMP_THREADS_BIND" not in gold.env
    assert gold.spec.server_args == argv and gold.spec.seed == 7


def test_scoring_inputs_are_the_configs_texts_and_prompts(tmp_path: Path):
    from moe_eval.evaluate.gsm8k import canary_data

    config = parse_config(tmp_path / "fam" / "M-BF16-torch.yaml", CONFIG)
    inputs = scoring_inputs(config, canary_data())
    assert inputs is not None and len(inputs.texts) == 8 and len(inputs.prompts) == 2
    # A decode prompt is its scoring text up to the answer: the two paths read the same questions.
    assert all(t.startswith(p) and p.endswith("Answer:") for p, t in zip(inputs.prompts, inputs.texts))
    # No prompts: no request at all (the server URL is never read).
    assert capture_continuations(config, "http://127.0.0.1:1", "m", []) == []
