"""How the vLLM engine loads the media of chat messages: vLLM's media connector (``MediaConnector``,
its extension point for loading images, videos and audio from URLs) subclassed, registered in vLLM's
``MEDIA_CONNECTOR_REGISTRY`` as ``sagelmi`` and chosen with ``VLLM_MEDIA_CONNECTOR`` in the worker's
process, where vLLM's chat renderer loads every message's media (the engine core gets them processed).

- **Media URLs reach public addresses only** (``AddressPolicy``): loopback, link-local (the instance
  metadata services), private, shared (CGNAT), unspecified, multicast, reserved and documentation
  ranges, their IPv4-mapped / NAT64 / 6to4 IPv6 forms, and this container's own addresses are refused,
  unless ``option.allowed_media_networks`` names their range or ``option.allowed_media_domains`` the
  host (a trusted host may resolve anywhere). The check is made on the addresses connected to: an
  aiohttp resolver hands the connection only allowed addresses (a name that resolves to a refused one
  when fetched is refused, DNS rebinding included), and an IP literal, which aiohttp does not
  resolve, is checked before the request. Redirects are followed here, each hop checked the same way
  (``allowed_media_domains`` too), at most ``MAX_REDIRECTS`` of them.
- **The client learns nothing about the network**: a refused address, a refused connection, a
  timeout or a failed lookup all answer the same ``FETCH_FAILED`` (400); the reason goes to the log,
  with the request id. A host that answers keeps vLLM's answers (a 4xx from it is 422, a body over
  ``VLLM_MAX_MEDIA_DOWNLOAD_SIZE_MB`` is 422).
- **Images are sized before they are decoded**: one of more than ``max_image_pixels`` pixels is
  refused from its header (PIL reads the size when it opens an image, and decodes on ``load``), from a
  data URL, an http(s) URL or a file alike.

vLLM's own rules stay: ``allowed_local_media_path`` for ``file://``, its fetch timeouts and retries
(``VLLM_IMAGE_FETCH_TIMEOUT``, ``VLLM_MEDIA_FETCH_MAX_RETRIES``, each try's timeout four times the
last), ``VLLM_MEDIA_URL_ALLOW_REDIRECTS``, its media cache (asked once the URL's host passed the
policy). Proxies from the environment (``HTTP_PROXY`` ...) are not used: the addresses checked must
be the ones connected to.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import os
import socket
from collections.abc import Iterable, Sequence
from io import BytesIO
from pathlib import Path
from typing import Any

import aiohttp
import psutil
import pybase64
from aiohttp.abc import AbstractResolver, ResolveResult
from PIL import Image
from vllm import envs as vllm_envs
from vllm.connections import HTTPConnection, HTTPResponseSizeExceededError, MediaDownloadSizeExceededError
from vllm.exceptions import VLLMValidationError
from vllm.multimodal.image import open_image
from vllm.multimodal.media import MEDIA_CONNECTOR_REGISTRY, MediaConnector
from vllm.multimodal.media.base import MediaIO
from vllm.multimodal.media.image import ImageMediaIO
from yarl import URL

from container.core.settings import Settings

log = logging.getLogger("sagelmi.vllm")

NAME = "sagelmi"  # VLLM_MEDIA_CONNECTOR's value for MediaConnectorWithPolicy
MAX_REDIRECTS = 10  # aiohttp's default, which vLLM's own fetches follow
_REDIRECTS = (301, 302, 303, 307, 308)
_RETRY_FACTOR = 4  # vLLM's: each try waits 4x longer than the last, and sleeps 4**n s before it
_READ_CHUNK = 64 * 1024
FETCH_FAILED = (
    "could not fetch a media URL of the messages: its address is not one this server fetches from, or its "
    "host did not answer in time or refused the connection (internal hosts need option.allowed_media_networks "
    "or option.allowed_media_domains)"
)

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network


def _table(*rows: tuple[str, str]) -> list[tuple[IPNetwork, str]]:
    return [(ipaddress.ip_network(net), what) for net, what in rows]


# IPv4 ranges that are not public addresses (IANA's special-purpose registry), and what each is
_NOT_PUBLIC_V4 = _table(
    ("0.0.0.0/8", "unspecified ('this network')"),
    ("10.0.0.0/8", "private (RFC 1918)"),
    ("100.64.0.0/10", "shared address space (carrier-grade NAT)"),
    ("127.0.0.0/8", "loopback"),
    ("169.254.0.0/16", "link-local (instance metadata services)"),
    ("172.16.0.0/12", "private (RFC 1918)"),
    ("192.0.0.0/24", "IETF protocol assignments"),
    ("192.0.2.0/24", "documentation"),
    ("192.88.99.0/24", "6to4 relay anycast"),
    ("192.168.0.0/16", "private (RFC 1918)"),
    ("198.18.0.0/15", "benchmarking"),
    ("198.51.100.0/24", "documentation"),
    ("203.0.113.0/24", "documentation"),
    ("224.0.0.0/4", "multicast"),
    ("240.0.0.0/4", "reserved (broadcast included)"),
)
# IPv6: public addresses are global unicast (2000::/3) outside these
_NOT_PUBLIC_V6 = _table(
    ("::/128", "unspecified"),
    ("::1/128", "loopback"),
    ("64:ff9b:1::/48", "local-use NAT64"),
    ("100::/64", "discard-only"),
    ("2001::/23", "IETF protocol assignments (Teredo included)"),
    ("2001:db8::/32", "documentation"),
    ("3fff::/20", "documentation"),
    ("fc00::/7", "unique local (private)"),
    ("fe80::/10", "link-local (instance metadata services)"),
    ("fec0::/10", "site-local"),
    ("ff00::/8", "multicast"),
)
_GLOBAL_UNICAST = ipaddress.ip_network("2000::/3")
_NAT64 = ipaddress.ip_network("64:ff9b::/96")


def _embedded_v4(ip: ipaddress.IPv6Address) -> ipaddress.IPv4Address | None:
    """The IPv4 address an IPv6 address reaches: IPv4-mapped (``::ffff:a.b.c.d``), NAT64
    (``64:ff9b::a.b.c.d``) or 6to4 (``2002:aabb:ccdd::``)."""
    if ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    if ip in _NAT64:
        return ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
    return ip.sixtofour


def not_public(ip: IPAddress) -> str | None:
    """What makes ``ip`` other than a public address (loopback, private ...), or None if it is one."""
    if isinstance(ip, ipaddress.IPv6Address):
        v4 = _embedded_v4(ip)
        if v4 is not None:
            reason = not_public(v4)
            return f"{reason}, as {v4}" if reason else None
    table = _NOT_PUBLIC_V4 if ip.version == 4 else _NOT_PUBLIC_V6
    for network, what in table:
        if ip in network:
            return what
    if isinstance(ip, ipaddress.IPv6Address) and ip not in _GLOBAL_UNICAST:
        return "reserved (outside global unicast 2000::/3)"
    return None


def own_addresses() -> set[IPAddress]:
    """The addresses of this machine's (this container's) network interfaces."""
    found: set[IPAddress] = set()
    for entries in psutil.net_if_addrs().values():
        for entry in entries:
            if entry.family in (socket.AF_INET, socket.AF_INET6):
                try:
                    found.add(ipaddress.ip_address(entry.address.split("%")[0]))
                except ValueError:
                    continue
    return found


class AddressPolicy:
    """Which addresses and hosts media URLs may reach: public addresses; the ranges of
    ``networks`` too (an address of ``own``, this container's, only when a network is that
    address alone); any address of a host in ``domains`` (vLLM's ``allowed_media_domains``,
    which when given are also the only hosts allowed)."""

    def __init__(
        self, networks: Sequence[IPNetwork] = (), domains: Iterable[str] = (), own: Iterable[IPAddress] = ()
    ) -> None:
        self.networks = list(networks)
        self.domains = {_host_name(d) for d in domains}
        self.own = set(own)

    def trusts(self, host: str) -> bool:
        """Whether ``host`` is named in ``domains``: its addresses are not checked."""
        return _host_name(host) in self.domains

    def host_refusal(self, host: str) -> str | None:
        """Why ``host`` (of a URL) may not be fetched, or None: not one of ``domains`` when those
        are given."""
        if self.domains and not self.trusts(host):
            return f"{host!r} is not in option.allowed_media_domains"
        return None

    def refusal(self, address: str) -> str | None:
        """Why ``address`` (an IP address as text) may not be connected to, or None if it may."""
        try:
            ip = ipaddress.ip_address(address.split("%")[0])
        except ValueError:
            return "not an IP address"
        forms: list[IPAddress] = [ip]
        if isinstance(ip, ipaddress.IPv6Address) and (v4 := _embedded_v4(ip)) is not None:
            forms.append(v4)
        own = any(form in self.own for form in forms)
        # an address of this container only when named alone, any other in the networks named
        if any(form in n and (n.num_addresses == 1 or not own) for n in self.networks for form in forms):
            return None
        reason = not_public(ip) or ("an address of this container" if own else None)
        return f"{address} is {reason}" if reason else None


def _host_name(host: str) -> str:
    return host.rstrip(".").lower()


class MediaURLRefused(Exception):
    """A media URL's hop that the policy refuses (the reason is for the log, not the client)."""


