"""lever.model.gbnf: llama.cpp's GBNF as the engine's Lark, the same text llguidance's own
converter writes on every grammar generated here, in linear time, and its errors one line."""

from __future__ import annotations

import random

import pytest
from llguidance.gbnf_to_lark import gbnf_to_lark

from lever.model.gbnf import GbnfError, to_lark

JSON_GBNF = r'''# JSON, as llama.cpp's grammars write it
root   ::= object
value  ::= object | array | string | number | ("true" | "false" | "null") ws

object ::=
  "{" ws (
            string ":" ws value
    ("," ws string ":" ws value)*
  )? "}" ws

array  ::=
  "[" ws (
            value
    ("," ws value)*
  )? "]" ws

string ::=
  "\"" (
    [^"\\\x7F\x00-\x1F] |
    "\\" (["\\bfnrt] | "u" [0-9a-fA-F]{4}) # escapes
  )* "\"" ws

number ::= ("-"? ([0-9] | [1-9] [0-9]{0,15})) ("." [0-9]+)? ([eE] [-+]? [0-9] [1-9]{0,15})? ws
ws ::= | " " | "\n" [ \t]{0,20}
'''


def random_gbnf(rng: random.Random) -> str:
    """A grammar of 1-8 rules using every construct: literals with escapes, classes, `.`,
    groups, alternatives, all repetitions, references (to root too, and cycles), comments,
    dashed and camelCase names, rules over several lines."""
    names = ["root", *(rng.choice(["r", "item-", "fooBar", "x_"]) + str(i) for i in range(1, rng.randint(1, 8)))]

    def item(d: int) -> str:
        k = rng.randrange(6 if d < 3 else 4)
        if k == 0:
            return '"' + rng.choice(["a", "bc", "\\n", '\\"', "\\x41", "\\u00e9", "\\\\", " "]) + '"'
        if k == 1:
            return rng.choice(["[a-z]", "[^\\n]", "[0-9]", ".", '[^"\\\\]', "[/]"])
        if k == 2:
            return rng.choice(names)
        if k == 3:
            return '"z"'
        return "(" + (alternatives(d + 1) if k == 4 else sequence(d + 1)) + ")"

    def sequence(d: int) -> str:
        reps = ["", "", "*", "+", "?", "{2}", "{1,3}", "{0,}", "{ 2 , 4 }"]
        return " ".join(item(d) + rng.choice(reps) for _ in range(rng.randint(1, 3)))

    def alternatives(d: int) -> str:
        sep = rng.choice([" | ", " |\n    "])
        return sep.join(sequence(d) for _ in range(rng.randint(1, 3)))

    rules = [f"{n} ::= {alternatives(0)}" + (f"  # about {n}" if rng.random() < 0.2 else "") for n in names]
    return ("# generated\n" if rng.random() < 0.3 else "") + "\n".join(rules) + rng.choice(["", "\n", "\n\n"])


@pytest.mark.parametrize("seed", range(8))
def test_the_lark_equals_llguidances_own_converters(seed):
    rng = random.Random(seed)
    grammars = [random_gbnf(rng) for _ in range(60)] + [JSON_GBNF, 'root ::= "a"{5,5}', 'root ::= "x = " [0-9]+']
    for g in grammars:
        try:
            want = gbnf_to_lark(g)
        except Exception:  # theirs refused it (a name clash after renaming, say): ours must too
            with pytest.raises(GbnfError):
                to_lark(g)
            continue
        assert to_lark(g) == want, g


def test_a_chain_of_rules_converts_in_one_pass():
    """16,000 rules each referring to the next: the rule that waits on a count is settled once
    (llguidance's sweep took minutes here); all of them are terminals of one lexeme."""
    n = 16_000
    g = "root ::= r0\n" + "\n".join(f'r{i} ::= r{i + 1} "a"' for i in range(n)) + f'\nr{n} ::= "b"'
    lark = to_lark(g)
    assert lark.count("\n") > n and "R15999: R16000 \"a\"" in lark and lark.splitlines()[2] == "start: R0"


@pytest.mark.parametrize("grammar, words", [
    ('root ::= "a', "unexpected end of input at line 1"),
    ("root ::= x", "rule 'root' refers to 'x', which is not defined"),
    ('item ::= "a"', "no 'root' rule"),
    ('root ::= "a"\nstart ::= "b"', "a rule named 'start'"),
    ('root ::= "\\q"', "invalid escape sequence \\\\q at line 1"),
    ('root ::= "a"{x}', "expected an integer at line 1"),
    ("root ::= " + "(" * 65 + '"a"' + ")" * 65, "groups nested over 64 deep"),
    ('root ::= "a"\nfoo-bar ::= "x"\nfoo_bar ::= "y"', "Lark name 'FOO_BAR' is another rule's"),
])
def test_a_bad_grammar_is_one_line_naming_where(grammar, words):
    with pytest.raises(GbnfError, match=words) as e:
        to_lark(grammar)
    assert "\n" not in str(e.value)
