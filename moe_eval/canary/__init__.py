"""The canary: a small MoE model of the project's own that answers a GSM8K-shaped arithmetic task well,
so that the embedded default's accuracy gate can tell a correct kernel from a broken one."""
