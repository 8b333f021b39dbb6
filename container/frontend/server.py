"""Running the Flask app under gunicorn: ``python -m container.frontend.server LAUNCH``.

One gunicorn worker process with a thread per request (gthread), so all
requests share one ``Router`` (queue bound, least-in-flight routing, health).
A connection gets a thread only once its request's head is there whole
(``container.frontend.main_loop``). The listening socket is created by the
supervisor before the model loads and passed in as a file descriptor.

Shutdown: on SIGTERM the worker first drains: it keeps accepting connections
but answers 503, lets the requests in flight finish (up to the grace period),
and only then stops. A stop signal that reaches the worker while it boots
waits (blocked) until it has loaded the app, so none is lost.
"""

from __future__ import annotations

import logging
import resource
import signal
import ssl
import sys
import threading
from pathlib import Path
from typing import cast

from gunicorn import glogging, util
from gunicorn.app.base import BaseApplication
from gunicorn.arbiter import Arbiter
from gunicorn.http import errors as http_errors
from gunicorn.workers.gthread import ThreadWorker

from container.core import logs, proc
from container.core.errors import InputError, scrub
from container.core.launch import FrontendLaunch, decode_frontend_launch
from container.frontend.app import create_app
from container.frontend.main_loop import HeadWaitingWorker, json_answer

log = logging.getLogger("sagelmi.frontend")

# Threads beyond the queue bound, so rejections never wait for a thread (/ping has threads of its own).
SPARE_THREADS = 32
FD_RESERVE = 128  # file descriptors the frontend keeps for itself (its groups' sockets, logs, pipes ...)


class GunicornLog(glogging.Logger):
    """Gunicorn's own messages in sagelmi's log format; no access log (the app
    logs each request with its id)."""

    def setup(self, cfg) -> None:
        self.error_log.handlers.clear()
        self.error_log.propagate = True
        self.error_log.setLevel(cfg.loglevel.upper())
        self.access_log.handlers.clear()
        self.access_log.propagate = False
        self.access_log.disabled = True


# What stops gunicorn's worker: TERM drains it (handle_exit), INT and QUIT end it at once.
STOP_SIGNALS = {signal.SIGTERM, signal.SIGINT, signal.SIGQUIT}


class FrontendArbiter(Arbiter):
    """gunicorn's arbiter, forking its worker with the stop signals blocked: a
    new worker runs the arbiter's handlers until its own are installed, and the
    app it serves is loaded after that, so a stop signal sent to it in between
    (the supervisor stopping right after start-up) would be lost, and the
    arbiter would wait ``graceful_timeout`` before killing it, or would find the
    app not there yet. The worker unblocks them once it can act on them
    (``DrainingWorker.load_wsgi``)."""

    def spawn_worker(self):
        previous = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
        try:
            return super().spawn_worker()  # in the worker, it returns only by exiting
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, previous)


# gunicorn's request errors (gunicorn.http.errors) whose answer is not a plain 400: status, reason.
_STATUS = {
    http_errors.LimitRequestLine: (414, "URI Too Long"),
    http_errors.LimitRequestHeaders: (431, "Request Header Fields Too Large"),
    http_errors.ExpectationFailed: (417, "Expectation Failed"),
    http_errors.UnsupportedTransferCoding: (501, "Not Implemented"),
    http_errors.ForbiddenProxyRequest: (403, "Forbidden"),
    http_errors.ConfigurationProblem: (500, "Internal Server Error"),
}


def rejection(exc: BaseException) -> tuple[int, str, str] | None:
    """The answer to a request gunicorn could not read (``exc``: one of its request errors):
    status, reason and what was wrong; ``None`` for any other exception (a server error)."""
    if isinstance(exc, ssl.SSLError):
        return 403, "Forbidden", str(exc)
    app_made = (http_errors.InvalidResponseHeader, http_errors.InvalidResponseHeaderName)  # the app's, not the client's
    if not isinstance(exc, http_errors.ParseException) or isinstance(exc, app_made):
        return None
    status, reason = next((answer for kind, answer in _STATUS.items() if isinstance(exc, kind)), (400, "Bad Request"))
    return status, reason, str(exc)


