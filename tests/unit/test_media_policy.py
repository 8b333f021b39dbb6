"""The vLLM engine's media loading (handlers/engines/vllm_media.py): which addresses media URLs may
reach, the resolver that enforces it on what is connected to, and the image size checked from the
header. tests/integration/test_media_fetch.py fetches over real sockets; tests/e2e/test_vision.py
through a real server."""

import asyncio
import base64
import io
import ipaddress
import logging
import re
import socket
import time

import pytest
from PIL import Image
from vllm.multimodal.media import MEDIA_CONNECTOR_REGISTRY
from vllm.multimodal.media.image import ImageMediaIO
from yarl import URL

from container.core.settings import SettingsError, resolve_settings
from handlers.engines import vllm_media
from handlers.engines.vllm_media import (
    AddressPolicy,
    MediaConnectorWithPolicy,
    MediaURLRefused,
    PixelBound,
    PolicyHTTPConnection,
    _PolicyResolver,
    not_public,
)
from handlers.engines.vllm_openai import _options_named


def networks(*cidrs: str):
    return [ipaddress.ip_network(c) for c in cidrs]


# address -> what the refusal says
NOT_PUBLIC = {
    "127.0.0.1": "loopback",
    "127.255.255.254": "loopback",
    "169.254.169.254": "link-local",
    "10.1.2.3": "private",
    "172.16.0.1": "private",
    "172.31.255.255": "private",
    "192.168.1.1": "private",
    "100.64.0.1": "carrier-grade NAT",
    "100.127.255.255": "carrier-grade NAT",
    "0.0.0.0": "unspecified",
    "0.1.2.3": "unspecified",
    "224.0.0.1": "multicast",
    "239.255.255.250": "multicast",
    "240.0.0.1": "reserved",
    "255.255.255.255": "reserved",
    "192.0.0.170": "IETF",
    "192.0.2.1": "documentation",
    "198.18.0.1": "benchmarking",
    "::1": "loopback",
    "::": "unspecified",
    "fe80::1": "link-local",
    "fe80::1%eth0": "link-local",
    "fd00:ec2::254": "unique local",
    "fc00::1": "unique local",
    "fec0::1": "site-local",
    "ff02::1": "multicast",
    "100::1": "discard",
    "2001:db8::1": "documentation",
    "2001:0:4136:e378:8000:63bf:3fff:fdd2": "IETF protocol assignments (Teredo",
    "64:ff9b:1::1": "local-use NAT64",
    "::127.0.0.1": "reserved",  # IPv4-compatible (deprecated)
    "4000::1": "reserved",
    # IPv6 forms that reach an IPv4 address: mapped, NAT64, 6to4
    "::ffff:127.0.0.1": "loopback, as 127.0.0.1",
    "::ffff:169.254.169.254": "link-local (instance metadata services), as 169.254.169.254",
    "::ffff:10.0.0.1": "private (RFC 1918), as 10.0.0.1",
    "::ffff:100.64.0.1": "carrier-grade NAT), as 100.64.0.1",
    "64:ff9b::a9fe:a9fe": "link-local (instance metadata services), as 169.254.169.254",
    "2002:7f00:1::": "loopback, as 127.0.0.1",
    "2002:c0a8:101::1": "private (RFC 1918), as 192.168.1.1",
}
PUBLIC = ["8.8.8.8", "1.1.1.1", "100.63.255.255", "100.128.0.0", "172.15.255.255", "172.32.0.0", "11.0.0.1",
          "2606:4700:4700::1111", "2a00:1450:4001:80b::200e", "::ffff:8.8.8.8", "64:ff9b::808:808", "2002:808:808::"]


@pytest.mark.parametrize("address", sorted(NOT_PUBLIC))
def test_every_non_public_range_is_refused_and_named(address):
    refusal = AddressPolicy().refusal(address)
    assert refusal is not None and NOT_PUBLIC[address] in refusal, refusal


@pytest.mark.parametrize("address", PUBLIC)
def test_public_addresses_are_allowed(address):
    assert AddressPolicy().refusal(address) is None
    assert not_public(ipaddress.ip_address(address)) is None


def test_text_that_is_not_an_address_is_refused():
    assert AddressPolicy().refusal("localhost") == "not an IP address"


def test_allowed_networks_allow_their_addresses_and_mapped_forms_only():
    policy = AddressPolicy(networks("127.0.0.2/32", "10.20.0.0/16", "fd00::/8"))
    for allowed in ("127.0.0.2", "::ffff:127.0.0.2", "10.20.3.4", "fd00:ec2::254"):
        assert policy.refusal(allowed) is None, allowed
    for refused in ("127.0.0.1", "::ffff:127.0.0.1", "10.21.0.1", "169.254.169.254", "fe80::1"):
        assert policy.refusal(refused) is not None, refused


