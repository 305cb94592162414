"""What pytest must never collect: the trees guests wrote, wherever the user keeps them.

A guest's files reach the host in three places: the cache (a warm baseline is the tree a guest
exported), the state and runtime dirs (a guest's scratch: its upper layer), and the artifacts
dir (files collected from a failed test's guest). Where a user keeps one inside the project
(``PYTEST_SMOLVM_CACHE_DIR=smolvm-cache``, ``--smol-artifacts=artifacts`` for CI to upload),
pytest's collection walks into it, and a ``conftest.py`` or ``test_*.py`` a guest put there
would be imported by the host's pytest: the guest's code, run as the user.

Collection asks about every path of a project, so the answer costs no system call for almost
all of them: the homes of guest trees are compared as strings, and only a directory named as the
artifacts' guest copies are (``files``, ``files-N``) is looked at, for the mark the artifacts
writer leaves beside them. That mark outlives the run that wrote it: a later run without
``--smol-artifacts`` still steps around the copies.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import pytest

from pytest_smolvm.errors import UsageError
from pytest_smolvm.host import paths
from pytest_smolvm.session.settings import marker_spec

# Written in a test's artifacts dir before any guest file is copied into it.
GUEST_FILES_MARK = ".smolvm-guest-files"
GUEST_FILES_MARK_TEXT = ("The files/ directories beside this file were copied out of guests; "
                         "pytest-smolvm keeps pytest from collecting them.\n")


def guest_files_dir_name(number: int) -> str:
    """The name of the directory that holds the files collected from a test's ``number``-th guest."""
    return "files" if number == 1 else f"files-{number}"


def guest_tree_homes(artifacts: Path | None) -> frozenset[str]:
    """This host's homes of guest trees (``host.paths``), and this run's artifacts dir if any."""
    own = {str(artifacts.absolute()), str(artifacts.resolve())} if artifacts is not None else set()
    return paths.guest_tree_homes() | own


def is_guest_tree(path: Path, homes: frozenset[str]) -> bool:
    """Whether ``path`` is a home of guest-written trees, or an artifacts copy of guest files."""
    if str(path) in homes:
        return True
    name = path.name
    if name == "files" or (name.startswith("files-") and name[6:].isdigit()):
        return os.path.exists(os.path.join(path.parent, GUEST_FILES_MARK))
    return False


def marker_problems(collected: Sequence[pytest.Item | pytest.Collector]) -> list[str]:
    """One line per test whose ``smol`` marker is bad (a typo'd keyword, a wrong type), found at
    collection, as ``--strict-markers`` finds an unknown marker: before any guest is made, and
    not once per parametrized case. An ``image=`` that names no baseline is found when its guest
    is made (resolving it may pull), and then errors that test only."""
    problems: list[str] = []
    for item in collected:
        if not isinstance(item, pytest.Item) or item.get_closest_marker("smol") is None:
            continue
        try:
            marker_spec(item)
        except UsageError as exc:
            line = f"{getattr(item, 'originalname', item.name)}: {exc}"
            if line not in problems:
                problems.append(line)
    return problems
