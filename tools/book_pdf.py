"""Print the book, built as one HTML page, to one PDF with Chromium (`make pdf`).

`make pdf` builds the whole book with Sphinx's singlehtml builder, from the committed notebooks
that nbval verifies (tools/verified_cache.py: nothing is executed), and this script prints that
page: it serves the folder on 127.0.0.1, opens the page in Debian's Chromium driven by
Playwright (as tools/site_check.py does; no browser is downloaded), blocks every request outside
the site, opens every collapsed block (the exercises' solutions, hidden code), waits for the
images and for MathJax to typeset the math, then prints with Chromium's own PDF printer.

    python tools/book_pdf.py SINGLEHTML OUT.pdf [--min-pages N]

Fails when a request left the site, an image did not load, math is left untypeset, or the PDF
has fewer than N pages (default 100: the book is well over that).
"""

from __future__ import annotations

import argparse
import asyncio
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from site_check import CHROMIUM_ARGS, REFRESH, ensure_chromium, serve  # noqa: E402

MIN_PAGES = 100
LOAD_TIMEOUT_MS = 300_000  # one page holding the whole book, every figure and formula in it

# Added to the page for print: each document (the intro, a chapter, an appendix) starts a page,
# long lines of code wrap instead of running off the paper, and what only a screen needs is left
# out: the intro's link to the PDF (book/intro.md), the buttons that show hidden code, the button
# back to the top.
PRINT_CSS = """
@media print {
  .book-pdf, details.hide > summary, #pst-back-to-top { display: none !important; }
  span[id^="document-"] + section { break-before: page; }
  pre { white-space: pre-wrap !important; overflow-wrap: anywhere; }
  img { break-inside: avoid; }
}
"""

# Run in the page before printing: the print style added, every collapsed block opened, every
# image loaded, the math typeset. Returns what the checks need.
PREPARE_JS = """
async (css) => {
  const withTimeout = (promise, ms) =>
    Promise.race([promise, new Promise(resolve => setTimeout(resolve, ms))]);
  const style = document.createElement('style');
  style.textContent = css;
  document.head.appendChild(style);
  document.querySelectorAll('details').forEach(d => { d.open = true; });
  document.querySelectorAll('.toggle-hidden').forEach(e => e.classList.remove('toggle-hidden'));
  document.querySelectorAll('button.toggle-button').forEach(b => { b.style.display = 'none'; });
  const images = [...document.images];
  images.forEach(img => { if (img.loading === 'lazy') img.loading = 'eager'; });
  await withTimeout(Promise.all(images.map(img => img.complete ? null :
    new Promise(resolve => { img.addEventListener('load', resolve);
                             img.addEventListener('error', resolve); }))), 120000);
  const math = document.querySelectorAll('.math').length;
  let mathjax = 'absent';
  const started = () => window.MathJax && MathJax.startup && MathJax.startup.promise;
  for (let i = 0; i < 600 && math && !started(); i++)
    await new Promise(resolve => setTimeout(resolve, 100));
  if (math && started()) {
    mathjax = 'loading';
    await withTimeout(MathJax.startup.promise.then(() => { mathjax = 'ready'; }), 240000);
  }
  return {
    mathjax,
    math,
    untypeset: [...document.querySelectorAll('.math')]
      .filter(el => !el.querySelector('mjx-container')).length,
    mathErrors: document.querySelectorAll('mjx-merror').length,
    images: images.length,
    broken: images.filter(img => !(img.complete && img.naturalWidth > 0))
      .map(img => img.currentSrc || img.src),
  };
}
"""


def book_page(folder: Path) -> Path:
    """The file holding the book: index.html, or the root document it redirects to. Sphinx
    writes the links of a root document in a subfolder (book/intro.html) as if it were at the
    top, so the page is opened as if it were there (print_pdf)."""
    match = REFRESH.search((folder / "index.html").read_text(errors="replace"))
    return folder / (match.group(1) if match else "index.html")


def page_count(pdf: bytes) -> int:
    """The number of pages of a PDF: its page objects (Chromium writes them uncompressed)."""
    return len(re.findall(rb"/Type\s*/Page(?![a-zA-Z])", pdf))


async def print_pdf(browser_path: Path, base: str, book: Path, out: Path) -> tuple[dict, list[str]]:
    """Open the file `book` as the page {base}/book.html of the site served at `base`, prepare
    it and print it to `out`: (what PREPARE_JS found, the requests that left the site)."""
    from playwright.async_api import async_playwright

    outside: list[str] = []

    async def on_route(route):
        if route.request.url == f"{base}/book.html":
            await route.fulfill(path=str(book), content_type="text/html")
        elif route.request.url.startswith((base, "data:")):
            await route.continue_()
        else:
            outside.append(route.request.url)
            await route.abort()

    async with async_playwright() as playwright:
        browser = await playwright.chromium.launch(
            executable_path=str(browser_path), args=CHROMIUM_ARGS, headless=True
        )
        page = await browser.new_page(viewport={"width": 1000, "height": 1400})
        await page.route("**/*", on_route)
        await page.goto(f"{base}/book.html", wait_until="load", timeout=LOAD_TIMEOUT_MS)
        info = await page.evaluate(PREPARE_JS, PRINT_CSS)
        await page.emulate_media(media="print")
        await page.pdf(path=str(out), format="A4", print_background=True,
                       margin={"top": "15mm", "bottom": "15mm", "left": "12mm", "right": "12mm"},
                       display_header_footer=True, header_template="<span></span>",
                       footer_template='<div style="font-size:8px;width:100%;text-align:center">'
                                       '<span class="pageNumber"></span></div>')
        await browser.close()
    return info, outside


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("singlehtml", type=Path, help="the singlehtml build (its index.html)")
    parser.add_argument("out", type=Path)
    parser.add_argument("--min-pages", type=int, default=MIN_PAGES)
    args = parser.parse_args()
    if not (args.singlehtml / "index.html").is_file():
        print(f"book pdf: no {args.singlehtml / 'index.html'} (make pdf builds it)",
              file=sys.stderr)
        return 2
    args.out.parent.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    server, base = serve(args.singlehtml.resolve())
    try:
        book = book_page(args.singlehtml)
        info, outside = asyncio.run(print_pdf(ensure_chromium(), base, book, args.out))
    finally:
        server.shutdown()
        server.server_close()
    pages = page_count(args.out.read_bytes())
    problems = [f"requests something outside the site: {url}" for url in outside]
    problems += [f"image did not load: {src}" for src in info["broken"]]
    if info["math"] and (info["mathjax"] != "ready" or info["untypeset"] or info["mathErrors"]):
        problems.append(f"math: MathJax {info['mathjax']}, {info['untypeset']} of "
                        f"{info['math']} formulas untypeset, {info['mathErrors']} TeX errors")
    if pages < args.min_pages:
        problems.append(f"{pages} pages, fewer than {args.min_pages}")
    for problem in problems:
        print(f"book pdf: {problem}", file=sys.stderr)
    print(f"book pdf: {args.out}, {pages} pages, {info['images']} images, {info['math']} "
          f"formulas, {args.out.stat().st_size / 1e6:.1f} MB, in {time.monotonic() - start:.0f} s")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
