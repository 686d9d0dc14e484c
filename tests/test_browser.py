"""Pages open in a real browser: headless Chromium draws every plot, with no script error, lost WebGL context,
network request or blank plot.

Chromium is driven over its DevTools pipe (`--remote-debugging-pipe`), in real time: the test waits until the
page says it is done (`<body data-status>`), reads what the page recorded, takes a screenshot and checks its
pixels. Every wait is bounded by the CPU time chromium spends (`Wait`), not the wall clock alone, so a loaded
machine does not fail a page that is merely slow. Skipped only where no `chromium` (or `chromium-browser`) is on
PATH; .ci/run installs Debian's.

Run as a script to look at a page: `python tests/test_browser.py PAGE.html OUT.png [WIDTH HEIGHT]`.
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import fcntl
import json
import os
import re
import select
import shutil
import subprocess
import sys
import tempfile
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from pipesim.traces.hostload import tree_cpu_s

RUN_EARLY = True  # first (conftest.py): it waits mostly on Chromium
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
needs_chromium = pytest.mark.skipif(CHROMIUM is None, reason="no chromium on PATH (.ci/run installs it)")

# WebGL runs in SwiftShader, the software GPU; the page's layers are composited by Chromium's software compositor
# (--disable-gpu-compositing), not through SwiftShader as well, where the GPU process spent 3-6 CPU-s a page on
# compositing alone, more than the page's renderer (about 3), and about 1 without it.
FLAGS = ["--headless", "--no-sandbox", "--use-angle=swiftshader", "--enable-unsafe-swiftshader",
         "--disable-gpu-compositing", "--disable-background-networking", "--disable-component-update",
         "--disable-sync", "--no-first-run", "--no-default-browser-check", "--hide-scrollbars", "--mute-audio",
         "--disable-extensions", "--disable-dev-shm-usage"]
KIND_RGB = {"F": (0x4C, 0x78, 0xA8), "B": (0x54, 0xA2, 0x4B)}
# How long to wait on chromium. A page draws in software (SwiftShader): the built-in example's 16 views take
# chromium about 17 CPU-seconds, 47 s of wall time at a load of 5.5 per core, and once 7 minutes in a full run on
# a 2-core machine shared by others, where a 60 s wall-clock limit failed it. So a wait is over after WAIT_CPU_S of
# chromium's CPU time (7x that need: a page that spins without end still runs out of it, on an idle machine in
# two minutes at most) or, for a page stuck spending none, after WAIT_WALL_S, twice the slowest wait seen.
WAIT_CPU_S = 120.0
WAIT_WALL_S = 900.0
STATUS_POLL_S = 0.25  # between reads of the page's status (each wait check reads /proc)
NOTED_WALL_S = 10.0  # for errors a page notes after it is done; they came within the 1 s the tests slept before


@dataclass
class Wait:
    """A wait on chromium (process `pid` and its children): over once they have spent `cpu_s` CPU-seconds or
    `wall_s` seconds have passed since it began. Where /proc does not say (not Linux), wall seconds stand in for
    CPU-seconds."""

    pid: int
    cpu_s: float = WAIT_CPU_S
    wall_s: float = WAIT_WALL_S
    began_s: float = field(init=False, default_factory=time.monotonic)
    began_cpu_s: float | None = field(init=False)
    checked_s: float = field(init=False)  # when `over` last read /proc

    def __post_init__(self) -> None:
        self.began_cpu_s, self.checked_s = tree_cpu_s(self.pid), self.began_s

    def spent(self) -> tuple[float, float]:
        """(CPU-seconds, wall seconds) since the wait began."""
        wall_s, cpu_s = time.monotonic() - self.began_s, tree_cpu_s(self.pid)
        return (wall_s if cpu_s is None or self.began_cpu_s is None else cpu_s - self.began_cpu_s), wall_s

    def over(self) -> bool:
        cpu_s, wall_s = self.spent()
        self.checked_s = time.monotonic()
        return cpu_s > self.cpu_s or wall_s > self.wall_s

    def __str__(self) -> str:
        cpu_s, wall_s = self.spent()
        return f"{cpu_s:.1f} of {self.cpu_s:g} CPU-s in {wall_s:.0f} of {self.wall_s:g} s"


# --- a minimal DevTools client over the pipe -------------------------------------------------------------

class Browser:
    """Headless Chromium with the DevTools protocol on file descriptors 3 (commands) and 4 (replies). Each page
    opens in a browser context of its own (`open`): no renderer, storage or cache shared with an earlier one."""

    def __init__(self) -> None:
        self.profile = tempfile.mkdtemp(prefix="pipesim-chromium-")
        self.log = open(os.path.join(self.profile, "stderr.log"), "w+b")
        ends = [*os.pipe(), *os.pipe()]
        # Out of the way of 3 and 4, so that moving them there in the child overwrites nothing still needed.
        to_browser, self._commands, self._replies, from_browser = (fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 10)
                                                                   for fd in ends)
        for fd in ends:
            os.close(fd)

        def wire() -> None:  # in the child, before exec: the protocol's descriptors where Chromium expects them
            os.dup2(to_browser, 3)  # dup2 makes them inheritable; every other descriptor closes on exec
            os.dup2(from_browser, 4)

        self.proc = subprocess.Popen(
            [CHROMIUM, *FLAGS, f"--user-data-dir={self.profile}", "--remote-debugging-pipe", "about:blank"],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=self.log, preexec_fn=wire, close_fds=False,
        )
        os.close(to_browser)
        os.close(from_browser)
        self._buffer = b""
        self._next_id = 0
        self.context: str | None = None  # the open page's browser context
        self.session: str | None = None  # the open page's DevTools session
        self.events: list[dict[str, Any]] = []  # the open page's, as they came

    def open(self, width: int, height: int) -> None:
        """A blank page, its viewport `width` x `height`, in a new browser context: the page `session=True` calls
        address, whose events alone `events` keeps."""
        self.context = self.call("Target.createBrowserContext")["browserContextId"]
        target = self.call("Target.createTarget", url="about:blank", browserContextId=self.context, width=width,
                           height=height)["targetId"]
        self.events = []
        self.session = self.call("Target.attachToTarget", targetId=target, flatten=True)["sessionId"]
        for domain in ("Page", "Runtime", "Network", "Log"):
            self.call(f"{domain}.enable", session=True)
        self.call("Emulation.setDeviceMetricsOverride", session=True, width=width, height=height,
                  deviceScaleFactor=1, mobile=False)

    def close_page(self) -> None:
        """Closes the open page with its browser context (and the context's renderer)."""
        context, self.context, self.session = self.context, None, None
        self.call("Target.disposeBrowserContext", browserContextId=context)

    def _read(self, method: str, wait: Wait) -> dict[str, Any]:
        """The next message; TimeoutError once `wait` is over, read each STATUS_POLL_S whether messages come or not
        (events streaming in, console logs, do not hold off a reply that never comes)."""
        while b"\0" not in self._buffer:
            if time.monotonic() - wait.checked_s >= STATUS_POLL_S and wait.over():
                raise TimeoutError(f"chromium did not answer {method}: {wait}")
            if not select.select([self._replies], [], [], STATUS_POLL_S)[0]:
                continue
            chunk = os.read(self._replies, 1 << 20)
            if not chunk:
                self.log.seek(0)
                raise RuntimeError("chromium exited: " + self.log.read().decode(errors="replace")[-2000:])
            self._buffer += chunk
        message, self._buffer = self._buffer.split(b"\0", 1)
        return json.loads(message)

    def call(self, method: str, session: bool = False, wait: Wait | None = None, **params: Any) -> dict[str, Any]:
        self._next_id += 1
        message = {"id": self._next_id, "method": method, "params": params}
        if session:
            message["sessionId"] = self.session
        os.write(self._commands, json.dumps(message).encode() + b"\0")
        wait = wait or Wait(self.proc.pid)
        while True:
            reply = self._read(method, wait)
            if reply.get("id") == self._next_id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply.get("result", {})
            if "method" in reply and self.session and reply.get("sessionId") == self.session:
                self.events.append(reply)

    def evaluate(self, expression: str, wait: Wait | None = None) -> Any:
        result = self.call("Runtime.evaluate", session=True, wait=wait, expression=expression, returnByValue=True,
                           awaitPromise=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression}: {result['exceptionDetails']}")
        return result["result"].get("value")

    def poll(self, expression: str, done: Callable[[Any], bool], wait: Wait, what: str) -> Any:
        """`expression`'s value once `done` holds for it, evaluated every STATUS_POLL_S; TimeoutError ("`what` after
        ...") once `wait` is over, however fast each answer comes."""
        while not done(value := self.evaluate(expression, wait)):
            if wait.over():
                raise TimeoutError(f"{what} after {wait}")
            time.sleep(STATUS_POLL_S)
        return value

    def close(self) -> None:
        try:
            self.call("Browser.close", wait=Wait(self.proc.pid, cpu_s=10, wall_s=10))  # killed below if not
        except (RuntimeError, TimeoutError, OSError):
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        for fd in (self._commands, self._replies):
            os.close(fd)
        self.log.close()
        shutil.rmtree(self.profile, ignore_errors=True)

    def __enter__(self) -> Browser:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass
class Visit:
    status: str
    body: dict[str, str]            # the page's data-* attributes on <body>
    geometry: dict[str, Any] | None  # where the timeline's lanes are on the page
    summary: dict[str, Any] | None  # where the summary chart's titles and figures are
    screenshot: np.ndarray          # height x width x 3, uint8
    seconds: float
    requests: list[str] = field(default_factory=list)  # URLs the page asked for, other than itself and data:
    problems: list[str] = field(default_factory=list)  # exceptions and errors the browser reported
    probed: Any = None  # the value of visit's `probe`

    @property
    def clean(self) -> bool:
        """What assert_healthy passes: status "ok", nothing requested or reported."""
        return self.status == "ok" and not self.requests and not self.problems


class SharedBrowser:
    """The one Browser that serves the visits in turn, where each visit started its own (about 0.75 CPU-s and
    seconds of wall time under load, 28 times a module): started at the first visit, kept after a clean one and
    thrown away after any other (or one that raised), so that no page's trouble reaches a later page, whose visit
    then starts a new browser."""

    def __init__(self) -> None:
        self.browser: Browser | None = None

    def get(self) -> Browser:
        if self.browser is None:
            self.browser = Browser()
        return self.browser

    def release(self, clean: bool) -> None:
        if clean and self.browser is not None:
            try:
                self.browser.close_page()
                return
            except (RuntimeError, TimeoutError, OSError):
                pass
        self.discard()

    def discard(self) -> None:
        if self.browser is not None:
            self.browser, browser = None, self.browser
            browser.close()


SHARED = SharedBrowser()


@pytest.fixture(scope="module", autouse=True)
def closes_the_shared_browser():
    yield
    SHARED.discard()


def visit(path: Path, fragment: str = "", width: int = 1400, height: int = 1000, noted: tuple[str, ...] = (),
          cpu_s: float = WAIT_CPU_S, wall_s: float = WAIT_WALL_S, probe: str = "") -> Visit:
    """Open `path` in headless Chromium (a new page of SHARED's browser), wait until its body's data-status leaves
    "loading" (and, for errors the page notes later, a blocked request or a lost WebGL context, until its
    data-errors holds every one of `noted`, at most NOTED_WALL_S; a `Wait` of `cpu_s` and `wall_s`, else
    TimeoutError),
    and collect what the page recorded, what the browser saw, the value of the JavaScript expression `probe` (a page
    that records nothing of its own: the sweep's) and then a screenshot of the viewport (make it tall enough)."""
    url = path.resolve().as_uri() + fragment
    browser, seen = SHARED.get(), None
    try:
        browser.open(width, height)
        wait = Wait(browser.proc.pid, cpu_s, wall_s)
        browser.call("Page.navigate", session=True, url=url)
        status = browser.poll("document.body ? document.body.dataset.status || '' : ''",
                              lambda status: status not in ("", "loading"), wait, f"{path.name} still loading")
        seconds = time.monotonic() - wait.began_s
        if noted:
            with contextlib.suppress(TimeoutError):  # the test's asserts then say what the page noted
                browser.poll("document.body.dataset.errors || ''", lambda errors: all(n in errors for n in noted),
                             Wait(browser.proc.pid, wall_s=NOTED_WALL_S), f"{path.name} noted not all of {noted}")
            status = browser.evaluate("document.body.dataset.status")
        body = browser.evaluate("document.body ? Object.assign({}, document.body.dataset) : {}") or {}
        geometry, summary = (browser.evaluate(f"(d => d && d.dataset.geometry)(document.getElementById('{name}'))")
                             for name in ("timeline", "summary"))
        probed = browser.evaluate(probe) if probe else None  # after the page's records: a probe may zoom (redraw)
        # The viewport only: capturing beyond it resizes the page, which redraws every plot (slow in software).
        shot = browser.call("Page.captureScreenshot", session=True, format="png")
        requests, problems = [], []
        for event in browser.events:
            method, params = event["method"], event.get("params", {})
            if method == "Network.requestWillBeSent":
                if not params["request"]["url"].startswith(("data:", "blob:", url.split("#")[0])):
                    requests.append(params["request"]["url"])
            elif method == "Runtime.exceptionThrown":
                problems.append("exception: " + json.dumps(params["exceptionDetails"])[:500])
            elif method == "Log.entryAdded" and params["entry"]["level"] == "error":
                problems.append("log: " + params["entry"]["text"])
            elif method == "Runtime.consoleAPICalled" and params["type"] == "error":
                problems.append("console: " + json.dumps(params["args"])[:500])
        seen = Visit(status, body, json.loads(geometry) if geometry else None,
                     json.loads(summary) if summary else None, decode_png(base64.b64decode(shot["data"])), seconds,
                     requests, problems, probed)
        return seen
    finally:
        SHARED.release(clean=seen is not None and seen.clean)


# --- pixels ----------------------------------------------------------------------------------------------

def decode_png(data: bytes) -> np.ndarray:
    """An 8-bit RGB(A) PNG as a height x width x 3 array: with Pillow where installed, else by hand."""
    try:
        import io

        from PIL import Image
        return np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))
    except ImportError:
        pass
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    at, chunks, header = 8, [], None
    while at < len(data):
        length = int.from_bytes(data[at:at + 4], "big")
        kind, body = data[at + 4:at + 8], data[at + 8:at + 8 + length]
        at += 12 + length
        if kind == b"IHDR":
            header = body
        elif kind == b"IDAT":
            chunks.append(body)
        elif kind == b"IEND":
            break
    width, height = int.from_bytes(header[0:4], "big"), int.from_bytes(header[4:8], "big")
    depth, color, interlace = header[8], header[9], header[12]
    assert depth == 8 and color in (2, 6) and interlace == 0, f"unsupported PNG: depth {depth}, colour {color}"
    bpp = 3 if color == 2 else 4
    raw = np.frombuffer(zlib.decompress(b"".join(chunks)), dtype=np.uint8).reshape(height, 1 + width * bpp)
    out = np.zeros((height, width * bpp), dtype=np.int32)
    previous = np.zeros(width * bpp, dtype=np.int32)
    for y in range(height):
        kind, line = raw[y, 0], raw[y, 1:].astype(np.int32)
        if kind == 0:
            row = line
        elif kind == 1:  # Sub: a running sum per channel
            row = np.cumsum(line.reshape(width, bpp), axis=0).ravel() & 0xFF
        elif kind == 2:  # Up
            row = (line + previous) & 0xFF
        else:  # Average and Paeth depend on the byte just decoded: byte by byte, in plain Python (faster here)
            cur, up = line.tolist(), previous.tolist()
            for x in range(len(cur)):
                left = cur[x - bpp] if x >= bpp else 0
                if kind == 3:
                    cur[x] = (cur[x] + ((left + up[x]) >> 1)) & 0xFF
                    continue
                upper_left = up[x - bpp] if x >= bpp else 0
                pa, pb, pc = abs(up[x] - upper_left), abs(left - upper_left), abs(left + up[x] - 2 * upper_left)
                cur[x] = (cur[x] + (left if pa <= pb and pa <= pc else up[x] if pb <= pc else upper_left)) & 0xFF
            row = np.array(cur, dtype=np.int32)
        out[y] = row
        previous = row
    return out.reshape(height, width, bpp)[:, :, :3].astype(np.uint8)


