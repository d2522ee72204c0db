"""lever.gguf.tokenizer against llama.cpp's own tokenizer, and against facts that need no reference.

llama.cpp (through llama-cpp-python, when importable) must give the same ids on corpus lines,
Python source and awkward strings, for the SentencePiece vocabs (stories260K, Llama 2) and the
byte-level one (Qwen2.5), plus tiny byte-level GGUFs written here for the other pre-tokenizers.
Without it: stories260K agrees with llama2.c's tok512 and its encoder, known ids, special
tokens as one id, round trips and streaming. `python tests/gguf/test_tokenizer.py` prints the
agreement rates with llama.cpp over whole corpora and the stdlib.
"""

from __future__ import annotations

import glob
import os
import random
import struct
import sysconfig
from pathlib import Path

import gguf
import pytest

from lever.errors import LeverError
from lever.fuzz.inputs import ARR, F32, I32, STR, U32, RandomChooser, serialize
from lever.fuzz.models import model_desc
from lever.gguf.tokenizer import StreamDecoder, Tokenizer, byte_level_chars
from tests.conftest import CORPORA, LLAMA2, MODELS, QWEN_DRAFT, STORIES, require

TOK512 = MODELS / "tok512.bin"
QWEN = QWEN_DRAFT

AWKWARD = [
    "",
    " ",
    "   leading and trailing   ",
    "Hello world",
    "Once upon a time",
    "don't I'LL we'Ve you'd",
    "1 12 123 1234 12345 3.14159 1,000,000",
    "def f(x):\n    return x  # two  spaces\n\t\ttabs\r\nwindows\n\n\n",
    "        deeply\n                indented",
    "你好，世界！ こんにちは 한국어 Привет мир مرحبا",
    "emoji 😀👍🏽🇫🇷 and e\u0301 combining, ½ ² ٣ Ⅻ ﬁ",
    "nbsp\u00a0ideographic\u3000space zero\u200bwidth \ufeffbom",
    "control \x00 \x07 \x7f chars",
    "▁ a literal metaspace and <0x41> a literal byte name",
]
# A token's name inside text. Qwen's "</s>" is left out on purpose: it is an ordinary token
# there, and this llama.cpp build turns it into a control token by its name (a heuristic
# meant for other models), so it would split the text where the HF tokenizer does not.
SPECIAL_TEXTS = {
    "llama": ["<s>hi</s>", "a</s> <s>b", "x<unk>y"],
    "gpt2": ["<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", "a<|endoftext|>b", "<tool_call>{}</tool_call>"],
}


# --- fixtures -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def stories_tok() -> Tokenizer:
    return Tokenizer.from_gguf(require(STORIES))


@pytest.fixture(scope="module")
def llama2_tok() -> Tokenizer:
    return Tokenizer.from_gguf(require(LLAMA2))


@pytest.fixture(scope="module")
def qwen_tok() -> Tokenizer:
    return Tokenizer.from_gguf(require(QWEN))


@pytest.fixture(params=["stories", "llama2", "qwen"])
def any_tok(request) -> Tokenizer:
    return request.getfixturevalue(f"{request.param}_tok")


def reference(llama_cpp, path: Path):
    """`encode(text)` by llama.cpp, with the file's default BOS/EOS and special-token parsing."""
    llm = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
    return lambda text: llm.tokenize(text.encode(), add_bos=True, special=True)


# --- tiny byte-level GGUFs ------------------------------------------------------------------


# Ranked so that where the pre-tokenizer cuts changes the result: "3 4" outranks "1 2", and
# "n '" would glue a contraction to its word if the regex did not cut before the apostrophe.
TINY_MERGES = ["3 4", "1 2", "12 3", "4 5", "45 6", "d o", "do n", "n '", "' t", "' L", "'L L", "Ġ t", "Ġt h", "Ġth e"]
TINY_SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"]