def test_the_containers_own_addresses_are_refused_even_public_or_in_an_allowed_range():
    own = {ipaddress.ip_address(a) for a in ("8.8.4.4", "10.20.0.5", "2600:1f18::5")}
    policy = AddressPolicy(networks("10.20.0.0/16"), own=own)
    assert policy.refusal("8.8.4.4") == "8.8.4.4 is an address of this container"
    assert policy.refusal("::ffff:8.8.4.4") == "::ffff:8.8.4.4 is an address of this container"
    assert policy.refusal("2600:1f18::5") == "2600:1f18::5 is an address of this container"
    assert "private" in policy.refusal("10.20.0.5")  # the wider range does not allow it
    assert policy.refusal("10.20.0.6") is None
    # named alone, it is allowed
    assert AddressPolicy(networks("10.20.0.5/32"), own=own).refusal("10.20.0.5") is None


def test_own_addresses_are_this_machines():
    own = vllm_media.own_addresses()
    assert ipaddress.ip_address("127.0.0.1") in own
    assert all(isinstance(a, (ipaddress.IPv4Address, ipaddress.IPv6Address)) for a in own)


def test_allowed_domains_are_trusted_and_the_only_hosts():
    policy = AddressPolicy(domains=["images.internal", "Example.COM"])
    assert policy.trusts("images.internal") and policy.trusts("example.com.") and not policy.trusts("other.com")
    assert policy.host_refusal("example.com") is None
    assert "not in option.allowed_media_domains" in policy.host_refusal("other.com")
    assert AddressPolicy().host_refusal("anything.com") is None  # none given: any host


@pytest.mark.parametrize("url, says", [
    ("http://127.0.0.1:8080/x.png", "loopback"),
    ("http://[::1]/x.png", "loopback"),
    ("http://[::ffff:169.254.169.254]/latest", "link-local"),
    ("http://[fd00:ec2::254]/latest", "unique local"),
    ("http://169.254.169.254/latest/meta-data/", "link-local"),
    ("ftp://example.com/x.png", "not an http(s) URL"),
])
def test_a_hop_to_a_refused_literal_or_scheme_is_refused_before_connecting(url, says):
    with pytest.raises(MediaURLRefused, match=re.escape(says)):
        PolicyHTTPConnection(AddressPolicy()).check_hop(URL(url))


def test_a_hop_to_a_name_is_left_to_the_resolver_unless_domains_are_given():
    PolicyHTTPConnection(AddressPolicy()).check_hop(URL("http://localhost/x.png"))
    connection = PolicyHTTPConnection(AddressPolicy(domains=["images.internal"]))
    connection.check_hop(URL("http://images.internal/x.png"))
    with pytest.raises(MediaURLRefused, match="not in option.allowed_media_domains"):
        connection.check_hop(URL("https://elsewhere.com/x.png"))


class Answers:
    """aiohttp's resolver interface answering fixed addresses for any name (what a DNS server
    an attacker controls answers)."""

    def __init__(self, *addresses: str) -> None:
        self.addresses = addresses

    async def resolve(self, host, port=0, family=socket.AF_INET):
        return [{"hostname": host, "host": a, "port": port, "family": socket.AF_INET6 if ":" in a else socket.AF_INET,
                 "proto": 0, "flags": 0} for a in self.addresses]

    async def close(self):
        pass


def resolve(policy, *addresses, host="rebind.example.com"):
    return asyncio.run(_PolicyResolver(policy, Answers(*addresses)).resolve(host, 80))


def test_the_resolver_answers_only_allowed_addresses():
    assert [r["host"] for r in resolve(AddressPolicy(), "8.8.8.8", "169.254.169.254", "::1")] == ["8.8.8.8"]
    with pytest.raises(MediaURLRefused, match="169.254.169.254 is link-local.*::1 is loopback"):
        resolve(AddressPolicy(), "169.254.169.254", "::1")
    allowed = AddressPolicy(networks("10.0.0.0/8"))
    assert [r["host"] for r in resolve(allowed, "10.1.1.1", "192.168.0.1")] == ["10.1.1.1"]


def test_the_resolver_trusts_the_allowed_domains_wherever_they_resolve():
    policy = AddressPolicy(domains=["images.internal"])
    assert len(resolve(policy, "10.1.1.1", "127.0.0.1", host="images.internal")) == 2


def png(width: int, height: int, mode: str = "RGB") -> bytes:
    buffer = io.BytesIO()
    Image.new(mode, (width, height)).save(buffer, "PNG")
    return buffer.getvalue()


BOMB = png(13_000, 13_000, "1")  # about 20 KB; 169 megapixels decoded


def test_an_image_over_the_pixel_limit_is_refused_from_its_header():
    images = PixelBound(ImageMediaIO(), 50_000_000)
    started = time.monotonic()
    for load in (lambda: images.load_bytes(BOMB), lambda: images.load_base64("image/png", base64.b64encode(BOMB))):
        with pytest.raises(Exception, match="13000 x 13000 = 169,000,000 pixels.*at most 50,000,000 pixels "
                                            r"\(the max_image_pixels setting, SERVING_MAX_IMAGE_PIXELS\)"):
            load()
    assert time.monotonic() - started < 1  # decoding it takes seconds and 500 MB
    assert len(BOMB) < 30_000


