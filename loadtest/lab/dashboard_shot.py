"""A picture of the dashboard under load (the README's): starts a server with the debug routes, drives a
concurrency sweep point at it, and has Chromium photograph ``/dashboard`` while the requests run.

    python -m loadtest.lab.dashboard_shot --out docs/dashboard.png [--concurrency 24] [--after 25]

Needs Playwright and a Chromium (``apt-get install chromium``, or ``--chromium PATH``).
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import time
from pathlib import Path

from playwright.sync_api import sync_playwright

from loadtest.processes import start, stop, wait_healthy


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="docs/dashboard.png")
    p.add_argument("--port", type=int, default=8017)
    p.add_argument("--concurrency", type=int, default=24)
    p.add_argument("--after", type=float, default=25.0, help="seconds of load before the picture")
    p.add_argument("--chromium", default=shutil.which("chromium") or "chromium")
    args = p.parse_args()
    base = f"http://127.0.0.1:{args.port}"
    server = start([sys.executable, "-m", "server", "--port", str(args.port), "--enable-debug-routes",
                    "--kv-cache-memory", "256MiB", "--log-level", "warning"], Path("/tmp/dashboard_shot_server.log"))
    load = None
    try:
        wait_healthy(base, server, Path("/tmp/dashboard_shot_server.log"))
        load = subprocess.Popen([sys.executable, "-m", "loadtest.serve", "--base-url", base, "--dataset", "chat",
                                 "--num-prompts", str(8 * args.concurrency), "--input-len", "256", "--output-len",
                                 "128", "--max-concurrency", str(args.concurrency), "--no-progress"],
                                stdout=subprocess.DEVNULL)
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=args.chromium, args=["--no-sandbox", "--disable-gpu"])
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.goto(f"{base}/dashboard")
            time.sleep(args.after)
            page.screenshot(path=args.out, full_page=True)
            browser.close()
        print(f"saved {args.out}")
    finally:
        stop([p for p in (load, server) if p is not None])


if __name__ == "__main__":
    main()
