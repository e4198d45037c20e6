"""The deepscaler rule reward (issue 37; VIME's ``--rm-type deepscaler``): answer extraction, the two graders,
on a table of known answers (LaTeX forms, units, fractions, tuples, malformed outputs)."""

from __future__ import annotations

import pytest

from rlk_repro import deepscaler as ds


def _r(answer: str, tail: str = "") -> str:
    return f"Let me think. 2+2=5? No.</think>The answer is $\\boxed{{{answer}}}${tail}"


# (response, label, reward)
TABLE = [
    # extraction: the part after the last </think>, the last \boxed{...}
    (_r("42"), "42", 1),
    (_r("43"), "42", 0),
    ("\\boxed{42}", "42", 0),  # no </think> and no ###Response: nothing is graded
    ("reasoning \\boxed{41}</think> so \\boxed{40} and finally \\boxed{42}", "42", 1),
    ("\\boxed{42}</think> I am not sure", "42", 0),  # the boxed answer is inside the thinking only
    ("a</think>b \\boxed{1}</think> \\boxed{42}", "42", 1),  # the last </think>
    ("draft \\boxed{7}###Response the answer \\boxed{42}", "42", 1),
    ("x###Response \\boxed{42}###Response \\boxed{7}", "42", 1),  # between the first two ###Response marks
    ("</think>The answer is 42.", "42", 0),  # no box
    ("</think>\\boxed 42", "42", 0),  # not \boxed{...}
    ("</think>\\boxed{42", "42", 0),  # unbalanced
    ("</think>\\fbox{42}", "42", 0),
    ("</think>\\boxed{}", "42", 0),
    ("", "42", 0),
    (_r("42"), "", 0),  # an empty label
    (_r("42"), "\\boxed{42}", 1),  # a boxed label is unwrapped
    (_r("42"), 42, 1),
    (_r("\\boxed{42}"), "42", 1),  # nested boxes: the last \boxed is the inner one
    # integers, decimals, thousands separators
    (_r("42.0"), "42", 1),
    (_r("1,000"), "1000", 1),
    (_r("1{,}000"), "1000", 1),
    (_r("-7"), "-7", 1),
    (_r("- 7"), "-7", 1),
    (_r("7"), "-7", 0),
    (_r("0.5"), "\\frac{1}{2}", 1),
    (_r(".5"), "\\frac12", 1),
    # fractions
    (_r("\\frac{7}{2}"), "\\frac{7}{2}", 1),
    (_r("\\dfrac{7}{2}"), "\\frac{7}{2}", 1),
    (_r("\\tfrac72"), "\\frac{7}{2}", 1),
    (_r("7/2"), "\\frac{7}{2}", 1),
    (_r("3.5"), "\\frac{7}{2}", 1),
    (_r("14/4"), "\\frac{7}{2}", 0),  # an unreduced fraction is wrong
    (_r("\\frac{14}{4}"), "\\frac{7}{2}", 0),
    (_r("3\\frac{1}{2}"), "\\frac{7}{2}", 1),  # a mixed number
    (_r("\\frac{1}{\\sqrt{2}}"), "\\frac{\\sqrt{2}}{2}", 1),
    (_r("\\frac{a+b}{2}"), "\\frac{a+b}{2}", 1),
    (_r("\\frac{a+b}{2}"), "\\frac{b+a}{2}", 0),  # upstream reads a+b/2 and b+a/2 (pylatexenc's frac)
    # roots, pi, powers
    (_r("2\\sqrt{3}"), "2\\sqrt3", 1),
    (_r("\\sqrt{12}"), "2\\sqrt{3}", 1),
    (_r("2\\pi"), "2\\pi", 1),
    (_r("\\pi \\cdot 2"), "2\\pi", 1),
    (_r("6.28"), "2\\pi", 0),
    (_r("2^{10}"), "1024", 0),  # an integer answer needs an integer; 2^{10} is not tried
    (_r("x^2+2x+1"), "(x+1)^2", 1),
    (_r("(x+1)^2"), "x^2+2x+1", 1),
    # units, degrees, percent, dollars, text
    (_r("90^\\circ"), "90", 1),
    (_r("90^{\\circ}"), "90", 1),
    (_r("90 degrees"), "90", 1),
    (_r("5\\text{ cm}"), "5", 1),
    (_r("5 \\mbox{cm}^2"), "5", 0),  # the ^2 stays: 5^2
    (_r("12 hours"), "12", 1),
    (_r("25\\%"), "25", 1),
    (_r("\\$18.90"), "18.90", 1),
    (_r("\\text{Monday}"), "\\text{monday}", 1),
    (_r("\\text{(B)}"), "B", 1),
    (_r("2 million"), "2000000", 0),  # 2*10^6 is not an integer string, and an integer needs one
    # equations, tuples, intervals
    (_r("x = 5"), "5", 1),
    (_r("k=5"), "5", 1),
    (_r("(1, 2)"), "(1,2)", 1),
    (_r("(2, 1)"), "(1,2)", 0),
    (_r("[1, 2)"), "(1,2)", 0),
    (_r("\\left( 1, \\frac{1}{2} \\right)"), "(1,\\frac{1}{2})", 1),
    (_r("1, 2"), "1,2", 1),
    (_r("3 or 4"), "3, 4", 1),
    # malformed model output
    (_r("\\frac{1}{"), "1", 0),
    (_r("\\sqrt"), "2", 0),
    (_r("abc def ghi"), "42", 0),
    (_r("1/0"), "1", 0),
    (_r("\\infty"), "\\infty", 1),
]


@pytest.mark.parametrize("response, label, expected", TABLE, ids=[f"{i}:{t[0][-30:]!r}={t[1]!r}" for i, t in
                                                                    enumerate(TABLE)])
def test_known_answers(response, label, expected):
    assert ds.reward(response, label) == expected


@pytest.mark.parametrize("latex, text", [
    ("\\frac{1}{2}", "1/2"),
    ("\\frac{a+b}{c}", "a+b/c"),
    ("\\frac12", "1/2"),
    ("\\sqrt{x+1}", "√(x+1)"),
    ("\\sqrt[3]{8}", "√(8)"),
    ("\\left(1,2\\right]", "(1,2]"),
    ("\\text{ cm}", "cm"),
    ("2\\times 3\\cdot 4", "2×3·4"),
    ("\\alpha+\\Delta", "α+Δ"),
    ("\\sin x", "sinx"),
    ("\\foo{3}", "3"),
])
def test_latex_to_text(latex, text):
    assert ds.latex_to_text(latex) == text


def test_unbalanced_latex_raises_and_normalize_keeps_the_text():
    with pytest.raises(ValueError):
        ds.latex_to_text("\\frac{1}{2")
    assert ds.normalize("\\frac{1}{2") == "\\frac12"  # braces dropped, the LaTeX left as it was


@pytest.mark.parametrize("given, truth, equal", [
    ("\\frac12", "\\frac{1}{2}", True), ("1/2", "\\frac{1}{2}", True), ("k = 3", "3", True),
    ("\\$5", "5", True), ("\\sqrt2", "\\sqrt{2}", True), ("2", "3", False),
])
def test_string_grader(given, truth, equal):
    assert ds.mathd_equal(given, truth) is equal
