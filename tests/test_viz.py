"""attnbook.viz (appendix C): the attention explorer's HTML, read back with Python's HTML parser."""

import json
import re
from html.parser import HTMLParser

import numpy as np
import pytest
import torch

from attnbook.attention import softmax
from attnbook.layers import MultiHeadAttention
from attnbook.viz import AttentionExplorer, attention_explorer, explorer_weights


class Page(HTMLParser):
    """Every start tag's attributes, the text of the token elements and the embedded JSON."""

    def __init__(self, text: str):
        super().__init__()
        self.tags, self.texts, self.json, self._where = [], [], [], None
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        self.tags.append((tag, attrs))
        if attrs.get("class") == "ax-text":
            self._where = "text"
        elif tag == "script" and attrs.get("type") == "application/json":
            self._where = "json"
        else:
            self._where = None

    def handle_endtag(self, tag):
        self._where = None

    def handle_data(self, data):
        if self._where == "text":
            self.texts.append(data)
        elif self._where == "json":
            self.json.append(data)

    def ids(self) -> list[str]:
        return [attrs["id"] for _, attrs in self.tags if "id" in attrs]

    def data(self) -> dict:
        (text,) = self.json
        return json.loads(text)


def random_weights(*shape, seed=0) -> np.ndarray:
    return softmax(np.random.default_rng(seed).normal(size=shape) * 2)


@pytest.mark.parametrize("shape", [(1, 1), (5, 5), (3, 5, 5), (2, 3, 5, 5)])
def test_tokens_indices_and_weights_survive_the_round_trip(shape):
    T = shape[-1]
    tokens = [f"w{i}" for i in range(T)]
    weights = random_weights(*shape, seed=T)
    page = Page(attention_explorer(tokens, weights, digits=4)._repr_html_())
    assert page.texts == tokens
    indices = [attrs["data-token-index"] for _, attrs in page.tags if "data-token-index" in attrs]
    assert indices == [str(i) for i in range(T)]
    assert all(attrs.get("tabindex") == "0" for _, attrs in page.tags
               if "data-token-index" in attrs)
    data = page.data()
    assert data["tokens"] == tokens and data["digits"] == 4
    expected = weights.reshape((1,) * (4 - len(shape)) + shape)
    np.testing.assert_allclose(np.array(data["weights"]), expected, rtol=0, atol=5e-5 + 1e-12)


def test_selectors_appear_for_more_than_one_layer_or_head():
    def selects(weights):
        page = Page(attention_explorer(["a", "b"], weights)._repr_html_())
        return {attrs["class"]: [a.get("value") for t, a in page.tags if t == "option"]
                for tag, attrs in page.tags if tag == "select"}

    assert selects(np.eye(2)) == {}
    assert selects(np.stack([np.eye(2)] * 3)) == {"ax-head": ["0", "1", "2", "mean"]}
    both = selects(np.stack([np.stack([np.eye(2)] * 2)] * 3))
    assert set(both) == {"ax-layer", "ax-head"}


def test_tokens_are_text_not_markup():
    tokens = ["<b>", "</script><script>alert(1)</script>", "&amp;", '"x"']
    html = attention_explorer(tokens, np.full((4, 4), 0.25))._repr_html_()
    page = Page(html)
    assert page.texts == tokens and page.data()["tokens"] == tokens
    assert [tag for tag, _ in page.tags].count("b") == 0
    assert [tag for tag, _ in page.tags].count("script") == 2  # the JSON and the program
    assert "<b>" not in html and "&lt;b&gt;" in html


def test_control_characters_show_as_their_pictures_not_raw():
    tokens, title = ["\x00", "a\x1fb", "\x7f", "\n"], "t\x07"
    html = attention_explorer(tokens, np.full((4, 4), 0.25), title=title)._repr_html_()
    assert not any(ord(ch) < 32 or ord(ch) == 0x7F for ch in html.replace("\n", ""))
    page = Page(html)
    assert page.texts == ["\u2400", "a\u241fb", "\u2421", "\u240a"]
    assert page.data()["tokens"] == tokens  # the data keep the tokens as they are


