"""The notebook face as people see it: a real JupyterLab in headless Chromium.

The test starts a JupyterLab server on 127.0.0.1 (free port, a token, a temporary root folder holding a
copy of ``examples/torch_quickstart.ipynb``) and drives Debian's ``chromium`` through ``chromedriver``
(Selenium), clicking and typing as a user does:

1. open the notebook and *Run > Run All Cells*;
2. the ``%keepalive status`` widget renders, with its two bars, and its numbers change (the DOM is
   read twice, one refresh apart) while the training cell runs; the training's epoch bar fits its
   cell (a short label, a bar of real width, its rate not cut off);
3. once the run has a committed checkpoint, the kernel process (found through the server's
   ``/api/sessions`` and the kernel's connection file) is SIGKILLed mid-training; JupyterLab says the
   kernel died and restarts it;
4. the user selects the training cell, *Run > Run All Above Selected Cell* (install, Drive,
   ``%load_ext keepalive`` + the panel, setup), types ``%resume_training`` into a new cell at the end
   and runs it: the page shows ``resuming run 'torch-quickstart' from ...`` and the remaining epochs.
   The run is written to an explicit folder outside the checkpoint dir (the README's form): the
   panel shown after the restart lists it, found through the index of runs, and
   ``%resume_training`` finds it there too.

Screenshots of the panel and of the resumed run are written to the test's temporary folder, and also
to ``$SCREENSHOTS_DIR`` when that is set (``SCREENSHOTS_DIR=docs bash scripts/test.sh
tests/test_browser.py`` refreshes the README's pictures). Every server and browser started here is
stopped by its PID in fixture teardown. The test is skipped only when chromium / chromedriver are not
installed (``scripts/test.sh`` installs Debian's ``chromium`` and ``chromium-driver``).
"""
from __future__ import annotations

import json
import os
import queue
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Callable, Dict, Iterator, List, Optional, TypeVar

import pytest

pytest.importorskip("torch")
pytest.importorskip("jupyterlab")
pytest.importorskip("ipywidgets")
webdriver = pytest.importorskip("selenium.webdriver")

from selenium.common.exceptions import StaleElementReferenceException  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.common.keys import Keys  # noqa: E402

from kernelkit import kernelspec  # noqa: E402  (tests/kernelkit.py)
from servers import HOST, free_port  # noqa: E402  (tests/servers.py)

REPO = Path(__file__).resolve().parent.parent
EXAMPLE = REPO / "examples" / "torch_quickstart.ipynb"
RUN = "torch-quickstart"
EPOCHS = 6
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(300),
    pytest.mark.skipif(not (CHROMIUM and CHROMEDRIVER),
                       reason="Debian's chromium and chromium-driver are not installed and could not be "
                              "(scripts/test.sh installs them with apt-get)"),
]

T = TypeVar("T")


