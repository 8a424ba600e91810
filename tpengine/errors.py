"""The one exception type for a user's mistake (a bad flag, setting, path or checkpoint).

The command-line tools (``tpengine.entrypoints.run``, ``tpengine-shard``) catch only :class:`UserError`: it
becomes one ``error:`` line on stderr and a non-zero exit code without a traceback. Any other
exception, a plain ``ValueError`` included, is a failure of tpengine itself and keeps its
traceback. Code that validates user input raises :class:`UserError` (or a subclass, such as
``tpengine.model.shard_folder.CheckpointMismatchError``), or the boundary that received the input converts
the validator's ``ValueError`` into one.
"""

from __future__ import annotations


class UserError(ValueError):
    """A mistake in the user's input; the message names the value and what is valid.

    A ``ValueError`` subclass, so callers that validate with ``except ValueError`` keep working.
    """
