"""Trains the draft/target pair that ships in examples/models/: two small code-completion models
that share one tokenizer, on the Python standard library of the running interpreter.

Every machine with Python has that corpus, so the pair can be rebuilt anywhere with no download:
this script finds the stdlib through sysconfig (the file list and held-out split live in
examples/eval_pair.py), trains a byte-level BPE tokenizer with `tokenizers` whose
pre-tokenization is exactly Lever's `qwen2` one, trains a `llama`-architecture target and a much
smaller draft in torch with the very forward pass Lever computes (RMSNorm, adjacent-pair rope,
grouped-query attention, SwiGLU, tied embeddings), and writes both as quantized GGUF files with
gguf.GGUFWriter. It then checks the files with Lever itself: the tokenizer gives the training ids
on held-out files, and the draft's teacher-forced agreement with the target is measured with
`lever.model.transformer.Model`. Torch is the `train` extra (`pip install -e ".[train]"`, or just
the CPU wheel: `pip install torch --index-url https://download.pytorch.org/whl/cpu`); Lever never imports
it. Runs are deterministic given --seed and --threads (stop conditions are step counts, not time).

    python examples/train_pair.py --out examples/models            # the shipped pair
    python examples/train_pair.py --tiny --out /tmp/pair            # a smoke run, seconds
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import re
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # before tokenizers starts its pool

import gguf
import numpy as np
import torch
import torch.nn.functional as F
from tokenizers import Regex, decoders, models, pre_tokenizers, trainers
from tokenizers import Tokenizer as HFTokenizer
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from eval_pair import (
    evaluate_pair,
    is_held_out,
    read_source,
    stdlib_files,
    window_logits,
)

from lever.backends.cpu import native
from lever.gguf.tokenizer import _PRE_TOKENIZERS
from lever.gguf.tokenizer import Tokenizer as LeverTokenizer
from lever.model.transformer import Model

# The pre-tokenizer the GGUF names. Its regex is taken from Lever rather than copied, so the
# training tokenizer cuts words exactly where Lever (and llama.cpp) will cut them at run time.
PRE = "qwen2"
EOT = "<|endoftext|>"
RMS_EPS = 1e-5
ROPE_BASE = 10000.0


@dataclass(frozen=True)
class Arch:
    n_embd: int
    n_layer: int
    n_head: int
    n_head_kv: int
    n_ff: int
    n_vocab: int
    n_ctx: int

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    def n_params(self) -> int:
        """Every weight, embeddings included (tied: the output head is the embedding)."""
        d, q, kv = self.n_embd, self.n_embd, self.n_head_kv * self.head_dim
        per_layer = d * (q + 2 * kv) + q * d + 3 * d * self.n_ff + 2 * d
        return self.n_vocab * d + self.n_layer * per_layer + d


# --- data -----------------------------------------------------------------------------------


def build_tokenizer() -> HFTokenizer:
    splits = [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in _PRE_TOKENIZERS[PRE].regexes]
    hf = HFTokenizer(models.BPE())
    # the same pre-tokenizer Lever's tokenizer.py builds for a gpt2-type vocab
    hf.pre_tokenizer = pre_tokenizers.Sequence(
        [*splits, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    hf.decoder = decoders.ByteLevel()
    return hf


def train_tokenizer(texts: list[str], vocab_size: int) -> HFTokenizer:
    hf = build_tokenizer()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=2, special_tokens=[EOT], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte encodable, seen or not
    )
    hf.train_from_iterator(texts, trainer=trainer, length=len(texts))
    return hf


def prompt_cuts(text: str, rng: np.random.Generator, p: float) -> list[str]:
    """`text` cut at a random fraction p of the places where a word follows whitespace.

    A prompt is tokenized on its own, so one that ends in whitespace ("def ", "x = ", a new
    line's indentation) ends in a whitespace token that whole-file tokenization never makes
    there: " name" is one token in a file, but "def " + "name" is "def", " ", "name". Trained
    only on whole files, the model reads that lone " " as what it always precedes in a file (a
    digit) and completes "def " with "1000...". Tokenizing a few pieces of each file separately
    shows it prompt boundaries as they come.
    """
    starts = np.array([m.start() for m in re.finditer(r"(?<=\s)(?=\S)", text)], np.int64)
    cuts = starts[rng.random(starts.size) < p].tolist()
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


def encode_stream(hf: HFTokenizer, texts: list[str], cut_rng: np.random.Generator | None = None,
                  cut_p: float = 0.0) -> np.ndarray:
    """All files as one stream, each after an end-of-text token (it doubles as BOS); with
    cut_rng, each file is tokenized in pieces (prompt_cuts)."""
    eot = hf.token_to_id(EOT)
    pieces = [prompt_cuts(t, cut_rng, cut_p) if cut_rng is not None else [t] for t in texts]
    encs = iter(hf.encode_batch([piece for ps in pieces for piece in ps], add_special_tokens=False))
    out: list[int] = []
    for ps in pieces:
        out.append(eot)
        for _ in ps:
            out += next(encs).ids
    return np.asarray(out, np.int32)


def tokenizer_metadata(hf: HFTokenizer) -> dict:
    vocab = hf.get_vocab()
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    assert [vocab[t] for t in tokens] == list(range(len(tokens))), "token ids are not dense"
    merges = json.loads(hf.to_str())["model"]["merges"]
    merges = [m if isinstance(m, str) else " ".join(m) for m in merges]
    types = [gguf.TokenType.CONTROL if t == EOT else gguf.TokenType.NORMAL for t in tokens]
    return {"tokens": tokens, "types": types, "merges": merges, "eot": vocab[EOT]}


def add_tokenizer(w: gguf.GGUFWriter, meta: dict) -> None:
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(PRE)
    w.add_token_list(meta["tokens"])
    w.add_token_types(meta["types"])
    w.add_token_merges(meta["merges"])
    w.add_bos_token_id(meta["eot"])
    w.add_eos_token_id(meta["eot"])
    # A prompt starts after an end-of-text token, as every file does in training: the model
    # then reads it as the start of a file.
    w.add_add_bos_token(True)


def check_lever_tokenizer(meta: dict, texts: list[str], want: list[list[int]]) -> int:
    """Lever's tokenizer, built from the GGUF metadata, must give the training ids."""
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "tok.gguf"
        w = gguf.GGUFWriter(str(path), "llama")
        add_tokenizer(w, meta)
        w.add_tensor("dummy", np.zeros(32, np.float32))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        tok = LeverTokenizer.from_gguf(path)
    n = 0
    for text, ids in zip(texts, want):
        got = tok.encode(text, add_bos=False)
        if got != ids:
            i = next((k for k, (a, b) in enumerate(zip(got, ids)) if a != b), min(len(got), len(ids)))
            raise SystemExit(f"Lever's tokenizer differs from the training tokenizer at token {i}: "
                             f"{got[i:i + 8]} vs {ids[i:i + 8]}")
        if tok.decode(got) != text:
            raise SystemExit("Lever's tokenizer does not round-trip a held-out file")
        n += len(ids)
    return n


# --- the model: Lever's forward pass in torch ------------------------------------------------


class RMSNorm(nn.Module):
    def __init__(self, n: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))

    def forward(self, x):
        x32 = x.float()  # the norm in float32 even under bf16 autocast, as Lever computes it
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + RMS_EPS)).to(x.dtype) * self.weight.to(x.dtype)


