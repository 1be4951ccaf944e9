"""The Playground in a real browser: JupyterLab, headless Chromium driven by Playwright, notebook 06 run in full.

What no kernel-side test can see: the widgets render, a click in the page reaches the kernel, the live timeline is
redrawn in the page while the step runs, the comparison table lands, and no output scrolls sideways.

Needs Playwright (the ``dev`` extra) and Chromium (Debian: ``apt-get install chromium``; another binary:
``MEMKIT_CHROMIUM=/path``); skipped, with the reason, when either is missing. ``MEMKIT_SCREENSHOT_DIR=dir`` also
writes the app's screenshot there as ``playground.png`` (the README's picture). Run by ``make browser-test``.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from pathlib import Path

import pytest

NOTEBOOK = Path(__file__).resolve().parents[2] / "notebooks" / "06_playground.ipynb"
SETTINGS = {
    # A kernel starts with the notebook (no kernel dialog); every cell stays in the page (no windowing), so
    # the whole notebook can be checked for overflow.
    "@jupyterlab/notebook-extension/tracker.jupyterlab-settings": {
        "autoStartDefaultKernel": True,
        "windowingMode": "none",
    },
    # No "receive Jupyter news?" toast over the page.
    "@jupyterlab/apputils-extension/notification.jupyterlab-settings": {"fetchNews": "false", "checkForUpdates": False},
}
PATTERN = "every:2"  # the value the test picks in the checkpointing panel (the notebook leaves "all")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Lab:
    """A JupyterLab server on 127.0.0.1 with a token, serving ``root``; stopped by its PID."""

    def __init__(self, root: Path, home: Path, startup: str | None = None) -> None:
        self.port, self.token = _free_port(), uuid.uuid4().hex
        settings = home / "settings"
        for name, values in SETTINGS.items():
            path = settings / name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(values))
        env = dict(os.environ, MEMKIT_SMOKE="1", JUPYTER_CONFIG_DIR=str(home / "config"))
        env.pop("PLOTLY_RENDERER", None)  # the browser's own renderer, as a user has it
        env["JUPYTER_RUNTIME_DIR"] = str(home / "runtime")
        if startup:  # code each kernel runs first (IPython's startup folder, in a profile of its own)
            env["IPYTHONDIR"] = str(home / "ipython")
            (home / "ipython/profile_default/startup").mkdir(parents=True)
            (home / "ipython/profile_default/startup/00-test.py").write_text(startup)
        args = [
            sys.executable, "-m", "jupyterlab", "--no-browser", "--ip=127.0.0.1", f"--port={self.port}",
            f"--ServerApp.token={self.token}", f"--ServerApp.root_dir={root}", "--ServerApp.port_retries=0",
            f"--LabApp.user_settings_dir={settings}", f"--LabApp.workspaces_dir={home / 'workspaces'}",
            "--LabApp.expose_app_in_browser=True",
        ]  # fmt: skip
        if os.geteuid() == 0:
            args.append("--allow-root")
        self.log = home / "lab.log"
        with open(self.log, "wb") as log:
            # Its own session: the kernels it starts are stopped with it.
            self.proc = subprocess.Popen(args, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def api(self, path: str, method: str = "GET") -> object:
        req = urllib.request.Request(
            f"{self.url}{path}", method=method, headers={"Authorization": f"token {self.token}"}
        )
        with urllib.request.urlopen(req, timeout=10) as r:
            body = r.read()
        return json.loads(body) if body else None

    def wait_ready(self, timeout: float = 90) -> None:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise RuntimeError(f"jupyter lab exited with {self.proc.returncode}:\n{self.log.read_text()[-3000:]}")
            try:
                self.api("/api/status")
                return
            except OSError:
                time.sleep(0.5)
        raise TimeoutError(f"jupyter lab did not answer in {timeout} s:\n{self.log.read_text()[-3000:]}")

    def wait_kernel_idle(self, timeout: float = 120) -> None:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            sessions = self.api("/api/sessions")
            if sessions and all(s["kernel"]["execution_state"] == "idle" for s in sessions):
                return
            time.sleep(0.5)
        raise TimeoutError(f"no idle kernel in {timeout} s: {self.api('/api/sessions')}")

    def stop(self) -> None:
        try:
            for s in self.api("/api/sessions") or []:
                self.api(f"/api/sessions/{s['id']}", method="DELETE")
        except OSError:
            pass
        self.proc.terminate()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=20)


# Polls the live figure (the first plotly plot in the app: its points, all traces) and the comparison table every
# 20 ms, in the page.
WATCH_JS = """(app) => {
  const seen = [];
  window.__memkit = {seen, tableAt: null};
  window.__memkit.timer = setInterval(() => {
    const gd = app.querySelector('.js-plotly-plot');
    const points = gd && gd.data ? gd.data.reduce((n, t) => n + (t.x ? t.x.length : 0), 0) : -1;
    if (!seen.length || seen[seen.length - 1] !== points) seen.push(points);
    const table = app.querySelector('.memkit-table');
    if (window.__memkit.tableAt === null && table && table.innerText.includes(%r)) {
      window.__memkit.tableAt = seen.length;
    }
  }, 20);
}"""


PLOTS_JS = """() => [...document.querySelectorAll('.js-plotly-plot')].map(gd => [
  gd.data ? gd.data.length : -1,
  gd.data ? gd.data.reduce((n, t) => n + (t.x ? t.x.length : 0), 0) : -1,
  Math.round(gd.getBoundingClientRect().width),
  gd.closest('.jp-OutputArea-output')?.innerText.includes('Live memory of the tracked step') ?? false,
])"""


def _increases(counts: list[int]) -> int:
    return sum(1 for a, b in zip(counts, counts[1:], strict=False) if b > a)


@pytest.fixture
def lab(chromium, tmp_path):
    """Start a JupyterLab serving a temporary folder with a copy of notebook 06: ``lab()`` or ``lab(startup=code)``."""
    servers: list[Lab] = []

    def start(startup: str | None = None) -> Lab:
        root, home = tmp_path / "root", tmp_path / "home"
        root.mkdir()
        home.mkdir()
        shutil.copy(NOTEBOOK, root / NOTEBOOK.name)
        servers.append(Lab(root, home, startup))
        servers[-1].wait_ready()
        return servers[-1]

    yield start
    for server in servers:
        server.stop()


def _open(chromium, lab: Lab, name: str):
    """A page with notebook ``name`` open, its kernel idle; the page's errors collected in ``page.errors``."""
    page = chromium.new_page(viewport={"width": 1280, "height": 900})
    page.errors = []  # the page's own errors, said when an assertion fails
    page.on("pageerror", lambda e: page.errors.append(f"pageerror: {e}"))
    page.on("console", lambda m: m.type == "error" and page.errors.append(f"console: {m.text[:300]}"))
    # A workspace of its own: JupyterLab would reopen the notebooks of the page before beside it
    page.goto(f"{lab.url}/lab/workspaces/{uuid.uuid4().hex[:8]}/tree/{name}?token={lab.token}")
    page.wait_for_function("window.jupyterapp && window.jupyterapp.shell.currentWidget", timeout=60_000)
    page.wait_for_selector(".jp-Notebook .jp-Cell", timeout=60_000)
    deadline = time.monotonic() + 60
    while not any(s["path"].endswith(name) for s in lab.api("/api/sessions") or []) and time.monotonic() < deadline:
        time.sleep(0.5)
    lab.wait_kernel_idle()
    page.wait_for_function(
        "window.jupyterapp.shell.currentWidget.sessionContext?.session?.kernel?.status === 'idle'", timeout=60_000
    )
    return page


