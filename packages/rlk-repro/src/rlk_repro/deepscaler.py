"""The deepscaler rule reward (VIME's / slime's ``--rm-type deepscaler``), written here from its rule.

``reward(response, label)`` is 1 or 0:

1. **The solution part.** The text after the *last* ``</think>``; without one, the text between the first and the
   second ``###Response``; without either, the reward is 0 (a response that never closes its thinking earns
   nothing).
2. **The answer.** The *last* ``\\boxed`` of the solution part with its brace-balanced argument; an answer only
   when it reads ``\\boxed{...}`` exactly (``\\boxed 5``, an unbalanced brace or ``\\fbox{}`` alone give 0).
   An empty label gives 0; a label holding ``\\boxed{...}`` is unwrapped the same way.
3. **Equivalence**, either of two graders:

   - *string* (:func:`mathd_normalize`, Hendrycks' MATH normalisation): outer ``\\text{}`` dropped, line breaks,
     ``\\!``, ``\\left`` / ``\\right``, degrees, ``\\$``, ``\\%``, a right-hand unit ``\\text{ ...}`` and spaces
     removed, ``tfrac`` / ``dfrac`` -> ``frac``, ``.5`` -> ``0.5``, a short ``k =`` prefix dropped,
     ``\\sqrt3`` -> ``\\sqrt{3}``, ``\\frac12`` -> ``\\frac{1}{2}``, ``0.5`` and ``1/2`` -> ``\\frac{1}{2}``; equal
     strings are equal answers;
   - *symbolic* (:func:`sympy_equal`): a second normalisation (:func:`normalize`: ``$`` / ``%`` / unit words /
     ``million`` ... removed or expanded, integral floats as integers, LaTeX turned into plain text by
     :func:`latex_to_text`, mixed numbers ``7 3/4`` -> ``7+3/4``, braces and spaces dropped, lower case), then
     tuples / intervals compared element by element (same brackets, same length); two fractions ``a/b`` must be
     the same string (an unreduced fraction is wrong), an integer must match an integer, anything else is equal
     when sympy simplifies ``(truth) - (given)`` to 0 — not tried for expressions with more than two distinct
     letters, ``^{`` / ``^(`` or large powers (sympy could hang).

The LaTeX-to-text step is :func:`latex_to_text`, written to give what upstream's pylatexenc 2.x ``latex2text``
gives for the forms answers take: ``\\frac{a}{b}`` -> ``a/b`` with *no* parentheses (``\\frac{a+b}{2}`` reads
``a+b/2``, and is graded as upstream grades it), ``\\sqrt[n]{x}`` -> ``sqrt(x)`` (the degree is dropped),
``\\pi``, ``\\infty``, ``\\cdot``, ``\\times``, ``\\cup`` -> ``pi``, ``inf``, ``*``, ``*``, ``U``; text and font
macros keep their argument; spacing macros become a space; function names (``\\sin``) their name; other macros
their Unicode symbol (Greek letters) or nothing, their braced argument kept. Exotic LaTeX may grade differently
from upstream; the table in ``tests/repro/test_deepscaler.py`` pins the common forms (it was checked against
slime's reward hub with pylatexenc 2.11 installed: the same reward on every row).
"""

from __future__ import annotations

import re
import unicodedata

THINK_END, RESPONSE_MARK = "</think>", "###Response"


def solution_part(response: str) -> str | None:
    if THINK_END in response:
        return response.rsplit(THINK_END, 1)[1]
    if RESPONSE_MARK in response:
        return response.split(RESPONSE_MARK)[1]
    return None