def rope_pairs(x, cos, sin):
    """llama's GGUF convention (Lever's rope_neox=False): rotate adjacent pairs (2i, 2i+1)."""
    a, b = x.float().unflatten(-1, (-1, 2)).unbind(-1)
    return torch.stack((a * cos - b * sin, a * sin + b * cos), -1).flatten(-2).to(x.dtype)


class Block(nn.Module):
    def __init__(self, a: Arch):
        super().__init__()
        hd = a.head_dim
        self.a = a
        self.attn_norm, self.ffn_norm = RMSNorm(a.n_embd), RMSNorm(a.n_embd)
        self.wq = nn.Linear(a.n_embd, a.n_head * hd, bias=False)
        self.wk = nn.Linear(a.n_embd, a.n_head_kv * hd, bias=False)
        self.wv = nn.Linear(a.n_embd, a.n_head_kv * hd, bias=False)
        self.wo = nn.Linear(a.n_head * hd, a.n_embd, bias=False)
        self.w_gate = nn.Linear(a.n_embd, a.n_ff, bias=False)
        self.w_up = nn.Linear(a.n_embd, a.n_ff, bias=False)
        self.w_down = nn.Linear(a.n_ff, a.n_embd, bias=False)

    def forward(self, x, cos, sin):
        B, T, _ = x.shape
        a = self.a
        h = self.attn_norm(x)
        q = self.wq(h).view(B, T, a.n_head, a.head_dim)
        k = self.wk(h).view(B, T, a.n_head_kv, a.head_dim)
        v = self.wv(h).view(B, T, a.n_head_kv, a.head_dim)
        q, k = rope_pairs(q, cos, sin), rope_pairs(k, cos, sin)
        # query head h reads kv head h // group, as Lever's attention does
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                           is_causal=True, enable_gqa=True)
        x = x + self.wo(o.transpose(1, 2).reshape(B, T, -1))
        h = self.ffn_norm(x)
        return x + self.w_down(F.silu(self.w_gate(h)) * self.w_up(h))


