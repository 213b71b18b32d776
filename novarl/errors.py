"""Errors meant for users: one paragraph, no traceback, exit code 2.

Anything raised as a `UserError` is caught by the command line (and by
`novarl.train`'s callers if they wish) and printed as its message alone. Raise it
for bad input -- config, data, model path, reward function -- never for bugs.
"""

from __future__ import annotations


class UserError(Exception):
    """Bad input that the user can fix. The message names what and where."""

    exit_code = 2


class ConfigError(UserError):
    """A configuration value or key is invalid."""


class NotAvailableYet(UserError):
    """The config asks for a capability novarl does not have yet."""


class RunFailed(Exception):
    """The run stopped for a reason that is not bad input (a worker died, ...).
    The command line prints the message without a traceback and exits 1."""

    exit_code = 1