def kind_pixels(image: np.ndarray, rgb: tuple[int, int, int], tolerance: int = 24) -> np.ndarray:
    """Mask of the pixels within `tolerance` of a kind's colour."""
    return (np.abs(image.astype(np.int16) - np.array(rgb, dtype=np.int16)).max(axis=2) <= tolerance)


def check_timeline(v: Visit, min_fraction: float = 0.01) -> None:
    """The screenshot's timeline area shows bars of F and B, every bar pixel lies on a lane, and bars fill their
    lane's band."""
    assert v.geometry, "the page recorded no timeline geometry"
    left, top, width, height = (round(c) for c in v.geometry["plot"])
    area = v.screenshot[top:top + height, left:left + width]
    assert area.shape[0] > 20 and area.shape[1] > 20, f"timeline area off the screenshot: {v.geometry['plot']}"
    white = (area.min(axis=2) >= 245).mean()
    assert white < 0.98, f"timeline is blank: {white:.1%} white"
    bars = kind_pixels(area, KIND_RGB["F"]) | kind_pixels(area, KIND_RGB["B"])
    assert bars.mean() > min_fraction, f"too few F/B bar pixels in the timeline: {bars.mean():.2%}"
    lanes = np.array(v.geometry["lanes"]) - top
    # Bars are 70 % of a lane's height (devices are further apart): the height the page says it drew must fit
    # between the lanes as they lie on the screen, and the pixels must stay within it.
    pitch = np.diff(lanes).min() if len(lanes) > 1 else height
    assert 0.3 * pitch <= v.geometry["bar_px"] <= 0.72 * pitch, (v.geometry["bar_px"], pitch)
    half = v.geometry["bar_px"] / 2
    rows = np.flatnonzero(bars.sum(axis=1) > 0)
    off = np.abs(rows[:, None] - lanes[None, :]).min(axis=1) > half + 1.5
    assert not off.any(), f"bar pixels off their lanes at rows {(rows[off] + top)[:10].tolist()}"
    # And each lane's band is filled across the bar's height, not a thin line.
    filled = bars.sum(axis=1)
    used = [y for y in lanes if 0 <= round(y) < len(filled) and filled[round(y)] > 0]
    assert used, "no lane has bars on its centre line"
    last = len(filled) - 1
    edges = [filled[max(0, round(y - half + 2))] > 0 and filled[min(last, round(y + half - 2))] > 0 for y in used]
    assert np.mean(edges) > 0.9, "bars are thinner than their recorded height"