class Transformer(nn.Module):
    def __init__(self, a: Arch):
        super().__init__()
        self.a = a
        self.tok_embd = nn.Embedding(a.n_vocab, a.n_embd)
        self.layers = nn.ModuleList(Block(a) for _ in range(a.n_layer))
        self.output_norm = RMSNorm(a.n_embd)
        # Lever's ModelSpec.inv_freq: float64 powers rounded to float32; theta = pos * inv_freq
        # is then formed in float32, as ggml does.
        i = np.arange(0, a.head_dim, 2, dtype=np.float64)
        self.register_buffer("inv_freq", torch.from_numpy((1.0 / ROPE_BASE ** (i / a.head_dim)).astype(np.float32)),
                             persistent=False)

    def init_weights(self, gen: torch.Generator) -> None:
        for name, p in self.named_parameters():
            if p.dim() == 1:
                continue
            std = 0.02
            if name.endswith(("wo.weight", "w_down.weight")):
                std /= math.sqrt(2 * self.a.n_layer)  # residual writes shrink with depth (GPT-2)
            with torch.no_grad():
                p.normal_(0.0, std, generator=gen)

    def forward(self, idx):
        T = idx.shape[1]
        theta = torch.arange(T, dtype=torch.float32)[:, None] * self.inv_freq[None, :]
        cos, sin = theta.cos()[:, None, :], theta.sin()[:, None, :]  # (T, 1, hd/2): all heads
        x = self.tok_embd(idx)
        for blk in self.layers:
            x = blk(x, cos, sin)
        return F.linear(self.output_norm(x), self.tok_embd.weight)  # tied output head


# --- training --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Schedule:
    steps: int
    batch: int
    lr: float
    warmup: int
    min_lr_frac: float = 0.1
    weight_decay: float = 0.1

    def lr_at(self, step: int) -> float:
        if step < self.warmup:
            return self.lr * (step + 1) / self.warmup
        t = (step - self.warmup) / max(1, self.steps - self.warmup)
        return self.lr * (self.min_lr_frac + (1 - self.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * t)))


