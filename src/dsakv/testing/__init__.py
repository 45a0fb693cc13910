"""Test harnesses shipped with the package (peer processes, tiny checkpoints, cluster launchers): imported by
tests/ and bench/, never by the serving code."""
