"""Images in chat messages, against real vLLM on the tiny Idefics3 (``sagelmi tiny-model --arch
idefics3``): one server started as docs/vision.md says, answers compared with vLLM's offline
``LLM.chat`` on the same messages, and every way an image can be bad."""

import base64
import http.server
import io
import json
import shlex
import socket
import subprocess
import sys
import textwrap
import threading
import time

import openai
import pytest
import requests

from tests.e2e.conftest import EAGER, ENGINE_READY_TIMEOUT, EXACT, VLLM_CPU_ENV
from tests.listener import Listener
from tests.readme import on_port, python_snippets, run_shell, serve_settings, shell_commands
from tests.references import offline_reference
from tests.server import REPO, Server, clean_env, processes

pytestmark = pytest.mark.slow

DOC = (REPO / "docs" / "vision.md").read_text()
WRITE, SERVE, DATA_CURL, HTTP_CURL = shell_commands(DOC)
(SNIPPET,) = python_snippets(DOC)
MAX_TOKENS = 8  # what the doc's examples ask for
LIMIT = 2  # the doc's OPTION_LIMIT_MM_PER_PROMPT=image=2
# A host that does not answer fails after one try of 2 s, not vLLM's 5 + 20 + 80 s and back-offs.
FAST_FETCH = {"VLLM_IMAGE_FETCH_TIMEOUT": "2", "VLLM_MEDIA_FETCH_MAX_RETRIES": "1"}


def picture(shade: int) -> bytes:
    """A 40 x 30 PNG, different for each ``shade``."""
    from PIL import Image

    image = Image.new("RGB", (40, 30))
    image.putdata([((x * 6 + shade) % 256, (y * 8 + 3 * shade) % 256, (x * y) % 256)
                   for y in range(30) for x in range(40)])
    buffer = io.BytesIO()
    image.save(buffer, "PNG")
    return buffer.getvalue()


PICTURE, OTHER = picture(0), picture(90)


def data_url(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode()


def image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def user(*parts: dict) -> list[dict]:
    return [{"role": "user", "content": [{"type": "text", "text": "What is in it?"}, *parts]}]


def body_of(curl: str) -> dict:
    words = shlex.split(curl)
    return json.loads(words[words.index("-d") + 1])


# name -> the messages vLLM's offline LLM.chat answers, to compare the server's answers with
CONVERSATIONS = {
    "picture": user(image_part(data_url(PICTURE))),
    "other": user(image_part(data_url(OTHER))),
    "both": user(image_part(data_url(PICTURE)), image_part(data_url(OTHER))),
    "text": [{"role": "user", "content": "What is in it?"}],
    "doc_data_url": body_of(DATA_CURL)["messages"],
    # the doc's second curl has the server fetch PICTURE over HTTP; offline gets the same bytes inline
    "doc_http": [{"role": "user", "content": [image_part(data_url(PICTURE))]}],
}

OFFLINE = textwrap.dedent("""
    import json, sys
    if __name__ == "__main__":
        from vllm import LLM, SamplingParams
        model, conversations = sys.argv[1], json.loads(sys.argv[2])
        max_tokens, limit = int(sys.argv[3]), int(sys.argv[4])
        llm = LLM(model=model, dtype="float32", enforce_eager=True, gpu_memory_utilization=0.5, limit_mm_per_prompt={"image": limit})
        outputs = llm.chat(list(conversations.values()), SamplingParams(temperature=0, max_tokens=max_tokens),
                           use_tqdm=False)
        answers = {name: {"ids": list(o.outputs[0].token_ids), "text": o.outputs[0].text}
                   for name, o in zip(conversations, outputs)}
        print("ANSWERS=" + json.dumps(answers))
""")


ALLOWED_HOST = "127.0.0.2"  # the doc's OPTION_ALLOWED_MEDIA_NETWORKS; 127.0.0.1 stays refused


class ImageHost:
    """A local web server on ALLOWED_HOST: ``/picture.png`` is PICTURE, ``/silent.png`` never
    answers in time, ``/redirect?to=URL`` sends there, anything else 404. Counts the GETs of each path."""

    def __init__(self) -> None:
        self.gets: dict[str, int] = {}
        host = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                host.gets[self.path] = host.gets.get(self.path, 0) + 1
                if self.path.startswith("/redirect?to="):
                    self.send_response(302)
                    self.send_header("Location", self.path.split("?to=", 1)[1])
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                if self.path == "/silent.png":
                    time.sleep(10)
                if self.path not in ("/picture.png", "/silent.png"):
                    self.send_error(404)
                    return
                self.send_response(200)
                self.send_header("Content-Type", "image/png")
                self.send_header("Content-Length", str(len(PICTURE)))
                self.end_headers()
                try:
                    self.wfile.write(PICTURE)
                except BrokenPipeError:  # /silent.png: the container gave up waiting
                    pass

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer((ALLOWED_HOST, 0), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def url(self, path: str) -> str:
        return f"http://{ALLOWED_HOST}:{self.port}{path}"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("tiny-vision"))
    assert WRITE.startswith("sagelmi ")  # run as `python -m container`, the command's own code (not a script's)
    command = shlex.split(WRITE.replace("/tmp/tiny-vision", directory))[1:]
    written = subprocess.run([sys.executable, "-m", "container", *command], capture_output=True, text=True,
                             timeout=300, cwd=REPO, env=clean_env())
    assert written.returncode == 0, written.stderr
    return directory


@pytest.fixture(scope="module")
def offline(model_dir):
    """vLLM's offline greedy answers, computed before the server starts (the two would share 2 cores),
    unless they are kept from an earlier run (tests/references.py)."""
    args = [json.dumps(CONVERSATIONS), str(MAX_TOKENS), str(LIMIT)]
    answers = offline_reference(OFFLINE, model_dir, args, "ANSWERS=", timeout=400)
    # The image reaches the model: another picture, or none, gives another answer.
    assert len({tuple(answers[name]["ids"]) for name in ("picture", "other", "both", "text")}) == 4, answers
    return answers


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory):
    """The directory the server may read file:// images from, with PICTURE in it."""
    directory = tmp_path_factory.mktemp("media")
    (directory / "picture.png").write_bytes(PICTURE)
    return directory


