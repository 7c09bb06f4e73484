"""What the harness and the in-server plugin (moe_eval.kernels.plugin) agree on.

The launcher passes requests to the plugin through the server's environment; the plugin answers
through the server log and small counter files. Plain constants, no imports: both the harness
(no torch, no vLLM) and every vLLM process read them.
"""

RUN_DIR_ENV = "MOE_EVAL_RUN_DIR"  # the config's run folder; also marks every process of a run
BACKEND_ENV = "MOE_EVAL_MOE_BACKEND"  # the config's moe_backend; unset = the plugin stays out
MUTATION_ENV = "MOE_EVAL_MUTATION"  # `moe-eval run --mutate NAME`: a deliberate bug (kernels/mutations.py)
PLUGIN_NAME = "moe_eval_kernels"  # the vllm.general_plugins entry point in pyproject.toml

LOG_PREFIX = "moe-eval bundled MoE kernel: "  # one JSON line per process and layer shape
STATS_DIR = "kernel-stats"  # <run dir>/kernel-stats/<pid>.json: the plugin's call counters
STATS_INTERVAL_SECONDS = 0.5  # counters are rewritten at most this often (apply() is hot)