def test_c1_control_characters_are_not_left_raw_in_the_page():
    # reader53-V F3: U+0080-U+009F (HTML parse errors, as C0's are) were left raw, in the text
    # and in the JSON
    tokens = ["a\x85b", "\x9c", "\x80"]
    html = attention_explorer(tokens, np.full((3, 3), 1 / 3), title="t\x9f")._repr_html_()
    assert not any(0x80 <= ord(ch) < 0xA0 for ch in html)
    page = Page(html)
    assert page.texts == ["a\ufffdb", "\ufffd", "\ufffd"] and "t\ufffd" in html  # title too
    assert page.data()["tokens"] == tokens  # escaped in the JSON, the same tokens once parsed


def test_the_readout_names_tokens_as_the_token_row_shows_them():
    # reader53-V F4: the readout wrote data.tokens, raw, where the token row shows pictures
    html = attention_explorer(["\n", "a"], np.full((2, 2), 0.5))._repr_html_()
    assert "data.tokens[" not in html and '.querySelector(".ax-text").textContent' in html


def test_no_outside_requests_and_unique_ids():
    first = attention_explorer(["a", "b", "c"], random_weights(2, 2, 3, 3))
    pages = [first._repr_html_(), first._repr_html_(),
             attention_explorer(["a", "b", "c"], random_weights(2, 2, 3, 3))._repr_html_()]
    ids = [i for html in pages for i in Page(html).ids()]
    assert len(ids) == len(set(ids))  # three explorers on one page share no id
    for html in pages:
        assert not re.search(r"https?:|<(link|img|iframe)\b|\b(src|href)=|url\(|@import", html)
        assert not re.search(r"\b(fetch|import|XMLHttpRequest)\b", html)
        root = Page(html).ids()[0]
        assert all(i.startswith(root) for i in Page(html).ids())
        assert f'getElementById("{root}")' in html


def test_tensors_and_zero_rows_are_accepted():
    torch.manual_seed(0)
    weights = torch.softmax(torch.randn(2, 4, 4, dtype=torch.float16), -1)
    assert explorer_weights(list("abcd"), weights).shape == (1, 2, 4, 4)
    leaf = torch.softmax(torch.randn(4, 4, requires_grad=True), -1)
    assert explorer_weights(list("abcd"), leaf).dtype == np.float64
    no_key = np.full((3, 3), 1 / 3)
    no_key[1] = 0  # a query with no allowed key: the book's softmax gives a row of zeros
    np.testing.assert_array_equal(explorer_weights(list("abc"), no_key)[0, 0], no_key)


@pytest.mark.parametrize("tokens, weights, error, match", [
    ("abc", np.eye(3), TypeError, "tokens"),
    (["a", 1, "c"], np.eye(3), TypeError, r"tokens\[1\]"),
    ([], np.zeros((0, 0)), ValueError, r"len\(tokens\)"),
    (["a", "b"], np.eye(3), ValueError, "weights must have shape"),
    (["a", "b"], np.eye(2)[0], ValueError, "weights"),
    (["a", "b"], np.ones((1, 1, 1, 2, 2)) / 2, ValueError, "weights must have shape"),
    (["a", "b"], np.zeros((0, 2, 2)), ValueError, "weights must have shape"),
    (["a", "b"], np.full((2, 2), 0.6), ValueError, r"weights\[0, :\] summing to 1.2"),
    (["a", "b"], np.array([[1.5, -0.5], [0, 1]]), ValueError, "non-negative"),
    (["a", "b"], np.array([[np.nan, 1], [0, 1]]), ValueError, r"weights\[0, :\] summing to nan"),
    (["a", "b"], np.array([[np.inf, 0], [0, 1]]), ValueError, "finite"),
    (["a", "b"], np.array([["x", "y"], ["z", "w"]]), TypeError, "weights"),
])
def test_bad_input_names_the_argument(tokens, weights, error, match):
    with pytest.raises(error, match=match):
        attention_explorer(tokens, weights)


