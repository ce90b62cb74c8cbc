"""The gateway's status page in a real headless browser (Debian's chromium, driven by its chromedriver through
Selenium): its script fills in the daemon's live state, and its chat box talks to the model through the
gateway's own API, reusing the conversation's earlier turns."""

from __future__ import annotations

import re
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from .daemon_process import DaemonProcess
from .gateway_process import GatewayProcess
from .system_packages import need

CHROMIUM, CHROMEDRIVER = shutil.which("chromium"), shutil.which("chromedriver")
WAIT_S = 30.0


@pytest.fixture
def browser(short_tmp: Path) -> Iterator[object]:
    need("chromium", "chromedriver")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for flag in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        f"--user-data-dir={short_tmp / 'chromium'}",
    ):
        options.add_argument(flag)
    driver = webdriver.Chrome(options=options, service=Service(str(CHROMEDRIVER)))
    try:
        yield driver
    finally:
        driver.quit()


def test_the_page_shows_the_daemon_and_chats_through_the_gateway(
    browser: object, daemon: DaemonProcess, short_tmp: Path
) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    gateway = GatewayProcess(short_tmp / "gw", daemon.address).start()
    try:
        driver = browser
        wait = WebDriverWait(driver, WAIT_S)  # type: ignore[arg-type]
        driver.get(gateway.url + "/")  # type: ignore[attr-defined]

        def shown(element_id: str) -> Callable[[object], str | bool]:
            """The element's text once the page has filled it ("-" is its placeholder until the first status)."""

            def text(d: object) -> str | bool:
                value = d.find_element(By.ID, element_id).text.strip()  # type: ignore[attr-defined]
                return value if value not in ("", "-") else False

            return text

        assert re.fullmatch(r"\d+/4", wait.until(shown("slots")))  # the daemon fixture has 4 hot slots
        assert re.fullmatch(r"\d+/2048", wait.until(shown("cells")))
        assert wait.until(shown("model")) == "tiny"
        assert wait.until(shown("queue")) == "0 waiting"  # the gateway's own queue (nothing waits here)
        assert re.fullmatch(r"0/\d+ in flight, 0 queued, 0 refused", wait.until(shown("queue-detail")))

        def say(text: str) -> str:
            box = driver.find_element(By.ID, "chat-input")  # type: ignore[attr-defined]
            box.send_keys(text)
            # read before the click: the answer may come, and change it, before a read after the click
            before = driver.find_element(By.ID, "chat-usage").text  # type: ignore[attr-defined]
            driver.find_element(By.ID, "chat-send").click()  # type: ignore[attr-defined]
            return wait.until(lambda d: (u := d.find_element(By.ID, "chat-usage").text) != before and u)

        httpx.post(gateway.url + "/v1/responses", json={"model": "tiny", "input": "hi", "max_output_tokens": 2})
        apis = wait.until(lambda d: "responses 1" in (t := d.find_element(By.ID, "apis-detail").text) and t)
        assert "chat 0" in apis and "1 stored responses" in apis and "messages 0" in apis
        first = say("hello page")
        assert re.match(r"\d+ prompt tokens, 0 cached, \d+ generated", first)
        second = say("and once more")
        cached = int(re.search(r"(\d+) cached", second).group(1))
        assert cached > 0  # the page's conversation kept its session
        answers = driver.find_elements(By.CSS_SELECTOR, "#chat-log .assistant")  # type: ignore[attr-defined]
        assert len(answers) == 2 and all(a.text for a in answers)
        # the latency plot is drawn from the daemon's per-task histogram once the chat's turns are counted
        wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, "#plot rect.bar"))
        count = wait.until(lambda d: d.find_element(By.CSS_SELECTOR, "#tasks tbody").text or False)
        assert re.search(r"default\s+3\b", count)  # (the two chat turns and the response)
    finally:
        gateway.stop()


PAGE = """<!doctype html><div id="out">waiting</div><script>
const gateway = new URLSearchParams(location.search).get("gw");
fetch(gateway + "/v1/chat/completions", {
  method: "POST",
  headers: {"content-type": "application/json"},
  body: JSON.stringify({model: "tiny", messages: [{role: "user", content: "hi"}], max_tokens: 2,
                        logit_bias: {"2": -100}}),
}).then(r => r.json())
  .then(j => { document.getElementById("out").textContent = "answered " + j.usage.completion_tokens; })
  .catch(() => { document.getElementById("out").textContent = "blocked"; });
</script>"""


@pytest.fixture
def page_elsewhere() -> Iterator[str]:
    """A web page served from another origin than the gateway's (another port on 127.0.0.1): its address."""
    import http.server
    import threading

    class Page(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = PAGE.encode()
            self.send_response(200)
            self.send_header("content-type", "text/html")
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Page)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_a_page_served_elsewhere_calls_the_gateway_only_when_its_origin_is_allowed(
    browser: object, daemon: DaemonProcess, short_tmp: Path, page_elsewhere: str
) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    allowing = GatewayProcess(short_tmp / "gw-cors", daemon.address, "--cors-origins", page_elsewhere).start()
    closed = GatewayProcess(short_tmp / "gw-closed", daemon.address).start()
    try:
        driver = browser
        wait = WebDriverWait(driver, WAIT_S)  # type: ignore[arg-type]

        def outcome(gateway: GatewayProcess) -> str:
            driver.get(f"{page_elsewhere}/?gw={gateway.url}")  # type: ignore[attr-defined]
            return wait.until(lambda d: (t := d.find_element(By.ID, "out").text) != "waiting" and t)

        assert outcome(allowing) == "answered 2"
        assert outcome(closed) == "blocked"  # the browser refused the answer: no Access-Control-Allow-Origin
    finally:
        allowing.stop()
        closed.stop()
