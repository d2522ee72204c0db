"""lever.api on the shipped pair (and the Qwen pair's chat template when it can be fetched):
the API's text and tokens are the pipeline's, stop strings end the text where they begin, streams
add up to the completion, and bad arguments get one line."""

from __future__ import annotations

import json
import threading

import pytest

import lever
from lever.api import Cancelled
from lever.config import load_config
from lever.errors import LeverError
from lever.gguf.chat_template import CHATML, ChatTemplate
from lever.pipelines.engine import run_pipeline
from lever.pipelines.text import TextStream
from lever.shipped import shipped

PROMPT = "def parse_args(argv):"
N = 40
TEMPLATE = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")


@pytest.fixture(scope="module")
def llm():
    with lever.load(shipped("default.toml"), chat_template=TEMPLATE) as m:
        yield m


@pytest.fixture(scope="module")
def full(llm):
    return llm.generate(PROMPT, max_tokens=N)


def test_generate_is_the_pipelines_greedy_output(llm, full):
    cfg = load_config(shipped("default.toml"), [f"generate.n_predict={N}"])
    res = run_pipeline(cfg, PROMPT)
    assert list(full.tokens) == res.tokens and full.text == res.text
    assert full.finish_reason == "length" and full.usage.completion_tokens == N
    assert full.usage.prompt_tokens == len(llm.tokenizer.encode(PROMPT))
    assert full.usage.total_tokens == full.usage.prompt_tokens + N
    assert llm.generate(PROMPT, max_tokens=N).tokens == full.tokens  # the open engine gives the same again


def test_a_stop_string_across_tokens_ends_the_text_where_it_begins(llm, full):
    pieces = [llm.tokenizer.decode(full.tokens[: i + 1]) for i in range(len(full.tokens))]
    # a boundary inside the text whose two sides both have characters: the stop string spans it
    i = next(i for i in range(3, len(pieces) - 1) if len(pieces[i]) > len(pieces[i - 1]) + 1
             and len(pieces[i + 1]) > len(pieces[i]) + 1)
    stop = pieces[i][-2:] + pieces[i + 1][len(pieces[i]) : len(pieces[i]) + 2]
    first = full.text.find(stop)
    c = llm.generate(PROMPT, max_tokens=N, stop=["never in this text \x00", stop])
    assert c.finish_reason == "stop"
    assert c.text == full.text[:first] and stop not in c.text
    assert c.tokens == full.tokens[: len(c.tokens)]  # lossless: a prefix of the greedy tokens
    assert llm.tokenizer.decode(c.tokens).find(stop) == first  # the last token completed it
    assert stop not in llm.tokenizer.decode(c.tokens[:-1])


def test_the_stream_adds_up_to_the_completion_and_holds_back_stop_strings(llm, full):
    chunks = list(llm.stream(PROMPT, max_tokens=N))
    assert "".join(c.text for c in chunks) == full.text
    assert sum(c.n_tokens for c in chunks) == N
    assert [c.finish_reason for c in chunks] == [None] * (len(chunks) - 1) + ["length"]
    assert len(chunks) > 2  # streamed pass by pass, not at the end
    stop = full.text[len(full.text) // 2 : len(full.text) // 2 + 3]
    shown = ""
    for c in llm.stream(PROMPT, max_tokens=N, stop=stop):
        shown += c.text
        assert stop not in shown
    assert shown == full.text[: full.text.find(stop)]


def test_leaving_a_stream_early_cancels_it_and_the_engine_goes_on(llm, full):
    for i, _ in enumerate(llm.stream(PROMPT, max_tokens=N)):
        if i == 1:
            break
    assert llm.generate(PROMPT, max_tokens=N).tokens == full.tokens


def test_a_cancelled_generation_ends_at_its_next_pass(llm):
    cancel = threading.Event()
    chunks = []
    for c in llm.stream(PROMPT, max_tokens=N, cancel=cancel):
        chunks.append(c)
        cancel.set()
    assert chunks[-1].finish_reason == "cancelled" and 0 < sum(c.n_tokens for c in chunks) < N
    with pytest.raises(Cancelled):  # cancelled while it waited: it never starts
        llm.generate(PROMPT, max_tokens=N, cancel=cancel)


def test_chat_renders_the_template_and_generates_from_it(llm):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "import os"}]
    text = llm.chat_template.render(msgs)
    assert text == "<system>Be brief.\n<user>import os\n<assistant>"
    c = llm.chat(msgs, max_tokens=16)
    assert c.tokens == llm.generate(text, max_tokens=16).tokens
    streamed = "".join(ch.text for ch in llm.stream_chat(msgs, max_tokens=16))
    assert streamed == c.text


