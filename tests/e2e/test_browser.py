"""The ci run's reports in a real browser (headless Chromium): every image loads, every local link leads to a
file or anchor that exists, nothing loads from the network, no page shows an error or a traceback.
Screenshots of each page go to outputs/<run>/screenshots/ for people to look at.

Needs the Debian packages chromium and chromium-driver (`make browser`, which `make test` runs) and selenium."""

import re
import shutil
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest

from eagle3lib.workbook import pipeline

CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
# What a reader must never see: a traceback, an exception's name, an error line.
ERROR_TEXT = re.compile(r"Traceback \(most recent call last\)|\b[A-Z]\w*(Error|Exception)\b|^\s*(ERROR|Error)\b", re.M)
MAX_SHOT_HEIGHT = 20000  # px; longer pages are cut there


def chromium():
    """A headless Chromium driven through the system chromedriver."""
    if not (Path(CHROMIUM).is_file() and Path(CHROMEDRIVER).is_file()):
        pytest.fail(
            f"{CHROMIUM} and {CHROMEDRIVER} are needed: `make browser` installs them "
            "(apt-get install chromium chromium-driver)"
        )
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--window-size=1400,1000",
        "--hide-scrollbars",
    ):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    driver.set_page_load_timeout(60)
    return driver


@pytest.fixture(scope="module")
def browser():
    driver = chromium()
    yield driver
    driver.quit()


def screenshot(driver, path: Path) -> None:
    """The whole page (up to MAX_SHOT_HEIGHT px) as PNG, through the DevTools protocol."""
    import base64

    size = driver.execute_cdp_cmd("Page.getLayoutMetrics", {})["cssContentSize"]
    clip = {"x": 0, "y": 0, "width": size["width"], "height": min(size["height"], MAX_SHOT_HEIGHT), "scale": 1}
    shot = driver.execute_cdp_cmd(
        "Page.captureScreenshot", {"format": "png", "captureBeyondViewport": True, "clip": clip}
    )
    path.write_bytes(base64.b64decode(shot["data"]))


def check_page(driver, page: Path, shots: Path) -> list[str]:
    """Open one page; returns its problems (empty when a reader would find none) after saving a screenshot."""
    driver.get(page.resolve().as_uri())
    driver.execute_script("window.scrollTo(0, document.body.scrollHeight); window.scrollTo(0, 0);")
    problems = []
    for src, ok, width in driver.execute_script(
        "return [...document.images].map(i => [i.getAttribute('src').slice(0, 80), i.complete, i.naturalWidth])"
    ):
        if not ok or width == 0:
            problems.append(f"image does not load: {src}")
    for tag, url in driver.execute_script(
        "return [...document.querySelectorAll('a[href], img[src], script[src], link[href]')]"
        ".map(e => [e.tagName, e.getAttribute('href') || e.getAttribute('src')])"
    ):
        parts = urlsplit(url)
        if parts.scheme in ("http", "https") and tag != "A":
            problems.append(f"{tag.lower()} loads from the network: {url}")
        if parts.scheme in ("http", "https", "mailto", "data", "javascript"):
            continue
        if parts.path:
            if not (page.parent / unquote(parts.path)).exists():
                problems.append(f"broken link: {url}")
        elif parts.fragment and not driver.execute_script(  # nbconvert's heading ids keep the %-escapes
            "return arguments.length && [...arguments].some(f => document.getElementById(f) ||"
            " document.getElementsByName(f).length)",
            parts.fragment,
            unquote(parts.fragment),
        ):
            problems.append(f"anchor not on the page: {url}")
    shots.mkdir(exist_ok=True)
    screenshot(driver, shots / f"{page.stem}.png")
    # What is rendered visibly, code cells aside (a `raise ValueError(...)` in code is not an error shown).
    driver.execute_script("document.querySelectorAll('.jp-CodeMirrorEditor').forEach(e => e.style.display = 'none')")
    text = driver.find_element("tag name", "body").text
    for m in ERROR_TEXT.finditer(text):
        end = text.find("\n", m.end())
        line = text[text.rfind("\n", 0, m.start()) + 1 : end if end >= 0 else len(text)][:200]
        problems.append(f"shows an error: {line!r}")
    if len(text.strip()) < 200:
        problems.append(f"nearly empty page ({len(text.strip())} characters of text)")
    return [
        f"{page.relative_to(page.parent.parent) if page.name != 'index.html' else page.name}: {p}" for p in problems
    ]


@pytest.mark.slow
def test_reports_render_cleanly_in_chromium(ci_run, browser):
    run_dir, _ = ci_run
    shots = run_dir / "screenshots"
    shutil.rmtree(shots, ignore_errors=True)
    pages = [run_dir / "index.html"] + [run_dir / s / f"{s}.html" for s in pipeline.stages()]
    problems = [p for page in pages for p in check_page(browser, page, shots)]
    assert not problems, "\n".join(problems)
    assert {f"{p.stem}.png" for p in pages} <= {p.name for p in shots.glob("*.png")}
    # the index links every stage report and the benchmark's recommendation
    browser.get((run_dir / "index.html").as_uri())
    body = browser.find_element("tag name", "body").text
    assert "Recommendation" in body and "all 6 stages finished" in body and "total stage time" in body


def test_the_browser_check_catches_what_it_should(browser, tmp_path):
    """A page with a missing image, a broken link, a bad anchor and a traceback fails on each."""
    page = tmp_path / "bad.html"
    page.write_text(
        "<html><body><p>" + "Some words for a page. " * 20 + "</p>"
        "<img src='missing.png'><a href='nowhere.html'>x</a><a href='#nope'>y</a>"
        "<pre>Traceback (most recent call last):\nValueError: boom</pre><a href='#here'>z</a><i id='here'></i>"
        "<div class='jp-CodeMirrorEditor'>raise KeyError('in code, not shown as an error')</div>"
        "<p style='display:none'>HiddenError is not visible</p></body></html>"
    )
    problems = check_page(browser, page, tmp_path / "shots")
    text = "\n".join(problems)
    for wanted in (
        "image does not load: missing.png",
        "broken link: nowhere.html",
        "anchor not on the page: #nope",
        "Traceback (most recent call last)",
        "ValueError: boom",
    ):
        assert wanted in text, (wanted, text)
    assert "HiddenError" not in text and "KeyError" not in text and "#here" not in text
    assert (tmp_path / "shots" / "bad.png").is_file()
