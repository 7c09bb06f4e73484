"""The gates: which a config gets (table.py), each gate's arithmetic (accuracy, checks, stats, golden_gate,
layer_gate), and the pure judge that turns a run's measurements into checks and a verdict (judge.py)."""
