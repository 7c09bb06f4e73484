"""What a running server is asked: GSM8K through lm-eval (or the canary task), the scoring texts'
log-probabilities and decode continuations, the layer sweep, and the golden reference made on the exact MoE;
one serve-and-capture path for the run and the golden (serving.py)."""
