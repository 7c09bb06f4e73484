"""What every stage shares: the run record and its schema, errors and exit codes, the check and verdict rule,
the parallel layout, atomic files, the plugin protocol and the live status file. Imports no other stage."""
