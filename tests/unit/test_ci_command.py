"""The README's test command is the one .ci/run runs, and it lists the slowest tests (a test that
slows down under load shows in every run's output)."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_readme_and_ci_run_the_same_pytest_command_with_durations():
    readme = re.findall(r"(python -m pytest [^\n`]*)", (ROOT / "README.md").read_text())
    ci = [  # .ci/run keeps the suite's exit code (`|| suite=$?`) to report both torch streams
        line.strip().split(" || ")[0]
        for line in (ROOT / ".ci" / "run").read_text().splitlines()
        if line.strip().startswith("python -m pytest")
    ]
    assert len(ci) == 1 and ci[0] in [c.strip() for c in readme], (ci, readme)
    assert "--durations=15" in ci[0].split()
