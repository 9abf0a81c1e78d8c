"""The trainer's exit statuses, in one place: the trainer returns them, and the launchers read STOPPED_BY_SIGNAL from
this file (scripts/launch_common.sh), so a wrapper that requeues on 75 sees the same number everywhere."""

OK = 0
FAILED = 1  # an error that is not the inputs' (a checkpoint write that failed, a crash)
BAD_INPUT = 2  # a Problem with the inputs, reported before any step; nothing already saved is touched
NONFINITE = 3  # training diverged (non-finite loss or gradients); requeueing would not help
STOPPED_BY_SIGNAL = 75  # EX_TEMPFAIL: a checkpoint was saved on a signal; run the same command again to resume
