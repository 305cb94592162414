"""The compatibility matrix: the plugin-behaviour tests on the oldest and newest versions declared.

``python3 -m nox -s compat`` runs both cells (README's test command does, after the suite);
``-s "compat(cell='oldest')"`` one. Each cell is a fresh virtualenv with the package and the
versions below, running the tests that exercise pytest's, xdist's and pytest-timeout's machinery
through the plugin: the parity corpus (every outcome, serial vs concurrent vs ``-n 2``), the
compatibility checks, the concurrent runner's tests and the options. The oldest cell is
pyproject.toml's lower bounds; the newest takes the latest releases and the plugins users run
beside ours. docs/configuration.md ("Supported versions") says the same.
"""

from __future__ import annotations

import nox

nox.options.default_venv_backend = "venv"
nox.options.reuse_existing_virtualenvs = True

CELLS = {
    "oldest": ["pytest==8.0.0", "pytest-xdist==3.5.0", "pytest-timeout==2.3.1", "pluggy==1.5.0"],
    "newest": ["pytest>=9,<10", "pytest-xdist", "pytest-timeout", "pytest-asyncio", "anyio",
               "pytest-rerunfailures", "pytest-randomly", "pytest-html"],
}
TESTS = ["tests/test_parity.py", "tests/test_compat.py", "tests/test_concurrency.py", "tests/test_options.py"]


@nox.session(python=False)
@nox.parametrize("cell", list(CELLS))
def compat(session: nox.Session, cell: str) -> None:
    venv = f".nox/compat-{cell}"
    python = f"{venv}/bin/python"
    session.run("python3", "-m", "venv", venv)
    session.run(python, "-m", "pip", "install", "-q", "--disable-pip-version-check", ".", *CELLS[cell])
    session.run(python, "-m", "pip", "list", "--format=freeze", "--disable-pip-version-check")
    # -p no:randomly for the suite itself: its tests' own order is not what is being checked
    # (the inner runs it starts do load pytest-randomly in the newest cell)
    session.run(python, "-m", "pytest", "-n", "2", "-p", "no:randomly", "-p", "no:cacheprovider", *TESTS)
