"""Threads that call the job's store, stopped and waited for before Python exits.

A thread that is inside one of torch's store calls while the interpreter exits aborts the process
("terminate called without an active exception", SIGABRT): returning, the call takes Python's lock
back from C++ code that cannot be unwound. The supervisor reads that abort as a lost peer, and a run
that saved and ended with 143 or 0 would end with 75. So each such thread stops looking at the store
and is waited for when the process exits, and whenever its work is over.
"""

import atexit
import threading

# A store call answers within milliseconds while the job lives; one waiting on a frozen main node does not end
# before the store's timeout, and is not waited for beyond this.
EXIT_WAIT_SECONDS = 5.0


class StoreThread(threading.Thread):
    """A daemon thread that polls the job's store until `stop_and_wait`; its `run` waits on `stopping` between calls."""

    def __init__(self, name: str) -> None:
        super().__init__(name=name, daemon=True)
        self.stopping = threading.Event()

    def start(self) -> None:
        atexit.register(self.stop_and_wait)
        super().start()

    def stop_and_wait(self) -> None:
        """Make no more calls to the store, and wait (up to EXIT_WAIT_SECONDS) for a call under way to return."""
        self.stopping.set()
        atexit.unregister(self.stop_and_wait)
        if self.is_alive() and self is not threading.current_thread():
            self.join(EXIT_WAIT_SECONDS)
