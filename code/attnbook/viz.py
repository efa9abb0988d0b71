# Do not edit: tools/tangle.py generates this file from chapters/a3-pictures.md.
"""An attention explorer: attention weights over a sentence's tokens as HTML that Jupyter, Colab
and the book's site display, with nothing fetched from outside.

Built and explained in the book's chapter chapters/a3-pictures.md.
"""

__all__ = [
    "explorer_weights",
    "explorer_html",
    "AttentionExplorer",
    "attention_explorer",
]

# chapters/a3-pictures.md, "What the explorer accepts"
import hashlib
import html
import itertools
import json
import re

import numpy as np
import numpy.typing as npt
import torch

from attnbook.checks import check_array, check_instance, check_int, check_real, check_text


def explorer_weights(tokens: list[str] | tuple[str, ...], weights: npt.ArrayLike | torch.Tensor,
                     atol: float | None = None) -> np.ndarray:
    """`weights` of shape (T, T), (heads, T, T) or (layers, heads, T, T) as a float64 array of
    shape (layers, heads, T, T) (appendix C), checked against `tokens`, T strings: finite,
    non-negative, every row summing to 1 within `atol` or all zero (no allowed key). `atol`
    defaults to what the weights' dtype allows: 4 of its epsilons, and 1e-3 at least."""
    for i, token in enumerate(check_instance("tokens", tokens, (list, tuple))):
        check_text(f"tokens[{i}]", token)
    T = check_int("len(tokens)", len(tokens), minimum=1)
    atol = _rounding_atol(weights) if atol is None else check_real("atol", atol, 0, 0.5)
    if isinstance(weights, torch.Tensor):
        if weights.is_meta:  # a meta tensor has a shape but no values to show
            raise ValueError("weights must hold values, got a tensor on the meta device")
        weights = weights.detach().cpu().double()
    w = check_array("weights", weights, min_ndim=2).astype(np.float64)
    if w.ndim > 4 or w.shape[-2:] != (T, T) or w.size == 0:
        raise ValueError(f"weights must have shape (T, T), (heads, T, T) or (layers, heads, T, T)"
                         f" with T = len(tokens) = {T}, got shape {w.shape}")
    sums = w.sum(axis=-1)  # (..., T): one per query
    bad = ~np.isfinite(sums) | (w.min(axis=-1) < 0) | ((abs(sums - 1) > atol) & (sums != 0))
    if bad.any():
        where = tuple(np.argwhere(bad)[0])
        raise ValueError(f"weights must be finite, non-negative and sum to 1 in every row (or be"
                         f" all zero), got weights[{', '.join(map(str, where))}, :] summing to "
                         f"{float(sums[where]):.4g}, its smallest weight {float(w[where].min()):.4g}")
    return w.reshape((1,) * (4 - w.ndim) + w.shape)


def _rounding_atol(weights: object) -> float:
    """How far from 1 a row of `weights` may sum: each weight rounded to their dtype moves the
    sum by up to half an epsilon of itself, so eps / 2 in all; 4 eps leaves room for a softmax
    summed in that dtype (bfloat16: 0.03; float16: 0.004), and 1e-3 for the wider dtypes."""
    dtype = getattr(weights, "dtype", None)
    if isinstance(dtype, torch.dtype) and dtype.is_floating_point:
        eps = torch.finfo(dtype).eps
    elif isinstance(weights, np.ndarray) and np.issubdtype(dtype, np.floating):
        eps = float(np.finfo(dtype).eps)
    else:  # lists, integers: nothing rounded
        eps = 0.0
    return max(1e-3, 4 * eps)


# chapters/a3-pictures.md, "The page"
_STYLE = """
.attnbook-explorer { font-family: sans-serif; margin: 0.5em 0; }
.attnbook-explorer .ax-controls label { margin-left: 0.5em; font-size: 0.9em; }
.attnbook-explorer .ax-tokens { display: flex; flex-wrap: wrap; gap: 4px; margin: 0.5em 0; }
.attnbook-explorer .ax-token { display: inline-flex; flex-direction: column; align-items: center;
  padding: 2px 6px; border: 1px solid #999; border-radius: 4px; cursor: pointer; }
.attnbook-explorer .ax-token.ax-query { outline: 2px solid #1f5fbf; }
.attnbook-explorer .ax-value { font-size: 0.75em; min-height: 1.2em; }
"""

