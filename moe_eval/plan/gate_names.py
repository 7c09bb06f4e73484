"""The gates' names, in the table's order (moe_eval.gates.table asserts it): what a config's
`optional_gates` key and `run --optional-gate` may name. Apart from the table so that moe_eval.plan.config can
validate the key without importing the table, which reads configs."""

GATE_NAMES = (
    "served",
    "accuracy",
    "garbage",
    "paired",
    "divergence",
    "golden",
    "jit",
    "kernel_calls",
    "layer_check",
    "speed",
)
