"""logonce.py: a message is said the first time its key is given, then never again for
that owner; other keys and other owners are independent; the record names the caller's
line (not logonce.py), so a log line still says where the problem was met."""

import logging

from msprobe.core.monitor_v2.logonce import LogOnce, log_once, warn_once


def _messages(caplog):
    return [(r.levelno, r.getMessage(), r.filename) for r in caplog.records]


def test_each_key_is_said_once_per_owner(caplog):
    once, other = LogOnce(), LogOnce()
    with caplog.at_level(logging.INFO, logger="msprobe.monitor_v2"):
        said = [once.warning("a", "monitor_v2: %s is %d", "x", 1), once.warning("a", "monitor_v2: %s is %d", "y", 2),
                once.info(("b", 1), "monitor_v2: info"), once.error("c", "monitor_v2: error"),
                once.error("c", "monitor_v2: error"), other.warning("a", "monitor_v2: other owner")]
    assert said == [True, False, True, True, False, True]
    assert _messages(caplog) == [
        (logging.WARNING, "monitor_v2: x is 1", "test_logonce.py"),
        (logging.INFO, "monitor_v2: info", "test_logonce.py"),
        (logging.ERROR, "monitor_v2: error", "test_logonce.py"),
        (logging.WARNING, "monitor_v2: other owner", "test_logonce.py"),
    ]
    assert "a" in once and ("b", 1) in once and "d" not in once


def test_first_marks_without_logging(caplog):
    once = LogOnce()
    with caplog.at_level(logging.DEBUG, logger="msprobe.monitor_v2"):
        assert once.first("k") and not once.first("k")
        assert not once.warning("k", "never said")
    assert caplog.records == []


def test_process_wide_helpers_say_a_key_once_across_callers(caplog):
    key = ("test_logonce", id(caplog))  # a key no other test uses: the set lives for the process
    with caplog.at_level(logging.INFO, logger="msprobe.monitor_v2"):
        assert warn_once(key, "monitor_v2: process-wide %s", "once")
        assert not warn_once(key, "monitor_v2: process-wide %s", "twice")
        assert not log_once(logging.INFO, key, "monitor_v2: same key, other level")
        assert log_once(logging.INFO, key + ("info",), "monitor_v2: another key")
    assert _messages(caplog) == [(logging.WARNING, "monitor_v2: process-wide once", "test_logonce.py"),
                                 (logging.INFO, "monitor_v2: another key", "test_logonce.py")]