# The page's CPU slowed this much (Chrome's throttling) while Run All shows the app, with
# MEMKIT_BROWSER_THROTTLE=6: how the app's figures were left blank for good is timing (figures.py: anywidget drops
# every update to a widget whose page code took over 2 s to load, and a busy page loads plotly's 5 MB in more than
# that). Unthrottled, plotly's own FigureWidget stayed blank in 3 runs of 5 on a busy machine and 1 of 7 on a quieter
# one; throttled 6x, in 2 runs of 3. Throttled runs take 3 minutes, so CI runs unthrottled.
THROTTLE = int(os.environ.get("MEMKIT_BROWSER_THROTTLE", "1"))
CODE_CELLS = sum(c["cell_type"] == "code" for c in json.loads(NOTEBOOK.read_text())["cells"])


def _run_all_throttled(page, lab: Lab) -> list:
    """Run All with the page's CPU throttled until the app's figures drew (or 3 minutes); their traces then."""
    cdp = page.context.new_cdp_session(page)
    if THROTTLE > 1:
        cdp.send("Emulation.setCPUThrottlingRate", {"rate": THROTTLE})
    try:
        _start_run_all(page)
        page.wait_for_function(LIVE_DRAWN_JS, timeout=180_000)
    except Exception as e:  # playwright's TimeoutError: left blank
        if "Timeout" not in type(e).__name__:
            raise
    finally:
        traces = page.evaluate(APP_TRACES_JS)
        cdp.send("Emulation.setCPUThrottlingRate", {"rate": 1})
    _wait_all_ran(page, lab)
    return traces


