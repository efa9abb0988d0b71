"""How much of the package a reader meets on one forward pass, and how often it checks (issue 38).

- check calls: calls of functions of attnbook.checks (sys.setprofile), for a GPT forward and a
  10-token generation on each backend at 4 and 8 layers, EncoderDecoder.greedy_decode of 10
  steps, and block_sparse_attention at L = 256;
- the GPT forward path: the functions of attnbook a training-mode forward enters (sys.settrace),
  their code lines (no blank, comment or docstring line) and conditionals (`if`, conditional
  expressions, each extra `and`/`or` operand), and the files they are in;
- validation's share of the package's code lines: the lines of check/validate functions and
  `__post_init__`, and of `if ...: raise` statements elsewhere.

    TRITON_INTERPRET=1 python benchmarks/boundary.py
"""

import ast
import inspect
import io
import os
import re
import sys
import textwrap
import tokenize
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")  # the Triton backend on the CPU

import torch  # noqa: E402

PACKAGE = Path(__file__).resolve().parents[1] / "code" / "attnbook"
# check_x, checked, validate_x (leading underscores dropped): not checkpoint_state
VALIDATOR = re.compile(r"(check|validate)(ed)?(_|$)")


def check_calls(fn) -> int:
    count = 0

    def profile(frame, event, arg):
        nonlocal count
        if event == "call" and frame.f_globals.get("__name__") == "attnbook.checks":
            count += 1

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return count


def code_lines(tree: ast.AST, source: str) -> set[int]:
    """The line numbers of `source` that hold code: no blank, comment or docstring line."""
    docstrings = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr) \
                and isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str):
            docstrings.update(range(body[0].lineno, body[0].end_lineno + 1))
    lines = set()
    skip = (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT,
            tokenize.ENDMARKER)
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type not in skip:
            lines.update(range(token.start[0], token.end[0] + 1))
    return lines - docstrings


def conditionals(tree: ast.AST) -> int:
    return sum(len(n.values) - 1 if isinstance(n, ast.BoolOp) else 1 for n in ast.walk(tree)
               if isinstance(n, (ast.If, ast.IfExp, ast.BoolOp)))


def forward_path(fn) -> tuple[int, int, int, list[str]]:
    """(functions, code lines, conditionals, files) of the attnbook functions fn() enters."""
    entered = set()

    def trace(frame, event, arg):
        if event == "call" and frame.f_globals.get("__name__", "").startswith("attnbook"):
            entered.add(frame.f_code)

    sys.settrace(trace)
    try:
        fn()
    finally:
        sys.settrace(None)
    lines = branches = 0
    codes = [c for c in entered if not c.co_name.startswith("<")]
    for code in codes:
        source = textwrap.dedent("".join(inspect.getsourcelines(code)[0]))
        tree = ast.parse(source)
        lines, branches = lines + len(code_lines(tree, source)), branches + conditionals(tree)
    return len(codes), lines, branches, sorted({Path(c.co_filename).name for c in codes})


def validation_share() -> tuple[int, int]:
    total = checks = 0
    for path in sorted(PACKAGE.glob("*.py")):
        source = path.read_text()
        tree = ast.parse(source)
        lines, marked = code_lines(tree, source), set()
        for node in ast.walk(tree):
            name = (getattr(node, "name", "") or "").lstrip("_")
            if isinstance(node, ast.FunctionDef) and (VALIDATOR.match(name)
                                                      or node.name == "__post_init__"):
                marked.update(range(node.lineno, node.end_lineno + 1))
            elif isinstance(node, ast.If) and not node.orelse \
                    and all(isinstance(s, ast.Raise) for s in node.body):
                marked.update(range(node.lineno, node.end_lineno + 1))
        total, checks = total + len(lines), checks + len(lines & marked)
    return checks, total


def main() -> None:
    from attnbook import efficient
    from attnbook.encdec import EncoderDecoder, EncoderDecoderConfig
    from attnbook.gpt import GPT, GPTConfig
    from attnbook.layers import ATTENTION_BACKENDS

    torch.manual_seed(0)
    idx = torch.randint(0, 50, (2, 16))
    for backend in ATTENTION_BACKENDS:
        for layers in (4, 8):
            model = GPT(GPTConfig(vocab_size=50, context_length=64, d_model=32, num_layers=layers,
                                  num_heads=2, dropout=0.0, backend=backend))
            forward = check_calls(lambda m=model: m(idx))
            generate = check_calls(lambda m=model: m.generate(idx[:, :4], 10, temperature=0))
            print(f"check calls, GPT {backend:8} {layers} layers: forward {forward}, "
                  f"10-token generate {generate}")
    model = GPT(GPTConfig(vocab_size=50, context_length=64, d_model=32, num_layers=4,
                          num_heads=2)).train()
    functions, lines, branches, files = forward_path(lambda: model(idx))
    print(f"GPT forward path: {functions} functions, {lines} code lines, {branches} "
          f"conditionals, in {len(files)} files {files}")
    translator = EncoderDecoder(EncoderDecoderConfig(src_vocab=20, tgt_vocab=20, d_model=32,
                                                     num_heads=2, num_layers=2)).eval()
    src = torch.randint(3, 20, (2, 7))
    print("check calls, greedy_decode of 10 steps:",
          check_calls(lambda: translator.greedy_decode(src, 10)))
    q, layout = torch.randn(1, 2, 256, 16), efficient.sliding_window_mask(8, 8, 3)
    sparse = check_calls(lambda: efficient.block_sparse_attention(q, q, q, block_size=32,
                                                                  layout=layout, causal=True))
    print("check calls, block_sparse_attention at L = 256, 8 tile rows:", sparse)
    checks, total = validation_share()
    print(f"validation: {checks} of {total} code lines, {100 * checks / total:.1f}%")


if __name__ == "__main__":
    main()
