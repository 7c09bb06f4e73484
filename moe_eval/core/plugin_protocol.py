"""What the harness and the in-server plugin (moe_eval.kernels.plugin) agree on.

The launcher passes requests to the plugin through the server's environment; the plugin answers
through the server log and small counter files. Plain constants, no imports: both the harness
(no torch, no vLLM) and every vLLM process read them.
"""

RUN_DIR_ENV = "MOE_EVAL_RUN_DIR"  # the config's run folder; also marks every process of a run
BACKEND_ENV = "MOE_EVAL_MOE_BACKEND"  # the config's moe_backend; unset = the plugin stays out
MUTATION_ENV = "MOE_EVAL_MUTATION"  # `moe-eval run --mutate NAME`: a deliberate bug (kernels/mutations.py)
# Golden-reference servers only (evaluate/golden.py): after the golden is scored, the same server switches
# its power probe on (global expert 0 scaled as GOLDEN_PROBE_MUTATION scales it, in place, in every layer)
# and scores the texts again, to measure how a per-expert scale error moves the log-probabilities (the
# golden gate's power). The switch is a vLLM worker extension called through vLLM's dev-mode /collective_rpc.
GOLDEN_PROBE_MUTATION = "scale_one_expert"
GOLDEN_PROBE_EXTENSION = "moe_eval.kernels.golden_probe.GoldenProbeSwitch"  # --worker-extension-cls
GOLDEN_PROBE_METHOD = "moe_eval_golden_probe"  # its method: args ["on"] or ["off"]
PLUGIN_NAME = "moe_eval_kernels"  # the vllm.general_plugins entry point in pyproject.toml
# vLLM releases (major, minor) the plugin supports, both ends included: 0.26 is the newest release the
# lent H200s' torch 2.11 runs (the GPU path is proven there), 0.32 the install pin (the CPU path).
SUPPORTED_VLLM = ((0, 26), (0, 32))

# The most tokens one MoE call carries when vLLM's max_num_batched_tokens cannot be read: the plugin's warm-up
# bound, and the layer check's sweep target when no process wrote its own.
DEFAULT_MAX_TOKENS = 8192
LOG_PREFIX = "moe-eval bundled MoE kernel: "  # one JSON line per process and layer shape
STATS_DIR = "kernel-stats"  # <run dir>/kernel-stats/<pid>.json: the plugin's call counters
STATS_INTERVAL_SECONDS = 0.5  # a flusher thread rewrites the counters at most this often
# After each tick a flusher writes <file><FLUSHED_SUFFIX>: the wall time (seconds, text) taken before it
# copied its numbers: the harness waits until each process copied after the calls it sent (core/flushes.py).
FLUSHED_SUFFIX = ".flushed"

# The layer check (kernels/layer_check.py, read by gates/layer_gate.py): each bundled-kernel process
# samples the MoE calls it serves, compares the served output with the exact MoE of the same inputs and
# writes per-layer, per-range, per-expert sums to <run dir>/layer-check/<pid>.npz.
# Off with MOE_EVAL_LAYER_CHECK=0.
LAYER_CHECK_ENV = "MOE_EVAL_LAYER_CHECK"  # "0": off; else on (the launcher sets it from the config)
LAYER_CHECK_SLOTS_ENV = (
    "MOE_EVAL_LAYER_CHECK_SLOTS"  # slots a cell collects before rows stop being picked for it
)
LAYER_CHECK_DIR = "layer-check"  # <run dir>/layer-check/<pid>.npz (core/layer_cells.py)
# While <run dir>/layer-check/<LAYER_CHECK_PAUSE> exists, every process's check samples nothing (its flusher
# looks each STATS_INTERVAL_SECONDS and says so in its file's meta, "paused"): the speed measurement's timed
# requests run without the check's work beside them (evaluate/moe_speed.py).
LAYER_CHECK_PAUSE = "paused"
# Dispatch ranges by the call's token count M: the lower edge of each range. They follow the bundled Triton
# kernel's launch plan: M = 1 (one decode sequence), the small-BLOCK_M decode batches up to 16 and up to 64
# (CUDA-graph sizes), mid batches, single-text prefills, and the persistent prefill path from M = 1024
# (tile_configs.PREFILL_SHAPES), split at 4096 where chunked prefill's largest calls sit.
LAYER_RANGE_EDGES = (1, 2, 17, 65, 257, 1024, 4096)


def layer_range_names() -> tuple[str, ...]:
    """'M=1', 'M=2-16', ..., 'M>=4096': one name per LAYER_RANGE_EDGES entry."""
    names = []
    for i, low in enumerate(LAYER_RANGE_EDGES):
        high = LAYER_RANGE_EDGES[i + 1] - 1 if i + 1 < len(LAYER_RANGE_EDGES) else None
        names.append(f"M>={low}" if high is None else f"M={low}" if high == low else f"M={low}-{high}")
    return tuple(names)


def layer_range_index(tokens: int) -> int:
    """The range of a call of `tokens` tokens (0 for an empty call)."""
    index = 0
    for i, low in enumerate(LAYER_RANGE_EDGES):
        if tokens >= low:
            index = i
    return index


# The served MoE calls' time per dispatch range (kernels/moe_timer.py, read by core/moe_timing.py): every
# process of a row under test, the incumbent's (vLLM's own kernel) included, sums the time of its MoE calls
# into <run dir>/moe-timing/<pid>.json. On with MOE_EVAL_MOE_TIMING=1 (the launcher sets it from the config).
MOE_TIMING_ENV = "MOE_EVAL_MOE_TIMING"
MOE_TIMING_DIR = "moe-timing"
# The timer keeps one cell per call size M (token count) up to this many tokens, so that two rows' calls are
# compared size for size (matched work), never as a range's mean over a mix of sizes that differs between
# runs; larger calls share the last cell (vLLM's default batched-token limits are 2,048-16,384).
TIMER_MAX_SIZE = 16384