@pytest.mark.parametrize("kwargs, names", [
    ({"temperature": float("nan")}, "temperature"), ({"max_tokens": -1}, "max_tokens"),
    ({"max_tokens": 0}, "max_tokens"), ({"max_tokens": 2.5}, "max_tokens"), ({"top_p": 0}, "top_p"),
    ({"seed": -2}, "seed"), ({"stop": 3}, "stop"), ({"stop": [""]}, "stop"), ({"stop": ["x"] * 17}, "stop"),
    ({"max_tokens": 2**31}, "max_tokens"), ({"temp": 1.0}, "temp"), ({"max_tokens": True}, "max_tokens"),
])
def test_bad_arguments_get_one_line_naming_them(llm, kwargs, names):
    with pytest.raises(LeverError, match=names) as e:
        llm.generate(PROMPT, **kwargs)
    assert "\n" not in str(e.value)
    with pytest.raises(LeverError, match=names):
        llm.stream(PROMPT, **kwargs)  # at the call, not at the first chunk


@pytest.mark.parametrize("n_ctx", [24, 37])
def test_max_tokens_past_the_context_stops_at_the_context_as_the_pipeline_does(n_ctx):
    """llama-server's "until the context is full": no refusal; the tokens are the pipeline's own
    up to the last row the context has (its honest stop, lossless), the reason "context"."""
    with lever.load(shipped("default.toml"), overrides=[f"model.n_ctx={n_ctx}"]) as m:
        c = m.generate(PROMPT, max_tokens=10**6)
        res = run_pipeline(load_config(shipped("default.toml"), [f"model.n_ctx={n_ctx}", "generate.n_predict=1000000"]),
                           PROMPT)
        assert c.finish_reason == res.stop_reason == "context" and list(c.tokens) == res.tokens
        assert c.usage.prompt_tokens + c.usage.completion_tokens == n_ctx
        with pytest.raises(LeverError, match=rf"prompt: \d+ tokens exceeds the available context size of {n_ctx}"):
            m.generate("word " * n_ctx)


@pytest.mark.parametrize("messages, where", [
    ("hi", "messages"), ([], "messages"), ([{"role": "user"}], r"messages\[0\].content"),
    ([{"role": "robot", "content": "x"}], r"messages\[0\].role"), ([["user", "x"]], r"messages\[0\]"),
])
def test_bad_messages_are_named(llm, messages, where):
    with pytest.raises(LeverError, match=where):
        llm.chat(messages)


def test_a_model_without_a_template_chats_in_chatml_as_llama_server_does():
    with lever.load(shipped("default.toml"), overrides=['model.chat_template=""']) as m:  # the GGUF's own: none
        t = m.chat_template
        assert t.text == CHATML and t.fallback and "stdlib-target-q4_0.gguf" in t.note
        ids = m.encode_chat([{"role": "user", "content": "x"}])
        assert ids == m.tokenizer.encode("<|im_start|>user\nx<|im_end|>\n<|im_start|>assistant\n")  # a BOS first
        assert m.chat([{"role": "user", "content": "x"}], max_tokens=4).usage.prompt_tokens == len(ids)
    with lever.load(shipped("default.toml"), overrides=[f"model.chat_template={json.dumps(TEMPLATE)}"]) as m:
        assert m.chat_template.render([{"role": "user", "content": "x"}]) == "<user>x\n<assistant>"


def test_a_template_that_raises_gets_its_message():
    t = ChatTemplate("{{ raise_exception('only user turns') }}", "code")
    with pytest.raises(LeverError, match="only user turns"):
        t.render([{"role": "user", "content": "x"}])
    with pytest.raises(LeverError, match="chat template"):
        ChatTemplate("{% for %}", "code").render([{"role": "user", "content": "x"}])
    with pytest.raises(LeverError, match="chat template"):  # the sandbox: no reaching into Python
        ChatTemplate("{{ ''.__class__.__mro__[1].__subclasses__() }}", "code").render(
            [{"role": "user", "content": "x"}])


