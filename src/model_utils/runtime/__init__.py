"""One process of a run, above checkpoint: the process group and its collectives (distributed.py), each rank's threads,
seeds, RNG state and stop signals (process.py), the lock that gives a checkpoint directory to one run (run_lock.py),
DeepSpeed's op build locks (build_locks.py), the log and its throughput and memory figures (run_log.py), the header,
metric sinks and summary (monitor.py), the launchers' communication check (sanity.py) and the metrics' plots
(plot.py).
"""
