"""Media URLs fetched by the vLLM engine's media connector (handlers/engines/vllm_media.py) over real
sockets, without an engine: an image host on 127.0.0.2 that the settings allow, and a listener on
127.0.0.1 that must never see a connection. tests/e2e/test_vision.py runs the same through a server."""

import asyncio
import http.server
import io
import ipaddress
import logging
import socket
import threading
import time

import pytest
from PIL import Image

from handlers.engines.vllm_media import (
    FETCH_FAILED,
    MAX_REDIRECTS,
    AddressPolicy,
    MediaConnectorWithPolicy,
    own_addresses,
)
from tests.listener import Listener

ALLOWED = "127.0.0.2"


def picture() -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (40, 30), (10, 200, 30)).save(buffer, "PNG")
    return buffer.getvalue()


PICTURE = picture()


class ImageHost:
    """``/picture.png``; ``/redirect?to=URL`` (302 there); ``/loop/N`` (302 to ``/loop/N+1``);
    ``/silent.png`` (answers after 5 s)."""

    def __init__(self, address: str) -> None:
        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                if self.path.startswith("/redirect?to="):
                    return self.redirect(self.path.split("?to=", 1)[1])
                if self.path.startswith("/loop/"):
                    return self.redirect(f"/loop/{int(self.path.rsplit('/', 1)[1]) + 1}")
                if self.path == "/silent.png":
                    time.sleep(5)
                self.send_response(200)
                self.send_header("Content-Type", "image/png")
                self.send_header("Content-Length", str(len(PICTURE)))
                self.end_headers()
                try:
                    self.wfile.write(PICTURE)
                except OSError:
                    pass

            def redirect(self, location: str) -> None:
                self.send_response(302)
                self.send_header("Location", location)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer((address, 0), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def url(self, path: str) -> str:
        return f"http://{ALLOWED}:{self.port}{path}"


@pytest.fixture(scope="module")
def host():
    image_host = ImageHost(ALLOWED)
    yield image_host
    image_host.server.shutdown()


@pytest.fixture()
def listener():
    forbidden = Listener()
    yield forbidden
    forbidden.close()


@pytest.fixture(autouse=True)
def fast_fetch(monkeypatch):
    monkeypatch.setenv("VLLM_IMAGE_FETCH_TIMEOUT", "2")
    monkeypatch.setenv("VLLM_MEDIA_FETCH_MAX_RETRIES", "1")


def connector(*domains: str, networks=(f"{ALLOWED}/32",)):
    policy = AddressPolicy([ipaddress.ip_network(n) for n in networks], domains, own_addresses())
    return MediaConnectorWithPolicy.configured(policy, 50_000_000)(allowed_media_domains=list(domains) or None)


def fetch(url: str, *domains: str):
    """The image, or the exception's text."""

    async def fetch_image():
        media = connector(*domains)
        try:
            return await media.fetch_image_async(url)
        finally:
            await (await media.connection.get_async_client()).close()

    try:
        return asyncio.run(fetch_image())
    except Exception as exc:
        return str(exc)


def test_an_allowed_host_is_fetched_directly_and_through_redirects(host):
    assert fetch(host.url("/picture.png")).size == (40, 30)
    assert fetch(host.url("/redirect?to=/picture.png")).size == (40, 30)
    assert fetch(host.url(f"/redirect?to={host.url('/picture.png')}")).size == (40, 30)
    assert connector().fetch_image(host.url("/picture.png")).size == (40, 30)  # vLLM's synchronous load


@pytest.mark.parametrize("url", [
    "http://127.0.0.1:{port}/picture.png",
    "http://localhost:{port}/picture.png",  # a name that resolves to loopback
    "http://[::ffff:127.0.0.1]:{port}/picture.png",
    "http://169.254.169.254/latest/meta-data/iam/security-credentials/",
    "http://[fd00:ec2::254]/latest/meta-data/",
    "http://[fe80::1]:{port}/picture.png",
])
def test_loopback_and_link_local_urls_are_refused_without_a_connection(url, listener, caplog):
    url = url.format(port=listener.port)
    with caplog.at_level(logging.INFO, logger="sagelmi.vllm"):
        answer = fetch(url)
    assert answer == f"{FETCH_FAILED} (parameter=image_url)"
    assert listener.connections() == 0
    assert "refused" in caplog.text and ("loopback" in caplog.text or "link-local" in caplog.text
                                         or "unique local" in caplog.text), caplog.text
    assert all(r.levelno == logging.WARNING for r in caplog.records if "refused" in r.getMessage())


def test_a_redirect_from_an_allowed_host_to_a_refused_one_is_not_followed(host, listener, caplog):
    with caplog.at_level(logging.WARNING, logger="sagelmi.vllm"):
        answer = fetch(host.url(f"/redirect?to=http://127.0.0.1:{listener.port}/picture.png"))
    assert answer == f"{FETCH_FAILED} (parameter=image_url)"
    assert listener.connections() == 0
    assert f"redirected to http://127.0.0.1:{listener.port}: 127.0.0.1 is loopback" in caplog.text
    answer = fetch(host.url(f"/redirect?to=http://localhost:{listener.port}/picture.png"))
    assert answer == f"{FETCH_FAILED} (parameter=image_url)" and listener.connections() == 0


def test_redirects_are_followed_a_bounded_number_of_times(host, caplog):
    with caplog.at_level(logging.WARNING, logger="sagelmi.vllm"):
        assert fetch(host.url("/loop/0")) == f"{FETCH_FAILED} (parameter=image_url)"
    assert f"more than {MAX_REDIRECTS} redirects" in caplog.text


def test_redirects_are_refused_when_vllm_is_told_not_to_follow_them(host, monkeypatch):
    monkeypatch.setenv("VLLM_MEDIA_URL_ALLOW_REDIRECTS", "0")
    assert fetch(host.url("/redirect?to=/picture.png")) == f"{FETCH_FAILED} (parameter=image_url)"
    assert fetch(host.url("/picture.png")).size == (40, 30)


def test_allowed_domains_are_trusted_and_hold_on_every_hop(host):
    local = ImageHost("127.0.0.1")  # loopback: reached only through a domain named
    try:
        assert fetch(f"http://localhost:{local.port}/picture.png", "localhost").size == (40, 30)
        assert fetch(f"http://127.0.0.1:{local.port}/picture.png") == f"{FETCH_FAILED} (parameter=image_url)"
        # 127.0.0.2 is an allowed network, but not one of the domains, which are then the only hosts; the
        # answer does not list the domains (vLLM's own refusal does)
        assert fetch(host.url("/picture.png"), "localhost") == f"{FETCH_FAILED} (parameter=image_url)"
        redirected = f"http://localhost:{local.port}/redirect?to={host.url('/picture.png')}"
        assert fetch(redirected, "localhost") == f"{FETCH_FAILED} (parameter=image_url)"
    finally:
        local.server.shutdown()


def test_a_refused_address_a_closed_port_and_a_silent_host_look_the_same(host, listener):
    closed = socket.create_server((ALLOWED, 0))
    port = closed.getsockname()[1]
    closed.close()
    answers = {
        "policy": fetch(f"http://127.0.0.1:{listener.port}/picture.png"),
        "closed port": fetch(f"http://{ALLOWED}:{port}/picture.png"),
        "silent": fetch(host.url("/silent.png")),
    }
    assert set(answers.values()) == {f"{FETCH_FAILED} (parameter=image_url)"}, answers
    for text in answers.values():
        assert "127.0.0" not in text and str(port) not in text and "refused" not in text.split(":", 1)[0]