def assert_healthy(v: Visit) -> None:
    assert v.status == "ok", f"page status {v.status!r}: {v.body.get('errors')}"
    assert not v.requests, f"network requests: {v.requests}"
    assert not v.problems, "\n".join(v.problems)


# --- the tests ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def example_page(tmp_path_factory) -> Path:
    from tests.conftest import pipesim

    folder = tmp_path_factory.mktemp("example")
    cwd = os.getcwd()
    os.chdir(folder)
    try:
        code, _, err = pipesim("simulate")
    finally:
        os.chdir(cwd)
    assert code == 0, err
    return folder / "pipesim-example.html"


@needs_chromium
def test_built_in_example_renders_every_schedule(example_page):
    from pipesim.schedules import METHODS

    v = visit(example_page, "#test", width=800, height=1300)
    assert_healthy(v)
    # In test mode the page drew every view in turn and measured the WebGL canvas's ink under the timeline.
    drawn = dict(item.split("=") for item in v.body["views"].split())
    assert list(drawn) == list(METHODS)
    assert all(float(ink) > 0.002 for ink in drawn.values()), drawn
    check_timeline(v)
    # The summary chart heads the page: its bars (SVG) are above the timeline.
    top = round(v.geometry["plot"][1])
    assert kind_pixels(v.screenshot[:top - 100], (0x4C, 0x78, 0xA8)).sum() > 200, "no summary chart at the top"
    # At 800 px the 16 names leave each of its four panels 130 px: the titles wrap within their panels (one ran
    # into the next title, the last off the page), and a figure too wide for its bar stands past the bar's end
    # (ZB-V's "7.3%" bubble, kept inside shrunk and then drawn larger, ran left over the axis).
    titles, right = v.summary["titles"], v.summary["right"]
    assert len(titles) == 4
    for (_, end), (start, _) in zip(titles, [*titles[1:], (right, right)]):
        assert end <= start, titles
    for panel in v.summary["figures"]:
        assert panel["left"] >= panel["axis_left"] - 0.5, v.summary["figures"]
    assert_ticks_apart(v.summary["ticks"])
    assert len(v.summary["ticks"][0]) == 4  # samples/s: 0, 100, 200, 300, as dense as they read apart (not 0, 200)


TICK_GAP_PX = 8  # between a summary panel's tick labels at the least: "1,000 2,000 3,000" stood 4 px apart


def assert_ticks_apart(axes: list[list[list[float]]]) -> None:
    """Each summary panel's tick labels (left, right, top, bottom) level and TICK_GAP_PX apart, left to right."""
    assert len(axes) == 4 and all(len(ticks) >= 2 for ticks in axes), axes
    for ticks in axes:
        assert max(bottom - top for _, _, top, bottom in ticks) <= 16, ticks  # one 12 px line high: level, not on end
        assert all(b[0] - a[1] >= TICK_GAP_PX for a, b in zip(ticks, ticks[1:])), ticks


@needs_chromium
def test_large_page_is_small_and_draws_bars_on_lanes(tmp_path):
    from tests.conftest import pipesim

    page = tmp_path / "big.html"
    code, _, err = pipesim("simulate", "-s", "1f1b", "-p", "64", "-m", "1024", "--html", page)
    assert code == 0, err
    assert page.stat().st_size < 25e6
    v = visit(page, "#test", height=1600)
    assert_healthy(v)
    check_timeline(v, min_fraction=0.05)
    assert len(v.geometry["lanes"]) == 64  # transfers cost nothing: no empty send/recv lanes


@needs_chromium
@pytest.mark.parametrize("script, cpu_s, wall_s, ended_by", [
    ("while (true) {}", 1, WAIT_WALL_S, "cpu"),  # spins: its CPU budget runs out, however loaded the machine
    ("", WAIT_CPU_S, 1, "wall"),  # never says it is done and spends nothing: the wall bound ends the wait
])
def test_a_page_that_never_finishes_is_a_timeout(tmp_path, script, cpu_s, wall_s, ended_by):
    """The wait ends on the bound it should: what it spent, as the error says, is past that bound alone (both bounds
    are in every message, so the message's words alone do not tell which ended it)."""
    page = tmp_path / "hang.html"
    page.write_text(f"<html><body data-status=\"loading\"><script>{script}</script></body></html>")
    with pytest.raises(TimeoutError) as raised:
        visit(page, cpu_s=cpu_s, wall_s=wall_s)
    spent = re.search(r"([\d.]+) of [\d.]+ CPU-s in (\d+) of [\d.]+ s$", str(raised.value))
    assert spent, raised.value
    assert (float(spent[1]) >= cpu_s, int(spent[2]) >= wall_s) == (ended_by == "cpu", ended_by == "wall"), raised.value


