"""The data's errors: a DataError carries the Problem (setting, value, fix) that stops a run before it trains, and the
exceptions datasets' loaders raise for a wrong name, a missing file or no network.
"""

from __future__ import annotations

from model_utils.core.problems import Problem


class DataError(Exception):
    def __init__(self, problem: Problem):
        self.problem = problem
        super().__init__(str(problem))

    def __reduce__(self):  # raised in a worker process, re-raised in the parent with its Problem
        return (type(self), (self.problem,))


class OneRankDataError(DataError):
    """A data problem found by one rank alone (unlike a DataError every rank raises together): it stops that rank
    without a collective, since the others are not there to meet it."""


class PreparerLost(OneRankDataError):
    """A waiting rank's preparer died, hangs or never reported: the preparer is not there to meet the others in a
    collective."""


# What datasets raises for a wrong name or config, a missing file or no network.
LOAD_ERRORS = (FileNotFoundError, ValueError, ConnectionError, OSError)
