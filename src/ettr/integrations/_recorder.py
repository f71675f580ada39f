"""The recorder a framework callback records to by default, and the one line that says when that records nothing
(a script with ettr's callback run as plain `python`, outside `ettr run` and without `ettr.init`)."""

from __future__ import annotations

from ettr.recorder import RecorderProtocol
from ettr.warn import WarnOnce

_records_nothing = WarnOnce(
    "ettr: {what} records nothing: this process is not under `ettr run` (ETTR_RUN_DIR is not set) and "
    "ettr.init(RUN_DIR) was not called; run the script with `ettr run -- python ...`, or call ettr.init first"
)


def default_recorder(callback: str) -> RecorderProtocol:
    """This process's recorder (`get_recorder()`); says once, naming `callback`, if it records nothing."""
    from ettr.runtime import get_recorder

    recorder = get_recorder()
    if not recorder.enabled:
        _records_nothing(callback)
    return recorder