def val_windows(stream: np.ndarray, n_ctx: int, n: int) -> torch.Tensor:
    """Fixed, non-overlapping held-out windows of n_ctx + 1 tokens."""
    n = min(n, (stream.size - 1) // n_ctx)
    return torch.from_numpy(np.stack([stream[i * n_ctx : i * n_ctx + n_ctx + 1] for i in range(n)]).astype(np.int64))


@torch.no_grad()
def val_loss(model: Transformer, windows: torch.Tensor, batch: int) -> float:
    model.eval()
    total = 0.0
    for i in range(0, len(windows), batch):
        w = windows[i : i + batch]
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(w[:, :-1])
        total += F.cross_entropy(logits.float().flatten(0, 1), w[:, 1:].flatten(), reduction="sum").item()
    model.train()
    return total / windows[:, 1:].numel()


def optimizer(model: Transformer, sched: Schedule) -> torch.optim.AdamW:
    """AdamW, weight decay on the matrices only."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": sched.weight_decay},
                              {"params": no_decay, "weight_decay": 0.0}], lr=sched.lr, betas=(0.9, 0.95), eps=1e-8)


def train_step(model: Transformer, opt: torch.optim.AdamW, xy: torch.Tensor, lr: float) -> float:
    """One optimizer step on windows xy (batch, n_ctx + 1); the batch's loss."""
    for g in opt.param_groups:
        g["lr"] = lr
    # bf16 matmuls with float32 master weights: several times the float32 rate on CPUs with
    # AVX512-BF16, and still deterministic on one thread.
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(xy[:, :-1])
    loss = F.cross_entropy(logits.float().flatten(0, 1), xy[:, 1:].flatten())
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    return loss.item()


def train(name: str, a: Arch, sched: Schedule, stream: np.ndarray, val: torch.Tensor, seed: int,
          log_every: int, eval_every: int, partial: Path | None = None, key: dict | None = None,
          save_every: int = 100) -> tuple[Transformer, dict]:
    """Trains from scratch, or resumes from `partial` (saved every save_every steps when given,
    with the optimizer and sampler state: a resumed run ends with the very same weights)."""
    gen = torch.Generator().manual_seed(seed)
    model = Transformer(a)
    model.init_weights(gen)
    opt = optimizer(model, sched)
    rng = np.random.default_rng(seed)
    n_ctx = a.n_ctx
    print(f"[{name}] {a.n_params() / 1e6:.2f}M parameters, {asdict(a)}; {sched.steps} steps of "
          f"{sched.batch}x{n_ctx} tokens, lr {sched.lr} (warmup {sched.warmup}, cosine to {sched.min_lr_frac:g}x)",
          flush=True)
    t0, c0, seen, run_loss, run_n = time.perf_counter(), time.process_time(), 0, 0.0, 0
    history, first = [], 0
    if partial and partial.exists() and (state := torch.load(partial, weights_only=False))["key"] == key:
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        rng.bit_generator.state = state["rng"]
        first, history, seen = state["step"], state["history"], state["seen"]
        t0, c0 = t0 - state["seconds"], c0 - state["cpu_seconds"]
        print(f"[{name}] resumed from {partial} at step {first}", flush=True)
    for step in range(first, sched.steps):
        # Random windows over the whole stream (they may span a file boundary, marked by EOT).
        starts = rng.integers(0, stream.size - n_ctx - 1, sched.batch)
        xy = torch.from_numpy(np.stack([stream[s : s + n_ctx + 1] for s in starts]).astype(np.int64))
        run_loss += train_step(model, opt, xy, sched.lr_at(step))
        seen += xy[:, 1:].numel()
        run_n += 1
        last = step == sched.steps - 1
        if (step + 1) % log_every == 0 or last:
            dt = time.perf_counter() - t0
            line = (f"[{name}] step {step + 1}/{sched.steps} loss {run_loss / run_n:.4f} lr {sched.lr_at(step):.2e} "
                    f"{seen / dt:.0f} tok/s {dt / 60:.1f} min")
            rec = {"step": step + 1, "train_loss": run_loss / run_n, "minutes": dt / 60}
            if (step + 1) % eval_every == 0 or last:
                rec["val_loss"] = val_loss(model, val, sched.batch)
                line += f" val {rec['val_loss']:.4f}"
            print(line, flush=True)
            history.append(rec)
            run_loss, run_n = 0.0, 0
        if partial and (step + 1) % save_every == 0 and not last:
            tmp = partial.with_suffix(".tmp")
            torch.save({"key": key, "step": step + 1, "model": model.state_dict(), "opt": opt.state_dict(),
                        "rng": rng.bit_generator.state, "history": history, "seen": seen,
                        "seconds": time.perf_counter() - t0, "cpu_seconds": time.process_time() - c0}, tmp)
            tmp.replace(partial)  # a kill while saving leaves the previous partial state whole
    # wall time counts any pauses (SIGSTOP while benchmarks run); CPU time is the work itself
    return model, {"history": history, "seconds": time.perf_counter() - t0, "cpu_seconds": time.process_time() - c0,
                   "tokens_seen": seen}


# --- writing GGUF ----------------------------------------------------------------------------


def write_gguf(path: Path, model: Transformer, name: str, meta: dict, wtype: str, embd_type: str) -> None:
    """Matrices in `wtype`, the embedding (also the output head) in `embd_type`, norms in F32,
    under the names and metadata keys Lever (and llama.cpp) read for `llama`."""
    a = model.a
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name(name)
    w.add_description("code completion, trained on the Python standard library by examples/train_pair.py")
    w.add_block_count(a.n_layer)
    w.add_context_length(a.n_ctx)
    w.add_embedding_length(a.n_embd)
    w.add_feed_forward_length(a.n_ff)
    w.add_head_count(a.n_head)
    w.add_head_count_kv(a.n_head_kv)
    w.add_rope_dimension_count(a.head_dim)
    w.add_rope_freq_base(ROPE_BASE)
    w.add_layer_norm_rms_eps(RMS_EPS)
    w.add_vocab_size(a.n_vocab)
    w.add_file_type({"Q4_0": gguf.LlamaFileType.MOSTLY_Q4_0, "Q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
                     "F16": gguf.LlamaFileType.MOSTLY_F16, "F32": gguf.LlamaFileType.ALL_F32}[wtype])
    add_tokenizer(w, meta)

    def f32(t):
        return t.detach().float().numpy()

    def mat(tname, t, qtype):
        q = gguf.GGMLQuantizationType[qtype]
        data = f32(t)
        if qtype == "F32":
            w.add_tensor(tname, data)
        elif qtype == "F16":
            w.add_tensor(tname, data.astype(np.float16))
        else:
            w.add_tensor(tname, gguf.quants.quantize(data, q), raw_dtype=q)

    mat("token_embd.weight", model.tok_embd.weight, embd_type)
    w.add_tensor("output_norm.weight", f32(model.output_norm.weight))
    for i, blk in enumerate(model.layers):
        p = f"blk.{i}."
        w.add_tensor(p + "attn_norm.weight", f32(blk.attn_norm.weight))
        w.add_tensor(p + "ffn_norm.weight", f32(blk.ffn_norm.weight))
        for gname, lin in (("attn_q", blk.wq), ("attn_k", blk.wk), ("attn_v", blk.wv), ("attn_output", blk.wo),
                           ("ffn_gate", blk.w_gate), ("ffn_up", blk.w_up), ("ffn_down", blk.w_down)):
            mat(p + gname + ".weight", lin.weight, wtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def check_forward(model: Transformer, meta: dict, ids: np.ndarray) -> float:
    """Relative error of Lever's logits against this module's float32 forward, on an F32 copy
    of the model: proof that what was trained is what Lever computes (float16 KV cache and
    summation order aside, ~1e-4)."""
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "f32.gguf"
        write_gguf(path, model, "check", meta, "F32", "F32")
        got = window_logits(Model(path), ids)
    with torch.no_grad():
        want = model(torch.from_numpy(ids)[None])[0].numpy()
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


# --- main ------------------------------------------------------------------------------------


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "models")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (results depend on it)")
    ap.add_argument("--tiny", action="store_true", help="smoke run: few files, tiny models, a few steps")
    ap.add_argument("--max-files", type=int, default=0, help="train on the first N files only (0: all)")
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--cut-p", type=float, default=0.0,
                    help="fraction of word starts after whitespace where a file is tokenized in two (prompt_cuts); "
                         "the shipped pair was trained with 0, 0.1 is meant to fix prompts ending in whitespace")
    ap.add_argument("--ctx", type=int, default=512, help="training context (the GGUF's context_length)")
    ap.add_argument("--target", default="384,6,6,2,1024", help="n_embd,n_layer,n_head,n_head_kv,n_ff")
    ap.add_argument("--draft", default="128,3,4,2,384", help="n_embd,n_layer,n_head,n_head_kv,n_ff")
    ap.add_argument("--target-steps", type=int, default=1400)
    ap.add_argument("--draft-steps", type=int, default=1600)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--target-lr", type=float, default=2e-3)
    ap.add_argument("--draft-lr", type=float, default=3e-3)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--target-type", default="Q4_0", choices=["Q4_0", "Q8_0", "F16"])
    ap.add_argument("--draft-type", default="Q8_0", choices=["Q4_0", "Q8_0", "F16"])
    ap.add_argument("--log-every", type=int, default=50)
    ap.add_argument("--eval-every", type=int, default=200)
    ap.add_argument("--val-windows", type=int, default=64, help="held-out windows for the val loss")
    ap.add_argument("--checkpoints", type=Path, help="keep training state here: a killed run resumes where "
                    "it saved, a finished one is reused (to rewrite the GGUFs in another type)")
    ap.add_argument("--save-every", type=int, default=100, help="steps between resumable saves (with --checkpoints)")
    ap.add_argument("--agree-tokens", type=int, default=32768, help="held-out tokens for the Lever evaluation")
    args = ap.parse_args(argv)
    if args.tiny:
        args.max_files, args.vocab, args.ctx = args.max_files or 40, min(args.vocab, 512), min(args.ctx, 64)
        args.target, args.draft = "64,2,2,1,128", "32,1,1,1,64"
        args.target_steps, args.draft_steps, args.batch, args.warmup = 12, 12, 4, 2
        args.log_every, args.eval_every, args.val_windows, args.agree_tokens = 4, 12, 4, 512
    return args