def test_load_from_settings_alone_and_unknown_settings(full):
    cfg = load_config(shipped("default.toml"))
    with lever.load(target=cfg.model.target, draft=cfg.model.draft, n_ctx=cfg.model.n_ctx,
                    dram_budget=cfg.flash.dram_budget) as m:
        assert m.config.pipeline.kind == "speculative"
        assert m.generate(PROMPT, max_tokens=N).tokens == full.tokens
    with pytest.raises(LeverError, match="dram"):
        lever.load(shipped("default.toml"), dram=0.5)


def test_stop_strings_hold_back_only_what_could_still_match(llm):
    got = []
    rule = TextStream(llm.tokenizer, ("abc", "xyz"), lambda text, n, lps: got.append(text))
    ids = llm.tokenizer.encode("hello ab", add_bos=False)
    assert llm.tokenizer.decode(ids) == "hello ab"
    assert rule(tuple(ids)) is None
    assert "".join(got) == "hello "  # "ab" may begin "abc": held back
    rule.finish()
    assert "".join(got) == "hello ab" and rule.final_text == "hello ab"


def test_qwen_chat_template_renders_like_hugging_face(qwen_target):
    from lever.gguf.file import GGUFFile
    from lever.gguf.tokenizer import Tokenizer

    f = GGUFFile(qwen_target)
    tok = Tokenizer.from_gguf(f)
    t = ChatTemplate.from_gguf(f, tok.token_text(tok.bos_id), tok.token_text(tok.eos_id))
    text = t.render([{"role": "user", "content": "Write quicksort."}])
    assert text == ("<|im_start|>system\n"
                    "You are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n"
                    "<|im_start|>user\nWrite quicksort.<|im_end|>\n<|im_start|>assistant\n")
    ids = tok.encode(text, add_bos=False)
    assert ids[0] == 151644 and tok.decode(ids[:1]) == ""  # <|im_start|> is one special token


def test_a_long_token_that_completes_a_short_stop_string_stops(llm):
    ids = llm.tokenizer.encode("  # 2-bit characters and more", add_bos=False)
    long_piece = max(range(len(ids)), key=lambda i: len(llm.tokenizer.decode(ids[i : i + 1])))
    assert len(llm.tokenizer.decode(ids[long_piece : long_piece + 1])) > 4  # the case: one token of many chars
    rule = TextStream(llm.tokenizer, ("t c",))
    for t in ids:
        if rule((t,)):
            break
    assert rule.stopped_at >= 0 and rule.final_text == "  # 2-bi"


def test_a_session_prefills_only_what_is_new_and_equals_fresh_runs(llm):
    turns = [[{"role": "user", "content": "import os"}], [{"role": "user", "content": "import sys"}],
             [{"role": "user", "content": "def main():"}]]
    with llm.session() as s:
        seen = 0
        for i, turn in enumerate(turns):
            c = s.chat(turn, max_tokens=24)
            fresh = llm.chat(s.messages[:-1], max_tokens=24)  # the same conversation, nothing cached
            assert c.tokens == fresh.tokens and c.text == fresh.text
            assert s.messages[-1] == {"role": "assistant", "content": c.text}
            if i:
                assert c.usage.cached_tokens >= seen - 24  # at most the last cycle's tokens prefilled again
                assert c.usage.cached_tokens < c.usage.prompt_tokens
            assert s.n_cached > c.usage.prompt_tokens  # the reply is in the caches too
            seen = s.n_cached
        n = len(s.messages)
        s.rewind(n - 2)  # edit the last user message
        c = s.chat([{"role": "user", "content": "def run():"}], max_tokens=24)
        assert c.tokens == llm.chat(s.messages[:-1], max_tokens=24).tokens
        assert c.usage.cached_tokens > 0
        with pytest.raises(LeverError, match="rewind"):
            s.rewind(99)


def test_a_session_generate_continues_its_text(llm, full):
    with llm.session() as s:
        a = s.generate(PROMPT, max_tokens=N)
        assert a.tokens == full.tokens
        text = PROMPT + a.text + "\n\ndef main():"
        b = s.generate(text, max_tokens=16)
        assert b.tokens == llm.generate(text, max_tokens=16).tokens and b.usage.cached_tokens > 0


