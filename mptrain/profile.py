"""`python -m mptrain.profile WORKDIR [--top=10]`: the kernel table of a run's newest trace.

A run traces the steps `config.profile` names (`mptrain.record.profile.Tracer`); this command
reads the trace and prints where each step's device time went (`mptrain.record.profile.table`).
It ends as mptrain's other commands do: one line and exit 2 for bad usage or a workdir without
a trace, never a traceback.
"""

from __future__ import annotations

import sys

from mptrain import errors
from mptrain.record import profile


def main(argv: list[str] | None = None) -> int:
    import argparse

    class OneLine(argparse.ArgumentParser):
        def error(self, message: str):  # one line, as mptrain's other commands
            sys.stderr.write(f"mptrain.profile: error: {message} (--help lists the flags)\n")
            sys.exit(errors.EXIT_USAGE)

    parser = OneLine(prog="python -m mptrain.profile", description=profile.__doc__.split("\n\n")[0])
    parser.add_argument("workdir", help="a run's workdir, traced with config.profile")
    parser.add_argument("--top", type=int, default=10, help="kernels listed (default 10)")
    args = parser.parse_args(argv)
    try:
        print(profile.render(profile.table(args.workdir, args.top)))
    except errors.WorkdirError as e:
        sys.stderr.write(f"mptrain.profile: error: {e}\n")
        return e.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main())
