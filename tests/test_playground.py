"""The playground page in a real browser (headless Chromium through selenium) against the real
services (tiny model, CPU) behind the gateway: type text, press Speak, hear it as it streams (the
page reports what it scheduled and when the last chunk finished playing), hear an mp3 once whole
and find it behind a download link named .mp3, stop one mid-stream,
store voices from a file and from the (fake) microphone in the voices tab, and speak with them.

The browser tests need Debian's `chromium` and `chromium-driver` (apt-get install chromium
chromium-driver) and the `selenium` package; without them they skip, saying which is missing.
Screenshots go to the test's tmp dir (the path is logged); set PLAYGROUND_SCREENSHOT=PATH to keep
a copy of the spoken page there too (docs/playground.png is made that way)."""

from __future__ import annotations

import io
import os
import shutil
import time

import httpx
import numpy as np
import pytest
import soundfile as sf
from starlette.testclient import TestClient

from gateway_svc.config import GatewayConfig
from gateway_svc.server import build_app
from helpers import make_cluster
from test_gateway import start_gateway

CHROMIUM = shutil.which("chromium")
CHROMEDRIVER = shutil.which("chromedriver")
SECONDS = 0.8  # the page's length, at least and at most: the tiny model's random weights would stop at once


def browser_missing() -> str | None:
    missing = [name for name, path in (("chromium", CHROMIUM), ("chromium-driver", CHROMEDRIVER)) if not path]
    if missing:
        return f"no {' or '.join(missing)} on PATH (Debian: apt-get install chromium chromium-driver)"
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "the selenium package is not installed (pip install -e '.[dev]')"
    return None


needs_browser = pytest.mark.skipif(browser_missing() is not None, reason=f"browser test: {browser_missing()}")


def test_the_gateway_serves_the_page_and_its_assets():
    with TestClient(build_app(GatewayConfig())) as client:
        page = client.get("/")
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        for asset in ("/static/playground.js", "/static/playground.css"):
            assert asset in page.text
            assert client.get(asset).status_code == 200
        missing = client.get("/static/nothing.js")
        assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"


# ---- in the browser -----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def gateway():
    with make_cluster(worker_args=["--dtype", "float32", "--max-batch", "4", "--kv-slots", "8192"]) as cluster:
        g = start_gateway(cluster.address)
        try:
            yield f"http://{g.address}"
        finally:
            g.stop()


@pytest.fixture(scope="module")
def browser():
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1100,900",
                "--autoplay-policy=no-user-gesture-required",
                "--use-fake-ui-for-media-stream", "--use-fake-device-for-media-stream"):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    try:
        yield driver
    finally:
        driver.quit()


def wait_for(driver, script: str, timeout: float = 180.0):
    """The value of `return <script>` once it is truthy."""
    deadline = time.monotonic() + timeout
    while not (value := driver.execute_script(f"return {script}")):
        if time.monotonic() > deadline:
            errors = driver.execute_script("return document.getElementById('speak-error').textContent")
            raise AssertionError(f"timed out waiting for {script} (page error: {errors!r})")
        time.sleep(0.2)
    return value


def set_field(driver, element_id: str, value: str) -> None:
    field = driver.find_element("id", element_id)
    field.clear()
    field.send_keys(value)


def speak(driver) -> dict:
    driver.find_element("id", "tab-speak").click()
    driver.find_element("id", "speak-button").click()
    wait_for(driver, "window.chorusPlayground.lastRun && (window.chorusPlayground.lastRun.played"
                     " || window.chorusPlayground.lastRun.error)")
    return driver.execute_script("return window.chorusPlayground.lastRun")


def screenshot(driver, tmp_path, name: str) -> str:
    path = str(tmp_path / name)
    driver.save_screenshot(path)
    print(f"playground screenshot: {path}")
    return path


@needs_browser
def test_speak_plays_the_audio_as_it_streams(browser, gateway, tmp_path):
    browser.get(gateway)
    wait_for(browser, "window.chorusPlayground.ready", 60)
    set_field(browser, "text", "Hello from a browser.")
    set_field(browser, "seed", "3")
    set_field(browser, "min-seconds", str(SECONDS))
    set_field(browser, "max-seconds", str(SECONDS))
    run = speak(browser)
    assert run["error"] is None, run
    assert run["done"] and run["played"] and run["samples"] > 0 and run["ttfaMs"] > 0
    assert run["rtf"] > 0 and run["sampleRate"] == 48000 and run["channels"] == 2
    assert run["playedMs"] >= 0.9 * SECONDS * 1000  # the audio clock ran through all of it
    assert (run["format"], run["contentType"], run["download"]) == ("wav", "audio/wav", "chorus-speech.wav")
    # the file offered for download is whole: its header has the length the stream left out
    played = wait_for(browser, "document.getElementById('audio').duration", 30)
    assert abs(played - SECONDS) < 0.01, played
    stats = browser.find_element("id", "stats").text
    assert "first audio" in stats and "real-time factor" in stats
    # what the page played is what the API gives for the same request
    model = httpx.get(f"{gateway}/v1/models").json()["data"][0]
    direct = httpx.post(f"{gateway}/v1/audio/speech", timeout=120, json={
        "input": "Hello from a browser.", "seed": 3, "response_format": "pcm",
        "min_frames": round(SECONDS * model["frame_rate"]), "max_frames": round(SECONDS * model["frame_rate"])})
    assert run["samples"] == len(direct.content) // 4
    path = screenshot(browser, tmp_path, "playground-speak.png")
    if os.environ.get("PLAYGROUND_SCREENSHOT"):
        shutil.copy(path, os.environ["PLAYGROUND_SCREENSHOT"])

    # Stop while it streams: the page stops playing and drops the connection (the gateway then cancels)
    set_field(browser, "min-seconds", "30")
    set_field(browser, "max-seconds", "30")
    browser.find_element("id", "speak-button").click()
    wait_for(browser, "window.chorusPlayground.lastRun.samples > 0", 120)
    browser.find_element("id", "stop-button").click()
    wait_for(browser, "!document.getElementById('speak-button').disabled", 30)
    stopped = browser.execute_script("return window.chorusPlayground.lastRun")
    assert stopped["error"] == "stopped" and not stopped["played"] and stopped["samples"] < 30 * 48000, stopped