class DrainingWorker(HeadWaitingWorker):
    """A gthread worker whose main loop keeps connections until their request heads are whole
    (``container.frontend.main_loop``), hands the handler's requests to their group unread
    (``container.frontend.early``), answers 503 while draining instead of refusing
    connections, stops once its requests are done, and answers the requests it rejects itself
    in JSON."""

    def init_process(self) -> None:
        launch = cast("FrontendServer", self.app).launch
        logs.configure("frontend", self.cfg.loglevel.upper(), launch.log_format)
        proc.die_with_parent()
        self.hold(launch.header_read_timeout, launch.max_connections_per_client)
        super().init_process()

    def load_wsgi(self) -> None:
        super().load_wsgi()
        self.early = self.wsgi.extensions.get("sagelmi.early")
        if self.early is not None:
            self.early.connections = self
        metrics = self.wsgi.extensions.get("sagelmi.metrics")
        if metrics is not None:
            self.closed_metric = metrics.connections_closed
        signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)  # what came while booting is handled now

    def handle(self, conn):
        """gthread's, then a look at what the client of a kept-alive connection did meanwhile.
        A client that closed it is let go here: gthread would hand the connection back to its
        main loop, which wakes on the close and hands it to a thread again only to read the
        end (three wake-ups, and this process's CPU in the first millisecond of the client's
        next request). A next request whose head is there whole is served in this thread, without
        the main loop's wake-up and another thread's, unless rank 0 takes it (the main loop hands
        it over); one not whole yet waits in the main loop. /ping's threads serve one and go back."""
        keepalive = super().handle(conn)
        if getattr(conn, "ping", False):
            conn.ping = False
            return keepalive
        while keepalive is True and self.alive and not conn.is_http2:
            waiting = self.next_head_here(conn)
            if waiting is None:
                break  # the main loop waits for its next request
            if not waiting:
                return False  # gthread's main loop closes it
            keepalive = super().handle(conn)
        return keepalive

    def handle_error(self, req, client, addr, exc) -> None:
        """A request gunicorn could not read (bad bytes 400, a head too large 431 ...), or an error
        past the app: answered in the error envelope of the route called (LMI's when the path is not
        known) instead of gunicorn's HTML."""
        path = getattr(req or getattr(exc, "req", None), "path", None) or ""
        answer = rejection(exc)
        if answer is None:
            log.error("error handling a request to %s", path or "an unread path", exc_info=exc)
            status, reason, detail = 500, "Internal Server Error", ""
        else:
            status, reason, detail = answer
            log.warning("invalid request from %s: %s", (addr or ("",))[0], scrub(detail))
        message = InputError.message if status == 400 else reason.lower()
        try:
            util.write_nonblock(client, json_answer(path, status, message, scrub(detail) or reason, reason))
        except OSError:
            log.debug("could not send the error answer")

    def handle_exit(self, sig, frame) -> None:
        router = self.wsgi.extensions["sagelmi"]
        if router.draining:
            return
        router.begin_drain()
        threading.Thread(target=self._stop_when_idle, args=(router,), name="drain", daemon=True).start()

    def _stop_when_idle(self, router) -> None:
        grace = router.launch.grace_period
        log.info("draining: %d request(s) in flight, waiting up to %gs", router.in_flight, grace)
        if router.wait_idle(grace):
            log.info("drained")
        else:
            log.warning("grace period over with %d request(s) still in flight", router.in_flight)
        router.close()
        tracer = self.wsgi.extensions.get("sagelmi.tracer")
        if tracer is not None:
            tracer.shutdown()  # export the spans still queued
        ThreadWorker.handle_exit(self, signal.SIGTERM, None)


def connection_bound(threads: int) -> int:
    """How many connections the frontend may hold at once (gthread's ``worker_connections``): as
    many as its file-descriptor limit allows, once the soft limit is raised to the hard one (a
    container often starts with 1,024 of a much larger hard limit), less ``FD_RESERVE``. Past
    it, the connection waiting longest is closed for a new one (``HeadWaitingWorker.accept``)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
    if soft != resource.RLIM_INFINITY and soft < wanted:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
            soft = wanted
        except (ValueError, OSError) as exc:
            log.warning("could not raise the open-file limit from %d to %d: %s", soft, wanted, exc)
    bound = (1 << 20 if soft == resource.RLIM_INFINITY else soft) - FD_RESERVE
    if bound < threads:
        log.warning(
            "the open-file limit (%d) leaves room for %d connections, fewer than the %d request threads",
            soft,
            bound,
            threads,
        )
    return max(bound, 1)


class FrontendServer(BaseApplication):
    def __init__(self, launch: FrontendLaunch) -> None:
        self.launch = launch
        super().__init__()

    def load_config(self) -> None:
        threads = self.launch.job_queue_size + SPARE_THREADS
        settings = {
            "bind": [f"fd://{self.launch.listen_fd}"],
            "workers": 1,
            "worker_class": f"{__name__}.DrainingWorker",
            "threads": threads,
            "worker_connections": connection_bound(threads),
            "keepalive": 75,  # longer than SageMaker's idle connection reuse
            "timeout": 120,  # heartbeat of the worker's main loop, not a request limit
            "graceful_timeout": int(self.launch.grace_period) + 5,
            "loglevel": self.launch.log_level.lower(),
            "accesslog": None,
            "logger_class": f"{__name__}.GunicornLog",
            "control_socket_disable": True,
            "proc_name": "sagelmi-frontend",
        }
        for key, value in settings.items():
            self.cfg.set(key, value)

    def run(self) -> None:
        try:
            FrontendArbiter(self).run()
        except RuntimeError as exc:  # what gunicorn raises for a configuration it cannot start with
            log.error("the HTTP frontend could not start: %s", exc)
            sys.exit(1)

    def load(self):
        return create_app(self.launch)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    launch = decode_frontend_launch(Path(args[0]).read_bytes())
    logs.configure("frontend", launch.log_level, launch.log_format)
    proc.die_with_parent()
    FrontendServer(launch).run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