_SCRIPT = """(function () {
  var root = document.getElementById("__UID__");
  if (!root || root.dataset.ready) return;  // already running (the output was shown twice)
  root.dataset.ready = "yes";
  var data = JSON.parse(document.getElementById("__UID__-data").textContent);
  var tokens = root.querySelectorAll("[data-token-index]");
  var layer = root.querySelector(".ax-layer"), head = root.querySelector(".ax-head");
  var readout = root.querySelector(".ax-readout"), chosen = null;
  function row(i) {  // query i's weights over the keys: one head's, or the mean over heads
    var heads = data.weights[layer ? Number(layer.value) : 0];
    if (!head || head.value !== "mean") return heads[head ? Number(head.value) : 0][i];
    return heads[0][i].map(function (_, j) {
      return heads.reduce(function (sum, h) { return sum + h[i][j]; }, 0) / heads.length;
    });
  }
  function show(i) {
    var w = row(i), values = [], top = [];
    chosen = i;
    tokens.forEach(function (el, j) {
      values.push(w[j].toFixed(data.digits));  // ties are judged as the page shows the weights
      el.style.backgroundColor = "rgba(255, 140, 0, " + w[j].toFixed(3) + ")";
      el.querySelector(".ax-value").textContent = values[j];
      el.classList.toggle("ax-query", j === i);
    });
    var most = values.reduce(function (a, b) { return Number(b) > Number(a) ? b : a; });
    values.forEach(function (v, j) { if (v === most) top.push(j); });
    readout.textContent = quoted(i) + said(kind(i), most, top);
  }
  function kind(i) {  // "0": no allowed key, "=": even, ".": neither, judged on the exact weights
    var kinds = data.kinds[layer ? Number(layer.value) : 0];
    return kinds[head && head.value === "mean" ? kinds.length - 1 : head ? Number(head.value) : 0][i];
  }
  function said(k, most, top) {  // the readout, after the query's name
    if (k === "0") return " gives no weight to any token (it has no allowed key)";
    if (tokens.length === 1) return " gives all its weight, " + most + ", to itself";
    if (Number(most) === 0) return " spreads its weight" + (k === "=" ? " evenly" : "") +
      " over " + tokens.length + " tokens, too thinly to show: every weight shows as " + most;
    if (k === "=") return " spreads its weight evenly, " + most + " to each token";
    return " gives its largest weight, " + most + ", to " + (top.length > 1 ? "each of " : "") +
      named(top);
  }
  function named(top) {  // the tokens' names, at most six, or five and how many others
    var names = top.slice(0, top.length > 6 ? 5 : 6).map(quoted);
    return names.join(", ") + (top.length > 6 ? " and " + (top.length - 5) + " others" : "");
  }
  function quoted(i) { return "\\u201c" + shown(i) + "\\u201d"; }
  function shown(i) {  // token i as its element shows it: control characters as pictures
    return tokens[i].querySelector(".ax-text").textContent;
  }
  tokens.forEach(function (el) {
    var i = Number(el.dataset.tokenIndex);
    el.addEventListener("mouseenter", function () { show(i); });
    el.addEventListener("focus", function () { show(i); });
  });
  [layer, head].forEach(function (select) {
    if (select) select.addEventListener("change", function () { if (chosen !== null) show(chosen); });
  });
})();"""


# chapters/a3-pictures.md, "The page"
def _options(name: str, count: int, uid: str, average: bool = False) -> str:
    """A <select> of `count` numbered choices (plus the average), or nothing for one choice."""
    if count == 1:
        return ""
    choices = [f'<option value="{i}">{i}</option>' for i in range(count)]
    if average:
        choices.append('<option value="mean">average over heads</option>')
    return (f'<label for="{uid}-{name}">{name}</label> '
            f'<select id="{uid}-{name}" class="ax-{name}">{"".join(choices)}</select> ')


_C1 = range(0x80, 0xA0)  # the C1 control characters, which have no pictures
_PICTURES = {**{c: 0x2400 + c for c in range(32)}, 0x7F: 0x2421,  # "\x00" -> "␀", DEL -> "␡"
             **dict.fromkeys(_C1, 0xFFFD)}  # C1 -> "�", the replacement character
_SCRIPT_ESCAPES = {c: f"\\u{c:04x}" for c in (*map(ord, "<>&\x7f"), *_C1)}  # "<" -> "\\u003c"


def _as_text(text: str) -> str:
    """`text` escaped for HTML, its control characters shown as their pictures (C1's as U+FFFD):
    a page may not hold them raw (a browser drops or replaces a NUL)."""
    return html.escape(text.translate(_PICTURES))


def _json_for_script(data: object) -> str:
    """JSON that an HTML <script> element holds safely: no `<`, `>` or `&` left to parse, and no
    DEL or C1 control (JSON escapes C0's itself)."""
    return json.dumps(data, separators=(",", ":"), ensure_ascii=False).translate(_SCRIPT_ESCAPES)


