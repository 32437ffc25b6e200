"""The chat page at ``GET /`` (``pyxllm/entrypoints/openai/web_ui.py`` and its ``static/``
files) in a real headless Chromium driven by Selenium, against one real ``pyxllm serve`` on the
default model, started with ``--api-key`` (so every test also goes through the page's key
setting). Replies are short (a few tokens) but for the stop test.

The browser tests need Debian's ``chromium`` and ``chromium-driver`` packages (``.ci/run``
installs them) and PyPI's ``selenium`` (the test extra); without them they are skipped, saying
so. The ``--disable-web-ui`` tests run without a browser.
"""

from __future__ import annotations

import json
import re
import shutil
import sys
import types
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack

import httpx
import pytest

from pyxllm.cli.main import main
from tests.utils import RemoteServer, stub_app_client

KEY, WRONG_KEY = "sk-web-ui-7e3a", "sk-wrong-1b2c"
ENGINE = ["--max-model-len", "512", "--kv-cache-memory", "0.25", "--disable-log-stats"]
SETTINGS = {"api_key": KEY, "temperature": "0", "max_tokens": "4"}
WAIT_S = 30.0  # the longest any step may take on a loaded 2-core machine
# what the model is made to write in the end-to-end injection test (a structured-output regex)
INJECTION = "<script>x</script><img onerror=x>"  # 13 tokens


# --- --disable-web-ui, without a browser -----------------------------------------------------


