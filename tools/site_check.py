"""Open every page of the built site in a headless browser and check what a reader would see.

The site is served on 127.0.0.1 (http.server, in a thread) and each HTML page is opened in
Debian's Chromium, driven by Playwright. A page passes when:

- it loads with no console error, no uncaught exception and no failed request, and requests
  nothing from outside the site (there is no network: MathJax, fonts and scripts are all local);
- its math is typeset: every `.math` element holds MathJax output (`mjx-container`), MathJax
  reports no TeX error, and no raw `\\(`, `\\[`, `$$` or `\\begin{` is left in the text;
- every image loaded (naturalWidth > 0);
- every figure of a chapter has a caption that starts with its own number, "Figure N.k.", and
  no second, book-wide one;
- every link inside the site resolves: the file exists (or, for a file named by --later that
  another job is still writing, has that name) and, for `page.html#anchor`, the page has an
  element with that id;
- every "Open in Colab" link (class colab-link, book/_ext/colab_links.py) is the one for its
  chapter and names a notebook that exists in notebooks/; every chapter page has one, as a badge;
- every chapter page's download menu offers its executed notebook, the very file
  notebooks/<chapter>.ipynb that Colab opens, and its .md source, the very file in chapters/;
- every page has a favicon, a canonical link under _config.yml's html.baseurl and an "Open an
  issue" button; every page with a source has an "Edit this page" button opening a file of the
  repository (except pages written at build time, book/_ext/source_buttons.py's GENERATED_PAGES);
  sitemap.xml lists every chapter page, under html.baseurl, and only pages that exist;
- every attention explorer (attnbook.viz, class attnbook-explorer) reacts: focusing one token and
  hovering another give two different pictures (the tokens' computed shading and the values they
  show, which are the embedded weights), and its head selector changes the picture.

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
from dataclasses import dataclass, field, replace
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
from source_buttons import GENERATED_PAGES  # noqa: E402

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
    colabBadges: document.querySelectorAll('.colab-link a img').length,
    downloads: [...document.querySelectorAll('.dropdown-download-buttons a')]
      .map(a => ({text: a.textContent.trim(), href: a.href})),
    edit: [...document.querySelectorAll('a.btn-source-edit-button')].map(a => a.href),
    issues: [...document.querySelectorAll('a.btn-source-issues-button')].map(a => a.href),
    canonical: [...document.querySelectorAll('link[rel="canonical"]')].map(l => l.href),
    icons: [...document.querySelectorAll('link[rel~="icon"]')]
      .map(l => ({href: l.href, raw: l.getAttribute('href')})),
    explorers: document.querySelectorAll('.attnbook-explorer').length,
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

# The picture an attention explorer shows now: each token's computed shading and shown value.
PICTURE_JS = """
root => [...root.querySelectorAll('[data-token-index]')].map(el => ({
  shade: getComputedStyle(el).backgroundColor,
  value: (el.querySelector('.ax-value') || {}).textContent || ''}))