def test_a_saved_session_goes_on_as_if_it_had_never_stopped(llm, tmp_path):
    path = tmp_path / "s.msgpack"
    with llm.session() as s:
        s.chat([{"role": "user", "content": "import os"}], max_tokens=24)
        s.save(path)
        want = s.chat([{"role": "user", "content": "import sys"}], max_tokens=24)
    with llm.session() as s2:
        s2.load(path)
        assert s2.n_cached > 0 and len(s2.messages) == 2
        got = s2.chat([{"role": "user", "content": "import sys"}], max_tokens=24)
        assert got.tokens == want.tokens and got.usage.cached_tokens == want.usage.cached_tokens


def test_a_saved_session_is_checked_field_by_field(llm, tmp_path):
    import msgpack
    import numpy as np

    path = tmp_path / "s.msgpack"
    with llm.session() as s:
        s.chat([{"role": "user", "content": "import os"}], max_tokens=12)
        s.save(path)
    doc = msgpack.unpackb(path.read_bytes())

    def refused(change, match):
        bad = tmp_path / "bad.msgpack"
        d = msgpack.unpackb(path.read_bytes())
        change(d)
        bad.write_bytes(msgpack.packb(d))
        with llm.session() as s2, pytest.raises(LeverError, match=match) as e:
            s2.load(bad)
        assert str(bad) in str(e.value) and "\n" not in str(e.value)
        assert s2.n_cached == 0  # nothing half-loaded

    refused(lambda d: d.update(format="other"), "not a saved session")
    refused(lambda d: d.update(target=[1, "00"]), "target")
    refused(lambda d: d.update(n_rows="12"), "n_rows")
    refused(lambda d: d.update(n_rows=10**9), "n_rows")
    refused(lambda d: d.update(ids=d["ids"][:-1]), "ids")
    refused(lambda d: d.update(ids=[10**9] * len(d["ids"])), "ids")
    refused(lambda d: d.update(messages=[{"role": 3}]), "messages")
    refused(lambda d: d["target_kv"]["k"].__setitem__(0, d["target_kv"]["k"][0][:-2]), r"target_kv.k\[0\]")
    nan = np.frombuffer(doc["draft_kv"]["v"][1], np.float16).copy()
    nan[3] = np.nan
    refused(lambda d: d["draft_kv"]["v"].__setitem__(1, nan.tobytes()), r"draft_kv.v\[1\].*not finite")
    (tmp_path / "junk").write_bytes(b"\x00\x01garbage")
    with llm.session() as s3, pytest.raises(LeverError, match="not a saved session"):
        s3.load(tmp_path / "junk")


def test_saving_a_session_never_follows_a_planted_link(llm, tmp_path):
    """The old temp name was predictable (.NAME.tmpPID): a link planted there was written through."""
    import os

    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    path = tmp_path / "s.msgpack"
    for name in (f".{path.name}.tmp{os.getpid()}", f".{path.name}.{os.getpid()}.tmp"):
        (tmp_path / name).symlink_to(victim)
    with llm.session() as s:
        s.chat([{"role": "user", "content": "import os"}], max_tokens=4)
        s.save(path)
    assert victim.read_text() == "keep me" and path.is_file() and not path.is_symlink()


def test_a_huge_or_sparse_session_file_is_refused_before_it_is_read(llm, tmp_path):
    import resource

    import msgpack

    sparse = tmp_path / "sparse.msgpack"
    with open(sparse, "wb") as f:  # 8 GiB of holes: reading it whole would take minutes and the memory
        f.truncate(8 << 30)
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with llm.session() as s, pytest.raises(LeverError, match="more than any saved session"):
        s.load(sparse)
    # a small file whose arrays claim more items than any session of this pair holds
    nils = tmp_path / "nils.msgpack"
    nils.write_bytes(msgpack.packb({"format": "lever-session", "ids": [None] * 2_000_000}))
    with llm.session() as s, pytest.raises(LeverError, match="corrupt msgpack"):
        s.load(nils)
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0 < 200_000  # KiB: nothing decoded whole