def wait_for(what: str, probe: Callable[[], Optional[T]], timeout: float = 60.0, every: float = 0.25) -> T:
    """Poll ``probe`` until it returns something truthy; fail naming ``what`` after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    last_error: Optional[BaseException] = None
    while time.monotonic() < deadline:
        try:
            value = probe()
        except (StaleElementReferenceException, OSError) as exc:  # the page or a file moved under us
            value, last_error = None, exc
        if value:
            return value
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}"
                         + (f" (last error: {last_error!r})" if last_error else ""))


# ------------------------------------------------------------------------------------- notebook
def quickstart_notebook(path: Path, run_dir: Path) -> None:
    """The quick-start example, slowed down so that a person (and this test) can watch it train.

    Three edits, each checked: more epochs, a short sleep after each optimizer step, and the run
    written to the folder ``run_dir`` outside the checkpoint dir (the README's own form,
    ``DriveCheckpoint("/content/drive/MyDrive/runs/x", ...)``: the status panel must find it through
    the index of runs). The kernel is the test interpreter's (``tests/kernelkit.py``)."""
    nb = json.loads(EXAMPLE.read_text())
    sources = ["".join(c["source"]) if isinstance(c["source"], list) else c["source"] for c in nb["cells"]]
    setup = [i for i, s in enumerate(sources) if re.search(r"^EPOCHS = \d+$", s, re.M)]
    train = [i for i, s in enumerate(sources) if "ckpt.batches(" in s and "opt.step()" in s]
    assert len(setup) == 1 and len(train) == 1, (
        f"{EXAMPLE.name} changed (no single setup cell with 'EPOCHS = N' and training cell with "
        "ckpt.batches / opt.step()): update quickstart_notebook() in tests/test_browser.py")
    sources[setup[0]] = "import time\n" + re.sub(r"^EPOCHS = \d+", f"EPOCHS = {EPOCHS}", sources[setup[0]],
                                                 flags=re.M)
    sources[train[0]] = re.sub(
        r"^(\s*)opt\.step\(\)\n", r"\g<0>\1time.sleep(0.25)  # slow enough to watch (browser test)\n",
        sources[train[0]], count=1, flags=re.M)
    named = f'DriveCheckpoint(run="{RUN}",'
    assert sources[train[0]].count(named) == 1, f"{EXAMPLE.name}: the training cell no longer has {named}"
    sources[train[0]] = sources[train[0]].replace(named, f"DriveCheckpoint({str(run_dir)!r},")
    for cell, source in zip(nb["cells"], sources):
        cell["source"] = source
        if cell["cell_type"] == "code":
            cell["outputs"], cell["execution_count"] = [], None
    nb["metadata"]["kernelspec"] = {"name": kernelspec(), "display_name": "keepalive tests",
                                    "language": "python"}
    path.write_text(json.dumps(nb, indent=1))


# ----------------------------------------------------------------------------------- processes
def descendants(pid: int) -> List[int]:
    """PIDs of every live process below ``pid`` (read from /proc)."""
    children: Dict[int, List[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def stop_pids(pids: List[int], grace: float = 5.0) -> None:
    """SIGTERM each live PID, then SIGKILL what is still alive after ``grace`` seconds."""
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 2.0)):
        live = [p for p in pids if alive(p)]
        for pid in live:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + wait
        while any(alive(p) for p in live) and time.monotonic() < deadline:
            time.sleep(0.1)