def test_bad_options_name_the_option():
    with pytest.raises(TypeError, match="title"):
        AttentionExplorer(["a"], np.ones((1, 1)), title=None)
    with pytest.raises(ValueError, match="digits"):
        attention_explorer(["a"], np.ones((1, 1)), digits=0)
    with pytest.raises(ValueError, match="atol"):
        explorer_weights(["a"], np.ones((1, 1)), atol=-1)
    assert explorer_weights(["a", "b"], np.array([[0.6, 0.5], [0, 1]]), atol=0.2).shape[-1] == 2


@pytest.mark.parametrize("uid", ['x" onmouseover="alert(1)', 'a");alert(1);("', "a b", "a<b>",
                                 "", "1abc", "a\\nb", "é", 3, None])
def test_explorer_html_refuses_a_uid_that_could_inject(uid):
    """The uid goes into attributes and into the script, so it is validated."""
    from attnbook.viz import explorer_html

    with pytest.raises(ValueError, match="uid"):
        explorer_html(["a", "b"], np.eye(2), uid)


def test_explorer_html_checks_its_arguments_and_escapes_every_string():
    from attnbook.viz import explorer_html

    attack = '</div><script>alert("t")</script><img src=x onerror=alert(1)>'
    page_html = explorer_html([attack, "b"], np.eye(2), "ok-id_1", title=attack)
    page = Page(page_html)
    assert [tag for tag, _ in page.tags].count("script") == 2  # the JSON and the program only
    assert not any(tag in ("img", "b") for tag, _ in page.tags)
    assert page.texts[0] == attack and page.data()["tokens"][0] == attack
    assert attack not in page_html and "alert(1)" not in page_html.split("<script>")[-1]
    assert Page(page_html).ids()[0] == "ok-id_1"
    with pytest.raises(ValueError, match="weights"):
        explorer_html(["a", "b"], np.full((2, 2), np.nan), "u")  # NaN would be invalid JSON
    with pytest.raises(TypeError, match="title"):
        explorer_html(["a"], np.ones((1, 1)), "u", title=None)
    with pytest.raises(ValueError, match="digits"):
        explorer_html(["a"], np.ones((1, 1)), "u", digits=9)
    with pytest.raises(TypeError, match=r"tokens\[0\]"):
        explorer_html([1], np.ones((1, 1)), "u")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_weights_rounded_to_a_two_byte_dtype_are_accepted(dtype):
    """A bfloat16 layer's weights sum to 1 only within its rounding (0.9985): the
    default tolerance follows the dtype, and still refuses what rounding cannot explain."""
    torch.manual_seed(0)
    layer = MultiHeadAttention(64, 4).to(dtype).eval()
    tokens = [f"t{i}" for i in range(48)]
    _, weights = layer(torch.randn(1, 48, 64, dtype=dtype), return_weights=True)
    off = (weights.double().sum(-1) - 1).abs().max().item()
    assert off > 1e-3 or dtype == torch.float16  # the old fixed 1e-3 refused these
    assert explorer_weights(tokens, weights[0]).shape == (1, 4, 48, 48)
    assert attention_explorer(tokens, weights[0].detach().numpy() if dtype == torch.float16 else weights[0])
    with pytest.raises(ValueError, match="summing to 1.1"):
        explorer_weights(tokens, weights[0] * 1.1)
    with pytest.raises(ValueError, match="summing to 0.998"):
        explorer_weights(tokens[:2], np.array([[0.998, 0], [0, 1]]))  # float64: 1e-3 as before


def test_a_meta_tensor_has_no_weights_to_show():
    with pytest.raises(ValueError, match="weights must hold values, got a tensor on the meta"):
        explorer_weights(["a", "b"], torch.empty(2, 2, device="meta"))


@pytest.mark.parametrize("token", ["\ud800", "a\udfffb"])
def test_a_token_without_utf8_is_refused_when_the_explorer_is_made(token):
    with pytest.raises(ValueError, match=r"tokens\[0\] must be encodable as UTF-8"):
        attention_explorer([token, "b"], np.eye(2))