class _PolicyResolver(AbstractResolver):
    """aiohttp's resolver, answering only the addresses the policy allows (every address of a
    trusted host); ``MediaURLRefused`` when none is left. aiohttp connects only to what its
    resolver answers."""

    def __init__(self, policy: AddressPolicy, resolver: AbstractResolver) -> None:
        self.policy = policy
        self.resolver = resolver

    async def resolve(self, host: str, port: int = 0, family: socket.AddressFamily = socket.AF_INET):
        found = await self.resolver.resolve(host, port, family)
        if self.policy.trusts(host):
            return found
        allowed: list[ResolveResult] = []
        refusals = []
        for result in found:
            refusal = self.policy.refusal(result["host"])
            if refusal is None:
                allowed.append(result)
            else:
                refusals.append(refusal)
        if not allowed:
            raise MediaURLRefused(f"{host!r} resolves to no allowed address ({'; '.join(refusals) or 'none'})")
        return allowed

    async def close(self) -> None:
        await self.resolver.close()


def _size_limit(max_bytes: int | None) -> tuple[int | None, bool]:
    """The most bytes a body may have, and whether that is vLLM's download limit
    (``VLLM_MAX_MEDIA_DOWNLOAD_SIZE_MB``) rather than the media kind's own (``max_bytes``)."""
    download = vllm_envs.VLLM_MAX_MEDIA_DOWNLOAD_SIZE_MB * 1024 * 1024
    if download > 0 and (max_bytes is None or download <= max_bytes):
        return download, True
    return max_bytes, False