@needs_chromium
def test_a_call_never_answered_is_a_timeout_while_events_stream_in(tmp_path):
    """A page logging every 10 ms sends chromium's events faster than a wait polls: the wait still ends."""
    page = tmp_path / "chatty.html"
    page.write_text("<html><body><script>setInterval(() => console.log('tick'), 10)</script></body></html>")
    with Browser() as browser:
        browser.open(200, 200)
        browser.call("Page.navigate", session=True, url=page.resolve().as_uri())
        browser.poll("location.protocol + document.readyState", lambda state: state == "file:complete",
                     Wait(browser.proc.pid), f"{page.name} still loading")
        with pytest.raises(TimeoutError, match="did not answer Runtime.evaluate"):
            browser.evaluate("new Promise(resolve => { window.kept = resolve })", Wait(browser.proc.pid, wall_s=1))


@needs_chromium
def test_the_checks_catch_a_broken_page(tmp_path):
    """The health checks fail where they should: a network request, a script error, too many WebGL plots."""
    from pipesim.traces.view import write_html

    page = tmp_path / "broken.html"
    write_html([], page)  # no figure: the page's health checks alone
    text = page.read_text()
    assert "data-status" in text
    page.write_text(text.replace("</body>", "<img src=\"http://192.0.2.1/x.png\"><script>nope()</script></body>"))
    v = visit(page, noted=("network request blocked", "nope is not defined"))
    assert v.status == "error"
    assert "network request blocked: http://192.0.2.1/x.png" in v.body["errors"]
    assert "nope is not defined" in v.body["errors"]

    # What one WebGL plot per schedule did: more live contexts than the browser keeps (about 16).
    many = tmp_path / "many.html"
    many.write_text(text.replace("</body>", "<script>for (let i = 0; i < 20; i++) document.body.appendChild("
                                 "document.createElement('canvas')).getContext('webgl');</script></body>"))
    v = visit(many, noted=("WebGL context lost",))
    assert v.status == "error" and "WebGL context lost" in v.body["errors"]


def test_png_decoder_reads_every_filter():
    """The hand-written decoder (used where Pillow is missing) against rows written with each filter."""
    rng = np.random.default_rng(0)
    image = rng.integers(0, 256, size=(5, 7, 3), dtype=np.uint8)
    rows, previous = [], np.zeros(21, dtype=np.int32)
    for y, kind in enumerate([0, 1, 2, 3, 4]):
        row = image[y].ravel().astype(np.int32)
        left = np.concatenate([np.zeros(3, dtype=np.int32), row[:-3]])
        upper_left = np.concatenate([np.zeros(3, dtype=np.int32), previous[:-3]])
        if kind == 0:
            pred = np.zeros_like(row)
        elif kind == 1:
            pred = left
        elif kind == 2:
            pred = previous
        elif kind == 3:
            pred = (left + previous) >> 1
        else:
            p = left + previous - upper_left
            pa, pb, pc = np.abs(p - left), np.abs(p - previous), np.abs(p - upper_left)
            pred = np.where((pa <= pb) & (pa <= pc), left, np.where(pb <= pc, previous, upper_left))
        rows.append(bytes([kind]) + ((row - pred) & 0xFF).astype(np.uint8).tobytes())
        previous = row

    def chunk(kind: bytes, body: bytes) -> bytes:
        return len(body).to_bytes(4, "big") + kind + body + zlib.crc32(kind + body).to_bytes(4, "big")

    header = (7).to_bytes(4, "big") + (5).to_bytes(4, "big") + bytes([8, 2, 0, 0, 0])
    png = (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"".join(rows)))
           + chunk(b"IEND", b""))
    assert np.array_equal(decode_png(png), image)


@pytest.fixture(scope="module")
def big_and_small_view(tmp_path_factory) -> tuple[Path, Path, Visit]:
    """A view of a 2 GiB prediction and a run of a few KiB (1F1B, p = 2, m = 4, N = 2): the two traces and one visit
    of the page, its hovers and ticks read as drawn and zoomed (HOVERS_JS; its geometry is read before the zoom):
    the page the memory axes' and the hovers' tests read."""
    from tests.conftest import pipesim

    folder = tmp_path_factory.mktemp("big-and-small")
    big, small, page = folder / "big.json", folder / "small.json", folder / "v.html"
    shape = ("-s", "1f1b", "-p", 2, "-m", 4, "-n", 2)
    assert pipesim("simulate", *shape, "--activation-mb", 700, "--trace", big).code == 0
    assert pipesim("simulate", *shape, "--param-mb", 0.002, "--activation-mb", 0.001, "--output-mb", 0.001,
                   "--trace", small).code == 0
    code, _, err = pipesim("view", big, small, "--html", page)
    assert code == 0, err
    return big, small, visit(page, "#test", height=1400, probe=HOVERS_JS)


@needs_chromium
def test_traces_of_very_different_memory_each_get_their_own_memory_axis(big_and_small_view):
    """A view of a 2 GiB prediction and a run of a few KiB (a measured CPU run's is a few MiB): each trace's memory
    panel is scaled to its own peak, so neither curve is a flat line at the bottom of the other's axis."""
    from pipesim.traces.trace import read_trace
    from pipesim.units import MIB

    big, small, v = big_and_small_view
    assert_healthy(v)
    check_timeline(v)
    panels = v.geometry["memory"]
    assert [panel["trace"] for panel in panels] == ["1f1b, predicted (big.json)", "1f1b, predicted (small.json)"]
    for panel, path in zip(panels, (big, small)):
        peak = max(c.values.max() for c in read_trace(path).counters["memory_bytes"]) / MIB
        assert peak <= panel["range"][1] <= 1.3 * peak, (panel, peak)


# The sweep page's boxes: the trade-off's title and mode bar, and each of the fronts' table's header and first row
# cells with their text ([left, top, right, bottom]).
SWEEP_BOXES_JS = """(() => {
  const box = element => { const r = element.getBoundingClientRect(); return [r.left, r.top, r.right, r.bottom]; };
  const [figure, table] = document.querySelectorAll(".js-plotly-plot");
  const cells = [...table.querySelectorAll(".column-block")].filter(block => block.id !== "cells2").map(block => {
    const cell = block.querySelector(".column-cell");
    return {text: cell.textContent, cell: box(cell.querySelector(".cell-rect")),
            written: box(cell.querySelector(".cell-text"))};
  });
  return {title: box(figure.querySelector(".gtitle")), modebar: box(figure.querySelector(".modebar")), cells};
})()"""


# The sweep page's axes' tick labels, as written: the trade-off's times and its memory.
SWEEP_TICKS_JS = """[".xtick text", ".ytick text"].map(ticks =>
  [...document.querySelectorAll(".js-plotly-plot")[0].querySelectorAll(ticks)].map(tick => tick.textContent))"""


