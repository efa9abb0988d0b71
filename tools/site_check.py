"""Open every page of the built site in a headless browser and check what a reader would see.

The site is served on 127.0.0.1 (http.server, in a thread) and each HTML page is opened in
Debian's Chromium, driven by Playwright. A page passes when:

- it loads with no console error, no uncaught exception and no failed request, and requests
  nothing from outside the site (there is no network: MathJax, fonts and scripts are all local);
- its math is typeset: every `.math` element holds MathJax output (`mjx-container`), MathJax
  reports no TeX error, and no raw `\\(`, `\\[`, `$$` or `\\begin{` is left in the text;
- every image loaded (naturalWidth > 0);
- every link inside the site resolves: the file exists and, for `page.html#anchor`, the page
  has an element with that id;
- every "Open in Colab" link (class colab-link, book/_ext/colab_links.py) is the one for its
  chapter and names a notebook that exists in notebooks/; every chapter page has one.

    python tools/site_check.py [SITE]   SITE: the built HTML (default: the site `make test` builds,
                                        _build/verified/_build/html); `make site-check`
    --screenshots DIR                   also save a full-page PNG of every page in DIR
    --tabs N                            pages open at once (default 2)

Chromium is $CHROMIUM, else /usr/bin/chromium, installed with apt-get (no recommended packages)
when it is missing and we are root on Debian; elsewhere a Chrome or Chromium on the PATH.
Playwright is pinned in requirements.txt; it drives that browser and downloads none of its own
(`playwright install` is never run). Exits 1 with the list of problems, after a table of every
page.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import http.server
import os
import posixpath
import re
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import unquote, urlsplit

import yaml

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_SITE = ROOT / "_build" / "verified" / "_build" / "html"
DEBIAN_CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
]
SKIP_DIRS = {"_static", "_sources", "_images", "_downloads"}
PAGE_TIMEOUT_MS = 30_000
TABS = 2  # pages open at once (the machines have 2 cores)

sys.path.insert(0, str(ROOT / "book" / "_ext"))
from colab_links import colab_url  # noqa: E402

# Run in the page once it has loaded: wait for MathJax's first typesetting and for every image,
# then report what the checks need.
INSPECT_JS = """
async () => {
  const withTimeout = (promise, ms) =>
    Promise.race([promise, new Promise(resolve => setTimeout(resolve, ms))]);
  const images = [...document.images];
  images.forEach(img => { if (img.loading === 'lazy') img.loading = 'eager'; });
  const mathCount = document.querySelectorAll('.math').length;
  let mathjax = 'absent';
  if (window.MathJax) {
    mathjax = 'loading';
    for (let i = 0; i < 200 && !(MathJax.startup && MathJax.startup.promise); i++)
      await new Promise(resolve => setTimeout(resolve, 50));
    if (MathJax.startup && MathJax.startup.promise) {
      await withTimeout(MathJax.startup.promise.then(() => { mathjax = 'ready'; }), 20000);
    }
  }
  await withTimeout(Promise.all(images.map(img => img.complete ? null :
    new Promise(resolve => { img.addEventListener('load', resolve);
                             img.addEventListener('error', resolve); }))), 15000);
  const text = document.body.cloneNode(true);
  text.querySelectorAll('pre, code, script, style, textarea, mjx-container, .highlight')
      .forEach(el => el.remove());
  const raw = [];
  const content = text.textContent;
  for (const token of ['\\\\(', '\\\\[', '$$', '\\\\begin{']) {
    const at = content.indexOf(token);
    if (at >= 0) raw.push(content.slice(Math.max(0, at - 30), at + 50).replace(/\\s+/g, ' '));
  }
  return {
    mathjax,
    math: mathCount,
    untypeset: [...document.querySelectorAll('.math')]
      .filter(el => !el.querySelector('mjx-container'))
      .map(el => el.textContent.trim().slice(0, 60)),
    typeset: document.querySelectorAll('mjx-container').length,
    mathErrors: [...document.querySelectorAll('mjx-merror')]
      .map(el => (el.getAttribute('data-mjx-error') || el.textContent).slice(0, 100)),
    raw,
    images: images.map(img => ({src: img.currentSrc || img.src,
                                ok: img.complete && img.naturalWidth > 0})),
    links: [...document.querySelectorAll('a[href]')]
      .map(a => ({href: a.href, raw: a.getAttribute('href')})),
    colab: [...document.querySelectorAll('.colab-link a')].map(a => a.href),
    execTables: [...document.querySelectorAll('table')]
      .filter(t => t.tHead && t.tHead.textContent.includes('Run Time'))
      .map(t => ({head: [...t.tHead.rows[0].cells].map(c => c.textContent.trim()),
                  rows: [...t.tBodies].flatMap(b => [...b.rows])
                    .map(r => [...r.cells].map(c => c.textContent.trim()))})),
    ids: [...document.querySelectorAll('[id]')].map(el => el.id)
      .concat([...document.querySelectorAll('a[name]')].map(a => a.name)),
  };
}
"""


@dataclass
class PageResult:
    path: str
    seconds: float = 0.0
    console_errors: int = 0
    math: int = 0
    typeset: int = 0
    images: int = 0
    images_ok: int = 0
    links: int = 0
    problems: list[str] = field(default_factory=list)
    ids: set[str] = field(default_factory=set)
    fragments: list[tuple[str, str, str]] = field(default_factory=list)  # (raw, page, id)


class QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format, *args):  # noqa: A002 (the base class's name)
        pass


def serve(site: Path) -> tuple[http.server.ThreadingHTTPServer, str]:
    handler = functools.partial(QuietHandler, directory=str(site))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    host, port = server.server_address[:2]
    return server, f"http://{host}:{port}"


def find_chromium() -> Path | None:
    """$CHROMIUM, else Debian's /usr/bin/chromium, if it is there."""
    path = Path(os.environ.get("CHROMIUM", DEBIAN_CHROMIUM))
    return path if path.exists() else None


