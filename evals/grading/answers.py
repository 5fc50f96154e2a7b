"""Reading answers out of outputs, and the notation removed before answers are compared.

Extraction: the contents of \\boxed{...} groups (math) and the letter of a multiple-choice answer
(GPQA). Normalisation: what a gold or a boxed answer may carry that means nothing to its value
(dollar signs, thousands separators, a trailing period, a trailing modulus), and the facts the
comparison needs to keep from it (a percent sign, a set written in braces, a base subscript).

Every pattern here runs over model output of any length, so none may backtrack on long runs of one
character: repeated parts are single character classes, or alternatives that start with different
characters (`extract_choice` on "answer" and 10^5 spaces stays linear).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# --- extraction ----------------------------------------------------------------------------------

_BOX_OPEN = re.compile(r"\\(?:boxed|fbox)\s*\{")
BRACE_TOKEN = re.compile(r"\\.|[{}]", re.DOTALL)  # an escaped character, or a brace

# What may stand between "answer" and its letter: spaces, markdown emphasis, colons, dashes, equals
# signs, quotes, dollar signs, an opening parenthesis or bracket, "is", "option", LaTeX's math
# delimiters \( and \[, and LaTeX wrappers (\boxed{, \text{, ...). Each alternative starts with
# characters no other one starts with, so no text makes the pattern backtrack.
_FILLER = (r"""(?:[\s*_:\-=$"'`“”‘’(\[]|(?i:is)\b|(?i:option)\b"""
           r"""|\\(?:[(\[]|(?:boxed|text|textbf|mathrm|mathbf)\s?\{))*""")
_LETTER = r"([A-D])(?![A-Za-z0-9])"
_STATED_CHOICE = (
    # "Answer: C", "**Answer:** C", "Answer: $D$", "Answer: \"C\"", "Final answer: (C)",
    # "the answer is **C**", "Answer: \boxed{\text{B}}", "Answer: \(\mathbf{B}\)", "Answer: [B]",
    # "Answer: Option B", "Answer - B", "Answer = B".
    re.compile(r"(?i:answer)" + _FILLER + _LETTER),
    re.compile(r"\\boxed\s?\{" + _FILLER + _LETTER),
)
_BARE_CHOICE = re.compile(r"\(([A-D])\)")
_LEADING_CHOICE = re.compile(r"[\s*_#]*\(?([A-D])[.):](?=\s|$)")  # an answer that starts "D. ..."


def extract_choice(text: str) -> str | None:
    """The multiple-choice letter (A-D) a text answers with, or None: the letter of the last
    "Answer: X" (with the variants above, or "\\boxed{X}"), else of the last "(X)", else the letter
    the text starts with ("D. because ...")."""
    stated = [match for pattern in _STATED_CHOICE for match in pattern.finditer(text)]
    if stated:
        return max(stated, key=lambda match: match.start()).group(1)
    bare = list(_BARE_CHOICE.finditer(text))
    if bare:
        return bare[-1].group(1)
    leading = _LEADING_CHOICE.match(text)
    return leading.group(1) if leading else None


def boxed_contents(text: str) -> list[str]:
    """The contents of the complete top-level \\boxed{...} / \\fbox{...} groups of `text`, in order.

    Braces are matched, escaped ones (\\{, \\}) skipped; a box nested in another is part of the
    outer content, and an unclosed box (a cut-off output) ends the search.
    """
    contents = []
    position = 0
    while (opening := _BOX_OPEN.search(text, position)) is not None:
        depth = 1
        for token in BRACE_TOKEN.finditer(text, opening.end()):
            depth += {"{": 1, "}": -1}.get(token.group(), 0)
            if depth == 0:
                contents.append(text[opening.end():token.start()].strip())
                position = token.end()
                break
        else:
            break
    return contents


# --- normalisation -------------------------------------------------------------------------------

# Thousands separated by a LaTeX space or a braced comma ("70\,000", "1\ 000", "10{,}080").
_SPACED_THOUSANDS = re.compile(r"(?<=\d)(?:\\,|\\;|\\:|\\ |~|\{,\})(?=\d{3}(?!\d))")
_NEGATIVE_SPACE = re.compile(r"\\!\s*")  # "\!", MATH's kerning in "10,\!080" and "11,\! 111"
# A whole answer that is one number with thousands commas or plain spaces ("2,125", "1 000 000");
# "2500,7500" or "1,3,5" are lists, and "1 2" is not a number.
_COMMA_THOUSANDS = re.compile(r"[+-]?[1-9]\d{0,2}(?:,\d{3})+(?:\.\d+)?")
_SPACE_THOUSANDS = re.compile(r"[+-]?[1-9]\d{0,2}(?: \d{3})+(?:\.\d+)?")
_DECIMAL_COMMA = re.compile(r"([+-]?\d+),(\d+)")
# What `split_answers` reads: an escaped character ("\\,", "\\{") or a number with thousands
# commas ("1,000.99", not the "2,100" of "1,2,100"), which it skips, and commas and brackets (group 1).
_ANSWER_TOKEN = re.compile(r"\\.|(?<![\d,.])[1-9]\d{0,2}(?:,\d{3})+(?!\d|,\d)|([,()\[\]{}])", re.DOTALL)
_PERCENT = re.compile(r"\\?%")
# A modulus after a residue names the modulus, not part of the value ("3 \\pmod{7}", "3 \\bmod 7",
# "3 \\mod 7", "3 \\ (\\text{mod } 7)", "3 \\text{ (mod 7)}"); math-verify reads "\\pmod{7}" as p*m*o*d*7.
# Each alternative starts with a fixed "\\" or "(", so a search stays linear.
_MODULUS_VALUE = r"(?:\{[^{}]*\}|\\?\w+)"
_TRAILING_MODULUS = re.compile(
    r"(?:\\[pb]?mod\b\s*" + _MODULUS_VALUE
    + r"|(?:\\left\s*)?\(\s*(?:\\(?:text|mathrm|operatorname|textrm|rm)\s*\{\s*mod\s*\}|\\[pb]?mod\b|mod\b)"
    + r"(?:\s|\\[ ,;:]|~)*" + _MODULUS_VALUE + r"\s*(?:\\right\s*)?\)"
    + r"|\\text\s*\{\s*\(\s*mod\s*\w+\s*\)\s*\})\s*$")
_LATEX_SPACES = ("\\ ", "\\,", "\\;", "\\:", "\\quad", "\\qquad", "~")
# A numeral with its base as a subscript, as MATH writes them: "52_8", "2516_{8}", "A1_{16}".
_BASE_NUMERAL = re.compile(r"(?=[0-9A-Za-z]*\d)([0-9A-Za-z]+)_\{?\s*(?:\\text\{\s*)?(\d{1,2})\s*\}?\}?")
_SET_BRACES = (("\\{", "\\}"), ("{", "}"))
# "I_{\max} = ...", "n_{\gamma}(\nu) = ...", "\Phi(x, y) = ...": a name (a letter or a Greek letter,
# with subscripts and arguments) defined by the rest of the answer.
_DEFINITION = re.compile(r"(?:[A-Za-z]|\\[A-Za-z]+)(?:\s*[_^](?:\{[^{}=]*\}|\\?[A-Za-z0-9]+))*\s*"
                         r"(?:\\left\s*)?(?:\([^()=]*\))?\s*(?:\\right\s*)?=(?![=<>])")


@dataclass(frozen=True)
class Answer:
    """A gold or a boxed answer after normalisation: `text` without the notation that means nothing
    to its value, `percent` whether it carried a percent sign."""

    text: str
    percent: bool = False


def normalize(text: str) -> Answer:
    """See the module docstring."""
    percent = _PERCENT.search(text) is not None
    text = _PERCENT.sub("", text.replace("\\$", "").replace("$", ""))
    text = _NEGATIVE_SPACE.sub("", text).strip().rstrip(".").strip()
    text = _without_modulus(text)
    text = _SPACED_THOUSANDS.sub("", text)
    if _COMMA_THOUSANDS.fullmatch(text):
        text = text.replace(",", "")
    elif _SPACE_THOUSANDS.fullmatch(text):
        text = text.replace(" ", "")
    return Answer(text, percent)


def _without_modulus(text: str) -> str:
    """`text` without a trailing modulus (`_TRAILING_MODULUS`) and the spacing before it."""
    modulus = _TRAILING_MODULUS.search(text)
    if modulus is None or modulus.start() == 0:
        return text
    end = modulus.start()
    while True:  # one space at a time: "\\ " must go whole, not as a stray "\\" left by rstrip()
        space = next((space for space in _LATEX_SPACES if text.endswith(space, 0, end)), None)
        if space is not None:
            end -= len(space)
        elif end and text[end - 1].isspace():
            end -= 1
        else:
            return text[:end]


def definition(text: str) -> tuple[str, str] | None:
    """(name, value) of an answer that defines one name ("I_{\\max} = \\frac{q}{2}"), else None."""
    match = _DEFINITION.match(text)
    if match is None or "=" in text[match.end():] or not text[match.end():].strip():
        return None
    return re.sub(r"\s+", "", text[:match.end() - 1]), text[match.end():].strip()


def decimal_comma(text: str) -> str | None:
    """"1000,99" as "1000.99" when the comma cannot be a thousands separator ("1,22", "0,111"), else
    None. Only an answer is read so, against a gold that is one number but not an integer: "-2,1"
    and "2500,7500" are also lists, and the benchmarks' golds write every list so."""
    match = _DECIMAL_COMMA.fullmatch(text)
    if match is None or (len(match.group(2)) == 3 and match.group(1).lstrip("+-") != "0"):
        return None
    return f"{match.group(1)}.{match.group(2)}"


def repair_gold(gold: str) -> str:
    """A gold cut out of a solution by a regex that did not match braces ("3} \\pmod{7") ends at its
    first unmatched "}"; balanced golds come back unchanged."""
    depth = 0
    for token in BRACE_TOKEN.finditer(gold):
        if token.group() == "{":
            depth += 1
        elif token.group() == "}":
            if depth == 0:
                return gold[:token.start()]
            depth -= 1
    return gold


def set_braces(text: str) -> tuple[str, str] | None:
    """The braces ("\\{", "\\}") or ("{", "}") when `text` is one set written in them, else None."""
    for opening, closing in _SET_BRACES:
        inner = text[len(opening):-len(closing)]
        if (len(text) > len(opening) + len(closing) and text.startswith(opening) and text.endswith(closing)
                and (opening == "{" or opening not in inner) and _balanced(inner)):
            return opening, closing
    return None


def _balanced(text: str) -> bool:
    depth = 0
    for token in BRACE_TOKEN.finditer(text):
        depth += {"{": 1, "}": -1}.get(token.group(), 0)
        if depth < 0:
            return False
    return depth == 0


def split_answers(text: str) -> list[str]:
    """The comma-separated answers `text` holds: split at bracket depth 0, or inside the braces of a
    set that is the whole text ("{1,2,3}" holds three). A LaTeX space ("4,\\,-8") or a thousands
    comma in a sentence ("it's 1,000.99") separates nothing."""
    braces = set_braces(text)
    if braces is not None:
        text = text[len(braces[0]):-len(braces[1])]
    answers, depth, start = [], 0, 0
    for token in _ANSWER_TOKEN.finditer(text):
        if token.group(1) in ("(", "[", "{"):
            depth += 1
        elif token.group(1) in (")", "]", "}"):
            depth -= 1
        elif token.group(1) == "," and depth == 0:
            answers.append(text[start:token.start()].strip())
            start = token.end()
    return [*answers, text[start:].strip()]


def base_numeral(text: str) -> tuple[str, int] | None:
    """(digits, base) of a numeral written with its base as a subscript ("52_8"), else None."""
    match = _BASE_NUMERAL.fullmatch(text)
    if match is None or not 2 <= int(match.group(2)) <= 36:
        return None
    digits, base = match.group(1).upper(), int(match.group(2))
    try:
        int(digits, base)
    except ValueError:  # "19_8": not a numeral of that base, so a subscript of something else
        return None
    return digits, base