def write_tiny_bpe(path: Path, pre: str, model: str = "gpt2") -> Path:
    tokens = byte_level_chars() + ["".join(m.split(" ")) for m in TINY_MERGES] + ["xyz"] + TINY_SPECIALS
    types = [1] * (len(tokens) - len(TINY_SPECIALS)) + [3] * len(TINY_SPECIALS)
    w = gguf.GGUFWriter(str(path), "llama")
    # the few hyperparameters llama.cpp reads even for a vocab-only load
    w.add_context_length(64)
    w.add_embedding_length(8)
    w.add_block_count(1)
    w.add_feed_forward_length(16)
    w.add_head_count(2)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_tokenizer_model(model)
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(TINY_MERGES)
    w.add_bos_token_id(tokens.index("<|begin_of_text|>"))
    w.add_eos_token_id(tokens.index("<|end_of_text|>"))
    w.add_add_bos_token(pre == "llama-bpe")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def tiny_bpe(tmp_path_factory):
    base = tmp_path_factory.mktemp("tok")
    return lambda pre: write_tiny_bpe(base / f"{pre}.gguf", pre)


def pieces(tok: Tokenizer, text: str) -> list[bytes]:
    return [tok.token_bytes(i) for i in tok.encode(text, add_bos=False)]


# --- llama2.c's tokenizer: an independent SentencePiece-BPE encoder -------------------------


def read_tok512() -> tuple[list[bytes], list[float]]:
    data = require(TOK512).read_bytes()
    vocab, scores, off = [], [], 4  # after max_token_len
    while off < len(data):
        score, n = struct.unpack_from("<fi", data, off)
        vocab.append(data[off + 8 : off + 8 + n])
        scores.append(score)
        off += 8 + n
    return vocab, scores


def llama2c_encode(text: str, vocab: list[bytes], scores: list[float]) -> list[int]:
    """run.c's encode() with BOS: a space prefix, code points or bytes+3, then best-score merges."""
    index = {s: i for i, s in enumerate(vocab)}
    ids = [index[b" "]] if text else []
    for ch in text:
        b = ch.encode()
        ids += [index[b]] if b in index else [x + 3 for x in b]
    while True:
        best = max(
            ((scores[index[vocab[a] + vocab[b]]], -i) for i, (a, b) in enumerate(zip(ids, ids[1:]))
             if vocab[a] + vocab[b] in index),
            default=None,
        )
        if best is None:
            return [1, *ids]
        i = -best[1]
        ids[i : i + 2] = [index[vocab[ids[i]] + vocab[ids[i + 1]]]]


def test_stories_vocab_and_scores_match_llama2c_tok512(stories_tok):
    vocab, scores = read_tok512()
    reader = gguf.GGUFReader(STORIES)
    tokens = [bytes(reader.fields["tokenizer.ggml.tokens"].parts[i]).decode()
              for i in reader.fields["tokenizer.ggml.tokens"].data]
    gguf_scores = [float(reader.fields["tokenizer.ggml.scores"].parts[i][0])
                   for i in reader.fields["tokenizer.ggml.scores"].data]
    assert len(vocab) == len(tokens) == stories_tok.vocab_size == 512
    # tok512 writes bos/eos as "\n<s>\n" and a space where the GGUF has "▁"
    expected = [t.replace("▁", " ").encode() for t in tokens]
    expected[1:3] = [b"\n<s>\n", b"\n</s>\n"]
    assert vocab == expected
    assert scores == gguf_scores


@pytest.mark.parametrize("text", [
    "Once upon a time",
    "Once upon a time, there was a little girl named Lily. She loved to play outside in the park.",
    'Tom said, "I can\'t find my red ball!" 123 — naïve café 😀',
    "  two leading spaces\nand a newline",
])
def test_stories_encodes_like_llama2c(stories_tok, text):
    vocab, scores = read_tok512()
    assert stories_tok.encode(text) == llama2c_encode(text, vocab, scores)


# --- known ids and special tokens -----------------------------------------------------------


def test_known_llama2_ids(llama2_tok):
    assert llama2_tok.encode("Hello world") == [1, 15043, 3186]
    assert llama2_tok.encode("Once upon a time", add_bos=False) == [9038, 2501, 263, 931]
    assert llama2_tok.encode("\n") == [1, 29871, 13]  # "▁" then the <0x0A> byte token


