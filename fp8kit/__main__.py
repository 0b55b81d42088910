"""The ``fp8kit`` command (``python -m fp8kit``): ``fp8kit demo [options]``."""

from __future__ import annotations

import sys

USAGE = """usage: fp8kit <command> [options]

commands:
  demo    train a small GPT in fp32, bf16 and FP8 and write a report (fp8kit demo --help)

options:
  -h, --help     show this message
  --version      print the fp8kit version
"""


def main(argv: list[str] | None = None) -> int:
    """Dispatch ``fp8kit <command>``; returns the exit code (2 for an unknown command)."""
    args = sys.argv[1:] if argv is None else list(argv)
    if args and args[0] in ("-h", "--help", "--version") and len(args) > 1:
        print(f"fp8kit: error: {args[0]} takes no arguments, got {args[1:]}", file=sys.stderr)
        return 2
    if not args or args[0] in ("-h", "--help"):
        print(USAGE, end="")
        return 0 if args else 2
    if args[0] == "--version":
        from fp8kit import __version__

        print(f"fp8kit {__version__}")
        return 0
    if args[0] == "demo":
        from fp8kit.demo.cli import main as demo_main

        return demo_main(args[1:], prog="fp8kit demo")
    print(f"fp8kit: error: unknown command {args[0]!r} (commands: demo)", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
