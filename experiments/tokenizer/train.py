r"""Training a tokenizer on the documents a run reads (``experiments.tokenizer.documents``):

  python -m experiments.tokenizer --data corpus/ --vocab_size 8000 --kind bpe \
      --out corpus.tokenizer.json
  python -m experiments.tokenizer --data corpus/ --vocab_size 8000 --kind sentencepiece \
      --out corpus.model

Both kinds are lossless: ``decode(encode(text)) == text`` for every document.

- ``bpe``: byte-level BPE (``tokenizers``) with the special tokens ``<pad> <unk> <s> </s>``.
- ``sentencepiece``: a unigram model with byte fallback, pad 0, unk 1, BOS 2, EOS 3, trained on
  whole documents (cut at line ends into chunks of at most ``SP_CHUNK`` characters, newlines
  kept: SentencePiece's trainer takes "sentences") with the identity normalization, no dummy
  prefix, extra whitespace kept, pieces of spaces only allowed, and newline and tab as pieces of
  their own. SentencePiece's defaults (the nmt_nfkc normalization, whitespace runs folded)
  would erase newlines, tabs and repeated spaces. ``input_sentence_size`` chunks at most are
  sampled at random from a larger corpus (SentencePiece's memory grows with the text it keeps).

Reading shows a progress bar of the documents' bytes, files and documents (stderr); the
result is one line of JSON on stdout. Bad input is one line on stderr, exit status 2, and
nothing is written.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import sys
from pathlib import Path

import sentencepiece as spm
import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers
from tqdm import tqdm

from experiments.tokenizer import documents
from experiments.tokenizer import Tokenizer, TokenizerError, load_tokenizer

KINDS = ("sentencepiece", "bpe")
# special tokens of the BPE tokenizers trained here
BPE_SPECIALS = ("<pad>", "<unk>", "<s>", "</s>")
SP_CHUNK = 4096  # characters of a document SentencePiece's trainer takes as one "sentence"
INPUT_SENTENCE_SIZE = 20_000  # chunks SentencePiece trains on at most (0: all)
# SentencePiece's options of a lossless unigram model (the module docstring)
SP_OPTIONS = dict(model_type="unigram",
                  byte_fallback=True,
                  character_coverage=0.9995,
                  pad_id=0,
                  unk_id=1,
                  bos_id=2,
                  eos_id=3,
                  normalization_rule_name="identity",
                  remove_extra_whitespaces=False,
                  add_dummy_prefix=False,
                  allow_whitespace_only_pieces=True,
                  user_defined_symbols=["\n", "\t"],
                  max_sentence_length=4 * SP_CHUNK,
                  minloglevel=2)


def chunks(texts, size: int = SP_CHUNK):
    """Each document cut after a newline into pieces of at most ``size`` characters (a line
    longer than that is cut inside); the pieces of a document join back to it."""
    for t in texts:
        at = 0
        while at < len(t):
            end = at + size
            if end < len(t):
                nl = t.rfind("\n", at, end)
                end = nl + 1 if nl >= at else end
            yield t[at:end]
            at = end


def check_settings(kind: str, vocab_size: int, input_sentence_size: int) -> None:
    """Raises TokenizerError (one line) for a setting out of range."""
    if kind not in KINDS:
        raise TokenizerError(f"--kind={kind!r} is invalid: one of {', '.join(KINDS)}")
    if vocab_size < 260:
        raise TokenizerError(f"--vocab_size={vocab_size} is invalid: at least 260 (the 256 "
                             "bytes and the special tokens)")
    if not isinstance(input_sentence_size, int) or not (input_sentence_size == 0
                                                        or input_sentence_size > 100):
        raise TokenizerError(f"--input_sentence_size={input_sentence_size!r} is invalid: 0 "
                             "(every chunk) or an int > 100 (SentencePiece's least)")


def train_tokenizer(texts,
                    kind: str,
                    vocab_size: int,
                    out,
                    *,
                    input_sentence_size: int = INPUT_SENTENCE_SIZE,
                    progress: bool = False) -> Tokenizer:
    """Trains a ``kind`` tokenizer (the module docstring) of ``vocab_size`` on the iterable of
    documents ``texts`` and writes it to ``out`` (atomically). Raises TokenizerError (one line)."""
    out = Path(out)
    check_settings(kind, vocab_size, input_sentence_size)
    if kind == "bpe":
        tok = tokenizers.Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=vocab_size,
                                      special_tokens=list(BPE_SPECIALS),
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                      show_progress=progress)
        tok.train_from_iterator(texts, trainer=trainer)
        data = tok.to_str().encode("utf-8")
    else:
        model = io.BytesIO()
        try:
            spm.SentencePieceTrainer.Train(sentence_iterator=chunks(texts),
                                           model_writer=model,
                                           vocab_size=vocab_size,
                                           input_sentence_size=input_sentence_size,
                                           shuffle_input_sentence=True,
                                           num_threads=os.cpu_count() or 1,
                                           **SP_OPTIONS)
        except RuntimeError as e:
            raise TokenizerError(f"SentencePiece training failed: "
                                 f"{' '.join(str(e).split())[:200]}") from e
        data = model.getvalue()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, out)
    return load_tokenizer(str(out))


class _Reading:
    """The documents of ``files``, counted (files, documents, bytes) as they are read, with a
    tqdm bar of their bytes on stderr."""

    def __init__(self, files, text_field: str, show: bool):
        self.files, self.text_field = files, text_field
        self.read = {"files": 0, "documents": 0, "bytes": 0}
        self.bar = tqdm(total=sum(os.stat(f).st_size for f in files),
                        unit="B",
                        unit_scale=True,
                        desc="reading documents",
                        file=sys.stderr,
                        delay=1.0,
                        dynamic_ncols=True,
                        disable=not show)

    def __iter__(self):
        for f in self.files:
            for doc in documents.read_documents(f, self.text_field):
                self.read["documents"] += 1
                self.read["bytes"] += len(doc.encode("utf-8"))
                yield doc
            self.read["files"] += 1
            self.bar.update(os.stat(f).st_size)
            self.bar.set_postfix(files=self.read["files"],
                                 documents=f"{self.read['documents']:,}",
                                 refresh=False)
        self.bar.close()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m experiments.tokenizer",
                                 description="Train a tokenizer on the documents of --data.")
    ap.add_argument("--data", required=True, help="a file, directory or glob (as data.path)")
    ap.add_argument("--vocab_size", type=int, required=True)
    ap.add_argument("--kind", choices=KINDS, required=True)
    ap.add_argument("--out", required=True, help="the tokenizer file to write")
    ap.add_argument("--text_field", default="text", help="the field of .jsonl / .parquet")
    ap.add_argument("--input_sentence_size",
                    type=int,
                    default=INPUT_SENTENCE_SIZE,
                    help=f"sentencepiece: train on at most this many chunks (of at most "
                    f"{SP_CHUNK} characters of a document) drawn at random; 0 = all")
    ap.add_argument("--no_progress", action="store_true", help="draw no progress bar")
    args = ap.parse_args(argv)
    try:
        check_settings(args.kind, args.vocab_size, args.input_sentence_size)
        files, _ = documents.find_files(args.data)
        reading = _Reading(files, args.text_field, not args.no_progress)
        print(
            f"experiments.tokenizer: training a {args.kind} tokenizer of "
            f"{args.vocab_size} ids on the documents of {len(files)} files",
            file=sys.stderr,
            flush=True)
        tok = train_tokenizer(reading,
                              args.kind,
                              args.vocab_size,
                              args.out,
                              input_sentence_size=args.input_sentence_size,
                              progress=not args.no_progress)
    except (TokenizerError, documents.DocumentError) as e:
        print(f"experiments.tokenizer: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    print(
        json.dumps({
            "out": str(tok.path),
            "kind": args.kind,
            "vocab_size": tok.vocab_size,
            "bos_id": tok.bos_id,
            "eos_id": tok.eos_id,
            "sha256": tok.sha256,
            **reading.read
        }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
