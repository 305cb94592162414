"""The ``pytest-smolvm`` command: doctor, ls, reap, shell, pull, results."""

from __future__ import annotations

import argparse
import os
import re
import shlex
import signal
import sys
import time
from collections.abc import Sequence
from importlib.util import find_spec
from pathlib import Path
from typing import Any

from pytest_smolvm.backends import backend_class
from pytest_smolvm.errors import ResultsError
from pytest_smolvm.host import registry
from pytest_smolvm.session.reaper import reap_orphans


def _ls(args: argparse.Namespace) -> int:
    rows = list(registry.records())
    if not rows:
        print("no guests recorded")
        return 0
    print(f"{'NAME':<32} {'BACKEND':<10} {'STATE':<8} {'OWNER':<14} {'AGE':>7}  TEST")
    now = time.time()
    for r in rows:
        state = ("kept" if r.kept else "elsewhere" if r.here is False else "unknown" if r.here is None
                 else "live" if r.owner_alive else "orphan")
        owner = f"{r.worker}/{r.owner_pid}"
        print(f"{r.name:<32} {r.backend:<10} {state:<8} {owner:<14} {now - r.created_at:>6.0f}s  {r.test_id}")
    return 0


def _reap(args: argparse.Namespace) -> int:
    names = dict.fromkeys(args.names) if args.names else None
    recorded = {r.name for r in registry.records()} if names else set()
    unknown = [name for name in names or () if name not in recorded]
    # Naming a guest is asking for it: a kept guest named explicitly goes too.
    report = reap_orphans(include_kept=args.kept or names is not None, names=names)
    if names is None and find_spec("smol") is not None:
        # smol baseline machines are not in the registry: they are found by label.
        try:
            report.removed += backend_class("smol").reap_unrecorded()
        except Exception as exc:  # an unusable engine must not hide the registry's result
            report.failed.append(("smol machines", f"{type(exc).__name__}: {exc}"))
    for name in report.removed:
        print(f"removed {name}")
    for name, why in report.failed:
        print(f"could not remove {name}: {why}", file=sys.stderr)
    left = report.left_line()
    if left is not None:
        print(left)
    if not report.removed and not report.failed and left is None:
        print("nothing to reap")
    live = [r.name for r in registry.records() if not r.kept and r.owner_alive
            and (names is None or r.name in names)]
    if live and names is not None:
        print(f"still owned by a running pytest (not touched): {', '.join(live)}", file=sys.stderr)
    for name in unknown:
        print(f"pytest-smolvm reap: no guest named {name!r} (see 'pytest-smolvm ls')", file=sys.stderr)
    return 1 if report.failed else 2 if unknown else 0


def _shell(args: argparse.Namespace) -> int:
    record = next((r for r in registry.records() if r.name == args.name), None)
    if record is None:
        print(f"pytest-smolvm shell: no guest named {args.name!r} (see 'pytest-smolvm ls')", file=sys.stderr)
        return 2
    if record.backend == "smol":
        from pytest_smolvm.backends.smol.shell import shell

        return shell(record.data, args.command)
    if record.backend != "namespace":
        print(f"pytest-smolvm shell: {args.name} runs on {record.backend}; use its own tooling", file=sys.stderr)
        return 2
    from pytest_smolvm.backends.namespace.shell import shell as namespace_shell

    return namespace_shell(record.data, record.name, args.command)


def _pull(args: argparse.Namespace) -> int:
    """Pull and unpack an image into this host's cache, as a test run would (for CI warm-up)."""
    from pytest_smolvm.baselines import cache
    from pytest_smolvm.baselines.oci.pull import resolve_image
    from pytest_smolvm.baselines.oci.reference import parse
    from pytest_smolvm.errors import UsageError
    from pytest_smolvm.session.settings import Settings

    try:
        if args.registry_auth:
            from pytest_smolvm.baselines.oci.auth import parse_auth_option

            parse_auth_option(args.registry_auth, "--registry-auth")
        pinned = resolve_image(args.image, Settings(registry_auth=args.registry_auth, offline=args.offline))
        rootfs = cache.unpack(pinned, by="pytest-smolvm pull")
    except UsageError as exc:
        message = str(exc).replace(f"--smol-baseline={args.image}", f"pytest-smolvm pull {shlex.quote(args.image)}")
        if args.offline:  # the plugin's advice, for this command's own flag
            message = re.sub(r"--smol-offline forbids pulling \(pre-pull it: [^)]*\)",
                             "--offline forbids pulling (run it without --offline to pull it)", message)
        print(message, file=sys.stderr)
        return 2
    print(f"{args.image}: {pinned.digest}")
    print(f"  pin it with: --smol-baseline={parse(args.image).with_digest(pinned.digest)}")
    print(f"  unpacked at {rootfs.path}")
    return 0


