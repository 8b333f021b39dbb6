"""gthread's main loop holding the connections that have no request for a thread yet
(``container.frontend.server``'s worker is this one).

gthread hands a connection to a request thread as soon as it has something to read, and the
thread then waits for the request's head without a deadline: a client that sends half a head
holds a thread for as long as it likes, and a thousand of them hold them all, ``/ping``'s
included. Here a connection waits in the main loop's poller until its next request's head is
whole (``head_ready``: up to its empty line), and only then goes to a thread, which reads it
without waiting on the client. Until then it costs a socket and nothing else:

- the head must be whole within ``header_read_timeout`` of the connection's opening (or, on a
  kept-alive connection, of the next request's first bytes); past it the server answers 408 in
  the route's envelope and closes the connection (one that sent nothing is closed silently);
- what is there is peeked, not read (``MSG_PEEK``), so that a request the early hand-off may take
  (``container.frontend.early``) is still on the socket when it is whole; the kernel wakes the
  loop only once more came (``SO_RCVLOWAT``). A head that comes in many pieces, or past
  ``PEEK_BYTES``, is read off the socket into a buffer instead (a peek would see the same bytes at
  every wake-up), which goes with the connection: gunicorn reads it first, or the hand-off gives it
  to rank 0 (as it does bytes gunicorn read ahead after an answer);
- idle kept-alive connections wait here too, as in gthread; with the connections waiting for a
  head they are counted per client address (``WaitingConnections``): past
  ``max_connections_per_client`` the address's oldest waiting one is closed, and at the
  server's own bound (its file-descriptor limit) the oldest of all, so accepting never stops
  while a connection merely waits;
- ``GET /ping`` without a body is served by threads of its own (``PING_THREADS``), so SageMaker's
  health check is answered when every request thread is busy.
"""

from __future__ import annotations

import errno
import json
import logging
import math
import select
import selectors
import socket
import time
from collections import Counter
from concurrent import futures
from functools import partial
from http import HTTPStatus
from typing import Any

from gunicorn.workers.gthread import STOP_KEEPALIVE_LINGER, ThreadWorker

from container.core.errors import RequestTimeout, ServiceUnavailable, ServingError, describe, envelope_for
from container.core.ingress import PEEK_BYTES, head_ready, is_bare_ping, request_path
from container.frontend.waiting import WaitingConnections

log = logging.getLogger("sagelmi.frontend")

PING_THREADS = 4  # threads that serve only GET /ping
PEEKS = 3  # wake-ups a head coming in pieces may be peeked at (subclasses: peek_for) before it is read
READ_BYTES = 1 << 16
REPORT_EVERY = 60.0  # seconds between two log lines counting the connections closed here
# gthread's methods this worker overrides or calls, as gunicorn 27 has them; checked when it starts
GTHREAD_METHODS = (
    "accept",
    "enqueue_req",
    "finish_request",
    "handle",
    "murder_keepalived",
    "murder_pending",
    "on_client_socket_readable",
    "wait_for_and_dispatch_events",
)


def json_answer(path: str, status: int, message: str, detail: str, reason: str = "") -> bytes:
    """An error answer that ends the connection, in the envelope of the route at ``path``
    (``reason``: the status line's, else the status's usual phrase)."""
    body = json.dumps(envelope_for(path, status, message, detail)).encode()
    head = (
        f"HTTP/1.1 {status} {reason or HTTPStatus(status).phrase}\r\nConnection: close\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    return head.encode("latin-1") + body


def client_address(conn: Any) -> str:
    return str(conn.client[0] if isinstance(conn.client, tuple) else conn.client)


def client_waiting(sock: socket.socket) -> bool | None:
    """What the client of a connection did that the server has not read yet: True when it sent
    more (a next request), False when it closed the connection, None when neither (or the
    socket cannot be peeked without gunicorn: TLS). One non-blocking peek."""
    if type(sock) is not socket.socket:
        return None
    try:
        return bool(sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT))
    except BlockingIOError:
        return None
    except OSError:
        return False


def read_ahead(conn: Any) -> bytes:
    """What gunicorn read of a connection's next request (its parser's buffer; the socket has the rest)."""
    return conn.parser.unreader.buf.getvalue() if conn.initialized and not conn.is_http2 else b""


def _writable(sock: socket.socket) -> bool:
    poll = select.poll()
    poll.register(sock, select.POLLOUT)
    return bool(poll.poll(0))


def close_read(conn: Any) -> None:
    """Close a connection after reading off what its client sent and nobody will read: a close
    with it unread would reset the connection, and the client could lose the answer written."""
    try:
        for _ in range(16):
            if not conn.sock.recv(READ_BYTES, socket.MSG_DONTWAIT):
                break
    except OSError:
        pass
    conn.close()