@pytest.mark.parametrize("title", ["\ud800", "heads \udfff of layer 0"])
def test_a_title_without_utf8_is_refused_by_every_entry_point(title):
    """A lone surrogate in the title gave a page that no UTF-8 file or display could hold."""
    from attnbook.viz import explorer_html

    match = r"title must be encodable as UTF-8, got title="
    with pytest.raises(ValueError, match=match):
        explorer_html(["a", "b"], np.eye(2), "u", title=title)
    with pytest.raises(ValueError, match=match):
        attention_explorer(["a", "b"], np.eye(2), title=title)  # when made, not when shown
    with pytest.raises(ValueError, match=match):
        AttentionExplorer(["a", "b"], np.eye(2), title=title)


def test_every_string_the_page_holds_is_valid_utf8():
    """The page, written as UTF-8 and read back, is the same page (tokens and title outside ASCII)."""
    from attnbook.viz import explorer_html

    page_html = explorer_html(["é", "日本", "😀"], np.eye(3), "u", title="Ünïcode 😀")
    assert page_html.encode("utf-8").decode("utf-8") == page_html
    page = Page(page_html)
    assert page.data()["tokens"] == ["é", "日本", "😀"] and "Ünïcode 😀" in page_html


def test_a_negative_weight_is_named_even_when_its_row_sums_to_1():
    with pytest.raises(ValueError, match=r"weights\[0, :\] summing to 1, its smallest weight -0.5"):
        explorer_weights(["a", "b"], np.array([[1.5, -0.5], [0.0, 1.0]]))


# The page's script, run under node with a minimal stand-in for the DOM (skipped without node):
# what the readout says when the reader points at a token.
_DOM = """
var data = JSON.parse(%(data)s), words = %(words)s, readout = {textContent: ""};
var head = %(head)s;
var tokens = words.map(function (w, i) {
  var text = {textContent: w}, value = {textContent: ""}, on = {};
  return {dataset: {tokenIndex: String(i)}, style: {}, classList: {toggle: function () {}},
          querySelector: function (s) { return s === ".ax-text" ? text : value; },
          addEventListener: function (event, f) { on[event] = f; }, on: on};
});
var root = {dataset: {}, querySelectorAll: function () { return tokens; },
            querySelector: function (s) {
              return s === ".ax-readout" ? readout : s === ".ax-head" ? head : null; }};
var document = {getElementById: function (id) {
  return id === "u" ? root : {textContent: JSON.stringify(data)}; }};
%(script)s
tokens.forEach(function (el) { el.on.mouseenter(); console.log(readout.textContent); });
"""


