"""The drafters' error type: a drafter cannot be built, loaded or used as asked.

Its own module so that ``base`` and ``capabilities`` both raise it without importing each other.
"""


class DrafterError(ValueError):
    """A drafter cannot be built, loaded or used as asked; the message names what differs."""
