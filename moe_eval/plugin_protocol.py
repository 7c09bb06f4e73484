"""What the harness and the in-server plugin (moe_eval.kernels.plugin) agree on.

The launcher passes requests to the plugin through the server's environment; the plugin answers
through the server log and small counter files. Plain constants, no imports: both the harness
(no torch, no vLLM) and every vLLM process read them.
"""

RUN_DIR_ENV = "MOE_EVAL_RUN_DIR"  # the config's run folder; also marks every process of a run
BACKEND_ENV = "MOE_EVAL_MOE_BACKEND"  # the config's moe_backend; unset = the plugin stays out
MUTATION_ENV = "MOE_EVAL_MUTATION"  # `moe-eval run --mutate NAME`: a deliberate bug (kernels/mutations.py)
# Golden-reference servers only (moe_eval.golden): after the golden is scored, the same server switches its
# power probe on (global expert 0 scaled as GOLDEN_PROBE_MUTATION scales it, in place, in every layer) and
# scores the texts again, to measure how a per-expert scale error moves the log-probabilities (the golden
# gate's power). The switch is a vLLM worker extension called through vLLM's dev-mode /collective_rpc.
GOLDEN_PROBE_MUTATION = "scale_one_expert"
GOLDEN_PROBE_EXTENSION = "moe_eval.kernels.golden_probe.GoldenProbeSwitch"  # --worker-extension-cls
GOLDEN_PROBE_METHOD = "moe_eval_golden_probe"  # its method: args ["on"] or ["off"]
PLUGIN_NAME = "moe_eval_kernels"  # the vllm.general_plugins entry point in pyproject.toml
# vLLM releases (major, minor) the plugin supports, both ends included: 0.26 is the newest release the
# lent H200s' torch 2.11 runs (the GPU path is proven there), 0.32 the install pin (the CPU path).
SUPPORTED_VLLM = ((0, 26), (0, 32))

LOG_PREFIX = "moe-eval bundled MoE kernel: "  # one JSON line per process and layer shape
STATS_DIR = "kernel-stats"  # <run dir>/kernel-stats/<pid>.json: the plugin's call counters
STATS_INTERVAL_SECONDS = 0.5  # a flusher thread rewrites the counters at most this often
