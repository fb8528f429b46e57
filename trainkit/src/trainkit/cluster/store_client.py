"""A client of the main node's key-value store that gives up within its timeout, whatever listens there.

torch's TCPStore client bounds only its connecting: a port where another program listens (a web server,
a notebook, anything but a store) takes the connection and never answers the client's greeting, and the
client waits for that answer forever. So the client is opened in a thread of its own, and this process
stops waiting once the timeout is over; the thread, stuck in torch's code, ends with the process.
"""

import threading
from datetime import timedelta

from torch.distributed import TCPStore

# torch's own retries of an unanswered connection end at the timeout; this is for the last one to return.
MARGIN_SECONDS = 5


class NotAStore(RuntimeError):
    """Something listens at the main node's address and port, but it is not torch's store."""


def connect_to_store(address: str, port: int, timeout: timedelta) -> TCPStore:
    """A client of the store at address:port, within `timeout` and a few seconds.

    Raises torch's DistNetworkError where nothing listens within the timeout, NotAStore where a
    listener does not answer as a store.
    """
    outcome: list[TCPStore | BaseException] = []

    def connect() -> None:
        try:
            outcome.append(TCPStore(address, port, is_master=False, timeout=timeout, wait_for_workers=False))
        except BaseException as error:  # raised again in the waiting thread
            outcome.append(error)

    thread = threading.Thread(target=connect, name="trainkit-store-client", daemon=True)
    thread.start()
    thread.join(timeout.total_seconds() + MARGIN_SECONDS)
    if not outcome:
        raise NotAStore(
            f"{address}:{port} took the connection but did not answer as torch's store within {timeout}: another"
            " program listens on that port"
        )
    if isinstance(outcome[0], BaseException):
        raise outcome[0]
    return outcome[0]