def test_an_image_within_the_limit_loads_as_vllm_loads_it(tmp_path):
    images = PixelBound(ImageMediaIO(), 100 * 100)
    assert images.load_bytes(png(100, 100, "RGBA")).media.mode == "RGB"
    (tmp_path / "p.png").write_bytes(png(40, 30))
    assert images.load_file(tmp_path / "p.png").media.size == (40, 30)
    with pytest.raises(Exception, match="101 x 100"):
        images.load_bytes(png(101, 100))
    with pytest.raises(ValueError, match="Failed to load image"):  # vLLM's own answer to bytes PIL cannot open
        images.load_bytes(b"not a picture")


def test_data_urls_through_the_connector_are_sized_first():
    connector = MediaConnectorWithPolicy.configured(AddressPolicy(), 50_000_000)()
    url = "data:image/png;base64," + base64.b64encode(BOMB).decode()
    with pytest.raises(Exception, match="max_image_pixels"):
        asyncio.run(connector.fetch_image_async(url))
    assert connector.fetch_image("data:image/png;base64," + base64.b64encode(png(8, 8)).decode()).size == (8, 8)


def settings(**env):
    return resolve_settings(env, "/nonexistent")


def test_settings_defaults_and_their_checks():
    defaults = settings()
    assert defaults.max_image_pixels == 50_000_000 and defaults.allowed_media_network_list == []
    assert defaults.trust_request_mm_kwargs is False
    given = settings(OPTION_ALLOWED_MEDIA_NETWORKS="10.0.0.0/8, fd00::/8,127.0.0.2", OPTION_TRUST_REQUEST_MM_KWARGS="true",
                     SERVING_MAX_IMAGE_PIXELS="1000")
    assert given.allowed_media_network_list == networks("10.0.0.0/8", "fd00::/8", "127.0.0.2/32")
    assert given.passthrough_options() == {}  # sagelmi's settings, never vLLM engine arguments
    for env, says in ((dict(OPTION_ALLOWED_MEDIA_NETWORKS="10.0.0.1/8"), "'10.0.0.1/8' is not a CIDR range"),
                      (dict(OPTION_ALLOWED_MEDIA_NETWORKS="10.0.0.0/8,intranet"), "'intranet' is not a CIDR range"),
                      (dict(SERVING_MAX_IMAGE_PIXELS="0"), "max_image_pixels")):
        with pytest.raises(SettingsError, match=says) as refused:
            settings(**env)
        assert "\n" not in str(refused.value)


def test_install_chooses_the_connector_with_the_settings(monkeypatch, caplog):
    monkeypatch.setenv("VLLM_MEDIA_CONNECTOR", "")  # so that the value install() sets is undone after the test
    monkeypatch.delenv("VLLM_MEDIA_CONNECTOR")
    vllm_media.install(settings(OPTION_ALLOWED_MEDIA_NETWORKS="10.0.0.0/8", SERVING_MAX_IMAGE_PIXELS="1000"),
                       {"allowed_media_domains": ["images.internal"]})
    import os
    assert os.environ["VLLM_MEDIA_CONNECTOR"] == "sagelmi"
    connector = MEDIA_CONNECTOR_REGISTRY.load("sagelmi", allowed_media_domains=["images.internal"])
    assert isinstance(connector, MediaConnectorWithPolicy) and connector.max_image_pixels == 1000
    policy = connector.connection.policy
    assert policy.networks == networks("10.0.0.0/8") and policy.trusts("images.internal")
    # a connector the user chose is kept, with a warning
    monkeypatch.setenv("VLLM_MEDIA_CONNECTOR", "mine")
    with caplog.at_level(logging.WARNING, logger="sagelmi.vllm"):
        vllm_media.install(settings(), {})
    assert os.environ["VLLM_MEDIA_CONNECTOR"] == "mine" and "without sagelmi's address policy" in caplog.text


def test_vllms_flags_in_its_messages_become_the_options():
    assert _options_named("At most 1 image(s) may be provided in one prompt. Set `--limit-mm-per-prompt` to "
                          "increase this limit.").endswith("Set option.limit_mm_per_prompt to increase this limit.")
    # vLLM names its flag only when the model takes more; for a model without a limit of its own, never
    assert _options_named("At most 2 image(s) may be provided in one prompt. (parameter=image)") == (
        "At most 2 image(s) may be provided in one prompt. Set option.limit_mm_per_prompt to increase this limit, "
        "as far as the model takes more. (parameter=image)")
    assert "Start the server with option.trust_request_mm_kwargs=true only" in _options_named(
        "Per-request media_io_kwargs are disabled by default because they can change multimodal media loading "
        "resource usage. Start the server with --trust-request-mm-kwargs only when clients are trusted.")
