"""The torch 2.11 CI environment (.ci/torch211.sh) runs files that exist, and every test file of
the package's parallelism, compile, float8, CUDA-trace and checkpoint code is among them."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LISTED = [
    ln.strip()
    for ln in (ROOT / ".ci" / "torch211_tests.txt").read_text().splitlines()
    if ln.strip() and not ln.lstrip().startswith("#")
]
# The test files whose names say they test one of those subjects.
SUBJECT = re.compile(r"test_(parallel|compile|swiglu|float8|cuda_trace|checkpoint|elastic_exit)")


def test_every_listed_path_exists_and_every_subject_test_is_listed():
    assert LISTED and all((ROOT / p).exists() for p in LISTED), [
        p for p in LISTED if not (ROOT / p).exists()
    ]
    covered = lambda path: any(path == p or path.startswith(p + "/") for p in LISTED)  # noqa: E731
    missing = [
        str(f.relative_to(ROOT))
        for f in sorted((ROOT / "tests").rglob("test_*.py"))
        if SUBJECT.match(f.name) and "gpu" not in f.parts and not covered(str(f.relative_to(ROOT)))
    ]
    assert missing == [], f"not run on torch 2.11 (.ci/torch211_tests.txt): {missing}"


def test_ci_runs_the_torch211_environment_before_the_readme_suite():
    ci = (ROOT / ".ci" / "run").read_text()
    assert ci.index("bash .ci/torch211.sh") < ci.index("python -m pytest tests")
    # Alongside the suite, and waited for: its failure fails CI.
    assert ci.index("python -m pytest tests") < ci.index('wait "${TORCH211}"')
    assert ci.rstrip().endswith("(( suite == 0 && torch211 == 0 ))")
    script = (ROOT / ".ci" / "torch211.sh").read_text()
    assert "torch==2.11.0" in script and "torch211_tests.txt" in script