@needs_browser
def test_mp3_plays_once_whole_and_downloads_as_mp3(browser, gateway):
    from selenium.webdriver.support.ui import Select

    browser.get(gateway)
    wait_for(browser, "window.chorusPlayground.ready", 60)
    set_field(browser, "seed", "4")
    set_field(browser, "min-seconds", str(SECONDS))
    set_field(browser, "max-seconds", str(SECONDS))
    Select(browser.find_element("id", "format")).select_by_value("mp3")
    run = speak(browser)
    assert run["error"] is None and run["done"] and run["played"], run
    assert (run["contentType"], run["download"]) == ("audio/mpeg", "chorus-speech.mp3")
    assert 0.8 * SECONDS < run["duration"] < SECONDS + 0.3  # the player's own reading of the file (mp3 pads)
    assert run["playedMs"] >= 0.8 * SECONDS * 1000
    link = browser.find_element("id", "download")
    assert link.is_displayed() and link.get_attribute("download") == "chorus-speech.mp3"
    assert link.get_attribute("href").startswith("blob:")


@needs_browser
def test_a_voice_stored_in_the_voices_tab_speaks(browser, gateway, tmp_path):
    from selenium.webdriver.support.ui import Select

    browser.get(gateway)
    wait_for(browser, "window.chorusPlayground.ready", 60)
    clip = tmp_path / "reference.wav"
    t = np.arange(24000) / 24000
    buf = io.BytesIO()
    sf.write(buf, 0.3 * np.sin(2 * np.pi * 220 * t), 24000, format="WAV", subtype="PCM_16")
    clip.write_bytes(buf.getvalue())

    browser.find_element("id", "tab-voices").click()
    set_field(browser, "voice-name", "browser-voice")
    browser.find_element("id", "voice-file").send_keys(str(clip))
    set_field(browser, "voice-transcript", "A short reference.")
    browser.find_element("id", "voice-upload").click()
    wait_for(browser, "document.getElementById('voice-status').textContent.startsWith('stored browser-voice')", 120)
    assert "browser-voice" in browser.find_element("id", "voice-list").text
    stored = {v["id"]: v for v in httpx.get(f"{gateway}/v1/audio/voices").json()["data"]}
    assert stored["browser-voice"]["frames"] > 0
    screenshot(browser, tmp_path, "playground-voices.png")

    browser.find_element("id", "tab-speak").click()
    set_field(browser, "min-seconds", str(SECONDS))
    set_field(browser, "max-seconds", str(SECONDS))
    Select(browser.find_element("id", "voice")).select_by_value("browser-voice")
    run = speak(browser)
    assert run["error"] is None and run["played"] and run["samples"] > 0, run

    browser.find_element("id", "tab-voices").click()
    browser.find_element("css selector", "#voice-list button.delete").click()
    wait_for(browser, "document.getElementById('voice-status').textContent === 'deleted browser-voice'", 30)
    assert "browser-voice" not in {v["id"] for v in httpx.get(f"{gateway}/v1/audio/voices").json()["data"]}

    # a voice recorded from the microphone (Chromium's fake one), WebM turned into WAV by the page
    browser.find_element("id", "tab-voices").click()
    set_field(browser, "voice-name", "recorded-voice")
    browser.find_element("id", "voice-record").click()
    wait_for(browser, "document.getElementById('voice-record').textContent === 'Stop recording'", 30)
    time.sleep(1.5)
    browser.find_element("id", "voice-record").click()
    wait_for(browser, "document.getElementById('voice-status').textContent.startsWith('recorded')", 30)
    browser.find_element("id", "voice-upload").click()
    wait_for(browser, "document.getElementById('voice-status').textContent.startsWith('stored recorded-voice')", 120)
    stored = {v["id"]: v for v in httpx.get(f"{gateway}/v1/audio/voices").json()["data"]}
    assert stored["recorded-voice"]["frames"] > 0

    # the same file as a one-off clip in the speak tab (sent as reference_audio, stored nowhere)
    browser.find_element("id", "tab-speak").click()
    browser.find_element("id", "clip-file").send_keys(str(clip))
    wait_for(browser, "document.getElementById('voice').value === '@clip'", 30)
    Select(browser.find_element("id", "format")).select_by_value("wav")  # a streamed WAV: its header skipped
    run = speak(browser)
    assert run["error"] is None and run["played"] and run["samples"] > 0, run