@pytest.fixture(scope="module")
def sweep_page(tmp_path_factory) -> Visit:
    """One visit at 800 px of the sweep page of 1F1B, ZB-H1 and ZB-V at p = 2 and 0.1 of the costs, which the sweep
    page's tests read (its boxes, SWEEP_BOXES_JS, and its ticks, SWEEP_TICKS_JS): one plotly.js start, not one a
    test."""
    from tests.conftest import pipesim

    page = tmp_path_factory.mktemp("sweep") / "t.html"
    code, _, err = pipesim("sweep", "-s", "1f1b,zb-h1,zb-v", "-p", "2", "--cost-scale", "0.1", "-j", "1",
                           "--html", page)
    assert code == 0, err
    return visit(page, width=800, probe=f"({{boxes: {SWEEP_BOXES_JS}, ticks: {SWEEP_TICKS_JS}}})")


@needs_chromium
def test_sweep_page_draws_each_schedule_in_its_own_colour(sweep_page):
    """The trade-off page opens on one front: its dots are there, in one colour per schedule. At 800 px its title
    starts under the plot's mode bar, and no header or figure of the fronts' table runs past its cell (the title
    ran under the icons; "staleness" and "samples/s" were cut)."""
    from plotly.colors import qualitative

    from pipesim.traces.metrics import STALENESS_HEADER

    v = sweep_page
    assert_healthy(v)
    for colour in qualitative.D3[:3]:
        rgb = tuple(int(colour[k:k + 2], 16) for k in (1, 3, 5))
        assert kind_pixels(v.screenshot, rgb, tolerance=8).sum() > 40, f"no dot of colour {colour} on the page"
    boxes = v.probed["boxes"]
    assert boxes["title"][1] >= boxes["modebar"][3], boxes
    assert {STALENESS_HEADER, "samples/s"} <= {c["text"] for c in boxes["cells"]}  # headed as the tables
    for c in boxes["cells"]:
        assert c["cell"][0] < c["written"][0] and c["written"][2] <= c["cell"][2], c


@needs_chromium
def test_the_sweep_pages_axes_write_each_tick_to_one_number_of_decimals(sweep_page):
    """At 800 px 0.1 of the costs put the trade-off's times 0.2 ms apart: each tick reads to a tenth ("5.8, 6.0,
    6.2", where "," wrote "5.8 6 6.2"), the memory axis's, 1 MiB apart, whole and thousands separated."""
    v = sweep_page
    assert_healthy(v)
    times, mib = v.probed["ticks"]
    assert len(times) >= 3 and {len(tick.partition(".")[2]) for tick in times} == {1}, times
    assert len(mib) >= 3 and all(re.fullmatch(r"\d,\d{3}", tick) for tick in mib), mib


TIMELINE_LINE_JS = "document.querySelector('#timeline .gtitle').textContent"


@needs_chromium
def test_a_view_line_gives_the_source_once(two_device_page, tmp_path):
    """A view's line read "1f1b, predicted: makespan ... (p=2, m=2, N=1, 18 ops, predicted)": its label names the
    source, so its shape does not; simulate's page, whose label is the method alone, keeps it there."""
    from tests.conftest import pipesim

    trace, simulated = two_device_page
    page = tmp_path / "v.html"
    assert pipesim("view", trace, "--html", page).code == 0
    viewed = visit(page, "#test", probe=TIMELINE_LINE_JS)
    for v in (viewed, simulated):
        assert_healthy(v)
    lines = [viewed.probed, simulated.probed["line"]]
    assert lines[0].startswith("1f1b, predicted: ") and lines[0].count("predicted") == 1, lines[0]
    assert lines[0].endswith("(p=2, m=2, N=1, 18 ops)"), lines[0]
    assert lines[1].startswith("1f1b: ") and lines[1].endswith("(p=2, m=2, N=1, 18 ops, predicted)"), lines[1]


@needs_chromium
def test_sixteen_devices_lanes_stay_apart_and_the_memory_legend_shows_every_device(tmp_path):
    """16 devices with send and receive lanes on a 1000 x 800 window: the memory legend (5 parts, 16 devices) lies
    in rows under the memory panel, whole and unscrolled, and takes no height from the lanes, which stay at
    least 16 px apart (beside the panel, it scrolled and squeezed them to 9 px)."""
    from tests.conftest import pipesim

    page = tmp_path / "p16.html"
    code, _, err = pipesim("simulate", "-s", "1f1b", "-p", 16, "-m", 32, "--comm", 0.2, "--html", page)
    assert code == 0, err
    v = visit(page, "#test", width=1000, height=800)
    assert_healthy(v)
    lanes = v.geometry["lanes"]
    assert len(lanes) == 16 * 3  # compute, send, receive
    assert min(b - a for a, b in zip(lanes, lanes[1:])) >= 15.9, lanes[:6]
    (panel,) = v.geometry["memory"]
    legend, figure = v.geometry["memory_legend"], v.geometry["figure"]
    assert not legend["scrolls"]
    _, legend_top, _, legend_height = legend["box"]
    assert legend_top >= panel["plot"][1] + panel["plot"][3]  # under the panel
    assert legend_top + legend_height <= figure[1] + figure[3] + 1  # within the figure
    assert legend["box"][0] + legend["box"][2] <= figure[0] + figure[2] + 1
    assert len(panel["lines_listed"]) == 16


@needs_chromium
def test_the_memory_panel_draws_each_devices_capacity_as_a_labelled_dashed_line(tmp_path):
    """A cluster whose devices 0-1 hold 1.25 GiB and devices 2-3 are ranks sharing one 2.5 GiB GPU: one line per
    capacity, naming its devices, so device 0's 1,288 MiB peak shows above its 1,280 MiB; each rank's line at
    what the other's peak leaves it (2,560 - 1,104 and 2,560 - 1,168 MiB, both fitting, as the table says),
    the two 64 MiB apart labelled once; and the axis reaches the highest."""
    from tests.conftest import pipesim

    cluster, page = tmp_path / "c.json", tmp_path / "c.html"
    cluster.write_text(json.dumps({"devices": [
        {"name": "gpu0", "memory_gib": 1.25}, {"name": "gpu1", "memory_gib": 1.25},
        {"name": "r2", "compute": "g", "memory_gib": 2.5}, {"name": "r3", "compute": "g"}]}))
    code, out, err = pipesim("simulate", "-s", "1f1b", "-p", 4, "-m", 8, "--cluster", cluster, "--html", page)
    assert code == 0, err
    assert "memory: 1f1b OOM on device 0 " in " ".join(out.split())  # device 0 alone: the caption names it
    v = visit(page, "#test", height=1100)
    assert_healthy(v)
    assert v.geometry["capacity"] == [
        {"axis": "y2", "mib": 1280, "label": "device 0, device 1: memory 1,280 MiB"},
        {"axis": "y2", "mib": 1392,
         "label": "device 3, device 2: room beside its GPU's other ranks' peaks 1,392\u20131,456 MiB"},
        {"axis": "y2", "mib": 1456, "label": ""}]
    assert v.geometry["memory"][0]["range"][1] >= 1456
    # The lines' label over the panel, off device 0's curve at its 1,280 MiB line (under the line, it lay on it).
    (label,) = v.geometry["capacity_labels"]
    assert label["text"] == "- - - device 0, device 1: memory 1,280 MiB; device 3, device 2: room beside its GPU's " \
        "other ranks' peaks 1,392\u20131,456 MiB"
    _, label_top, _, label_height = label["box"]
    assert label_top + label_height <= v.geometry["memory"][0]["plot"][1], (label, v.geometry["memory"][0])


