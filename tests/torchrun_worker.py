"""Transition: ``finish()`` moved to ``support.worker``; workers written before that still
append ``tests/`` to ``sys.path`` and import it from here. Drop once none does."""

from support.worker import finish  # noqa: F401