"""
# Two tokens whose rows differ (layer 0, head 0), read from the explorer's embedded JSON.
PAIR_JS = """
root => {
  const data = JSON.parse(document.getElementById(root.id + '-data').textContent);
  const rows = data.weights[0][0], same = (a, b) => JSON.stringify(a) === JSON.stringify(b);
  for (let j = rows.length - 1; j > 0; j--)
    if (!same(rows[j], rows[0])) return {i: 0, j, row: rows[j], digits: data.digits};
  return null;
}
"""
ACTION_TIMEOUT_MS = 5_000


async def check_explorers(page) -> list[str]:
    """Focus one token of each explorer and hover another: two pictures, and they must differ;
    the values shown are the weights the explorer holds; each head selector changes the picture."""
    problems = []
    roots = page.locator(".attnbook-explorer")
    ids = await roots.evaluate_all("roots => roots.map(r => r.id)")
    if len(set(ids)) != len(ids) or not all(ids):
        problems.append(f"attention explorers without distinct ids: {ids}")
    for n, uid in enumerate(ids):
        root, name = roots.nth(n), f"attention explorer {uid or n}"
        tokens = root.locator("[data-token-index]")
        pair = await root.evaluate(PAIR_JS)
        if pair is None:
            continue  # every row the same: no two tokens can show different pictures
        await page.mouse.move(0, 0)  # over the page's header: scrolling brings no token under it
        before = await root.evaluate(PICTURE_JS)
        await tokens.nth(pair["i"]).focus(timeout=ACTION_TIMEOUT_MS)
        focused = await root.evaluate(PICTURE_JS)
        await tokens.nth(pair["j"]).hover(timeout=ACTION_TIMEOUT_MS)
        hovered = await root.evaluate(PICTURE_JS)
        if focused == before:
            problems.append(f"{name}: focusing token {pair['i']} changes nothing")
        if hovered == focused:
            problems.append(f"{name}: hovering token {pair['j']} shows the same picture as "
                            f"focusing token {pair['i']}")
        shown = [token["value"] for token in hovered]
        wanted = [f"{w:.{pair['digits']}f}" for w in pair["row"]]
        if shown != wanted:
            problems.append(f"{name}: token {pair['j']} shows {shown}, its weights are {wanted}")
        problems += await check_selector(root, name)
    return problems


async def check_selector(root, name: str) -> list[str]:
    """Each choice of the head selector (heads, and their average) repaints the picture."""
    select = root.locator("select.ax-head")
    if not await select.count():
        return []
    pictures = set()
    for value in await select.locator("option").evaluate_all("os => os.map(o => o.value)"):
        await select.select_option(value, timeout=ACTION_TIMEOUT_MS)
        pictures.add(repr(await root.evaluate(PICTURE_JS)))
    return [] if len(pictures) > 1 else [f"{name}: every head shows the same picture"]


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


@dataclass(frozen=True)
class SiteConfig:
    """What _config.yml says the pages of the published site carry."""

    repository: str  # https://github.com/<owner>/<name>
    branch: str
    baseurl: str  # where the site is published, ending in /
    tracked: frozenset[str]  # the repository's files (git ls-files), which edit links may open
    # files another job writes into the site after this check (make test: the PDF): a link to one
    # is checked by its name only, and the caller checks the file
    later: frozenset[str] = frozenset()


def site_config(root: Path = ROOT) -> SiteConfig:
    config = yaml.safe_load((root / "_config.yml").read_text())
    listed = subprocess.run(["git", "ls-files"], cwd=root, capture_output=True, text=True)
    tracked = listed.stdout.split() if listed.returncode == 0 else [
        p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file()]
    return SiteConfig(config["repository"]["url"].rstrip("/"),
                      config["repository"].get("branch") or "main",
                      config.get("html", {}).get("baseurl", "").rstrip("/") + "/",
                      frozenset(tracked))


def page_source(site: Path, page: str) -> str | None:
    """The source path of a page (chapters/01-x.md), if the site has its copy in _sources."""
    stem = page.removesuffix(".html")
    for suffix in (".md", ".ipynb", ".rst"):
        if (site / "_sources" / (stem + suffix)).is_file():
            return stem + suffix
    return None


def check_buttons(result: PageResult, info: dict, base: str, site: Path,
                  config: SiteConfig) -> None:
    """Canonical link, favicon, "Open an issue" and "Edit this page" on every page."""
    canonical = config.baseurl + result.path
    if info["canonical"] != [canonical]:
        result.problems.append(f"canonical link is {info['canonical']}, not [{canonical!r}]")
    if not info["icons"]:
        result.problems.append("has no favicon (link rel=icon)")
    for icon in info["icons"]:
        if not icon["href"].startswith(base + "/"):
            result.problems.append(f"favicon is not served by the site: {icon['raw']}")
        resolve_link(result, icon, base, site)
    if len(info["issues"]) != 1 or not info["issues"][0].startswith(config.repository
                                                                     + "/issues/new?"):
        result.problems.append(f"no 'Open an issue' button for {config.repository}: "
                               f"{info['issues']}")
    source = page_source(site, result.path)
    stem = result.path.removesuffix(".html")
    if source is None or stem in GENERATED_PAGES:
        if info["edit"]:
            result.problems.append(f"edit button on a page with no file to edit: {info['edit']}")
    elif info["edit"] != [f"{config.repository}/edit/{config.branch}/{source}"]:
        result.problems.append(f"edit buttons {info['edit']} do not open {source}")
    elif source not in config.tracked:
        result.problems.append(f"edit button opens {source}, which the repository does not hold")


def check_downloads(result: PageResult, downloads: list[dict], base: str, site: Path,
                    notebooks: Path) -> None:
    """A chapter page offers the very files notebooks/<chapter>.ipynb and chapters/<chapter>.md."""
    chapter = result.path.removeprefix("chapters/").removesuffix(".html")
    for suffix, original in [(".ipynb", notebooks / f"{chapter}.ipynb"),
                             (".md", ROOT / "chapters" / f"{chapter}.md")]:
        links = [d["href"] for d in downloads if d["text"] == suffix]
        if len(links) != 1 or not links[0].startswith(base + "/"):
            result.problems.append(f"download menu offers {links} as {suffix}, not one file "
                                   "of the site")
            continue
        served = site / unquote(urlsplit(links[0]).path).lstrip("/")
        if not served.is_file() or served.read_bytes() != original.read_bytes():
            result.problems.append(f"the {suffix} download is not the file {original}")


def check_sitemap(site: Path, config: SiteConfig, results: list[PageResult]) -> PageResult:
    """sitemap.xml: every chapter page, under html.baseurl, and only pages that exist."""
    result = PageResult("sitemap.xml")
    if not (site / "sitemap.xml").is_file():
        result.problems.append("the site has no sitemap.xml")
        return result
    listed = re.findall(r"<loc>([^<]+)</loc>", (site / "sitemap.xml").read_text())
    result.links = len(listed)
    for url in listed:
        rel = url.removeprefix(config.baseurl)
        if rel == url or not (site / unquote(rel)).is_file():
            result.problems.append(f"lists {url}, which is not a page under {config.baseurl}")
    for page in (r.path for r in results if r.path.startswith("chapters/")):
        if config.baseurl + page not in listed:
            result.problems.append(f"does not list {page}")
    return result


def resolve_link(result: PageResult, link: dict, base: str, site: Path,
                 later: frozenset[str] = frozenset()) -> None:
    """Check one internal link's file now (one in `later` by its name: it is written after this
    check); keep its #fragment for when every page is read."""
    href = link["href"]
    if not href.startswith(base + "/"):
        return
    parts = urlsplit(href)
    rel = unquote(parts.path).lstrip("/")
    if rel == "" or rel.endswith("/"):
        rel += "index.html"
    result.links += 1
    target = site / rel
    if not target.is_file() and rel not in later:
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
                     shots: Path | None, config: SiteConfig | None) -> PageResult:
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
        if info["explorers"]:
            events.extend(await check_explorers(page))
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
    analyse(result, info, base, site, notebooks, config)
    return result


