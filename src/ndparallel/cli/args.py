"""Argument parsers whose errors are one line (``ndparallel train: error: argument --steps: …``)
and exit code 2, like every other input error of the command line."""

from __future__ import annotations

import argparse
import sys
from typing import NoReturn


class Parser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` that reports a usage error in one line (no usage block)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} -h)\n")


def fail(command: str, message: object) -> int:
    """Print an input error on stderr, one line per problem (a message listing several keeps its
    line breaks; whitespace inside a line is collapsed); the exit code for it (2)."""
    first, *rest = [" ".join(line.split()) for line in str(message).splitlines() if line.strip()] or [""]
    print(
        "\n".join([f"ndparallel {command}: error: {first}", *(f"  {line}" for line in rest)]), file=sys.stderr
    )
    return 2


def at_least(minimum: float, strict: bool = False):
    """An argparse ``type`` for a number ``>= minimum`` (``> minimum`` when ``strict``)."""

    def parse(text: str):
        kind = int if isinstance(minimum, int) and not strict else float
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid {kind.__name__} value: {text!r}") from None
        if value < minimum or (strict and value == minimum):
            raise argparse.ArgumentTypeError(f"must be {'>' if strict else '>='} {minimum}, got {text}")
        return value

    return parse
