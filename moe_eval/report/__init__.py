"""What a run shows: the table (terminal, summary.md, step summary), JUnit, `moe-eval compare`, live
progress."""