class Lab:
    """A JupyterLab server on 127.0.0.1 with a token and a private root, config and runtime folder."""

    def __init__(self, base: Path):
        self.root = base / "root"
        self.checkpoints = base / "checkpoints"
        self.drive = base / "drive" / "runs"  # runs opened with an explicit path
        self.runtime = base / "runtime"
        self.port = free_port()
        self.token = secrets.token_hex(16)
        self.url = f"http://{HOST}:{self.port}"
        self.log_path = base / "jupyterlab.log"
        for d in (self.root, self.checkpoints, self.runtime, base / "config", base / "data",
                  base / "workspaces", base / "ipython"):
            d.mkdir(parents=True, exist_ok=True)
        settings = base / "settings" / "@jupyterlab" / "apputils-extension"
        settings.mkdir(parents=True)
        # no "news / updates?" notification over the notebook
        (settings / "notification.jupyterlab-settings").write_text(
            json.dumps({"fetchNews": "false", "checkForUpdates": False}))
        kernelspec()  # puts the test interpreter's kernelspec on JUPYTER_PATH (inherited below)
        self.env = dict(os.environ)
        self.env.update({
            "JUPYTER_CONFIG_DIR": str(base / "config"), "JUPYTER_RUNTIME_DIR": str(self.runtime),
            "JUPYTER_DATA_DIR": str(base / "data"), "JUPYTERLAB_SETTINGS_DIR": str(base / "settings"),
            "JUPYTERLAB_WORKSPACES_DIR": str(base / "workspaces"), "IPYTHONDIR": str(base / "ipython"),
            # inherited by the kernels: checkpoints in the test's folder; a 45 min session begun 12 min
            # ago and a 30 min idle timeout, so the panel's bars and numbers move second by second
            "KEEPALIVE_DIR": str(self.checkpoints), "KEEPALIVE_SPOOL": str(base / "spool"),
            "KEEPALIVE_BUDGET": "45min", "KEEPALIVE_IDLE": "30min",
            "KEEPALIVE_SESSION_START": str(int(time.time() - 12 * 60)),
            # the epoch bar (it shows where a session limit is set; the tests' environment turns bars off)
            "KEEPALIVE_PROGRESS": "1",
            "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "MPLBACKEND": "Agg",
        })
        self.proc: Optional[subprocess.Popen] = None
        self.kernel_pids: List[int] = []

    def start(self) -> None:
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "jupyterlab", "--no-browser", f"--ServerApp.ip={HOST}",
                 f"--ServerApp.port={self.port}", "--ServerApp.port_retries=0",
                 f"--IdentityProvider.token={self.token}", f"--ServerApp.root_dir={self.root}",
                 "--ServerApp.allow_remote_access=False", "--LabApp.news_url=None",
                 "--ServerApp.terminals_enabled=False", "--LabApp.extension_manager=readonly",
                 "--allow-root"],
                cwd=self.root, env=self.env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
        wait_for("JupyterLab to answer /api/status", self._answers, timeout=90)

    def _answers(self) -> bool:
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise AssertionError(f"jupyter lab exited with {self.proc.returncode}:\n{self.log()}")
        try:
            self.api("status")
        except OSError:
            return False
        return True

    def api(self, path: str):
        req = urllib.request.Request(f"{self.url}/api/{path}", headers={"Authorization": f"token {self.token}"})
        with urllib.request.urlopen(req, timeout=5) as resp:
            return json.loads(resp.read())

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-4000:]
        except OSError:
            return ""

    def kernel_state(self, notebook: str) -> str:
        """The server's execution state of the kernel of ``notebook`` (idle, busy, starting, ...)."""
        sessions = [s for s in self.api("sessions") if s.get("path") == notebook]
        return str(sessions[0]["kernel"].get("execution_state", "")) if len(sessions) == 1 else ""

    def connection_file(self, notebook: str) -> Path:
        """The connection file of the kernel of ``notebook`` (its id from /api/sessions). It keeps its
        name and ports across the server's automatic restarts: the ports are held by jupyter_client's
        port cache, so "restarting kernel (1/5), new random ports" changes neither."""
        sessions = [s for s in self.api("sessions") if s.get("path") == notebook]
        assert len(sessions) == 1, f"sessions for {notebook}: {sessions}"
        return self.runtime / f"kernel-{sessions[0]['kernel']['id']}.json"

    def kernel_pid(self, notebook: str) -> int:
        """The PID of the kernel of ``notebook``: the process below the server whose command line
        names that kernel's connection file."""
        connection_file = self.connection_file(notebook).name
        assert self.proc is not None
        for pid in descendants(self.proc.pid):
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    argv = f.read().split(b"\0")
            except OSError:
                continue
            if any(a.decode(errors="replace").endswith(connection_file) for a in argv):
                if pid not in self.kernel_pids:
                    self.kernel_pids.append(pid)
                return pid
        raise AssertionError(f"no process runs the kernel with {connection_file}")

    def kernel_answers(self, notebook: str, timeout: float = 10.0) -> bool:
        """Whether the kernel of ``notebook`` answers a ``kernel_info_request`` on its shell channel,
        asked by a client of our own through its connection file (its shell socket only, in a zmq
        context of its own: both closed before returning, no thread or process left behind).

        This, not the ``execution_state`` of /api/sessions, says that a restarted kernel is up.
        jupyter_server sets that state only from the IOPub status messages its own subscriber sees:
        those answering a "tracked" request (execute, comm, ...: not kernel_info), or the first one
        after ``starting``. After the restarter's automatic restart nothing resets the dead kernel's
        last state (``busy``, it was training), and the new kernel's single ``starting`` message is
        published while the server's subscriber is re-subscribing to the same port: when it is lost
        (a race, lost more often on a loaded machine) the state stays ``busy`` until someone runs a
        cell, and so forever for a test that waits for ``idle`` before running one."""
        import zmq
        from jupyter_client import BlockingKernelClient

        context = zmq.Context()
        try:
            client = BlockingKernelClient(connection_file=str(self.connection_file(notebook)), context=context)
            try:
                client.load_connection_file()
            except ValueError:  # read while being written
                return False
            client.start_channels(shell=True, iopub=False, stdin=False, hb=False, control=False)
            try:
                msg_id = client.kernel_info()
                deadline = time.monotonic() + timeout
                while time.monotonic() < deadline:
                    try:
                        reply = client.get_shell_msg(timeout=max(0.1, deadline - time.monotonic()))
                    except queue.Empty:
                        return False
                    if reply.get("parent_header", {}).get("msg_id") == msg_id:
                        return reply["content"].get("status") == "ok"
                return False
            finally:
                client.shell_channel.stop()
        finally:
            context.destroy(linger=0)

    def stop(self) -> None:
        if self.proc is None:
            return
        pids = descendants(self.proc.pid)  # kernels first noted now: the server may leave none behind
        stop_pids([self.proc.pid])
        stop_pids(pids + self.kernel_pids, grace=2.0)
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass


