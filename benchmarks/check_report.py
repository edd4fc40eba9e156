"""Check the HTML report in a real headless browser: it loads without errors and every plot decodes.

Needs Chromium from Debian's packages (`apt-get install -y chromium`); not part of the default test run.
The page (kvsum/report/render.py) declares its plot count in <body data-plots> and, once loaded, records
how many plot images decoded (data-plots-decoded) and any script or resource error (data-errors). This
script has Chromium load the page from disk with the network disabled, dumps the DOM after load, compares
the counts, scans the browser's console log for errors and takes a full-page screenshot.

    python -m benchmarks.check_report [benchmarks/results/report/report.html]

Writes check.json and screenshot.png next to the page; exits 1 if a check fails.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--no-first-run",
         "--disable-extensions", "--proxy-server=127.0.0.1:9", "--proxy-bypass-list=<-loopback>",
         "--virtual-time-budget=10000", "--enable-logging=stderr", "--v=0"]


def browser() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    sys.exit("no Chromium found: apt-get install -y chromium")


def run(args: list[str], profile: str) -> subprocess.CompletedProcess:
    return subprocess.run([browser(), *FLAGS, f"--user-data-dir={profile}", *args], capture_output=True, text=True,
                          timeout=180)


def console_errors(stderr: str) -> list[str]:
    """Console messages of the page at error level (Chromium's own startup noise is not the page's)."""
    return [ln for ln in stderr.splitlines() if "CONSOLE" in ln and ("ERROR" in ln or "Uncaught" in ln)]


def crop(png: Path) -> int:
    """Cut the white space below the page's content; returns the new height."""
    from PIL import Image, ImageChops

    im = Image.open(png).convert("RGB")
    box = ImageChops.difference(im, Image.new("RGB", im.size, (255, 255, 255))).getbbox()
    if box:
        im = im.crop((0, 0, im.width, min(im.height, box[3] + 20)))
    im.quantize(256).save(png, optimize=True)  # 8-bit palette: a third of the bytes, text unchanged
    return im.height


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    page = Path(argv[0] if argv else "benchmarks/results/report/report.html").resolve()
    url = page.as_uri()
    with tempfile.TemporaryDirectory() as profile:
        dom = run(["--dump-dom", url], profile)
    body = re.search(r"<body([^>]*)>", dom.stdout)
    attrs = dict(re.findall(r'([\w-]+)="([^"]*)"', body.group(1))) if body else {}
    declared = int(attrs.get("data-plots", -1))
    decoded = int(attrs.get("data-plots-decoded", -1))
    imgs = len(re.findall(r"<img[^>]*data-plot=", dom.stdout))
    errors = [e for e in attrs.get("data-errors", "").split(";") if e] + console_errors(dom.stderr)
    # a window taller than any report, then the blank bottom is cropped off
    height = min(60000, 2000 + 600 * imgs + 40 * dom.stdout.count("<tr>"))
    shot = page.with_name("screenshot.png")
    with tempfile.TemporaryDirectory() as profile:
        snap = run([f"--screenshot={shot}", f"--window-size=1280,{height}", url], profile)
    if shot.is_file():
        height = crop(shot)
    result = dict(page=str(page.relative_to(Path.cwd()) if page.is_relative_to(Path.cwd()) else page),
                  browser=subprocess.run([browser(), "--version"], capture_output=True, text=True).stdout.strip(),
                  loaded=attrs.get("data-loaded") == "yes", plots_declared=declared, img_elements=imgs,
                  plots_decoded=decoded, errors=errors, screenshot=shot.name if shot.is_file() else None,
                  screenshot_errors=console_errors(snap.stderr), window=[1280, height])
    result["ok"] = (result["loaded"] and declared > 0 and declared == imgs == decoded and not errors
                    and result["screenshot"] is not None and not result["screenshot_errors"])
    page.with_name("check.json").write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
