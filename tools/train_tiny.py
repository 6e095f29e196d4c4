"""Train radixkv-tiny's shipped weights from scratch on the CPU, reproducibly.

Corpus: the Python standard library's own source (code, docstrings, comments, and the
documentation prose of ``pydoc_data/topics.py``) of the *running* interpreter, PSF license
(https://docs.python.org/3/license.html; derived works such as weights trained on it may be
distributed). Test suites, ``site-packages``, the codec tables of ``encodings/`` and the generated
``_sysconfigdata*`` are left out. Files are read in sorted path order; every 40th file (by that
order) is held out for validation. A SHA-256 of the exact corpus bytes is printed and stored with
the weights, so a rerun can tell whether it trained on the same text (CPython 3.11.7 here).

Model: the radixkv-tiny shape of radixkv/model/tiny.py (byte vocabulary, 2 layers, hidden 512,
SwiGLU 3072, one 64-dim head), run through the same ``LlamaForCausalLM`` the engine serves, with a
plain causal attention in place of the paged backend. Each file is ``<|bos|> bytes <|eos|>``.

Reproducible: ``torch.manual_seed``, a fixed number of steps, a data order drawn from its own
seeded generator (random 512-byte windows of the training stream), and a fixed intra-op thread
count (2 by default, recorded). The model never sees a position past 512: prompt plus output
beyond ~500 tokens gives garbage. (A run on 2,048-byte windows, 2 per step, learned much more
slowly at the same compute: held-out 2.16 nats/byte after 640 steps against 1.60.) Compute is bf16 autocast with fp32 master weights (about 4x faster than
fp32 on a CPU with AVX512-BF16); the weights are stored as fp16 and served in fp32.

Usage (the shipped weights: 36 minutes on a 2-core machine shared with other jobs):
    python tools/train_tiny.py                      # writes radixkv/model/weights/
    python tools/train_tiny.py --stop-after 20 --out /tmp/tiny   # same run, cut short: compare the log
    python tools/train_tiny.py --out /tmp/tiny      # elsewhere
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import platform
import sys
import sysconfig
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from radixkv.model.llama import LlamaForCausalLM  # noqa: E402
from radixkv.model.tiny import (  # noqa: E402
    TINY_WEIGHTS,
    build_tiny_random_model,
    tiny_config,
)

BOS, EOS = 256, 257
EXCLUDED_DIRS = {"test", "tests", "idle_test", "site-packages", "encodings", "__pycache__"}
VAL_EVERY = 40  # every 40th file (sorted order) is held out


def corpus_files(stdlib: Path) -> list[Path]:
    """The corpus: sorted ``*.py`` paths under the stdlib, minus tests, codecs, generated files."""
    out = []
    for p in stdlib.rglob("*.py"):
        rel = p.relative_to(stdlib)
        if EXCLUDED_DIRS.intersection(rel.parts[:-1]) or rel.name.startswith("_sysconfigdata"):
            continue
        if not p.is_file():
            continue
        out.append(rel)
    return sorted(out, key=lambda r: r.as_posix())


def build_corpus(stdlib: Path) -> dict[str, Any]:
    files = corpus_files(stdlib)
    train: list[int] = []
    val: list[int] = []
    digest = hashlib.sha256()
    n_bytes = [0, 0]
    names = [[], []]
    for i, rel in enumerate(files):
        raw = (stdlib / rel).read_bytes().replace(b"\r\n", b"\n")
        try:
            raw.decode("utf-8")
        except UnicodeDecodeError:
            continue  # none in CPython 3.11; keeps the corpus valid UTF-8 if some ever is
        digest.update(rel.as_posix().encode() + b"\0" + raw + b"\0")
        split = 1 if i % VAL_EVERY == VAL_EVERY // 2 else 0
        (val if split else train).extend([BOS, *raw, EOS])
        n_bytes[split] += len(raw)
        names[split].append(rel.as_posix())
    return {
        "train": torch.tensor(train, dtype=torch.int16),
        "val": torch.tensor(val, dtype=torch.int16),
        "sha256": digest.hexdigest(),
        "train_files": len(names[0]),
        "val_files": len(names[1]),
        "train_bytes": n_bytes[0],
        "val_bytes": n_bytes[1],
        "val_names": names[1],
    }


class CausalBatch:
    """Attention backend for training: ``B`` sequences of ``L`` tokens laid end to end."""

    def __init__(self, batch: int, length: int) -> None:
        self.b, self.l = batch, length

    def forward(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        b, n = self.b, self.l
        q, k, v = (t.view(b, n, t.shape[1], t.shape[2]).transpose(1, 2) for t in (q, k, v))
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return o.transpose(1, 2).reshape(b * n, o.shape[1], o.shape[3])


def loss_of(model: LlamaForCausalLM, x: torch.Tensor, bf16: bool) -> torch.Tensor:  # x: [B, L+1]
    b, n = x.shape[0], x.shape[1] - 1
    pos = torch.arange(n).repeat(b)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        logits = model(x[:, :-1].reshape(-1), pos, CausalBatch(b, n), max_position=n - 1)
    return F.cross_entropy(logits.float(), x[:, 1:].reshape(-1))


def val_windows(val: torch.Tensor, length: int, count: int) -> torch.Tensor:
    """``count`` evenly spaced windows of ``length + 1`` tokens of the validation stream."""
    span = val.numel() - length - 1
    starts = [round(i * span / max(count - 1, 1)) for i in range(count)]
    return torch.stack([val[s : s + length + 1] for s in starts]).long()


@torch.no_grad()
def evaluate(model: LlamaForCausalLM, windows: torch.Tensor, bf16: bool, chunk: int = 8) -> float:
    """Mean cross-entropy (nats per byte) over ``windows``."""
    model.eval()
    total = 0.0
    for i in range(0, windows.shape[0], chunk):
        part = windows[i : i + chunk]
        total += float(loss_of(model, part, bf16)) * part.shape[0]
    model.train()
    return total / windows.shape[0]


def init_weights(model: LlamaForCausalLM, num_layers: int) -> None:
    """GPT-2 style: N(0, 0.02), residual-output projections scaled by 1/sqrt(2 * layers)."""
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith(("o_proj.weight", "down_proj.weight")):
                p.normal_(0.0, 0.02 / math.sqrt(2 * num_layers))
            else:
                p.normal_(0.0, 0.02)


def lr_at(step: int, args: argparse.Namespace) -> float:
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    t = (step - args.warmup) / max(args.steps - args.warmup, 1)
    return args.lr * (args.min_lr_frac + (1 - args.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * t)))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--stop-after", type=int, default=None, help="end early, same schedule")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--min-lr-frac", type=float, default=0.1)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--eval-every", type=int, default=250)
    ap.add_argument("--eval-windows", type=int, default=64)
    ap.add_argument("--fp32", action="store_true", help="fp32 compute (slow; default bf16)")
    ap.add_argument("--stdlib", type=Path, default=Path(sysconfig.get_paths()["stdlib"]))
    ap.add_argument("--out", type=Path, default=TINY_WEIGHTS.parent)
    ap.add_argument("--log-every", type=int, default=10)
    args = ap.parse_args(argv)
    if args.stop_after is not None and args.out == TINY_WEIGHTS.parent:
        ap.error("--stop-after writes a partly trained model: give --out (not the package folder)")

    from tqdm import tqdm

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    bf16 = not args.fp32
    if sys.version_info[:2] != (3, 11):
        print(f"note: the shipped weights were trained on CPython 3.11's stdlib, not {sys.version}")

    t0 = time.perf_counter()
    corpus = build_corpus(args.stdlib)
    print(
        f"corpus {args.stdlib}: {corpus['train_files']} train files ({corpus['train_bytes']:,} B), "
        f"{corpus['val_files']} held out ({corpus['val_bytes']:,} B), sha256 {corpus['sha256']}"
        f" [{time.perf_counter() - t0:.1f}s]"
    )
    train, val = corpus["train"], corpus["val"]
    windows = val_windows(val, args.seq_len, args.eval_windows)

    cfg = tiny_config()
    model = LlamaForCausalLM(cfg, device="cpu", dtype=torch.float32)
    init_weights(model, cfg.num_layers)
    model.train()
    decay = [p for n, p in model.named_parameters() if p.ndim == 2 and "embed" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.ndim == 2 and "embed" not in n)]
    opt = torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": args.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=args.lr,
        betas=(0.9, 0.95),
        eps=1e-8,
    )
    data_gen = torch.Generator().manual_seed(args.seed + 1)  # data order, independent of the model
    tokens_per_step = args.batch * args.seq_len
    last = args.steps if args.stop_after is None else min(args.stop_after, args.steps)
    print(
        f"model: {sum(p.numel() for p in model.parameters()):,} parameters; "
        f"{args.steps} steps x {args.batch} x {args.seq_len} = "
        f"{args.steps * tokens_per_step:,} tokens ({args.steps * tokens_per_step / train.numel():.2f}"
        f" epochs); threads {args.threads}; {'bf16 autocast' if bf16 else 'fp32'}; seed {args.seed}"
    )
    log: list[dict[str, Any]] = []
    bar = tqdm(range(last), desc="train", unit="step", mininterval=5, file=sys.stdout)
    t_train = time.perf_counter()
    ema = None
    for step in bar:
        starts = torch.randint(
            0, train.numel() - args.seq_len - 1, (args.batch,), generator=data_gen
        )
        x = torch.stack([train[s : s + args.seq_len + 1] for s in starts.tolist()]).long()
        for g in opt.param_groups:
            g["lr"] = lr_at(step, args)
        loss = loss_of(model, x, bf16)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gnorm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0))
        opt.step()
        lv = float(loss.detach())
        ema = lv if ema is None else 0.98 * ema + 0.02 * lv
        elapsed = time.perf_counter() - t_train
        tps = (step + 1) * tokens_per_step / elapsed
        bar.set_postfix(loss=f"{lv:.4f}", tok_s=f"{tps:.0f}")
        entry: dict[str, Any] = {"step": step + 1, "loss": lv}
        if (step + 1) % args.log_every == 0 or step == 0:
            print(
                f"step {step + 1:5d}  loss {lv:.4f}  (ema {ema:.4f})  lr {lr_at(step, args):.2e}"
                f"  gnorm {gnorm:.2f}  {tps:,.0f} tok/s  {elapsed / 60:.1f} min",
                flush=True,
            )
        if (step + 1) % args.eval_every == 0 or step + 1 == last:
            vl = evaluate(model, windows, bf16)
            entry["val_loss"] = vl
            print(
                f"step {step + 1:5d}  held-out {vl:.4f} nats/byte = {vl / math.log(2):.4f} bits/byte",
                flush=True,
            )
        log.append(entry)
    train_s = time.perf_counter() - t_train

    # What ships: fp16 storage, fp32 compute. Evaluate exactly that, in fp32, against the random model.
    state = {k: v.detach().to(torch.float16).contiguous() for k, v in model.state_dict().items()}
    served = LlamaForCausalLM(cfg, device="cpu", dtype=torch.float32)
    served.load_state_dict({k: v.float() for k, v in state.items()})
    val_fp32 = evaluate(served, windows, bf16=False)
    val_random = evaluate(build_tiny_random_model(), windows, bf16=False)
    summary = {
        "corpus": {
            "source": "CPython standard library *.py (tests, site-packages, encodings/, "
            "_sysconfigdata* excluded), PSF license",
            "python": platform.python_version(),
            "stdlib": str(args.stdlib),
            "sha256": corpus["sha256"],
            "train_files": corpus["train_files"],
            "train_bytes": corpus["train_bytes"],
            "val_files": corpus["val_files"],
            "val_bytes": corpus["val_bytes"],
            "val_every": VAL_EVERY,
        },
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "steps_run": last,
        "tokens_seen": last * tokens_per_step,
        "train_seconds": round(train_s, 1),
        "tokens_per_second": round(last * tokens_per_step / train_s, 1),
        "torch": torch.__version__,
        "machine": platform.machine(),
        "held_out": {
            "windows": args.eval_windows,
            "seq_len": args.seq_len,
            "trained_nats_per_byte": val_fp32,
            "trained_bits_per_byte": val_fp32 / math.log(2),
            "random_nats_per_byte": val_random,
            "random_bits_per_byte": val_random / math.log(2),
        },
        "loss_at": {
            str(e["step"]): e["loss"]
            for e in log
            if e["step"] in (1, 10, 20, 50, 100, last) or e["step"] % 250 == 0
        },
    }
    print(json.dumps(summary["held_out"], indent=1))
    print(
        f"trained {last} steps in {train_s / 60:.1f} min ({summary['tokens_per_second']:,.0f} tok/s)"
    )
    args.out.mkdir(parents=True, exist_ok=True)
    from safetensors.torch import save_file

    weights = args.out / TINY_WEIGHTS.name
    save_file(state, str(weights), metadata={"radixkv": json.dumps(summary)})
    weights.with_suffix(".json").write_text(json.dumps(summary, indent=1) + "\n")
    print(
        f"wrote {weights} ({weights.stat().st_size / 1e6:.1f} MB) and {weights.with_suffix('.json')}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
