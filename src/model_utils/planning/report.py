"""What the preflight says about a plan: the lines it prints, its notes and problems, and the memory and disk figures."""

from __future__ import annotations

from dataclasses import dataclass, field

from model_utils.core.problems import Problem
from model_utils.planning.plan import Plan


@dataclass
class Report:
    """What the preflight says about a plan: the lines it prints, notes, problems, and the memory and disk estimates
    (which a starting run also logs)."""

    plan: Plan | None = None
    lines: list[str] = field(default_factory=list)
    problems: list[Problem] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    estimates: list[str] = field(default_factory=list)

    def estimate(self, line: str) -> None:
        self.lines.append(line)
        self.estimates.append(line)