@pytest.fixture
def lab() -> Iterator[Lab]:
    # a short folder name: the page (and so the screenshots) shows the checkpoint paths
    base = Path(tempfile.mkdtemp(prefix="kb-"))
    server = Lab(base)
    try:
        server.start()
        yield server
    finally:
        server.stop()
        shutil.rmtree(base, ignore_errors=True)


@pytest.fixture
def browser() -> Iterator["webdriver.Chrome"]:
    """Headless Chromium driven by chromedriver; both (and every process below them) stopped by PID."""
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--window-size=1280,1000", "--force-device-scale-factor=1", "--no-first-run",
                "--disable-extensions", "--disable-background-networking", "--disable-sync",
                "--disable-default-apps", "--mute-audio", "--hide-scrollbars"):
        options.add_argument(arg)
    service = webdriver.ChromeService(executable_path=CHROMEDRIVER)
    driver = webdriver.Chrome(service=service, options=options)  # installed but not starting: a failure
    driver_pid = service.process.pid
    try:
        yield driver
    finally:
        pids = descendants(driver_pid)
        try:
            driver.quit()
        except Exception:  # noqa: BLE001 - the PIDs below are stopped whatever happened
            pass
        stop_pids(pids + [driver_pid], grace=3.0)


# ------------------------------------------------------------------------------------ the page
class Page:
    """What a JupyterLab user sees and does, on one open notebook."""

    def __init__(self, driver, name: str):
        self.driver = driver
        self.name = name

    def cells(self):
        return self.driver.find_elements(By.CSS_SELECTOR, ".jp-NotebookPanel:not(.lm-mod-hidden) .jp-Cell")

    def code_cells(self):
        return [c for c in self.cells() if "jp-CodeCell" in (c.get_attribute("class") or "")]

    def cell_source(self, cell) -> str:
        return cell.find_element(By.CSS_SELECTOR, ".cm-content").text

    def cell_with(self, text: str):
        found = [c for c in self.code_cells() if text in self.cell_source(c)]
        assert len(found) == 1, f"{len(found)} code cells contain {text!r}"
        return found[0]

    def output_text(self, cell) -> str:
        return "\n".join(o.text for o in cell.find_elements(By.CSS_SELECTOR, ".jp-OutputArea-output"))

    def prompt(self, cell) -> str:
        """The cell's execution prompt: ``[ ]:`` never run, ``[*]:`` queued or running, ``[3]:`` done."""
        return cell.find_element(By.CSS_SELECTOR, ".jp-InputPrompt").text.strip()

    def kernel_status(self) -> str:
        ind = self.driver.find_elements(By.CSS_SELECTOR, ".jp-NotebookPanel:not(.lm-mod-hidden) "
                                                         ".jp-Notebook-ExecutionIndicator")
        return (ind[0].get_attribute("data-status") or "") if ind else ""

    def menu(self, menu: str, command: str) -> None:
        """Click ``menu`` in the menu bar, then the item that runs ``command``."""
        items = [m for m in self.driver.find_elements(By.CSS_SELECTOR, ".lm-MenuBar-item")
                 if m.text.strip() == menu]
        assert items, f"no menu {menu!r}"
        items[0].click()
        entry = wait_for(f"menu item {command}", lambda: [
            e for e in self.driver.find_elements(By.CSS_SELECTOR, f'.lm-Menu-item[data-command="{command}"]')
            if e.is_displayed()], timeout=10)
        entry[0].click()

    def select(self, cell) -> None:
        """Make ``cell`` the active cell (a click on its prompt, as a user does), in command mode."""
        self.driver.execute_script("arguments[0].scrollIntoView({block: 'center'});", cell)
        cell.find_element(By.CSS_SELECTOR, ".jp-InputPrompt").click()
        wait_for("the cell to become active", lambda: "jp-mod-active" in (cell.get_attribute("class") or ""),
                 timeout=10)

    def keys(self, *keys: str) -> None:
        webdriver.ActionChains(self.driver).send_keys(*keys).perform()

    def shift_enter(self) -> None:
        """Run the active cell (and select the next), as Shift+Enter does."""
        webdriver.ActionChains(self.driver).key_down(Keys.SHIFT).send_keys(Keys.ENTER).key_up(Keys.SHIFT).perform()

    def status_panel(self):
        """The newest ``%keepalive status`` widget on the page."""
        panels = self.driver.find_elements(By.CSS_SELECTOR, ".jp-OutputArea-output .widget-vbox")
        panels = [p for p in panels if "keepalive" in p.text and p.find_elements(By.CSS_SELECTOR, ".progress")]
        return panels[-1] if panels else None

    def progress_bar(self, cell, unit: str) -> Optional[Dict[str, object]]:
        """The newest tqdm bar in ``cell``'s output whose text names ``unit`` (tqdm's widget: a label,
        the bar, a text), measured as drawn: widths in pixels, whether its text is cut off."""
        found = self.driver.execute_script("""
            const bars = [...arguments[0].querySelectorAll('.jp-OutputArea-output .widget-hprogress')];
            const out = [];
            for (const bar of bars) {
              const box = bar.parentElement, parts = [...box.children];
              const i = parts.indexOf(bar), label = parts[i - 1], text = parts[i + 1];
              if (!label || !text || !text.textContent.includes(arguments[1])) continue;
              const area = bar.closest('.jp-OutputArea-output').getBoundingClientRect();
              const inner = text.querySelector('*') || text;
              out.push({label: label.textContent.trim(), text: text.textContent.trim(),
                        bar: bar.getBoundingClientRect().width, area: area.width, area_right: area.right,
                        right: text.getBoundingClientRect().right,
                        clipped: inner.scrollWidth > inner.clientWidth + 1 || text.scrollWidth > text.clientWidth + 1});
            }
            return out.length ? out[out.length - 1] : null;""", cell, unit)
        return found or None

    def read_panel(self) -> Dict[str, object]:
        """The panel's bars (fill in %) and captions, as the page shows them now."""
        panel = self.status_panel()
        assert panel is not None, "no status panel on the page"
        fills = [self.driver.execute_script(
            "const b = arguments[0].querySelector('.progress-bar');"
            "return b.getBoundingClientRect().width / arguments[0].getBoundingClientRect().width * 100;", p)
            for p in panel.find_elements(By.CSS_SELECTOR, ".progress")]
        labels = [e.text for e in panel.find_elements(By.CSS_SELECTOR, ".widget-hbox .widget-label")
                  if e.text and e.text not in ("session left", "idle margin")]
        return {"text": panel.text, "fills": fills, "captions": labels}