def ensure_chromium() -> Path:
    """Debian's Chromium, installed with apt-get if it is not there yet. Where that cannot be done
    (not root, not Debian), a Chrome or Chromium already on the PATH."""
    found = find_chromium()
    if found:
        return found
    if os.geteuid() == 0 and shutil.which("apt-get") and Path("/etc/debian_version").exists():
        print("site check: installing Debian's chromium with apt-get ...", flush=True)
        start = time.monotonic()
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        subprocess.run(["apt-get", "update", "-qq"], check=True, env=env)
        subprocess.run(
            ["apt-get", "install", "-y", "-qq", "--no-install-recommends", "chromium"],
            check=True, env=env, stdout=subprocess.DEVNULL,
        )
        print(f"site check: chromium installed in {time.monotonic() - start:.0f} s", flush=True)
        if find_chromium():
            return find_chromium()
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        if shutil.which(name):
            return Path(shutil.which(name))
    sys.exit("site check: no Chromium: install Debian's (as root: apt-get install chromium), "
             "or set CHROMIUM to a Chromium or Chrome binary")


def pages(site: Path) -> list[str]:
    return sorted(
        p.relative_to(site).as_posix()
        for p in site.rglob("*.html")
        if not SKIP_DIRS & set(p.relative_to(site).parts[:-1])
    )


def expected_colab(page: str) -> str | None:
    """The Colab link a chapter page must carry (None for pages that are not chapters)."""
    if not page.startswith("chapters/"):
        return None
    repo = yaml.safe_load((ROOT / "_config.yml").read_text())["repository"]
    chapter = page.removeprefix("chapters/").removesuffix(".html")
    return colab_url(repo["url"], repo.get("branch") or "main", chapter)


def check_colab(result: PageResult, hrefs: list[str], notebooks: Path) -> None:
    expected = expected_colab(result.path)
    if expected and not hrefs:
        result.problems.append("chapter page has no Colab link (class colab-link)")
    for href in hrefs:
        parts = urlsplit(href)
        path = parts.path.split("/")
        # /github/<owner>/<repo>/blob/<branch>/notebooks/<name>.ipynb
        if parts.netloc != "colab.research.google.com" or path[1:2] != ["github"] or (
            len(path) < 8 or path[-2] != "notebooks" or not path[-1].endswith(".ipynb")
        ):
            result.problems.append(f"Colab link is not a notebook in the repository: {href}")
            continue
        if not (notebooks / path[-1]).is_file():
            result.problems.append(f"Colab link names {path[-2]}/{path[-1]}, which does not exist")
        if expected and href != expected:
            result.problems.append(f"Colab link {href} is not this chapter's ({expected})")
        if not expected:
            result.problems.append(f"Colab link on a page that is not a chapter: {href}")


