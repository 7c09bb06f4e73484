"""Keeping vLLM servers honest: the guard that dies with the harness, the process tree, cancellation, and
what a server's log says (which MoE kernel served, compilations while serving, kernel call counts)."""