def test_min_p_of_one_keeps_only_the_likeliest_token_so_sampling_is_greedy(llm, full):
    # under speculation too: the target's distribution after the cut is what Accept samples from
    assert llm.generate(PROMPT, max_tokens=N, temperature=0.9, seed=5, min_p=1.0).tokens == full.tokens
    assert llm.generate(PROMPT, max_tokens=N, temperature=0.9, seed=5).tokens != full.tokens


def test_the_repeat_penalty_is_lossless_under_speculation(llm, full):
    """Greedy with a penalty: speculative = Flash-AR = the plain DRAM loop of lever.model.generate."""
    from lever.model.generate import generate
    from lever.model.sampling import SamplingParams
    from lever.model.transformer import Model

    spec = llm.generate(PROMPT, max_tokens=N, repeat_penalty=1.5, repeat_last_n=16)
    assert spec.tokens != full.tokens  # it changes the text
    cfg = load_config(shipped("default.toml"), ['pipeline.kind="flash-ar"', 'pipeline.baseline=""',
                                                "generate.repeat_penalty=1.5", "generate.repeat_last_n=16",
                                                f"generate.n_predict={N}"])
    assert run_pipeline(cfg, PROMPT).tokens == list(spec.tokens)
    ref = generate(Model(cfg.model.target), llm.tokenizer.encode(PROMPT), N,
                   SamplingParams(repeat_penalty=1.5, repeat_last_n=16))
    assert ref.tokens == list(spec.tokens)
    with llm.session() as s:  # the cached text counts as history too
        a = s.generate(PROMPT, max_tokens=N, repeat_penalty=1.5, repeat_last_n=16)
        text = PROMPT + a.text + "\n"
        b = s.generate(text, max_tokens=16, repeat_penalty=1.5, repeat_last_n=16)
        assert b.usage.cached_tokens > 0
        assert b.tokens == llm.generate(text, max_tokens=16, repeat_penalty=1.5, repeat_last_n=16).tokens


def test_logprobs_are_the_targets_own_at_every_emitted_token(llm):
    """Each token's logprob is the target's (never the draft's): the same under speculation as
    in the plain DRAM loop, whose logits at every position are computed here one at a time."""
    import numpy as np

    from lever.model.generate import prefill
    from lever.model.transformer import Model

    n, k = 12, 3
    c = llm.generate(PROMPT, max_tokens=n, logprobs=k)
    assert len(c.logprobs) == len(c.tokens) == n
    ids = llm.tokenizer.encode(PROMPT)
    model = Model(load_config(shipped("default.toml")).model.target)
    cache = model.new_cache(256)
    hidden = prefill(model, cache, ids)
    for tok, lp in zip(c.tokens, c.logprobs):
        logits = model.logits(hidden[None])[0].astype(np.float64)
        ref = logits - (logits.max() + np.log(np.exp(logits - logits.max()).sum()))
        assert lp.token == tok and lp.logprob == pytest.approx(ref[tok], abs=1e-9)
        assert [t for t, _ in lp.top] == list(np.argsort(-ref, kind="stable")[:k])
        assert lp.top[0] == (tok, lp.logprob)  # greedy: the token is the likeliest
        hidden = prefill(model, cache, [tok])
    flash_ar = lever.load(shipped("default.toml"), kind="flash-ar", overrides=['pipeline.baseline=""'])
    with flash_ar:
        assert flash_ar.generate(PROMPT, max_tokens=n, logprobs=k).logprobs == c.logprobs
    assert llm.generate(PROMPT, max_tokens=n).logprobs is None  # not asked for: not computed


def test_streamed_logprobs_cover_the_streamed_tokens(llm):
    c = llm.generate(PROMPT, max_tokens=N, logprobs=0, stop=[")\n"])
    chunks = list(llm.stream(PROMPT, max_tokens=N, logprobs=0, stop=[")\n"]))
    assert all(len(ch.logprobs) == ch.n_tokens for ch in chunks)
    assert tuple(lp for ch in chunks for lp in ch.logprobs) == c.logprobs
    assert all(lp.top == () for lp in c.logprobs)


@pytest.mark.parametrize("bad", [-1, 21, 2.5, True, "3"])
def test_logprobs_out_of_range_is_one_line_naming_it(llm, bad):
    with pytest.raises(LeverError, match=r"^logprobs: must be an integer in \[0, 20\]"):
        llm.generate(PROMPT, max_tokens=2, logprobs=bad)