def resolve_link(result: PageResult, link: dict, base: str, site: Path) -> None:
    """Check one internal link's file now; keep its #fragment for when every page is read."""
    href = link["href"]
    if not href.startswith(base + "/"):
        return
    parts = urlsplit(href)
    rel = unquote(parts.path).lstrip("/")
    if rel == "" or rel.endswith("/"):
        rel += "index.html"
    result.links += 1
    target = site / rel
    if not target.is_file():
        result.problems.append(f"broken link {link['raw']!r}: {rel} does not exist")
    elif parts.fragment and rel.endswith(".html"):
        result.fragments.append((link["raw"], rel, unquote(parts.fragment)))


REFRESH = re.compile(r'<meta http-equiv="refresh" content="\d+;\s*url=([^"]+)"', re.IGNORECASE)


def check_redirect(path: str, site: Path) -> PageResult | None:
    """A page that only redirects (index.html to the root document) is checked for its target."""
    html = (site / path).read_text(errors="replace")
    match = REFRESH.search(html)
    if not match or len(html) > 1000:
        return None
    result = PageResult(path, links=1)
    target = posixpath.normpath(posixpath.join(posixpath.dirname(path), match.group(1)))
    if not (site / unquote(target.split("#")[0])).is_file():
        result.problems.append(f"redirects to {match.group(1)}, which does not exist")
    return result


async def check_page(context, base: str, path: str, site: Path, notebooks: Path,
                     shots: Path | None) -> PageResult:
    """Open one page in a fresh tab (no listener or request left over from another page)."""
    result = PageResult(path)
    events: list[str] = []
    external: list[str] = []

    def on_console(msg):
        if msg.type == "error":
            result.console_errors += 1
            where = msg.location.get("url", "") if msg.location else ""
            events.append(f"console error: {msg.text}" + (f" ({where})" if where else ""))

    def on_request_failed(request):
        if request.url.startswith(base):
            events.append(f"request failed: {request.url} ({request.failure})")

    def on_response(response):
        if response.status >= 400 and response.url.startswith(base):
            events.append(f"HTTP {response.status}: {response.url}")

    async def on_route(route):
        if route.request.url.startswith(base) or route.request.url.startswith("data:"):
            await route.continue_()
        else:
            external.append(route.request.url)
            await route.abort()

    page = await context.new_page()
    page.on("console", on_console)
    page.on("pageerror", lambda exc: events.append(f"uncaught exception: {exc}"))
    page.on("requestfailed", on_request_failed)
    page.on("response", on_response)
    await page.route("**/*", on_route)
    start = time.monotonic()
    try:
        response = await page.goto(f"{base}/{path}", wait_until="load", timeout=PAGE_TIMEOUT_MS)
        if response is None or response.status != 200:
            events.append(f"page answered HTTP {response.status if response else '?'}")
        info = await page.evaluate(INSPECT_JS)
        if shots:
            shot = shots / (path.replace("/", "__").removesuffix(".html") + ".png")
            await page.screenshot(path=str(shot), full_page=True)
    except Exception as error:  # a page that does not load is a problem of that page
        result.problems.append(f"did not load: {error}")
        return result
    finally:
        result.seconds = time.monotonic() - start
        await page.close()
    # Console errors that only repeat the blocked external requests are reported once, below.
    result.problems += [e for e in events if not any(url in e for url in external)]
    result.problems += [f"requests something outside the site: {url}" for url in external]
    analyse(result, info, base, site, notebooks)
    return result


def analyse(result: PageResult, info: dict, base: str, site: Path, notebooks: Path) -> None:
    """The checks on what INSPECT_JS reported."""
    result.math, result.typeset = info["math"], info["typeset"]
    if info["math"] and info["mathjax"] != "ready":
        result.problems.append(f"has {info['math']} math elements but MathJax is "
                               f"{info['mathjax']} (not loaded, or it never finished)")
    for tex in info["untypeset"][:5]:
        result.problems.append(f"math not typeset: {tex!r}")
    for error in info["mathErrors"][:5]:
        result.problems.append(f"MathJax error: {error}")
    for snippet in info["raw"]:
        result.problems.append(f"raw TeX left in the text: ...{snippet}...")

    result.images = len(info["images"])
    result.images_ok = sum(img["ok"] for img in info["images"])
    result.problems += [f"image did not load: {img['src']}" for img in info["images"]
                        if not img["ok"]]
    result.ids = set(info["ids"])
    for link in info["links"]:
        resolve_link(result, link, base, site)
    check_colab(result, info["colab"], notebooks)
    for exec_table in info["execTables"]:
        check_execution_table(result, exec_table, site)