@pytest.fixture(scope="module")
def server(model_dir, offline, media_dir):
    env, directory = serve_settings(SERVE)
    assert env == {**VLLM_CPU_ENV, "OPTION_LIMIT_MM_PER_PROMPT": f"image={LIMIT}",
                   "OPTION_ALLOWED_MEDIA_NETWORKS": f"{ALLOWED_HOST}/32"}
    # float32: the answers are compared with offline vLLM's token for token (see tests/e2e/conftest.py)
    more = {**EXACT, **EAGER, **FAST_FETCH, "OPTION_ALLOWED_LOCAL_MEDIA_PATH": str(media_dir)}
    with Server(directory.replace("/tmp/tiny-vision", model_dir), env={**env, **more},
                ready_timeout=ENGINE_READY_TIMEOUT) as server:
        yield server


@pytest.fixture(scope="module")
def image_host():
    host = ImageHost()
    yield host
    host.server.shutdown()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url("/v1"), api_key="unused", max_retries=0)


def chat(server, path: str, messages: list[dict], **extra) -> requests.Response:
    body = {"model": "tiny-vision", "messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0,
            "return_token_ids": True, **extra}
    return requests.post(server.url(path), json=body, timeout=60)


def test_the_openai_client_gets_offline_vllms_answer(client, offline):
    for name in ("picture", "other", "both", "text"):
        completion = client.chat.completions.create(
            model="tiny-vision", messages=CONVERSATIONS[name], max_tokens=MAX_TOKENS, temperature=0,
            extra_body={"return_token_ids": True})
        choice = completion.choices[0]
        assert choice.model_extra["token_ids"] == offline[name]["ids"], name
        assert choice.message.content == offline[name]["text"], name


