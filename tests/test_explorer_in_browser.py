"""The plan explorer as a person sees it: a real JupyterLab on 127.0.0.1, a headless Chromium 1,000 px wide, a
notebook that plans Hugging Face GPT-2 for 8 × H100 with ``%%autoparallel``; the device count and the memory budget
are changed through the page, the notebook is saved, its kernel shut down and the page reloaded.

    .venv/bin/python -m pytest -q tests/test_explorer_in_browser.py          # about a minute
    NBTRAIN_SCREENSHOTS=docs/images .venv/bin/python -m pytest -q tests/test_explorer_in_browser.py
                                                   # the same, and refresh the pictures the docs show

Screenshots are saved under the test's temporary folder (and, with ``NBTRAIN_SCREENSHOTS``, copied there). The
browser, the server and the kernel never reach outside 127.0.0.1; the page's own network log is checked for it.
Without Chromium the tests are skipped on a developer's machine, and fail in CI (``CI`` set), whose ``.ci/run``
installs it.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import pytest

from tests.browser import browser_missing, chromium, jupyter_lab, requests_outside, wait_for

MISSING = browser_missing()
if MISSING and os.environ.get("CI"):
    raise RuntimeError(f"CI runs the browser tests: {MISSING}")
# alone: the redraw is timed (under 2 s), which a test running beside it in the other worker slows down
pytestmark = [pytest.mark.slow, pytest.mark.alone,
              pytest.mark.skipif(MISSING is not None, reason=f"no browser here: {MISSING}")]

CELL = """%%autoparallel --gpus 8 --gpu H100 --batch 32 --seq 1024
from transformers import GPT2Config, GPT2LMHeadModel
model = GPT2LMHeadModel(GPT2Config())"""


def _notebook(folder: Path) -> str:
    import nbformat

    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.cells = [nbformat.v4.new_code_cell("%load_ext nbtrain"), nbformat.v4.new_code_cell(CELL)]
    nbformat.write(nb, folder / "explorer.ipynb")
    return "explorer.ipynb"


class Page:
    """The notebook's page, read and used as a person would: menus, the explorer's controls, what is displayed."""

    def __init__(self, driver, shots: Path):
        from selenium.webdriver.common.by import By

        self.driver, self.by, self.shots = driver, By, shots

    def find(self, css: str, within=None):
        return (within or self.driver).find_elements(self.by.CSS_SELECTOR, css)

    def menu(self, top: str, item: str) -> None:
        [m for m in self.find(".lm-MenuBar-itemLabel") if m.text == top][0].click()
        wait_for(lambda: [i for i in self.find(".lm-Menu-itemLabel") if i.text == item], timeout=10,
                 what=f"the menu item {top} → {item}")[0].click()

    def open(self, url: str) -> None:
        self.driver.get(url)
        wait_for(lambda: self.find(".jp-Notebook .jp-Cell"), timeout=90, what="the notebook's cells")
        self.wait_idle()
        for tab in self.find(".jp-SideBar.jp-mod-left .lm-TabBar-tab.lm-mod-current"):
            tab.click()  # the file browser folded away: the notebook takes the page's width, as people work

    def wait_idle(self, timeout: float = 120) -> None:
        wait_for(lambda: "Idle" in self.driver.find_element(self.by.ID, "jp-main-statusbar").text,
                 timeout=timeout, what="the kernel to be idle")

    def explorer(self):
        return self.find(".nbtrain-explorer")[0]

    def part(self, name: str) -> str:
        return self.find(f".nbtrain-explorer .nbtrain-{name}")[0].text

    def chart_html(self) -> str:
        return self.find(".nbtrain-explorer .nbtrain-comparison")[0].get_attribute("innerHTML")

    def shown_outputs(self) -> list[str]:
        """The text of every output of the planning cell that is on screen."""
        area = self.find(".jp-OutputArea")[-1]
        return [child.text for child in self.find(".jp-OutputArea-child", area) if child.is_displayed()]

    def shot(self, name: str, element=None) -> Path:
        if element is not None:
            self.driver.execute_script("arguments[0].scrollIntoView()", element)
            time.sleep(0.3)
        path = self.shots / name
        self.driver.save_screenshot(str(path))
        return path


@pytest.fixture(scope="module")
def seen(tmp_path_factory):
    """What the page showed at each step of the session; the tests below each check one promise."""
    from selenium.webdriver.support.ui import Select

    folder = tmp_path_factory.mktemp("lab")
    shots = folder / "screenshots"
    shots.mkdir()
    notebook = _notebook(folder)
    seen = {}
    env = {"NBTRAIN_NONINTERACTIVE": "0", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    with jupyter_lab(folder, env) as lab, chromium(folder / "chromium-profile") as driver:
        page = Page(driver, shots)
        page.open(lab.url(notebook))
        page.menu("Run", "Run All Cells")
        wait_for(lambda: page.find(".nbtrain-explorer .nbtrain-comparison .nbtrain-chart"), timeout=240,
                 what="the plan explorer under the %%autoparallel cell")
        page.wait_idle()
        seen["opened"] = dict(outputs=page.shown_outputs(), explorers=len(page.find(".nbtrain-explorer")),
                              static_shown=[e.is_displayed() for e in page.find(".nbtrain-static")],
                              status=page.part("status"), summary=page.part("summary"), chart=page.chart_html(),
                              header_style=driver.execute_script(
                                  "const th = document.querySelector('.nbtrain-explorer .nbtrain-summary th');"
                                  "const s = getComputedStyle(th);"
                                  "return [s.borderBottomStyle, s.whiteSpace];"),
                              shot=page.shot("opened.png", page.explorer()))

        before = page.chart_html()
        changed = time.monotonic()
        Select(page.find(".nbtrain-explorer .nbtrain-devices select")[0]).select_by_visible_text("4")
        wait_for(lambda: "4 × H100" in page.part("status") and "planned in" in page.part("status")
                 and page.chart_html() != before, timeout=120, every=0.05, what="the explorer to replan for 4 devices")
        seen["four_devices"] = dict(status=page.part("status"), summary=page.part("summary"),
                                    chart=page.chart_html(), seconds=time.monotonic() - changed)

        statuses = []
        before = page.chart_html()
        page.find(".nbtrain-explorer .nbtrain-memory input")[0].send_keys("3GiB")  # one key at a time, as typed
        typed = time.monotonic()  # the box changed last here; the explorer waits for typing to pause (debounce_s)

        def replanned():
            statuses.append(page.part("status"))
            return "budget 3.00 GiB" in statuses[-1] and "planned in" in statuses[-1] and page.chart_html() != before
        wait_for(replanned, timeout=120, every=0.05, what="the explorer to replan for a 3 GiB budget")
        seen["three_gib"] = dict(status=page.part("status"), statuses=statuses, summary=page.part("summary"),
                                 memory=page.part("memory-bars"), chart=page.chart_html(),
                                 chart_text=page.part("comparison"), seconds=time.monotonic() - typed,
                                 shot=page.shot("plan-explorer.png", page.explorer()))
        seen["log"] = driver.get_log("browser")
        seen["outside"] = requests_outside(driver)

        page.menu("File", "Save Notebook")
        time.sleep(1)
        page.menu("Kernel", "Shut Down Kernel")
        time.sleep(2)
        page.open(lab.url(notebook))
        time.sleep(3)  # the widget manager gives up on the old kernel's widgets
        area = page.find(".jp-OutputArea")[-1]
        seen["reopened"] = dict(outputs=page.shown_outputs(), shot=page.shot("reopened.png", area))
    if target := os.environ.get("NBTRAIN_SCREENSHOTS"):
        Path(target).mkdir(parents=True, exist_ok=True)
        for shot in shots.iterdir():
            shutil.copy(shot, Path(target) / shot.name)
    return seen


def test_the_cell_shows_one_plan_the_explorer_opened_on_the_recommendation(seen):
    opened = seen["opened"]
    assert opened["explorers"] == 1
    assert opened["static_shown"] == [False]  # the static tables are in the outputs, for papermill, not on screen
    summary_line = opened["outputs"][0]  # printed first, above the explorer
    assert summary_line.startswith("recommended:") and "8 × H100" in summary_line
    recommended = opened["summary"].splitlines()[0]
    assert recommended in summary_line.replace("\n", "")  # the explorer opens on the plan the cell printed
    assert "8 × H100" in opened["status"] and "the cell's plan" in opened["status"]
    assert opened["shot"].stat().st_size > 10_000


def test_changing_the_device_count_replans_and_redraws_the_chart(seen):
    before, after = seen["opened"], seen["four_devices"]
    assert "model on 4 devices" in after["summary"] and "model on 8 devices" in before["summary"]
    assert after["summary"] != before["summary"] and after["chart"] != before["chart"]


def test_a_typed_budget_replans_once_typing_pauses_and_the_page_names_it(seen):
    typed = seen["three_gib"]
    assert "memory budget 3.00 GiB per device" in typed["status"] and "80.00 GiB per device" not in typed["status"]
    # "3", "3G", "3Gi" were never planned: the box waited for typing to pause ("3" alone would be refused)
    assert not any("cannot plan" in s for s in typed["statuses"]), typed["statuses"]
    assert "the track is the budget, 3.00 GiB" in typed["memory"]
    assert "does not fit" in typed["chart_text"] and 'class="nbtrain-bar over"' in typed["chart"]  # DDP needs more
    assert typed["chart"] != seen["four_devices"]["chart"]


def test_a_changed_box_redraws_the_chart_within_two_seconds(seen):
    """Issue 46: what a person waits for, from the box changed on the page to the chart redrawn by the kernel (the
    widget's round trip, the replan, the page's update); a typed budget's includes the pause the explorer waits
    for typing to end (0.6 s). GPT-2 replanned for 4 devices took 4.7 s before the search was made fast."""
    assert seen["four_devices"]["seconds"] < 2.0, seen["four_devices"]["status"]
    assert seen["three_gib"]["seconds"] < 2.0, seen["three_gib"]["status"]


def test_tables_inside_the_explorer_keep_the_notebooks_table_style(seen):
    border, wrapping = seen["opened"]["header_style"]
    assert border == "solid" and wrapping == "nowrap"  # a header rule; "speed-up" never broken over two lines


def test_the_page_logged_no_widget_error_and_asked_nothing_outside_127_0_0_1(seen):
    errors = [entry["message"] for entry in seen["log"]
              if entry["level"] == "SEVERE" or "widget" in entry["message"].lower() and "error" in
              entry["message"].lower()]
    assert errors == []
    assert [url for url in seen["outside"] if not url.startswith("chrome://")] == []  # the browser's own pages


def test_a_reopened_notebook_shows_the_static_plan_and_how_to_explore_not_an_error(seen):
    shown = "\n".join(seen["reopened"]["outputs"])
    assert "re-run the cell to explore" in shown and "model on 8 devices" in shown
    assert "step time of the compared plans" in shown
    assert "Error displaying widget" not in shown and "Loading widget" not in shown