def analyse(result: PageResult, info: dict, base: str, site: Path, notebooks: Path,
            config: SiteConfig | None = None) -> None:
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
        resolve_link(result, link, base, site, config.later if config else frozenset())
    check_colab(result, info["colab"], notebooks)
    if expected_colab(result.path):
        if info["colab"] and not info["colabBadges"]:
            result.problems.append("the Colab link is not a badge (an image)")
        check_downloads(result, info["downloads"], base, site, notebooks)
    if config:
        check_buttons(result, info, base, site, config)
    for exec_table in info["execTables"]:
        check_execution_table(result, exec_table, site)
    if result.path.startswith("chapters/") and (site / result.path).is_file():
        check_figures(result, (site / result.path).read_text(encoding="utf-8"))


FIGURE_CAPTION = re.compile(r"<figcaption>(.*?)</figcaption>", re.S)


def check_figures(result: PageResult, html: str) -> None:
    """Every figure's caption carries the book's own number ("Figure 5.3. ...", the chapter's
    count, which Colab shows too) and no second, book-wide one from Sphinx ("Fig. 13")."""
    for caption in FIGURE_CAPTION.findall(html):
        text = re.sub(r"<[^>]+>", "", caption).strip()
        if 'class="caption-number"' in caption:
            result.problems.append(f"figure numbered twice: {text[:40]!r}")
        elif not re.match(r"Figure [0-9A-Z]+\.[0-9]+\. ", text):
            result.problems.append(f"figure caption without its number: {text[:40]!r}")


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
                    shots: Path | None, tabs: int, config: SiteConfig | None) -> list[PageResult]:
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
                return await check_page(context, base, path, site, notebooks, shots, config)

        results = await asyncio.gather(*(one(path) for path in pages(site)))
        await browser.close()
    return list(results)


def run(site: Path, notebooks: Path, shots: Path | None, tabs: int = TABS,
        config: SiteConfig | None = None) -> list[PageResult]:
    """Check every page of `site`, `tabs` pages at a time; anchors and the sitemap last, once every
    page is known. With `config` (what _config.yml says of the published site), also each page's
    canonical link, favicon and repository buttons, and the sitemap."""
    browser_path = ensure_chromium()
    server, base = serve(site)
    try:
        results = asyncio.run(check_all(browser_path, base, site, notebooks, shots, tabs, config))
    finally:
        server.shutdown()
        server.server_close()
    check_fragments(results)
    return results + ([check_sitemap(site, config, results)] if config else [])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("site", nargs="?", type=Path, default=DEFAULT_SITE)
    parser.add_argument("--notebooks", type=Path, default=ROOT / "notebooks")
    parser.add_argument("--screenshots", type=Path, help="save a PNG of every page here")
    parser.add_argument("--tabs", type=int, default=TABS, help="pages open at once")
    parser.add_argument("--later", action="append", default=[], metavar="FILE",
                        help="a file (relative to the site) that another job writes into it "
                             "after this check, such as attnbook.pdf: links to it are checked by "
                             "name, and the caller checks the file")
    args = parser.parse_args()
    if not (args.site / "index.html").is_file():
        print(f"site check: no site at {args.site} (build it: make book, or make site-verified)",
              file=sys.stderr)
        return 2
    if args.screenshots:
        args.screenshots.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    config = replace(site_config(), later=frozenset(args.later))
    results = run(args.site.resolve(), args.notebooks.resolve(), args.screenshots, args.tabs,
                  config)
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
