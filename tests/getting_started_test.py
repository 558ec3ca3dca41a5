"""docs/getting-started.md as a newcomer runs it: a fresh venv, a plain `pip install` of this
checkout (no extras, so no TensorFlow), the page's files written out and its commands run in
order, Ctrl-C and resume included. Slow (the install downloads or unpacks JAX): `make test-slow`.
`make test` runs the same page in the test venv with TensorFlow hidden (tests/docs_test.py).
"""

import shutil
import subprocess
import sys

import pytest
from docs_test import GETTING_STARTED, assert_the_path_went_as_the_page_says, page_blocks, run_page
from helpers import ROOT, fake_cpu_env

_NOT_COPIED = shutil.ignore_patterns(".venv", ".git", "runs", "build", "*.egg-info", "__pycache__")


@pytest.mark.slow
def test_the_getting_started_page_from_a_fresh_venv_without_tensorflow(tmp_path):
    (install,) = [b for b in page_blocks(GETTING_STARTED) if b.arg == "install"]
    for line in ("mkdir circles && cd circles", "python3 -m venv .venv", "pip install mptrain"):
        assert line in install.text, install.text  # what this test does in their place
    source = tmp_path / "mptrain"  # a copy: pip builds in the tree it installs from
    shutil.copytree(ROOT, source, ignore=_NOT_COPIED)
    project = tmp_path / "circles"
    project.mkdir()
    subprocess.run([sys.executable, "-m", "venv", ".venv"], cwd=project, check=True)
    python = str(project / ".venv" / "bin" / "python")
    # --no-compile: Python compiles what the page imports as it imports it, not every module
    # of JAX and SciPy up front (what pip installs is otherwise the same)
    pip = [python, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--no-compile"]
    subprocess.run([*pip, str(source)], cwd=project, check=True, timeout=1200)
    names = "['tensorflow', 'tensorflow_datasets']"
    absent = f"import importlib.util as u; print(*map(u.find_spec, {names}))"
    found = subprocess.run([python, "-c", absent], capture_output=True, text=True, check=True)
    assert found.stdout.split() == ["None", "None"]

    ran = run_page(GETTING_STARTED, project, python=python, env=fake_cpu_env(1), link_repo=False)
    assert_the_path_went_as_the_page_says(ran)