def check_execution_table(result: PageResult, exec_table: dict, site: Path) -> None:
    """myst-nb's {nb-exec-table} (book/execution.md): a row for every chapter on the site, each
    with a run time in seconds and the status of a run without errors."""
    head = exec_table["head"]
    try:
        doc, seconds, status = (head.index(h) for h in ("Document", "Run Time (s)", "Status"))
    except ValueError:
        result.problems.append(f"execution table has unexpected columns {head}")
        return
    listed = set()
    for row in exec_table["rows"]:
        listed.add(row[doc])
        try:
            float(row[seconds])
        except ValueError:
            result.problems.append(f"execution table: {row[doc]} has no run time ({row[seconds]!r})")
        if row[status] != "\u2705":
            result.problems.append(f"execution table: {row[doc]} did not run cleanly ({row[status]!r})")
    chapters = {p.relative_to(site).with_suffix("").as_posix() for p in site.glob("chapters/*.html")}
    for missing in sorted(chapters - listed):
        result.problems.append(f"execution table has no row for {missing}")


def check_fragments(results: list[PageResult]) -> None:
    ids = {r.path: r.ids for r in results}
    for result in results:
        for raw, target, fragment in result.fragments:
            if target in ids and fragment not in ids[target]:
                result.problems.append(f"broken anchor {raw!r}: {target} has no id {fragment!r}")
            elif target not in ids:
                result.problems.append(f"link {raw!r} to a page that was not checked: {target}")


def table(results: list[PageResult]) -> str:
    head = ("page", "s", "console", "math", "images", "links", "problems")
    rows = [
        (r.path, f"{r.seconds:.1f}", str(r.console_errors),
         f"{r.typeset}/{r.math}" if r.math else "-",
         f"{r.images_ok}/{r.images}" if r.images else "-", str(r.links), str(len(r.problems)))
        for r in results
    ]
    widths = [max(len(row[i]) for row in [head, *rows]) for i in range(len(head))]
    line = lambda row: "  ".join(  # noqa: E731
        c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))
    )
    return "\n".join([line(head), "  ".join("-" * w for w in widths), *map(line, rows)])


async def check_all(browser_path: Path, base: str, site: Path, notebooks: Path,
                    shots: Path | None, tabs: int) -> list[PageResult]:
    from playwright.async_api import async_playwright

    async with async_playwright() as playwright:
        browser = await playwright.chromium.launch(
            executable_path=str(browser_path), args=CHROMIUM_ARGS, headless=True
        )
        context = await browser.new_context(viewport={"width": 1280, "height": 900})
        slots = asyncio.Semaphore(tabs)

        async def one(path: str) -> PageResult:
            redirect = check_redirect(path, site)
            if redirect:
                return redirect
            async with slots:
                return await check_page(context, base, path, site, notebooks, shots)

        results = await asyncio.gather(*(one(path) for path in pages(site)))
        await browser.close()
    return list(results)


def run(site: Path, notebooks: Path, shots: Path | None, tabs: int = TABS) -> list[PageResult]:
    """Check every page of `site`, `tabs` pages at a time; anchors last, once every page's ids
    are known."""
    browser_path = ensure_chromium()
    server, base = serve(site)
    try:
        results = asyncio.run(check_all(browser_path, base, site, notebooks, shots, tabs))
    finally:
        server.shutdown()
        server.server_close()
    check_fragments(results)
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("site", nargs="?", type=Path, default=DEFAULT_SITE)
    parser.add_argument("--notebooks", type=Path, default=ROOT / "notebooks")
    parser.add_argument("--screenshots", type=Path, help="save a PNG of every page here")
    parser.add_argument("--tabs", type=int, default=TABS, help="pages open at once")
    args = parser.parse_args()
    if not (args.site / "index.html").is_file():
        print(f"site check: no site at {args.site} (build it: make book, or make site-verified)",
              file=sys.stderr)
        return 2
    if args.screenshots:
        args.screenshots.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    results = run(args.site.resolve(), args.notebooks.resolve(), args.screenshots, args.tabs)
    print(table(results))
    problems = [(r.path, p) for r in results for p in r.problems]
    seconds = time.monotonic() - start
    if problems:
        print(f"\nsite check: {len(problems)} problem(s) on "
              f"{len({p for p, _ in problems})} of {len(results)} pages:", file=sys.stderr)
        for path, problem in problems:
            print(f"  {path}: {problem}", file=sys.stderr)
        return 1
    print(f"\nsite check: {len(results)} pages of {args.site} passed in {seconds:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
