"""What the harness and the in-server plugin (moe_eval.kernels.plugin) agree on.

The launcher passes requests to the plugin through the server's environment; the plugin answers
through the server log and small counter files. Plain constants, no imports: both the harness
(no torch, no vLLM) and every vLLM process read them.
"""

RUN_DIR_ENV = "MOE_EVAL_RUN_DIR"  # the config's run folder; also marks every process of a run
BACKEND_ENV = "MOE_EVAL_MOE_BACKEND"  # the config's moe_backend; unset = the plugin stays out
MUTATION_ENV = "MOE_EVAL_MUTATION"  # `moe-eval run --mutate NAME`: a deliberate bug (kernels/mutations.py)
# Golden-reference servers only (moe_eval.golden): the reference backend with global expert 0 scaled by
# the probe's factor, to measure how a per-expert scale error moves the log-probabilities (the golden
# gate's power). Never a golden itself; refused with any other backend.
GOLDEN_PROBE_ENV = "MOE_EVAL_GOLDEN_PROBE"
PLUGIN_NAME = "moe_eval_kernels"  # the vllm.general_plugins entry point in pyproject.toml
# vLLM releases (major, minor) the plugin supports, both ends included: 0.26 is the newest release the
# lent H200s' torch 2.11 runs (the GPU path is proven there), 0.32 the install pin (the CPU path).
SUPPORTED_VLLM = ((0, 26), (0, 32))

LOG_PREFIX = "moe-eval bundled MoE kernel: "  # one JSON line per process and layer shape
STATS_DIR = "kernel-stats"  # <run dir>/kernel-stats/<pid>.json: the plugin's call counters
STATS_INTERVAL_SECONDS = 0.5  # a flusher thread rewrites the counters at most this often
