"""The docs' code blocks, run: README.md and docs/*.md stay true because CI executes them.

Sybil (the test extra) finds every fenced block with a language and hands it to an evaluator
here. A block that cannot run on a test host (it installs packages, pulls from a registry, runs
the whole suite, or is a signature) carries ``<!-- skip: next "why" -->`` right above it in the
Markdown, visible in the source; a block of a language with no evaluator fails until it is run
or marked. Untagged blocks are terminal output, not code.

- ``python``: a block that defines tests (``def test_``) is a test module, run by pytest in its
  own directory with the plugin as a user has it, and every test in it must pass; a block that
  only defines hooks or fixtures is that directory's ``conftest.py``, run under one guest test;
  any other block is executed, and what it defines is there for the document's later blocks
  (a test module gets them too). ``import asyncio, pytest`` come first, as a reader assumes.
- ``toml``: parsed, and loaded as the Inspect provider's ``smolvm.toml``.
- ``json``: parsed.
- ``bash``, ``console``, ``yaml``: a reader's shell session or CI file; each is marked, with its
  reason and the test that covers it where one does, and an unmarked one fails.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import unittest
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import tomllib  # type: ignore[import-not-found]  # 3.11+: mypy checks as python_version 3.10

from tests.tools import in_ci

ROOT = Path(__file__).resolve().parents[1]
DOCUMENTS = ["README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))]
PRELUDE = "import asyncio\nimport pytest\n"
TESTS = re.compile(r"^(async )?def test_", re.MULTILINE)
HOOKS = re.compile(r"^(def pytest_|@pytest\.fixture)", re.MULTILINE)
# What a block names and the reader is assumed to have, made here: the README's tasks/fizzbuzz
# (examples/tasks), and the agent a README test runs (a stand-in that prints a reward).
STAND_IN_CONFTEST = '''
def pytest_smolvm_vm_ready(item, vm):  # as root: a block's guest may run as another user
    vm.exec("printf '#!/bin/sh\\necho 0.5\\n' > /usr/local/bin/run-agent && chmod 755 /usr/local/bin/run-agent",
            user=0, check=True)
'''


def _sybil() -> Any:
    try:
        from sybil import Sybil
        from sybil.parsers.markdown import CodeBlockParser, SkipParser
    except ImportError:  # the test extra has it; a missing one is a broken install, failed in CI
        if in_ci():
            pytest.fail("sybil is missing: pip install '.[test]' installs it -- .ci/run must have it")
        pytest.skip("needs sybil: python3 -m pip install '.[test]'")

    class EveryLanguage(CodeBlockParser):
        """Every fenced block that names a language, whichever it is: an unknown one fails."""

        language = "any"

        def __call__(self, document: Any) -> Any:
            for region in self.lexers(document):
                region.parsed = (region.lexemes["arguments"].split()[0], region.lexemes["source"])
                region.evaluator = _evaluate
                yield region

    return Sybil(parsers=[EveryLanguage(), SkipParser()], patterns=["*.md"])


class Runner:
    """What the evaluators need from the running test: a pytest to run blocks with, and a place."""

    def __init__(self, pytester: pytest.Pytester) -> None:
        self.pytester = pytester
        self.count = 0
        shutil.copytree(ROOT / "examples" / "tasks", pytester.path / "tasks")  # pytest runs from here

    def workdir(self) -> Path:
        self.count += 1
        path = self.pytester.path / f"block-{self.count}"
        path.mkdir()
        shutil.copytree(ROOT / "examples" / "tasks", path / "tasks")
        return path


RUNNER: list[Runner] = []  # the test running now (one per process: xdist runs tests one at a time)


def _evaluate(example: Any) -> None:
    language, source = example.parsed[0], str(example.parsed[1])
    evaluator: dict[str, Callable[[Any, str], None]] = {
        "python": _python, "toml": _toml, "json": _json, "bash": _bash, "console": _bash, "yaml": _bash}
    if language not in evaluator:
        raise AssertionError(f"a ```{language} block: no evaluator runs it; run it here or mark it "
                             "<!-- skip: next \"why it cannot run\" --> in the Markdown")
    evaluator[language](example, source)


def _python(example: Any, source: str) -> None:
    namespace = example.namespace
    earlier = "".join(namespace.setdefault("__blocks__", []))
    if not TESTS.search(source) and not HOOKS.search(source):
        cwd = os.getcwd()
        os.chdir(RUNNER[-1].workdir())
        try:
            exec(compile(PRELUDE + source, str(example.path), "exec"), namespace)
        finally:
            os.chdir(cwd)
        namespace["__blocks__"].append(source + "\n")
        return
    where = RUNNER[-1].workdir()
    conftest = STAND_IN_CONFTEST
    if TESTS.search(source):
        (where / "test_block.py").write_text(PRELUDE + earlier + source)
    else:
        conftest += "\n" + PRELUDE + earlier + source
        (where / "test_block.py").write_text("def test_a_guest(smol_vm):\n    smol_vm.exec('true', check=True)\n")
    (where / "conftest.py").write_text(conftest)
    result = RUNNER[-1].pytester.runpytest_subprocess(str(where), "-p", "no:cacheprovider")
    outcomes = result.parseoutcomes()
    assert result.ret == 0 and outcomes.get("passed", 0) > 0 and not outcomes.get("skipped"), \
        f"{example.path}:{example.line}: the block's tests did not all pass:\n{result.stdout.str()[-4000:]}"


def _toml(example: Any, source: str) -> None:
    from pytest_smolvm.integrations.inspect_config import _validated

    data = tomllib.loads(source)
    if "baseline" in data or "setup" in data:  # a smolvm.toml: every key must be the provider's
        _validated(data, f"{example.path}:{example.line}")


def _json(example: Any, source: str) -> None:
    json.loads(source)


def _bash(example: Any, source: str) -> None:
    # Shell blocks are the reader's host's commands (installs, sudo, whole suites): running an
    # unmarked one here, as root in CI or as a developer, is not worth the risk of one that is wrong.
    raise AssertionError(f"{example.path}:{example.line}: a shell block runs on the reader's host, not here: "
                         "mark it <!-- skip: next \"not run by tests/test_docs.py: why\" --> and say which test "
                         "covers it")


@pytest.mark.parametrize("name", DOCUMENTS)
def test_the_documents_code_blocks_run(name: str, pytester: pytest.Pytester, smol_state: Path) -> None:
    """Every block in order (a later block may use what an earlier one defined); all failures at once."""
    sybil = _sybil()
    document = sybil.parse(ROOT / name)
    # What a block's skip condition may ask (<!-- skip: start if(inspect_missing, ...) -->).
    document.namespace["inspect_missing"] = importlib.util.find_spec("inspect_ai") is None
    RUNNER.append(Runner(pytester))
    failures = []
    try:
        for example in document:
            try:
                example.evaluate()
            except unittest.SkipTest:  # marked in the Markdown, with its reason
                continue
            except Exception as exc:
                failures.append(f"{name}:{example.line}: {type(exc).__name__}: {exc}")
    finally:
        RUNNER.pop()
    assert not failures, "\n\n".join(failures)


def test_a_skip_mark_is_visible_in_the_source_and_names_why() -> None:
    """Every ``skip`` directive says why, so a reader of the Markdown knows the block is not run."""
    bare = [f"{name}:{number}" for name in DOCUMENTS
            for number, line in enumerate((ROOT / name).read_text().splitlines(), 1)
            if "skip:" in line and line.strip().startswith("<!--") and "skip: end" not in line and '"' not in line]
    assert not bare, f"skip marks without a reason: {bare}"


def test_the_readme_network_paragraph_agrees_with_the_configuration_page() -> None:
    """README and docs/configuration.md tell one story: pasta NAT with the host's addresses
    refused, and allow_hosts on every backend."""
    readme = (ROOT / "README.md").read_text()
    paragraph = next(p for p in readme.split("\n\n") if "network=True" in p)
    flat = " ".join(paragraph.split())
    assert "host's network" not in flat and "needs the smol backend" not in flat, flat
    for claim in ("pasta", "host's own addresses", "every backend", "allow_hosts"):
        assert claim in flat, (claim, flat)
    table = " ".join((ROOT / "docs" / "configuration.md").read_text().split())
    assert "own netns + pasta NAT (IPv4); refused per packet" in table and "(every backend" in table


def test_getting_started_names_what_each_install_pulls_in() -> None:
    """The install paragraph names every package of the dependencies and of the test extra."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    text = " ".join((ROOT / "docs" / "getting-started.md").read_text().split("## The first test")[0].split())

    def names(requirements: list[str]) -> list[str]:
        return [re.split(r"[<>=;\[ ]", r, maxsplit=1)[0] for r in requirements]

    first = text.split("The first pulls in", 1)[1].split(".", 1)[0]
    extra = text.split("extra adds", 1)[1].split("(each", 1)[0]
    assert [n for n in names(project["dependencies"]) if n not in first] == [], first
    assert [n for n in names(project["optional-dependencies"]["test"]) if n not in extra] == [], extra


def test_the_inspect_section_says_how_to_install_from_a_checkout_and_run_offline() -> None:
    """From a checkout the extra is '.[inspect]'; mockllm without usage downloads a tokenizer."""
    text = " ".join((ROOT / "docs" / "agents.md").read_text().split("## Inspect AI", 1)[1].split())
    assert "python3 -m pip install '.[inspect]'" in text, text
    assert "reply.usage = ModelUsage(" in text and "tokenizer" in text, text
    assert "tests/test_inspect_eval.py" in text, text
