"""The golden server's power-probe switch: a vLLM worker extension (`--worker-extension-cls`).

A golden server (moe_eval.evaluate.golden) scores the texts with the exact reference MoE, then calls
`POST /collective_rpc {"method": "moe_eval_golden_probe", "args": ["on"]}` (vLLM's dev-mode endpoint,
VLLM_SERVER_DEV_MODE=1) and scores them again with global expert 0 scaled as `--mutate scale_one_expert`
scales it: the probe the gate's power comes from, made by the same server instead of a second one.
vLLM mixes this class into its worker class; the method runs in each worker process, between requests.
"""

from __future__ import annotations

from typing import Any


class GoldenProbeSwitch:
    def moe_eval_golden_probe(self, state: str) -> dict[str, Any]:
        if state not in ("on", "off"):
            raise ValueError(f"moe_eval_golden_probe: state {state!r} must be 'on' or 'off'")
        from moe_eval.kernels.plugin import switch_golden_probe

        return switch_golden_probe(state == "on")