def session_left(panel: Dict[str, object]) -> int:
    """Seconds left in the session, from the caption of the panel's session bar."""
    captions = panel["captions"]
    assert isinstance(captions, list) and captions, panel
    m = re.match(r"(\d+) min (\d+) s left", captions[0])
    assert m, f"unexpected session caption {captions[0]!r}"
    return int(m.group(1)) * 60 + int(m.group(2))


def shoot(element, name: str, tmp_path: Path) -> Path:
    """A PNG of ``element`` into the test's folder (and ``$SCREENSHOTS_DIR`` when set)."""
    out = tmp_path / name
    assert element.screenshot(str(out)), f"screenshot {name} failed"
    try:  # a palette PNG: a third of the size, the same to the eye
        from PIL import Image
    except ImportError:
        pass
    else:
        with Image.open(out) as image:
            small = image.convert("RGB").quantize(colors=128)
        small.save(out, optimize=True)
    target = os.environ.get("SCREENSHOTS_DIR")
    if target:
        dest = Path(target) if os.path.isabs(target) else REPO / target
        dest.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(out, dest / name)
    return out


# ------------------------------------------------------------------------------------- the test
def test_status_widget_kill_and_resume_in_jupyterlab(lab: Lab, browser, tmp_path: Path) -> None:
    try:
        _story(lab, browser, tmp_path)
    except BaseException:
        try:  # what the page looked like, for the failure report
            browser.save_screenshot(str(tmp_path / "failure.png"))
            print(f"page at the failure: {tmp_path / 'failure.png'}\n--- jupyter lab log:\n{lab.log()}")
        except Exception:  # noqa: BLE001
            pass
        raise


