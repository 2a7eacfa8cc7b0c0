"""Run a whole simulated cluster on this machine: one ``train.py`` per task.

    python launch.py --strategy multiworker --workers 2 -- --epochs 1 --model-dir runs/mw
    python launch.py --strategy ps --workers 2 --ps 1 --hosts 3 --slow worker:1=0.25 -- --epochs 1

Each task gets its own TF_CONFIG and runs the same command a user runs on a
real host. The TF_CONFIGs and commands are saved in ``<model-dir>/launch/``
so any task can be replayed by hand. Every task checks its own flags first
(``--dry-run`` prints each task's plan), so bad input ends the launch before
anything is written. Output lines are prefixed with their task. If a task
fails the others are stopped, and the launcher exits with that task's code
(a task ended by a signal counts as lost: 75); no task outlives the launcher.

By default every task listens on loopback in one private network namespace
(``--netns``). ``--hosts N`` places the tasks on N simulated hosts, each with
its own address on a private bridge; ``--link-rate`` shapes their links;
``--slow`` runs a task at a fraction of its speed. The work is done by the
``tfdist.launcher`` package (``job``: plan, network, processes, faults,
supervisor); this file only reads the flags into one ``LaunchRequest`` and runs it.
"""

from __future__ import annotations

import argparse
import sys

from tfdist import flags, protocol
from tfdist.cli.parsing import OneLineParser
from tfdist.launcher.config import LaunchRequest, MemberArgs
from tfdist.launcher.checks import MemberCheckFailed
from tfdist.launcher.job import run_request
from tfdist.launcher.plan import LaunchError
from tfdist.options import TrainOptions
from tfdist.protocol import Exit
from tfdist.strategies import kinds

# The request's typed groups, each a section of --help (flags.add_options). A new
# launcher option is one field of one of them (tfdist.flags says how), nothing here.
GROUPS = LaunchRequest.GROUPS


def parser() -> OneLineParser:
    names = kinds.names()
    p = OneLineParser(
        description=flags.description(__doc__),
        usage="launch.py [--strategy {%s}] [options] -- [train.py args]" % ",".join(names),
        formatter_class=flags.HelpFormatter,
        epilog="Everything after -- goes to every task's train.py (see train.py --help).\n\n"
               + protocol.exit_epilog(),
    )
    flags.add_options(p, LaunchRequest, exclude=("program", "netns_inside"))
    for name, title in GROUPS:
        flags.add_options(p, type(getattr(LaunchRequest, name)), title)
    flags.add_options(p, LaunchRequest, exclude=("strategy", "dry_run"))
    return p


def parse_args(argv=None):
    p = parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    train_args = []
    if "--" in argv:
        i = argv.index("--")
        argv, train_args = argv[:i], argv[i + 1:]
    args = p.parse_args(argv)
    if any(a == "--strategy" or a.startswith("--strategy=") for a in train_args):
        raise protocol.UsageError("pass --strategy to launch.py only; it forwards it to every task")
    if any(a == "--dry-run" for a in train_args):
        raise protocol.UsageError(
            "pass --dry-run to launch.py, before --: it asks every task for its plan")
    return args, train_args


# train.py flags that name where a member learns its cluster or how it checks itself:
# the launcher sets every member's TF_CONFIG and runs the check, so none of them applies.
LAUNCHERS_OWN = ("cluster_resolver", "slurm_ps", "slurm_port", "check_only")


def member_args(train_args: list[str], program: str | None = None) -> MemberArgs:
    """The flags after ``--`` -> every member's typed flags, parsed once, by train.py's own
    parser (its errors, word for word). With ``--program`` the flags train.py does not know
    are the program's own, passed on as given."""
    from tfdist.cli import train as train_cli

    p = train_cli.parser()
    if program is None:
        args, extra = p.parse_args(train_args), []
    else:
        args, extra = p.parse_known_args(train_args)
    parsed = train_cli.parser().parse_args([])
    for name in LAUNCHERS_OWN:
        if getattr(args, name) != getattr(parsed, name):
            flag = "--" + name.replace("_", "-")
            raise protocol.UsageError(f"{flag} after -- does not apply under launch.py, which "
                                      "gives every member its TF_CONFIG and checks it; drop it")
    given = any(a == "--task" or a.startswith("--task=") for a in train_args)
    return MemberArgs(task=args.task if given else None, model=args.model,
                      options=flags.from_args(TrainOptions, args), verbose=args.verbose,
                      extra=tuple(extra))


def request_from_args(args: argparse.Namespace, train_args: list[str]) -> LaunchRequest:
    """Flags -> the typed request (the only place the launcher's Namespace is read);
    UsageError (one line) for a bad flag after ``--``."""
    groups = {name: flags.from_args(type(getattr(LaunchRequest, name)), args)
              for name, _ in GROUPS}
    return flags.from_args(LaunchRequest, args, **groups,
                           member=member_args(train_args, args.program))


def main(argv=None) -> int:
    try:
        args, train_args = parse_args(argv)
        request = request_from_args(args, train_args)
    except protocol.UsageError as err:
        print(f"error: {err}", file=sys.stderr)
        return Exit.BAD_INPUT
    try:
        return run_request(request)
    except MemberCheckFailed as err:
        print(err.line, file=sys.stderr)
        return err.code
    except LaunchError as err:
        print(f"error: {err}", file=sys.stderr)
        return Exit.BAD_INPUT


if __name__ == "__main__":
    sys.exit(main())