def boxed_answer(text: str) -> str | None:
    """The argument of the last ``\\boxed{...}`` (None: no ``\\boxed``, unbalanced, or not of that form)."""
    start = text.rfind("\\boxed")
    if start < 0:
        return None
    depth = 0
    for i in range(start, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                whole = text[start : i + 1]
                return whole[len("\\boxed{") : -1] if whole.startswith("\\boxed{") else None
    return None


def reward(response: str, label: str | int | float) -> int:
    """1 when the response's final boxed answer equals ``label`` under either grader, else 0."""
    part = solution_part(response)
    if part is None:
        return 0
    given = boxed_answer(part)
    if given is None:
        return 0
    truth = str(label)
    if truth == "":
        return 0
    if "\\boxed" in truth:
        truth = boxed_answer(truth)
        if truth is None:
            return 0
    return int(mathd_equal(given, truth) or sympy_equal(given, truth))


# -- the string grader -----------------------------------------------------------------------------------
_OUTER_TEXT = re.compile(r"^\\text\{(?P<text>.+?)\}$")


class _Keep(Exception):
    """A normalisation step that cannot apply: the answer is compared as it was."""


def _frac_args(s: str) -> str:
    head, *parts = s.split("\\frac")
    out = head
    for part in parts:
        out += "\\frac"
        if part[:1] == "{":
            out += part
            continue
        if len(part) < 2:
            return s
        a, b, rest = part[0], part[1], part[2:]
        out += "{" + a + "}" + ("{" + b + "}" + rest if b != "{" else b + rest)
    return out


def _slash_frac(s: str) -> str:
    parts = s.split("/")
    if len(parts) != 2:
        return s
    try:
        a, b = int(parts[0]), int(parts[1])
    except ValueError:
        return s
    return f"\\frac{{{a}}}{{{b}}}" if s == f"{a}/{b}" else s


def _sqrt_args(s: str) -> str:
    head, *parts = s.split("\\sqrt")
    out = head
    for part in parts:
        if not part:
            raise _Keep
        out += "\\sqrt" + (part if part[0] == "{" else "{" + part[0] + "}" + part[1:])
    return out


def mathd_normalize(answer: str) -> str:
    answer = answer.strip()
    m = _OUTER_TEXT.search(answer)
    if m is not None:
        answer = m.group("text").strip()
    s = answer.replace("\n", "").replace("\\!", "").replace("\\\\", "\\")
    s = s.replace("tfrac", "frac").replace("dfrac", "frac").replace("\\left", "").replace("\\right", "")
    s = s.replace("^{\\circ}", "").replace("^\\circ", "").replace("\\$", "")
    if "\\text{ " in s:  # a unit on the right
        pieces = s.split("\\text{ ")
        if len(pieces) != 2:
            return answer
        s = pieces[0]
    s = s.replace("\\%", "").replace(" .", " 0.").replace("{.", "{0.")
    if not s:
        return s
    if s[0] == ".":
        s = "0" + s
    sides = s.split("=")
    if len(sides) == 2 and len(sides[0]) <= 2:
        s = sides[1]
    try:
        s = _sqrt_args(s)
    except _Keep:
        return answer
    s = _frac_args(s.replace(" ", ""))
    if s == "0.5":
        s = "\\frac{1}{2}"
    return _slash_frac(s)


def mathd_equal(given: str, truth: str) -> bool:
    return mathd_normalize(truth) == mathd_normalize(given)


# -- LaTeX to plain text -----------------------------------------------------------------------------------
_SYMBOLS = {"pi": "π", "infty": "∞", "cdot": "·", "times": "×", "cup": "∪", "cap": "∩", "circ": "∘", "le": "≤",
            "leq": "≤", "ge": "≥", "geq": "≥", "neq": "≠", "pm": "±", "mp": "∓", "div": "÷", "to": "→",
            "in": "∈", "emptyset": "∅", "varnothing": "∅", "ldots": "…", "cdots": "⋯", "dots": "…",
            "degree": "°", "prime": "′", "%": "%", "$": "$", "{": "{", "}": "}", "_": "_", "&": "&", "#": "#"}
_ARG_KEEPING = {"text", "textrm", "textbf", "textit", "textup", "mathrm", "mathbf", "mathit", "mathsf", "mathtt",
                "mbox", "operatorname", "boldsymbol", "bm", "displaystyle", "textstyle", "mathbb", "mathcal",
                "overline", "underline", "hat", "bar", "vec", "tilde", "widehat"}
_SPACES = {",", ";", ":", " ", "quad", "qquad", "enspace", "thinspace", "medspace", "thickspace"}
_DROPPED = {"left", "right", "big", "Big", "bigg", "Bigg", "bigl", "bigr", "Bigl", "Bigr", "!", "limits",
            "displaystyle", "textstyle"}
_FUNCTIONS = {"sin", "cos", "tan", "cot", "sec", "csc", "arcsin", "arccos", "arctan", "sinh", "cosh", "tanh", "log",
              "ln", "lg", "exp", "lim", "max", "min", "gcd", "det", "deg", "arg", "sup", "inf"}


class _Latex:
    def __init__(self, s: str) -> None:
        self.s, self.i = s, 0

    def text(self, until: str | None = None) -> str:
        out = []
        while self.i < len(self.s):
            c = self.s[self.i]
            if until is not None and c == until:
                self.i += 1
                return "".join(out)
            if c == "{":
                self.i += 1
                out.append(self.text("}"))
            elif c == "\\":
                out.append(self.macro())
            elif c == "~":
                self.i += 1
                out.append(" ")
            else:
                self.i += 1
                out.append(c)
        if until is not None:
            raise ValueError("unbalanced braces")
        return "".join(out)

    def arg(self) -> str:
        while self.i < len(self.s) and self.s[self.i] == " ":
            self.i += 1
        if self.i >= len(self.s):
            return ""
        c = self.s[self.i]
        if c == "{":
            self.i += 1
            return self.text("}")
        if c == "\\":
            return self.macro()
        self.i += 1
        return c

    def optional(self) -> str:
        if self.s[self.i : self.i + 1] != "[":
            return ""
        end = self.s.find("]", self.i)
        if end < 0:
            raise ValueError("unclosed [")
        inner, self.i = self.s[self.i + 1 : end], end + 1
        return _Latex(inner).text().strip()

    def macro(self) -> str:
        m = re.compile(r"\\([A-Za-z]+|.)").match(self.s, self.i)
        if m is None:
            self.i += 1
            return ""
        name, self.i = m.group(1), m.end()
        if name.isalpha():  # a control word swallows the spaces after it
            while self.s[self.i : self.i + 1] == " ":
                self.i += 1
        if name in ("frac", "dfrac", "tfrac", "nicefrac", "cfrac"):
            num, den = self.arg(), self.arg()
            return num + "/" + den
        if name == "sqrt":
            self.optional()
            return "√(" + self.arg() + ")"
        if name in _ARG_KEEPING:
            return self.arg() if name not in ("displaystyle", "textstyle") else ""
        if name in _SPACES:
            return " "
        if name in _DROPPED:
            return ""
        if name in _SYMBOLS:
            return _SYMBOLS[name]
        if name in _FUNCTIONS:
            return name
        try:
            return unicodedata.lookup(f"GREEK {'CAPITAL' if name[0].isupper() else 'SMALL'} LETTER {name.upper()}")
        except KeyError:
            return ""


def latex_to_text(expr: str) -> str:
    return _Latex(expr).text().strip()


# -- the symbolic grader -------------------------------------------------------------------------------------
_UNITS = ("degree", "cm", "centimeter", "meter", "mile", "second", "minute", "hour", "day", "week", "month",
          "year", "foot", "feet", "inch", "yard")
_PLAIN = {"√": "sqrt", "π": "pi", "∞": "inf", "∪": "U", "·": "*", "×": "*"}
_BAD_SUBSTRINGS = ("^{", "^(")
_BAD_POWERS = (re.compile(r"\^[0-9]+\^"), re.compile(r"\^[0-9][0-9]+"))
_BRACKETS = "()[]"
_THOUSANDS = re.compile(r"(\d)(,)(\d\d\d)($|\D)")
_FRACTION = re.compile(r"^-?[0-9]+.?/0*[1-9][0-9]*.?$")


def _float(s: str) -> float | None:
    try:
        return float(s)
    except (ValueError, OverflowError):
        return None


def _integral(x: float) -> bool:
    try:
        return abs(x - round(x)) <= 1e-7
    except (ValueError, OverflowError):
        return False


def _drop_thousands(expr: str) -> str:
    while True:
        nxt = _THOUSANDS.sub(r"\1\3\4", expr)
        if nxt == expr:
            return nxt
        expr = nxt


def _str_integral(s: str) -> bool:
    x = _float(_drop_thousands(s))
    return x is not None and _integral(x)


def _latex_plain(expr: str) -> str:
    text = latex_to_text(expr.replace("\\tfrac", "\\frac").replace("\\dfrac", "\\frac").replace("\\frac", " \\frac"))
    for sym, plain in _PLAIN.items():
        text = text.replace(sym, plain)
    return text.strip()


def normalize(expr: str) -> str:
    m = _OUTER_TEXT.search(expr)
    if m is not None:
        expr = m.group("text")
    expr = expr.replace("\\%", "%").replace("\\$", "$").replace("$", "").replace("%", "")
    expr = expr.replace(" or ", " , ").replace(" and ", " , ")
    expr = expr.replace("million", "*10^6").replace("billion", "*10^9").replace("trillion", "*10^12")
    for unit in _UNITS:
        expr = re.sub(rf"{unit}(es)?(s)? *(\^[0-9]+)?", "", expr)
    expr = re.sub(r"\^ *\\circ", "", expr)
    if expr[:1] == "{" and expr[-1:] == "}":
        expr = expr[1:-1]
    expr = re.sub(r",\\! *", "", expr)
    x = _float(expr)
    if x is not None and _integral(x):
        expr = str(round(x))
    if "\\" in expr:
        try:
            expr = _latex_plain(expr)
        except (ValueError, RecursionError):
            pass
    expr = re.sub("- *", "-", expr)
    expr = re.sub("([0-9]) +([0-9])", r"\1+\2", expr)  # a mixed number: 7 3/4 -> 7+3/4
    expr = expr.replace(" ", "").replace("{", "").replace("}", "").lower()
    if _str_integral(expr):
        expr = str(int(float(expr.replace(",", ""))))
    return expr


def _elements(expr: str) -> list[str]:
    expr = _drop_thousands(expr)
    if not expr:
        return []
    if len(expr) > 2 and expr[0] in _BRACKETS and expr[-1] in _BRACKETS and \
            not any(c in expr[1:-1] for c in _BRACKETS):
        return [e.strip() for e in expr[1:-1].split(",")]
    return [expr]


def _may_evaluate(expr: str) -> bool:
    letters = {c for c in expr.replace("sqrt", "").replace("frac", "") if c.isalpha()}
    return len(letters) <= 2 and not any(b in expr for b in _BAD_SUBSTRINGS) and \
        not any(r.search(expr) for r in _BAD_POWERS)


def _sympy_zero(truth: str, given: str) -> bool:
    import sympy
    from sympy.parsing import sympy_parser

    expr = f"({truth})-({given})"
    if not _may_evaluate(expr):
        return False
    names = {k: v for k, v in vars(sympy).items() if not k.startswith("_")}
    transformations = sympy_parser.standard_transformations + (sympy_parser.implicit_multiplication_application,)
    try:
        parsed = sympy_parser.parse_expr(expr.replace("^", "**"), local_dict={},
                                         global_dict={"__builtins__": {}, **names}, transformations=transformations)
        return sympy.simplify(parsed) == 0
    except Exception:  # anything sympy cannot parse or simplify is simply not shown equal
        return False


def sympy_equal(given: str, truth: str) -> bool:
    t, g = normalize(truth), normalize(given)
    if t == g:
        return True
    if not g:
        return False
    te, ge = _elements(t), _elements(g)
    if len(te) > 1 and (t[0] != g[0] or t[-1] != g[-1]):
        return False
    if len(te) != len(ge):
        return False
    for a, b in zip(te, ge):
        if _FRACTION.search(a) and _FRACTION.search(b):
            ok = a == b  # an unreduced fraction is not the answer
        elif _str_integral(a) != _str_integral(b):
            ok = False  # an integer answer needs an integer
        else:
            ok = _sympy_zero(a, b)
        if not ok:
            return False
    return True
