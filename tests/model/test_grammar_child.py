"""lever.model.grammar_child: a compile past its time is killed, one that crashes or runs out of
memory kills only the child, the engine's refusals come back in one line, the next compile
gets a fresh child, and the bytes measured are what the matcher holds."""

from __future__ import annotations

import llguidance as llg
import pytest

from lever.model.grammar import matcher_limits
from lever.model.grammar_child import CompileProcess, CompileRefused
from tests.model.test_bounds import ref_chain

SMALL = llg.LLMatcher.grammar_from_lark('start: "a" | "b"')


def props(n: int, objects: int = 1) -> str:
    """A schema the engine compiles in more than linear time in its properties (0.1 s at 1,000
    on this kind of machine): objects of n properties each."""
    inner = {"type": "object", "properties": {f"q{j}": {"type": "integer"} for j in range(n)}}
    return llg.LLMatcher.grammar_from_json_schema({"type": "object", "properties": {f"p{i}": inner
                                                                                 for i in range(objects)}})


@pytest.fixture
def compiler():
    with CompileProcess(n_vocab=4096, specials={"<|end|>": 4095}, eos_id=4095, limits=matcher_limits()) as c:
        yield c


LOADED_S = 120.0  # a child's start and its crash on a machine whose cores are busy with other work


def test_the_bytes_measured_grow_with_the_grammar(compiler):
    small, big = compiler.check(SMALL), compiler.check(props(1000))
    assert 0 < small < 1 << 20 < big < 64 << 20
    assert compiler.check(props(1000)) == pytest.approx(big, rel=0.2)  # the same again, in a warm child


def test_a_compile_past_its_time_is_killed_and_the_next_gets_a_fresh_child(compiler):
    slow = props(900, objects=4)
    with pytest.raises(CompileRefused, match=r"took over 0.01 s to compile; refused"):
        compiler.check(slow, timeout_s=0.01)
    assert compiler.kills == 1 and compiler.check(SMALL) > 0


def test_a_crash_kills_only_the_child(compiler):
    """A chain of 3,000 $refs overflows the engine's stack (SIGSEGV): the bounds keep it out
    (lever.model.bounds); here it goes straight to the child."""
    chain = llg.LLMatcher.grammar_from_json_schema(ref_chain(3000))
    with pytest.raises(CompileRefused, match=r"the grammar engine died compiling it \(exit -11"):
        compiler.check(chain, timeout_s=LOADED_S)  # the crash, not the clock, must end it on a busy machine
    assert compiler.check(SMALL) > 0


def test_a_compile_past_the_childs_memory_is_refused():
    with CompileProcess(data_limit_bytes=16 << 20) as c:
        with pytest.raises(CompileRefused, match=r"died compiling it|ran out of memory"):
            c.check(llg.LLMatcher.grammar_from_json_schema({"type": "string", "pattern": "^(a{300}){300}$"}))
        assert c.check(SMALL) > 0


@pytest.mark.parametrize("text, words", [("start: ((", "Expected token"), ("start: <[5000]>", "oken")])
def test_the_engines_refusals_are_one_line(compiler, text, words):
    with pytest.raises(CompileRefused, match=words) as e:
        compiler.check(llg.LLMatcher.grammar_from_lark(text))
    assert "\n" not in str(e.value)


def test_special_tokens_are_known_by_name_and_id(compiler):
    assert compiler.check(llg.LLMatcher.grammar_from_lark('start: <|end|> | <[4095]> "x"')) > 0


def test_a_closed_compiler_refuses_at_once(compiler):
    compiler.close()
    with pytest.raises(CompileRefused, match="closed"):
        compiler.check(SMALL)
