"""A PNG of the `moebench report` page of one or more runs, as a browser shows it: the page is written to a
temporary folder and screenshotted by headless Chromium (`chromium`, `chromium-browser`, `google-chrome` or
$CHROMIUM; on Debian: `apt-get install chromium`).

    python3 scripts/report_screenshot.py RUN_DIR... -o page.png [--width 1200] [--height 1600] [--scale 0.6]

`--height` is the part of the page captured from its top (the headline, the timing mode and the first rows come
first); `--scale` shrinks the image afterwards (needs Pillow, which matplotlib brings) to keep a docs figure small.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from moebench.report.page import ReportError, write_report  # noqa: E402

BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")


def find_browser() -> str | None:
    """The Chromium to run: $CHROMIUM, else the first of BROWSERS on PATH."""
    if os.environ.get("CHROMIUM"):
        return os.environ["CHROMIUM"]
    return next((path for path in map(shutil.which, BROWSERS) if path), None)


def screenshot(html: Path, png: Path, width: int, height: int, browser: str) -> None:
    """Headless Chromium renders `html` at width x height and writes `png`."""
    with tempfile.TemporaryDirectory(prefix="moebench-chromium-") as profile:
        cmd = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
               f"--user-data-dir={profile}", f"--window-size={width},{height}", f"--screenshot={png.resolve()}",
               html.resolve().as_uri()]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    if proc.returncode != 0 or not png.is_file():
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise RuntimeError(f"{browser} exited {proc.returncode}: {tail}")


def shrink(png: Path, scale: float) -> None:
    from PIL import Image

    with Image.open(png) as img:
        small = img.convert("RGB").resize((round(img.width * scale), round(img.height * scale)), Image.LANCZOS)
    small.quantize(colors=128, method=Image.Quantize.MEDIANCUT).save(png, optimize=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run_dirs", nargs="+", metavar="RUN_DIR")
    ap.add_argument("-o", "--out", required=True, help="the PNG to write")
    ap.add_argument("--width", type=int, default=1200)
    ap.add_argument("--height", type=int, default=1600)
    ap.add_argument("--scale", type=float, default=1.0, help="shrink the PNG by this factor (e.g. 0.6)")
    ap.add_argument("--title", default="moebench report")
    args = ap.parse_args(argv)
    browser = find_browser()
    if browser is None:
        sys.stderr.write("report_screenshot: no Chromium found (install chromium, or set CHROMIUM)\n")
        return 2
    out = Path(args.out)
    with tempfile.TemporaryDirectory(prefix="moebench-page-") as tmp:
        try:
            page = write_report(args.run_dirs, Path(tmp) / "report.html", title=args.title)
        except ReportError as e:
            sys.stderr.write(f"report_screenshot: {e}\n")
            return 2
        screenshot(page, out, args.width, args.height, browser)
    if args.scale != 1.0:
        shrink(out, args.scale)
    print(f"{out} ({out.stat().st_size // 1024} KB)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