def test_the_page_and_its_files_are_served_without_a_key_and_with_a_strict_csp():
    client = stub_app_client(api_keys=(KEY,))
    page = client.get("/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    csp = page.headers["content-security-policy"]
    assert "script-src 'self'" in csp and "default-src 'none'" in csp
    assert "static/chat.js" in page.text and "static/chat.css" in page.text
    for name in ("chat.js", "api.js", "markdown.js", "chat.css"):
        assert client.get(f"/static/{name}").status_code == 200
    assert client.get("/static/missing.js").status_code == 401  # not a page file: key needed
    assert client.get("/v1/models").status_code == 401


def test_disable_web_ui_leaves_the_root_as_it_was(monkeypatch):
    served = []
    fake = types.ModuleType("pyxllm.entrypoints.openai.api_server")
    fake.run_server = lambda config, options: served.append(options.web_ui)
    monkeypatch.setitem(sys.modules, fake.__name__, fake)
    assert main(["serve", "--disable-web-ui"]) == 0 and main(["serve"]) == 0
    assert served == [False, True]
    assert stub_app_client(web_ui=False).get("/").status_code == 404
    assert stub_app_client(web_ui=False).get("/static/chat.js").status_code == 404
    assert stub_app_client(web_ui=False, api_keys=(KEY,)).get("/").status_code == 401


# --- the browser -----------------------------------------------------------------------------

MISSING_BROWSER = (
    "no headless Chromium for the chat page's browser tests: install Debian's chromium and "
    "chromium-driver (apt-get install -y chromium chromium-driver; .ci/run does) and PyPI's "
    "selenium (pip install -e '.[test]')"
)


def chromium() -> tuple[str, str] | None:
    """The paths of Chromium and its driver, or ``None`` when either (or selenium) is missing."""
    try:
        import selenium  # noqa: F401
    except ImportError:
        return None
    binary = next(filter(None, map(shutil.which, ("chromium", "chromium-browser"))), None)
    driver = shutil.which("chromedriver")
    return (binary, driver) if binary and driver else None


def start_browser(binary: str, driver_path: str):
    """A headless Chromium under Selenium, 900 x 640."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = binary
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"):
        options.add_argument(arg)
    options.add_argument("--window-size=900,640")
    driver = webdriver.Chrome(options=options, service=Service(driver_path))
    driver.set_script_timeout(WAIT_S)
    return driver


def quit_browser(launching) -> None:
    """Quit the browser ``launching`` (a future) started, if it started."""
    if launching.exception() is None:
        launching.result().quit()


@pytest.fixture(scope="module")
def browser_and_server():
    """The browser and the keyed server, started at the same time (a missing browser skips
    before the server loads); the browser quits first, so the server has no client left."""
    paths = chromium()
    if paths is None:
        pytest.skip(MISSING_BROWSER)
    with ThreadPoolExecutor(1) as pool, ExitStack() as stack:
        launching = pool.submit(start_browser, *paths)
        try:
            server = stack.enter_context(
                RemoteServer([*ENGINE, "--api-key", KEY], env={"PYXLLM_API_KEY": ""})
            )
        finally:
            stack.callback(quit_browser, launching)
        yield launching.result(), server


@pytest.fixture
def server(browser_and_server) -> RemoteServer:
    return browser_and_server[1]


def open_page(driver, server: RemoteServer, settings: dict | None) -> None:
    """Load the chat page with no conversations and ``settings`` (``None``: none at all)."""
    if not driver.current_url.startswith(server.url_for("")):
        driver.get(server.url_for(""))  # localStorage is the page's origin's
    driver.execute_script(
        "localStorage.clear();"
        "if (arguments[0]) localStorage.setItem('pyxllm-chat.settings', arguments[0]);",
        json.dumps(settings) if settings is not None else None,
    )
    driver.refresh()
    wait(driver, lambda d: d.execute_script("return Boolean(window.pyxllm)"))


@pytest.fixture
def chat(browser_and_server):
    """A function that opens the chat page with :data:`SETTINGS`, updated by its keyword
    arguments, and returns the browser."""
    driver, server = browser_and_server

    def open_with(**settings: str):
        open_page(driver, server, {**SETTINGS, **settings})
        return driver

    return open_with


@pytest.fixture
def page(chat):
    """The browser on the chat page, with the right key, temperature 0 and 4 new tokens."""
    return chat()


def wait(driver, condition, timeout: float = WAIT_S):
    """``condition(driver)``'s first truthy value, polled every 20 ms."""
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(driver, timeout, poll_frequency=0.02).until(condition)


def by_id(driver, element_id: str):
    from selenium.webdriver.common.by import By

    return driver.find_element(By.ID, element_id)


LAST_REPLY_JS = """
const node = [...document.querySelectorAll('#messages .message.assistant')].at(-1);
if (!node) return null;
const part = (name) => node.querySelector(name);
return {
  state: node.dataset.state,
  text: part('.content').textContent,
  html: part('.content').innerHTML,
  error: part('.error').hidden ? '' : part('.error').textContent,
  stats: part('.stats').textContent,
};
"""


def last_reply(driver) -> dict | None:
    """The last assistant message: its ``state``, ``text``, ``html``, ``error`` and ``stats``."""
    return driver.execute_script(LAST_REPLY_JS)


def finished_reply(driver, timeout: float = WAIT_S) -> dict:
    """The last assistant message once it is done, stopped or failed."""
    return wait(
        driver,
        lambda d: (r := last_reply(d)) and r["state"] in ("done", "stopped", "error") and r,
        timeout,
    )


def ask(driver, *keys) -> None:
    """Type ``keys`` into the message box and press Enter."""
    from selenium.webdriver.common.keys import Keys

    by_id(driver, "prompt").send_keys(*keys, Keys.ENTER)


def change_settings(driver, **values: str) -> None:
    """Open Settings, replace the fields in ``values`` and save."""
    by_id(driver, "open-settings").click()
    form = by_id(driver, "settings-form")
    for name, value in values.items():
        field = form.find_element("name", name)
        field.clear()
        field.send_keys(value)
    by_id(driver, "save-settings").click()
    wait(driver, lambda d: not by_id(d, "settings").get_attribute("open"))


def running_requests(server: RemoteServer) -> int:
    """Requests the engine runs or queues, and KV blocks they hold, from ``/debug/stats``."""
    stats = httpx.get(server.url_for("debug", "stats"), headers={"Authorization": f"Bearer {KEY}"})
    body = stats.json()
    return body["num_running"] + body["num_waiting"] + body["num_kv_blocks_used"]


# the lengths and states of the last reply at each change of the messages, kept by the page
RECORD_JS = """
window.seen = [];
new MutationObserver(() => {
  const node = [...document.querySelectorAll('#messages .message.assistant')].at(-1);
  if (node) {
    const text = (name) => node.querySelector(name).textContent;
    window.seen.push([node.dataset.state, text('.content').length, text('.stats')]);
  }
}).observe(document.getElementById('messages'),
           {subtree: true, childList: true, characterData: true});
"""


def test_enter_sends_and_the_reply_streams_in_and_grows(page, server, tmp_path):
    from selenium.webdriver.common.keys import Keys

    assert f"chat page at {server.url_for('')}" in server.output()
    page.execute_script(RECORD_JS)
    ask(page, "What is the capital", Keys.SHIFT, Keys.ENTER, Keys.SHIFT, "of France?")
    reply = finished_reply(page)
    assert reply["state"] == "done" and reply["text"].strip() and not reply["error"]
    user = page.execute_script(
        "return document.querySelector('.message.user .content').textContent"
    )
    assert user == "What is the capital\nof France?"  # Shift+Enter: a newline, not a send
    streaming = [
        (length, stats)
        for state, length, stats in page.execute_script("return seen")
        if state == "streaming"
    ]
    lengths = [length for length, _ in streaming]
    assert len(set(lengths)) >= 2 and lengths == sorted(lengths), lengths  # it grew, live
    assert any("tok/s" in stats for _, stats in streaming)
    # the figures under the reply, from stream_options.include_usage
    stats = r"\d+ prompt \+ [1-4] tokens? · [\d.]+ tok/s · TTFT \d+ ms · seed \d+"
    assert re.fullmatch(stats, reply["stats"])
    page.save_screenshot(str(tmp_path / "chat_page.png"))
    # kept in localStorage: a reload shows the conversation again
    page.refresh()
    wait(page, lambda d: (r := last_reply(d)) and r["text"] == reply["text"])
    titles = page.execute_script(
        "return [...document.querySelectorAll('#conversations .open')].map(b => b.textContent)"
    )
    assert titles == ["What is the capital\nof France?"]


def test_stop_aborts_the_stream_and_the_server_frees_the_request(chat, server):
    page = chat(max_tokens="400")
    ask(page, "Tell a long story.")
    wait(page, lambda d: (r := last_reply(d)) and r["state"] == "streaming" and r["text"])
    by_id(page, "stop").click()
    reply = finished_reply(page)
    assert reply["state"] == "stopped" and "(stopped)" in reply["text"] and not reply["error"]
    assert by_id(page, "send").is_displayed() and not by_id(page, "stop").is_displayed()
    wait(page, lambda _: running_requests(server) == 0, timeout=5.0)
    assert "aborting" in server.output()


RENDER_JS = """
const box = document.createElement('div');
box.innerHTML = window.pyxllm.renderMarkdown(arguments[0]);
document.body.append(box);
const found = {
  text: box.textContent,
  tags: [...box.querySelectorAll('*')].map((n) => n.tagName.toLowerCase()),
  handlers: [...box.querySelectorAll('*')].flatMap((n) => n.getAttributeNames())
    .filter((a) => a.startsWith('on')),
  links: [...box.querySelectorAll('a')].map((a) => a.getAttribute('href')),
};
box.remove();
return found;
"""

HOSTILE = [
    "<script>window.xss = 1</script>",
    '<img src=x onerror="window.xss = 2">',
    "<iframe src='javascript:window.xss=3'></iframe>",
    "**<b onmouseover=alert(1)>bold</b>** and `<script>` in code",
    "[click](javascript:window.xss=4) [data](data:text/html,<script>x</script>)",
    '[quote](https://example.com/" onclick="window.xss=5)',
    "```html\n<script>window.xss = 6</script>\n```",
]


def test_the_renderer_escapes_html_and_renders_only_its_safe_set(page):
    for text in HOSTILE:
        found = page.execute_script(RENDER_JS, text)
        assert set(found["tags"]) <= {"p", "strong", "em", "code", "div", "span", "button", "pre"}
        assert not found["handlers"] and not found["links"], (text, found)
        for needle in ("<script>", "<img", "<iframe", "<b onmouseover"):
            if needle in text:
                assert needle in found["text"], (text, found)  # shown as text
    md = page.execute_script(
        RENDER_JS,
        "# Title\n**bold** *it* `a<b`\n\n- one\n- two\n\n1. first\n\n"
        "[site](https://example.com/a?b=1&c=2)\n```py\nx = '<p>'\n```",
    )
    assert md["tags"][:4] == ["h3", "p", "strong", "em"]
    assert {"ul", "ol", "li", "a", "pre", "button"} <= set(md["tags"])
    assert md["links"] == ["https://example.com/a?b=1&c=2"]
    assert "x = '<p>'" in md["text"] and "a<b" in md["text"]
    assert page.execute_script("return window.xss") is None


def test_a_reply_with_script_and_img_tags_shows_them_as_text(chat):
    # the model is made to write them: a structured-output regex through the extra fields
    extra = json.dumps({"structured_outputs": {"regex": re.escape(INJECTION)}})
    page = chat(max_tokens="16", extra=extra)
    ask(page, "Show me some HTML.")
    reply = finished_reply(page)
    assert reply["state"] == "done" and reply["text"] == INJECTION, reply
    tags = page.execute_script(
        "return [...document.querySelectorAll('#messages script, #messages img')].length"
    )
    assert tags == 0 and "&lt;script&gt;" in reply["html"]


def test_a_400_shows_the_servers_message(chat):
    page = chat(max_tokens="100000")
    ask(page, "Hello")
    reply = finished_reply(page)
    assert reply["state"] == "error", reply
    assert reply["error"].startswith("400: ") and "maximum context length is 512" in reply["error"]
    assert by_id(page, "send").is_displayed()


def test_the_api_key_from_the_settings_is_checked(browser_and_server):
    driver, server = browser_and_server
    assert httpx.get(server.url_for("")).status_code == 200  # the page needs no key
    open_page(driver, server, {"temperature": "0", "max_tokens": "2"})
    wait(driver, lambda d: "needs an API key" in by_id(d, "notice").text)
    change_settings(driver, api_key=WRONG_KEY)
    ask(driver, "Hi")
    reply = finished_reply(driver)
    assert reply["state"] == "error" and reply["error"].startswith(
        "401: missing or invalid API key"
    )
    change_settings(driver, api_key=KEY)
    wait(driver, lambda d: not by_id(d, "notice").is_displayed())
    assert by_id(driver, "model-name").text == "SmolLM2-135M-Instruct"
    driver.find_element("css selector", ".message.assistant .regenerate").click()
    reply = finished_reply(driver)
    assert reply["state"] == "done" and reply["text"] and not reply["error"]
    messages = driver.execute_script("return document.querySelectorAll('.message').length")
    assert messages == 2  # regenerate replaced the failed reply


FAKE_FETCH_JS = """
const [kind] = arguments;
const sse = (text) => new TextEncoder().encode(text);
const delta = {choices: [{index: 0, delta: {content: 'Hel'}}]};
const chunk = 'data: ' + JSON.stringify(delta) + '\\n\\n';
window.fetch = async () => {
  if (kind === '503') {
    return new Response(JSON.stringify({error: {message: 'the engine is not healthy'}}),
                        {status: 503, headers: {'Content-Type': 'application/json'}});
  }
  const body = new ReadableStream({
    start(controller) {
      controller.enqueue(sse(chunk));
      const drop = () => controller.error(new TypeError('network error'));
      if (kind === 'dropped') setTimeout(drop, 50);
      else controller.close();
    },
  });
  return new Response(body, {status: 200, headers: {'Content-Type': 'text/event-stream'}});
};
"""


@pytest.mark.parametrize(
    "kind, message",
    [
        ("503", "503: the engine is not healthy"),
        ("dropped", "the connection was lost (network error)"),
        ("unfinished", "the connection closed before the reply was complete"),
    ],
)
def test_a_failed_stream_shows_its_error_in_the_conversation(page, kind, message):
    page.execute_script(FAKE_FETCH_JS, kind)
    ask(page, "Hello")
    reply = finished_reply(page)
    assert reply["state"] == "error" and reply["error"] == message, reply
    assert reply["text"] == ("" if kind == "503" else "Hel")
    assert by_id(page, "send").is_displayed() and not by_id(page, "stop").is_displayed()


def test_edit_the_last_question_and_start_a_new_chat(chat):
    from selenium.webdriver.common.keys import Keys

    page = chat(max_tokens="2")
    ask(page, "Say yes")
    first = finished_reply(page)
    page.find_element("css selector", ".message.user .edit").click()
    area = page.find_element("css selector", ".message.user .edit-text")
    area.clear()
    area.send_keys("Say no", Keys.ENTER)
    wait(page, lambda d: (r := last_reply(d)) and r["state"] == "done" and r is not first)
    texts = page.execute_script(
        "return [...document.querySelectorAll('.message')].map(m => m.className)"
    )
    assert texts == ["message user", "message assistant"]
    user = page.execute_script(
        "return document.querySelector('.message.user .content').textContent"
    )
    assert user == "Say no"
    by_id(page, "new-chat").click()
    assert last_reply(page) is None
    conversations = page.find_elements("css selector", "#conversations .open")
    assert [c.text for c in conversations] == ["New chat", "Say no"]
    conversations[1].click()
    wait(page, lambda d: last_reply(d) is not None)


# A seed whose answer to QUESTION names Paris at the embedded model's own sampling (its card's
# temperature 0.2, top_p 0.9), in float32 (the suite's) and in its default int8 GGUF alike.
QUESTION, PARIS_SEED = "What is the capital of France?", "1"
SEED = re.compile(r" · seed (\d+)$")


def test_the_first_answer_names_paris_and_a_seed_in_the_settings_gives_it_again(chat):
    """Issue 36's item 7 on the page: its first answer to "What is the capital of France?" at
    the model's own sampling (nothing set but the key) names Paris. Sampled answers vary (about
    1 in 6 seeds gives French nonsense instead), so the test fixes the seed in Settings, as a
    user reproducing an answer would; a new chat with that seed gives the same reply, token for
    token. The time bound is a hang guard: unbounded sampling at temperature 1.0 (before the
    model's defaults) ran for minutes."""
    page = chat(temperature="", max_tokens="")
    change_settings(page, seed=PARIS_SEED)
    ask(page, QUESTION)
    first = finished_reply(page, timeout=120)
    assert first["state"] == "done" and "Paris" in first["text"], first
    assert SEED.search(first["stats"])[1] == PARIS_SEED
    by_id(page, "new-chat").click()
    ask(page, QUESTION)
    again = finished_reply(page, timeout=120)
    assert again["text"] == first["text"] and again["stats"].endswith(f"seed {PARIS_SEED}")


def test_each_reply_has_its_own_random_seed_when_the_settings_fix_none(page):
    """With no seed in Settings every reply draws its own (shown under it), so answers vary
    between conversations and Regenerate gives another; a seed in the extra request fields
    wins over the drawn one."""
    seeds = []
    for question in ("Hi", "Hi again"):
        ask(page, question)
        wait(
            page,
            lambda d: len(d.find_elements("css selector", ".message.assistant")) == len(seeds) + 1,
        )
        seeds.append(SEED.search(finished_reply(page)["stats"])[1])
    assert seeds[0] != seeds[1], seeds  # two draws from 2**31 seeds
    change_settings(page, extra='{"seed": 42}')
    ask(page, "Hello")
    wait(page, lambda d: len(d.find_elements("css selector", ".message.assistant")) == 3)
    assert finished_reply(page)["stats"].endswith(" · seed 42")


def test_a_narrow_window_and_the_dark_theme(page):
    background = "return getComputedStyle(document.documentElement).backgroundColor"
    light = page.execute_script(background)
    page.execute_cdp_cmd(
        "Emulation.setEmulatedMedia",
        {"features": [{"name": "prefers-color-scheme", "value": "dark"}]},
    )
    assert page.execute_script(background) != light
    page.execute_cdp_cmd("Emulation.setEmulatedMedia", {"features": []})
    page.set_window_size(390, 700)
    try:
        toggle, sidebar = by_id(page, "toggle-sidebar"), by_id(page, "sidebar")
        left = "return arguments[0].getBoundingClientRect().right"
        wait(page, lambda d: toggle.is_displayed() and d.execute_script(left, sidebar) <= 0)
        toggle.click()
        wait(page, lambda d: d.execute_script(left, sidebar) > 0)
        assert by_id(page, "prompt").is_displayed() and by_id(page, "send").is_displayed()
    finally:
        page.set_window_size(900, 640)


DROP_IMAGES_JS = """
const transfer = new DataTransfer();
for (const [name, b64] of arguments[0]) {
  const bytes = Uint8Array.from(atob(b64), (c) => c.charCodeAt(0));
  const type = name.endsWith('.png') ? 'image/png' : 'text/plain';
  transfer.items.add(new File([bytes], name, {type}));
}
document.getElementById('composer').dispatchEvent(
  new DragEvent('drop', {dataTransfer: transfer, bubbles: true, cancelable: true}));
"""


def test_a_dropped_image_is_sent_as_an_image_part(page):
    """Images dropped on the composer show as thumbnails (each removable) and go with the next
    message as OpenAI ``image_url`` parts: the text model of this server refuses the first part
    by name, which the page shows; the question keeps its image. A dropped non-image is not
    attached."""
    import base64
    import io

    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (4, 4), (200, 30, 30)).save(buffer, format="PNG")
    png = base64.b64encode(buffer.getvalue()).decode()
    thumbnails = "return document.querySelectorAll('#attachments img').length"
    page.execute_script(DROP_IMAGES_JS, [["a.png", png], ["b.png", png], ["c.txt", "aGk="]])
    wait(page, lambda d: d.execute_script(thumbnails) == 2)
    assert "only images" in by_id(page, "notice").text
    page.execute_script("document.querySelector('#attachments .remove-attachment').click()")
    wait(page, lambda d: d.execute_script(thumbnails) == 1)
    ask(page, "What is in this picture?")
    reply = finished_reply(page)
    assert reply["state"] == "error", reply
    assert "content[0]" in reply["error"] and "reads text only" in reply["error"], reply
    sent = page.execute_script(
        "const img = document.querySelector('#messages .message.user img.attached');"
        "return img && img.src;"
    )
    assert sent == f"data:image/png;base64,{png}"
    assert page.execute_script(thumbnails) == 0
    assert by_id(page, "attachments").get_attribute("hidden") is not None
