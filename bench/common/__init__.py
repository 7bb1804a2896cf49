"""What every benchmark shares: the measuring harness (``harness``), the machine
record (``machine``), the one report writer (``report``) and the benchmark
checkpoints (``models``)."""