def test_a_streamed_answer_is_the_same(client, offline):
    stream = client.chat.completions.create(model="tiny-vision", messages=CONVERSATIONS["picture"],
                                            max_tokens=MAX_TOKENS, temperature=0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == offline["picture"]["text"]


def test_invocations_takes_the_chat_schema_with_images(server, offline):
    """LMI's request form for vision language models: the chat-completions schema on /invocations."""
    answer = chat(server, "/invocations", CONVERSATIONS["picture"])
    assert answer.status_code == 200, answer.text
    assert answer.json()["object"] == "chat.completion"
    assert answer.json()["choices"][0]["token_ids"] == offline["picture"]["ids"]


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/invocations"])
def test_an_http_image_is_fetched_by_the_container(server, image_host, offline, path):
    before = image_host.gets.get("/picture.png", 0)
    answer = chat(server, path, user(image_part(image_host.url("/picture.png"))))
    assert answer.status_code == 200, answer.text
    assert answer.json()["choices"][0]["token_ids"] == offline["picture"]["ids"]
    assert image_host.gets["/picture.png"] > before


def test_a_file_in_the_allowed_directory_is_read(server, media_dir, offline):
    answer = chat(server, "/v1/chat/completions", user(image_part((media_dir / "picture.png").as_uri())))
    assert answer.status_code == 200, answer.text
    assert answer.json()["choices"][0]["token_ids"] == offline["picture"]["ids"]


def _refused_port() -> int:
    with socket.create_server((ALLOWED_HOST, 0)) as probe:
        port = probe.getsockname()[1]  # nothing listens there once the probe socket is closed
    with socket.socket() as probe:
        assert probe.connect_ex((ALLOWED_HOST, port)) != 0
    return port


# What the client is told whenever a media URL's host is not reached: a refused address, a closed
# port, a silent host alike (handlers/engines/vllm_media.py: FETCH_FAILED)
UNREACHED = ("could not fetch a media URL of the messages: its address is not one this server fetches from, or "
             "its host did not answer in time or refused the connection (internal hosts need "
             "option.allowed_media_networks or option.allowed_media_domains)")


# (image parts, status, what the message says)
BAD_IMAGES = {
    "undecodable": ([image_part("data:image/png;base64," + base64.b64encode(b"not a picture").decode())], 400,
                    "Failed to load image"),
    "not_base64": ([image_part("data:image/png;base64,@@@@")], 400, "base64"),
    "refused": ([image_part(f"http://{ALLOWED_HOST}:{_refused_port()}/picture.png")], 400, UNREACHED),
    "silent": ([image_part("SILENT")], 400, UNREACHED),
    "missing": ([image_part("MISSING")], 422, "HTTP 404"),
    "s3": ([image_part("s3://bucket/picture.png")], 400, "The URL must be either a HTTP, data or file URL"),
    "outside_file": ([image_part("file:///etc/hostname")], 400,
                     "a file:// media URL must name a file inside the directory option.allowed_local_media_path"),
    "too_many": ([image_part(data_url(PICTURE))] * (LIMIT + 1), 400,
                 f"At most {LIMIT} image(s) may be provided in one prompt. Set option.limit_mm_per_prompt to "
                 f"increase this limit"),
}


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/invocations"])
@pytest.mark.parametrize("case", sorted(BAD_IMAGES))
def test_bad_images_are_refused_in_the_routes_envelope(server, image_host, case, path):
    parts, status, says = BAD_IMAGES[case]
    urls = {"SILENT": image_host.url("/silent.png"), "MISSING": image_host.url("/missing.png")}
    parts = [image_part(urls.get(p["image_url"]["url"], p["image_url"]["url"])) for p in parts]
    answer = chat(server, path, user(*parts))
    assert answer.status_code == status, answer.text
    body = answer.json()
    if path.startswith("/v1/"):  # OpenAI's envelope
        assert body["error"]["code"] == status and says in body["error"]["message"], body
    else:  # LMI's
        assert body["code"] == status and says in body["error"], body
    assert "Traceback" not in answer.text and "/tmp/" not in answer.text and "site-packages" not in answer.text


def test_a_bad_image_in_a_streamed_request_is_refused_before_the_stream(server):
    for path in ("/v1/chat/completions", "/invocations"):
        answer = chat(server, path, user(image_part("data:image/png;base64,AAAA")), stream=True)
        assert answer.status_code == 400 and "Failed to load image" in answer.text, answer.text
        assert answer.headers["content-type"].startswith("application/json")


def test_the_server_keeps_serving_after_bad_images(server, offline):
    for _ in range(2):
        chat(server, "/v1/chat/completions", user(image_part("data:image/png;base64,AAAA")))
        chat(server, "/invocations", user(*[image_part(data_url(OTHER))] * (LIMIT + 1)))
    assert requests.get(server.url("/ping"), timeout=5).status_code == 200
    answer = chat(server, "/v1/chat/completions", CONVERSATIONS["picture"])
    assert answer.status_code == 200 and answer.json()["choices"][0]["token_ids"] == offline["picture"]["ids"]


def test_the_docs_examples(server, image_host, offline, tmp_path):
    by_data = json.loads(run_shell(DATA_CURL, server.port).stdout)
    assert by_data["choices"][0]["message"]["content"] == offline["doc_data_url"]["text"]
    by_http = json.loads(run_shell(HTTP_CURL.replace(f"{ALLOWED_HOST}:8000", f"{ALLOWED_HOST}:{image_host.port}"),
                                   server.port).stdout)
    assert by_http["choices"][0]["message"]["content"] == offline["doc_http"]["text"]
    (tmp_path / "picture.png").write_bytes(PICTURE)
    printed = subprocess.run([sys.executable, "-c", on_port(SNIPPET, server.port)], capture_output=True,
                             timeout=120, cwd=tmp_path)  # bytes: the tiny model's text may hold a "\r"
    assert printed.returncode == 0, printed.stderr.decode()
    assert printed.stdout.decode() == offline["picture"]["text"] + "\n"


# -- hostile media: URLs the container must not reach, images too large to decode, per-request options


@pytest.fixture()
def listener():
    forbidden = Listener()
    yield forbidden
    forbidden.close()


def test_loopback_link_local_and_redirected_urls_are_refused_without_a_connection(server, image_host, listener):
    """The container reaches neither its own loopback (a name resolving there too) nor the
    instance metadata service, also through a redirect from an allowed host; the client cannot
    tell any of them from a closed port or a silent host."""
    urls = {
        "loopback": f"http://127.0.0.1:{listener.port}/picture.png",
        "name of loopback": f"http://localhost:{listener.port}/picture.png",
        "link-local": "http://169.254.169.254/latest/meta-data/iam/security-credentials/",
        "redirected": image_host.url(f"/redirect?to=http://127.0.0.1:{listener.port}/picture.png"),
    }
    for name, url in urls.items():
        for path in ("/v1/chat/completions", "/invocations"):
            answer = chat(server, path, user(image_part(url)))
            assert answer.status_code == 400, (name, answer.text)
            message = answer.json()["error"]["message"] if path.startswith("/v1/") else answer.json()["error"]
            assert message == f"{UNREACHED} (parameter=image_url)", (name, message)
    assert listener.connections() == 0
    log = server.log()
    assert f"media URL of http://127.0.0.1:{listener.port} refused: 127.0.0.1 is loopback" in log
    assert "169.254.169.254 is link-local" in log
    assert f"redirected to http://127.0.0.1:{listener.port}: 127.0.0.1 is loopback" in log
    refusals = [line for line in log.splitlines() if "refused: 169.254.169.254" in line]
    assert refusals and all(" WARNING " in line and "[-]" not in line for line in refusals), refusals  # request id


def worker_tree_rss(server) -> int:
    import psutil

    total = 0
    for group in server.group_pids():
        for pid in processes(group):
            try:
                total += psutil.Process(pid).memory_info().rss
            except psutil.Error:
                pass
    return total


def test_an_image_bomb_is_refused_within_seconds_without_growing_the_worker(server, offline):
    """A 20 KB 1-bit PNG of 13,000 x 13,000 decodes to 169 MB, 507 MB in RGB."""
    from PIL import Image

    buffer = io.BytesIO()
    Image.new("1", (13_000, 13_000)).save(buffer, "PNG")
    assert len(buffer.getvalue()) < 30_000
    warm = chat(server, "/v1/chat/completions", CONVERSATIONS["picture"])
    assert warm.status_code == 200, warm.text
    before, peak, done = worker_tree_rss(server), [0], threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], worker_tree_rss(server))
            time.sleep(0.02)

    sampler = threading.Thread(target=sample)
    sampler.start()
    started = time.monotonic()
    try:
        answer = chat(server, "/v1/chat/completions", user(image_part(data_url(buffer.getvalue()))))
    finally:
        took = time.monotonic() - started
        done.set()
        sampler.join()
    grown = (peak[0] - before) / 2**20
    print(f"image bomb: answered {answer.status_code} in {took:.2f} s; worker tree RSS {before / 2**20:.0f} MiB, "
          f"peak +{grown:.0f} MiB")
    assert 400 <= answer.status_code < 500, answer.text[:300]
    assert "max_image_pixels" in answer.json()["error"]["message"], answer.text
    assert took < 10, took
    assert grown < 300, grown


def test_per_request_media_options_are_refused_naming_the_setting(server):
    for field, value in (("media_io_kwargs", {"image": {"image_mode": "L"}}),
                         ("mm_processor_kwargs", {"do_resize": False})):
        answer = chat(server, "/v1/chat/completions", CONVERSATIONS["picture"], **{field: value})
        assert answer.status_code == 400, answer.text
        assert field in answer.text and "option.trust_request_mm_kwargs=true" in answer.text, answer.text
