"""What several verbs' command lines share: the parser class, the config arguments, output-file checks."""

from __future__ import annotations

import argparse
import os

from hpcpar.errors import ConfigError, UsageError


class Parser(argparse.ArgumentParser):
    """argparse that raises a UsageError where it would print its usage and exit: under mpiexec
    every rank parses the same command line, and an error must be printed once, not once a rank
    (`failure.report_user_error`). Sub-commands' parsers are of this class too."""

    def error(self, message: str):
        raise UsageError(f"{message} (see: {self.prog} --help)")


def add_config_args(p: argparse.ArgumentParser) -> None:
    """The run's config: a TOML file (or the built-in defaults) and `--set` overrides."""
    p.add_argument("config", nargs="?", help="TOML config file (default: built-in defaults)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override one config value, e.g. --set model.n_layer=8 (repeatable)")


def check_output_file(path: str | None, option: str) -> None:
    """An output file the command writes at its end must be creatable: checked before the work, so a
    typo in the directory does not cost the whole run (None: not asked for)."""
    if not path:
        return
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise ConfigError(f"{option} {path!r} is a directory; give a file name inside it")
    if not os.path.isdir(folder):
        raise ConfigError(f"{option} {path!r}: directory {folder!r} does not exist; create it first or give a path "
                          "in an existing directory")
    if not os.access(folder, os.W_OK):
        raise ConfigError(f"{option} {path!r}: directory {folder!r} is not writable; give a path in a writable "
                          "directory")
