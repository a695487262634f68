"""Packing a token stream into training rows of S+1 tokens (inputs: the first S, labels: the
last S).

- ``concat``: windows of the documents joined one after another (EOS between them where
  ``data.add_eos``), anywhere in the stream: ``windows(stream, starts, S)``.
- ``documents``: whole documents (a document longer than a row is split into row-sized
  pieces) placed in rows one after another, a row closed with padding when the next piece does
  not fit (``plan_rows`` / ``document_row``). Each row carries ``segment_ids`` (1, 2, ... per
  piece, 0 = padding) and ``segment_pos`` (the position inside the piece); Praxis's
  TransformerLm turns them into a causal attention mask that never crosses a piece and into
  the rotary positions, and a label is weighted only where it continues its input's piece.

Every row also carries ``label_bytes``: the UTF-8 bytes of text each weighted label covers (the
denominator of bits per byte; host-side, never sent to the devices).
"""

from __future__ import annotations

import dataclasses

import numpy as np


def windows(tokens: np.ndarray, token_bytes: np.ndarray, starts: np.ndarray, seq_len: int) -> dict:
    """The rows ``tokens[start : start + S + 1]`` for each start."""
    idx = np.asarray(starts, np.int64)[:, None] + np.arange(seq_len + 1)[None, :]
    win = np.asarray(tokens[idx]).astype(np.int32)  # [B, S+1]
    return {
        "ids": win[:, :-1],
        "labels": win[:, 1:],
        "weights": np.ones((len(starts), seq_len), np.float32),
        "label_bytes": np.asarray(token_bytes[idx[:, 1:]]).astype(np.int64),
    }


@dataclasses.dataclass
class RowPlan:
    """Rows of pieces: row r holds pieces ``row_ptr[r]:row_ptr[r + 1]``; piece p is the
    tokens ``piece_start[p] : piece_start[p] + piece_len[p]`` of the stream."""

    row_ptr: np.ndarray
    piece_start: np.ndarray
    piece_len: np.ndarray

    @property
    def num_rows(self) -> int:
        return len(self.row_ptr) - 1


def plan_rows(doc_starts: np.ndarray, row_len: int) -> RowPlan:
    """Packs the documents ``doc_starts[i] : doc_starts[i + 1]`` (in order) into rows of
    ``row_len`` tokens, next-fit."""
    starts, lens, row_ptr = [], [], [0]
    free = row_len
    for a, b in zip(doc_starts[:-1].tolist(), doc_starts[1:].tolist()):
        while a < b:
            n = min(b - a, row_len)
            if n > free:
                row_ptr.append(len(starts))
                free = row_len
            starts.append(a)
            lens.append(n)
            free -= n
            a += n
    if free < row_len:
        row_ptr.append(len(starts))
    return RowPlan(np.asarray(row_ptr, np.int64), np.asarray(starts, np.int64),
                   np.asarray(lens, np.int64))


def document_row(plan: RowPlan, r: int, tokens: np.ndarray, token_bytes: np.ndarray,
                 seq_len: int) -> dict:
    """Row ``r`` of ``plan`` as model inputs (one example, no batch dimension)."""
    n = seq_len + 1
    buf = np.zeros(n, np.int32)
    nb = np.zeros(n, np.int64)
    seg = np.zeros(n, np.int32)
    pos = np.zeros(n, np.int32)
    at = 0
    for k, p in enumerate(range(plan.row_ptr[r], plan.row_ptr[r + 1]), 1):
        s, length = int(plan.piece_start[p]), int(plan.piece_len[p])
        buf[at:at + length] = tokens[s:s + length]
        nb[at:at + length] = token_bytes[s:s + length]
        seg[at:at + length] = k
        pos[at:at + length] = np.arange(length)
        at += length
    weights = ((seg[1:] == seg[:-1]) & (seg[:-1] > 0)).astype(np.float32)
    return {
        "ids": buf[:-1],
        "labels": buf[1:],
        "weights": weights,
        "segment_ids": seg[:-1],
        "segment_pos": pos[:-1],
        "label_bytes": nb[1:] * (weights > 0),
    }


def stack_rows(rows: list[dict]) -> dict:
    return {k: np.stack([r[k] for r in rows]) for k in rows[0]}