@needs_chromium
def test_a_capacity_far_above_its_devices_peak_is_noted_not_drawn_so_the_axis_stays_the_runs(tmp_path):
    """Device 0 peaks at 1,160 MiB of its 1,280 MiB: its line is drawn. Device 1 peaks near 1,100 MiB of 80 GiB:
    a line there would stretch the axis to 81,920 MiB and flatten the run to a line at 0, so the panel's note
    names that memory and the peak's share instead, and the axis ends near the run's own peak."""
    from tests.conftest import pipesim

    cluster, page = tmp_path / "c.json", tmp_path / "far.html"
    cluster.write_text(json.dumps({"devices": [{"name": "gpu0", "memory_gib": 1.25},
                                               {"name": "gpu1", "memory_gib": 80}]}))
    code, _, err = pipesim("simulate", "-s", "1f1b", "-p", 2, "-m", 8, "--cluster", cluster, "--html", page)
    assert code == 0, err
    v = visit(page, "#test")
    assert_healthy(v)
    assert v.geometry["capacity"] == [{"axis": "y2", "mib": 1280, "label": "device 0: memory 1,280 MiB"}]
    (note,) = v.geometry["capacity_notes"]
    assert note["axis"] == "y2"
    assert note["text"].startswith("device 1: memory 81,920 MiB (peak 1.") and note["text"].endswith(
        "% of it), off this panel's scale"), note
    assert 1280 <= v.geometry["memory"][0]["range"][1] <= 1.1 * 1280


@needs_chromium
def test_a_capacity_the_axis_reaches_for_another_device_is_drawn_not_noted_off_the_scale(tmp_path):
    """Device 1 peaks at 136 MiB of its 2,048, under half, but device 0's 1,160 MiB of the same 2,048 takes the axis
    there: one line for both, not a note calling device 1's memory off the panel's scale (the note stood over the
    very line it said was off it)."""
    from tests.conftest import pipesim

    cluster, page = tmp_path / "c.json", tmp_path / "reached.html"
    cluster.write_text(json.dumps({"devices": [{"name": "gpu0", "memory_gib": 2}, {"name": "gpu1", "memory_gib": 2}]}))
    code, _, err = pipesim("simulate", "-s", "1f1b", "-p", 2, "-m", 8, "--cluster", cluster, "--param-mb", "256,16",
                           "--html", page)
    assert code == 0, err
    v = visit(page, "#test")
    assert_healthy(v)
    assert v.geometry["capacity"] == [{"axis": "y2", "mib": 2048, "label": "each device's memory 2,048 MiB"}]
    assert v.geometry["capacity_notes"] == []


@needs_chromium
def test_compare_draws_each_devices_memory_alike_in_the_predicted_and_measured_panels(tmp_path):
    """A device's legend entry toggles its line in both panels, so both draw it by default: the measured panel
    (no parts stacked) draws device 1, and the predicted one draws it too over its stack of device 0's parts,
    where before it was hidden there and its legend entry greyed out while the measured panel drew it."""
    from tests.conftest import pipesim

    predicted, page = tmp_path / "p.json", tmp_path / "c.html"
    assert pipesim("simulate", "-s", "1f1b", "-p", 2, "-m", 4, "-n", 8, "--trace", predicted).code == 0
    measured = Path(__file__).parent.parent / "traces" / "measured" / "fidelity-cpu2-day3-runs" / "1f1b.json"
    code, _, err = pipesim("compare", measured, predicted, "--html", page)
    assert code == 0, err
    v = visit(page, "#test", height=1400)
    assert_healthy(v)
    panels = v.geometry["memory"]
    assert [panel["stacked_peak_mib"] is not None for panel in panels] == [True, False]
    assert [panel["lines_drawn"] for panel in panels] == [["device 0", "device 1"]] * 2


def twenty_devices_page(folder: Path, memory_gib: float, probe: str = "") -> Visit:
    """1F1B on 20 devices of `memory_gib` each (a heatmap of memory, no lines), its page visited (with `probe`): its
    peak is device 0's 2,312 MiB."""
    from tests.conftest import pipesim

    cluster, page = folder / "c.json", folder / "h.html"
    cluster.write_text(json.dumps({"devices": [{"name": f"gpu{d}", "memory_gib": memory_gib} for d in range(20)]}))
    code, _, err = pipesim("simulate", "-s", "1f1b", "-p", 20, "-m", 20, "--cluster", cluster, "--html", page)
    assert code == 0, err
    v = visit(page, "#test", height=1300, probe=probe)
    assert_healthy(v)
    return v


@pytest.fixture(scope="module")
def small_runs_heatmap(tmp_path_factory) -> Visit:
    """`twenty_devices_page` on 80 GiB each, its hovers and ticks read as drawn and zoomed (HOVERS_JS): the page of
    the tests of either."""
    return twenty_devices_page(tmp_path_factory.mktemp("heatmap"), 80, HOVERS_JS)


@needs_chromium
def test_a_memory_heatmap_turns_red_above_the_devices_shared_memory(tmp_path):
    """20 devices' memory is a heatmap (no lines, so no dashed line): on 1.25 GiB each, its colours run up to
    1,280 MiB and LIMIT_COLOR beyond, to device 0's 2,312 MiB peak, and the colour bar names the capacity."""
    (heatmap,) = twenty_devices_page(tmp_path, 1.25).geometry["heatmaps"]
    assert heatmap["capacity"] == 1280 and heatmap["zmax"] == 2312
    top, stops = 1280 / 2312, heatmap["colorscale"]
    assert stops[0] == [0, "#440154"] and stops[-3] == [pytest.approx(top), "#fde725"]  # Viridis up to 1,280 MiB
    assert stops[-2:] == [[pytest.approx(top), "#c0392b"], [1, "#c0392b"]]  # then red
    assert heatmap["ticks"] == ["0", "320", "640", "960", "memory 1,280"]


@needs_chromium
def test_a_small_runs_heatmap_runs_its_colours_to_its_own_peak_and_notes_the_memory(small_runs_heatmap):
    """20 devices peaking at 2,312 MiB on 80 GiB each: coloured up to 81,920 MiB the heatmap was one dark purple;
    its colours run to the peak, and the note over it names the memory and the peak's share of it. Each row is
    named once, by its label, the axis untitled as the timeline's (titled "device" beside "device 0", it said so
    twice); the colour bar by what it colours and in which unit (it read "MiB"), its title inside the figure."""
    v = small_runs_heatmap
    (heatmap,) = v.geometry["heatmaps"]
    assert heatmap["capacity"] is None and heatmap["zmax"] == 2312 and heatmap["colorscale"] == "Viridis"
    assert heatmap["rows"] == "" and heatmap["bar"] == "memory<br>(MiB)"
    labels = heatmap["row_labels"]
    assert labels and len(set(labels)) == len(labels) and set(labels) <= {f"device {d}" for d in range(20)}
    left, _, width, _ = v.geometry["figure"]
    assert heatmap["bar_box"][2] > 0 and heatmap["bar_box"][0] + heatmap["bar_box"][2] <= left + width
    assert v.geometry["capacity_notes"] == [
        {"axis": "y2", "text": "each device's memory 81,920 MiB (peak 2.8% of it), off this panel's scale"}]


# The timeline's drawn figure as drawn and once zoomed into the middle third of its time (the page then redraws each
# device's memory for the range shown): each trace's hover template, legend group, hovered MiB and ms (a line's
# customdata pairs, a heatmap's text and customdata) beside its y (z) and x values, the tick labels of every axis and
# colour bar, and the title.
HOVERS_JS = """(async () => {
  const gd = document.getElementById("timeline"), list = values => (values ? Array.from(values) : null);
  const heatmap = d => d.type === "heatmap";
  const read = () => ({traces: gd.data.filter(d => d.hovertemplate).map(d => ({
            type: d.type, template: d.hovertemplate, group: d.legendgroup || "",
            mib: heatmap(d) ? d.text.flat() : list(d.customdata).map(pair => pair[0]),
            ms: heatmap(d) ? d.customdata.flat() : list(d.customdata).map(pair => pair[1]),
            values: heatmap(d) ? d.z.flat() : list(d.y),
            times: heatmap(d) ? d.z.flatMap(() => list(d.x)) : list(d.x)})),
          ticks: [...gd.querySelectorAll("[class$=tick] text")].map(t => t.textContent), title: gd.layout.title.text});
  const drawn = read(), before = gd.data.map(d => d.x), [x0, x1] = gd._fullLayout.xaxis.range;
  await Plotly.relayout(gd, {"xaxis.range": [x0 + (x1 - x0) / 3, x1 - (x1 - x0) / 3]});
  for (let k = 0; k < 600 && gd.data.every((d, j) => d.x === before[j]); k++) {
    await new Promise(resolve => requestAnimationFrame(() => setTimeout(resolve, 0)));
  }
  return {drawn, zoomed: Object.assign(read(), {redrawn: gd.data.some((d, j) => d.x !== before[j])})};
})()"""