def _kinds(weights: np.ndarray) -> list[list[str]]:
    """For each layer, one string per head and one for the mean over heads, with a character per
    query, judged on the weights before they are rounded: "0" for a row of zeros (no allowed
    key), "=" for a row whose weights are all equal (within a relative 1e-9), "." otherwise."""
    rows = np.concatenate([weights, weights.mean(axis=1, keepdims=True)], axis=1)  # (L, H+1, T, T)
    largest, smallest = rows.max(axis=-1), rows.min(axis=-1)
    kinds = np.where(largest == 0, "0", np.where(largest - smallest <= 1e-9 * largest, "=", "."))
    return [["".join(head) for head in layer] for layer in kinds.tolist()]


def explorer_html(tokens: list[str] | tuple[str, ...], weights: np.ndarray, uid: str,
                  title: str = "", digits: int = 3) -> str:
    """The explorer's HTML for `weights` over `tokens`, checked by explorer_weights (appendix C),
    its element ids all starting with `uid`: letters, digits, `-` and `_` only, since it goes
    into attributes and into the script. Tokens and title are escaped, shown as text."""
    weights = explorer_weights(tokens, weights)  # (L, H, T, T), finite: valid JSON
    if not isinstance(uid, str) or not re.fullmatch(r"[A-Za-z][A-Za-z0-9_-]*", uid):
        raise ValueError(f"uid must be a letter followed by letters, digits, '-' or '_' (it goes "
                         f"into HTML attributes and the script), got uid={uid!r}")
    title = check_text("title", title)
    digits = check_int("digits", digits, minimum=1, maximum=6)
    L, H, T, _ = weights.shape
    spans = "".join(
        f'<span class="ax-token" tabindex="0" data-token-index="{i}">'
        f'<span class="ax-text">{_as_text(token)}</span><span class="ax-value"></span></span>'
        for i, token in enumerate(tokens))
    data = {"tokens": list(tokens), "digits": digits, "kinds": _kinds(weights),
            "weights": np.round(weights, digits).tolist()}  # (L, H, T, T)
    return (f'<div class="attnbook-explorer" id="{uid}"><style>{_STYLE}</style>'
            f'<div class="ax-title">{_as_text(title)}</div>'
            f'<div class="ax-controls">{_options("layer", L, uid)}'
            f'{_options("head", H, uid, average=True)}</div>'
            f'<div class="ax-tokens">{spans}</div>'
            '<div class="ax-readout" aria-live="polite">Hover over a token, or reach it with '
            'the Tab key, to see where it attends.</div>'
            f'<script type="application/json" id="{uid}-data">{_json_for_script(data)}</script>'
            f'<script>{_SCRIPT.replace("__UID__", uid)}</script></div>')


# chapters/a3-pictures.md, "The page"
_shown = itertools.count()  # explorers displayed so far by this Python process


class AttentionExplorer:
    """Attention weights over `tokens` that Jupyter, Colab and the book's site display as an
    interactive explorer (appendix C); make one with attention_explorer."""

    def __init__(self, tokens: list[str] | tuple[str, ...], weights: npt.ArrayLike | torch.Tensor,
                 title: str = "", digits: int = 3) -> None:
        self.weights = explorer_weights(tokens, weights)  # (L, H, T, T)
        self.tokens = list(tokens)
        self.title = check_text("title", title)
        self.digits = check_int("digits", digits, minimum=1, maximum=6)

    def __repr__(self) -> str:
        L, H, T, _ = self.weights.shape
        return f"AttentionExplorer(tokens={T}, layers={L}, heads={H})"

    def _repr_html_(self) -> str:
        digest = hashlib.sha256(json.dumps([self.tokens, self.title]).encode())
        digest.update(np.round(self.weights, self.digits).tobytes())
        uid = f"attnbook-explorer-{next(_shown)}-{digest.hexdigest()[:8]}"
        return explorer_html(self.tokens, self.weights, uid, self.title, self.digits)


def attention_explorer(tokens: list[str] | tuple[str, ...], weights: npt.ArrayLike | torch.Tensor,
                       title: str = "", digits: int = 3) -> AttentionExplorer:
    """An explorer of `weights` (T, T), (heads, T, T) or (layers, heads, T, T) over `tokens`, a
    list of T strings (appendix C): hovering over or focusing a token shades the others by its
    weights; selectors choose the layer and the head, or the average over heads."""
    return AttentionExplorer(tokens, weights, title=title, digits=digits)