def _too_large(limit: int, received: int, download_limit: bool) -> Exception:
    if download_limit:
        return MediaDownloadSizeExceededError(limit, received)
    return HTTPResponseSizeExceededError(limit, received)


async def _read_body(response: aiohttp.ClientResponse, max_bytes: int | None) -> bytes:
    """The body, refused (vLLM's exceptions) past the size limit, before it is all read."""
    limit, download_limit = _size_limit(max_bytes)
    if limit is not None and response.content_length is not None and response.content_length > limit:
        raise _too_large(limit, response.content_length, download_limit)
    chunks, received = [], 0
    async for chunk in response.content.iter_chunked(_READ_CHUNK):
        received += len(chunk)
        if limit is not None and received > limit:
            raise _too_large(limit, received, download_limit)
        chunks.append(chunk)
    return b"".join(chunks)


def _transient(exc: Exception) -> bool:
    """A failure worth another try, as vLLM retries: timeouts, connection failures, 5xx answers."""
    if isinstance(exc, aiohttp.ClientResponseError):
        return exc.status >= 500
    return isinstance(exc, (TimeoutError, asyncio.TimeoutError, aiohttp.ClientConnectionError, ConnectionError))


class PolicyHTTPConnection(HTTPConnection):
    """vLLM's HTTP connection for media, fetching through an ``AddressPolicy``: every hop's
    host and addresses are checked, redirects are followed here. ``MediaURLRefused`` for a hop
    the policy refuses (not retried); vLLM's exceptions otherwise."""

    def __init__(self, policy: AddressPolicy) -> None:
        super().__init__(reuse_client=True)
        self.policy = policy
        self._session: aiohttp.ClientSession | None = None

    def _new_session(self) -> aiohttp.ClientSession:
        resolver = _PolicyResolver(self.policy, aiohttp.DefaultResolver())
        return aiohttp.ClientSession(connector=aiohttp.TCPConnector(resolver=resolver), trust_env=False)

    async def get_async_client(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = self._new_session()
        return self._session

    def check_hop(self, url: URL) -> None:
        """Refuse (``MediaURLRefused``) a hop whose scheme, host or IP literal the policy does not
        allow; a host name's addresses are checked when it is resolved."""
        if url.scheme not in ("http", "https") or not url.raw_host:
            raise MediaURLRefused(f"not an http(s) URL with a host (scheme {url.scheme!r})")
        host = url.raw_host
        refusal = self.policy.host_refusal(host)
        if refusal is None and not self.policy.trusts(host):
            try:
                ipaddress.ip_address(host.split("%")[0])
            except ValueError:
                return  # a name: _PolicyResolver checks what it resolves to
            refusal = self.policy.refusal(host)
        if refusal is not None:
            raise MediaURLRefused(refusal)

    async def _follow(
        self, session: aiohttp.ClientSession, url: str, allow_redirects: bool, max_bytes: int | None
    ) -> bytes:
        target = URL(url)
        for hop in range(MAX_REDIRECTS + 1):
            try:
                self.check_hop(target)
                async with session.get(target, headers=self._headers(), allow_redirects=False) as response:
                    location = response.headers.get("Location")
                    if response.status in _REDIRECTS and location:
                        if not allow_redirects:
                            raise MediaURLRefused(f"a redirect ({response.status}); VLLM_MEDIA_URL_ALLOW_REDIRECTS=0")
                        target = target.join(URL(location))
                        continue
                    response.raise_for_status()
                    return await _read_body(response, max_bytes)
            except MediaURLRefused as exc:
                if hop == 0:
                    raise
                raise MediaURLRefused(f"redirected to {_where(str(target))}: {exc}") from None
        raise MediaURLRefused(f"more than {MAX_REDIRECTS} redirects")

    async def _fetch(
        self, session: aiohttp.ClientSession, url: str, timeout: float | None, allow_redirects: bool, max_bytes
    ) -> bytes:
        attempts = max(vllm_envs.VLLM_MEDIA_FETCH_MAX_RETRIES, 1)
        for attempt in range(attempts):
            try_timeout = timeout * _RETRY_FACTOR**attempt if timeout is not None else None
            try:
                return await asyncio.wait_for(self._follow(session, url, allow_redirects, max_bytes), try_timeout)
            except Exception as exc:
                if attempt + 1 >= attempts or not _transient(exc):
                    raise
                log.info("media URL of %s: try %d of %d failed (%s)", _where(url), attempt + 1, attempts, _why(exc))
                await asyncio.sleep(_RETRY_FACTOR**attempt)
        raise AssertionError("unreachable")

    async def async_get_bytes(
        self, url: str, *, timeout: float | None = None, allow_redirects: bool = True, max_bytes: int | None = None
    ) -> bytes:
        session = await self.get_async_client()
        return await self._fetch(session, url, timeout, allow_redirects, max_bytes)

    def get_bytes(
        self, url: str, *, timeout: float | None = None, allow_redirects: bool = True, max_bytes: int | None = None
    ) -> bytes:
        """vLLM's synchronous load (offline chat, never the server's requests): the same fetch, on
        a loop and a session of its own."""

        async def fetch() -> bytes:
            async with self._new_session() as session:
                return await self._fetch(session, url, timeout, allow_redirects, max_bytes)

        return asyncio.run(fetch())


def _where(url: str) -> str:
    """A URL's scheme, host and port, for the log: its path and query may hold a signature."""
    try:
        parsed = URL(url)
        return repr(f"{parsed.scheme}://{parsed.host}:{parsed.port}")[1:-1]  # control characters escaped
    except ValueError:
        return "an unparsable URL"


def _why(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


class PixelBound(MediaIO[Any]):
    """An image loader (vLLM's ``ImageMediaIO``) that first reads the image's size from its
    header and refuses one of more than ``limit`` pixels, before anything is decoded."""

    def __init__(self, images: ImageMediaIO, limit: int) -> None:
        super().__init__()
        self.images = images
        self.limit = limit

    def get_max_bytes(self) -> int | None:
        return self.images.get_max_bytes()

    def _check(self, data: bytes) -> None:
        try:
            with open_image(BytesIO(data)) as image:
                width, height = image.size
        except Image.DecompressionBombError:  # PIL's own bound: twice its MAX_IMAGE_PIXELS
            width = height = None
        except Exception:
            return  # not an image PIL opens: the loader says so, as vLLM does
        if width is None or height is None or width * height > self.limit:
            size = "its size" if width is None else f"{width} x {height} = {width * height:,} pixels"
            raise VLLMValidationError(
                f"an image is too large to decode ({size}): this server takes at most {self.limit:,} pixels "
                f"(the max_image_pixels setting, SERVING_MAX_IMAGE_PIXELS)",
                parameter="image_url",
            )

    def load_bytes(self, data: bytes) -> Any:
        self._check(data)
        return self.images.load_bytes(data)

    def load_base64(self, media_type: str, data: str) -> Any:
        return self.load_bytes(pybase64.b64decode(data, validate=True))  # as ImageMediaIO decodes

    def load_file(self, filepath: Path) -> Any:
        return self.load_bytes(filepath.read_bytes())


# What fetching a media URL raises when its host could not be reached (vLLM has already turned the
# host's own 4xx answers into its 422): the client gets FETCH_FAILED for all of them alike.
_UNREACHABLE = (MediaURLRefused, aiohttp.ClientError, TimeoutError, asyncio.TimeoutError)


class MediaConnectorWithPolicy(MediaConnector):
    """vLLM's media connector, fetching through ``connection`` (a ``PolicyHTTPConnection``) and
    sizing images before they are decoded (``max_image_pixels``). ``configured`` makes the class
    vLLM's registry instantiates for each request."""

    connection_with_policy: PolicyHTTPConnection
    max_image_pixels: int

    def __init__(self, media_io_kwargs: dict[str, dict[str, Any]] | None = None, **kwargs: Any) -> None:
        kwargs["connection"] = self.connection_with_policy
        super().__init__(media_io_kwargs, **kwargs)

    @classmethod
    def configured(cls, policy: AddressPolicy, max_image_pixels: int) -> type[MediaConnectorWithPolicy]:
        attributes = {"connection_with_policy": PolicyHTTPConnection(policy), "max_image_pixels": max_image_pixels}
        return type(cls.__name__, (cls,), attributes)

    def _bounded(self, media_io: MediaIO) -> MediaIO:
        return PixelBound(media_io, self.max_image_pixels) if isinstance(media_io, ImageMediaIO) else media_io

    def _check_url(self, url: str) -> None:
        """The policy's check of an http(s) URL's own host, before vLLM's (whose refusal of a host
        outside ``allowed_media_domains`` lists them) and before its media cache is asked."""
        if url[:5].lower() == "data:":
            return
        try:
            parsed = URL(url)
        except ValueError:
            return  # vLLM refuses it
        if parsed.scheme in ("http", "https"):
            self.connection_with_policy.check_hop(parsed)

    def load_from_url(self, url: str, media_io: MediaIO, *, fetch_timeout: int | None = None) -> Any:
        try:
            self._check_url(url)
            return super().load_from_url(url, self._bounded(media_io), fetch_timeout=fetch_timeout)
        except _UNREACHABLE as exc:
            raise _fetch_failed(url, exc) from None

    async def load_from_url_async(self, url: str, media_io: MediaIO, *, fetch_timeout: int | None = None) -> Any:
        try:
            self._check_url(url)
            return await super().load_from_url_async(url, self._bounded(media_io), fetch_timeout=fetch_timeout)
        except _UNREACHABLE as exc:
            raise _fetch_failed(url, exc) from None


def _fetch_failed(url: str, exc: BaseException) -> VLLMValidationError:
    """The one answer to every failure to reach a media URL's host; the reason goes to the log."""
    if isinstance(exc, MediaURLRefused):
        log.warning("media URL of %s refused: %s", _where(url), exc)
    else:
        log.info("media URL of %s could not be fetched: %s", _where(url), _why(exc))
    return VLLMValidationError(FETCH_FAILED, parameter="image_url")


def install(settings: Settings, engine_kwargs: dict[str, Any]) -> None:
    """Have vLLM load media in this process through ``MediaConnectorWithPolicy``, with the
    settings' networks and pixel limit and vLLM's ``allowed_media_domains`` from
    ``engine_kwargs``. Call before the engine is built (vLLM caches its environment then).
    A ``VLLM_MEDIA_CONNECTOR`` of the user's own is kept, with a warning."""
    chosen = vllm_envs.VLLM_MEDIA_CONNECTOR
    if chosen not in ("http", NAME):
        log.warning(
            "VLLM_MEDIA_CONNECTOR=%s: media are loaded by that connector, without sagelmi's address policy "
            "(option.allowed_media_networks) and image size limit (max_image_pixels)",
            chosen,
        )
        return
    policy = AddressPolicy(
        settings.allowed_media_network_list, engine_kwargs.get("allowed_media_domains") or (), own_addresses()
    )
    MEDIA_CONNECTOR_REGISTRY.register(NAME)(MediaConnectorWithPolicy.configured(policy, settings.max_image_pixels))
    os.environ["VLLM_MEDIA_CONNECTOR"] = NAME  # vLLM reads it when a request's media are loaded
    log.info(
        "media URLs: public addresses%s%s; images up to %s pixels",
        f", and {settings.allowed_media_networks}" if policy.networks else "",
        f"; only the hosts {sorted(policy.domains)}" if policy.domains else "",
        f"{settings.max_image_pixels:,}",
    )
