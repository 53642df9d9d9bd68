"""Children that a test signals start with the default dispositions, whatever the test run inherited.

A test run started under nohup, or as a background job of a shell, has SIGHUP or SIGINT ignored, and
its children inherit that. pyckpt rightly leaves a signal ignored on entry ignored, so a test that
expects the signal to interrupt its child would see the child run on (or wait for it in vain).
"""

import signal

SIGNALS = (signal.SIGINT, signal.SIGHUP, signal.SIGTERM)


def default_signals(then=None):
    """A ``preexec_fn`` that sets SIGINT, SIGHUP and SIGTERM to SIG_DFL in the child before it execs,
    then calls ``then`` (a test's own set-up of the child, which may ignore one again on purpose)."""
    def setup():
        for sig in SIGNALS:
            signal.signal(sig, signal.SIG_DFL)
        if then is not None:
            then()
    return setup