def arch_of(spec: str, vocab: int, ctx: int) -> Arch:
    d, n_layer, n_head, n_kv, n_ff = (int(v) for v in spec.split(","))
    if d % n_head or n_head % n_kv or d % 32 or n_ff % 32:  # 32: the Q4_0/Q8_0 block
        raise SystemExit(f"bad model shape {spec}: n_embd and n_ff multiples of 32, heads dividing n_embd")
    return Arch(d, n_layer, n_head, n_kv, n_ff, vocab, ctx)


def corpus(args) -> tuple[list, list, list[str], list[str]]:
    """(train files, held-out files, their texts): this Python's standard library, split by file."""
    files = stdlib_files()
    if args.max_files:
        files = files[: args.max_files]
    train_files = [(r, p) for r, p in files if not is_held_out(r)]
    val_files = [(r, p) for r, p in files if is_held_out(r)]
    if args.tiny and not val_files:
        val_files = train_files[-2:]  # a 40-file prefix may hold none out; the smoke run still needs some
    train_texts = [read_source(p) for _, p in train_files]
    val_texts = [read_source(p) for _, p in val_files]
    print(f"corpus: {sys.version.split()[0]} stdlib, {len(train_files)} train files "
          f"({sum(map(len, train_texts)) / 1e6:.2f}M chars), {len(val_files)} held out "
          f"({sum(map(len, val_texts)) / 1e6:.2f}M chars)", flush=True)
    return train_files, val_files, train_texts, val_texts