# The traces of each plotly figure in the app (-1: not drawn yet), and "the live figure drew"
APP_TRACES_JS = """() => {
  const app = [...document.querySelectorAll('.jp-OutputArea-output')]
    .find(o => o.innerText.includes('Live memory of the tracked step'));
  return app ? [...app.querySelectorAll('.js-plotly-plot')].map(gd => gd.data ? gd.data.length : -1) : [];
}"""
LIVE_DRAWN_JS = f"() => (({APP_TRACES_JS})()[0] || 0) > 0"


def test_playground_notebook_runs_and_the_app_updates_live_in_a_browser(chromium, lab, tmp_path):
    server = lab()
    page = _open(chromium, server, NOTEBOOK.name)
    try:
        traces = _run_all_throttled(page, server)
        assert traces and traces[0] > 0, f"the app's live figure stayed blank on a busy page: traces {traces}"
        _check_the_app(page, tmp_path)
    except Exception as e:
        e.add_note("page errors:\n" + "\n".join(page.errors[-20:]))
        e.add_note(f"plots (traces, points, width): {page.evaluate(PLOTS_JS)}")
        raise
    finally:
        page.close()


# plotly's own FigureWidget in the app's place (a kernel startup file swaps the class), on demand: blank means the
# page provoked the race, so the run of the test above on the same kind of page did prove the fix.
CONTROL = (
    "import plotly.graph_objects as go\n"
    "import memkit.widgets.figures as f\n"
    "f.live_figure_class = lambda: go.FigureWidget\n"
)


@pytest.mark.skipif(
    os.environ.get("MEMKIT_BROWSER_CONTROL") != "1",
    reason="the control (is plotly's own FigureWidget left blank on the same page?) runs with MEMKIT_BROWSER_CONTROL=1 "
    "(and MEMKIT_BROWSER_THROTTLE=6)",
)
def test_control_plotlys_own_figurewidget_stays_blank_on_the_same_busy_page(chromium, lab):
    server = lab(startup=CONTROL)
    page = _open(chromium, server, NOTEBOOK.name)
    try:
        traces = _run_all_throttled(page, server)
        assert traces and traces[0] <= 0, f"plotly's FigureWidget drew ({traces}): the race did not happen this run"
    finally:
        page.close()


def _start_run_all(page) -> None:
    """Run All, once the notebook's code cells are all on the page."""
    page.wait_for_function(
        f"() => document.querySelectorAll('.jp-Notebook .jp-CodeCell').length === {CODE_CELLS}", timeout=60_000
    )
    page.evaluate("window.jupyterapp.commands.execute('runmenu:run-all')")


def _wait_all_ran(page, lab: Lab) -> None:
    """Returns when each code cell has run and none failed."""
    # Every code cell numbered (none waiting as [*] or never run), the kernel idle.
    page.wait_for_function(
        """() => {
          const prompts = [...document.querySelectorAll('.jp-Notebook .jp-CodeCell .jp-InputPrompt')];
          return prompts.length > 0 && prompts.every(p => /\\[\\d+\\]/.test(p.innerText));
        }""",
        timeout=240_000,
    )
    lab.wait_kernel_idle()
    errors = page.locator(".jp-OutputArea-output[data-mime-type='application/vnd.jupyter.error']")
    assert errors.count() == 0, errors.first.inner_text()


