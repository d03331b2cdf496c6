"""A screenshot of the training view of `mtrain serve` on a run, as docs/serve-training.png shows.

    python scripts/screenshot_training.py --run runs/NAME [--out docs/serve-training.png]
        [--validation N] [--example N]

It starts `mtrain serve` on the run on a free port, opens /#view=training in headless Chromium
(selenium with Debian's /usr/bin/chromedriver), moves the slider to the N-th validation (default:
the middle one) and picks the N-th example (default: the first), and saves the window.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.common.keys import Keys
from selenium.webdriver.support.ui import Select, WebDriverWait

REPO = Path(__file__).resolve().parent.parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run", type=Path, required=True)
    parser.add_argument("--out", type=Path, default=REPO / "docs/serve-training.png")
    parser.add_argument("--validation", type=int, default=None)
    parser.add_argument("--example", type=int, default=0)
    parser.add_argument("--size", default="1100,1500", help="window width,height")
    args = parser.parse_args()
    serve = subprocess.Popen(
        [sys.executable, "-m", "mtrain", "serve", "--run", str(args.run), "--port", "0"],
        stderr=subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    try:
        url = None
        for line in serve.stderr:
            if found := re.search(rb"http://[\d.]+:\d+/", line):
                url = found[0].decode()
                break
        if url is None:
            sys.exit("mtrain serve did not start")
        options = webdriver.ChromeOptions()
        for flag in ("--headless=new", "--no-sandbox", "--hide-scrollbars", "--disable-gpu"):
            options.add_argument(flag)
        options.add_argument(f"--window-size={args.size}")
        driver = webdriver.Chrome(service=Service("/usr/bin/chromedriver"), options=options)
        try:
            wait = WebDriverWait(driver, 120)
            driver.get(url + "#view=training")
            wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, "#ex-heatmap[data-step]"))
            steps = driver.execute_script(  # the table is drawn again as the run goes on
                "return [...document.querySelectorAll('#examples-table tbody tr')]"
                ".map((tr) => tr.cells[0].textContent)"
            )
            Select(driver.find_element(By.ID, "example")).select_by_index(args.example)
            slider = driver.find_element(By.ID, "validation")
            slider.send_keys(Keys.HOME)
            at = len(steps) // 2 if args.validation is None else args.validation
            for _ in range(at):
                slider.send_keys(Keys.RIGHT)
            step = steps[at]
            wait.until(
                lambda d: d.find_element(By.ID, "ex-heatmap").get_attribute("data-step") == step
            )
            wait.until(lambda d: d.execute_script("return document.fonts.status") == "loaded")
            driver.execute_script("window.scrollTo(0, 0)")  # the slider's keys scrolled down
            driver.save_screenshot(str(args.out))
        finally:
            driver.quit()
    finally:
        serve.terminate()
        serve.wait()
    print(args.out)


if __name__ == "__main__":
    main()