class HeadWaitingWorker(ThreadWorker):
    """A gthread worker whose main loop keeps each connection until its next request's head is
    whole (see the module). Subclasses decide where a whole head goes (``serve``) and may ask for
    a head that comes in pieces to be peeked at a few times more (``peek_for``)."""

    header_read_timeout = 10.0
    closed_metric: Any = None  # a Prometheus counter by reason, once the app is loaded
    early: Any = None  # the hand-off to worker groups (container.frontend.early), once the app is loaded

    def hold(self, header_read_timeout: float, per_client: int) -> None:
        """The limits of waiting connections; called before ``init_process``."""
        missing = [name for name in GTHREAD_METHODS if not callable(getattr(ThreadWorker, name, None))]
        if missing:
            raise RuntimeError(f"this gunicorn's gthread worker has no {', '.join(missing)}: sagelmi needs gunicorn 27")
        self.header_read_timeout = header_read_timeout
        self.waits = WaitingConnections(per_client)
        self.ping_pool = futures.ThreadPoolExecutor(max_workers=PING_THREADS, thread_name_prefix="ping")
        cfg = self.cfg  # gunicorn's own bound on a head (Message.max_buffer_headers and the request line)
        self.max_head = max(cfg.limit_request_line, 4094) + max(cfg.limit_request_fields, 100) * (
            max(cfg.limit_request_field_size, 8190) + 2
        )
        self.tls = bool(cfg.is_ssl)
        self.closed: Counter[str] = Counter()
        self.reported = -math.inf
        self.stopped = math.inf

    # -- where a connection with a request to come goes (gthread calls this for every one)
    def enqueue_req(self, conn) -> None:
        if self.tls:  # the socket holds TLS records: gunicorn reads them in a thread
            super().enqueue_req(conn)
            return
        if getattr(conn, "head", None) is not None:
            self._read_head(conn)
            return
        look = self.look(conn)
        if look is None:
            self._drop(conn)
            return
        seen, peeked = look
        if head_ready(seen):
            self._head_came(conn)
            self.serve(conn, seen)
        else:
            self._wait_for_head(conn, seen, peeked)

    def serve(self, conn, head: bytes) -> None:
        """A connection whose next request's head is whole, ``head`` being what the client sent
        (what gunicorn read of it, then what a peek sees): to /ping's threads, to its worker group
        with the rest unread (``container.frontend.early``), or to the request threads."""
        if is_bare_ping(head):
            self._ping(conn)
        elif not (self.early is not None and self.early.send(conn, self._closes(), head)):
            self.to_thread(conn)

    def _closes(self) -> bool:
        """Whether gthread's ``handle_request`` would close the connection after its next answer."""
        return (
            not self.alive
            or not self.cfg.keepalive
            or self.nr + 1 >= self.max_requests
            or len(self.keepalived_conns) >= self.max_keepalived
        )

    def to_thread(self, conn) -> None:
        """To the request threads (gthread's own ``enqueue_req``)."""
        ThreadWorker.enqueue_req(self, conn)

    def peek_for(self, conn, seen: bytes) -> bool:
        """Whether a head that came in part (``seen``) is peeked at again (up to ``PEEKS`` times)
        rather than read off the socket: the start of a request the hand-off may take, which then
        goes to rank 0 without bytes read here."""
        return self.early is not None and self.early.may_take(seen)

    def look(self, conn) -> tuple[bytes, int] | None:
        """What the client sent of its next request, without reading it: what gunicorn read
        ahead, then what the socket holds (peeked), and how many of those bytes the socket holds.
        ``None``: the client closed the connection before a whole head, or it broke."""
        buffered = read_ahead(conn)
        if type(conn.sock) is not socket.socket:
            return buffered, 0  # TLS: no peek past gunicorn
        try:
            peeked = conn.sock.recv(PEEK_BYTES, socket.MSG_PEEK | socket.MSG_DONTWAIT)
        except BlockingIOError:
            return buffered, 0
        except OSError:
            return None
        if not peeked:  # the client's end of the connection
            return (buffered, 0) if head_ready(buffered) else None
        return buffered + peeked, len(peeked)

    def next_head_here(self, conn) -> bool | None:
        """For a request thread after an answer on a kept-alive connection: True when the whole
        head of the client's next request is there, False when the client closed the connection,
        None when neither (the main loop waits for it), or when that request is one the main loop
        hands to rank 0 (``early.takes``; gthread's ``finish_request`` gives it to the main loop at
        once when gunicorn read some of it)."""
        look = self.look(conn)
        if look is None:
            return False
        if not head_ready(look[0]):
            return None
        if self.early is not None and self.early.takes(look[0]):
            return None
        return True

    def _wait_for_head(self, conn, seen: bytes, peeked: int) -> None:
        if not getattr(conn, "waiting_head", False):  # as self.waits says, without a call per request
            conn.waiting_head = True
            conn.peeks = 0
            self._wait(conn, time.monotonic() + self.header_read_timeout)
            self.poller.register(conn.sock, selectors.EVENT_READ, partial(self._on_head_readable, conn))
        else:
            conn.peeks += 1
        if seen and (peeked >= PEEK_BYTES or conn.peeks >= PEEKS or not self.peek_for(conn, seen)):
            self.set_lowat(conn, 1)
            conn.head = bytearray(conn.parser.unreader.take_buffered() if conn.initialized else b"")
            self._read_head(conn)
        else:
            self.set_lowat(conn, peeked + 1)  # woken once more came (or the client closed)

    def _on_head_readable(self, conn, _sock) -> None:
        self.enqueue_req(conn)

    def _read_head(self, conn) -> None:
        try:
            data = conn.sock.recv(READ_BYTES, socket.MSG_DONTWAIT)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            self._drop(conn)  # the client left with half a head
            return
        start = len(conn.head)
        conn.head += data
        if not head_ready(conn.head, start) and len(conn.head) <= self.max_head:
            return
        head, conn.head = bytes(conn.head), None  # (past max_head: gunicorn refuses it, 431)
        self._head_came(conn)
        conn.init()
        conn.parser.unreader.unread(head)  # gunicorn reads it first, or rank 0 (early.send)
        self.serve(conn, head)

    def _head_came(self, conn) -> None:
        if getattr(conn, "waiting_head", False):
            conn.waiting_head = False
            self.waits.done(conn)
            self.poller.unregister(conn.sock)
        self.set_lowat(conn, 1)  # a thread's reads must not wait for more than there is
        conn.data_ready = True  # gthread's handle does not wait for it again

    def set_lowat(self, conn, size: int) -> None:
        if getattr(conn, "lowat", 1) != size:
            conn.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, size)
            conn.lowat = size

    # -- after an answer rank 0 wrote (container.frontend.early.Connections; called from any thread)
    def let_go(self, conn, keep: bool) -> None:
        self.method_queue.defer(self._let_go, conn, keep)

    def _let_go(self, conn, keep: bool) -> None:
        """As gthread's ``finish_request`` after an answer: wait for the client's next request
        on the poller, or close the connection (at once when the client closed it already)."""
        waiting = client_waiting(conn.sock) if keep and self.alive else False
        if waiting:
            self.enqueue_req(conn)  # its next request is coming already
            return
        if waiting is None:
            conn.sock.setblocking(False)
            conn.set_timeout()
            self.keepalived_conns.append(conn)
            self.poller.register(conn.sock, selectors.EVENT_READ, partial(self.on_client_socket_readable, conn))
            self.idle(conn)
            return
        self.nr_conns -= 1
        close_read(conn)

    def _ping(self, conn) -> None:
        if not _writable(conn.sock):
            self._drop(conn)  # a client that does not read its answers would hold the thread writing one
            return
        conn.ping = True
        fs = self.ping_pool.submit(self.handle, conn)
        fs.add_done_callback(lambda fut: self.method_queue.defer(self.finish_request, conn, fut))

    # -- waiting connections: idle ones (gthread's keepalived_conns) and heads, per client
    def _wait(self, conn, deadline: float | None = None) -> None:
        crowded = self.waits.wait(conn, client_address(conn), deadline)
        if crowded is not None:
            self._count("client")
            self.close_waiting(
                crowded,
                RequestTimeout(
                    f"the request head was not whole when its client opened more than {self.waits.per_client} "
                    "connections waiting for a request (max_connections_per_client): the oldest is closed"
                ),
            )

    def idle(self, conn) -> None:
        """``conn`` waits for its next request, as one of gthread's kept-alive connections."""
        self._wait(conn)

    def finish_request(self, conn, fs) -> None:
        super().finish_request(conn, fs)
        if self.keepalived_conns and self.keepalived_conns[-1] is conn:
            self.idle(conn)

    def on_client_socket_readable(self, conn, client) -> None:
        self.waits.done(conn)
        super().on_client_socket_readable(conn, client)

    def close_waiting(self, conn, error: ServingError) -> None:
        """Close a waiting connection; one whose client sent part of a head gets ``error`` first."""
        seen = b""
        if self.waits.waiting_for_head(conn):
            seen = bytes(conn.head) if getattr(conn, "head", None) is not None else (self.look(conn) or (b"",))[0]
        else:
            self.keepalived_conns.remove(conn)
        self._drop(conn, close=False)
        if seen.strip():
            try:
                conn.sock.send(json_answer(request_path(seen), *describe(error)), socket.MSG_DONTWAIT)
            except OSError:
                pass
        close_read(conn)

    def _drop(self, conn, close: bool = True) -> None:
        """The connection waits no more and is counted no more (closed, unless ``close`` is False)."""
        if conn in self.waits:
            self.waits.done(conn)
            try:
                self.poller.unregister(conn.sock)
            except (KeyError, ValueError, OSError):
                pass  # not registered (yet)
        conn.head = None
        conn.waiting_head = False
        self.nr_conns -= 1
        if close:
            conn.close()

    def murder_keepalived(self, force: bool = False) -> None:
        """gthread's (kept-alive connections idle past ``keepalive`` are closed), keeping count."""
        now = time.monotonic()
        while self.keepalived_conns and (force or self.keepalived_conns[0].timeout <= now):
            conn = self.keepalived_conns.popleft()
            self.waits.done(conn)
            try:
                self.poller.unregister(conn.sock)
            except (KeyError, ValueError, OSError):
                pass
            self.nr_conns -= 1
            conn.close()

    def murder_pending(self) -> None:
        """gthread's, with one clock for all (``pending_expired``), then the heads past their
        deadline (all of them ``STOP_KEEPALIVE_LINGER`` after the worker began to stop). Runs
        after every pass of the loop: it looks at nothing more when nothing is due."""
        now = time.monotonic()
        if self.pending_conns:
            for conn in [conn for conn in self.pending_conns if conn.timeout <= now]:
                self.pending_conns.remove(conn)
                self.poller.unregister(conn.sock)
                self.pending_expired(conn)
        if not self.alive:
            self.stopped = min(self.stopped, now)
        due = self.waits.next_deadline()
        if due is not None and (due <= now or now >= self.stopped + STOP_KEEPALIVE_LINGER):
            self._expire_heads(math.inf if now >= self.stopped + STOP_KEEPALIVE_LINGER else now)
        if self.closed:
            self._report(now)

    def _expire_heads(self, now: float) -> None:
        late = RequestTimeout(
            f"the request head did not arrive whole within {self.header_read_timeout:g}s (header_read_timeout)"
        )
        for conn in self.waits.expired(now):
            self._count("head")
            self.close_waiting(conn, late)

    def pending_expired(self, conn) -> None:
        """A connection gthread deferred to its poller that sent nothing in time: closed."""
        self.nr_conns -= 1
        conn.close()

    def wait_for_and_dispatch_events(self, timeout: float) -> None:
        """gthread's, waking in time for the next deadline of a waiting connection."""
        due = self.waits.next_deadline()
        if self.pending_conns:
            body_due = min(conn.timeout for conn in self.pending_conns)
            due = body_due if due is None else min(due, body_due)
        if due is not None:
            timeout = max(min(timeout, due - time.monotonic()), 0.0)
        super().wait_for_and_dispatch_events(timeout)

    def accept(self, listener) -> None:
        """gthread's; at the server's bound on connections (gthread stops accepting there), the
        connection that has waited longest is closed for the new one."""
        try:
            super().accept(listener)
        except OSError as exc:
            if exc.errno not in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                raise
            if not self._make_room():
                self.set_accept_enabled(False)  # until a connection closes (gthread's loop enables it again)
            return
        while self.nr_conns >= self.worker_connections and self._make_room():
            pass

    def _make_room(self) -> bool:
        oldest = self.waits.oldest()
        if oldest is None:
            return False
        self._count("server")
        self.close_waiting(
            oldest,
            ServiceUnavailable(
                f"the server holds as many connections as it may ({self.worker_connections}); "
                "the one waiting longest is closed"
            ),
        )
        return True

    def run(self) -> None:
        try:
            super().run()
        finally:
            self.ping_pool.shutdown(wait=False)
            self._report(math.inf)

    # -- what was closed here: a metric, and a log line at most every REPORT_EVERY seconds
    def _count(self, reason: str) -> None:
        self.closed[reason] += 1
        if self.closed_metric is not None:
            self.closed_metric.labels(reason).inc()

    def _report(self, now: float) -> None:
        if not self.closed or now < self.reported + REPORT_EVERY:
            return
        why = {
            "head": f"whose request head did not come whole within {self.header_read_timeout:g}s (header_read_timeout)",
            "client": f"for newer ones of the same client past max_connections_per_client={self.waits.per_client}",
            "server": f"for new ones at the server's bound of {self.worker_connections} connections",
        }
        log.warning("closed connections: %s", "; ".join(f"{n} {why[reason]}" for reason, n in self.closed.items()))
        self.closed.clear()
        self.reported = now