def _story(lab: Lab, browser, tmp_path: Path) -> None:
    started = time.monotonic()
    timeline: List[str] = []

    def mark(what: str) -> None:
        timeline.append(f"{what} {time.monotonic() - started:.0f} s")

    name = "torch_quickstart.ipynb"
    quickstart_notebook(lab.root / name, lab.drive / RUN)
    browser.get(f"{lab.url}/lab/tree/{name}?token={lab.token}")
    page = Page(browser, name)
    wait_for("the notebook and its kernel", lambda: len(page.code_cells()) >= 6 and page.kernel_status() == "idle",
             timeout=90)
    # collapse the file browser (a click on its tab in the left bar): the notebook gets the width
    tabs = browser.find_elements(By.CSS_SELECTOR, ".jp-SideBar.jp-mod-left .lm-TabBar-tab.lm-mod-current")
    if tabs:
        tabs[0].click()
    train_cell = page.cell_with("ckpt.epochs(EPOCHS)")
    status_cell = page.cell_with("%keepalive status")
    mark("notebook open")

    # 1. Run > Run All Cells; the panel renders with its two bars
    page.menu("Run", "runmenu:run-all")
    wait_for("the status widget", page.status_panel, timeout=60)
    first = page.read_panel()
    mark("panel shown")
    assert len(first["fills"]) == 2, first  # session left, idle margin
    assert "platform" in str(first["text"]) and "left of 45 min" in str(first["text"]), first
    assert all(0.0 < float(f) <= 100.0 for f in first["fills"]), first

    # 2. the numbers move while the training runs (time bars refresh every 5 s)
    wait_for("the training cell to print an epoch", lambda: "epoch 1/" in page.output_text(train_cell), timeout=90)
    # the session clock runs down (the idle caption may change first, in the same second: not enough)
    second = wait_for("the panel's session time to go down", lambda: (
        lambda now: now if session_left(now) < session_left(first) else None)(page.read_panel()), timeout=30)
    assert second["fills"][0] <= first["fills"][0], (first, second)  # and so does its bar
    mark("panel refreshed")
    # the epoch bar fits its cell: a short label (the run's name), a bar of real width, the rate shown
    bar = wait_for("the epoch bar", lambda: page.progress_bar(train_cell, "epoch"), timeout=60)
    assert bar["label"].startswith(RUN) and len(bar["label"]) < 40, bar
    assert bar["bar"] >= 0.25 * bar["area"], bar
    assert not bar["clipped"] and bar["right"] <= bar["area_right"] + 1, bar

    # 3. a committed checkpoint, the run not finished: kill the kernel process
    from keepalive.runs import find_runs

    def unfinished_run():
        runs = [r for r in find_runs(str(lab.drive)) if r.run == RUN and r.newest is not None]
        return runs[0] if runs and runs[0].unfinished else None

    run = wait_for("a committed checkpoint", unfinished_run, timeout=60)
    assert f"epoch {EPOCHS}/{EPOCHS}" not in page.output_text(train_cell), "training ended before the kill"
    killed_pid = lab.kernel_pid(name)
    os.kill(killed_pid, signal.SIGKILL)
    killed_at = run.where()
    mark("kernel killed")
    dialog = wait_for("JupyterLab's 'kernel restarting' dialog",
                      lambda: browser.find_elements(By.CSS_SELECTOR, ".jp-Dialog"), timeout=30)
    assert "restart" in dialog[0].text.lower() or "died" in dialog[0].text.lower(), dialog[0].text
    dialog[0].find_element(By.CSS_SELECTOR, ".jp-Dialog-button.jp-mod-accept").click()  # its only button: "Ok"
    # A new kernel process, and it answers. Neither the server's execution_state (it can keep the dead
    # kernel's "busy": see Lab.kernel_answers) nor the page's indicator (it can stay "unknown" until an
    # IOPub status reaches it) is waited for: the page holds the cells run below until its reconnected
    # kernel connection has the new kernel's kernel_info reply.
    seen: Dict[str, object] = {}

    def restarted() -> bool:
        try:
            seen["pid"] = pid = lab.kernel_pid(name)
        except AssertionError as exc:  # between the old process and the new one
            seen["pid"] = str(exc)
            return False
        if pid == killed_pid:
            return False
        seen["answers"] = lab.kernel_answers(name)
        return bool(seen["answers"])

    try:
        wait_for("the restarted kernel", restarted, timeout=120)
    except AssertionError as exc:
        raise AssertionError(f"{exc}; killed PID {killed_pid}, last seen {seen}, server state "
                             f"{lab.kernel_state(name)!r}, page state {page.kernel_status()!r}") from None
    mark("kernel restarted")

    # 4. after the "reset": the setup cells, then %resume_training typed into a new last cell
    page.select(train_cell)
    page.menu("Run", "notebook:run-all-above")
    above = page.code_cells()[:page.code_cells().index(train_cell)]
    wait_for("the setup cells to finish", lambda: RUN in page.output_text(status_cell)  # ran again
             and all(page.prompt(c) not in ("[*]:", "[ ]:") for c in above), timeout=90)
    mark("setup cells run")
    announce = page.output_text(status_cell)
    assert RUN in announce, announce  # %load_ext names the unfinished run
    panel = page.status_panel()
    # the run lies outside the checkpoint dir: the panel lists it from the index of runs
    assert panel is not None and RUN in panel.text, "the panel lists the run's checkpoints"
    assert "elsewhere" in panel.text and "UNFINISHED" in panel.text and str(lab.drive / RUN) in panel.text, \
        panel.text
    panel_png = shoot(status_cell.find_element(By.CSS_SELECTOR, ".jp-Cell-outputArea"), "status-panel.png",
                      tmp_path)

    page.select(page.code_cells()[-1])
    page.keys("b")  # a new cell below, in command mode
    wait_for("the new cell", lambda: page.cell_source(page.code_cells()[-1]) == "", timeout=10)
    page.keys(Keys.ENTER)  # edit it
    page.keys("%resume_training")
    resume_cell = page.code_cells()[-1]
    page.shift_enter()  # runs it (and adds an empty cell below it, the last one)
    assert page.cell_source(resume_cell).strip() == "%resume_training"
    text = wait_for("the resume line", lambda: (lambda t: t if f"resuming run '{RUN}'" in t else None)(
        page.output_text(resume_cell)), timeout=90)
    assert f"run '{RUN}'" in text and "newest valid checkpoint" in text, text
    mark("resume line shown")
    done = wait_for("the resumed run to finish", lambda: (lambda t: t if f"epoch {EPOCHS}/{EPOCHS}" in t else None)(
        page.output_text(resume_cell)), timeout=90)
    # "from ...: at the end of epoch 1, step 80" at an epoch end, "in epoch 2 after 4 batches, ..." inside
    # one (epochs numbered from 0, as the loop's variable): the epochs completed before the resume
    resumed_from = re.search(rf"resuming run '{RUN}' from \S+: (?:at the end of epoch (\d+)|in epoch (\d+) after)",
                             done)
    completed = (int(resumed_from.group(1)) + 1 if resumed_from.group(1) is not None else int(resumed_from.group(2))
                 ) if resumed_from else 0
    assert resumed_from and completed >= 1, done
    resumed_epochs = [int(e) for e in re.findall(rf"^epoch (\d+)/{EPOCHS}:", done, re.M)]
    assert resumed_epochs == list(range(completed + 1, EPOCHS + 1)), done  # each once, none again
    assert "Error" not in done, done
    mark("resumed run finished")
    resume_png = shoot(resume_cell, "resumed-run.png", tmp_path)
    browser.save_screenshot(str(tmp_path / "page.png"))  # the whole window, for whoever debugs this test

    for png in (panel_png, resume_png):
        assert png.stat().st_size > 2000, f"{png.name} looks empty"
    final = [r for r in find_runs(str(lab.drive)) if r.run == RUN]
    assert final and final[0].finished, f"run not finished after the resume (killed at {killed_at})"
    print(f"browser test: killed at {killed_at}; " + ", ".join(timeline))