def tokenize(args, train_texts: list[str], val_texts: list[str]) -> tuple[dict, np.ndarray, np.ndarray]:
    """(the tokenizer's GGUF metadata, the training stream, the held-out stream), Lever's
    tokenizer checked against the trained one on the held-out text."""
    t0 = time.perf_counter()
    hf = train_tokenizer(train_texts, args.vocab)
    meta = tokenizer_metadata(hf)
    # training data gets prompt boundaries; held-out text stays whole, as files are
    train_stream = encode_stream(hf, train_texts, np.random.default_rng(args.seed), args.cut_p)
    val_stream = encode_stream(hf, val_texts)
    val_ids = [e.ids for e in hf.encode_batch(val_texts, add_special_tokens=False)]
    n_checked = check_lever_tokenizer(meta, val_texts, val_ids)
    print(f"tokenizer: {len(meta['tokens'])} tokens, {len(meta['merges'])} merges, pre '{PRE}'; "
          f"{train_stream.size} train / {val_stream.size} held-out tokens; Lever's tokenizer gives the "
          f"same ids on all {n_checked} held-out tokens ({time.perf_counter() - t0:.0f} s)", flush=True)
    return meta, train_stream, val_stream


def train_both(args, ta: Arch, da: Arch, train_stream: np.ndarray, val: torch.Tensor) -> dict:
    """{"target": (model, info), "draft": (model, info)}, each from its checkpoint when one matches."""
    common = {"val": val, "log_every": args.log_every, "eval_every": args.eval_every}
    runs = {"target": (ta, Schedule(args.target_steps, args.batch, args.target_lr, args.warmup), args.seed),
            "draft": (da, Schedule(args.draft_steps, args.batch, args.draft_lr, args.warmup), args.seed + 1)}
    trained = {}
    if args.checkpoints:
        args.checkpoints.mkdir(parents=True, exist_ok=True)
    for name, (arch, sched, seed) in runs.items():
        ckpt = args.checkpoints / f"{name}.pt" if args.checkpoints else None
        key = {"arch": asdict(arch), "schedule": asdict(sched), "seed": seed, "threads": args.threads,
               "stream": hashlib.sha256(train_stream.tobytes()).hexdigest()}
        if ckpt and ckpt.exists() and (saved := torch.load(ckpt, weights_only=False))["key"] == key:
            model = Transformer(arch)
            model.load_state_dict(saved["state"])
            trained[name] = model, saved["info"]
            print(f"[{name}] loaded from {ckpt}", flush=True)
            continue
        partial = ckpt.with_suffix(".partial.pt") if ckpt else None
        trained[name] = model, info = train(name, arch, sched, train_stream, seed=seed, partial=partial, key=key,
                                            save_every=args.save_every, **common)
        if ckpt:
            torch.save({"key": key, "state": model.state_dict(), "info": info}, ckpt)
            partial.unlink(missing_ok=True)
    return trained


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    native.n_threads_default = args.threads
    torch.manual_seed(args.seed)
    t_start = time.perf_counter()
    args.out.mkdir(parents=True, exist_ok=True)
    train_files, val_files, train_texts, val_texts = corpus(args)
    meta, train_stream, val_stream = tokenize(args, train_texts, val_texts)
    n_vocab = len(meta["tokens"])
    ta, da = arch_of(args.target, n_vocab, args.ctx), arch_of(args.draft, n_vocab, args.ctx)
    if ta.n_params() < 8 * da.n_params():
        print(f"warning: target/draft parameter ratio {ta.n_params() / da.n_params():.1f} is under 8", flush=True)
    trained = train_both(args, ta, da, train_stream, val_windows(val_stream, args.ctx, args.val_windows))
    (target, t_info), (draft, d_info) = trained["target"], trained["draft"]

    t_path = args.out / f"stdlib-target-{args.target_type.lower()}.gguf"
    d_path = args.out / f"stdlib-draft-{args.draft_type.lower()}.gguf"
    write_gguf(t_path, target, "stdlib-target", meta, args.target_type,
               "Q8_0" if args.target_type == "Q4_0" else args.target_type)
    write_gguf(d_path, draft, "stdlib-draft", meta, args.draft_type, args.draft_type)

    window = val_stream[: args.ctx].astype(np.int64)
    for name, m in (("target", target), ("draft", draft)):
        rel = check_forward(m, meta, window)
        print(f"{name}: Lever's forward (F32 copy) vs torch float32, relative error {rel:.2e}", flush=True)
        if rel > 1e-2:
            raise SystemExit(f"{name}: Lever's forward does not match the trained model's")

    # The files as Lever runs them: quantized weights, Lever's kernels and tokenizer.
    t_model, d_model = Model(t_path), Model(d_path)
    ids = val_stream[: args.agree_tokens].astype(np.int64)
    lever_eval = evaluate_pair(t_model, d_model, ids)
    total = time.perf_counter() - t_start
    summary = {
        "python": sys.version.split()[0], "args": {k: str(v) for k, v in vars(args).items()},
        "files": {"train": len(train_files), "held_out": len(val_files)},
        "tokens": {"vocab": n_vocab, "train": int(train_stream.size), "held_out": int(val_stream.size)},
        "target": {"arch": asdict(ta), "params": ta.n_params(), "path": t_path.name,
                   "final_val_loss_torch": t_info["history"][-1].get("val_loss"), **t_info},
        "draft": {"arch": asdict(da), "params": da.n_params(), "path": d_path.name,
                  "final_val_loss_torch": d_info["history"][-1].get("val_loss"), **d_info},
        "lever_eval": lever_eval, "total_seconds": total, "total_cpu_seconds": time.process_time(),
    }
    print(f"Lever on {lever_eval['tokens']} held-out tokens: target loss {lever_eval['target_loss']:.4f}, "
          f"draft loss {lever_eval['draft_loss']:.4f}, agreement {lever_eval['agreement']:.3f}", flush=True)
    print(f"wrote {t_path} ({t_path.stat().st_size / 1e6:.2f} MB), {d_path} ({d_path.stat().st_size / 1e6:.2f} MB) "
          f"in {total / 60:.1f} min ({time.process_time() / 60:.1f} CPU min)", flush=True)
    (args.out / "train_log.json").write_text(json.dumps(summary, indent=1))
    return summary


if __name__ == "__main__":
    main()
