"""Bad inputs as the user sees them: a Problem names the setting, its value, what is wrong and the fix; ConfigError
carries every problem found, so they are fixed in one round; `exit_on_problems` prints them and exits with BAD_INPUT
before anything starts.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

from model_utils.core.exit_status import BAD_INPUT


@dataclass
class Problem:
    """One thing wrong with the inputs: which setting, what it holds, what is wrong and how to fix it."""

    setting: str
    value: object
    message: str
    fix: str

    def __str__(self) -> str:
        shown = self.value if isinstance(self.value, str) else repr(self.value)
        return f"{self.setting} = {shown}: {self.message}\n    fix: {self.fix}"


class ConfigError(Exception):
    """Raised with every problem found, so the user fixes them all in one round."""

    def __init__(self, problems: list[Problem]):
        self.problems = problems
        super().__init__("\n".join(str(p) for p in problems))


def exit_on_problems(problems: list[Problem], stream=None) -> None:
    stream = stream or sys.stderr  # the stream of the moment (a test's capture replaces it after import)
    if problems:
        print(f"error: {len(problems)} problem(s) with the inputs; nothing was started:", file=stream)
        for p in problems:
            print(f"  - {p}", file=stream)
        raise SystemExit(BAD_INPUT)