def _results(args: argparse.Namespace) -> int:
    """Summarize result files, and compare each later one with the first."""
    from pytest_smolvm.evals.results.load import read
    from pytest_smolvm.evals.results.terminal import comparison, run_summary

    try:
        runs = [(Path(p), read(Path(p))) for p in args.files]
    except ResultsError as exc:
        print(f"pytest-smolvm results: {exc}", file=sys.stderr)
        return 2
    for path, lines in runs:
        print("\n".join(run_summary(path, lines)))
    base_path, base = runs[0]
    for path, lines in runs[1:]:
        print("\n".join(comparison(base_path, base, path, lines)))
    if args.html is not None:
        return _write_html(Path(args.html), runs)
    return 0


def _write_html(out: Path, runs: list[tuple[Path, list[dict[str, Any]]]]) -> int:
    from pytest_smolvm.evals.results.html_report import report

    partial = out.with_name(f".{out.name}.partial")
    try:  # whole or not at all: a browser left open on the old report never sees half a page
        out.parent.mkdir(parents=True, exist_ok=True)
        partial.write_text(report(runs, out), encoding="utf-8")
        os.replace(partial, out)
    except OSError as exc:
        if partial.parent.is_dir():
            partial.unlink(missing_ok=True)
        print(f"pytest-smolvm results: --html {out}: cannot write it: {exc.strerror or exc}", file=sys.stderr)
        return 2
    print(f"wrote {out}")
    return 0


def _doctor(args: argparse.Namespace) -> int:
    from pytest_smolvm.backends.smol.doctor import run_doctor

    return run_doctor(sys.stdout, require_microvm=args.require_microvm)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pytest-smolvm", description="Look after the guests pytest-smolvm makes on this host: "
        "diagnose the host (doctor), list and remove guests (ls, reap), enter a kept one (shell), "
        "pre-pull a baseline image (pull), read eval results (results).")
    sub = parser.add_subparsers(dest="command", required=True)
    doctor = sub.add_parser("doctor", help="can this host boot microVMs? which backend runs, and the fix if not. "
                            "Exit 0: guests run here (a microVM, or the namespace backend where none "
                            "boots); 1: no backend can run a guest; 3: --require-microvm and none boots")
    doctor.add_argument("--require-microvm", action="store_true",
                        help="exit 3 unless a microVM boots here (the namespace fallback is not enough)")
    doctor.set_defaults(run=_doctor)
    sub.add_parser("ls", help="list the guests recorded on this host").set_defaults(run=_ls)
    reap = sub.add_parser("reap", help="remove guests whose pytest process is gone")
    reap.add_argument("names", nargs="*", help="only these guests")
    reap.add_argument("--kept", action="store_true", help="also remove guests kept with --smol-keep")
    reap.set_defaults(run=_reap)
    pull = sub.add_parser("pull", help="pull a registry image into this host's baseline cache (CI warm-up)")
    pull.add_argument("image", help="name[:tag], registry/name:tag or name@sha256:...")
    pull.add_argument("--registry-auth", metavar="[REGISTRY=]USER:PASSWORD",
                      help="credentials (else $PYTEST_SMOLVM_REGISTRY_AUTH, else ~/.docker/config.json)")
    pull.add_argument("--offline", action="store_true", help="only check that the image is in the cache")
    pull.set_defaults(run=_pull)
    results = sub.add_parser("results", help="summarize --smol-results files; with two or more, compare "
                             "each with the first, paired by task and seed")
    results.add_argument("files", nargs="+", metavar="RUN.jsonl")
    results.add_argument("--html", metavar="OUT.html", help="also write one self-contained HTML report: plots, "
                         "intervals, the episodes table and the comparison (no network needed to open it)")
    results.set_defaults(run=_results)
    shell = sub.add_parser("shell", help="open a shell in a kept guest")
    shell.add_argument("name")
    command = shell.add_argument("command", nargs=argparse.REMAINDER, help="run this instead of /bin/sh")
    command.required = False  # argparse marks a REMAINDER positional required: its usage error named it
    shell.set_defaults(run=_shell)
    for command_parser in sub.choices.values():
        command_parser.set_defaults(parser=command_parser)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    # argparse leaves a subcommand's unknown options to the top-level parser, whose error shows
    # the top-level usage: the subcommand's own, as for its other usage errors, says more.
    args, unknown = build_parser().parse_known_args(argv)
    if unknown:
        args.parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    try:
        code = int(args.run(args))
        sys.stdout.flush()  # here, not at exit: a closed pipe is met where it is handled
    except BrokenPipeError:
        # The reader went away (`pytest-smolvm ls | head`): the rest of the output is nobody's.
        # stdout goes to /dev/null so that the interpreter's own flush at exit fails no more.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + signal.SIGPIPE  # what a command killed by SIGPIPE, as coreutils', reports
    return code


if __name__ == "__main__":
    sys.exit(main())