def _check_the_app(page, tmp_path: Path) -> None:
    app = page.locator(".jp-OutputArea-output").filter(has_text="Live memory of the tracked step")
    assert app.count() == 1
    app.scroll_into_view_if_needed()
    assert app.locator(".js-plotly-plot").count() >= 2  # the live figure and the comparison figure render
    panel = app.locator(".widget-vbox").filter(has=page.get_by_role("checkbox", name="checkpointing")).last
    assert panel.get_by_role("checkbox", name="checkpointing").is_checked()  # as the notebook left it
    # the pattern field (a combobox: a text input with the registry's patterns as suggestions), typed as a person does
    pattern = panel.locator("input[list]").first
    pattern.fill(PATTERN)
    pattern.press("Enter")
    # The kernel got the value: the panel's status line shows the config the state now builds.
    panel.get_by_text(f"→ checkpointing:{PATTERN}").wait_for(timeout=30_000)

    # In view, as a person watching it: plotly draws a figure once it is on screen.
    live = app.locator(".js-plotly-plot").first
    live.scroll_into_view_if_needed()
    # Drawn after Run All (it stayed blank for good when the page took over 2 s to load plotly's code: figures.py)
    page.wait_for_function("gd => gd.data && gd.data.length > 0", arg=live.element_handle(), timeout=60_000)
    app.evaluate(WATCH_JS % f"checkpointing:{PATTERN}")
    # (by its text: the icon's glyph is part of the button's accessible name)
    app.locator("button.widget-button").filter(has_text="Run").click()
    page.wait_for_function("window.__memkit.tableAt !== null", timeout=240_000)
    app.get_by_text("Run: done").wait_for(timeout=30_000)
    watch = page.evaluate("clearInterval(window.__memkit.timer), window.__memkit")
    before_table = watch["seen"][: watch["tableAt"]]
    # The live timeline was redrawn while the run went on, before the table landed: a tracked window starts small and
    # grows. Point counts are of the decimated figure, which keeps the peak exactly but may draw fewer points as the
    # timeline grows (9,745 then 8,058 points): redraws are counted, and one growth (counting two was flaky).
    assert len(before_table) >= 3 and _increases(before_table) >= 1, watch["seen"]

    variants = app.locator(".memkit-table thead th").all_inner_texts()  # a column per variant
    assert [v.strip() for v in variants if v.strip()] == ["baseline", f"checkpointing:{PATTERN}"]
    assert app.locator(".memkit-table").inner_text().count("✓ pass") == 2  # outputs and gradients as the baseline

    # A GPU chosen in its menu, then Estimate: the verdict lands beside the timeline, which gains the card's usable
    # bytes as a line (the kernel side is tests/test_widgets.py; here, that the page shows it)
    card = "NVIDIA GeForce RTX 4090"
    app.locator("select").filter(has=page.locator("option", has_text=card)).select_option(label=card)
    app.locator("button.widget-button").filter(has_text="Estimate").click()
    verdicts = app.get_by_text(f"fits on {card}")
    verdicts.first.wait_for(timeout=240_000)
    assert verdicts.count() == 2  # one a variant: the baseline and the checkpointed one
    assert all("reserved bytes" in v for v in verdicts.all_inner_texts())
    page.wait_for_function(
        "([gd, name]) => gd.data && gd.data.some(t => t.name === name)",
        arg=[live.element_handle(), f"{card}: usable"],
        timeout=60_000,
    )
    # The live legend as drawn after three redraws with different traces (the pre-run blank, Run's timeline, the
    # judged estimate): each name once (it once listed parameter, optimizer_state and input twice)
    legend = live.evaluate("gd => [...gd.querySelectorAll('.legend .legendtext')].map(e => e.textContent)")
    assert legend and len(legend) == len(set(legend)), legend

    table = app.locator(".memkit-table")  # every column in view, none behind a scroll bar
    assert table.evaluate("el => el.scrollWidth <= el.clientWidth + 1"), table.evaluate(
        "el => [el.scrollWidth, el.clientWidth]"
    )
    wide = page.evaluate(
        """() => [...document.querySelectorAll('.jp-OutputArea-output')]
              .filter(o => o.scrollWidth > o.clientWidth + 1)
              .map(o => [o.scrollWidth, o.clientWidth, o.innerText.slice(0, 80)])"""
    )
    assert wide == [], f"outputs wider than the notebook: {wide}"

    # The whole app on screen (JupyterLab scrolls inside the page, so an element taller than the window would be
    # cut): a window as tall as the app, the app at its top.
    height = app.evaluate("el => el.getBoundingClientRect().height")
    page.set_viewport_size({"width": 1280, "height": int(height) + 200})
    app.evaluate("el => el.scrollIntoView({block: 'start'})")
    page.wait_for_timeout(1000)  # plotly redraws at the new size
    shot = tmp_path / "playground.png"
    app.screenshot(path=str(shot))
    assert shot.stat().st_size > 10_000
    if os.environ.get("MEMKIT_SCREENSHOT_DIR"):
        out = Path(os.environ["MEMKIT_SCREENSHOT_DIR"])
        out.mkdir(parents=True, exist_ok=True)
        shutil.copy(shot, out / "playground.png")