@needs_chromium
def test_the_timelines_hovers_and_ticks_write_ms_and_mib_as_the_rest_of_the_page(small_runs_heatmap,
                                                                                   big_and_small_view):
    """A run of a few KiB: its memory hovered "0.0 MiB" (",.1f") where its bars say "<0.01"; a 2 GiB run's memory
    axis read "2000" where every figure reads "1,288"; times hovered without separators, then by plotly's ",.3f",
    which rounds the binary value (1.0005 ms, 1.000499... in binary, "1.000" where the title and the tables write
    "1.001"); once zoomed, the memory redrawn for the range shown hovered the figures of the points drawn before.
    Every MiB hovered is `mib_text`'s (a device's line, a part of its stack, a heatmap's cell) and every time
    `ms_text`'s, as drawn and zoomed; every tick separated (20 devices' heatmap: `small_runs_heatmap`)."""
    from pipesim.traces.metrics import mib_text, ms_text

    shown = set()
    for v, kind in ((big_and_small_view[2], "scatter"), (small_runs_heatmap, "heatmap")):
        assert_healthy(v)
        assert v.probed["zoomed"]["redrawn"]
        for figure in (v.probed["drawn"], v.probed["zoomed"]):
            below = None  # the top of the stacked part under this one: a part's MiB is its top less that
            for t in figure["traces"]:
                assert t["type"] == kind and " ms<extra>" in t["template"] and ":," not in t["template"], t
                values, stacked = t["values"], t["group"].startswith("part ")
                if stacked and below is not None:
                    values = [top - low for top, low in zip(values, below)]
                below = t["values"] if stacked else None
                assert t["mib"] == ["" if mib is None else mib_text(mib) for mib in values], t["template"]
                assert t["ms"] == [ms_text(ms) for ms in t["times"]], t["template"]
                shown.update(t["mib"])
            ticks = [tick.replace("memory ", "") for tick in figure["ticks"] if tick[:1].isdigit() or "memory" in tick]
            assert any("," in tick for tick in ticks) and not any(re.fullmatch(r"\d{4,}|.*k", t) for t in ticks), ticks
            assert re.search(r"makespan [\d,]+\.\d{3} ms, bubble \d+\.\d%, [\d,]+\.\d{3} ms/step", figure["title"])
    assert {"<0.01", "1,724"} <= shown


# Values where two rules could part: zero and its sign, under MIB_SHOWN, a tie in binary (0.0625, 1.125) and one
# only in decimal (2.675: 2.67499... in binary), rounded up into the next decade (9.995, a tie only in decimal,
# 99.995, 0.9996), a share just short of whole (0.99995), thousands, millions, and not finite.
NUMBERS = [0.0, -0.0, 0.0004, 0.004, 0.01, -0.0001, -1.5, -250.25, 0.0625, 1.0625, 1.125, 0.0725, 2.675, 14.11,
           9.995, 9.996, 99.995, 100.0, 999.5, 1234.5678, 1e6, 0.09996, 0.9996, 0.99995, -0.9999999, 13.278,
           float("nan"), float("inf"), float("-inf")]


@pytest.fixture(scope="module")
def two_device_page(tmp_path_factory) -> tuple[Path, Visit]:
    """`simulate -s 1f1b -p 2 -m 2 -n 1`'s trace and one visit of its page, which read its timeline's line and its
    script's numbers (NUMBERS written by msText, mibText and percentText): the page the tests of either read."""
    from tests.conftest import pipesim

    folder = tmp_path_factory.mktemp("two-devices")
    trace, page = folder / "t.json", folder / "s.html"
    code, _, err = pipesim("simulate", "-s", "1f1b", "-p", 2, "-m", 2, "-n", 1, "--trace", trace, "--html", page)
    assert code == 0, err
    values = "[" + ", ".join({"nan": "NaN", "inf": "Infinity", "-inf": "-Infinity"}.get(repr(v), repr(v))
                             for v in NUMBERS) + "]"
    return trace, visit(page, "#test", probe=f"(() => {{ const n = window.pipesimNumbers, values = {values}; return "
                                             "{line: " + TIMELINE_LINE_JS + ", numbers: [n.msText, n.mibText, "
                                             "n.percentText].map(f => values.map(f))}; })()")


@needs_chromium
def test_the_page_scripts_numbers_are_pythons(two_device_page):
    """The timeline's script writes ms, MiB and shares in its hovers and title with copies of metrics.py's ms_text,
    mib_text and percent_text (msText, mibText, percentText): each, run in Chromium on NUMBERS, writes what
    Python's writes (0.0625 ms read "0.062" in a table and "0.063" hovered)."""
    from pipesim.traces.metrics import mib_text, ms_text, percent_text

    _, v = two_device_page
    assert_healthy(v)
    python = [[text(value) for value in NUMBERS] for text in (ms_text, mib_text, percent_text)]
    assert v.probed["numbers"] == python
    assert python[0][NUMBERS.index(0.0625)] == "0.063" and python[1][NUMBERS.index(2.675)] == "2.68"
    assert [python[1][NUMBERS.index(mib)] for mib in (9.995, 99.995, 0.9996)] == ["10.0", "100", "1.00"]
    assert [python[2][NUMBERS.index(share)] for share in (0.9996, 0.99995, -0.9999999)] == ["99.96%", "99.995%",
                                                                                             "-100%"]


if __name__ == "__main__":
    target, out = Path(sys.argv[1]), Path(sys.argv[2])
    size = (int(sys.argv[3]), int(sys.argv[4])) if len(sys.argv) > 4 else (1400, 1000)
    result = visit(target, sys.argv[5] if len(sys.argv) > 5 else "", *size)
    SHARED.discard()
    print(f"status {result.status} in {result.seconds:.1f} s; body {result.body}; requests {result.requests}; "
          f"problems {result.problems}")
    shot = result.screenshot
    try:
        from PIL import Image
        Image.fromarray(shot).save(out)
    except ImportError:  # write a plain PNG by hand
        raw = b"".join(b"\0" + row.tobytes() for row in shot)

        def chunk(kind: bytes, body: bytes) -> bytes:
            return len(body).to_bytes(4, "big") + kind + body + zlib.crc32(kind + body).to_bytes(4, "big")

        header = shot.shape[1].to_bytes(4, "big") + shot.shape[0].to_bytes(4, "big") + bytes([8, 2, 0, 0, 0])
        out.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(raw))
                        + chunk(b"IEND", b""))
    print(f"wrote {out} ({shot.shape[1]}x{shot.shape[0]})")


