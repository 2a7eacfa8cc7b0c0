"""The commands' parser: argparse whose errors are one line and exit 2 (``protocol.UsageError``)."""

from __future__ import annotations

import argparse
import re

from tfdist import protocol


class OneLineParser(argparse.ArgumentParser):
    """argparse whose errors take the one-line error path (exit 2), not usage + exit."""

    def error(self, message):
        bad_choice = re.match(r"argument ([\w-]+)(?:/\S+)?: invalid choice: (.+) \(choose from (.+)\)$",
                              message)
        if bad_choice:
            flag, value, allowed = bad_choice.groups()
            message = f"unknown {flag} {value}; allowed: {allowed.replace(chr(39), '')}"
        raise protocol.UsageError(f"{message}; see --help")