def test_known_qwen_ids(qwen_tok):
    assert qwen_tok.encode("Hello world") == [9707, 1879]  # no BOS: add_bos_token is false
    assert qwen_tok.encode("<|im_start|>user\n") == [151644, 872, 198]
    assert qwen_tok.encode("x", add_bos=True) == [151643, 87]


@pytest.mark.parametrize("text,expected", [("<s>", 1), ("</s>", 2), ("<unk>", 0)])
def test_llama_control_tokens_are_single_ids(llama2_tok, text, expected):
    assert llama2_tok.encode(text, add_bos=False) == [expected]
    assert llama2_tok.encode(f"a{text}b", add_bos=False).count(expected) == 1


@pytest.mark.parametrize("text", ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<tool_call>", "<|fim_middle|>"])
def test_qwen_special_tokens_are_single_ids(qwen_tok, text):
    (token_id,) = qwen_tok.encode(text)
    assert qwen_tok.token_bytes(token_id) == text.encode()
    assert token_id in qwen_tok.encode(f"abc{text}def")


def test_llama_ids_and_flags(stories_tok, llama2_tok):
    assert (stories_tok.vocab_size, stories_tok.bos_id, stories_tok.eos_id, stories_tok.eos_ids) == (512, 1, 2, {2})
    assert (llama2_tok.vocab_size, llama2_tok.bos_id, llama2_tok.eos_id) == (32000, 1, 2)
    assert stories_tok.add_bos and not stories_tok.add_eos


def test_qwen_ids_and_flags(qwen_tok):
    assert (qwen_tok.vocab_size, qwen_tok.bos_id, qwen_tok.eos_id) == (151936, 151643, 151645)
    # <|im_end|> (eos), <|endoftext|> by name, and the FIM markers that start another file
    assert qwen_tok.eos_ids == {151645, 151643, 151662, 151663, 151664}
    assert not qwen_tok.add_bos


# --- decoding -------------------------------------------------------------------------------


def _sample_texts() -> list[str]:
    texts = list(AWKWARD)
    for name in ("tinyshakespeare_input.txt", "tinystories_val_subset.txt"):
        texts.append((CORPORA / name).read_text()[:20000])
    texts.append(Path(gguf.__file__).read_text())
    return texts


def test_round_trip(any_tok):
    # SentencePiece writes a space as "▁", so a literal "▁" comes back as a space
    for text in [t for t in _sample_texts() if any_tok.model != "llama" or "▁" not in t]:
        assert any_tok.decode(any_tok.encode(text)) == text
        assert any_tok.decode(any_tok.encode(text, add_bos=False)) == text


def test_decode_agrees_with_the_tokenizers_decoder(any_tok):
    for text in _sample_texts():
        ids = any_tok.encode(text)
        assert any_tok.decode(ids) == any_tok._hf.decode(ids, skip_special_tokens=True)


def test_decode_drops_control_tokens(qwen_tok, llama2_tok):
    assert qwen_tok.decode(qwen_tok.encode("<|im_start|>user\nhi<|im_end|>")) == "user\nhi"
    assert llama2_tok.decode([1, 15043, 3186, 2]) == "Hello world"


def test_token_bytes(llama2_tok, qwen_tok):
    assert llama2_tok.token_bytes(13) == b"\n"  # <0x0A>
    assert llama2_tok.token_bytes(15043) == b" Hello"  # ▁Hello
    assert llama2_tok.token_bytes(1) == b"<s>"
    assert qwen_tok.token_bytes(220) == b" " and qwen_tok.token_bytes(198) == b"\n"  # Ġ, Ċ
    for tok in (llama2_tok, qwen_tok):
        text = "😀你"
        assert b"".join(tok.token_bytes(i) for i in tok.encode(text, add_bos=False)).lstrip(b" ") == text.encode()


@pytest.mark.parametrize("text", ["Emoji 😀👍🏽🇫🇷 in a line.", "中文字符和日本語のテキスト。",
                                  "mixed: naïve 😀 ok\n" * 3])
def test_stream_decoder_concatenates_to_decode(any_tok, text):
    ids = any_tok.encode(text)
    stream = StreamDecoder(any_tok)
    parts = [stream.push(i) for i in ids]
    assert "".join(parts) + stream.flush() == any_tok.decode(ids) == text
    assert all("\ufffd" not in p for p in parts)


def test_stream_decoder_holds_back_partial_characters(llama2_tok):
    ids = llama2_tok.encode("😀", add_bos=False)  # not in the vocab: four byte-fallback tokens
    assert [llama2_tok.token_bytes(i) for i in ids[1:]] == [bytes([b]) for b in "😀".encode()]
    stream = StreamDecoder(llama2_tok)
    assert [stream.push(i) for i in ids] == ["", "", "", "", "😀"]
    stream = StreamDecoder(llama2_tok)
    stream.push(ids[1])
    assert stream.flush() == "\ufffd"  # an unfinished sequence at the end is shown, not lost


def test_stream_decoder_continuing_text_keeps_the_space(llama2_tok):
    prompt, completion = llama2_tok.encode("Once upon a"), llama2_tok.encode("time", add_bos=False)
    stream = StreamDecoder(llama2_tok, at_start=False)
    assert "".join(stream.push(i) for i in completion) == " time"
    stream = StreamDecoder(llama2_tok)
    assert "".join(stream.push(i) for i in prompt) == "Once upon a"


# --- byte-level pre-tokenizers on a tiny vocab ----------------------------------------------


def test_llama_bpe_splits_like_llama3(tiny_bpe):
    tok = Tokenizer.from_gguf(tiny_bpe("llama-bpe"))
    assert pieces(tok, "123456") == [b"123", b"456"]  # digits in threes
    assert pieces(tok, "don't") == [b"don", b"'t"]  # the contraction is cut off before merging
    assert pieces(tok, "I'LL") == [b"I", b"'LL"]  # contractions in either case
    assert pieces(tok, "xyz") == [b"xyz"]  # a whole word in the vocab skips the merges
    assert pieces(tok, " the<|eot_id|>x") == [b" the", b"<|eot_id|>", b"x"]
    bos, eot = tok.bos_id, tok.encode("<|eot_id|>", add_bos=False)[0]
    assert tok.encode("x")[0] == bos  # add_bos_token is true
    assert tok.eos_ids == {tok.eos_id, eot}


def test_other_pre_tokenizers_split_differently(tiny_bpe):
    qwen2, gpt2, default = (Tokenizer.from_gguf(tiny_bpe(p)) for p in ("qwen2", "gpt-2", "default"))
    assert pieces(qwen2, "123456") == [bytes([c]) for c in b"123456"]  # one digit at a time
    assert pieces(qwen2, "xyz") == [b"x", b"y", b"z"]
    assert pieces(gpt2, "123456") == [b"12", b"34", b"5", b"6"]  # one word: "3 4" merges first
    assert pieces(gpt2, "I'LL") == [b"I", b"'", b"L", b"L"]  # only lower-case contractions
    assert pieces(default, "don't") == [b"don", b"'", b"t"]  # punctuation split off first
    assert pieces(default, "123456") == [b"123", b"456"]


@pytest.mark.parametrize("pre", ["llama-bpe", "qwen2", "gpt-2", "default"])
def test_tiny_bpe_matches_llama_cpp(tiny_bpe, llama_cpp, pre):
    path = tiny_bpe(pre)
    tok, ref = Tokenizer.from_gguf(path), reference(llama_cpp, path)
    texts = [*AWKWARD, "123456 don't I'LL xyz the<|eot_id|>", "a<|begin_of_text|>b<|end_of_text|>"]
    assert [tok.encode(t) for t in texts] == [ref(t) for t in texts]


# --- errors and speed -----------------------------------------------------------------------


@pytest.mark.parametrize("model,pre,named", [("bert", "default", "'bert'"), ("gpt2", "no-such-pre", "'no-such-pre'")])
def test_unsupported_tokenizer_is_a_one_line_error(tmp_path, model, pre, named):
    path = write_tiny_bpe(tmp_path / "odd.gguf", pre, model=model)
    with pytest.raises(LeverError) as e:
        Tokenizer.from_gguf(path)
    message = str(e.value)
    assert "\n" not in message and str(path) in message and named in message


def test_missing_file_is_a_lever_error(tmp_path):
    with pytest.raises(LeverError, match="no such file"):
        Tokenizer.from_gguf(tmp_path / "absent.gguf")


# --- agreement with llama.cpp on the real files ---------------------------------------------


def corpus_samples(n_lines: int = 300, n_files: int = 25) -> dict[str, list[str]]:
    samples = {}
    for name in ("tinyshakespeare_input.txt", "tinystories_val_subset.txt"):
        lines = (CORPORA / name).read_text().splitlines()
        samples[f"{name} lines"] = lines[:n_lines]
        samples[f"{name} 20-line blocks"] = ["\n".join(lines[i : i + 20])
                                             for i in range(0, min(len(lines), 20 * n_lines), 20)]
    files = sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py")))[:n_files]
    samples["stdlib .py files"] = [Path(f).read_text(encoding="utf-8", errors="replace") for f in files]
    return samples


def comparable(tok: Tokenizer, texts: list[str]) -> list[str]:
    return [t for t in texts if tok.model == "llama" or "</s>" not in t]  # see SPECIAL_TEXTS


@pytest.mark.parametrize("name", ["stories", "llama2", "qwen"])
def test_matches_llama_cpp(request, llama_cpp, name):
    tok = request.getfixturevalue(f"{name}_tok")
    ref = reference(llama_cpp, {"stories": STORIES, "llama2": LLAMA2, "qwen": QWEN}[name])
    texts = [*AWKWARD, *SPECIAL_TEXTS[tok.model]] + [t for group in corpus_samples().values() for t in group]
    mismatches = [t for t in comparable(tok, texts) if tok.encode(t) != ref(t)]
    assert not mismatches, f"{len(mismatches)} texts differ, first: {mismatches[0][:200]!r}"


def measure_agreement() -> None:
    """Print per-text agreement with llama.cpp over larger samples (run this file directly)."""
    from tests.conftest import import_llama_cpp

    llama_cpp = import_llama_cpp()
    samples = corpus_samples(n_lines=3000, n_files=10_000)
    for path in (STORIES, LLAMA2, QWEN):
        if not path.exists():
            print(f"{path.name}: absent, skipped")
            continue
        tok, ref = Tokenizer.from_gguf(path), reference(llama_cpp, path)
        for label, texts in samples.items():
            texts = comparable(tok, texts)
            same = sum(tok.encode(t) == ref(t) for t in texts)
            print(f"{path.name:42s} {label:42s} {same}/{len(texts)} = {100 * same / len(texts):.2f}%", flush=True)


if __name__ == "__main__":
    measure_agreement()


# --- metadata checks: a crafted vocabulary is refused with one line ---------------------------


def crafted(tmp_path, change, vocab: str = "gpt2") -> Path:
    d = model_desc(RandomChooser(random.Random(0)), "llama", vocab)
    change(d)
    path = tmp_path / "tok.gguf"
    serialize(d).write(path)
    return path


def refused_tok(path: Path, needle: str) -> None:
    with pytest.raises(LeverError) as e:
        Tokenizer.from_gguf(path)
    msg = str(e.value)
    assert msg.startswith(f"{path}: ") and "\n" not in msg and needle in msg, msg


def _set(key, vtype, value, elem=0):
    return lambda d: d.set(f"tokenizer.ggml.{key}", vtype, value, elem)


def _edit(key, fn):
    def change(d):
        kv = d.find(f"tokenizer.ggml.{key}")
        kv.value = fn(list(kv.value))
    return change


N_GPT2 = 256 + 8 + 3  # the crafted byte-level vocabulary: bytes, merged pieces, three specials


@pytest.mark.parametrize("change,needle", [
    (_edit("token_type", lambda t: t + [1]), f"tokenizer.ggml.token_type has {N_GPT2 + 1} entries for {N_GPT2} tokens"),
    (_edit("token_type", lambda t: t[:-5]), f"tokenizer.ggml.token_type has {N_GPT2 - 5} entries"),
    (_edit("token_type", lambda t: t[:3] + [9] + t[4:]), "tokenizer.ggml.token_type[3] = 9 is not a token type (0-6)"),
    (_set("token_type", ARR, ["1"] * N_GPT2, STR),
     "tokenizer.ggml.token_type is an array of 267, expected an array of numbers"),
    (_set("token_type", I32, 1), "tokenizer.ggml.token_type is int 1, expected an array of numbers"),
    (_set("tokens", ARR, [1, 2, 3], I32), "tokenizer.ggml.tokens is an array of 3, expected an array of strings"),
    (_set("tokens", ARR, [], STR), "tokenizer.ggml.tokens is empty"),
    (_edit("tokens", lambda t: t[:100] + ["x" * 2000] + t[101:]), "tokenizer.ggml.tokens[100] is 2000 characters long"),
    (_set("model", ARR, ["gpt2"], STR), "tokenizer.ggml.model is an array of 1, expected a string"),
    (_set("pre", U32, 5), "tokenizer.ggml.pre is int 5, expected a string"),
    (_edit("merges", lambda m: m + ["abc"]), "tokenizer.ggml.merges[8] 'abc' is not two tokens separated by a space"),
    (_edit("merges", lambda m: m + ["zz qq"]), "tokenizer.ggml.merges[8] 'zz qq': 'zz' is not a token"),
    (_edit("merges", lambda m: ["a b"] + m), "tokenizer.ggml.merges[0] 'a b': 'ab' is not a token"),
    (_set("merges", ARR, [0.5], F32), "tokenizer.ggml.merges is an array of 1, expected an array of strings"),
    (_set("bos_token_id", U32, N_GPT2), f"tokenizer.ggml.bos_token_id = {N_GPT2} is out of range for {N_GPT2} tokens"),
    (_set("eot_token_id", I32, -7), "tokenizer.ggml.eot_token_id = -7 is out of range"),
    (_set("eos_token_id", STR, "2"), "tokenizer.ggml.eos_token_id is the string '2', expected a token id"),
    (_set("add_bos_token", STR, "false"), "tokenizer.ggml.add_bos_token is the string 'false', expected true or false"),
    (_set("add_bos_token", U32, 2), "tokenizer.ggml.add_bos_token is int 2, expected true or false"),
])
def test_bad_vocabulary_metadata(tmp_path, change, needle):
    refused_tok(crafted(tmp_path, change), needle)


def test_bad_spm_metadata(tmp_path):
    n = 3 + 256 + 11  # <unk> <s> </s>, the byte tokens, the pieces
    refused_tok(crafted(tmp_path, _edit("scores", lambda s: s[:-1]), "llama"),
                f"tokenizer.ggml.scores has {n - 1} entries for {n} tokens")
    refused_tok(crafted(tmp_path, _edit("scores", lambda s: [float("nan")] + s[1:]), "llama"),
                "tokenizer.ggml.scores[0] = nan is not a usable score")
    refused_tok(crafted(tmp_path, _edit("tokens", lambda t: t[:3] + ["<0xZZ>"] + t[4:]), "llama"),
                "tokenizer.ggml.tokens[3] '<0xZZ>' is a byte token but not named <0xHH>")


def test_no_token_ids_are_accepted(tmp_path):
    for vtype, value in ((U32, 2**32 - 1), (I32, -1)):
        tok = Tokenizer.from_gguf(crafted(tmp_path, _set("bos_token_id", vtype, value)))
        assert tok.bos_id is None and tok.encode("the", add_bos=True) == tok.encode("the", add_bos=False)


def test_ids_out_of_range_are_one_line_errors(tmp_path):
    path = crafted(tmp_path, lambda d: None)
    tok = Tokenizer.from_gguf(path)
    n = tok.vocab_size
    for bad in (n, -1, 2**63):
        for call in (lambda b=bad: tok.decode([5, b]), lambda b=bad: tok.token_bytes(b),
                     lambda b=bad: StreamDecoder(tok).push(b)):
            with pytest.raises(LeverError) as e:
                call()
            assert str(e.value) == f"{path}: token id {bad} is out of range [0, {n})"
    assert tok.decode([n - 1]) == "" and tok.decode([]) == ""


def test_lone_surrogates_encode_as_replacement_characters(stories_tok):
    assert stories_tok.encode("a\udcff b") == stories_tok.encode("a\ufffd b")