@needs_chromium
def test_compare_page_aligns_predicted_and_measured_and_shows_the_error_panel(tmp_path):
    """`compare --html` on a committed torch.distributed.pipelining recording: every view draws, nothing is
    fetched, each device has its predicted and measured lanes, and the error panel's bars sit under the timeline.
    The measurement records no memory: the one memory panel is named the prediction's (unnamed, it read as the
    measurement's)."""
    from tests.conftest import pipesim

    predicted, page = tmp_path / "p.json", tmp_path / "c.html"
    assert pipesim("simulate", "-s", "1f1b", "-p", 2, "-m", 8, "-n", 3, "--comm", 0.1, "--trace", predicted).code == 0
    run_dir = Path(__file__).parent.parent / "traces" / "measured" / "torch-1f1b-2cpu"
    code, _, err = pipesim("compare", run_dir, predicted, "--html", page)
    assert code == 0, err
    v = visit(page, "#test", height=1800, probe="[...document.querySelectorAll('#timeline .annotation')]"
                                                 ".map(a => a.textContent)")
    assert_healthy(v)
    check_timeline(v)
    assert len(v.geometry["lanes"]) == 2 * 3 * 2  # per device, compute, send and receive, predicted and measured
    assert [panel["trace"] for panel in v.geometry["memory"]] == ["predicted"] and "memory of predicted" in v.probed
    bottom = round(v.geometry["plot"][1] + v.geometry["plot"][3])
    assert kind_pixels(v.screenshot[bottom:], (0x4C, 0x78, 0xA8)).sum() > 200, "no error panel under the timeline"


@pytest.fixture(scope="module")
def eight_devices_page(tmp_path_factory) -> tuple[Path, Visit]:
    """`simulate -s 1f1b -p 8 -m 16`'s trace and one visit of its page: the page the memory panel's tests read."""
    from tests.conftest import pipesim

    folder = tmp_path_factory.mktemp("eight-devices")
    page, trace = folder / "m8.html", folder / "m8.json"
    code, _, err = pipesim("simulate", "-s", "1f1b", "-p", 8, "-m", 16, "--html", page, "--trace", trace)
    assert code == 0, err
    return trace, visit(page, "#test", height=1300)


@needs_chromium
def test_the_memory_panel_stacks_the_fullest_devices_parts(eight_devices_page):
    """Under its line, the fullest device's memory fills the panel by part: the optimizer state's band
    (Adam: twice the weights) lies above the weights' and gradients', each in its colour, blended as drawn."""
    _, v = eight_devices_page
    assert_healthy(v)
    panel = v.geometry["memory"][0]
    left, top, width, height = (round(c) for c in panel["plot"])
    area = v.screenshot[top:top + height, left:left + width]

    def filled(hex_rgb: str) -> np.ndarray:  # a part's fill: its colour at 0x99 alpha over white
        rgb = np.array([int(hex_rgb[i:i + 2], 16) for i in (1, 3, 5)])
        return kind_pixels(area, tuple(np.round(rgb * 0x99 / 255 + 255 * (1 - 0x99 / 255)).astype(int)), 6)

    weights, optimizer = filled("#4c78a8"), filled("#54a24b")
    assert weights.mean() > 0.05 and optimizer.mean() > 0.1, (weights.mean(), optimizer.mean())
    rows = lambda mask: np.flatnonzero(mask.mean(axis=1) > 0.5)  # noqa: E731
    assert rows(optimizer).max() < rows(weights).min()  # higher on screen: stacked above


@needs_chromium
def test_over_the_stack_only_the_stacked_devices_line_is_drawn_and_the_parts_sum_to_its_peak(eight_devices_page):
    """Eight devices' lines over the fullest device's parts read as clutter: only that device's line is drawn, the
    others are listed in the legend to be drawn on a click, and the stack still reaches the device's peak."""
    from pipesim.traces.trace import read_trace
    from pipesim.units import MIB

    trace, v = eight_devices_page
    assert_healthy(v)
    peaks = [curve.values.max() / MIB for curve in read_trace(trace).counters["memory_bytes"]]
    fullest = int(np.argmax(peaks))
    (panel,) = v.geometry["memory"]
    assert panel["lines_listed"] == [f"device {d}" for d in range(8)]
    assert panel["lines_drawn"] == [f"device {fullest}"]
    assert panel["stacked_peak_mib"] == pytest.approx(peaks[fullest], rel=1e-9)


@needs_chromium
def test_a_legend_wrapped_into_rows_stays_under_the_title(tmp_path):
    """DualPipeV with expert parallelism draws 13 kinds of op: at 1000 px their legend wraps into two rows, which
    plotly grows upwards from the lanes; the top margin makes room, so the legend never covers the title. And the
    title, too long for one line, wraps clear of the mode bar: at 1000 px its shape took a second line, at 800 px
    its figures ran under the mode bar, so here, at 640 px, they wrap too."""
    from tests.conftest import pipesim

    page = tmp_path / "ep.html"
    code, _, err = pipesim("simulate", "--gpu", "h100-sxm", "--model", "gpt", "--layers", 4, "--width", 256,
                           "--heads", 4, "--seq-len", 128, "--experts", 4, "--expert-parallel", 2, "--data-parallel", 2,
                           "--zero", 1, "-p", 2, "-m", 4, "-s", "dualpipev", "--html", page)
    assert code == 0, err
    v = visit(page, "#test", width=640, height=900)
    assert_healthy(v)
    (_, title_top, _, title_height), (_, legend_top, _, legend_height) = v.geometry["title"], v.geometry["legend"]
    assert legend_height > 40, "the legend is one row: this page no longer checks a wrapped one"
    assert legend_top >= title_top + title_height, (v.geometry["title"], v.geometry["legend"])
    assert legend_top + legend_height <= v.geometry["plot"][1] + 1
    title_left, _, title_width, _ = v.geometry["title"]
    assert title_left + title_width <= v.geometry["modebar"][0], (v.geometry["title"], v.geometry["modebar"])
    assert title_height > 45, "the title is two lines or fewer: this page no longer checks its figures wrapping"


@dataclass
class RoomCheck:
    """A device's memory check as the page reads it (traces/view.py's MemoryCheck)."""

    room_bytes: float | None
    memory: str | None = None
    out_of_memory: bool = False


@needs_chromium
def test_a_view_of_two_traces_keeps_its_title_and_memory_labels_apart_at_800_px(tmp_path):
    """Two traces of long names side by side at 800 px, each device's memory known: the title of several lines was
    cut at the figure's top and its first line ran under the mode bar; each memory panel's capacity label lay over
    its heading ("memory of ... (its own scale)"); the summary's bubble axis, 110 px wide, stood its ticks on end.
    The title is whole and clear of the mode bar, each label over its panel's heading, every tick level and apart."""
    from pipesim.traces import summarize
    from pipesim.traces.view import write_timeline_page
    from tests.conftest import run

    traces = [run("interleaved-1f1b", 2, 8, 2, chunks=2).trace, run("zb-h1", 2, 8, 2).trace]
    checks = [[RoomCheck(1.02 * summarize(trace).peak_memory_mb * 2**20)] * trace.num_devices for trace in traces]
    page = tmp_path / "two.html"
    summaries = [dataclasses.replace(summarize(trace), bubble_fraction=bubble)  # as a measured run's 44 %
                 for trace, bubble in zip(traces, (0.158, 0.444))]
    write_timeline_page(traces, page, labels=["interleaved-1f1b, predicted on H100", "zb-h1, measured on H100"],
                        summaries=summaries, views=[("both", [0, 1])], memory_checks=checks)
    v = visit(page, "#test", width=800, height=1400)
    assert_healthy(v)
    (title_left, title_top, title_width, _), figure = v.geometry["title"], v.geometry["figure"]
    assert title_top >= figure[1] and title_left + title_width <= v.geometry["modebar"][0], v.geometry
    labels, panels = v.geometry["capacity_labels"], v.geometry["memory"]
    assert len(labels) == len(panels) == 2, labels
    for label, panel in zip(labels, panels):
        _, label_top, _, label_height = label["box"]
        assert label_top + label_height <= panel["plot"][1] - 14, (label, panel["plot"])  # over a 12 px heading
    assert_ticks_apart(v.summary["ticks"])