def readouts(tokens, weights, head=None, digits=3):
    """The readout after pointing at each token in turn, as the page's script writes it."""
    import os
    import shutil
    import subprocess
    import tempfile

    node = shutil.which("node")
    if node is None:
        pytest.skip("node is not installed: the explorer's script is not run")
    from attnbook.viz import explorer_html

    html = explorer_html(tokens, weights, "u", digits=digits)
    data = re.search(r'id="u-data">(.*?)</script>', html, re.S).group(1)
    script = re.findall(r"<script>(.*?)</script>", html, re.S)[-1]
    program = _DOM % {"data": json.dumps(data), "words": json.dumps(tokens), "script": script,
                      "head": "null" if head is None else
                      '{value: %s, addEventListener: function () {}}' % json.dumps(head)}
    with tempfile.TemporaryDirectory() as folder:  # a file: `node -e` fails (E2BIG) on long ones
        path = os.path.join(folder, "readout.js")
        with open(path, "w", encoding="utf-8") as file:
            file.write(program)
        done = subprocess.run([node, path], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout.splitlines()


def test_the_readout_names_one_largest_weight_ties_and_empty_rows():
    # R4-57 finding 9: ties were read as one "largest weight" (the first), and a row of zeros
    # as "its largest weight, 0.000"
    weights = np.array([[0.7, 0.2, 0.1, 0.0], [0.25] * 4, [0.0] * 4, [0.4, 0.4, 0.2, 0.0]])
    lines = readouts(["a", "b", "c", "d"], weights)
    assert lines == ["\u201ca\u201d gives its largest weight, 0.700, to \u201ca\u201d",
                     "\u201cb\u201d spreads its weight evenly, 0.250 to each token",
                     "\u201cc\u201d gives no weight to any token (it has no allowed key)",
                     "\u201cd\u201d gives its largest weight, 0.400, to each of \u201ca\u201d, "
                     "\u201cb\u201d"]


def test_the_readout_of_the_average_over_heads_compares_the_weights_shown():
    # the mean of two heads is not rounded in the script: ties are judged as the page shows them
    heads = np.array([[[0.6, 0.4], [0.5, 0.5]], [[0.4, 0.6], [1.0, 0.0]]])
    lines = readouts(["a", "b"], heads, head="mean")
    assert lines == ["\u201ca\u201d spreads its weight evenly, 0.500 to each token",
                     "\u201cb\u201d gives its largest weight, 0.750, to \u201ca\u201d"]


def q(token):
    return "\u201c" + token + "\u201d"


def test_the_readout_tells_a_row_that_rounds_to_zeros_from_a_row_with_no_allowed_key():
    # R-FX4-57 finding 1: "no allowed key" was decided on the rounded weights, so a uniform row of
    # 21 tokens at digits=1 (each 0.048, shown as 0.0), which sums to 1, read as a masked row
    words = [f"t{i}" for i in range(21)]
    lines = readouts(words, np.full((21, 21), 1 / 21), digits=1)
    assert lines[0] == (q("t0") + " spreads its weight evenly over 21 tokens, too thinly to show: "
                        "every weight shows as 0.0")
    words = [f"t{i}" for i in range(300)]  # causal, uniform over the allowed keys
    causal = np.tril(np.ones((300, 300))) / np.arange(1, 301)[:, None]
    causal[299, :2] = [0.004, 2 / 300 - 0.004]  # uneven, every weight still below 0.005
    lines = readouts(words, causal, digits=2)
    assert lines[299] == (q("t299") + " spreads its weight over 300 tokens, too thinly to show: "
                          "every weight shows as 0.00")
    assert lines[0] == q("t0") + " gives its largest weight, 1.00, to " + q("t0")
    masked = np.array([[0.0, 0.0], [0.5, 0.5]])
    assert readouts(["a", "b"], masked)[0] == q("a") + (" gives no weight to any token (it has no "
                                                        "allowed key)")


def test_the_readout_judges_an_even_row_on_the_exact_weights_and_reads_one_token():
    # R-FX4-57 finding 2: at digits=1, [0.14, 0.06, 0.1 x 8] all show as 0.1 and read as "evenly"
    words = [f"t{i}" for i in range(10)]
    weights = np.full((10, 10), 0.1)
    weights[0, :2] = [0.14, 0.06]
    lines = readouts(words, weights, digits=1)
    assert lines[0] == (q("t0") + " gives its largest weight, 0.1, to each of " +
                        ", ".join(q(f"t{i}") for i in range(5)) + " and 5 others")
    assert lines[1] == q("t1") + " spreads its weight evenly, 0.1 to each token"
    assert readouts(["a"], np.array([[1.0]])) == [q("a") + " gives all its weight, 1.000, to itself"]
    # the mean over heads of [0.6, 0.4] and [0.4, 0.6] is even; of [0.5, 0.5] and [1, 0] it is not
    heads = np.array([[[0.6, 0.4], [0.5, 0.5]], [[0.4, 0.6], [1.0, 0.0]]])
    assert readouts(["a", "b"], heads, head="mean") == [
        q("a") + " spreads its weight evenly, 0.500 to each token",
        q("b") + " gives its largest weight, 0.750, to " + q("a")]


def test_the_readout_names_at_most_five_tied_tokens():
    # R-FX4-57 finding 3: 301 tied tokens were named in one line of 2,347 characters
    words = [f"t{i}" for i in range(512)]
    causal = np.tril(np.ones((512, 512))) / np.arange(1, 513)[:, None]
    lines = readouts(words, causal)
    assert lines[300] == (q("t300") + " gives its largest weight, 0.003, to each of " +
                          ", ".join(q(f"t{i}") for i in range(5)) + " and 296 others")
    assert lines[5] == (q("t5") + " gives its largest weight, 0.167, to each of " +
                        ", ".join(q(f"t{i}") for i in range(6)))
