"""The README is part of the product: every setting is documented, and the quick start's test command is
what CI runs."""
import re

from conftest import ROOT

import settings


def test_every_setting_is_in_the_readme_table():
    readme = (ROOT / "README.md").read_text()
    missing = [k for k in settings.DEFAULTS if not re.search(rf"^\| `{k}` \|", readme, re.M)]
    assert not missing, f"settings missing from the README's settings table: {missing}"


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    assert "python -m pytest -q tests" in readme
    assert "python3 -m pytest -q tests" in ci or "python -m pytest -q tests" in ci
